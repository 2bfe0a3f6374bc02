"""Container hashes from leaf digests computed on the GPU (``spec/format.md``, "Hashes").

The device hashes every 64 KiB leaf (``kernels/hash.cu``); the root over ``u64 length`` and the
digests is a few bytes per leaf. The coders' groups root them on the device too
(``runtime.content_hashes``, ``runtime.plane_checksums``); where a caller holds only the digests
(the chunked coder's one tensor, nvCOMP's codec) they are rooted here, exactly as
:mod:`s4format.hashing` does: content hashes (XXH3-128) and plane checksums (XXH3-64).
"""

from __future__ import annotations

import numpy as np
import xxhash

from s4format.hashing import LEAF_SIZE


def content_hash_from_leaves(nbytes: int, digests: np.ndarray) -> bytes:
    """The 16-byte content hash of ``nbytes`` raw bytes whose leaves hash to ``digests``."""
    return content_hashes_from_leaves([nbytes], digests, [0, np.asarray(digests).size])[0]


def plane_checksum_from_leaves(nbytes: int, digests: np.ndarray) -> int:
    """The u64 plane checksum of ``nbytes`` stored bytes whose leaves hash to ``digests``."""
    return plane_checksums_from_leaves([nbytes], digests, [0, np.asarray(digests).size])[0]


def _roots_input(nbytes, digests: np.ndarray, first) -> tuple[memoryview, np.ndarray]:
    """Every root input of a batch laid out back to back (``u64 nbytes`` then the digests, per
    item) in one array: (bytes, start of each item in u64 units, plus the end)."""
    nbytes = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    first = np.asarray(first, dtype=np.int64).reshape(-1)
    counts = np.diff(first)
    want = (nbytes + LEAF_SIZE - 1) // LEAF_SIZE
    if counts.size != nbytes.size or (counts != want).any():
        raise ValueError("digest counts do not match the items' leaf counts")
    starts = first[:-1] + np.arange(nbytes.size)
    d = np.asarray(digests, dtype="<u8").reshape(-1)[:int(first[-1]) if first.size else 0]
    buf = np.insert(d, first[:-1], nbytes.astype("<u8"))  # (a scatter took 7x as long)
    ends = np.append(starts, buf.size)
    return memoryview(buf.view(np.uint8)), ends


def plane_checksums_from_leaves(nbytes, digests: np.ndarray, first) -> list[int]:
    """``plane_checksum_from_leaves`` of many planes: plane q has ``nbytes[q]`` bytes and the
    digests ``digests[first[q]:first[q + 1]]`` (one numpy pass, then one xxh3 call each)."""
    mv, ends = _roots_input(nbytes, digests, first)
    e = ends.tolist()
    h = xxhash.xxh3_64_intdigest
    return [h(mv[8 * e[q]:8 * e[q + 1]]) for q in range(len(e) - 1)]


def content_hashes_from_leaves(nbytes, digests: np.ndarray, first) -> list[bytes]:
    """``content_hash_from_leaves`` of many tensors, as :func:`plane_checksums_from_leaves`."""
    mv, ends = _roots_input(nbytes, digests, first)
    e = ends.tolist()
    h = xxhash.xxh3_128_digest
    return [h(mv[8 * e[q]:8 * e[q + 1]]) for q in range(len(e) - 1)]
