"""The save's writer thread (``s4weights.background``): jobs run in order, the queue's payload
bytes stay bounded, a job's error reaches the caller and stops everything after it."""

from __future__ import annotations

import threading
import time

import pytest

from s4weights.background import Background


def test_jobs_run_in_order_on_another_thread() -> None:
    seen: list[tuple[int, str]] = []
    bg = Background(limit=10)
    for i in range(200):
        bg.submit(lambda i=i: seen.append((i, threading.current_thread().name)), 1)
    bg.finish()
    assert [i for i, _ in seen] == list(range(200))
    assert {t for _, t in seen} == {"s4w-writer"}


def test_queued_bytes_stay_under_the_limit() -> None:
    gate = threading.Event()
    queued = []
    bg = Background(limit=100)

    def slow() -> None:
        gate.wait(5)

    bg.submit(slow, 60)          # running (or queued): 60 bytes
    t0 = time.perf_counter()
    done = threading.Event()

    def producer() -> None:
        bg.submit(lambda: None, 60)  # 120 > 100: must wait for the first job
        queued.append(time.perf_counter() - t0)
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    assert not done.wait(0.3)    # still blocked while the first job holds its bytes
    gate.set()
    assert done.wait(5)
    th.join()
    bg.finish()


def test_one_job_larger_than_the_limit_is_accepted() -> None:
    ran = []
    bg = Background(limit=10)
    bg.submit(lambda: ran.append(1), 1 << 40)
    bg.finish()
    assert ran == [1]


def test_an_error_reaches_the_caller_and_stops_later_jobs() -> None:
    ran = []
    gate = threading.Event()
    bg = Background(limit=1 << 20)

    def boom() -> None:
        gate.wait(5)
        raise ValueError("disk full")

    bg.submit(boom, 1)
    bg.submit(lambda: ran.append("after"), 1)
    gate.set()
    with pytest.raises(ValueError, match="disk full"):
        for _ in range(1000):     # the error shows at a later submit (or at finish)
            bg.submit(lambda: ran.append("later"), 1)
            time.sleep(0.001)
        bg.finish()
    assert ran == []


def test_abort_drops_waiting_jobs() -> None:
    ran = []
    started = threading.Event()
    gate = threading.Event()
    bg = Background(limit=1 << 20)

    def first() -> None:
        started.set()
        gate.wait(5)
        ran.append("first")

    bg.submit(first, 1)
    for i in range(5):
        bg.submit(lambda i=i: ran.append(i), 1)
    assert started.wait(5)
    threading.Timer(0.2, gate.set).start()  # the running job ends after abort dropped the rest
    bg.abort()
    assert ran == ["first"]


def test_save_codes_on_the_callers_thread_and_writes_on_the_writer_thread(monkeypatch) -> None:
    # The writer thread runs when tensors are coded on the GPU. The CPU coders share a zstd
    # compressor that is not thread-safe and the GPU path's CPU fallbacks code on the caller's
    # thread, so coding must never move to the writer thread. A stand-in for the GPU path
    # (CPU-coded, on the caller's thread, like its fallbacks) takes the "g" tensors.
    import io

    import torch

    import s4format
    import s4format.writer as writer_mod
    import s4weights
    from s4format import hashing
    from s4weights import gpu

    coders, writers = set(), set()
    code_tensor, add_coded = writer_mod.code_tensor, writer_mod.Writer.add_coded

    def spy_code(*a, **k):
        coders.add(threading.current_thread().name)
        return code_tensor(*a, **k)

    def spy_add(self, *a, **k):
        writers.add(threading.current_thread().name)
        return add_coded(self, *a, **k)

    def stand_in(tensors, policy, device, parents, workspace=None, parent_hashes=None):
        names = [n for n, _t in tensors if n.startswith("g")]

        def results():
            for n, t in tensors:
                if n in names:
                    c = writer_mod.code_tensor(t.data, t.dtype, policy)
                    yield c, hashing.content_hash(t.data), None, c.stored

        stream = results()
        return {n: stream for n in names}

    monkeypatch.setattr(writer_mod, "code_tensor", spy_code)
    monkeypatch.setattr(writer_mod.Writer, "add_coded", spy_add)
    monkeypatch.setattr(gpu, "coded_in_order", stand_in)
    state = {f"{'g' if i % 2 else 'h'}{i}": torch.arange(3000 + i) for i in range(40)}
    buf = io.BytesIO()
    s4weights.save(state, buf)
    assert coders == {threading.current_thread().name}
    assert writers == {"s4w-writer"}
    got = s4weights.load(buf.getvalue())
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert s4format.Reader(buf.getvalue()).tensors[1].name == "g1"


def test_an_interrupt_while_finishing_lets_the_running_job_end_first() -> None:
    # Ctrl-C during the final wait: the caller aborts the sink next, so the thread must not
    # still be writing into it. The running job ends, queued ones are dropped, then the
    # interrupt is raised.
    import signal

    main = threading.main_thread().ident
    state: list[str] = []
    gate = threading.Event()
    bg = Background(limit=1 << 20)

    def slow() -> None:
        state.append("start")
        gate.wait(5)
        time.sleep(0.2)
        state.append("end")

    bg.submit(slow, 1)
    bg.submit(lambda: state.append("later"), 1)

    def interrupt() -> None:
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)  # a real signal: it interrupts the wait
        gate.set()

    threading.Thread(target=interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        bg.finish()
    assert state == ["start", "end"]
    assert not bg._thread.is_alive()


def test_abort_returns_the_error_of_a_job_that_failed_before() -> None:
    bg = Background(limit=1 << 20)

    def boom() -> None:
        raise OSError("disk full")

    bg.submit(boom, 1)
    time.sleep(0.1)
    err = bg.abort()
    assert isinstance(err, OSError) and "disk full" in str(err)
    assert Background(limit=1).abort() is None


def test_a_second_interrupt_is_raised_at_once() -> None:
    # a write that hangs (a stalled network sink) must not make the save impossible to stop
    import signal

    main = threading.main_thread().ident
    gate = threading.Event()
    bg = Background(limit=1 << 20)
    bg.submit(lambda: gate.wait(10), 1)

    def interrupt_twice() -> None:
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_twice).start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        bg.finish()
    assert time.perf_counter() - t0 < 5
    gate.set()
    bg._thread.join(5)
    assert not bg._thread.is_alive()
