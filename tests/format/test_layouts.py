"""Plane layouts: split and merge are exact inverses, planes hold only their field's bits, and
merge refuses plane bytes that no split could have produced."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s4format import FormatError, UnsupportedFeatureError, layouts
from s4format.layouts import BF16, BYTES, FP16, FP32, RAW

CASES = [(RAW, 1), (RAW, 4), (BF16, 2), (FP16, 2), (FP32, 4), (BF16, 4), (FP16, 4),
         (BYTES, 2), (BYTES, 4), (BYTES, 8), (BYTES, 16), (BYTES, 1)]


def _check(layout: layouts.Layout, raw: np.ndarray, itemsize: int) -> list[np.ndarray]:
    planes = layout.split(raw, itemsize)
    fields = layout.planes(itemsize)
    assert len(planes) == len(fields)
    words = raw.size // layout.word_size(itemsize)
    for f, p in zip(fields, planes):
        assert p.dtype == np.uint8 and p.shape == ((raw.size,) if layout is RAW else (words,))
        assert p.size == 0 or int(p.max()) < (1 << f.bits), f.label
    back = layout.merge([p.copy() for p in planes], raw.size, itemsize)
    assert back.dtype == np.uint8 and back.tobytes() == raw.tobytes()
    return planes


@pytest.mark.parametrize("layout", [BF16, FP16])
def test_every_16_bit_pattern(layout: layouts.Layout) -> None:
    raw = np.arange(1 << 16, dtype="<u2").view(np.uint8)
    planes = _check(layout, raw, 2)
    # The sign plane is the top bit; the exponent plane the IEEE exponent field.
    words = np.arange(1 << 16, dtype=np.uint32)
    assert np.array_equal(planes[0], words >> 15)
    ebits = 8 if layout is BF16 else 5
    mbits = 7 if layout is BF16 else 10
    assert np.array_equal(planes[1], (words >> mbits) & ((1 << ebits) - 1))


def test_fp32_fields() -> None:
    bits = np.array([0x80000000, 0x7F800000, 0x007FFFFF, 0x3F812345], dtype="<u4")
    sign, exponent, m0, m1, m2 = _check(FP32, bits.view(np.uint8), 4)
    assert sign.tolist() == [1, 0, 0, 0]
    assert exponent.tolist() == [0, 255, 0, 127]
    assert m0.tolist() == [0, 0, 0x7F, 0x01]
    assert m1.tolist() == [0, 0, 0xFF, 0x23]
    assert m2.tolist() == [0, 0, 0xFF, 0x45]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), words=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_split_merge_round_trip(case, words: int, seed: int) -> None:
    layout, itemsize = case
    raw = np.frombuffer(np.random.default_rng(seed).bytes(words * layout.word_size(itemsize)),
                        np.uint8)
    _check(layout, raw, itemsize)


@pytest.mark.parametrize(("layout", "plane", "bits", "label"), [
    (BF16, 0, 1, "sign"), (BF16, 2, 7, "mantissa0"), (FP16, 0, 1, "sign"),
    (FP16, 1, 5, "exponent"), (FP16, 2, 2, "mantissa0"), (FP32, 2, 7, "mantissa0"),
])
def test_merge_refuses_bits_outside_a_field(layout, plane: int, bits: int, label: str) -> None:
    raw = np.zeros(4 * layout.word, np.uint8)
    planes = layout.split(raw, layout.word)
    planes[plane] = planes[plane].copy()
    planes[plane][-1] = 1 << bits
    with pytest.raises(FormatError, match=f"{label} plane holds values wider than its {bits} bits"):
        layout.merge(planes, raw.size, layout.word)


def test_words_must_divide_the_raw_length() -> None:
    with pytest.raises(FormatError, match="layout fp32 needs whole 4-byte words, raw length 6"):
        FP32.check_applies(6, 4)
    with pytest.raises(FormatError, match="layout bytes needs whole 8-byte words"):
        BYTES.split(np.zeros(12, np.uint8), 8)


def test_unknown_layout_id() -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"unknown plane layout ID 9; v1 defines "
                                                      r"\[0, 1, 2, 3, 4\]"):
        layouts.by_id(9)


@pytest.mark.parametrize(("dtype", "itemsize", "layout"), [
    ("bfloat16", 2, BF16), ("float16", 2, FP16), ("float32", 4, FP32), ("complex64", 8, FP32),
    ("complex32", 4, FP16), ("float64", 8, BYTES), ("int16", 2, BYTES), ("uint8", 1, RAW),
    ("float8_e4m3fn", 1, RAW), ("bool", 1, RAW),
])
def test_preferred_layouts(dtype: str, itemsize: int, layout: layouts.Layout) -> None:
    assert layouts.preferred(dtype, itemsize) is layout


def test_plane_labels() -> None:
    assert [layouts.plane_label(k, i) for k, i in
            ((0, 0), (1, 0), (2, 0), (3, 2), (4, 7), (9, 1))] == \
        ["raw", "sign", "exponent", "mantissa2", "byte7", "kind9"]
