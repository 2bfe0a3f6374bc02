"""The GPU path when the device runs out of memory (a training run may leave little free):
saves and loads still complete, bit-exact, with a warning. Allocations are refused for real, by
a per-process cap on torch's allocator, or one at a time, by a stand-in for the path's own
device allocations. The logic without a GPU: tests/weights/test_gpu_fallback.py. Skipped
without CUDA."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4weights  # noqa: E402
from s4weights import chain  # noqa: E402
from s4weights.gpu import runtime  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(5)
    out = {}
    for k in range(3):  # 16 MiB each: coded whole at 64 MiB, in chunks below
        out[f"big{k}"] = torch.randn(4 << 20, device="cuda", generator=g) * 0.02
    for k in range(18):
        x = torch.randn(1 << 19, device="cuda", generator=g) * 0.02
        out[f"w{k}"] = x.to((torch.bfloat16, torch.float16, torch.float32)[k % 3])
    out["step"] = torch.tensor(7, device="cuda")
    return out


@contextlib.contextmanager
def _capped(free: int):
    """torch's allocator on this device refuses to reserve more than ``free`` bytes beyond what
    it holds now (its cache emptied first), and the free space inside the segments it still
    holds (earlier tests' live blocks keep them) is taken by filler blocks first: else a
    workspace may fit there whatever the cap."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
    filler = []
    # the large pool's blocks (over 1 MiB) first, then the small pool's (1 MiB and under)
    for size in (64 * MIB, 8 * MIB, 2 * MIB, MIB + 512, MIB, 64 << 10, 4 << 10, 512):
        while True:
            try:
                filler.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.cuda.OutOfMemoryError:
                break
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + free) / total)
    try:
        yield
    finally:
        del filler
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _same(got: dict, state: dict) -> None:
    for k, v in state.items():
        assert got[k].device == v.device, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                           v.reshape(-1).view(torch.uint8)), k


def _refuse(monkeypatch, k: int) -> list[int]:
    """The GPU path's own device allocations (``runtime.device_empty``), the (k+1)-th refused
    as out of memory; returns the count of calls so far (one item)."""
    calls = [0]
    real = runtime.device_empty

    def refusing(nbytes: int):
        calls[0] += 1
        if calls[0] == k + 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's refusal)")
        return real(nbytes)

    monkeypatch.setattr(runtime, "device_empty", refusing)
    return calls


@pytest.mark.parametrize("free", [8 * MIB, 0])
def test_save_and_load_complete_when_device_memory_runs_out(free: int, caplog) -> None:
    state = _state()
    into = {k: torch.empty_like(v) for k, v in state.items()}
    torch.cuda.synchronize()
    with caplog.at_level(logging.WARNING, logger="s4weights"), _capped(free):
        buf = io.BytesIO()
        s4weights.save(state, buf, device="cuda", workspace=64 * MIB)
        saved = caplog.text
        caplog.clear()
        got = s4weights.load(buf.getvalue(), device="cuda", into=into, workspace=64 * MIB)
        loaded = caplog.text
    assert "ran out of memory coding" in saved
    assert "ran out of memory decoding" in loaded
    if not free:
        assert "the CPU codes it" in saved and "the CPU decodes it" in loaded
    _same(got, state)
    assert all(got[k] is into[k] for k in state)
    _same(s4weights.load(buf.getvalue(), map_location="cuda", device="cpu"), state)


@pytest.mark.parametrize("k", [0, 1, 2, 4, 7, 11])
def test_one_refused_allocation_anywhere_in_a_save(k: int, monkeypatch, caplog) -> None:
    state = _state()
    calls = _refuse(monkeypatch, k)
    buf = io.BytesIO()
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        s4weights.save(state, buf, device="cuda", workspace=32 * MIB)
    assert calls[0] > k and "ran out of memory coding" in caplog.text
    monkeypatch.undo()
    _same(s4weights.load(buf.getvalue(), device="cuda"), state)


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_one_refused_allocation_anywhere_in_a_load(k: int, monkeypatch, caplog) -> None:
    state = _state()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda", workspace=32 * MIB)
    calls = _refuse(monkeypatch, k)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = s4weights.load(buf.getvalue(), device="cuda", workspace=32 * MIB)
    assert calls[0] > k and "ran out of memory decoding" in caplog.text
    _same(got, state)


def test_a_checkpoint_chain_survives_a_full_device(tmp_path, caplog) -> None:
    chain._PARENT_CACHE.clear()
    state = _state()
    root = tmp_path / "run"
    try:
        s4weights.save_checkpoint(state, root, 0, device="cuda")
        for v in state.values():
            if v.is_floating_point():
                v.add_(torch.randn_like(v) * 1e-4)
        with caplog.at_level(logging.WARNING, logger="s4weights"), _capped(0):
            info = s4weights.save_checkpoint(state, root, 1, device="cuda")
        assert not info.is_base and "ran out of memory coding" in caplog.text
        chain._PARENT_CACHE.clear()
        _same(s4weights.load_checkpoint(root, device="cuda"), state)
    finally:
        chain._PARENT_CACHE.clear()
