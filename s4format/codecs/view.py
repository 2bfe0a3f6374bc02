"""Planes as the CPU coder sees them: a bit field of a tensor's words, read in place, with the
statistics that codec choice needs, gathered in one pass over the words.

A :class:`PlaneView` is field ``(shift, mask)`` of ``words`` (a plane of bytes is its own words,
shift 0, mask 255). Codecs that can code straight from the words (raw, bitpack, bitpack-w, rANS)
never materialise the plane; the others get its bytes from :meth:`PlaneView.bytes`. The
statistics are exact whatever the thread count: the words are cut into pieces by size alone.
"""

from __future__ import annotations

import numpy as np

from s4format import threads
from s4format.jit import kernel

# Words per piece of work on a worker (about 1 MiB of fp32 words).
PIECE = 1 << 18


class PlaneView:
    """Field ``(shift, mask)`` of the little-endian ``words`` (1-D uint8/16/32/64), with its
    byte histogram ``counts`` (256) and ``runs``: the bytes that equal the byte before or
    exceed it by one (as in runs and counters, which LZ coders shrink)."""

    __slots__ = ("_bytes", "counts", "mask", "runs", "shift", "words")

    def __init__(self, words: np.ndarray, shift: int, mask: int, counts: np.ndarray,
                 runs: int) -> None:
        self.words, self.shift, self.mask = words, shift, mask
        self.counts, self.runs = counts, runs
        self._bytes: np.ndarray | None = words if words.dtype == np.uint8 and mask == 0xFF \
            else None

    @classmethod
    def of(cls, plane: np.ndarray) -> PlaneView:
        """A plane of bytes, its statistics counted."""
        plane = np.ascontiguousarray(plane, dtype=np.uint8).reshape(-1)
        counts, runs = field_stats(plane, np.zeros(1, np.int64), np.full(1, 0xFF, np.int64))
        return cls(plane, 0, 0xFF, counts[0], int(runs[0]))

    @property
    def size(self) -> int:
        return int(self.words.size)

    @property
    def max_symbol(self) -> int:
        present = np.flatnonzero(self.counts)
        return int(present[-1]) if present.size else 0

    @property
    def symbols(self) -> int:
        return int(np.count_nonzero(self.counts))

    def bytes(self) -> np.ndarray:
        """The plane's bytes (uint8, contiguous), extracted from the words on first use."""
        if self._bytes is None:
            out = np.empty(self.size, np.uint8)
            run_pieces(lambda lo, hi: _extract(self.words, lo, hi, self.shift, self.mask, out),
                       self.size, 4 * PIECE)
            self._bytes = out
        return self._bytes


def run_pieces(fn, n: int, piece: int) -> None:
    """``fn(lo, hi)`` over ``[0, n)`` cut into pieces of ``piece``, across the worker pool."""
    if n <= piece:
        fn(0, n)
        return
    threads.pool().map(lambda lo: fn(lo, min(n, lo + piece)), range(0, n, piece))


def field_stats(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per field ``(shifts[k], masks[k])`` of ``words``: its histogram (k x 256) and runs."""
    k = shifts.size

    def piece(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        counts = np.zeros((k, 4, 256), np.int64)
        runs = np.zeros(k, np.int64)
        _count_fields(words, lo, hi, shifts, masks, counts, runs)
        return counts.sum(axis=1), runs

    n = words.size
    if n <= PIECE:
        return piece(0, n)
    parts = threads.pool().map(lambda lo: piece(lo, min(n, lo + PIECE)), range(0, n, PIECE))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


# Four interleaved histograms per field: a plane of few symbols (an exponent plane) would
# otherwise wait on the increment of the same counter, element after element.
@kernel()
def _count_fields(words, lo, hi, shifts, masks, counts, runs):  # pragma: no cover - compiled
    for f in range(shifts.size):
        s, m = shifts[f], masks[f]
        h0, h1, h2, h3 = counts[f, 0], counts[f, 1], counts[f, 2], counts[f, 3]
        i = lo
        if i == 0 and hi > 0:
            h0[(np.int64(words[0]) >> s) & m] += 1
            i = 1
        if i >= hi:
            continue
        p = (np.int64(words[i - 1]) >> s) & m
        run = 0
        while i + 3 < hi:
            a = (np.int64(words[i]) >> s) & m
            b = (np.int64(words[i + 1]) >> s) & m
            c = (np.int64(words[i + 2]) >> s) & m
            d = (np.int64(words[i + 3]) >> s) & m
            h0[a] += 1
            h1[b] += 1
            h2[c] += 1
            h3[d] += 1
            # (an unsigned difference of 0 or 1: the byte repeats or counts up)
            run += (np.uint64(a - p) <= 1) + (np.uint64(b - a) <= 1) \
                + (np.uint64(c - b) <= 1) + (np.uint64(d - c) <= 1)
            p = d
            i += 4
        while i < hi:
            a = (np.int64(words[i]) >> s) & m
            h0[a] += 1
            run += np.uint64(a - p) <= 1
            p = a
            i += 1
        runs[f] += run


@kernel()
def _extract(words, lo, hi, shift, mask, out):  # pragma: no cover - compiled
    sh, mk = np.uint64(shift), np.uint64(mask)
    for i in range(np.uint64(lo), np.uint64(hi)):
        out[i] = (np.uint64(words[i]) >> sh) & mk
