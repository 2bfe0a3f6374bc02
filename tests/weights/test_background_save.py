"""Saves with blocking=False: they return once the state is copied, the caller may change it at
once, errors surface on result(), and saves to one destination run in order."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest
import torch

import s4weights
from s4format.errors import StorageError
from s4weights import background_save, chain
from tests.weights.common import assert_same


def _state(v: float) -> dict:
    w = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    w[:64] += v
    return {"w": w, "v": v, "nested": {"b": torch.full((3,), v)}}


def test_the_caller_may_change_the_state_right_after(tmp_path: Path) -> None:
    state = _state(1.0)
    want = {"w": state["w"].clone(), "v": 1.0, "nested": {"b": state["nested"]["b"].clone()}}
    future = s4weights.save_checkpoint(state, tmp_path, step=1, blocking=False)
    state["w"].add_(100.0)  # the next training step, at once
    state["nested"]["b"].zero_()
    info = future.result(timeout=120)
    assert info.step == 1 and info.is_base
    assert_same(s4weights.load_checkpoint(tmp_path), want)


@pytest.mark.parametrize("against", ["base", "latest"])
def test_saves_to_one_store_run_in_order_and_deltas_still_chain(tmp_path: Path,
                                                                against: str) -> None:
    futures = [s4weights.save_checkpoint(_state(float(s)), tmp_path, step=s, blocking=False,
                                         delta_against=against) for s in range(4)]
    infos = [f.result(timeout=120) for f in futures]
    assert [i.step for i in infos] == [0, 1, 2, 3]
    assert [i.parent_step for i in infos] == ([None, 0, 0, 0] if against == "base"
                                              else [None, 0, 1, 2])
    # a blocking save waits for the ones before it
    s4weights.save_checkpoint(_state(4.0), tmp_path, step=4, blocking=False,
                              delta_against=against)
    assert s4weights.save_checkpoint(_state(5.0), tmp_path, step=5, delta_against=against
                                     ).parent_step == (0 if against == "base" else 4)
    for s in range(6):
        assert_same(s4weights.load_checkpoint(tmp_path, step=s), _state(float(s)))


def test_errors_surface_on_result(tmp_path: Path) -> None:
    s4weights.save_checkpoint(_state(0.0), tmp_path, step=3)
    future = s4weights.save_checkpoint(_state(1.0), tmp_path, step=3, blocking=False)
    with pytest.raises(StorageError, match="step 3 already exists"):
        future.result(timeout=120)
    # the next save is not held up by the failed one
    assert s4weights.save_checkpoint(_state(2.0), tmp_path, step=4, blocking=False) \
        .result(timeout=120).step == 4


def test_save_returns_before_the_coding(tmp_path: Path, monkeypatch) -> None:
    gate = threading.Event()
    real = chain._save

    def slow(*args, **kw):
        assert gate.wait(60)
        return real(*args, **kw)
    monkeypatch.setattr(chain, "_save", slow)
    t0 = time.perf_counter()
    future = s4weights.save_checkpoint(_state(1.0), tmp_path, step=1, blocking=False)
    assert time.perf_counter() - t0 < 5 and not future.done()
    gate.set()
    assert future.result(timeout=120).step == 1


def test_async_save_to_a_path_and_a_file_object(tmp_path: Path) -> None:
    state = _state(2.0)
    want = _state(2.0)
    path_future = s4weights.save(state, tmp_path / "a.s4w", blocking=False)
    buf = io.BytesIO()
    buf_future = s4weights.save(state, buf, blocking=False)
    state["w"].zero_()
    assert path_future.result(timeout=120).tensor_count == 2
    buf_future.result(timeout=120)
    assert_same(s4weights.load(tmp_path / "a.s4w"), want)
    assert_same(s4weights.load(buf.getvalue()), want)


def test_distributed_saves_refuse_blocking_false(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="distributed=True saves block"):
        s4weights.save_checkpoint(_state(1.0), tmp_path, step=1, distributed=True,
                                  blocking=False)
    assert not background_save._TAILS
