"""Writing a whole file into an empty ``io.BytesIO`` without the cost of its growth.

A ``BytesIO`` copies each write into a buffer it grows, on the writing thread, and a large
buffer lives in fresh 4 KiB pages whose faults cost more than the copy (docs/gpu.md, "Saving
into memory"). Given an empty ``io.BytesIO``, :func:`into` writes the file instead into one
``bytes`` object allocated up front (asked to live on transparent huge pages, where the kernel
allows); the worker threads fault its pages in ahead of the writes and copy the written bytes
in, many writes at once; the ``BytesIO`` then takes the object over without a copy (CPython's
``BytesIO`` shares a ``bytes`` object it is initialised with). When the block ends, also by an
error of the caller's, the ``BytesIO`` holds exactly the bytes written, its position after them,
as plain writes would leave it. Where the sink itself fails (a copy, an interrupt while it
waits) it gives up: the ``BytesIO`` is left as it was and the error raised.

The copies run after ``write`` returns: what is written must not change until the block ends
(the writer's planes, headers and index do not; a buffer handed to ``write`` is kept alive by
the sink until copied).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import io
import sys
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from s4format import threads

# Smaller files gain too little to be worth the bookkeeping.
MIN_CAPACITY = 8 << 20

_MADV_HUGEPAGE = 14  # Linux
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, their contents unchanged
_MADV_DONTNEED = 4

# Pages are faulted in this far ahead of the writes, in pieces of POPULATE_STEP.
POPULATE_AHEAD = 256 << 20
POPULATE_STEP = 32 << 20
# Writes of at least COPY_MIN bytes are copied by the workers, in tasks of about COPY_STEP; at
# most PENDING bytes wait to be copied (each holding its source alive) before a write waits.
COPY_MIN = 4 << 10
COPY_STEP = 4 << 20
PENDING = 256 << 20


@contextlib.contextmanager
def into(f: BinaryIO, capacity: int) -> Iterator[BinaryIO]:
    """A sink to write a file of about ``capacity`` bytes (at most: more is written, only
    slower) into ``f``, handed over when the block ends. ``f`` itself where it is not an empty
    ``io.BytesIO``."""
    sink = _BytesSink.open(f, capacity)
    if sink is None:
        yield f
        return
    try:
        yield sink
    finally:
        sink.close()


class _Api:
    """CPython's C API calls that make a ``bytes`` object whose contents are filled in after
    it is made (``PyBytes_FromStringAndSize(NULL, n)``, the documented way to do so in C)."""

    def __init__(self) -> None:
        api = ctypes.pythonapi
        self.new = api.PyBytes_FromStringAndSize
        self.new.restype = ctypes.py_object
        self.new.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
        self.address = api.PyBytes_AsString
        self.address.restype = ctypes.c_void_p
        self.address.argtypes = [ctypes.py_object]
        self.madvise = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(None, use_errno=True)
                self.madvise = libc.madvise
                self.madvise.restype = ctypes.c_int
                self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


_api: _Api | None = None


def _get_api() -> _Api | None:
    global _api
    if _api is None and sys.implementation.name == "cpython":
        with contextlib.suppress(AttributeError, OSError):
            _api = _Api()
    return _api


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]], _keep: bytes) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


# Allocations a sink gave up on while a writer thread could still be using them (a second
# interrupt left it running): kept for the life of the process, never freed under it.
_ABANDONED: list[bytes] = []


class _BytesSink:
    """Writes at increasing offsets into ``obj``, a ``bytes`` object nothing else sees yet.
    Its memory is reached through raw views that do not keep it alive, so every task that uses
    it holds ``obj`` too, and the ``BytesIO`` takes it only once they have all run. On any
    error the sink gives up: nothing is handed over, and ``obj`` lives on while tasks hold it
    (a ``BytesIO`` never changes a ``bytes`` object someone else holds)."""

    def __init__(self, f: io.BytesIO, obj: bytes, address: int, madvise: Any) -> None:
        self._f: io.BytesIO | None = f
        self._obj: bytes | None = obj
        self._view: np.ndarray | None = np.ctypeslib.as_array(
            (ctypes.c_ubyte * len(obj)).from_address(address))
        self._pos = 0
        self._address, self._madvise = address, madvise
        self._prefault = madvise is not None  # (off once the kernel refuses it)
        self._populated = -address % 4096  # offsets of page-aligned addresses
        self._populating: list[threads.Task] = []
        self._copying: collections.deque[tuple[threads.Task, int]] = collections.deque()
        self._pending = 0
        self._batch: list[tuple[np.ndarray, np.ndarray]] = []  # copies not yet handed out
        self._batched = 0
        self._busy = threading.Lock()  # held by a write or the close
        self._failed = False

    @classmethod
    def open(cls, f: BinaryIO, capacity: int) -> _BytesSink | None:
        if type(f) is not io.BytesIO or capacity < MIN_CAPACITY:
            return None
        api = _get_api()
        if api is None:
            return None
        try:
            if f.tell() != 0 or f.getbuffer().nbytes:
                return None
            f.truncate(0)  # (raises where the caller holds an export of its buffer)
            obj = api.new(None, capacity)
        except (ValueError, BufferError, MemoryError, OverflowError):
            # closed, exported or too large: the plain writes report or do what they would
            return None
        address = api.address(obj)
        if api.madvise is not None:
            start = -address % 4096
            api.madvise(address + start, (capacity - start) & ~4095, _MADV_HUGEPAGE)
        return cls(f, obj, address, api.madvise)

    def write(self, data: Any) -> int:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a memory sink written from two threads at once")
        try:
            if self._failed:
                raise ValueError("an earlier write into the BytesIO failed")
            if self._view is not None:
                return self._write(data)
            if self._f is None:
                raise ValueError("write to a closed memory sink")
            return self._f.write(data)
        except BaseException:
            self._give_up()
            raise
        finally:
            self._busy.release()

    def _write(self, data: Any) -> int:
        src = np.frombuffer(data, dtype=np.uint8)
        n = src.size
        if self._pos + n > self._view.size:
            self._spill()
            return self._f.write(data)
        self._populate(self._pos + n + POPULATE_AHEAD)
        dst = self._view[self._pos:self._pos + n]
        if n < COPY_MIN:
            dst[:] = src
        else:
            # copied by the workers, a task per COPY_STEP bytes however many writes they are
            for lo in range(0, n, COPY_STEP):
                hi = min(n, lo + COPY_STEP)
                self._batch.append((dst[lo:hi], src[lo:hi]))
                self._batched += hi - lo
                if self._batched >= COPY_STEP:
                    self._submit()
        self._pos += n
        return n

    def _submit(self) -> None:
        pool = threads.copy_pool()
        batch, n = self._batch, self._batched
        self._batch, self._batched = [], 0
        self._copying.append((pool.submit(_copy_all, batch, self._obj), n))
        self._pending += n
        while self._pending > PENDING:
            task, n = self._copying[0]
            pool.wait([task])  # (raises the task's error: the sink gives up)
            self._copying.popleft()
            self._pending -= n

    def close(self) -> None:
        if not self._busy.acquire(blocking=False):
            # a writer thread is still inside write(), left running by an interrupt: its views
            # must stay valid, so the memory is kept and nothing is handed over
            self._failed = True
            if self._obj is not None:
                _ABANDONED.append(self._obj)
            return
        try:
            if self._view is not None and not self._failed:
                self._spill()
        except BaseException:
            self._give_up()
            raise
        finally:
            self._f = None
            self._busy.release()

    def _give_up(self) -> None:
        """Drop every raw view and hand nothing over; tasks still queued or running keep
        ``obj`` alive until they end, and nothing waits for them again."""
        self._failed = True
        self._view = None
        self._batch, self._batched = [], 0
        self._copying.clear()
        self._populating = []
        self._obj = None

    def _populate(self, end: int) -> None:
        """Have the workers fault pages in up to offset ``end``, where they are not yet."""
        end = ((self._address + min(end, self._view.size)) & ~4095) - self._address
        if not self._prefault or end - self._populated < POPULATE_STEP // 2:
            return
        pool = threads.copy_pool()
        while self._populated < end:
            lo, hi = self._populated, min(end, self._populated + POPULATE_STEP)
            self._populating.append(pool.submit(self._fault_in, lo, hi, self._obj))
            self._populated = hi

    def _fault_in(self, lo: int, hi: int, _keep: bytes) -> None:
        if self._prefault and self._madvise(self._address + lo, hi - lo, _MADV_POPULATE_WRITE):
            self._prefault = False  # a kernel without it: the writes fault their pages in

    def _spill(self) -> None:
        """Hand what is written to the ``BytesIO`` once every copy and fault-in has run (the
        first error raised instead); later writes go to the ``BytesIO`` directly."""
        if self._batch:  # copied on this thread: no new task to wait for
            batch, self._batch, self._batched = self._batch, [], 0
            _copy_all(batch, self._obj)
        threads.copy_pool().wait([t for t, _n in self._copying] + self._populating)
        self._copying.clear()
        self._populating, self._pending = [], 0
        self._view = None
        f, obj, pos = self._f, self._obj, self._pos
        self._obj = None
        if not pos:
            return
        if self._madvise is not None and self._populated > pos:
            # pages faulted in past the end would stay with the BytesIO: given back
            end = ((self._address + pos + 4095) & ~4095) - self._address
            if self._populated > end:
                self._madvise(self._address + end, self._populated - end, _MADV_DONTNEED)
        if f.closed:
            raise ValueError("I/O operation on closed file (the BytesIO saved into)")
        f.__init__(obj)  # type: ignore[misc]  # shares obj: no copy
        del obj  # the BytesIO's reference alone, so that truncating it copies nothing
        f.truncate(pos)
        f.seek(pos)
