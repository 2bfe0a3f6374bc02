"""Large reads into the GPU loader's pinned staging go in pieces on a few threads
(``staging.read_into``); no CUDA needed: the bytes must be exactly the source's, from a file
or from memory, and a short file must still raise TruncatedError."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

from s4format.errors import TruncatedError
from s4format.source import BufferSource, FileSource
from s4weights.gpu import staging


@pytest.mark.parametrize("kind", ["file", "memory"])
@pytest.mark.parametrize("size", [0, 1000, 3 * 4096 + 17, 40 * 4096 + 5])
def test_pieces_read_exactly_the_source(tmp_path, monkeypatch, kind: str, size: int) -> None:
    monkeypatch.setattr(staging, "READ_PIECE", 4096)  # many pieces from small data
    data = np.random.default_rng(size).integers(0, 256, size + 300, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    src = FileSource(path) if kind == "file" else BufferSource(data.tobytes())
    dst = np.full(size, 0xAB, np.uint8)
    staging.read_into(SimpleNamespace(source=src), 300, dst)
    assert np.array_equal(dst, data[300:])


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_scattered_reads_go_in_jobs_and_read_exactly_the_source(tmp_path, monkeypatch,
                                                                  kind: str) -> None:
    """Many small reads at scattered offsets (a chain level's planes, which are not one span):
    gathered into about eight jobs on the reading threads, each byte where it belongs."""
    monkeypatch.setattr(staging, "READ_PIECE", 4096)
    data = np.random.default_rng(7).integers(0, 256, 200_000, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    src = FileSource(path) if kind == "file" else BufferSource(data.tobytes())
    rng = np.random.default_rng(8)
    offsets = sorted(rng.choice(190_000, 120, replace=False).tolist())
    sizes = rng.integers(0, 3 * 4096, len(offsets)).tolist()  # some empty, some in pieces
    reads = [(o, np.full(min(n, data.size - o), 0xAB, np.uint8)) for o, n in zip(offsets, sizes)]
    submitted = []
    pool = staging._readers()
    real_submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda fn, *a: submitted.append(a) or real_submit(fn, *a))
    staging.read_all(SimpleNamespace(source=src), reads)
    assert 1 < len(submitted) <= 9  # jobs, not a submission per plane
    for o, dst in reads:
        assert np.array_equal(dst, data[o:o + dst.size]), o


def test_a_short_file_raises(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(staging, "READ_PIECE", 4096)
    path = tmp_path / "f"
    path.write_bytes(bytes(10 * 4096))
    src = FileSource(path)
    path.write_bytes(bytes(5 * 4096))  # shrinks after the source was opened
    with pytest.raises(TruncatedError):
        staging.read_into(SimpleNamespace(source=src), 0, np.empty(10 * 4096, np.uint8))


def _child_read(path: str, expect: bytes) -> None:
    dst = np.empty(len(expect), np.uint8)
    staging.read_into(SimpleNamespace(source=FileSource(path)), 0, dst)
    raise SystemExit(0 if dst.tobytes() == expect else 3)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_reads_work_in_a_forked_child(tmp_path, monkeypatch) -> None:
    # the reader threads belong to the parent; a forked child must start its own
    import multiprocessing

    monkeypatch.setattr(staging, "READ_PIECE", 4096)
    data = bytes(range(256)) * 160
    path = tmp_path / "f"
    path.write_bytes(data)
    staging.read_into(SimpleNamespace(source=FileSource(path)), 0, np.empty(len(data), np.uint8))
    assert staging._READERS is not None  # the parent's pool exists
    p = multiprocessing.get_context("fork").Process(target=_child_read, args=(str(path), data))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("a read in a forked child hung")
    assert p.exitcode == 0


@pytest.mark.parametrize("sizes", [[], [10], [5000, 0, 3 * 4096 + 17, 40 * 4096 + 5], [90_000],
                                   [300 + k % 7 for k in range(3000)]])
def test_copies_land_exactly_in_pieces_or_whole(monkeypatch, sizes: list[int]) -> None:
    # staging.copy_into (a chunk's staged pieces into pinned memory): every array at its offset,
    # the bytes between them untouched, whether the pool copies it in pieces or one thread,
    # and many small arrays (a codec-9 chunk's segments) in a few jobs
    monkeypatch.setattr(staging, "READ_PIECE", 4096)
    jobs = []
    pool = staging._readers()
    real = pool.submit
    monkeypatch.setattr(pool, "submit", lambda *a: (jobs.append(1), real(*a))[1])
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    offsets = np.cumsum([0] + [n + 16 for n in sizes])
    dst = np.full(int(offsets[-1]), 0xAB, np.uint8)
    staging.copy_into(dst, list(zip(offsets[:-1].tolist(), arrays)))
    want = np.full_like(dst, 0xAB)
    for o, a in zip(offsets[:-1].tolist(), arrays):
        want[o:o + a.size] = a
    assert np.array_equal(dst, want)
    assert len(jobs) <= 9


@pytest.mark.parametrize("scattered", [False, True])
def test_reads_arrive_in_order_in_many_parts(monkeypatch, scattered: bool) -> None:
    """With ``arrived``, a large read is told as it comes in, about 32 times, in order: each
    call's piece and everything before it in the reads are filled by then."""
    monkeypatch.setattr(staging, "READ_PIECE", 4096)
    data = np.random.default_rng(9).integers(0, 256, 600_000, dtype=np.uint8)
    src = BufferSource(data.tobytes())
    host = np.full(data.size, 0xAB, np.uint8)
    if scattered:
        edges = [*range(0, data.size, 7_000), data.size]
        reads = [(a, host[a:b]) for a, b in itertools.pairwise(edges)]
    else:
        reads = [(0, host)]
    seen = []

    def arrived(d: np.ndarray) -> None:
        end = int(d.ctypes.data - host.ctypes.data) + d.size
        assert np.array_equal(host[:end], data[:end])  # all of it, before and in d, is in
        assert not seen or end > seen[-1]
        seen.append(end)

    staging.read_all(SimpleNamespace(source=src), reads, arrived)
    assert 16 <= len(seen) <= 40 and seen[-1] == data.size
