"""Buffers the CPU decoder reads a tensor's stored bytes into, kept for the next tensor.

A buffer allocated for each read often lives in fresh pages, whose faults cost more than the
read (loading MiniLM-L6 in bf16 again and again on one thread of the 2-core machine, 2026-12-05:
about 1,700 page faults and 37-40 ms a load, against none and 31 ms with the reads in reused
buffers). The stored bytes are needed only while a tensor is decoded, so the reader takes a
buffer from this pool for them and gives it back once the tensor's bytes are merged. Free
buffers of at most :data:`KEEP` bytes in all are kept between loads; the rest go back to the
allocator."""

from __future__ import annotations

import os
import threading

import numpy as np

# Free buffers kept, in bytes at most; a buffer is as large as the stored bytes of the tensor
# it was made for, rounded up to a power of two.
KEEP = 64 << 20
# Smaller reads come from the allocator's own reused memory, with no faults to save.
MIN_READ = 64 << 10

_lock = threading.Lock()
_free: list[np.ndarray] = []  # by size, smallest first


def take(n: int) -> np.ndarray | None:
    """A buffer of at least ``n`` bytes, reused, to :func:`give` back once nothing holds a view
    of it; None where ``n`` is under :data:`MIN_READ`."""
    if n < MIN_READ:
        return None
    with _lock:
        for k, buf in enumerate(_free):
            if buf.size >= n:
                return _free.pop(k)
    return np.empty(1 << (n - 1).bit_length(), dtype=np.uint8)


def give(buf: np.ndarray | None) -> None:
    """Return a buffer of :func:`take` (None: nothing) for the next read."""
    if buf is None or buf.size > KEEP:
        return
    with _lock:
        _free.append(buf)
        _free.sort(key=lambda b: b.size)
        while sum(b.size for b in _free) > KEEP:
            _free.pop(0)


def forget() -> None:
    """Let the kept buffers go (tests; a process that wants the memory back)."""
    with _lock:
        _free.clear()


def _forget_in_child() -> None:
    # A forked child keeps none of the parent's buffers; a lock that another of the
    # parent's threads held stays held in the child.
    global _lock, _free
    _lock, _free = threading.Lock(), []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
