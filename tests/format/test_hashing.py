"""The tree hash of spec/format.md ("Hashes") on buffers of many leaves: the digests the worker
pool takes, a run of leaves per task, are those of each 64 KiB leaf hashed alone, whether the
buffer is one array or pieces cut anywhere, and the root hashes the length and those digests."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from s4format import hashing
from s4format.pieces import Pieces

LEAF = hashing.LEAF_SIZE
RUN = hashing._PIECE_LEAVES  # leaves per task


@pytest.mark.parametrize("nbytes", [0, 1, LEAF - 1, LEAF, RUN * LEAF, RUN * LEAF + 1,
                                    2 * RUN * LEAF + 123, 3 * RUN * LEAF - LEAF + 7])
def test_leaf_digests_are_each_leaf_hashed_alone(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    raw = data.tobytes()
    want = [xxhash.xxh3_64_intdigest(raw[at:at + LEAF]) for at in range(0, nbytes, LEAF)]
    assert hashing.leaf_digests(data).tolist() == want
    assert hashing.leaf_digests(raw).tolist() == want
    cut = nbytes // 3 + 5
    assert hashing.leaf_digests(Pieces([data[:cut], data[cut:]])).tolist() == want
    root = struct.pack("<Q", nbytes) + np.array(want, dtype="<u8").tobytes()
    assert hashing.content_hash(data) == xxhash.xxh3_128_digest(root)
    assert hashing.plane_checksum(data) == xxhash.xxh3_64_intdigest(root)
