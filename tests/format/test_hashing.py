"""The tree hash of spec/format.md ("Hashes") on buffers of many leaves: the digests the worker
pool takes, a run of leaves per task, are those of each 64 KiB leaf hashed alone, whether the
buffer is one array or pieces cut anywhere, and the root hashes the length and those digests."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest
import xxhash

from s4format import hashing
from s4format.pieces import Pieces

LEAF = hashing.LEAF_SIZE
RUN = hashing._PIECE_LEAVES  # leaves per task


@pytest.mark.parametrize("nbytes", [0, 1, LEAF - 1, LEAF, LEAF + 1, 3 * LEAF + 2, RUN * LEAF,
                                    RUN * LEAF + 1, 2 * RUN * LEAF + 123,
                                    3 * RUN * LEAF - LEAF + 7])
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
    assert hashing.content_hash(raw) == hashing.content_hash(memoryview(raw)) \
        == xxhash.xxh3_128_digest(root)
    if nbytes % 2 == 0:  # (a tensor's words, not bytes: hashed as their bytes)
        assert hashing.content_hash(data.view("<u2")) == xxhash.xxh3_128_digest(root)


def _leaves(raw: bytes) -> list[int]:
    return [xxhash.xxh3_64_intdigest(raw[at:at + LEAF]) for at in range(0, len(raw), LEAF)]


@pytest.mark.parametrize("offset", [0, 1, 3, 7, 13])
def test_the_leaf_kernel_is_xxh3_at_any_alignment(offset: int) -> None:
    # (the kernel loads each stripe unaligned; a plane's stored bytes start anywhere in a file)
    rng = np.random.default_rng(offset)
    data = rng.integers(0, 256, 40 * LEAF + offset, dtype=np.uint8)[offset:]
    data[5 * LEAF:6 * LEAF] = 0  # a run of zero leaves, and one of all-ones
    data[6 * LEAF:7 * LEAF] = 0xFF
    leaves = np.zeros(40, dtype="<u8")
    hashing._hash_leaves(data, 0, 40, leaves, hashing._ROWS)
    assert leaves.tolist() == _leaves(data.tobytes())
    assert hashing.leaf_digests(data).tolist() == _leaves(data.tobytes())


def test_selected_leaves_and_pieces_take_the_kernel_and_xxhash_alike() -> None:
    rng = np.random.default_rng(5)
    n = 70 * LEAF + 999
    data = rng.integers(0, 256, n, dtype=np.uint8)
    want = _leaves(data.tobytes())
    todo = rng.random(len(want)) < 0.6
    got = hashing.leaf_digests(data, todo).tolist()
    assert got == [w if t else 0 for w, t in zip(want, todo)]
    cuts = [0, 3, 17 * LEAF, 17 * LEAF + 1, 40 * LEAF - 5, 52 * LEAF, n]
    pieces = Pieces([data[a:b] for a, b in itertools.pairwise(cuts)])
    assert hashing.leaf_digests(pieces).tolist() == want
    assert hashing.leaf_digests(pieces, todo).tolist() == got


def test_a_few_leaves_are_left_to_xxhash_until_a_kernel_has_run(monkeypatch) -> None:
    # Hashing alone (inspecting or verifying a small file) does not start numba.
    from s4format import jit

    monkeypatch.setattr(jit, "started", lambda: False)
    monkeypatch.setattr(hashing, "_hash_leaves", None)  # (called, it would raise)
    data = np.random.default_rng(2).integers(0, 256, (hashing.KERNEL_MIN_LEAVES - 1) * LEAF + 9,
                                             dtype=np.uint8)
    assert hashing.leaf_digests(data).tolist() == _leaves(data.tobytes())
