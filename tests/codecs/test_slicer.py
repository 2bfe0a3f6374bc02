"""Decoding slice by slice: every codec's slicer gives the bytes of a whole decode, a corrupt
block gives None, and a tensor merged from slices equals the merge of whole planes (the
reader falls back to whole planes, which name what is wrong, whenever slices cannot)."""

from __future__ import annotations

import numpy as np
import pytest

from s4format import codecs, dtypes, layouts
from s4format.codecs.view import PIECE
from s4format.writer import code_tensor

RNG = np.random.default_rng(8)


def _planes() -> list[tuple[int, np.ndarray]]:
    n = 3 * (1 << 16) + 4321
    w = (RNG.standard_normal(n) * 0.02).astype("<f4").view("<u4")
    return [(codecs.RANS, ((w >> 23) & 0xFF).astype(np.uint8)),                 # RANS mode
            (codecs.RANS, np.repeat(RNG.integers(0, 9, 4, dtype=np.uint8), 1 << 16)[:n]),
            (codecs.RANS, RNG.integers(0, 256, n, dtype=np.uint8)),             # RAW mode
            (codecs.BITPACK, (w >> 31).astype(np.uint8)),
            (codecs.BITPACK_W, ((w >> 16) & 0x7F).astype(np.uint8)),
            (codecs.RAW, (w & 0xFF).astype(np.uint8))]


@pytest.mark.parametrize("case", range(6))
def test_slices_are_the_whole_decode_cut_up(case: int) -> None:
    cid, plane = _planes()[case]
    codec = codecs.get(cid)
    enc = codec.encode(plane)
    payload = np.frombuffer(bytes(enc.payload), np.uint8)
    s = codec.slicer(payload, plane.size, enc.params)
    assert s is not None
    for lo in range(0, plane.size, 1 << 16):
        hi = min(plane.size, lo + (1 << 16))
        assert lo % s.align == 0
        assert s.get(lo, hi).tobytes() == plane[lo:hi].tobytes()


def test_a_corrupt_block_is_none_and_a_bad_form_no_slicer() -> None:
    plane = _planes()[0][1]
    codec = codecs.get(codecs.RANS)
    payload = np.frombuffer(bytes(codec.encode(plane).payload), np.uint8).copy()
    payload[-3] ^= 0x5A  # a word of the last block
    s = codec.slicer(payload, plane.size, b"")
    assert s.get(0, 1 << 16) is not None and s.get(2 << 16, plane.size) is None
    assert codec.slicer(payload, plane.size + 1, b"") is None
    assert codec.slicer(payload[:100], plane.size, b"") is None
    assert codecs.get(codecs.BITPACK_W).slicer(payload[:10], 80, b"\x07") is None


def _raw(dtype: str, n: int) -> np.ndarray:
    if dtype == "int64":
        return np.arange(n, dtype="<i8").view(np.uint8)
    x = (RNG.standard_normal(n) * 0.02).astype("<f4")
    x[100:5000] = 0.5  # a run: zstd may take a plane, which is then decoded whole
    if dtype == "bfloat16":
        return (x.view("<u4") >> 16).astype("<u2").view(np.uint8)
    return x.astype(dtype).view(np.uint8)


@pytest.mark.parametrize(("dtype", "n"), [("float32", 2 * PIECE + 999), ("bfloat16", 70_000),
                                          ("int64", 30_000), ("float16", PIECE + 3)])
def test_merging_slices_equals_merging_whole_planes(dtype: str, n: int) -> None:
    dt, raw = dtypes.by_name(dtype), _raw(dtype, n)
    coded = code_tensor(raw, dt)
    stored = [(p.codec, np.frombuffer(bytes(p.payload), np.uint8), p.decoded_len, p.params)
              for p in coded.planes]
    got = layouts.merge_stored(coded.layout, dt.itemsize, raw.size, stored)
    assert got is not None and got.tobytes() == raw.tobytes()


def test_a_field_overflow_falls_back_to_whole_planes() -> None:
    n = 5000
    planes = [np.zeros(n, np.uint8), np.full(n, 127, np.uint8), np.full(n, 0x80, np.uint8)]
    stored = [(codecs.RAW, p, n, b"") for p in planes]  # mantissa 0x80: wider than 7 bits
    assert layouts.merge_stored(layouts.BF16, 2, 2 * n, stored) is None
    assert layouts.merge_stored(layouts.RAW, 1, n, stored[:1]) is None


def test_a_plane_of_one_piece_with_a_corrupt_block_still_slices_block_by_block() -> None:
    """A rANS plane that a merge takes in one piece is decoded whole when its slicer is made;
    where that finds anything wrong, the slicer still gives each good block and None for the
    corrupt ones, as for a larger plane."""
    plane = _planes()[0][1]
    assert plane.size <= PIECE
    codec = codecs.get(codecs.RANS)
    good = np.frombuffer(bytes(codec.encode(plane).payload), np.uint8)
    assert codec.slicer(good, plane.size, b"").get(0, plane.size).tobytes() == plane.tobytes()
    bad = good.copy()
    bad[-3] ^= 0x5A
    s = codec.slicer(bad, plane.size, b"")
    assert s.get(0, 1 << 16).tobytes() == plane[:1 << 16].tobytes()
    assert s.get(2 << 16, plane.size) is None
