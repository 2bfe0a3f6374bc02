"""Racing writers on SeaweedFS: every step a writer is told is saved loads, or was deleted since
by the other writer's retention (tests/weights/test_chain_race.py has the local cases)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.weights.test_chain_race import check_race, race


def test_two_writers_race_on_s3(aws_env, bucket) -> None:
    check_race(race(f"s3://{bucket}/race", trials=1, count=15))


def test_a_prefix_with_an_empty_segment_is_refused(aws_env, bucket) -> None:
    import s4weights

    with pytest.raises(ValueError, match="empty path segment"):
        s4weights.save_checkpoint({"a": 1}, f"s3://{bucket}/runs//one", step=1)
