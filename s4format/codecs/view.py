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

import functools

import numpy as np

from s4format import threads
from s4format.jit import constant, intrinsic, kernel

# Words per piece of work on a worker (4 MiB of fp32 words). Each piece costs Python between
# its kernels: on 2 cores, pieces of 2^20 words loaded MiniLM-L6 fp32 in 0.042-0.043 s against
# 0.045-0.047 s with pieces of 2^18 (bench/cpu_speed.py, 2026-12-07).
PIECE = 1 << 20
# A plane of at least UNITS_MIN words keeps its histogram per UNIT words too (counted in the
# same pass), from which codec 9 (rans-seg) chooses where a new frequency table pays.
UNIT = 1 << 16
UNITS_MIN = 4 * UNIT
# A plane of bytes up to this long is counted in one call of its own kernel: the piecewise
# counting's calls cost more (a small tensor's one plane: 0.8 us for 256 bytes, against 4.3 by
# numpy and 9.9 by the pieces).
SMALL_PLANE = 4096
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
                 "shift", "size", "words")

    def __init__(self, words: np.ndarray, shift: int, mask: int, bits: int,
                 counts: np.ndarray | None, runs: int,
                 sample: tuple[np.ndarray, int, int] | None = None,
                 units: np.ndarray | None = None) -> None:
        self.words, self.shift, self.mask, self.bits = words, shift, mask, bits
        self.size = int(words.size)  # (asked for a dozen times a plane by the policy)
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
        if plane.size <= SMALL_PLANE:
            counts = np.zeros(256, np.int64)
            runs, bits = _small_stats(plane, counts)
            return cls(plane, 0, 0xFF, int(bits), counts, int(runs))
        return counted(plane, np.zeros(1, np.int64), np.full(1, 0xFF, np.int64))[0]

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
                       self.size, PIECE)
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
    return counted_window(words, shifts, masks)[0]


def counted_window(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray
                   ) -> tuple[list[PlaneView], tuple[int, int] | None]:
    """:func:`counted`, and where the fields were counted through 16 bits of each word, the
    ``(low, ors)`` of :func:`window_stats`."""
    counts, runs, units, window = window_stats(words, shifts, masks)
    ors = _ors_of(counts)
    return [PlaneView(words, int(shifts[k]), int(masks[k]), ors[k], counts[k],
                      int(runs[k]), units=None if units is None else units[:, k])
            for k in range(shifts.size)], window


def sampled(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray, ors: bool = True,
            window: tuple[int, int] | None = None) -> list[PlaneView]:
    """Views of fields of ``words`` whose histograms are counted on first use: one pass ORs
    each field's bytes, and a sample gives their statistics meanwhile. With ``ors`` False
    there is no pass over the words: each field's width is taken as its mask's, a bound for
    a quick estimate (:func:`s4format.writer.estimate_rough`), whose views are not coded.
    ``window``: the ``(low, ors, hist)`` of other fields counted through 16 bits of the same
    words (:func:`counted_window`), which give the OR of any field inside those bits, and
    where their histogram ``hist`` was kept, its histogram: such fields are counted exactly,
    from it."""
    n = words.size
    k = shifts.size
    inside = np.zeros(k, bool)
    if window is not None:
        low, window_ors, hist = window
        inside = (shifts >= low) & (shifts + _widths(masks) <= low + WINDOW_BITS)
        if hist is not None and inside.any():
            views: list[PlaneView] = [None] * k  # type: ignore[list-item]
            at = np.flatnonzero(inside)
            counts = np.zeros((at.size, 256), np.int64)
            runs = np.zeros(at.size, np.int64)
            _window_fields(hist, shifts[at] - low, masks[at], words, shifts[at], counts, runs)
            ors = _ors_of(counts)
            for i, j in enumerate(at.tolist()):
                views[j] = PlaneView(words, int(shifts[j]), int(masks[j]), ors[i], counts[i],
                                     int(runs[i]))
            rest = np.flatnonzero(~inside)
            if rest.size:
                for j, v in zip(rest.tolist(), sampled(words, shifts[rest], masks[rest], ors)):
                    views[j] = v
            return views
    if n <= SAMPLE_CHUNKS * SAMPLE_CHUNK:
        return counted(words, shifts, masks)
    bits = np.zeros(k, np.uint64) if ors else masks.astype(np.uint64)
    rest = np.arange(k)
    if ors and window is not None:
        for j in np.flatnonzero(inside).tolist():
            bits[j] = (window_ors >> (int(shifts[j]) - low)) & int(masks[j])
        rest = np.flatnonzero(~inside)
    if ors and rest.size:
        rest_shifts, rest_masks = shifts[rest], masks[rest]

        def piece(lo: int, hi: int) -> np.ndarray:
            out = np.zeros(rest.size, np.uint64)
            _or_fields(words, lo, hi, rest_shifts, rest_masks, out)
            return out

        for part in threads.pool().map(lambda lo: piece(lo, min(n, lo + PIECE)),
                                       range(0, n, PIECE)):
            bits[rest] |= part
    counts = np.zeros((k, 4, 256), np.int64)
    runs = np.zeros(k, np.int64)
    _count_sample(words, sample_starts(n), SAMPLE_CHUNK, shifts, masks, counts, runs)
    sums, pairs = counts.sum(axis=1), SAMPLE_CHUNKS * (SAMPLE_CHUNK - 1)
    return [PlaneView(words, int(shifts[j]), int(masks[j]), int(bits[j]), None, 0,
                      (sums[j], int(runs[j]), pairs)) for j in range(k)]


def sample_starts(n: int, chunks: int = SAMPLE_CHUNKS, chunk: int = SAMPLE_CHUNK
                  ) -> np.ndarray:
    """Where a sample of ``chunks`` evenly spaced runs of ``chunk`` of ``n`` words (more than
    ``chunks * chunk``) starts its runs (a new array)."""
    return _sample_starts(n, chunks, chunk).copy()


@functools.lru_cache(maxsize=1024)
def _sample_starts(n: int, chunks: int, chunk: int) -> np.ndarray:
    # (a checkpoint's tensors come in a few sizes, and linspace takes about 5 us a call: once a
    # tensor in the writer's Python of 0.1-0.3 ms)
    return np.linspace(0, n - chunk, chunks).astype(np.int64)


def sample_words(words: np.ndarray, chunks: int, chunk: int) -> np.ndarray:
    """The words of the sample of :func:`sample_starts`, in order (a copy)."""
    # (slices joined: an index array of the runs' words took 21 against 6 us for 16 runs of
    # 1,024, a call per large tensor of a delta save)
    return np.concatenate([words[s:s + chunk]
                           for s in _sample_starts(words.size, chunks, chunk).tolist()])


def _widths(masks: np.ndarray) -> np.ndarray:
    """The bits of each field mask (of the form 2**b - 1)."""
    return np.array([int(m).bit_length() for m in masks.tolist()], np.int64)


def chance_runs(counts: np.ndarray, m: int) -> float:
    """How often independent draws from the histogram ``counts`` of ``m`` bytes repeat the
    byte before or exceed it by one: ``sum(p[s] * (p[s] + p[s - 1]))``, p = counts / m."""
    return _chance_runs(counts, m)


@kernel()
def _chance_runs(counts, m):  # pragma: no cover - compiled
    """:func:`chance_runs` in one call (numpy's took five: a tenth of ranking a plane)."""
    same, up, before = 0.0, 0.0, 0.0
    for s in range(counts.size):
        p = counts[s] / m
        same += p * p
        up += p * before
        before = p
    return same + up


def _ors_of(counts: np.ndarray) -> list[int]:
    """The OR of the bytes present in each histogram of ``counts`` (k x 256)."""
    ors = np.zeros(counts.shape[0], np.int64)
    _present_ors(counts, ors)
    return ors.tolist()


@kernel()
def _present_ors(counts, ors):  # pragma: no cover - compiled
    """Into ``ors[f]``, the OR of the bytes counted in ``counts[f]`` (one call for all the
    fields: numpy's took two calls a field, a third of a small tensor's views)."""
    for f in range(counts.shape[0]):
        for s in range(256):
            if counts[f, s]:
                ors[f] |= s


def field_stats(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per field ``(shifts[k], masks[k])`` of ``words``: its histogram (k x 256), runs, and
    for at least UNITS_MIN words the histogram of each UNIT words (units x k x 256, int32)."""
    counts, runs, units, _ors = window_stats(words, shifts, masks)
    return counts, runs, units


def window_of(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray) -> int | None:
    """The lowest bit of the 16 bits of each word that :func:`_count_window` counts the fields
    ``(shifts, masks)`` of ``words`` through (as low as they allow, so that the bits below the
    fields spread the counts); None where it does not: words of one byte, fewer than
    WINDOW_MIN of them, one field, or fields that those 16 bits do not hold from bit
    WINDOW_BELOW up."""
    if words.itemsize == 1 or words.size < WINDOW_MIN:
        return None
    at, widths = shifts.tolist(), masks.tolist()  # (numpy's scalars cost more, one by one)
    top = max(s + m.bit_length() for s, m in zip(at, widths))
    low = max(0, top - WINDOW_BITS)
    return low if len(at) > 1 and min(at) >= low + WINDOW_BELOW else None


def window_stats(words: np.ndarray, shifts: np.ndarray, masks: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int] | None]:
    """:func:`field_stats`, and ``(low, ors)`` where the fields were counted through the 16
    bits of each word from bit ``low`` (:func:`window_of`): ``ors`` is the OR of those 16 bits
    over the words, from which any other field inside them has its ``bits`` (else None)."""
    k = shifts.size
    n = words.size
    units = np.zeros((-(-n // UNIT), k, 256), np.int32) if n >= UNITS_MIN else None
    low = window_of(words, shifts, masks)
    if low is not None:
        no_units, no_hist = np.zeros((0, k, 256), np.int32), np.zeros(0, np.int32)

        def part(lo: int, hi: int, hist: np.ndarray = no_hist
                 ) -> tuple[np.ndarray, np.ndarray, int, bool]:
            counts = np.zeros((k, 256), np.int64)
            runs = np.zeros(k, np.int64)
            ors, kept = _count_window(words, lo, hi, low, shifts, masks, counts, runs,
                                      no_units if units is None else units, hist)
            return counts, runs, ors, kept

        if n <= PIECE and units is None:
            # (one part: its histogram of the 16 bits is kept, which counts any other field
            # inside them without another pass, :func:`sampled`)
            hist = np.zeros(1 << WINDOW_BITS, np.int32)
            counts, runs, ors, kept = part(0, n, hist)
            return counts, runs, None, (low, int(ors), hist if kept else None)

        parts = [part(0, n)] if n <= PIECE else threads.pool().map(
            lambda lo: part(lo, min(n, lo + PIECE)), range(0, n, PIECE))
        ors = 0
        for p in parts:
            ors |= int(p[2])
        return (sum(p[0] for p in parts), sum(p[1] for p in parts), units,
                (low, ors, None))

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
        return counts, runs, units, None
    parts = threads.pool().map(lambda lo: piece(lo, min(n, lo + PIECE)), range(0, n, PIECE))
    return sum(p[0] for p in parts), sum(p[1] for p in parts), units, None


# Words of two bytes or more count their fields through one histogram of 16 bits of each word,
# the fields' and the bits below them, from which each field's histogram is then summed: one
# increment a word for all fields, where a field's own increments wait on each other when its
# values repeat (an exponent's do), and the bits below spread them over 65,536 counters.
# MiniLM-L6's bf16 weights on one thread: 0.81-0.87 ns a word for the sign and exponent with
# their runs, against 1.35 field by field. Below WINDOW_MIN words the sums cost more than
# they save.
WINDOW_BITS = 16
WINDOW_MIN = 1 << 16
# ... for two fields or more (one field of random bytes, such as a low mantissa byte, spreads
# its own counts, and 65,536 counters then miss the first-level cache), none of them starting
# below this bit of the 16 (the sums over the bits below take one pass then).
WINDOW_BELOW = 6


@kernel()
def _small_stats(plane, counts):  # pragma: no cover - compiled
    """The histogram of the bytes ``plane`` (added to ``counts``), and (their runs, their
    OR): a run is a byte equal to the one before or one above it."""
    runs, bits, before = 0, 0, -2
    for i in range(plane.size):
        b = np.int64(plane[i])
        counts[b] += 1
        bits |= b
        runs += (b == before) | (b == before + 1)
        before = b
    return runs, bits


@kernel()
def _count_window(words, lo, hi, low, shifts, masks, counts, runs, units, given
                  ):  # pragma: no cover - compiled
    """Histograms (into ``counts``, k x 256, zeroed) and runs (added to ``runs``) of the
    fields of words[lo:hi], and with ``units`` not empty each UNIT words' histograms (``lo`` a
    multiple of UNIT), counted through bits [low, low + 16) of each word; returns the OR of
    those 16 bits over the words, and whether ``given`` (2^16 zeros, or empty) now holds
    their histogram over every word."""
    k = shifts.size
    hist = given  # (else made for the first unit counted through it)
    every = True  # (no unit counted field by field)
    # (the histogram summed over the bits below the lowest field, from which each field's is)
    below = np.uint64(shifts.min() - low)
    coarse = np.zeros((1 << WINDOW_BITS) >> below, np.int64)
    seen = np.zeros((k, 256), np.int64)  # what hist held at the last unit's end
    direct = np.zeros((k, 256), np.int64)  # the units counted field by field
    four = np.zeros((k, 4, 256), np.int64)
    sh, m16 = np.uint64(low), np.uint64((1 << WINDOW_BITS) - 1)
    ors = np.uint64(0)
    step = UNIT if units.shape[0] else max(1, hi - lo)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        u = a // UNIT
        if _repeats(words, a, min(b, a + REPEATS_LOOK), sh) > REPEATS_MAX:
            every = False
            four[:] = 0
            _count_fields(words, a, b, shifts, masks, four, runs)
            for f in range(k):
                for s in range(256):
                    c = four[f, 0, s] + four[f, 1, s] + four[f, 2, s] + four[f, 3, s]
                    direct[f, s] += c
                    if units.shape[0]:
                        units[u, f, s] = c
            for i in range(np.uint64(a), np.uint64(b)):
                ors |= np.uint64(words[i])
            continue
        if hist.size == 0:
            hist = np.zeros(1 << WINDOW_BITS, np.int32)
        for i in range(np.uint64(a), np.uint64(b)):
            hist[(np.uint64(words[i]) >> sh) & m16] += 1
        for f in range(k):
            runs[f] += _field_runs(words, max(a, 1), b, shifts[f], masks[f])
        if units.shape[0]:  # (the histogram so far, less what it held before this unit)
            _fields_of(hist, below, coarse, shifts - low, masks, counts)
            for f in range(k):
                for s in range(256):
                    units[u, f, s] = counts[f, s] - seen[f, s]
                    seen[f, s] = counts[f, s]
    ors = (ors >> sh) & m16
    counts[:] = 0
    if hist.size:
        _fields_of(hist, below, coarse, shifts - low, masks, counts)
        for v in range(np.uint64(1 << WINDOW_BITS)):
            ors |= v if hist[v] else np.uint64(0)
    counts += direct
    return ors, every and given.size > 0


@kernel()
def _window_fields(hist, offsets, masks, words, shifts, counts, runs
                   ):  # pragma: no cover - compiled
    """The histograms (into ``counts``, k x 256, zeroed) of fields (offsets[f], masks[f]) of
    the 16-bit values counted in ``hist``, and their runs in ``words`` (at (shifts[f],
    masks[f]), added to ``runs``)."""
    for f in range(offsets.size):
        o, m = np.uint64(offsets[f]), np.uint64(masks[f])
        if o == 0:  # (the field in each value's low bits: rows of the histogram summed)
            width = m + np.uint64(1)
            acc = np.zeros(width, np.int64)
            for r in range(np.uint64(hist.size) // width):
                at = r * width
                for j in range(width):
                    acc[j] += hist[at + j]
            counts[f, :width] = acc
        else:
            for v in range(np.uint64(hist.size)):
                counts[f, (v >> o) & m] += hist[v]
        if words.size > 1:
            runs[f] += _field_runs(words, 1, words.size, shifts[f], masks[f])


# Words of one 16-bit value increment one counter, each waiting on the one before: where one
# value fills a good share of the words (a constant or sparse tensor, a delta's kept words
# that mostly differ in one bit), 65,536 counters counted slower than four interleaved ones per
# field (bf16 words 40% of one value: 1.25 times as long; a constant tensor 2.1 times). A
# unit in whose first REPEATS_LOOK words one value appears more than REPEATS_MAX times is
# counted field by field.
REPEATS_LOOK, REPEATS_MAX = 64, 12


@kernel(inline="always")
def _repeats(words, lo, hi, sh):  # pragma: no cover - compiled
    """How often the most common value of the 16 bits from ``sh`` appears in words[lo:hi]."""
    seen = np.empty(hi - lo, np.uint16)
    for i in range(hi - lo):
        seen[i] = (np.uint64(words[lo + i]) >> sh) & np.uint64((1 << WINDOW_BITS) - 1)
    seen.sort()
    top, run = 0, 0
    for i in range(seen.size):
        run = run + 1 if i and seen[i] == seen[i - 1] else 1
        top = max(top, run)
    return top


@kernel(inline="always")
def _fields_of(hist, below, coarse, offsets, masks, counts):  # pragma: no cover - compiled
    """counts[f] = the histogram of field (offsets[f], masks[f]) of the 16-bit values counted
    in ``hist``, none of whose fields starts below bit ``below``."""
    size = np.uint64(1) << below
    for c in range(np.uint64(coarse.size)):
        t = np.int64(0)
        for j in range(c * size, c * size + size):
            t += hist[j]
        coarse[c] = t
    counts[:] = 0
    for f in range(offsets.size):
        o, m = np.uint64(offsets[f]) - below, np.uint64(masks[f])
        for c in range(np.uint64(coarse.size)):
            counts[f, (c >> o) & m] += coarse[c]


@kernel(inline="always")
def _field_runs(words, lo, hi, shift, mask):  # pragma: no cover - compiled
    """The runs of field (shift, mask) in words[lo:hi] (lo >= 1): words whose field equals
    the word before's or exceeds it by one."""
    s, m, one = np.uint64(shift), np.uint64(mask), np.uint64(1)
    run = np.uint64(0)
    at = np.uint64(lo)
    if _runs_vectors(words):
        step = np.uint64(RUN_BYTES // words.itemsize)
        while at + step <= np.uint64(hi):
            run += _runs_block(words, at, s, m)
            at += step
    for i in range(at, np.uint64(hi)):
        a = (np.uint64(words[i]) >> s) & m
        p = (np.uint64(words[i - one]) >> s) & m
        run += np.uint64(a - p <= one)
    return np.int64(run)


# Four interleaved histograms per field: a plane of few symbols (an exponent plane) would
# otherwise wait on the increment of the same counter, element after element. A one-bit field
# (a sign) is counted by adding its bits instead, a loop that vectorises (4 times faster).
# Where runs are counted by vectors, fields wider than a bit are counted two to a pass (a
# masked delta's kept bf16 exponents and mantissas: 0.48 against 0.63 ms for 518,627 words).
@kernel()
def _count_fields(words, lo, hi, shifts, masks, counts, runs):  # pragma: no cover - compiled
    start = 1 if lo == 0 and hi > 0 else lo
    held = -1  # a field waiting for the next one, to be counted in one pass with it
    for f in range(shifts.size):
        s, m = shifts[f], masks[f]
        if lo == 0 and hi > 0:
            counts[f, 0, (np.int64(words[0]) >> s) & m] += 1
        if start >= hi:
            continue
        if m == 1:
            ones, run = _count_bits(words, start, hi, s)
            counts[f, 0, 1] += ones
            counts[f, 0, 0] += hi - start - ones
            runs[f] += run
            continue
        if _runs_vectors(words):
            # (runs by vectors in a pass of their own, the loop then only counting: a byte
            # field of 11.7M fp32 words in 8.5 against 10.4 ms)
            runs[f] += _field_runs(words, start, hi, s, m)
            if held < 0:
                held = f
            else:
                _count_two(words, start, hi, shifts[held], masks[held], counts[held], s, m,
                           counts[f])
                held = -1
            continue
        runs[f] += _count_one_runs(words, start, hi, s, m, counts[f])
    if held >= 0:
        _count_one(words, start, hi, shifts[held], masks[held], counts[held])


@kernel(inline="always")
def _count_one(words, i, hi, s, m, four):  # pragma: no cover - compiled
    """Add field (s, m) of words[i:hi] to the four histograms ``four``."""
    h0, h1, h2, h3 = four[0], four[1], four[2], four[3]
    while i + 3 < hi:
        h0[(np.int64(words[i]) >> s) & m] += 1
        h1[(np.int64(words[i + 1]) >> s) & m] += 1
        h2[(np.int64(words[i + 2]) >> s) & m] += 1
        h3[(np.int64(words[i + 3]) >> s) & m] += 1
        i += 4
    while i < hi:
        h0[(np.int64(words[i]) >> s) & m] += 1
        i += 1


@kernel(inline="always")
def _count_two(words, i, hi, s, m, four, t, n, other):  # pragma: no cover - compiled
    """:func:`_count_one` of fields (s, m) into ``four`` and (t, n) into ``other``, in one
    pass."""
    h0, h1, h2, h3 = four[0], four[1], four[2], four[3]
    g0, g1, g2, g3 = other[0], other[1], other[2], other[3]
    while i + 3 < hi:
        w0, w1 = np.int64(words[i]), np.int64(words[i + 1])
        w2, w3 = np.int64(words[i + 2]), np.int64(words[i + 3])
        h0[(w0 >> s) & m] += 1
        h1[(w1 >> s) & m] += 1
        h2[(w2 >> s) & m] += 1
        h3[(w3 >> s) & m] += 1
        g0[(w0 >> t) & n] += 1
        g1[(w1 >> t) & n] += 1
        g2[(w2 >> t) & n] += 1
        g3[(w3 >> t) & n] += 1
        i += 4
    while i < hi:
        w = np.int64(words[i])
        h0[(w >> s) & m] += 1
        g0[(w >> t) & n] += 1
        i += 1


@kernel(inline="always")
def _count_one_runs(words, i, hi, s, m, four):  # pragma: no cover - compiled
    """:func:`_count_one` (i >= 1), and the field's runs in the same loop, returned."""
    h0, h1, h2, h3 = four[0], four[1], four[2], four[3]
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
    return run


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


# (the OR of a field is the field of the words' OR: one pass for every field)
@kernel()
def _or_fields(words, lo, hi, shifts, masks, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    for i in range(np.uint64(lo), np.uint64(hi)):
        acc |= np.uint64(words[i])
    for f in range(shifts.size):
        out[f] |= (acc >> np.uint64(shifts[f])) & np.uint64(masks[f])


# A vector of words and one of the words before them: numba widens every integer to 64 bits,
# so its own loop over 16-bit words ran 4 of them a vector (0.31 ns a word and field; the
# sign and exponent of bf16 words 0.62 ns a word, with these vectors 0.14).
RUN_BYTES = 64


def _run_words(words) -> bool:
    """Whether :func:`_runs_block` takes the numba array type ``words``: C-contiguous words of
    2 or 4 bytes, addressed by their data pointer."""
    from numba.core import types

    return isinstance(words, types.Array) and words.layout == "C" and words.ndim == 1 \
        and str(words.dtype) in ("uint16", "uint32")


@intrinsic
def _runs_vectors(typingctx, words):  # pragma: no cover - compiled
    """True (a constant) where :func:`_runs_block` takes ``words``."""
    from numba.core import types

    ok = _run_words(words)
    return types.boolean(words), constant(lambda _context: ok)


@intrinsic
def _runs_block(typingctx, words, at, shift, mask):  # pragma: no cover - compiled
    """The runs of field (shift, mask) among the RUN_BYTES of words from ``at`` (>= 1), each
    compared with the word before: one vector of them and one of those before, in the words'
    own width (any CPU: LLVM splits a vector wider than the target's)."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        tw = signature.args[0]
        words_a, at, shift, mask = args
        if not _run_words(tw):
            return ir.Constant(ir.IntType(64), 0)  # (never run: _runs_vectors() is False)
        bits = tw.dtype.bitwidth
        lanes = RUN_BYTES * 8 // bits
        it = ir.IntType(bits)
        vec = ir.VectorType(it, lanes)
        ptr = context.make_array(tw)(context, builder, words_a).data

        def load(i):
            return builder.load(builder.bitcast(builder.gep(ptr, [i]), vec.as_pointer()),
                                align=1)

        def splat(value):
            one = builder.insert_element(ir.Constant(vec, None), builder.trunc(value, it),
                                         ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(one, ir.Constant(vec, None),
                                          ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                      [0] * lanes))

        s, m = splat(shift), splat(mask)
        cur = builder.and_(builder.lshr(load(at), s), m)
        before = builder.and_(builder.lshr(load(builder.sub(at, ir.Constant(at.type, 1))), s), m)
        step = builder.sub(cur, before)
        ok = builder.icmp_unsigned("<=", step, ir.Constant(vec, [1] * lanes))
        count = builder.ctpop(builder.bitcast(ok, ir.IntType(lanes)))
        return builder.zext(count, ir.IntType(64))

    return types.uint64(words, at, shift, mask), codegen
