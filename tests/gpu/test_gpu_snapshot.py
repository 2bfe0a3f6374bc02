"""save_checkpoint's host snapshots of CUDA tensors: page-locked at their exact size (not
torch's power of two), copied into asynchronously, unregistered when the last view goes; one
buffer per device for a run (each save overwrites the snapshot it replaces once the file is
coded), and a buffer kept aside never reused while something still reads it. These runs make
each delta against the latest checkpoint, whose snapshot is the next parent; deltas against
the base (the default) take none, and hold the base. Skipped without CUDA."""

from __future__ import annotations

import logging

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4weights  # noqa: E402
from s4weights import chain, hostmem  # noqa: E402
from tests.weights.common import save_on_latest  # noqa: E402

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
    monkeypatch.setattr(hostmem, "_unregister",
                        lambda ptr, dev: (gone.append(ptr), real(ptr, dev)))
    n = 5 * MIB + 3
    buf = hostmem.page_locked(n, torch.cuda.current_device())
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


def _train(state: dict[str, torch.Tensor]) -> None:
    state["master"].add_(torch.randn_like(state["master"]) * 1e-4)
    state["w"].copy_(state["master"])
    state["m"].lerp_(state["master"], 0.1)
    state["step"] += 1


def _snapshot_buffers(state: dict[str, torch.Tensor], root, steps: int, device: str):
    """Train ``state`` a step and save it as checkpoint 0, 1, ... ``steps - 1`` (``device``);
    after each save, the address of the snapshot buffer the process keeps for the state's
    device (checked page-locked, at the state's size)."""
    dev = state["w"].device
    url = root.resolve().as_uri()
    for step in range(steps):
        _train(state)
        save_on_latest(state, root, step, device=device)
        buf = chain._PARENT_CACHE[url][3][dev]
        assert hostmem.is_page_locked(buf) and buf.size == _raw(state)
        yield buf.ctypes.data
        del buf


def _same(got: dict, want: dict) -> None:
    for k, v in want.items():
        assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8),
                           v.cpu().reshape(-1).view(torch.uint8)), k


def test_a_run_holds_one_exact_snapshot_buffer(tmp_path) -> None:
    # each save copies the state into the buffer of the snapshot it replaces, once the file
    # is coded (the parent is no longer read): one buffer per device, of the state's size
    state = _state()
    url = (tmp_path / "run").resolve().as_uri()
    ptrs, saved = [], []
    for ptr in _snapshot_buffers(state, tmp_path / "run", 5, "cuda"):
        ptrs.append(ptr)
        saved.append({k: v.cpu().clone() for k, v in state.items()})
    assert ptrs == ptrs[:1] * 5
    for k, v in chain._PARENT_CACHE[url][1].items():  # the snapshot holds the last state
        assert v.data.tobytes() == state[k].cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    for step in (4, 2):
        chain._PARENT_CACHE.clear()
        _same(s4weights.load_checkpoint(tmp_path / "run", step, map_location="cpu"),
              saved[step])


def test_a_state_of_another_size_takes_a_new_buffer(tmp_path) -> None:
    state = _state()
    dev = state["w"].device
    url = (tmp_path / "run").resolve().as_uri()
    save_on_latest(state, tmp_path / "run", 0, device="cuda")
    first = chain._PARENT_CACHE[url][3][dev].ctypes.data
    state["extra"] = torch.randn(1 << 20, device="cuda")  # 4 MiB more: over the slack
    _train(state)
    save_on_latest(state, tmp_path / "run", 1, device="cuda")
    buf = chain._PARENT_CACHE[url][3][dev]
    assert buf.ctypes.data != first and buf.size == _raw(state)
    del buf
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(tmp_path / "run", 1, map_location="cpu"), state)


def _recovers(state: dict[str, torch.Tensor], root) -> None:
    """After a save of step 1 failed once its snapshot had begun: no parent cached, no step 1,
    and step 1 saved again is a delta (its parent read from the store) that loads exactly."""
    assert root.resolve().as_uri() not in chain._PARENT_CACHE
    assert [i.step for i in s4weights.list_checkpoints(root)] == [0]
    _train(state)
    info = save_on_latest(state, root, 1, device="cuda")
    assert not info.is_base
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(root, 1, map_location="cpu"), state)


def test_a_failed_save_after_the_snapshot_began_drops_the_parent(tmp_path, monkeypatch) -> None:
    # the replaced snapshot's buffer is overwritten once the file is coded: a save failing
    # then leaves no checkpoint and no half-overwritten parent; the next save reads the store
    state = _state()
    save_on_latest(state, tmp_path / "run", 0, device="cuda")
    _train(state)
    real = chain._wait

    def failing(events, quiet=False):
        real(events, quiet)
        if not quiet:
            raise RuntimeError("a device error (a test's)")

    monkeypatch.setattr(chain, "_wait", failing)
    with pytest.raises(RuntimeError, match="a test's"):
        save_on_latest(state, tmp_path / "run", 1, device="cuda")
    monkeypatch.setattr(chain, "_wait", real)
    _recovers(state, tmp_path / "run")


def test_a_kept_buffer_still_read_is_not_overwritten(tmp_path) -> None:
    # a parent dropped from the cache (retention, a failed save) keeps its buffer for a later
    # snapshot, but not while a view of it is alive
    state = _state()
    dev = state["w"].device
    url = (tmp_path / "run").resolve().as_uri()
    save_on_latest(state, tmp_path / "run", 0, device="cuda")
    held = chain._PARENT_CACHE[url][1]["master"].data  # a view of save 0's snapshot
    before = held.copy()
    first = chain._PARENT_CACHE[url][3][dev].ctypes.data
    chain._cache(url, None)
    state["master"].add_(1.0)
    save_on_latest(state, tmp_path / "run", 1, device="cuda")
    assert chain._PARENT_CACHE[url][3][dev].ctypes.data != first
    assert (held == before).all()
    del held
    chain._cache(url, None)  # now nothing refers to save 1's: the next save takes it
    second = hostmem._KEPT[dev].ctypes.data
    state["master"].add_(1.0)
    save_on_latest(state, tmp_path / "run", 2, device="cuda")
    assert chain._PARENT_CACHE[url][3][dev].ctypes.data == second
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(tmp_path / "run", 2, map_location="cpu"), state)


def test_a_snapshot_the_host_cannot_lock_goes_to_pageable_memory(tmp_path, monkeypatch,
                                                                  caplog) -> None:
    # some hosts refuse to lock a few GiB: the copies then wait for the device, the saves go on
    def refused(ptr, size, flags):
        raise cupy.cuda.runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", refused)
    state = _state()
    url = (tmp_path / "run").resolve().as_uri()
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        for step in range(3):
            state["master"].add_(1e-3)
            info = save_on_latest(state, tmp_path / "run", step, device="cuda")
            buf = chain._PARENT_CACHE[url][3][state["w"].device]
            assert not hostmem.is_page_locked(buf) and buf.size == _raw(state)
            del buf
    assert not info.is_base and "using pageable memory" in caplog.text
    chain._PARENT_CACHE.clear()
    got = s4weights.load_checkpoint(tmp_path / "run", 2, map_location="cpu")
    for k, v in state.items():
        assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                           v.cpu().reshape(-1).view(torch.uint8)), k


def test_a_refused_registration_leaves_no_cuda_error_behind(caplog) -> None:
    # CUDA refuses to register memory twice: the save would go on in pageable memory, and the
    # caller's next kernel launch (torch checks CUDA's last error there) must not fail
    dev = torch.cuda.current_device()
    arr = hostmem.populated(MIB).result()
    assert hostmem.lock(arr, dev)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        assert not hostmem.lock(arr, dev)
    assert "could not be page-locked" in caplog.text and "pageable" in caplog.text
    x = torch.ones(1024, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    assert float(x.sum()) == 2048.0


def test_a_manifest_that_fails_after_the_snapshot_drops_the_parent(tmp_path,
                                                                  monkeypatch) -> None:
    # the file is coded and the parent's buffer already holds the new state when the manifest
    # write fails (a full disk, S3): the save fails and the parent is not reused as it is
    from s4weights.store.local import LocalStore

    state = _state()
    save_on_latest(state, tmp_path / "run", 0, device="cuda")
    _train(state)
    real = LocalStore.put_atomic

    def full(self, name, data, **kw):
        if name.startswith("manifests/"):
            raise OSError(28, "No space left on device (a test's)")
        return real(self, name, data, **kw)

    monkeypatch.setattr(LocalStore, "put_atomic", full)
    with pytest.raises(OSError, match="a test's"):
        save_on_latest(state, tmp_path / "run", 1, device="cuda")
    monkeypatch.setattr(LocalStore, "put_atomic", real)
    _recovers(state, tmp_path / "run")


def test_saves_coded_on_the_cpu_alternate_between_two_buffers(tmp_path) -> None:
    # device="cpu": the CPU codes from the snapshot while the parent is read, so the snapshot
    # cannot go into the parent's buffer; the one before it is reused
    state = _state()
    ptrs = list(_snapshot_buffers(state, tmp_path / "run", 4, "cpu"))
    assert ptrs[0] != ptrs[1] and ptrs[2:] == ptrs[:2]
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(tmp_path / "run", 3, map_location="cpu"), state)


def test_a_restarted_process_reads_its_parent_on_the_gpu(tmp_path, monkeypatch) -> None:
    # nothing cached (a restart): the parent's chain is decoded on the GPU within the
    # workspace into one page-locked buffer, byte for byte what the CPU reads, and the
    # snapshot then takes that buffer over
    from s4weights.store import open_store

    state = _state()
    state["ids"] = torch.arange(1000, device="cuda")  # int64: read on the CPU
    state["big"] = torch.randn(6 << 20, device="cuda") * 0.02  # 24 MiB: over half of 32
    from s4weights.gpu import decode_large
    root = tmp_path / "run"
    url = root.resolve().as_uri()
    for step in range(3):
        _train(state)
        save_on_latest(state, root, step, device="cuda", workspace=32 * MIB)
    chain._PARENT_CACHE.clear()
    hostmem.forget()
    store = open_store(root)
    infos = chain.by_step(chain.list_checkpoints(store))
    chunked_to_host = []
    real_large = decode_large.load_large

    def large(reader, i, out, ws, on_host=False):
        chunked_to_host.append((reader.tensors[i].name, on_host, out.device.type, ws))
        return real_large(reader, i, out, ws, on_host)

    monkeypatch.setattr(decode_large, "load_large", large)
    on_gpu, hashes, buf, _whole = chain._parent_tensors(store, infos[2], infos, "cuda", 32 * MIB)
    # tensors that need more than the workspace with their bytes ("big": 24 MiB, two deltas
    # deep) are decoded in chunks within it, each copied down as it is made
    assert ("big", True, "cpu", 32 * MIB) in chunked_to_host
    assert all(c[1:] == (True, "cpu", 32 * MIB) for c in chunked_to_host), chunked_to_host
    on_cpu, hashes_cpu, none, _whole = chain._parent_tensors(store, infos[2], infos, "cpu")
    assert none is None and hashes == hashes_cpu and set(on_gpu) == set(on_cpu)
    assert buf is not None and hostmem.is_page_locked(buf)
    for k, v in on_cpu.items():
        assert np.asarray(v.data).tobytes() == np.asarray(on_gpu[k].data).tobytes(), k
    del on_gpu, on_cpu, buf
    read = []
    real = chain._read_on_gpu

    def spy(*a):
        got = real(*a)
        read.append(got[1].ctypes.data)  # the parent's buffer
        return got

    monkeypatch.setattr(chain, "_read_on_gpu", spy)
    _train(state)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    info = save_on_latest(state, root, 3, device="cuda", workspace=32 * MIB)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 32 * MIB + 4 * MIB, extra / MIB
    assert not info.is_base and len(read) == 1
    assert chain._PARENT_CACHE[url][3][state["w"].device].ctypes.data == read[0]  # taken over
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(root, 3, map_location="cpu"), state)


def test_a_parent_read_that_runs_out_of_gpu_memory_is_read_on_the_cpu(tmp_path, monkeypatch,
                                                                      caplog) -> None:
    state = _state()
    root = tmp_path / "run"
    save_on_latest(state, root, 0, device="cuda")
    chain._PARENT_CACHE.clear()

    def full(*a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")

    monkeypatch.setattr(chain, "_read_on_gpu", full)
    _train(state)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        info = save_on_latest(state, root, 1, device="cuda")
    assert not info.is_base and "read on the CPU instead" in caplog.text
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(root, 1, map_location="cpu"), state)


def test_a_resumed_run_saves_its_first_delta_without_reading_the_chain(tmp_path,
                                                                       monkeypatch) -> None:
    # load_checkpoint(resume=True) on the GPU copies each tensor down as it decodes, into one
    # page-locked buffer of the checkpoint's size that the next save's snapshot takes over;
    # that save reads nothing back, and the load holds no more GPU memory than without it
    root = tmp_path / "run"
    url = root.resolve().as_uri()
    state = _state()
    for step in range(3):
        _train(state)
        save_on_latest(state, root, step, device="cuda")
    chain._PARENT_CACHE.clear()
    hostmem.forget()
    del state
    peaks = []
    for resume in (False, True):
        chain._PARENT_CACHE.clear()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        state = s4weights.load_checkpoint(root, resume=resume, device="cuda")
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] <= peaks[0] + MIB, peaks
    dev = state["w"].device
    buf = chain._PARENT_CACHE[url][3][dev]
    assert hostmem.is_page_locked(buf) and buf.size == _raw(state)
    kept = buf.ctypes.data
    del buf

    def no_read(*a, **k):
        raise AssertionError("the chain was read back")

    monkeypatch.setattr(chain, "_read_on_gpu", no_read)
    real_open = chain.open_chain
    monkeypatch.setattr(chain, "open_chain", lambda store, ch, verify, device="auto": (
        no_read() if verify else real_open(store, ch, verify, device)))
    _train(state)  # in place: the copy is the file's bytes, not these
    want = {k: v.cpu().clone() for k, v in state.items()}
    info = save_on_latest(state, root, 3, device="cuda")
    assert not info.is_base and info.parent_step == 2
    assert chain._PARENT_CACHE[url][3][dev].ctypes.data == kept  # taken over
    monkeypatch.undo()
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(root, 3, map_location="cpu"), want)


@pytest.mark.parametrize("case", ["a view of the other", "one tensor twice"])
def test_into_destinations_sharing_storage_load_and_resume_exactly(tmp_path, case) -> None:
    # into= destinations sharing a storage are decoded apart and copied in, in tree order:
    # decoded in place ahead of their turn, the earlier one's copy landed on the later (the
    # resume copy then differed from the file), or both decoded into one (a false hash error)
    import s4format

    n = 1 << 16
    g = torch.Generator(device="cuda").manual_seed(9)
    a = torch.randn(2 * n if case == "a view of the other" else n, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g)
    root = tmp_path / "run"
    save_on_latest({"b": b, "a": a}, root, 0, device="cuda")
    chain._PARENT_CACHE.clear()
    x = torch.zeros_like(a)
    into = {"b": x[::2], "a": x} if case == "a view of the other" else {"b": x, "a": x}
    got = s4weights.load_checkpoint(root, device="cuda", into=into, resume=True)
    assert got["a"] is x and torch.equal(x, a)  # the later in tree order lands last
    entry = chain._PARENT_CACHE[root.resolve().as_uri()]
    r = s4format.Reader(str(root / chain.by_step(chain.list_checkpoints(root))[0].file))
    try:
        for i, t in enumerate(r.tensors):
            assert np.asarray(entry[1][t.name].data).tobytes() == r.read_raw(i).tobytes()
    finally:
        r.close()
    x.add_(1.0)
    save_on_latest({"b": b, "a": x}, root, 1, device="cuda")
    chain._PARENT_CACHE.clear()
    _same(s4weights.load_checkpoint(root, 1, map_location="cpu"), {"b": b, "a": x})


def test_deltas_against_the_base_hold_the_base(tmp_path) -> None:
    # a delta against the base takes no snapshot: the parent held stays the base, its bytes
    # untouched; a fresh process reads the base on the GPU into a page-locked buffer it holds
    state = _state()
    dev = state["w"].device
    root = tmp_path / "run"
    url = root.resolve().as_uri()
    saved = []

    def save(step: int):
        _train(state)
        info = s4weights.save_checkpoint(state, root, step, device="cuda", read_budget=None,
                                         min_delta_gain=0)
        saved.append({k: v.cpu().clone() for k, v in state.items()})
        assert info.parent_step == (None if step == 0 else 0)
        held = chain._PARENT_CACHE[url]
        assert held[0] == s4weights.list_checkpoints(root)[0].checkpoint_id
        assert hostmem.is_page_locked(held[3][dev])
        for k, v in held[1].items():
            want = saved[0][k].reshape(-1).view(torch.uint8).numpy()
            assert np.asarray(v.data).reshape(-1).view(np.uint8).tobytes() == want.tobytes(), k

    for step in range(3):
        save(step)
    chain._PARENT_CACHE.clear()  # a restarted process
    save(3)
    save(4)
    for step, want in enumerate(saved):
        chain._PARENT_CACHE.clear()
        _same(s4weights.load_checkpoint(root, step, map_location="cpu"), want)


def test_deltas_against_the_base_coded_on_the_cpu_reuse_one_buffer(tmp_path) -> None:
    # CUDA tensors coded on the CPU are copied to the host at each save; with deltas against
    # the base that copy is not the next parent, and its buffer is kept for the next save's
    state = _state()
    dev = state["w"].device
    root = tmp_path / "run"
    kept, saved = [], []
    for step in range(5):
        _train(state)
        info = s4weights.save_checkpoint(state, root, step, device="cpu", read_budget=None,
                                         min_delta_gain=0)
        saved.append({k: v.cpu().clone() for k, v in state.items()})
        assert info.parent_step == (None if step == 0 else 0)
        if step:
            buf = hostmem._KEPT[dev]
            assert hostmem.is_page_locked(buf) and buf.size == _raw(state)
            kept.append(buf.ctypes.data)
            del buf
    assert len(set(kept[1:])) == 1, kept  # (the second delta's buffer, taken and kept again)
    for step, want in enumerate(saved):
        chain._PARENT_CACHE.clear()
        _same(s4weights.load_checkpoint(root, step, map_location="cpu"), want)
