"""Codec 9, ``rans-seg``: a plane cut into segments, each an S4 rANS stream with its own
frequency table (``spec/codecs.md``, "9 — rans-seg"; format 1.3).

One table per plane (codec 4) fits a plane whose bytes follow one distribution. A flat buffer
holding many parameters (FSDP1's FlatParameter, a flat optimizer partition) is many
distributions end to end, and one table for all of them costs several percent. The writer cuts
such a plane where a new table pays for itself, at multiples of 65,536 symbols, from the
per-unit histograms counted in the writer's one pass over the words; each segment is then an
ordinary codec-4 stream, so the decoder is codec 4's run per segment.
"""

from __future__ import annotations

import bisect
import itertools
import math
import struct

import numpy as np

from s4format import threads
from s4format.codecs.abc import Codec, Encoded, Slicer
from s4format.codecs.rans import HEADER_SIZE as RANS_HEADER
from s4format.codecs.rans import LOG2_BLOCK_MAX, RansCodec
from s4format.codecs.registry import RANS_SEG, register
from s4format.codecs.view import UNIT, PlaneView
from s4format.errors import CodecError
from s4format.jit import kernel

COUNT = struct.Struct("<I")        # segment count k
SEGMENT = struct.Struct("<QQ")     # per segment: symbols, stored bytes of its codec-4 stream
# A segment other than the last holds a multiple of UNIT symbols (the writer's histogram
# unit): it bounds the segment count by the plane's length, so no payload makes the decoder
# loop over more segments than 65,536ths of the plane.
SEGMENT_UNIT = UNIT

_RANS = RansCodec()


class RansSegCodec(Codec):
    codec_id = RANS_SEG
    name = "rans-seg"
    counts_estimate = True

    def encode(self, plane: np.ndarray) -> Encoded | None:
        return self.encode_view(PlaneView.of(plane))

    def encode_view(self, view: PlaneView) -> Encoded | None:
        """The plane in the segments :func:`segments` chooses; None where that is one segment
        (codec 4 stores the same with less)."""
        bounds = segments(view)
        if bounds is None:
            return None
        units = view.units
        parts = [_sub_view(view, units, a, b) for a, b in itertools.pairwise(bounds.tolist())]
        streams = threads.pool().map(_RANS.encode_view, parts) if len(parts) > 1 else \
            [_RANS.encode_view(parts[0])]
        head = [COUNT.pack(len(parts))]
        head += [SEGMENT.pack(p.size, s.nbytes) for p, s in zip(parts, streams)]
        return Encoded(np.concatenate([np.frombuffer(b"".join(head), np.uint8)]
                                      + [np.asarray(s.payload, np.uint8).reshape(-1)
                                         if not isinstance(s.payload, bytes)
                                         else np.frombuffer(s.payload, np.uint8)
                                         for s in streams]))

    def estimate_view(self, view: PlaneView) -> int | None:
        """Stored size predicted from the segments' histograms (codec 4's estimate of each,
        plus the segment table); None where the plane stays one segment."""
        bounds = segments(view)
        if bounds is None:
            return None
        units = view.units
        total = COUNT.size + SEGMENT.size * (bounds.size - 1)
        for a, b in itertools.pairwise(bounds.tolist()):
            counts = units[a // UNIT:-(-b // UNIT)].sum(axis=0, dtype=np.int64)
            total += _RANS.estimate_counts(counts, b - a)
        return total

    def estimate(self, plane: np.ndarray) -> int | None:
        return self.estimate_view(PlaneView.of(plane))

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        if params:
            raise CodecError(f"rans-seg takes no parameters, got {len(params)} bytes")
        buf = np.frombuffer(payload, np.uint8) if isinstance(payload, bytes | bytearray) \
            else np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        table = _segment_table(buf, decoded_len)
        out = np.empty(decoded_len, np.uint8)

        def one(seg: tuple[int, int, int, int]) -> None:
            i, at, lo, n = seg
            stored = table[i][1]
            try:
                out[lo:lo + n] = _RANS.decode(buf[at:at + stored], n, b"")
            except CodecError as exc:
                raise CodecError(f"rans-seg segment {i} of {len(table)}: {exc}") from None

        segs, at, lo = [], COUNT.size + SEGMENT.size * len(table), 0
        for i, (n, stored) in enumerate(table):
            segs.append((i, at, lo, n))
            at, lo = at + stored, lo + n
        if len(segs) > 1:
            threads.pool().map(one, segs)
        else:
            one(segs[0])
        return out

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        """Slices from the segments' codec-4 slicers, so a reader merges a flat buffer piece by
        piece as it does one table's plane (a segment without one, or with blocks larger than
        the segment unit, is decoded whole first); None where the table or such a segment is
        corrupt."""
        buf = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        if params:
            return None
        try:
            table = _segment_table(buf, decoded_len)
        except CodecError:
            return None
        subs, starts = [], []
        at, lo = COUNT.size + SEGMENT.size * len(table), 0
        for n, stored in table:
            sub = _RANS.slicer(buf[at:at + stored], n, b"")
            if sub is None or sub.align > SEGMENT_UNIT:
                # a CONST segment of 2^20-symbol blocks, say: decoded whole, it slices anywhere
                try:
                    whole = _RANS.decode(buf[at:at + stored], n, b"")
                except CodecError:
                    return None
                sub = Slicer(1, lambda a, b, w=whole: w[a:b])
            subs.append(sub)
            starts.append(lo)
            at, lo = at + stored, lo + n

        def get(lo: int, hi: int) -> np.ndarray | None:
            parts = []
            i = bisect.bisect_right(starts, lo) - 1
            while lo < hi:
                end = min(hi, starts[i] + table[i][0])
                part = subs[i].get(lo - starts[i], end - starts[i])
                if part is None:
                    return None
                parts.append(part)
                lo, i = end, i + 1
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        return Slicer(max(s.align for s in subs), get)

    def max_decoded_len(self, stored_len: int) -> int:
        # Densest: one segment holding a CONST stream, one stored byte per 2**20 symbols.
        return max(0, stored_len - COUNT.size - SEGMENT.size - RANS_HEADER) << LOG2_BLOCK_MAX


def _segment_table(buf: np.ndarray, decoded_len: int) -> list[tuple[int, int]]:
    """(symbols, stored bytes) per segment, checked against the payload and the plane."""
    if buf.size < COUNT.size:
        raise CodecError(f"rans-seg payload of {buf.size} bytes is shorter than its count")
    (k,) = COUNT.unpack_from(buf[:COUNT.size].tobytes())
    if k == 0:
        raise CodecError("rans-seg payload holds 0 segments")
    body = COUNT.size + SEGMENT.size * k
    if body > buf.size:
        raise CodecError(f"rans-seg segment table of {k} segments needs {body} bytes, the "
                         f"payload has {buf.size}")
    fields = np.frombuffer(buf[COUNT.size:body].tobytes(), "<u8").reshape(k, 2)
    zero = np.flatnonzero(fields[:, 0] == 0)
    if zero.size:
        raise CodecError(f"rans-seg segment {int(zero[0])} holds 0 symbols")
    odd = np.flatnonzero(fields[:-1, 0] % SEGMENT_UNIT)
    if odd.size:
        i = int(odd[0])
        raise CodecError(f"rans-seg segment {i} holds {int(fields[i, 0])} symbols, not a "
                         f"multiple of {SEGMENT_UNIT} (only the last segment may)")
    # summed as Python ints: u64 sums may wrap
    symbols = sum(int(n) for n in fields[:, 0].tolist())
    stored = sum(int(n) for n in fields[:, 1].tolist())
    if symbols != decoded_len:
        raise CodecError(f"rans-seg segments hold {symbols} symbols, plane declares "
                         f"{decoded_len}")
    if body + stored != buf.size:
        raise CodecError(f"rans-seg segments store {stored} bytes after a {body}-byte table, "
                         f"the payload has {buf.size}")
    table = [(int(n), int(m)) for n, m in fields.tolist()]
    return table


def segments(view: PlaneView) -> np.ndarray | None:
    """Where the writer cuts the plane (symbol offsets from 0 to its length; memoised on the
    view), or None for one segment: from its per-unit histograms, a unit starts a new segment
    when coding it with its own table (whose bytes count) is estimated to beat coding it with
    the running segment's."""
    if "rans-seg" in view.memo:
        return view.memo["rans-seg"]
    units = view.units
    bounds = None
    if units is not None and units.shape[0] > 1:
        starts = _cut(np.ascontiguousarray(units, dtype=np.int64))
        if starts.size > 1:
            bounds = np.append(starts * UNIT, view.size).astype(np.int64)
    view.memo["rans-seg"] = bounds
    return bounds


def _sub_view(view: PlaneView, units: np.ndarray, a: int, b: int) -> PlaneView:
    counts = units[a // UNIT:-(-b // UNIT)].sum(axis=0, dtype=np.int64)
    present = np.flatnonzero(counts)
    bits = int(np.bitwise_or.reduce(present)) if present.size else 0
    return PlaneView(view.words[a:b], view.shift, view.mask, bits, counts, 0)


# Bytes a segment costs besides its coded symbols: its entry in the segment table, codec 4's
# header, the table's bitmap and padding (its two bytes per present symbol are added apart).
_SEGMENT_FIXED = SEGMENT.size + RANS_HEADER + 32 + 2


@kernel()
def _cut(units):  # pragma: no cover - compiled
    """First unit of each segment (0 first), greedily: unit j joins the running segment unless
    its own order-0 bits plus a table's bytes are below what it adds to the segment's bits."""
    m = units.shape[0]
    starts = np.empty(m, np.int64)
    starts[0] = 0
    k = 1
    seg = units[0].astype(np.float64)
    seg_bits = _bits(seg)
    for j in range(1, m):
        u = units[j].astype(np.float64)
        own = _bits(u)
        present = 0
        for s in range(256):
            if u[s] > 0:
                present += 1
        merged = _bits(seg + u)
        if merged - seg_bits > own + 8.0 * (_SEGMENT_FIXED + 2 * present):
            starts[k] = j
            k += 1
            seg = u
            seg_bits = own
        else:
            seg = seg + u
            seg_bits = merged
    return starts[:k]


@kernel(inline="always")
def _bits(h):  # pragma: no cover - compiled
    """Order-0 bits of a histogram: sum of c * log2(N / c)."""
    n = 0.0
    for s in range(256):
        n += h[s]
    if n == 0.0:
        return 0.0
    acc = 0.0
    for s in range(256):
        c = h[s]
        if c > 0:
            acc += c * math.log2(n / c)
    return acc


register(RansSegCodec())
