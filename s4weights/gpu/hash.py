"""Container hashes from leaf digests computed on the GPU (``spec/format.md``, "Hashes").

The device hashes every 64 KiB leaf (``kernels/hash.cu``); the root over ``u64 length`` and the
digests is a few bytes per leaf and is hashed here, exactly as :mod:`s4format.hashing` does.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from s4format.hashing import LEAF_SIZE


def leaf_count(nbytes: int) -> int:
    return (nbytes + LEAF_SIZE - 1) // LEAF_SIZE


def _root_input(nbytes: int, digests: np.ndarray) -> bytes:
    if digests.size != leaf_count(nbytes):
        raise ValueError(f"{nbytes} bytes have {leaf_count(nbytes)} leaves, got "
                         f"{digests.size} digests")
    return struct.pack("<Q", nbytes) + np.ascontiguousarray(digests, dtype="<u8").tobytes()


def content_hash_from_leaves(nbytes: int, digests: np.ndarray) -> bytes:
    """The 16-byte content hash of ``nbytes`` raw bytes whose leaves hash to ``digests``."""
    return xxhash.xxh3_128_digest(_root_input(nbytes, digests))


def plane_checksum_from_leaves(nbytes: int, digests: np.ndarray) -> int:
    """The u64 plane checksum of ``nbytes`` stored bytes whose leaves hash to ``digests``."""
    return xxhash.xxh3_64_intdigest(_root_input(nbytes, digests))
