"""The bytes layout merges its planes a word at a time with constant shifts (no field to
check): for words of 1, 2, 4 and 8 bytes, pieces and tails of every length, whole planes and
slices, merged new and XORed into a delta's buffer, it gives the words the planes were split
from."""

from __future__ import annotations

import numpy as np
import pytest

from s4format import codecs, layouts
from s4format.codecs.view import PIECE

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 1000, PIECE + 3, 2 * PIECE])
def test_byte_planes_merge_to_the_words(itemsize: int, n: int) -> None:
    raw = RNG.integers(0, 256, n * itemsize, dtype=np.uint8)
    planes = layouts.BYTES.split(raw, itemsize)
    assert layouts.BYTES.merge(planes, raw.size, itemsize).tobytes() == raw.tobytes()
    stored = []
    for plane in planes:
        cid = codecs.RANS if plane is planes[0] else codecs.RAW
        enc = codecs.get(cid).encode(plane)
        stored.append((cid, np.frombuffer(bytes(enc.payload), np.uint8), plane.size, b""))
    got = layouts.merge_stored(layouts.BYTES, itemsize, raw.size, stored)
    assert got is not None and got.tobytes() == raw.tobytes()
    acc = RNG.integers(0, 256, raw.size, dtype=np.uint8)
    want = acc ^ raw
    assert layouts.merge_stored(layouts.BYTES, itemsize, raw.size, stored, acc) is not None
    assert acc.tobytes() == want.tobytes()


def test_every_16_bit_word_merges_from_its_two_bytes() -> None:
    words = np.arange(1 << 16, dtype=np.uint16)
    planes = layouts.BYTES.split(words.view(np.uint8), 2)
    assert np.array_equal(planes[0], (words & 0xFF).astype(np.uint8))
    merged = layouts.BYTES.merge(planes, words.nbytes, 2)
    assert np.array_equal(merged.view(np.uint16), words)
