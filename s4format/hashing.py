"""Content hashes and plane checksums (``spec/format.md``, "Hashes").

Both are two-level XXH3 tree hashes so a GPU can compute them in parallel and a CPU can verify
them: the bytes are cut into 64 KiB leaves, each leaf is hashed with XXH3-64 (seed 0), and the
root hashes the little-endian u64 byte length followed by the leaf digests as little-endian
u64s. The content hash of a tensor's raw bytes is the root's XXH3-128 (16 bytes, canonical
big-endian form); the checksum of a plane's stored bytes is the root's XXH3-64.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from s4format import threads

LEAF_SIZE = 64 * 1024


# Leaves per piece of work on a worker thread (xxhash releases the GIL).
_PIECE_LEAVES = 256


def _root_input(data: np.ndarray | bytes | memoryview) -> bytes:
    view = memoryview(data).cast("B")
    n = len(view)
    count = (n + LEAF_SIZE - 1) // LEAF_SIZE
    leaves = np.empty(count, dtype="<u8")

    def piece(first: int) -> None:
        for j in range(first, min(count, first + _PIECE_LEAVES)):
            leaves[j] = xxhash.xxh3_64_intdigest(view[j * LEAF_SIZE:(j + 1) * LEAF_SIZE])

    if count <= _PIECE_LEAVES:
        piece(0)
    else:
        threads.pool().map(piece, range(0, count, _PIECE_LEAVES))
    return struct.pack("<Q", n) + leaves.tobytes()


def content_hash(data: np.ndarray | bytes | memoryview) -> bytes:
    """The 16-byte content hash of a tensor's raw bytes."""
    return xxhash.xxh3_128_digest(_root_input(data))


def plane_checksum(data: np.ndarray | bytes | memoryview) -> int:
    """The u64 checksum of a plane's stored bytes."""
    return xxhash.xxh3_64_intdigest(_root_input(data))


def bytes_checksum(data: bytes) -> int:
    """Plain XXH3-64 (seed 0) used for the header, footer and index."""
    return xxhash.xxh3_64_intdigest(data)
