"""The CPU path's worker pool: nested waits do not deadlock, errors come back in order, the
look-ahead helpers keep order and bounds, and coded bytes never depend on the thread count."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import s4format
from s4format import dtypes, memsink, threads
from s4format.writer import code_tensor


@pytest.fixture(params=[1, 2, 5])
def pool(request, monkeypatch) -> threads.Pool:
    p = threads.Pool(request.param)
    monkeypatch.setattr(threads, "_pool", p)
    return p


def test_nested_maps_finish_on_any_thread_count(pool: threads.Pool) -> None:
    def inner(x: int) -> int:
        return sum(pool.map(lambda y: x * y, range(10)))

    assert pool.map(inner, range(20)) == [45 * x for x in range(20)]


def test_the_first_error_in_order_is_raised(pool: threads.Pool) -> None:
    def work(x: int) -> int:
        if x in (3, 9):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 3"):
        pool.map(work, range(10))
    assert pool.map(work, range(3)) == [0, 1, 2]


class _Held:
    """Results made and not yet taken, and the most of them at once."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self._lock = threading.Lock()

    def made(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def taken(self) -> None:
        with self._lock:
            self.now -= 1


def test_ordered_keeps_order_and_its_bound(pool: threads.Pool) -> None:
    held = _Held()

    def work(x: int) -> int:
        held.made()
        return x

    got = []
    for x in threads.ordered(pool, work, ((x, 10) for x in range(50)), limit=30):
        got.append(x)
        held.taken()
    assert got == list(range(50))
    assert held.most <= 3


def test_idle_workers_hold_no_result(pool: threads.Pool) -> None:
    # a result that is a view of a buffer must not outlive the caller's use of it: a buffer
    # kept for reuse is taken only when nothing else refers to it (s4weights.hostmem.take)
    buf = np.zeros(64, np.uint8)
    alone = sys.getrefcount(buf)
    done = threading.Barrier(pool.threads) if pool.threads > 1 else None

    def piece(i: int) -> np.ndarray:
        if done is not None and i < pool.threads:
            done.wait(timeout=10)  # every thread runs one of the first pieces
        return buf[i:i + 1]

    got = pool.map(piece, range(4 * pool.threads))
    assert len(got) == 4 * pool.threads
    del got
    assert sys.getrefcount(buf) == alone


def test_prefetch_serves_keys_in_and_out_of_order(pool: threads.Pool) -> None:
    calls = []

    def fn(k: int) -> int:
        calls.append(k)
        return k * k

    ahead = threads.Prefetch(fn, [(k, 1) for k in range(6)], limit=2)
    assert [ahead.get(k) for k in (0, 2, 1, 9, 3, 3)] == [0, 4, 1, 81, 9, 9]
    # (4 and 5 may have been computed ahead meanwhile)
    assert sorted(k for k in calls if k not in (4, 5)) == [0, 1, 2, 3, 3, 9]


def test_s4_threads_is_read_and_checked(monkeypatch) -> None:
    monkeypatch.setenv("S4_THREADS", "3")
    assert threads.count() == 3
    monkeypatch.setenv("S4_THREADS", "32")  # (set, it is taken as it is)
    assert threads.count() == 32
    monkeypatch.delenv("S4_THREADS")
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert threads.count() == threads.DEFAULT_MAX == 4
    assert threads.copy_count() == threads.COPY_MAX == 8
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads.count() == threads.copy_count() == 2
    monkeypatch.setenv("S4_THREADS", "6")  # (both, set)
    assert threads.count() == threads.copy_count() == 6
    monkeypatch.setenv("S4_THREADS", "many")
    with pytest.raises(ValueError, match="S4_THREADS must be a positive integer, got 'many'"):
        threads.count()


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(700_000) * 0.02).astype("<f4")
    w[1000:90_000] = 0.5  # a run: LZ gets tried on some planes
    return {"w": w, "b": (rng.standard_normal(300_000) * 0.1).astype("<f4"),
            "ids": np.arange(200_000, dtype="<i8"), "small": np.ones(100, "<f4")}


def _coded(monkeypatch, n: int) -> bytes:
    monkeypatch.setattr(threads, "_pool", threads.Pool(n))
    return s4format.dumps(_state())


def test_files_do_not_depend_on_the_thread_count(monkeypatch) -> None:
    one = _coded(monkeypatch, 1)
    assert _coded(monkeypatch, 2) == one
    assert _coded(monkeypatch, 7) == one
    with s4format.Reader(one) as r:
        got = r.load()
    assert all(got[k].data.tobytes() == v.tobytes() for k, v in _state().items())


def test_a_delta_is_coded_alike_on_every_thread_count(monkeypatch) -> None:
    raw = np.random.default_rng(6).integers(0, 256, 3 << 20, dtype=np.uint8)
    parent = raw.copy()
    parent[::7] ^= 1
    out = []
    for n in (1, 4):
        monkeypatch.setattr(threads, "_pool", threads.Pool(n))
        buf = io.BytesIO()
        with s4format.Writer(buf, parent_id=b"\x01" * 16) as w:
            w.add("x", s4format.Tensor(dtypes.by_name("uint8"), raw.shape, raw),
                  parent=s4format.Tensor(dtypes.by_name("uint8"), raw.shape, parent))
        out.append(buf.getvalue())
    assert out[0] == out[1]
    assert code_tensor(raw ^ parent, dtypes.by_name("uint8")).stored < raw.size // 4


def test_importing_s4format_does_not_import_numba() -> None:
    code = ("import sys, s4format, s4format.reader, s4format.writer, s4format.cli; "
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_codes_with_a_pool_of_its_own() -> None:
    s4format.dumps(_state())  # the parent's pool has started its workers
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it codes and decodes the same bytes
        ok = False
        try:
            with s4format.Reader(s4format.dumps(_state())) as r:
                ok = r.load()["w"].data.tobytes() == _state()["w"].tobytes()
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_ordered_computes_small_items_on_the_callers_thread_in_order(
        pool: threads.Pool) -> None:
    me = threading.get_ident()
    ran_on: dict[int, int] = {}
    held = _Held()

    def work(x: int) -> int:
        held.made()
        ran_on[x] = threading.get_ident()
        if x == 37:
            raise ValueError("item 37")
        return x

    sizes = [1 if x % 3 else 10 for x in range(60)]  # every third item large
    got, pulled, ahead = [], [], [0]

    def items():
        for x in range(60):
            pulled.append(x)
            ahead[0] = max(ahead[0], sum(sizes[y] for y in pulled[len(got):]))
            yield x, sizes[x]

    with pytest.raises(ValueError, match="item 37"):
        for x in threads.ordered(pool, work, items(), limit=30, inline_below=5):
            got.append(x)
            held.taken()
    assert got == list(range(37))
    # the items taken and not yet handed over (a small one's host copy, say) stay bounded:
    # the limit, and the item just taken that waits for room
    assert ahead[0] <= 30 + 10
    if pool.threads > 1:  # (one thread runs everything on the caller's)
        assert all(ran_on[x] == me for x in range(37) if sizes[x] == 1)
    # small items count toward the bound too: computed or waiting, at most 30 of size
    assert held.most <= 30


def test_prefetch_passes_small_items_to_the_callers_thread(pool: threads.Pool) -> None:
    me = threading.get_ident()
    ran_on: dict[int, int] = {}

    def work(x: int) -> int:
        ran_on[x] = threading.get_ident()
        return x * 2

    ahead = threads.Prefetch(work, [(x, 1 if x % 2 else 100) for x in range(20)], 250,
                             inline_below=10)
    assert [ahead.get(x) for x in (0, 1, 5, 2, 3, 4, *range(6, 20))] == \
        [2 * x for x in (0, 1, 5, 2, 3, 4, *range(6, 20))]
    if pool.threads > 1:
        assert all(ran_on[x] == me for x in range(1, 20, 2))


def test_copies_into_memory_have_a_pool_of_their_own(monkeypatch) -> None:
    # (copies hold no GIL: the GPU path's saves into memory copy on more threads than the
    # coder's kernels gain from)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("S4_THREADS", raising=False)
    monkeypatch.setattr(threads, "_pool", None)
    monkeypatch.setattr(threads, "_copy_pool", None)
    assert threads.pool().threads == 4 and threads.copy_pool().threads == 8
    assert threads.pool() is threads.pool() and threads.copy_pool() is threads.copy_pool()
    data = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
    f = io.BytesIO()
    with memsink.into(f, data.nbytes) as sink:
        if sink is f:
            pytest.skip("no memory sink on this platform")
        sink.write(data)
    assert f.getvalue() == data.tobytes()
    # (the copies ran on the copy pool's workers; the coder's pool started none)
    assert threads.copy_pool()._started > 0 and threads.pool()._started == 0
