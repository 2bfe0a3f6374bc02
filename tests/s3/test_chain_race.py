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


def test_a_step_deleted_after_its_file_is_opened_says_so(aws_env, bucket, monkeypatch) -> None:
    # the source's HEAD finds the file and the header's GET, just after, does not: the failed
    # read names the deletion, not damage to a listed step
    import torch

    import s4weights
    from s4format.errors import StorageError
    from s4weights.store.s3 import S3Store

    url = f"s3://{bucket}/opened"
    s4weights.save_checkpoint({"w": torch.arange(10.0)}, url, step=1)
    real = S3Store.source

    def source(self, name):
        opened = real(self, name)
        s4weights.retain(url, [])
        return opened
    monkeypatch.setattr(S3Store, "source", source)
    with pytest.raises(StorageError, match=r"step 1 was deleted from .* while step 1 was being "
                       r"read .*load one that is kept"):
        s4weights.load_checkpoint(url, step=1)
