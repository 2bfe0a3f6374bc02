"""Content hashes and plane checksums (``spec/format.md``, "Hashes").

Both are two-level XXH3 tree hashes so a GPU can compute them in parallel and a CPU can verify
them: the bytes are cut into 64 KiB leaves, each leaf is hashed with XXH3-64 (seed 0), and the
root hashes the little-endian u64 byte length followed by the leaf digests as little-endian
u64s. The content hash of a tensor's raw bytes is the root's XXH3-128 (16 bytes, canonical
big-endian form); the checksum of a plane's stored bytes is the root's XXH3-64.
"""

from __future__ import annotations

import bisect
import itertools
import struct

import numpy as np
import xxhash

from s4format import threads
from s4format.pieces import Pieces

LEAF_SIZE = 64 * 1024


# Leaves per piece of work on a worker thread (xxhash releases the GIL).
_PIECE_LEAVES = 256


def leaf_digests(data: np.ndarray | bytes | memoryview | Pieces,
                 todo: np.ndarray | None = None) -> np.ndarray:
    """The XXH3-64 digests of ``data``'s 64 KiB leaves (all, or the leaves ``todo`` selects, a
    mask: the others are left 0), computed on the pool. A leaf across two pieces is joined
    first: at most 64 KiB copied."""
    parts = data.parts if isinstance(data, Pieces) else [memoryview(data).cast("B")]
    starts = list(itertools.accumulate((len(p) for p in parts), initial=0))
    n = starts[-1]

    def leaf(j: int):
        lo, hi = j * LEAF_SIZE, min(n, (j + 1) * LEAF_SIZE)
        k = bisect.bisect_right(starts, lo) - 1
        if hi <= starts[k + 1]:
            return parts[k][lo - starts[k]:hi - starts[k]]
        joined = []
        while lo < hi:
            end = min(hi, starts[k + 1])
            joined.append(parts[k][lo - starts[k]:end - starts[k]])
            lo, k = end, k + 1
        return b"".join(joined)

    count = (n + LEAF_SIZE - 1) // LEAF_SIZE
    leaves = np.zeros(count, dtype="<u8")
    if todo is None and len(parts) == 1:
        _all_leaves(parts[0], leaves)
        return leaves
    which = np.arange(count) if todo is None else np.flatnonzero(todo)

    def piece(first: int) -> None:
        for j in which[first:first + _PIECE_LEAVES].tolist():
            leaves[j] = xxhash.xxh3_64_intdigest(leaf(j))

    if which.size <= _PIECE_LEAVES:
        piece(0)
    else:
        threads.pool().map(piece, range(0, which.size, _PIECE_LEAVES))
    return leaves


def _all_leaves(data: memoryview, leaves: np.ndarray) -> None:
    """Every leaf digest of one contiguous buffer, a run of leaves per task: the Python work
    between the hashes (which release the GIL) is what the other threads wait for."""
    n, digest = len(data), xxhash.xxh3_64_intdigest

    def piece(first: int) -> None:
        lo = first * LEAF_SIZE
        hi = min(n, lo + _PIECE_LEAVES * LEAF_SIZE)
        leaves[first:first + -(-(hi - lo) // LEAF_SIZE)] = [
            digest(data[at:at + LEAF_SIZE]) for at in range(lo, hi, LEAF_SIZE)]

    if leaves.size <= _PIECE_LEAVES:
        piece(0)
    else:
        threads.pool().map(piece, range(0, leaves.size, _PIECE_LEAVES))


def root_input(nbytes: int, leaves: np.ndarray) -> bytes:
    """What the root hashes: the u64 byte length, then the leaves' digests (little-endian)."""
    return struct.pack("<Q", nbytes) + np.asarray(leaves, "<u8").tobytes()


def _root_input(data: np.ndarray | bytes | memoryview | Pieces) -> bytes:
    n = data.nbytes if isinstance(data, Pieces) else len(memoryview(data).cast("B"))
    return root_input(n, leaf_digests(data))


def content_hash(data: np.ndarray | bytes | memoryview) -> bytes:
    """The 16-byte content hash of a tensor's raw bytes."""
    return xxhash.xxh3_128_digest(_root_input(data))


def plane_checksum(data: np.ndarray | bytes | memoryview | Pieces) -> int:
    """The u64 checksum of a plane's stored bytes."""
    return xxhash.xxh3_64_intdigest(_root_input(data))


def bytes_checksum(data: bytes) -> int:
    """Plain XXH3-64 (seed 0) used for the header, footer and index."""
    return xxhash.xxh3_64_intdigest(data)
