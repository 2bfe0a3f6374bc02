"""bf16 and fp32 tensors whose sign plane is bitpacked and whose first mantissa plane is
bitpack-w at 7 bits (the writer's usual choice) merge from the packed bytes in one pass: the
words are those of unpacking each plane and merging, for every bf16 bit pattern, every length
of the last group, and XORed into a delta's buffer."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest

from s4format import codecs, hashing, layouts
from s4format.codecs.view import PIECE
from tests.generic_cpu import cpu_flags, on_generic_cpu

RNG = np.random.default_rng(21)


def _stored(layout: layouts.Layout, raw: np.ndarray, itemsize: int) -> list[tuple]:
    planes = layout.split(raw, itemsize)
    out = []
    for k, plane in enumerate(planes):
        cid = codecs.BITPACK if k == 0 else codecs.BITPACK_W if k == 2 else codecs.RANS
        enc = codecs.get(cid).encode(plane)
        out.append((cid, np.frombuffer(bytes(enc.payload), np.uint8), plane.size, enc.params))
    return out


@pytest.fixture
def packed_merges(monkeypatch) -> list[int]:
    """How many merges took the packed path."""
    taken = []
    original = layouts.Layout._packed_sign_mantissa

    def spy(self, slicers):
        found = original(self, slicers)
        taken.append(found is not None)
        return found
    monkeypatch.setattr(layouts.Layout, "_packed_sign_mantissa", spy)
    return taken


def _words(dtype: str, n: int, rng: np.random.Generator = RNG) -> np.ndarray:
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    bits[::5] &= 0x807FFFFF  # zero and subnormal exponents, and -0.0
    bits[1::7] |= 0x7F800000  # Inf and NaN payloads
    return bits if dtype == "u4" else (bits >> 16).astype(np.uint16)


@pytest.mark.parametrize("layout,dtype", [(layouts.BF16, "u2"), (layouts.FP32, "u4")])
@pytest.mark.parametrize("n", [8, 9, 15, 16, 1000, PIECE + 1, 2 * PIECE + 7, 3 * PIECE])
def test_packed_planes_merge_to_the_words(packed_merges, layout, dtype, n: int) -> None:
    words = _words(dtype, n)
    raw = words.view(np.uint8)
    itemsize = words.itemsize
    stored = _stored(layout, raw, itemsize)
    assert stored[2][3] == b"\x07"
    got = layouts.merge_stored(layout, itemsize, raw.size, stored)
    assert got is not None and got.tobytes() == raw.tobytes()
    acc = RNG.integers(0, 256, raw.size, dtype=np.uint8)
    want = acc ^ raw
    assert layouts.merge_stored(layout, itemsize, raw.size, stored, acc) is not None
    assert acc.tobytes() == want.tobytes()
    assert packed_merges == [True, True]


@pytest.mark.parametrize("layout,dtype,packed", [
    (layouts.BF16, "u2", True), (layouts.FP32, "u4", True), (layouts.FP16, "u2", False)])
@pytest.mark.parametrize("n", [1000, 32768, 32769, PIECE + 1, 2 * PIECE + 7])
def test_a_merge_hashes_its_pieces_as_the_content_hash_would(packed_merges, layout, dtype,
                                                             packed, n: int) -> None:
    # each piece's leaves hashed as it is merged, or XORed into a buffer: the same content
    # hash as hashing the bytes after, however the pieces fall on the leaves (the last one cut)
    words = _words(dtype, n)
    raw = words.view(np.uint8)
    stored = _stored(layout, raw, words.itemsize)
    leaves = hashing.leaves_for(raw.size)
    got = layouts.merge_stored(layout, words.itemsize, raw.size, stored, leaves=leaves)
    assert got.tobytes() == raw.tobytes()
    assert hashing.content_hash_of(raw.size, leaves) == hashing.content_hash(raw)
    acc = RNG.integers(0, 256, raw.size, dtype=np.uint8)
    leaves = hashing.leaves_for(raw.size)
    assert layouts.merge_stored(layout, words.itemsize, raw.size, stored, acc, leaves) \
        is not None
    assert hashing.content_hash_of(raw.size, leaves) == hashing.content_hash(acc)
    assert packed_merges == [packed, packed]


def test_every_bf16_pattern_merges_from_packed_planes(packed_merges) -> None:
    words = np.arange(1 << 16, dtype=np.uint16)
    for order in (words, RNG.permutation(words)):
        raw = order.view(np.uint8)
        stored = _stored(layouts.BF16, raw, 2)
        assert layouts.merge_stored(layouts.BF16, 2, raw.size, stored).tobytes() == raw.tobytes()
    assert packed_merges == [True, True]


def test_other_widths_take_the_plane_by_plane_merge(packed_merges) -> None:
    # mantissas below 2**6 pack at 6 bits: the packed path is for 7 alone
    words = (_words("u2", 5000) & 0xFFBF).astype(np.uint16)
    raw = words.view(np.uint8)
    stored = _stored(layouts.BF16, raw, 2)
    assert stored[2][3] == b"\x06"
    assert layouts.merge_stored(layouts.BF16, 2, raw.size, stored).tobytes() == raw.tobytes()
    assert packed_merges == [False]


def _digest() -> str:
    """A hash of the words merged from packed planes: every bf16 pattern, and bf16 and fp32
    words of lengths around a vector block, written and XORed."""
    h = hashlib.sha256()
    rng = np.random.default_rng(5)
    cases = [(layouts.BF16, np.arange(1 << 16, dtype=np.uint16))]
    for n in (63, 64, 65, 127, 128, 200, PIECE + 65):
        for layout, dtype in ((layouts.BF16, "u2"), (layouts.FP32, "u4")):
            cases.append((layout, _words(dtype, n, rng)))
    for layout, words in cases:
        raw = words.view(np.uint8)
        stored = _stored(layout, raw, words.itemsize)
        h.update(layouts.merge_stored(layout, words.itemsize, raw.size, stored).tobytes())
        acc = rng.integers(0, 256, raw.size, dtype=np.uint8)
        assert layouts.merge_stored(layout, words.itemsize, raw.size, stored, acc) is not None
        h.update(acc.tobytes())
    return h.hexdigest()


def test_vector_merge_where_the_cpu_has_it():
    # (a numba that renamed what the gate reads would fall back to the word loop silently)
    assert layouts.vector_merging() == ("avx2" in cpu_flags())


@pytest.mark.skipif(sys.platform != "linux", reason="NUMBA_CPU_NAME is exercised on Linux")
def test_vector_and_word_merges_agree(tmp_path):
    # a generic CPU has no AVX2: the word loop ran there, and gave the same bytes
    there = on_generic_cpu(tmp_path, __name__, "[layouts.vector_merging(), _digest()]")
    assert there == [False, _digest()]


@pytest.mark.parametrize("layout,dtype", [(layouts.BF16, "u2"), (layouts.FP32, "u4")])
@pytest.mark.parametrize("n,log2_block,signs", [
    (1000, 16, "0"), (PIECE + 9, 16, "1"), (1000, 5, "blocks"), (2 * PIECE + 3, 12, "blocks")])
def test_a_sign_plane_of_one_sign_per_block_merges_packed(packed_merges, layout, dtype,
                                                          n: int, log2_block: int,
                                                          signs: str) -> None:
    """A sign plane stored as rANS's CONST form (one symbol per block: Adam's second moments,
    all positive) merges by the packed path as a bitpacked one does, written and XORed."""
    from s4format.codecs.rans import MODE_CONST, RansCodec

    words = _words(dtype, n)
    top = np.uint64(8 * words.itemsize - 1)
    if signs == "blocks":
        per_block = RNG.integers(0, 2, -(-n // (1 << log2_block)), dtype=np.uint64)
        sign = np.repeat(per_block, 1 << log2_block)[:n]
    else:
        sign = np.full(n, int(signs), np.uint64)
    words = ((words.astype(np.uint64) & ~(np.uint64(1) << top)) | (sign << top)).astype(words.dtype)
    raw = words.view(np.uint8)
    stored = _stored(layout, raw, words.itemsize)
    plane = layout.split(raw, words.itemsize)[0]
    enc = RansCodec(log2_block=log2_block, split=False).encode(plane)
    payload = np.frombuffer(bytes(np.asarray(enc.payload, np.uint8)), np.uint8)
    assert payload[0] == MODE_CONST
    stored[0] = (codecs.RANS, payload, n, b"")
    got = layouts.merge_stored(layout, words.itemsize, raw.size, stored)
    assert got is not None and got.tobytes() == raw.tobytes()
    acc = RNG.integers(0, 256, raw.size, dtype=np.uint8)
    want = acc ^ raw
    assert layouts.merge_stored(layout, words.itemsize, raw.size, stored, acc) is not None
    assert acc.tobytes() == want.tobytes()
    assert packed_merges == [True, True]


def test_a_constant_sign_plane_of_another_symbol_is_refused(packed_merges) -> None:
    """A CONST sign plane whose symbol is not 0 or 1 has no packed form: the field merge finds
    the value wider than the sign's bit and the merge gives None (decoding the planes whole
    then names it)."""
    from s4format.codecs.rans import RansCodec

    words = _words("u2", 5000)
    raw = words.view(np.uint8)
    stored = _stored(layouts.BF16, raw, 2)
    enc = RansCodec().encode(np.full(5000, 2, np.uint8))
    stored[0] = (codecs.RANS, np.frombuffer(bytes(np.asarray(enc.payload, np.uint8)), np.uint8),
                 5000, b"")
    assert layouts.merge_stored(layouts.BF16, 2, raw.size, stored) is None
    assert packed_merges == [False]


def test_constant_planes_make_their_bits_only_for_the_packed_merge(monkeypatch) -> None:
    """fp32 words widened from bf16 have CONST low mantissa planes of 0s: their bits, which no
    merge reads, are not made; a CONST sign plane's are, once."""
    from s4format.codecs import rans

    made = []
    original = rans._const_bits

    def spy(*args):
        made.append(args[1])
        return original(*args)
    monkeypatch.setattr(rans, "_const_bits", spy)
    words = _words("u4", 5000) & np.uint32(0x7FFF0000)  # (positive, low 16 bits zero)
    raw = words.view(np.uint8)
    stored = _stored(layouts.FP32, raw, 4)
    for k in (0, 3, 4):  # sign, mantissa1, mantissa2: one symbol each
        enc = codecs.get(codecs.RANS).encode(layouts.FP32.split(raw, 4)[k])
        stored[k] = (codecs.RANS, np.frombuffer(bytes(np.asarray(enc.payload, np.uint8)),
                                                np.uint8), 5000, b"")
    got = layouts.merge_stored(layouts.FP32, 4, raw.size, stored)
    assert got is not None and got.tobytes() == raw.tobytes()
    assert made == [5000]
