"""s4weights.open: key paths built once per tensor and bounded in all (hostile trees), and the
tensors inside Python containers (Namespace, deque, ...) listed."""

from __future__ import annotations

import tracemalloc

import pytest

import s4weights
from s4format.errors import LimitError
from s4weights import lazy
from tests.format import hostile


def test_deep_long_keys_cost_one_path() -> None:
    # 128 levels of 16 KiB keys: a 2 MB file whose one tensor has an 8 MB key path (as a bytes
    # repr); building the path at every level would hold 128^2/2 x 16 KiB x 4 = 512 MB
    data = hostile.long_keys(128, 16 << 10)
    tracemalloc.start()
    try:
        with s4weights.open(data) as f:
            (key,) = f.keys()
            assert f.get_tensor(key).numel() == 16
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(key) > 128 * (16 << 10)
    assert peak < 8 * len(key), peak


def test_key_paths_over_the_bound_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(lazy, "MAX_KEY_CHARS", 1 << 20)
    with pytest.raises(LimitError, match="key paths of its tensors exceed 1048576 characters"):
        s4weights.open(hostile.long_keys(128, 16 << 10))


def test_tensors_inside_python_containers_are_listed() -> None:
    import argparse
    import collections
    import io

    import torch

    buf = io.BytesIO()
    state = {"args": argparse.Namespace(w=torch.ones(2)),
             "hist": collections.deque([torch.zeros(3)], maxlen=4)}
    s4weights.save(state, buf)
    with s4weights.open(buf.getvalue()) as f:
        assert sorted(f.keys()) == ["args.w", "hist.0"]
        assert torch.equal(f.get_tensor("hist.0"), torch.zeros(3))
