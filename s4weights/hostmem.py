"""Page-locked host memory of an exact size, for ``save_checkpoint``'s snapshots.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to a
power of two: a 2.1 GB snapshot takes 4 GiB of page-locked memory, and a save holds two
snapshots (the parent and the new one). Here an anonymous mapping of the size asked for (to
the page) is registered with CUDA (``cudaHostRegister``) and unregistered when the last view
of it is gone, so copies into it run asynchronously, as into torch's pinned memory, at no
more than a page of waste.

Making one is mostly page faults (~0.45 s per GB on the H200 machine, one thread): they are
taken by a few threads (:func:`populated`), which may run while the GPU codes, before the
mapping is registered (~0.05 s per GB, during which CUDA's other calls wait).

A buffer the caller is done with can be kept for the next request of about its size
(:func:`keep`, :func:`take`): making gigabytes of it takes far longer than copying them in
(1.88 GB: 0.5-0.9 s against 0.03 s), and checkpoints of one run have the same size every
time. It is only handed out again once nothing else refers to it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
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
    """A mapping being populated by :data:`THREADS` threads."""

    def __init__(self, nbytes: int) -> None:
        size = max(1, nbytes)
        self._area = mmap.mmap(-1, size)
        self.array = np.frombuffer(self._area, dtype=np.uint8, count=size)
        step = -(-size // THREADS) + mmap.PAGESIZE - 1 & ~(mmap.PAGESIZE - 1)
        self._parts = [_pool().submit(_touch, self.array[k:k + step])
                       for k in range(0, size, step)]

    def result(self) -> np.ndarray:
        for part in self._parts:
            part.result()
        return self.array


def _touch(part: np.ndarray) -> None:
    part[:] = 0  # (numpy lets go of the GIL for the write)


_POOL: ThreadPoolExecutor | None = None
THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="s4w-pages")
    return _POOL


def lock(arr: np.ndarray) -> bool:
    """Page-lock ``arr`` (from :func:`populated`) with CUDA until its last view is gone;
    False, with the reason logged, where CUDA cannot (no CUDA, or the host's limit on locked
    memory)."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        ptr = arr.ctypes.data
        # cudaHostRegisterPortable: page-locked for every device's context
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, arr.size, 1))
    except Exception as exc:  # (torch.cuda.CudaError, RuntimeError)
        log.warning("%d bytes of host memory could not be page-locked (%s)", arr.size,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    weakref.finalize(arr, _unregister, ptr)
    return True


def page_locked(nbytes: int) -> np.ndarray | None:
    """A new uint8 array of ``nbytes`` in page-locked host memory, or None (with the reason
    logged) where CUDA cannot lock it."""
    arr = populated(nbytes).result()
    return arr if lock(arr) else None


def _unregister(ptr: int) -> None:
    # before the mapping goes (finalizers run as the array dies, before its base is released)
    with contextlib.suppress(Exception):  # (CUDA already shut down at exit)
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)


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
    # references: `arr` here and getrefcount's argument; any other is a live view
    if sys.getrefcount(arr) > 2 or not fits(arr, nbytes):
        return None
    return arr


def fits(arr: np.ndarray, nbytes: int) -> bool:
    """Whether ``arr`` holds ``nbytes`` with at most :data:`SLACK` to spare."""
    return nbytes <= arr.size <= nbytes + int(nbytes * SLACK)


def forget() -> None:
    """Let every kept buffer go (unregistered and unmapped once no view of it is left)."""
    _KEPT.clear()
