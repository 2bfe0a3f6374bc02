"""s4weights.hostmem and save_checkpoint's use of it: snapshot buffers kept aside are handed
out again only when they fit and nothing refers to them; populated mappings; without CuPy
nothing is page-locked (the GPU side, registration and copies, is in
tests/gpu/test_gpu_snapshot.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from s4weights import chain, hostmem, manifests

KEY = "dev"


@pytest.fixture(autouse=True)
def _clean():
    hostmem.forget()
    yield
    hostmem.forget()


def _kept(n: int = 1000) -> int:
    """Keep a new buffer of ``n`` bytes that nothing else refers to; its address."""
    buf = np.zeros(n, np.uint8)
    hostmem.keep(KEY, buf)
    return buf.ctypes.data


def test_a_kept_buffer_is_handed_out_once_for_a_size_it_fits() -> None:
    at = _kept()
    assert hostmem.take("other", 1000) is None
    got = hostmem.take(KEY, 900)  # 100 bytes to spare: within 1/8
    assert got is not None and got.ctypes.data == at and got.size == 1000
    assert hostmem.take(KEY, 900) is None  # taken: not handed out twice


@pytest.mark.parametrize("nbytes", [1001, 800, 0])
def test_a_kept_buffer_that_does_not_fit_is_let_go(nbytes: int) -> None:
    _kept()
    assert hostmem.take(KEY, nbytes) is None
    assert hostmem.take(KEY, 1000) is None  # let go, not kept for a later fit


def test_a_kept_buffer_still_viewed_is_not_handed_out() -> None:
    # a snapshot's tensors are views of its buffer: while one lives (a caller still reading a
    # parent), the buffer must not be overwritten by the next snapshot
    buf = np.zeros(1000, np.uint8)
    view = buf[10:20]
    hostmem.keep(KEY, buf)
    del buf
    assert hostmem.take(KEY, 1000) is None
    del view


def test_a_view_through_torch_counts_too() -> None:
    buf = np.zeros(1000, np.uint8)
    t = torch.from_numpy(buf[:100])
    hostmem.keep(KEY, buf)
    del buf
    assert hostmem.take(KEY, 1000) is None
    del t


def test_keep_replaces_and_forget_drops() -> None:
    _kept()
    at = _kept()
    got = hostmem.take(KEY, 1000)
    assert got is not None and got.ctypes.data == at
    hostmem.keep(KEY, got)
    del got
    hostmem.forget()
    assert hostmem.take(KEY, 1000) is None


def test_nothing_is_page_locked_without_cupy() -> None:
    # the GPU path's dependency: without it the snapshot's copies go through pageable memory
    pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is here: tests/gpu/test_gpu_snapshot.py")
    except ImportError:
        pass
    assert hostmem.page_locked(1 << 20, 0) is None
    assert not hostmem.is_page_locked(np.zeros(10, np.uint8))


def test_a_dropped_parent_keeps_its_buffers_for_the_next_snapshot() -> None:
    # save_checkpoint's cache: a parent dropped (by retention, or a save failing once it had
    # begun overwriting it) leaves its page-locked buffers to the next save's snapshot, one per
    # device; a parent a save replaces lets them go (a run holds one snapshot per device)
    url = "file:///nowhere"
    dev = torch.device("cuda", 0)
    try:
        chain._cache(url, ("a", {}, {}, {dev: np.full(1000, 1, np.uint8)}))
        chain._cache(url, ("b", {}, {}, {}))
        assert chain._PARENT_CACHE[url][0] == "b" and not hostmem._KEPT
        chain._cache(url, ("c", {}, {}, {dev: np.full(1000, 2, np.uint8)}))
        chain._cache(url, None)
        assert url not in chain._PARENT_CACHE
        got = hostmem.take(dev, 1000)
        assert got is not None and int(got[0]) == 2  # c's
        # a save that coded on the CPU read its parent while its own snapshot was made:
        # the parent's buffer is the next save's
        chain._cache(url, ("d", {}, {}, {dev: np.full(1000, 3, np.uint8)}))
        chain._cache(url, ("e", {}, {}, {dev: np.full(1000, 4, np.uint8)}), keep_replaced=True)
        got = hostmem.take(dev, 1000)
        assert got is not None and int(got[0]) == 3  # d's
    finally:
        chain._PARENT_CACHE.pop(url, None)


def test_saves_to_one_store_run_one_at_a_time() -> None:
    import threading
    import time

    order = []

    def second() -> None:
        with manifests.saving("file:///s"):
            order.append("second")

    with manifests.saving("file:///s") as nested:
        assert not nested
        t = threading.Thread(target=second)
        t.start()
        with manifests.saving("file:///other"):  # another store: not held up
            order.append("other")
        time.sleep(0.2)
        order.append("first")
    t.join(5)
    assert order == ["other", "first", "second"]


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4097, 3 * (1 << 20) + 7])
def test_every_page_of_a_mapping_is_populated(nbytes: int, monkeypatch) -> None:
    # written by several threads, in page-aligned parts that cover it exactly once
    import mmap

    parts = []
    real = hostmem._touch
    monkeypatch.setattr(hostmem, "_touch",
                        lambda part: (parts.append((part.ctypes.data, part.size)), real(part)))
    arr = hostmem.populated(nbytes).result()
    assert arr.dtype == np.uint8 and arr.size == max(1, nbytes) and arr.flags.writeable
    at = arr.ctypes.data
    for start, size in sorted(parts):
        assert start == at and (start - arr.ctypes.data) % mmap.PAGESIZE == 0
        at += size
    assert at == arr.ctypes.data + arr.size
    arr[:] = 7  # writable to the last byte
    assert int(arr[-1]) == 7


def test_a_buffer_the_new_parent_took_over_is_not_kept_as_well() -> None:
    # a save on the GPU path writes its snapshot into the replaced one's buffer: that buffer
    # is the new parent's, not a spare
    url = "file:///nowhere"
    dev = torch.device("cuda", 0)
    buf = np.zeros(1000, np.uint8)
    try:
        chain._cache(url, ("a", {}, {}, {dev: buf}))
        chain._cache(url, ("b", {}, {}, {dev: buf}))
        assert not hostmem._KEPT
    finally:
        chain._PARENT_CACHE.pop(url, None)


@pytest.mark.parametrize("size,nbytes,ok", [(1000, 1000, True), (1000, 889, True),
                                            (1000, 888, False), (1000, 1001, False),
                                            (1, 0, True), (2, 0, False)])
def test_fits(size: int, nbytes: int, ok: bool) -> None:
    assert hostmem.fits(np.zeros(size, np.uint8), nbytes) is ok


def test_a_mapping_is_populated_where_no_thread_can_start(monkeypatch) -> None:
    # at interpreter exit the pool refuses new work: the caller's thread writes the pages
    def refused():
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(hostmem, "_pool", refused)
    touched = []
    real = hostmem._touch
    monkeypatch.setattr(hostmem, "_touch", lambda part: (touched.append(part.size), real(part)))
    arr = hostmem.populated(3 * 4096 + 5).result()
    assert arr.size == 3 * 4096 + 5 and sum(touched) == arr.size


def test_a_job_queued_behind_a_thread_that_never_started_writes_nothing(monkeypatch) -> None:
    # ThreadPoolExecutor queues a job before it starts a thread for it: where the thread
    # cannot start, submit raises but the job stays queued, and a pool thread runs it later.
    # It must not zero pages the caller has written by then (a review found a resume copy,
    # and so the next delta's parent, zeroed that way)
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(hostmem, "THREADS", 4)
    monkeypatch.setattr(hostmem, "_POOL", None)
    started = []
    real_start = threading.Thread.start

    def start(self):
        if self.name.startswith("s4w-pages"):
            started.append(self.name)
            if len(started) > 1:
                raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    real = hostmem._touch

    def touch(part):  # the pool's one thread is slow: its queued jobs run after result()
        if threading.current_thread().name.startswith("s4w-pages"):
            time.sleep(0.3)
        real(part)

    monkeypatch.setattr(hostmem, "_touch", touch)
    n = 4 << 20
    arr = hostmem.populated(n).result()
    arr[:] = 7  # the caller's bytes, as a copy writes them in
    pool = hostmem._POOL
    assert isinstance(pool, ThreadPoolExecutor) and len(started) >= 2
    monkeypatch.setattr(threading.Thread, "start", real_start)
    pool.shutdown(wait=True)  # every queued job has run on the one thread by now
    assert int((arr != 7).sum()) == 0


def test_a_save_from_within_a_save_completes(tmp_path, monkeypatch) -> None:
    # a preemption handler (a signal handler, on the thread that is saving) saves again to
    # the same store: it must not wait for the save it interrupted, nor disturb it
    import s4weights
    from s4weights import api

    state = {"w": torch.randn(50_000), "b": torch.randn(300)}
    s4weights.save_checkpoint(state, tmp_path, 0)
    real = api.write_flattened
    inner: dict[str, torch.Tensor] = {}

    def interrupted(*a, **k):
        if not inner:
            inner.update({k2: v + 1 for k2, v in state.items()})
            s4weights.save_checkpoint(inner, tmp_path, 2)
        return real(*a, **k)

    monkeypatch.setattr(chain, "write_flattened", interrupted)
    state["w"] += 1e-3
    s4weights.save_checkpoint(state, tmp_path, 1)
    monkeypatch.setattr(chain, "write_flattened", real)
    assert [i.step for i in s4weights.list_checkpoints(tmp_path)] == [0, 1, 2]
    for step, want in ((1, state), (2, inner)):
        chain._PARENT_CACHE.clear()
        got = s4weights.load_checkpoint(tmp_path, step)
        for k, v in want.items():
            assert torch.equal(got[k], v), (step, k)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_populates_with_its_own_threads() -> None:
    # the parent's pool threads do not exist in a forked child: it must start its own
    import os

    hostmem.populated(1 << 20).result()  # the parent's pool, started
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when population completes
        try:
            arr = hostmem.populated(4 << 20).result()
            os._exit(0 if arr.size == 4 << 20 else 1)
        except BaseException:
            os._exit(2)
    deadline = __import__("time").monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if __import__("time").monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung populating a mapping")
        __import__("time").sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
