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

LEAF_SIZE = 64 * 1024


def _root_input(data: np.ndarray | bytes | memoryview) -> bytes:
    view = memoryview(data).cast("B")
    n = len(view)
    leaves = np.fromiter(
        (xxhash.xxh3_64_intdigest(view[i:i + LEAF_SIZE]) for i in range(0, n, LEAF_SIZE)),
        dtype="<u8", count=(n + LEAF_SIZE - 1) // LEAF_SIZE)
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
