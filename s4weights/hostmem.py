"""Page-locked host memory of an exact size, for ``save_checkpoint``'s snapshots.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to a
power of two: a 2.1 GB snapshot would take 4 GiB of page-locked memory. Here an anonymous
mapping of the size asked for (to the page) is registered with CUDA (``cudaHostRegister``,
through CuPy, under the device the copies are for) and unregistered when the last view of it
is gone, so copies into it run asynchronously, as into torch's pinned memory, at no more than
a page of waste.

Making one is mostly page faults (~0.45 s per GB on the H200 machine, one thread): they are
taken by a few threads (:func:`populated`), which may run while the GPU codes, before the
mapping is registered (~0.05 s per GB, during which CUDA's other calls wait).

A buffer whose snapshot is dropped can be kept for the next request of about its size
(:func:`keep`, :func:`take`): making gigabytes of it takes far longer than copying them in
(1.88 GB: 0.5-0.9 s against 0.03 s). It is handed out only when nothing else refers to it
any more; one still referred to is let go instead.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger("s4weights")

# A kept buffer serves a request this much smaller, at most (else it is let go).
SLACK = 1 / 8

_KEPT: dict[object, np.ndarray] = {}


def populated(nbytes: int) -> Populating:
    """Start making a uint8 array of ``nbytes`` (an anonymous mapping) whose pages are
    written by threads (page faults are most of what page-locking costs, and they do not
    hold CUDA up, as registering does); :meth:`Populating.result` waits for it."""
    return Populating(nbytes)


class Populating:
    """A mapping being populated by :data:`THREADS` threads (by the caller's, where no thread
    can start: at interpreter exit, or on a host out of threads)."""

    def __init__(self, nbytes: int) -> None:
        size = max(1, nbytes)
        # (the array keeps the mapping alive: it is the array's base)
        self.array = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8, count=size)
        step = -(-size // THREADS) + mmap.PAGESIZE - 1 & ~(mmap.PAGESIZE - 1)
        self._parts = []
        for k in range(0, size, step):
            part = _Part(self.array[k:k + step])
            self._parts.append(part)
            try:
                _pool().submit(part.write)
            except RuntimeError:
                # (cannot schedule new futures after interpreter shutdown; or no thread could
                # start, the job queued all the same: whoever claims the part first writes
                # it, so a job a thread runs later writes nothing)
                part.write()

    def result(self) -> np.ndarray:
        for part in self._parts:
            part.wait()
        return self.array


class _Part:
    """One thread's share of a :class:`Populating` mapping, written once: by the pool's job
    or by :meth:`wait`'s caller, whichever claims it first."""

    def __init__(self, pages: np.ndarray) -> None:
        self.pages = pages
        self._claim = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._error: BaseException | None = None

    def write(self) -> None:
        with self._claim:
            if self._claimed:
                return
            self._claimed = True
        try:
            _touch(self.pages)
        except BaseException as exc:
            self._error = exc
        finally:
            self.pages = None  # (a queued job left unrun holds no mapping)
            self._done.set()

    def wait(self) -> None:
        """Wait for the part, writing it here if no thread has claimed it yet (a job queued
        behind a thread that never started)."""
        self.write()
        self._done.wait()
        if self._error is not None:
            raise self._error


def _touch(part: np.ndarray) -> None:
    part[:] = 0  # (numpy lets go of the GIL for the write)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # (the CPUs this process may run on)
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 2


THREADS = max(1, min(8, _cpus() // 2))
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="s4w-pages")
        return _POOL


def _forked() -> None:
    # a forked child has none of the pool's threads: work given to it would never run
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def lock(arr: np.ndarray, device: int) -> bool:
    """Page-lock ``arr`` (from :func:`populated`) until its last view is gone, registering
    it under CUDA device ``device`` (no context is made on another). False where it cannot
    be: quietly without CuPy (the GPU path's dependency; copies then go through pageable
    memory), with the reason logged where CUDA refuses (the host's limit on locked memory).
    CuPy's call, unlike torch's binding, clears CUDA's error state after a refusal: the
    caller's next kernel launch must not see it."""
    try:
        import cupy
    except ImportError:
        log.debug("no CuPy: snapshot in pageable memory")
        return False
    ptr = arr.ctypes.data
    try:
        with cupy.cuda.Device(device):
            # cudaHostRegisterPortable: page-locked for every device's context
            cupy.cuda.runtime.hostRegister(ptr, arr.size, 1)
    except Exception as exc:  # (cupy.cuda.runtime.CUDARuntimeError)
        from s4weights.gpu import error_text

        log.warning("checkpoint snapshot: %d bytes of host memory could not be page-locked "
                    "(%s); using pageable memory, the copies are slower", arr.size,
                    error_text(exc))
        return False
    weakref.finalize(arr, _unregister, ptr, device)
    return True


def page_locked(nbytes: int, device: int) -> np.ndarray | None:
    """A new uint8 array of ``nbytes`` in page-locked host memory, or None where it cannot be
    locked (:func:`lock`)."""
    arr = populated(nbytes).result()
    return arr if lock(arr, device) else None


def _unregister(ptr: int, device: int) -> None:
    # before the mapping goes (finalizers run as the array dies, before its base is released)
    with contextlib.suppress(Exception):  # (CUDA already shut down at exit)
        import cupy

        with cupy.cuda.Device(device):
            cupy.cuda.runtime.hostUnregister(ptr)


def is_page_locked(arr: np.ndarray) -> bool:
    """Whether CUDA sees ``arr``'s memory as page-locked (False without CUDA)."""
    import torch

    return torch.cuda.is_available() and torch.from_numpy(arr).is_pinned()


def keep(key: object, arr: np.ndarray) -> None:
    """Keep ``arr`` (from :func:`page_locked`) for a later :func:`take` with ``key``; it
    replaces the one kept there before."""
    _KEPT[key] = arr


def take(key: object, nbytes: int) -> np.ndarray | None:
    """The buffer kept for ``key`` (whole: slice it), when it holds ``nbytes`` with at most
    :data:`SLACK` to spare and nothing else refers to it any more; else None (and a kept
    buffer that does not fit is let go)."""
    arr = _KEPT.pop(key, None)
    if arr is None:
        return None
    # `arr` is held here alone unless a view of it lives; `probe` is held here alone: the
    # same count when nothing else refers to `arr`, however this Python counts a call's
    # argument (3.14 borrows it)
    probe = np.empty(0)
    if sys.getrefcount(arr) > sys.getrefcount(probe) or not fits(arr, nbytes):
        return None
    return arr


def fits(arr: np.ndarray, nbytes: int) -> bool:
    """Whether ``arr`` holds ``nbytes`` (at least one: an empty request still takes a
    byte) with at most :data:`SLACK` to spare."""
    nbytes = max(1, nbytes)
    return nbytes <= arr.size <= nbytes + int(nbytes * SLACK)


def forget() -> None:
    """Let every kept buffer go (unregistered and unmapped once no view of it is left)."""
    _KEPT.clear()
