"""An empty io.BytesIO filled through one allocation ends exactly as plain writes leave it."""

import io
import itertools

import numpy as np
import pytest

from s4format import memsink


def _pieces(total: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, total, 40))
    data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
    edges = [0, *cuts.tolist(), total]
    # pieces of every size: empty ones, a few bytes, and many MiB (copied by the workers)
    return [data[a:b] for a, b in itertools.pairwise(edges)] + [b"", data[:5 << 20]]


def _plain(pieces: list[bytes]) -> io.BytesIO:
    f = io.BytesIO()
    for p in pieces:
        f.write(p)
    return f


@pytest.mark.parametrize("spare", [0, 1, 3 << 20, 64 << 20])
def test_same_bytes_and_position_as_plain_writes(spare):
    pieces = _pieces(24 << 20)
    total = sum(map(len, pieces))
    f = io.BytesIO()
    with memsink.into(f, total + spare) as sink:
        assert sink is not f
        for p in pieces:
            assert sink.write(memoryview(p)) == len(p)
    want = _plain(pieces)
    assert f.tell() == want.tell() == total
    assert f.getvalue() == want.getvalue()
    f.write(b"after")  # the BytesIO goes on as any other
    assert f.getvalue()[-5:] == b"after" and len(f.getvalue()) == total + 5


def test_more_than_the_capacity_goes_on_as_plain_writes():
    pieces = _pieces(24 << 20, seed=1)
    f = io.BytesIO()
    with memsink.into(f, 10 << 20) as sink:
        for p in pieces:
            sink.write(p)
    assert f.getvalue() == _plain(pieces).getvalue()


def test_an_error_leaves_what_was_written():
    pieces = _pieces(16 << 20, seed=2)
    f = io.BytesIO()
    with pytest.raises(RuntimeError), memsink.into(f, 32 << 20) as sink:
        for p in pieces[:10]:
            sink.write(p)
        raise RuntimeError("coding failed")
    assert f.getvalue() == b"".join(pieces[:10])
    assert f.tell() == len(f.getvalue())


def test_nothing_written_leaves_the_bytesio_empty():
    f = io.BytesIO()
    with memsink.into(f, 32 << 20):
        pass
    assert f.getvalue() == b"" and f.tell() == 0


@pytest.mark.parametrize("make", [
    lambda: io.BytesIO(b"earlier bytes"),                    # holds bytes: written after them
    lambda: type("Mine", (io.BytesIO,), {})(),               # a subclass may override write
    lambda: io.BufferedWriter(io.BytesIO()),                 # not a BytesIO
])
def test_other_sinks_are_written_as_they_are(make):
    f = make()
    f.seek(0, io.SEEK_END)
    with memsink.into(f, 32 << 20) as sink:
        assert sink is f


def test_small_files_are_written_plainly():
    f = io.BytesIO()
    with memsink.into(f, memsink.MIN_CAPACITY - 1) as sink:
        assert sink is f


def test_a_closed_bytesio_fails_as_plain_writes_do():
    f = io.BytesIO()
    f.close()
    with memsink.into(f, 32 << 20) as sink, pytest.raises(ValueError, match="closed"):
        sink.write(b"x")


def test_an_impossible_capacity_is_written_plainly():
    f = io.BytesIO()
    with memsink.into(f, 1 << 62) as sink:
        assert sink is f


@pytest.mark.parametrize("limits", [
    dict(COPY_MIN=1, COPY_STEP=1 << 16, PENDING=1 << 20),   # many pieces, writes that wait
    dict(COPY_MIN=1 << 40),                                  # every copy on the writing thread
    dict(_MADV_POPULATE_WRITE=-1),                           # a kernel without MADV_POPULATE_WRITE
    dict(POPULATE_AHEAD=0),                                  # no pages faulted in ahead
])
def test_copies_in_any_pieces_give_the_same_bytes(monkeypatch, limits):
    for name, value in limits.items():
        monkeypatch.setattr(memsink, name, value)
    pieces = _pieces(24 << 20, seed=3)
    f = io.BytesIO()
    with memsink.into(f, 40 << 20) as sink:
        for p in pieces:
            sink.write(np.frombuffer(p, np.uint8))
    assert f.getvalue() == _plain(pieces).getvalue()


def test_a_bytesio_whose_buffer_is_exported_is_written_as_it_is():
    f = io.BytesIO()
    held = f.getbuffer()
    with memsink.into(f, 32 << 20) as sink:
        assert sink is f
    held.release()


def test_a_bytesio_closed_during_the_save_is_not_reopened():
    f = io.BytesIO()
    with pytest.raises(ValueError, match="closed"), memsink.into(f, 32 << 20) as sink:
        sink.write(bytes(1 << 20))
        f.close()
    assert f.closed


def test_a_failed_copy_is_raised_and_hands_nothing_over(monkeypatch):
    real = memsink._copy_all
    calls = []

    def flaky(pairs, keep):
        calls.append(len(pairs))
        if len(calls) == 2:
            raise MemoryError("copy failed")
        real(pairs, keep)

    monkeypatch.setattr(memsink, "_copy_all", flaky)
    f = io.BytesIO()
    with pytest.raises(MemoryError, match="copy failed"), memsink.into(f, 64 << 20) as sink:
        for p in _pieces(24 << 20, seed=4):
            sink.write(p)
    assert len(calls) >= 2 and f.getvalue() == b""


def _populate_works() -> bool:
    api = memsink._get_api()
    if api is None or api.madvise is None:
        return False
    f = io.BytesIO()
    with memsink.into(f, 16 << 20) as sink:
        return sink._madvise(sink._address + sink._populated, 4096,
                             memsink._MADV_POPULATE_WRITE) == 0


@pytest.mark.skipif(not _populate_works(), reason="needs Linux 5.14's MADV_POPULATE_WRITE")
def test_pages_are_faulted_in_ahead_all_along_and_given_back_past_the_end(monkeypatch):
    monkeypatch.setattr(memsink, "POPULATE_STEP", 1 << 20)
    monkeypatch.setattr(memsink, "POPULATE_AHEAD", (11 << 20) + 12345)  # (not page-aligned)

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    pieces = _pieces(24 << 20, seed=5)
    total = sum(map(len, pieces))  # 29 MiB: over half the capacity, so the BytesIO keeps
    f = io.BytesIO()                # the whole allocation (CPython shrinks only below half)
    before = resident()
    with memsink.into(f, 40 << 20) as sink:
        for p in pieces:
            sink.write(p)
    assert sink._prefault  # every fault-in took: none refused at an unaligned address
    assert sink._populated > 39 << 20
    # the pages faulted in past the end are not kept with the BytesIO
    assert resident() - before < total + (6 << 20)
    assert f.getvalue() == _plain(pieces).getvalue()


def test_after_a_failure_writes_are_refused_not_put_at_the_start(monkeypatch):
    monkeypatch.setattr(memsink, "_copy_all", lambda pairs, keep: 1 / 0)
    monkeypatch.setattr(memsink, "PENDING", 0)  # each write waits for its copies
    f = io.BytesIO()
    sink = memsink._BytesSink.open(f, 32 << 20)
    with pytest.raises(ZeroDivisionError):
        sink.write(bytes(4 << 20))
    with pytest.raises(ValueError, match="earlier write"):
        sink.write(b"TAIL")
    sink.close()  # nothing to hand over, nothing raised again
    assert f.getvalue() == b""


def test_a_close_while_a_write_runs_keeps_the_memory_and_hands_nothing_over():
    f = io.BytesIO()
    with memsink.into(f, 32 << 20) as sink:
        sink.write(bytes(8 << 20))
        sink._busy.acquire()  # a writer still inside write(), as a second interrupt leaves it
        kept = len(memsink._ABANDONED)
    assert len(memsink._ABANDONED) == kept + 1 and f.getvalue() == b""
    sink._busy.release()
    with pytest.raises(ValueError):
        sink.write(b"late")  # the writer's next write finds the sink given up
    memsink._ABANDONED.pop()


@pytest.mark.skipif(not _populate_works(), reason="needs Linux 5.14's MADV_POPULATE_WRITE")
def test_an_interrupt_taken_by_a_fault_in_task_is_raised(monkeypatch):
    def interrupted(self, lo, hi, keep):
        raise KeyboardInterrupt

    monkeypatch.setattr(memsink._BytesSink, "_fault_in", interrupted)
    f = io.BytesIO()
    with pytest.raises(KeyboardInterrupt), memsink.into(f, 64 << 20) as sink:
        for p in _pieces(24 << 20, seed=6):
            sink.write(p)
    assert f.getvalue() == b""
