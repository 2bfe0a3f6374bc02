"""Fields counted through one histogram of 16 bits of each word (``view.window_stats``) give
the histograms, runs, per-unit histograms and ORs that counting each field apart gives, on
weights, on constant and sparse stretches (counted field by field) and across pieces."""

from __future__ import annotations

import numpy as np
import pytest

from s4format import layouts
from s4format.codecs import view


def _reference(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Each field's histogram, runs and per-unit histograms, by numpy alone."""
    counts, runs, units = [], [], []
    n = words.size
    for s, m in zip(shifts.tolist(), masks.tolist()):
        plane = ((words.astype(np.uint64) >> np.uint64(s)) & np.uint64(m)).astype(np.int64)
        counts.append(np.bincount(plane, minlength=256))
        step = plane[1:] - plane[:-1]
        runs.append(int(np.count_nonzero((step == 0) | (step == 1))))
        if n >= view.UNITS_MIN:
            units.append([np.bincount(plane[a:a + view.UNIT], minlength=256)
                          for a in range(0, n, view.UNIT)])
    per_unit = np.array(units).transpose(1, 0, 2) if units else None
    return np.array(counts), np.array(runs), per_unit


def _weights(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 0.02).astype("<f4")


def _words(kind: str, n: int, layout: layouts.Layout) -> np.ndarray:
    f = _weights(n, 3)
    if kind == "constant units":  # whole units of one value, and one starting mid-unit
        f[view.UNIT:3 * view.UNIT] = 1.0
        f[5 * view.UNIT + 100:6 * view.UNIT + 7] = 0.0
    elif kind == "sparse":  # most words zero: counted field by field
        f[np.random.default_rng(4).random(n) < 0.8] = 0.0
    elif kind == "one bit":  # a delta's kept words: 40% of them one value, counted field by field
        f = f.view("<u4") & np.uint32(0xFFFF)
        f[np.random.default_rng(5).random(n) < 0.4] = 1 << 16
        f = f.view("<f4")
    elif kind == "counting":  # runs that count up, across a unit's bound
        at = min(n // 2, view.UNIT)
        f[at - 300:at + 300] = np.arange(600, dtype="<f4")
    if layout is layouts.FP32:
        return f.view("<u4")
    if layout is layouts.FP16:
        return f.astype("<f2").view("<u2")
    return (f.view("<u4") >> 16).astype("<u2")


@pytest.mark.parametrize("layout", [layouts.BF16, layouts.FP16, layouts.FP32])
@pytest.mark.parametrize("kind", ["weights", "constant units", "sparse", "one bit", "counting"])
@pytest.mark.parametrize("n", [view.WINDOW_MIN, 7 * view.UNIT + 5, 2 * view.PIECE + 4097])
def test_window_counts_what_each_field_counted_apart_holds(layout, kind: str, n: int) -> None:
    words = _words(kind, n, layout)
    shifts, masks = layout.shifts_masks(layout.word)
    counted = [k for k, f in enumerate(layout.fields)
               if f.kind in (layouts.KIND_SIGN, layouts.KIND_EXPONENT)]
    s, m = shifts[counted], masks[counted]
    counts, runs, units, window = view.window_stats(words, s, m)
    assert window is not None
    want_counts, want_runs, want_units = _reference(words, s, m)
    assert counts.tolist() == want_counts.tolist()
    assert runs.tolist() == want_runs.tolist()
    assert (units is None) == (want_units is None)
    if units is not None:
        assert units.tolist() == want_units.tolist()
    low, ors, hist = window
    sixteen = ((words.astype(np.uint64) >> np.uint64(low)) & np.uint64(0xFFFF)).astype(np.int64)
    assert ors == int(np.bitwise_or.reduce(sixteen))
    # kept for one part without units, unless a repeating stretch was counted field by field
    repeats = kind in ("sparse", "one bit") or (kind == "constant units" and n > view.UNIT)
    assert (hist is not None) == (n <= view.PIECE and units is None and not repeats)
    if hist is not None:
        assert hist.tolist() == np.bincount(sixteen, minlength=1 << 16).tolist()


@pytest.mark.parametrize("layout", [layouts.BF16, layouts.FP16, layouts.FP32])
@pytest.mark.parametrize("kind", ["weights", "sparse", "counting"])
@pytest.mark.parametrize("n", [view.WINDOW_MIN, 3 * view.UNIT + 5, view.UNITS_MIN - 1])
def test_fields_inside_a_kept_window_are_counted_from_it(layout, kind: str, n: int,
                                                         monkeypatch) -> None:
    # (the mantissa of a 16-bit float, fp32's top mantissa bits: no pass of their own)
    words = _words(kind, n, layout)
    passes: list[str] = []
    for name in ("_count_fields", "_count_sample"):
        real = getattr(view, name)
        monkeypatch.setattr(view, name, lambda w, *a, real=real, name=name: (
            passes.append(name), real(w, *a))[1])
    views = layout.views(words.view(np.uint8), layout.word)
    made = list(passes)  # (the passes that making the views took)
    shifts, masks = layout.shifts_masks(layout.word)
    want_counts, want_runs, _units = _reference(words, shifts, masks)
    for k, v in enumerate(views):
        assert v.counts.tolist() == want_counts[k].tolist(), layout.fields[k].label
        assert v.runs == want_runs[k]
        assert v.bits == int(np.bitwise_or.reduce(np.flatnonzero(want_counts[k])))
    inside = [k for k, f in enumerate(layout.fields) if f.kind == layouts.KIND_MANTISSA
              and int(shifts[k]) >= layout.word * 8 - 16]
    assert inside
    if kind == "weights":  # (else counted field by field, as before)
        # (fp32's two low bytes lie outside the window: one pass of their own, or a sample)
        assert len(made) == (1 if layout is layouts.FP32 else 0), made


def test_one_field_few_words_or_bytes_are_counted_field_by_field() -> None:
    w = _words("weights", 4 * view.UNIT, layouts.FP32)
    shifts, masks = layouts.FP32.shifts_masks(4)
    assert view.window_of(w, shifts[:2], masks[:2]) == 16
    assert view.window_of(w, shifts[1:2], masks[1:2]) is None  # one field
    assert view.window_of(w[:view.WINDOW_MIN - 1], shifts[:2], masks[:2]) is None
    assert view.window_of(w, shifts[[0, 4]], masks[[0, 4]]) is None  # not within 16 bits
    assert view.window_of(w.view(np.uint8), np.array([0, 4]), np.array([15, 15])) is None
    counts, runs, _units, window = view.window_stats(w, shifts[1:2], masks[1:2])
    want = _reference(w, shifts[1:2], masks[1:2])
    assert window is None and counts.tolist() == want[0].tolist()
    assert runs.tolist() == want[1].tolist()


@pytest.mark.parametrize("layout", [layouts.BF16, layouts.FP32])
def test_fields_inside_the_window_take_their_or_from_it(layout, monkeypatch) -> None:
    words = _words("weights", 3 * view.PIECE, layout)
    words[12345] |= 0x7F << (16 if layout is layouts.FP32 else 0)  # a full mantissa once
    raw = words.view(np.uint8)
    seen: list[list[int]] = []
    real = view._or_fields

    def or_fields(w, lo, hi, shifts, masks, out):
        seen.append(shifts.tolist())
        return real(w, lo, hi, shifts, masks, out)

    monkeypatch.setattr(view, "_or_fields", or_fields)
    views = layout.views(raw, layout.word)
    planes = layout.split(raw, layout.word)
    for f, v, plane in zip(layout.fields, views, planes):
        assert v.bits == int(np.bitwise_or.reduce(plane)), f.label
    # the mantissa's bits come from the window; fp32's lower bytes still need their pass
    want = [[8, 0]] * (-(-words.size // view.PIECE)) if layout is layouts.FP32 else []
    assert seen == want


def test_fallback_units_start_from_the_word_before() -> None:
    """A unit counted field by field compares its first word with the previous unit's last,
    as the window's units do, whichever way each is counted."""
    f = _weights(4 * view.UNIT, 5)
    f[view.UNIT - 1] = 1.0
    f[view.UNIT:2 * view.UNIT] = 1.0  # this unit repeats: counted field by field
    words = (f.view("<u4") >> 16).astype("<u2")
    shifts, masks = layouts.BF16.shifts_masks(2)
    counts, runs, units, _window = view.window_stats(words, shifts[:2], masks[:2])
    want = _reference(words, shifts[:2], masks[:2])
    assert counts.tolist() == want[0].tolist() and runs.tolist() == want[1].tolist()
    assert units.tolist() == want[2].tolist()
