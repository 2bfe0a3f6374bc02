"""Planes as views of a tensor's words: the statistics the codec choice reads are exact across
pieces, and every codec that codes straight from the words gives the bytes it gives on the
plane itself."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s4format import codecs, layouts
from s4format.codecs import view
from s4format.codecs.view import PlaneView


def _runs(plane: np.ndarray) -> int:
    step = plane[1:].astype(np.int64) - plane[:-1]
    return int(np.count_nonzero((step == 0) | (step == 1)))


def _words(n: int, seed: int = 1) -> np.ndarray:
    """fp32 weights, with a run and a counting stretch across a piece boundary."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.02).astype("<f4").view("<u4")
    w[view.PIECE - 500:view.PIECE + 500] = 0x3F800000
    w[2 * view.PIECE - 300:2 * view.PIECE + 300] = np.arange(600, dtype="<u4")
    return w


@pytest.mark.parametrize(("layout", "itemsize"), [(layouts.FP32, 4), (layouts.BF16, 4),
                                                  (layouts.BYTES, 8), (layouts.BYTES, 16),
                                                  (layouts.RAW, 4)])
def test_views_count_exactly_what_split_planes_hold(layout, itemsize: int) -> None:
    raw = _words(2 * view.PIECE + 1000).view(np.uint8)
    raw = raw[:raw.size - raw.size % itemsize]
    fields = layout.planes(itemsize) if layout is not layouts.RAW else layouts.RAW.fields
    for f, plane, v in zip(fields, layout.split(raw, itemsize), layout.views(raw, itemsize)):
        assert v.counted == (f.kind in (layouts.KIND_SIGN, layouts.KIND_EXPONENT)), f.label
        assert v.bits == int(np.bitwise_or.reduce(plane)) and v.width == max(1, v.bits
                                                                              .bit_length())
        assert v.bytes().tobytes() == plane.tobytes()
        assert v.counts.tolist() == np.bincount(plane, minlength=256).tolist()
        assert v.runs == _runs(plane) and v.counted
        assert v.symbols == len(np.unique(plane))


def test_a_plane_not_counted_is_judged_by_its_sample() -> None:
    raw = _words(3 * view.PIECE).view(np.uint8)
    m1 = layouts.FP32.views(raw, 4)[3]
    plane = layouts.FP32.split(raw, 4)[3]
    starts = np.linspace(0, plane.size - view.SAMPLE_CHUNK, view.SAMPLE_CHUNKS).astype(int)
    sample = [plane[s:s + view.SAMPLE_CHUNK] for s in starts]
    counts, m, runs = m1.share()
    assert m == view.SAMPLE_CHUNKS * view.SAMPLE_CHUNK and not m1.counted
    assert counts.tolist() == np.bincount(np.concatenate(sample), minlength=256).tolist()
    assert runs == sum(_runs(c) for c in sample) / (m - view.SAMPLE_CHUNKS)
    m1.counts  # noqa: B018 - counts it
    assert m1.share()[1:] == (plane.size, _runs(plane) / (plane.size - 1))


def test_a_plane_of_bytes_is_its_own_view() -> None:
    plane = np.array([5, 5, 6, 9, 8, 8, 200], np.uint8)
    v = PlaneView.of(plane)
    assert v.bytes() is v.words
    assert (v.runs, v.size, v.symbols, v.bits) == (3, 7, 5, 207)


@pytest.mark.parametrize("codec_id", [codecs.RAW, codecs.BITPACK, codecs.BITPACK_W,
                                      codecs.RANS, codecs.ZSTD])
def test_coding_a_view_gives_the_bytes_of_coding_its_plane(codec_id: int) -> None:
    codec = codecs.get(codec_id)
    raw = _words(view.PIECE * 5 + 77).view(np.uint8)
    views = layouts.FP32.views(raw, 4)  # none materialised: the codecs read the words
    for v, plane in zip(views, layouts.FP32.split(raw, 4)):
        got, want = codec.encode_view(v), codec.encode(plane)
        assert (got is None) == (want is None)
        if want is not None:
            assert bytes(got.payload) == bytes(want.payload) and got.params == want.params
        assert codec.estimate_view(v) == codec.estimate(plane)


@pytest.mark.parametrize("codec_id", [codecs.ZSTD, codecs.GDEFLATE])
def test_a_large_plane_is_estimated_from_samples_of_its_words(codec_id: int) -> None:
    # The LZ coders judge a large plane by samples: taken from the words, the plane is not
    # extracted for them, and the estimate is the one its bytes give.
    codec = codecs.get(codec_id)
    if not getattr(codec, "available", lambda: True)():
        pytest.skip("nvCOMP's CPU GDeflate library is not installed")
    w = _words(3 * view.PIECE + 77, seed=4)
    w[::3] &= 0xFFFF0000  # (an LZ coder's plane: runs of zero low bytes)
    raw = w.view(np.uint8)
    for k, plane in enumerate(layouts.FP32.split(raw, 4)):
        v = layouts.FP32.views(raw, 4)[k]
        assert v.bytes_at(1000, 5000).tobytes() == plane[1000:5000].tobytes()
        got = codec.estimate_view(v)
        assert v._bytes is None
        assert got == codec.estimate(plane)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=view.SMALL_PLANE + 64))
def test_small_planes_count_as_the_kernels_do(data: bytes) -> None:
    # PlaneView.of counts planes up to SMALL_PLANE bytes in one kernel call, larger ones in
    # pieces: histogram, runs (a byte equal to the one before or one above it) and width
    plane = np.frombuffer(data, np.uint8)
    got = view.PlaneView.of(plane)
    want = view.counted(plane, np.zeros(1, np.int64), np.full(1, 0xFF, np.int64))[0]
    assert got.counts.dtype == want.counts.dtype
    assert (got.counts == want.counts).all()
    assert (got.runs, got.bits, got.size) == (want.runs, want.bits, want.size)


@pytest.mark.parametrize("pattern", ["ramp", "runs", "wrap"])
def test_small_plane_runs_at_the_byte_range_ends(pattern: str) -> None:
    n = view.SMALL_PLANE
    plane = {"ramp": np.arange(n) % 256, "runs": np.repeat(np.arange(n // 16) % 256, 16),
             "wrap": np.tile([254, 255, 0, 255, 255], n // 5)}[pattern].astype(np.uint8)
    want = view.counted(plane, np.zeros(1, np.int64), np.full(1, 0xFF, np.int64))[0]
    assert view.PlaneView.of(plane).runs == want.runs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), min_size=256, max_size=256))
def test_chance_runs_is_the_sum_over_the_histogram(counts: list[int]) -> None:
    # (what lz_may_pay compares a plane's runs with: independent draws repeating the byte
    # before or exceeding it by one)
    c = np.array(counts, np.int64)
    m = max(1, int(c.sum()))
    p = c / m
    want = float(np.dot(p, p) + np.dot(p[1:], p[:-1]))
    assert view.chance_runs(c, m) == pytest.approx(want, rel=1e-12, abs=1e-15)
