"""Planes as the CPU coder sees them: a bit field of a tensor's words, read in place, with the
statistics that codec choice needs, gathered in one pass over the words.

A :class:`PlaneView` is field ``(shift, mask)`` of ``words`` (a plane of bytes is its own words,
shift 0, mask 255). Codecs that can code straight from the words (raw, bitpack, bitpack-w, rANS)
never materialise the plane; the others get its bytes from :meth:`PlaneView.bytes`. Its exact
histogram is counted in the first pass where it is nearly always needed (sign and exponent
planes) and otherwise on first use: until then a fixed sample stands in for it, so that the
choice can rule a coder out without counting. Statistics never depend on the thread count:
the words are cut into pieces and samples by size alone.
"""

from __future__ import annotations

import numpy as np

from s4format import threads
from s4format.jit import kernel

# Words per piece of work on a worker (about 1 MiB of fp32 words).
PIECE = 1 << 18
# A plane of at least UNITS_MIN words keeps its histogram per UNIT words too (counted in the
# same pass), from which codec 9 (rans-seg) chooses where a new frequency table pays.
UNIT = 1 << 16
UNITS_MIN = 4 * UNIT
# The sample of a plane not counted yet: this many evenly spaced runs of SAMPLE_CHUNK bytes
# (a plane that fits in them is counted whole).
SAMPLE_CHUNKS, SAMPLE_CHUNK = 32, 2048


class PlaneView:
    """Field ``(shift, mask)`` of the little-endian ``words`` (1-D uint8/16/32/64) with its
    statistics: ``bits``, the OR of all its bytes, and either its histogram ``counts`` (256)
    and ``runs`` (the bytes that equal the byte before or exceed it by one, as in runs and
    counters, which LZ coders shrink), or a sample's (:meth:`share`) until ``counts`` is
    first asked for."""

    __slots__ = ("_bytes", "_counts", "_runs", "_sample", "_units", "bits", "mask", "memo",
                 "shift", "words")

    def __init__(self, words: np.ndarray, shift: int, mask: int, bits: int,
                 counts: np.ndarray | None, runs: int,
                 sample: tuple[np.ndarray, int, int] | None = None,
                 units: np.ndarray | None = None) -> None:
        self.words, self.shift, self.mask, self.bits = words, shift, mask, bits
        self._counts, self._runs, self._sample, self._units = counts, runs, sample, units
        # codec ID -> its encoding of this plane, where an estimate had to encode it whole
        # (a small plane's zstd trial): the encode that follows takes it instead of repeating it
        self.memo: dict = {}
        self._bytes: np.ndarray | None = words if words.dtype == np.uint8 and mask == 0xFF \
            else None

    @classmethod
    def of(cls, plane: np.ndarray) -> PlaneView:
        """A plane of bytes, its statistics counted."""
        plane = np.ascontiguousarray(plane, dtype=np.uint8).reshape(-1)
        return counted(plane, np.zeros(1, np.int64), np.full(1, 0xFF, np.int64))[0]

    @property
    def size(self) -> int:
        return int(self.words.size)

    @property
    def width(self) -> int:
        """Bits the plane's largest byte needs (at least 1)."""
        return max(1, self.bits.bit_length())

    @property
    def counted(self) -> bool:
        return self._counts is not None

    @property
    def counts(self) -> np.ndarray:
        """The exact histogram, counted on first use."""
        if self._counts is None:
            counts, runs, units = field_stats(self.words, np.array([self.shift]),
                                              np.array([self.mask]))
            self._counts, self._runs = counts[0], int(runs[0])
            self._units = None if units is None else units[:, 0]
        return self._counts

    @property
    def units(self) -> np.ndarray | None:
        """The histogram of each UNIT words (int32, units x 256; the last unit may be
        shorter), for planes of at least UNITS_MIN words; else None."""
        self.counts  # noqa: B018 - counted on first use
        return self._units

    @property
    def runs(self) -> int:
        self.counts  # noqa: B018 - counted on first use
        return self._runs

    @property
    def symbols(self) -> int:
        return int(np.count_nonzero(self.counts))

    def share(self) -> tuple[np.ndarray, int, float]:
        """``(histogram, bytes it covers, share of runs)``: the exact ones once counted, else
        the sample's."""
        if self._counts is not None:
            return self._counts, self.size, self._runs / max(1, self.size - 1)
        counts, runs, pairs = self._sample
        return counts, int(counts.sum()), runs / max(1, pairs)

    def bytes_at(self, lo: int, hi: int) -> np.ndarray:
        """The plane's bytes [lo, hi): a slice of :meth:`bytes` once extracted, else extracted
        from those words alone (a sample of a large plane, without extracting all of it)."""
        if self._bytes is not None:
            return self._bytes[lo:hi]
        out = np.empty(hi - lo, np.uint8)
        _extract(self.words[lo:hi], 0, hi - lo, self.shift, self.mask, out)
        return out

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


def counted(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray) -> list[PlaneView]:
    """Views of fields ``(shifts[k], masks[k])`` of ``words``, every histogram counted."""
    counts, runs, units = field_stats(words, shifts, masks)
    return [PlaneView(words, int(shifts[k]), int(masks[k]), _or_of(counts[k]), counts[k],
                      int(runs[k]), units=None if units is None else units[:, k])
            for k in range(shifts.size)]


def sampled(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray, ors: bool = True
            ) -> list[PlaneView]:
    """Views of fields of ``words`` whose histograms are counted on first use: one pass ORs
    each field's bytes, and a sample gives their statistics meanwhile. With ``ors`` False
    there is no pass over the words: each field's width is taken as its mask's, a bound for
    a quick estimate (:func:`s4format.writer.estimate_rough`), whose views are not coded."""
    n = words.size
    if n <= SAMPLE_CHUNKS * SAMPLE_CHUNK:
        return counted(words, shifts, masks)
    k = shifts.size

    def piece(lo: int, hi: int) -> np.ndarray:
        out = np.zeros(k, np.uint64)
        _or_fields(words, lo, hi, shifts, masks, out)
        return out

    bits = np.zeros(k, np.uint64) if ors else masks.astype(np.uint64)
    if ors:
        for part in threads.pool().map(lambda lo: piece(lo, min(n, lo + PIECE)),
                                       range(0, n, PIECE)):
            bits |= part
    counts = np.zeros((k, 4, 256), np.int64)
    runs = np.zeros(k, np.int64)
    _count_sample(words, sample_starts(n), SAMPLE_CHUNK, shifts, masks, counts, runs)
    sums, pairs = counts.sum(axis=1), SAMPLE_CHUNKS * (SAMPLE_CHUNK - 1)
    return [PlaneView(words, int(shifts[j]), int(masks[j]), int(bits[j]), None, 0,
                      (sums[j], int(runs[j]), pairs)) for j in range(k)]


def sample_starts(n: int, chunks: int = SAMPLE_CHUNKS, chunk: int = SAMPLE_CHUNK
                  ) -> np.ndarray:
    """Where a sample of ``chunks`` evenly spaced runs of ``chunk`` of ``n`` words (more than
    ``chunks * chunk``) starts its runs."""
    return np.linspace(0, n - chunk, chunks).astype(np.int64)


def sample_words(words: np.ndarray, chunks: int, chunk: int) -> np.ndarray:
    """The words of the sample of :func:`sample_starts`, in order (a copy)."""
    runs = sample_starts(words.size, chunks, chunk)[:, None] + np.arange(chunk)
    return words[runs].reshape(-1)


def _or_of(counts: np.ndarray) -> int:
    present = np.flatnonzero(counts)
    return int(np.bitwise_or.reduce(present)) if present.size else 0


def field_stats(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per field ``(shifts[k], masks[k])`` of ``words``: its histogram (k x 256), runs, and
    for at least UNITS_MIN words the histogram of each UNIT words (units x k x 256, int32)."""
    k = shifts.size
    n = words.size
    units = np.zeros((-(-n // UNIT), k, 256), np.int32) if n >= UNITS_MIN else None

    def piece(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        counts = np.zeros((k, 4, 256), np.int64)
        runs = np.zeros(k, np.int64)
        if units is None:
            _count_fields(words, lo, hi, shifts, masks, counts, runs)
            return counts.sum(axis=1), runs
        # pieces start on unit bounds (PIECE % UNIT == 0)
        _count_units(words, lo, hi, shifts, masks, counts, runs, units)
        return units[lo // UNIT:-(-hi // UNIT)].sum(axis=0, dtype=np.int64), runs

    if n <= PIECE:
        counts, runs = piece(0, n)
        return counts, runs, units
    parts = threads.pool().map(lambda lo: piece(lo, min(n, lo + PIECE)), range(0, n, PIECE))
    return sum(p[0] for p in parts), sum(p[1] for p in parts), units


# Four interleaved histograms per field: a plane of few symbols (an exponent plane) would
# otherwise wait on the increment of the same counter, element after element. A one-bit field
# (a sign) is counted by adding its bits instead, a loop that vectorises (4 times faster).
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
        if m == 1:
            ones, run = _count_bits(words, i, hi, s)
            h0[1] += ones
            h0[0] += hi - i - ones
            runs[f] += run
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
def _count_units(words, lo, hi, shifts, masks, counts, runs, units
                 ):  # pragma: no cover - compiled
    for a in range(lo, hi, UNIT):
        counts[:] = 0
        _count_fields(words, a, min(hi, a + UNIT), shifts, masks, counts, runs)
        u = a // UNIT
        for f in range(shifts.size):
            for s in range(256):
                units[u, f, s] = counts[f, 0, s] + counts[f, 1, s] + counts[f, 2, s] \
                    + counts[f, 3, s]


@kernel()
def _count_sample(words, starts, chunk, shifts, masks, counts, runs
                  ):  # pragma: no cover - compiled
    for start in starts:
        _count_fields(words[start:start + chunk], 0, chunk, shifts, masks, counts, runs)


@kernel(inline="always")
def _count_bits(words, lo, hi, s):  # pragma: no cover - compiled
    """(ones, runs) of bit s of words[lo:hi] (lo >= 1: each bit is compared with the one
    before)."""
    ones, run = np.uint64(0), np.uint64(0)
    one, sh = np.uint64(1), np.uint64(s)
    for j in range(np.uint64(lo), np.uint64(hi)):
        a = (np.uint64(words[j]) >> sh) & one
        ones += a
        run += np.uint64(a >= (np.uint64(words[j - one]) >> sh) & one)  # not a fall 1 -> 0
    return np.int64(ones), np.int64(run)


@kernel()
def _extract(words, lo, hi, shift, mask, out):  # pragma: no cover - compiled
    sh, mk = np.uint64(shift), np.uint64(mask)
    for i in range(np.uint64(lo), np.uint64(hi)):
        out[i] = (np.uint64(words[i]) >> sh) & mk


@kernel()
def _or_fields(words, lo, hi, shifts, masks, out):  # pragma: no cover - compiled
    for f in range(shifts.size):
        sh, acc = np.uint64(shifts[f]), np.uint64(0)
        for i in range(np.uint64(lo), np.uint64(hi)):
            acc |= np.uint64(words[i]) >> sh
        out[f] |= acc & np.uint64(masks[f])
