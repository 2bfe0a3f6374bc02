"""Fields counted field by field (``view._count_fields``, which counts two wide fields in one
pass where runs go by vectors, words of 2 and 4 bytes; one at a time with their runs for 1 and
8): every field's histogram and runs match numpy's, whatever the number of fields, one-bit
fields between them, the word size and the range counted."""

from __future__ import annotations

import numpy as np
import pytest

from s4format.codecs import view


def _reference(words: np.ndarray, lo: int, hi: int, shifts: list[int], masks: list[int]
               ) -> tuple[np.ndarray, np.ndarray]:
    counts, runs = [], []
    for s, m in zip(shifts, masks):
        plane = ((words.astype(np.uint64) >> np.uint64(s)) & np.uint64(m)).astype(np.int64)
        counts.append(np.bincount(plane[lo:hi], minlength=256))
        # a run: a field equal to the one before it, or one more (the word before lo counts
        # as before)
        a = max(lo, 1)
        step = plane[a:hi] - plane[a - 1:hi - 1]
        runs.append(int(np.count_nonzero((step == 0) | (step == 1))) if hi > a else 0)
    return np.array(counts), np.array(runs)


FIELDS = {
    1: [([0], [255]), ([0, 4], [15, 15]), ([7, 0], [1, 127])],
    2: [([15, 7, 0], [1, 255, 127]), ([7, 0], [255, 127]), ([10, 0, 15], [31, 255, 1]),
        ([15, 10, 0], [1, 31, 255])],
    4: [([31, 23, 16, 8, 0], [1, 255, 127, 255, 255]), ([23, 16, 8], [255, 127, 255]),
        ([31, 23], [1, 255])],
    8: [([63, 52, 44, 36, 28, 20, 12, 4], [1, 255, 255, 255, 255, 255, 255, 15])],
}


@pytest.mark.parametrize("size", sorted(FIELDS))
@pytest.mark.parametrize("span", ["whole", "from 5", "tiny", "three", "empty"])
def test_fields_counted_match_numpy(size: int, span: str) -> None:
    rng = np.random.default_rng(size)
    n = 10_003
    words = rng.integers(0, 1 << 63, n, dtype=np.uint64).astype(np.dtype(f"<u{size}"))
    words[100:3000] = words[100]  # a stretch of one value: runs, and one counter hammered
    words[4000:4500] &= words.dtype.type(0x0F0F0F0F0F0F0F0F & ((1 << (8 * size)) - 1))
    lo, hi = {"whole": (0, n), "from 5": (5, n - 2), "tiny": (0, 1), "three": (7, 10),
              "empty": (9, 9)}[span]
    for shifts, masks in FIELDS[size]:
        counts = np.zeros((len(shifts), 4, 256), np.int64)
        runs = np.zeros(len(shifts), np.int64)
        view._count_fields(words, lo, hi, np.array(shifts, np.int64), np.array(masks, np.int64),
                           counts, runs)
        want_counts, want_runs = _reference(words, lo, hi, shifts, masks)
        assert np.array_equal(counts.sum(axis=1), want_counts), (shifts, masks)
        assert np.array_equal(runs, want_runs), (shifts, masks)
