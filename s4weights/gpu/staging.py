"""Staging for the GPU load: a batch's stored planes read from the file straight into pinned
host memory, and copied to the device in a few H2D copies, each as soon as its bytes are in.

Large reads and copies run in pieces on a few threads: one thread copying from the page cache
into pinned memory reaches a fraction of the memory bandwidth, and the copies release the GIL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from s4format.reader import Reader
from s4weights.gpu import runtime

SLOT_ALIGN = 16  # each staged plane's offset in the buffer


@dataclass
class Staged:
    """A batch's planes in pinned host memory (``host``, which the host's checks read) and on
    the device, each at offset ``at[q]`` of both."""
    reader: Reader
    idx: list[int]
    planes: list[tuple[int, int, object]]   # (tensor position, plane index, plane record)
    at: np.ndarray                           # offset of each plane in the buffer
    host: np.ndarray                         # pinned host copy (validation reads it)
    device: torch.Tensor
    keep: list[object] = field(default_factory=list)
    # per plane: tensor position, plane index, codec, decoded bytes, stored bytes, parameter
    # bytes (the planes' records as one array, for the host's checks; made from ``planes``
    # when not given)
    meta: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.meta is None:
            self.meta = np.array([(k, j, p.codec, p.decoded_len, p.stored_len, len(p.params))
                                  for k, j, p in self.planes], np.int64).reshape(-1, 6)


READ_PIECE = 4 << 20  # large reads into pinned memory go in pieces of this, in parallel
_READERS: ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()


def _forget_readers() -> None:
    global _READERS
    _READERS = None  # a forked child has none of the parent's threads: start afresh


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_readers)


def _readers() -> ThreadPoolExecutor:
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                          thread_name_prefix="s4w-read")
        return _READERS


def _in_pieces(n: int, whole: int | None = None) -> list[tuple[int, int]]:
    """[a, b) ranges of ``n`` bytes for the pool: one below two pieces' size, else at least
    ``READ_PIECE`` each, about eight in all of ``whole`` bytes read at once (default ``n``;
    4 KiB multiples)."""
    if n < 2 * READ_PIECE:
        return [(0, n)]
    step = max(READ_PIECE, -(-(whole or n) // 8) // 4096 * 4096)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _run_all(jobs: list) -> None:
    wait(jobs)  # every piece done (none still writing) before an error is raised
    for j in jobs:
        j.result()


def read_into(reader: Reader, offset: int, dst: np.ndarray) -> None:
    """Fill ``dst`` with the source's bytes at ``offset``. A large read is cut into pieces read
    by a few threads at once: one thread copying from the page cache (or from memory) into
    pinned memory runs at a fraction of the memory bandwidth, and the copies release the GIL.
    The source's ``read_at`` must therefore be safe to call from several threads (positional
    reads, as every source here; not a shared seek-and-read file object)."""
    read_all(reader, [(offset, dst)])


def read_all(reader: Reader, reads: list[tuple[int, np.ndarray]],
             arrived: Callable[[np.ndarray], None] | None = None) -> None:
    """:func:`read_into` of every ``(offset, dst)`` of ``reads``, all on the reading threads
    at once where they add up to a large read (planes read one by one, small as each may be,
    would each be read by the calling thread in turn). ``arrived(d)``, called on this thread
    as the reads go on, says that ``d`` (part of a ``dst``) and everything before it in
    ``reads`` is filled, so that it can be put to use while the rest is read. Not called
    where the reads are small: the caller's use then follows them."""
    total = sum(dst.size for _o, dst in reads)
    if total < 2 * READ_PIECE:
        for offset, dst in reads:
            _read_piece(reader, offset, dst)
        return
    # about eight jobs of consecutive pieces (a job per small plane costs its submission);
    # four times as many, and as many pieces, where they are used as they arrive
    jobs = _jobs(reads, total, 8 if arrived is None else 32)

    pool = _readers()
    running = [pool.submit(_read_job, reader, part) for part in jobs]
    if arrived is None:
        _run_all(running)
        return
    _in_order([(j, part[-1][1]) for part, j in zip(jobs, running)], arrived)


def _in_order(jobs: list[tuple[Future, Any]], done: Callable[[Any], None]) -> None:
    """``done(x)`` for each ``(job, x)`` of ``jobs`` as the job finishes, in order; the first
    failure in order raised once no job is still running."""
    try:
        for job, x in jobs:
            job.result()
            done(x)
    except BaseException:
        wait([job for job, _x in jobs])  # none still writing once the error is raised
        raise


def _jobs(reads: list[tuple[int, np.ndarray]], total: int, parts: int
          ) -> list[list[tuple[int, np.ndarray]]]:
    """``reads`` (``total`` bytes) cut into pieces and grouped into about ``parts`` jobs."""
    return _grouped([(offset + a, dst[a:b]) for offset, dst in reads
                     for a, b in _in_pieces(dst.size, total * 8 // parts)],
                    max(READ_PIECE, total // parts))


def copy_into(dst: np.ndarray, copies: list[tuple[int, np.ndarray]]) -> None:
    """``dst[o:o + a.size] = a`` for each (o, a) of ``copies`` on the reading threads (as
    :func:`read_into`), in about eight jobs: large copies cut into pieces, small ones
    grouped (a codec-9 chunk stages thousands of segments; a job each cost more than the
    copies, 0.77 s of a 1.3 s chunked load on the H200, 2026-12-03)."""
    total = sum(a.size for _o, a in copies)
    if total < 2 * READ_PIECE:
        for o, a in copies:
            dst[o:o + a.size] = a
        return
    jobs = _grouped([(o + x, a[x:y]) for o, a in copies for x, y in _in_pieces(a.size, total)],
                    max(READ_PIECE, -(-total // 8)))

    def one(job: list[tuple[int, np.ndarray]]) -> None:
        for o, a in job:
            dst[o:o + a.size] = a

    pool = _readers()
    _run_all([pool.submit(one, job) for job in jobs])


def _grouped(pieces: list[tuple[int, np.ndarray]], share: int
             ) -> list[list[tuple[int, np.ndarray]]]:
    """``pieces`` in order, cut into jobs of about ``share`` bytes each."""
    jobs: list[list[tuple[int, np.ndarray]]] = [[]]
    size = 0
    for o, d in pieces:
        if size >= share:
            jobs.append([])
            size = 0
        jobs[-1].append((o, d))
        size += d.size
    return jobs


def _read_piece(reader: Reader, offset: int, dst: np.ndarray) -> None:
    src = reader.source
    fd = getattr(src, "_fd", None)
    if isinstance(fd, int) and fd >= 0 and hasattr(os, "preadv"):
        done, n = 0, dst.size
        mv = memoryview(dst)
        try:
            while done < n:
                got = os.preadv(fd, [mv[done:]], offset + done)
                if got <= 0:
                    break
                done += got
        except OSError:
            done = -1  # the source's own read reports it (StorageError, as the CPU reader)
        if done == n:
            return
    dst[:] = src.read_at(offset, dst.size)


@dataclass
class _Layout:
    """Where a batch's planes go in its staging buffer, and the reads that fill it."""
    planes: list[tuple[int, int, object]]
    meta: np.ndarray
    at: np.ndarray
    host_t: torch.Tensor
    total: int
    reads: list[tuple[int, np.ndarray]]


def _layout(reader: Reader, idx: list[int], ahead: bool = False) -> _Layout | None:
    """Planes contiguous in the file (the writer's order) are read with one read; each plane
    sits at a 16-byte aligned offset of the buffer. ``ahead``: a read ahead, whose bytes count
    against ``AHEAD_LIMIT`` (None when they would pass it)."""
    planes = [(k, j, p) for k, i in enumerate(idx) for j, p in enumerate(reader.tensors[i].planes)]
    meta = np.array([(k, j, p.codec, p.decoded_len, p.stored_len, len(p.params), p.offset)
                     for k, j, p in planes], np.int64).reshape(-1, 7)
    off, ln = meta[:, 6].copy(), meta[:, 4].copy()
    span0 = int(off.min()) if off.size else 0
    span = int((off + ln).max()) - span0 if off.size else 0
    # one read of the planes' whole span when it holds nothing but them and the padding
    # between them (what device_extra counts), else plane by plane
    pad = max(SLOT_ALIGN, reader.alignment)
    contiguous = off.size and not ((off - span0) % SLOT_ALIGN).any() and \
        span <= int(ln.sum()) + pad * off.size
    if contiguous:
        at = off - span0
        total = span
    else:
        sizes = (ln + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        at = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if off.size \
            else np.zeros(0, np.int64)
        total = int(sizes.sum())
    if ahead and not _AHEAD.reserve(total):
        return None
    try:
        host_t = runtime.pinned(total)
    except BaseException:
        if ahead:
            _AHEAD.release(total)
        raise
    host = host_t.numpy()
    if contiguous:
        reads = [(span0, host[:span])]
    else:
        reads = [(o, host[a:a + n]) for a, o, n in zip(at.tolist(), off.tolist(), ln.tolist())]
    return _Layout(planes, meta, at, host_t, total, reads)


AHEAD_LIMIT = 1 << 30  # pinned bytes read ahead of their batches, in all the process, at most


class _AheadBytes:
    """The pinned bytes read ahead and not yet taken, in all the process."""

    def __init__(self) -> None:
        self.held = 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        with self._lock:
            if self.held + n > AHEAD_LIMIT:
                return False
            self.held += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.held -= n


_AHEAD = _AheadBytes()


class Ahead:
    """Batches' planes read into pinned memory ahead of their staging, while the device and
    the host work on the batch before (the next batch of a load, the levels of a delta
    chain). Reads queue on the reading threads behind those already submitted; the reads
    ahead of all the process hold at most ``AHEAD_LIMIT`` bytes, and one that cannot have its
    memory is not made. :meth:`drop` waits for any read nobody took."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, tuple[int, ...]], tuple[Reader, _Layout, list]] = {}

    def start(self, reader: Reader, idx: list[int]) -> None:
        key = (id(reader), tuple(idx))
        if not idx or key in self._pending:
            return
        try:
            lay = _layout(reader, idx, ahead=True)
        except (RuntimeError, MemoryError, OSError):  # (page-locked memory refused)
            return
        if lay is None:
            return
        pool = _readers()
        # (as many jobs as a read whose parts are used as they arrive: its staging copies
        # each finished job's bytes to the device while the rest are read)
        host = lay.host_t.numpy()
        self._pending[key] = (reader, lay, [
            (pool.submit(_read_job, reader, job), _end_in(host, job[-1][1]))
            for job in _jobs(lay.reads, lay.total, 32)])

    def take(self, reader: Reader, idx: list[int]
             ) -> tuple[_Layout, list[tuple[Future, int]]] | None:
        """The layout and the reads (each with the end of its bytes in the buffer, in order)
        that :meth:`start` began for ``idx``; None where it began none."""
        # (an entry holds its reader: no other reader can have its id meanwhile)
        got = self._pending.pop((id(reader), tuple(idx)), None)
        if got is None:
            return None
        _AHEAD.release(got[1].total)
        return got[1], got[2]

    def drop(self) -> None:
        while self._pending:
            _key, (_r, lay, jobs) = self._pending.popitem()
            wait([j for j, _end in jobs])
            _AHEAD.release(lay.total)


def _end_in(host: np.ndarray, part: np.ndarray) -> int:
    """Where ``part``, a view of ``host``, ends in it."""
    return int(part.ctypes.data - host.ctypes.data) + part.size


def _read_job(reader: Reader, part: list[tuple[int, np.ndarray]]) -> None:
    for o, d in part:
        _read_piece(reader, o, d)


def stage_planes(reader: Reader, idx: list[int], ahead: Ahead | None = None) -> Staged:
    """Read every plane of tensors ``idx`` into one pinned buffer and start its H2D copies
    (from the reads ``ahead`` started for them, where it did)."""
    got = ahead.take(reader, idx) if ahead is not None else None
    lay = _layout(reader, idx) if got is None else got[0]
    assert lay is not None
    host_t, host, total = lay.host_t, lay.host_t.numpy(), lay.total
    dev = runtime.device_empty(total)
    sent = 0

    def upload(end: int) -> None:
        nonlocal sent
        if end > sent:
            dev[sent:end].copy_(host_t[sent:end], non_blocking=True)
            sent = end
    if got is None:
        # what has arrived goes to the device while the rest is read
        read_all(reader, lay.reads, lambda d: upload(_end_in(host, d)))
    else:
        # ... and so do the reads ahead, in order, each as it is done (one copy of the whole
        # after the last read: a chain's parent level of 174 MB waited 3.8 ms for it, H100)
        _in_order(got[1], upload)
    upload(total)
    return Staged(reader, list(idx), lay.planes, lay.at, host, dev, [host_t], lay.meta[:, :6])
