"""Batched roots of the container hashes from leaf digests (host only, no GPU): equal to the
per-item functions and to s4format.hashing on the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from s4format import hashing
from s4weights.gpu.hash import (
    content_hash_from_leaves,
    content_hashes_from_leaves,
    plane_checksum_from_leaves,
    plane_checksums_from_leaves,
)


def _leaves(data: bytes) -> list[int]:
    return [xxhash.xxh3_64_intdigest(data[i:i + hashing.LEAF_SIZE])
            for i in range(0, len(data), hashing.LEAF_SIZE)]


def test_batched_roots_equal_per_item_roots_and_the_cpu_hashes() -> None:
    rng = np.random.default_rng(11)
    L = hashing.LEAF_SIZE
    sizes = [0, 1, 17, L - 1, L, L + 1, 3 * L + 5, 0, 2 * L]
    items = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    dig = [_leaves(b) for b in items]
    first = np.zeros(len(items) + 1, np.int64)
    np.cumsum([len(d) for d in dig], out=first[1:])
    flat = np.array([x for d in dig for x in d], np.uint64)
    sums = plane_checksums_from_leaves(sizes, flat, first)
    hashes = content_hashes_from_leaves(sizes, flat, first)
    for b, d, s, h in zip(items, dig, sums, hashes):
        arr = np.array(d, np.uint64)
        assert s == plane_checksum_from_leaves(len(b), arr) == hashing.plane_checksum(b)
        assert h == content_hash_from_leaves(len(b), arr) == hashing.content_hash(b)
    assert plane_checksums_from_leaves([], np.zeros(0, np.uint64), [0]) == []


def test_batched_roots_refuse_wrong_digest_counts() -> None:
    with pytest.raises(ValueError):
        plane_checksums_from_leaves([hashing.LEAF_SIZE + 1], np.zeros(1, np.uint64), [0, 1])
