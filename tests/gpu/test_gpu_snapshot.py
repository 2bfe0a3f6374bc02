"""save_checkpoint's host snapshots of CUDA tensors: page-locked at their exact size (not
torch's power of two), copied into asynchronously, unregistered when the last view goes, and
the buffer of the snapshot before last reused by the next save, never while something still
reads it. Skipped without CUDA."""

from __future__ import annotations

import logging

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4weights  # noqa: E402
from s4weights import chain, hostmem  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _clean():
    chain._PARENT_CACHE.clear()
    hostmem.forget()
    yield
    chain._PARENT_CACHE.clear()
    hostmem.forget()


def test_page_locked_memory_of_the_exact_size_copies_and_is_unregistered(monkeypatch) -> None:
    gone = []
    real = hostmem._unregister
    monkeypatch.setattr(hostmem, "_unregister", lambda ptr: (gone.append(ptr), real(ptr)))
    n = 5 * MIB + 3
    buf = hostmem.page_locked(n)
    assert buf is not None and buf.size == n and hostmem.is_page_locked(buf)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    host = torch.from_numpy(buf)
    assert host.is_pinned()
    torch.cuda.synchronize()
    host.copy_(src, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host, src.cpu())
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    assert torch.equal(back, src)
    ptr = buf.ctypes.data
    view = buf[MIB:2 * MIB]
    del buf, host
    assert gone == [] and torch.from_numpy(view).is_pinned()  # still viewed: still locked
    del view
    assert gone == [ptr]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(3 << 20, device="cuda", generator=g) * 0.02
    return {"w": w.bfloat16(), "master": w.clone(), "m": torch.zeros_like(w),
            "step": torch.tensor(0.0, device="cuda")}


def _raw(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_snapshots_are_exact_and_alternate_between_two_buffers(tmp_path) -> None:
    state = _state()
    dev = state["w"].device
    url = (tmp_path / "run").resolve().as_uri()
    ptrs, saved = [], []
    for step in range(5):
        state["master"].add_(torch.randn_like(state["master"]) * 1e-4)
        state["w"].copy_(state["master"])
        state["m"].lerp_(state["master"], 0.1)
        state["step"] += 1
        s4weights.save_checkpoint(state, tmp_path / "run", step, device="cuda")
        buf = chain._PARENT_CACHE[url][3][dev]
        assert hostmem.is_page_locked(buf) and buf.size == _raw(state)
        ptrs.append(buf.ctypes.data)
        del buf
        saved.append({k: v.cpu().clone() for k, v in state.items()})
    # the first two saves make one buffer each (the second while the first is the parent);
    # then each save reuses the one of the save before last
    assert ptrs[0] != ptrs[1] and ptrs[2:] == [ptrs[0], ptrs[1], ptrs[0]]
    for step in (4, 2):
        chain._PARENT_CACHE.clear()
        got = s4weights.load_checkpoint(tmp_path / "run", step, map_location="cpu")
        for k, v in saved[step].items():
            assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                               v.reshape(-1).view(torch.uint8)), (step, k)


def test_a_snapshot_still_read_is_not_overwritten(tmp_path) -> None:
    state = _state()
    dev = state["w"].device
    url = (tmp_path / "run").resolve().as_uri()
    s4weights.save_checkpoint(state, tmp_path / "run", 0, device="cuda")
    held = chain._PARENT_CACHE[url][1]["master"].data  # a view of save 0's snapshot
    before = held.copy()
    first = chain._PARENT_CACHE[url][3][dev].ctypes.data
    for step in (1, 2):
        state["master"].add_(1.0)
        s4weights.save_checkpoint(state, tmp_path / "run", step, device="cuda")
    # save 2 would have reused save 0's buffer, but a view of it is alive: a new buffer
    assert chain._PARENT_CACHE[url][3][dev].ctypes.data != first
    assert (held == before).all()
    got = s4weights.load_checkpoint(tmp_path / "run", 2, map_location="cpu")
    assert torch.equal(got["master"], state["master"].cpu())


def test_a_snapshot_the_host_cannot_lock_goes_to_pageable_memory(tmp_path, monkeypatch,
                                                                  caplog) -> None:
    # some hosts refuse to lock a few GiB: the copies then wait for the device, the saves go on
    monkeypatch.setattr(hostmem, "lock", lambda arr: False)
    state = _state()
    url = (tmp_path / "run").resolve().as_uri()
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        for step in range(3):
            state["master"].add_(1e-3)
            info = s4weights.save_checkpoint(state, tmp_path / "run", step, device="cuda")
            assert chain._PARENT_CACHE[url][3] == {}  # nothing locked, nothing kept
    assert not info.is_base and "using pageable memory" in caplog.text
    chain._PARENT_CACHE.clear()
    got = s4weights.load_checkpoint(tmp_path / "run", 2, map_location="cpu")
    for k, v in state.items():
        assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                           v.cpu().reshape(-1).view(torch.uint8)), k
