"""Codec 9, ``rans-seg``: a plane cut into segments, each stored by a codec of its own among
raw, bitpack, rANS (with its own frequency table) and bitpack-w (``spec/codecs.md``,
"9 — rans-seg"; format 1.3); and codec 10, ``seg-lz``: the same, whose segments may also be
zstd frames ("10 — seg-lz"; format 1.5).

One table per plane (codec 4) fits a plane whose bytes follow one distribution. A flat buffer
holding many parameters (FSDP1's FlatParameter, a flat optimizer partition) is many
distributions end to end: one table for all of them costs several percent, and one codec for
all of them trades the packed codecs' speed for rANS's ratio on the whole plane. The writer
cuts such a plane where a new table pays for itself, at multiples of 65,536 symbols, from the
per-unit histograms counted in the writer's one pass over the words, and codes each segment as
a plane of its own would be (bitpack-w unless rANS saves over 1/65 of it); the decoder runs
the segments' codecs, each on its own range.

Some parts of a flat buffer repeat (an embedding's optimizer moments, zero where a token never
came, a zero-initialised block): there an LZ coder stores below the order-0 bound that rANS is
held to, as it does for such a tensor stored alone. Codec 10 lets those segments be zstd; the
writer tries zstd on a segment only where a sample of its bytes shows runs above chance.
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
from s4format.codecs.registry import (
    BITPACK,
    BITPACK_W,
    NAMES,
    RANS,
    RANS_SEG,
    RAW,
    SEG_LZ,
    ZSTD,
    register,
)
from s4format.codecs.view import UNIT, PlaneView
from s4format.errors import CodecError
from s4format.jit import kernel

COUNT = struct.Struct("<I")        # segment count k
# per segment: symbols, stored bytes, codec ID, bitpack-w's width (else 0), reserved (0)
SEGMENT = struct.Struct("<QQHBBI")
# The codecs a segment may take: each decodes from its bytes alone, at memory speed or rANS's.
SEGMENT_CODECS = (RAW, BITPACK, RANS, BITPACK_W)
# Codec 10's: those and zstd, whose frames decode at LZ speed, one per segment.
LZ_SEGMENT_CODECS = (RAW, BITPACK, ZSTD, RANS, BITPACK_W)
# zstd takes a segment where its estimate is below the segment's order-0 choice by this share:
# below it the order-0 coders' speed wins.
LZ_SEGMENT_GAIN = 1 / 64
# Runs are taken from this many evenly spaced chunks of this many bytes of a longer segment.
_RUN_CHUNKS, _RUN_CHUNK = 4, 2048
# A segment other than the last holds a multiple of UNIT symbols (the writer's histogram
# unit): it bounds the segment count by the plane's length, so no payload makes the decoder
# loop over more segments than 65,536ths of the plane.
SEGMENT_UNIT = UNIT

# (segments keep the default block size: the finer cut of small planes was measured on
# whole planes only)
_RANS = RansCodec(split=False)


class RansSegCodec(Codec):
    codec_id = RANS_SEG
    name = "rans-seg"
    counts_estimate = True
    segment_codecs = SEGMENT_CODECS

    def encode(self, plane: np.ndarray) -> Encoded | None:
        return self.encode_view(PlaneView.of(plane))

    def encode_view(self, view: PlaneView) -> Encoded | None:
        """The plane in the segments :func:`segments` chooses, each coded as
        :func:`_segment_choice` picks; None where that is one segment."""
        parts = _parts(view)
        if parts is None:
            return None
        coded = threads.pool().map(_code_segment, parts) if len(parts) > 1 else \
            [_code_segment(parts[0])]
        return Encoded(assemble([(p.size, c, w, payload) for p, (c, w, payload)
                                 in zip(parts, coded)]))

    def estimate_view(self, view: PlaneView) -> int | None:
        """Stored size predicted from the segments' histograms (each segment's choice at its
        estimate, plus the segment table); None where the plane stays one segment."""
        parts = _parts(view)
        if parts is None:
            return None
        return COUNT.size + sum(SEGMENT.size + _segment_choice(p)[1] for p in parts)

    def estimate(self, plane: np.ndarray) -> int | None:
        return self.estimate_view(PlaneView.of(plane))

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        if params:
            raise CodecError(params_error(len(params), self.name))
        buf = as_bytes(payload)
        table = read_table(buf, decoded_len, self.codec_id)
        out = np.empty(decoded_len, np.uint8)

        def one(i: int) -> None:
            n, at, lo, codec, sp, stored = table[i]
            try:
                out[lo:lo + n] = codec.decode(buf[at:at + stored], n, sp)
            except CodecError as exc:
                raise CodecError(segment_message(i, len(table), codec.name, str(exc),
                                                 self.name)) from None

        if len(table) > 1:
            threads.pool().map(one, range(len(table)))
        else:
            one(0)
        return out

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        """Slices from the segments' slicers, so a reader merges a flat buffer piece by piece
        as it does a plane of one codec (a segment without one, or aligned wider than the
        segment unit, is decoded whole first); None where the table or such a segment is
        corrupt."""
        buf = as_bytes(payload)
        if params:
            return None
        try:
            table = read_table(buf, decoded_len, self.codec_id)
        except CodecError:
            return None
        subs: list[Slicer | None] = []
        for n, at, _lo, codec, sp, size in table:
            sub = codec.slicer(buf[at:at + size], n, sp)
            subs.append(None if sub is None or sub.align > SEGMENT_UNIT else sub)
        whole = [i for i, sub in enumerate(subs) if sub is None]

        def decoded(i: int) -> Slicer | None:
            n, at, _lo, codec, sp, size = table[i]
            try:
                out = codec.decode(buf[at:at + size], n, sp)
            except CodecError:
                return None
            return Slicer(1, lambda a, b: out[a:b])

        # (segments without a slicer, a zstd frame's, decode whole: on the workers, at once)
        got = threads.pool().map(decoded, whole) if len(whole) > 1 else map(decoded, whole)
        for i, sub in zip(whole, got):
            if sub is None:
                return None
            subs[i] = sub
        starts = [row[2] for row in table]

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

        return Slicer(max(s.align for s in subs), get)  # type: ignore[union-attr]

    def max_decoded_len(self, stored_len: int) -> int:
        # Densest: one segment, bitpack's 8 symbols per byte where a rANS header does not fit,
        # above that a CONST rANS stream's one stored byte per 2**20 symbols.
        body = stored_len - COUNT.size - SEGMENT.size
        if body <= 0:
            return 0
        return max(8 * body, max(0, body - RANS_HEADER) << LOG2_BLOCK_MAX)


def assemble(segments: list[tuple[int, int, int, np.ndarray | bytes]]) -> np.ndarray:
    """The payload of ``(symbols, codec ID, bitpack-w width or 0, stored bytes)`` segments."""
    return np.concatenate([np.frombuffer(head(segments), np.uint8)]
                          + [np.frombuffer(b, np.uint8) if isinstance(b, bytes)
                             else np.asarray(b, np.uint8).reshape(-1) for *_x, b in segments])


def head(segments: list[tuple[int, int, int, object]]) -> bytes:
    """The count and segment table that precede the segments' stored bytes in the payload
    (:func:`assemble`'s first bytes; the GPU writer passes them on with the segments as
    pieces, uncopied)."""
    return COUNT.pack(len(segments)) + b"".join(
        SEGMENT.pack(n, len(b) if isinstance(b, bytes) else b.nbytes, c, w, 0, 0)
        for n, c, w, b in segments)


def as_bytes(payload) -> np.ndarray:
    if isinstance(payload, bytes | bytearray):
        return np.frombuffer(payload, np.uint8)
    return np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)


def _parts(view: PlaneView) -> list[PlaneView] | None:
    bounds = segments(view)
    if bounds is None:
        return None
    units = view.units
    return [_sub_view(view, units, a, b) for a, b in itertools.pairwise(bounds.tolist())]


def _segment_choice(view: PlaneView) -> tuple[int, int]:
    """(codec ID, estimated stored bytes) of a segment, as the writer's ``auto`` policy picks
    for a plane: bitpack or bitpack-w where the bytes fit fewer bits, unless rANS saves over
    1/65 of that; else rANS where it stores less than the bytes; else raw."""
    from s4format.policy import packed_wins  # (the policy imports the codecs)

    n = view.size
    rans = _RANS.estimate_counts(view.counts, n)
    w = view.width
    if w < 8:
        packed = (n * w + 7) // 8
        if packed_wins(packed, rans):
            return (BITPACK if w == 1 else BITPACK_W), packed
    if rans < n:
        return RANS, rans
    return RAW, n


def _code_segment(view: PlaneView) -> tuple[int, int, np.ndarray | bytes]:
    """(codec ID, bitpack-w's width or 0, stored bytes) of a segment."""
    from s4format import codecs

    cid, _est = _segment_choice(view)
    if cid == RANS:
        enc = _RANS.encode_view(view)
        if enc.nbytes < view.size:
            return RANS, 0, enc.payload
        cid = RAW
    if cid == RAW:
        return RAW, 0, view.bytes()
    enc = codecs.get(cid).encode_view(view)
    return cid, (enc.params[0] if cid == BITPACK_W else 0), enc.payload


def read_table(buf: np.ndarray, decoded_len: int, codec_id: int = RANS_SEG) -> list[tuple]:
    """Per segment (symbols, offset in the payload, offset in the plane, codec, its params,
    stored bytes), checked against the payload and the plane, for a plane of codec 9 or 10
    (``codec_id``)."""
    from s4format import codecs

    name = NAMES[codec_id]
    if buf.size < COUNT.size:
        raise CodecError(f"{name} payload of {buf.size} bytes is shorter than its count")
    (k,) = COUNT.unpack_from(buf[:COUNT.size].tobytes())
    if k == 0:
        raise CodecError(f"{name} payload holds 0 segments")
    body = COUNT.size + SEGMENT.size * k
    if body > buf.size:
        raise CodecError(f"{name} segment table of {k} segments needs {body} bytes, the "
                         f"payload has {buf.size}")
    rec = np.frombuffer(buf[COUNT.size:body].tobytes(), np.dtype([
        ("symbols", "<u8"), ("stored", "<u8"), ("codec", "<u2"), ("w", "u1"), ("r1", "u1"),
        ("r2", "<u4")]))
    _check_records(rec, codec_id)
    symbols = sum(int(n) for n in rec["symbols"].tolist())  # Python ints: u64 sums may wrap
    stored = sum(int(n) for n in rec["stored"].tolist())
    if symbols != decoded_len:
        raise CodecError(f"{name} segments hold {symbols} symbols, plane declares "
                         f"{decoded_len}")
    if body + stored != buf.size:
        raise CodecError(f"{name} segments store {stored} bytes after a {body}-byte table, "
                         f"the payload has {buf.size}")
    rows, at, lo = [], body, 0
    for i, (n, s, c, w) in enumerate(zip(rec["symbols"].tolist(), rec["stored"].tolist(),
                                         rec["codec"].tolist(), rec["w"].tolist())):
        codec = codecs.get(c)
        # A zstd frame may declare any content size, and zstd allocates it before reading a
        # block: codec 3's bound on the segment's bytes refuses a lying one first.
        if c == ZSTD and n > codec.max_decoded_len(s):
            raise CodecError(segment_message(
                i, k, codec.name, f"declares {n} symbols from {s} stored bytes, beyond what "
                "zstd can produce", name))
        rows.append((n, at, lo, codec, bytes([w]) if c == BITPACK_W else b"", s))
        at, lo = at + s, lo + n
    return rows


def segment_name(i: int, k: int, codec_name: str, plane_codec: str = "rans-seg") -> str:
    """Segment ``i`` of ``k`` as the decoder names it in its failures (of a plane of codec
    ``plane_codec``, by name)."""
    return f"{plane_codec} segment {i} of {k} ({codec_name})"


def segment_message(i: int, k: int, codec_name: str, msg: str,
                    plane_codec: str = "rans-seg") -> str:
    """A segment's failure in the decoder's words."""
    return f"{segment_name(i, k, codec_name, plane_codec)}: {msg}"


def params_error(nbytes: int, plane_codec: str = "rans-seg") -> str:
    """The failure of a codec-9 (or 10: ``plane_codec``) plane given ``nbytes`` (> 0) of
    parameters."""
    return f"{plane_codec} takes no parameters, got {nbytes} bytes"


def form_failure(buf: np.ndarray, table: list[tuple]) -> str | None:
    """The first segment of ``table`` (from :func:`read_table`) whose stored form is wrong for
    its raw, bitpack or bitpack-w codec, in the decoder's words; None if none (rANS segments'
    headers are the stream parser's). The GPU decoder checks with it before its unpack ops,
    which trust the lengths."""
    from s4format.codecs import bitpack, bitpackw, raw

    forms = {RAW: raw.form_error, BITPACK: bitpack.form_error, BITPACK_W: bitpackw.form_error}
    for i, (n, at, _lo, codec, sp, size) in enumerate(table):
        check = forms.get(codec.codec_id)
        msg = check and check(n, sp, size, int(buf[at + size - 1]) if size else 0)
        if msg:
            return segment_message(i, len(table), codec.name, msg)
    return None


def _check_records(rec: np.ndarray, codec_id: int) -> None:
    """The segment records' own rules (spec/codecs.md, "9 — rans-seg" and "10 — seg-lz"),
    first broken first."""
    allowed = LZ_SEGMENT_CODECS if codec_id == SEG_LZ else SEGMENT_CODECS
    takes = ", ".join(f"{NAMES[c]} ({c})" for c in allowed[:-1])
    checks = (
        (rec["symbols"] == 0, lambda i: "holds 0 symbols"),
        (np.append(rec["symbols"][:-1] % SEGMENT_UNIT != 0, False),
         lambda i: f"holds {int(rec['symbols'][i])} symbols, not a multiple of {SEGMENT_UNIT} "
                   "(only the last segment may)"),
        (~np.isin(rec["codec"], allowed),
         lambda i: f"names codec {int(rec['codec'][i])}; a segment takes {takes} or "
                   f"{NAMES[allowed[-1]]} ({allowed[-1]})"),
        ((rec["codec"] == BITPACK_W) & ((rec["w"] < 1) | (rec["w"] > 7)),
         lambda i: f"is bitpack-w of width {int(rec['w'][i])}, not 1 to 7"),
        ((rec["codec"] != BITPACK_W) & (rec["w"] != 0),
         lambda i: f"sets a width ({int(rec['w'][i])}) for a codec that takes none"),
        ((rec["r1"] != 0) | (rec["r2"] != 0), lambda i: "has reserved bytes that are not zero"),
    )
    bad = [(int(np.flatnonzero(mask)[0]), say) for mask, say in checks if mask.any()]
    if bad:
        i, say = min(bad, key=lambda b: b[0])
        raise CodecError(f"{NAMES[codec_id]} segment {i} {say(i)}")


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


@kernel()
def cut_bits(units, starts):  # pragma: no cover - compiled
    """For per-unit histograms ``units`` (units x fields x 256) cut into segments at unit
    indices ``starts`` (0 first, ascending): the order-0 bits of every field coded whole minus
    coded in those segments, and the symbols present in the segments' tables, in one pass."""
    m, nf = units.shape[0], units.shape[1]
    saved = 0.0
    present = 0
    whole = np.empty(256, np.float64)
    seg = np.empty(256, np.float64)
    for f in range(nf):
        whole[:] = 0.0
        seg[:] = 0.0
        nxt = 1
        for u in range(m + 1):
            if u == m or (nxt < starts.size and u == starts[nxt]):
                saved -= _bits(seg)
                for s in range(256):
                    if seg[s] > 0:
                        present += 1
                seg[:] = 0.0
                nxt += 1
                if u == m:
                    break
            for s in range(256):
                c = units[u, f, s]
                seg[s] += c
                whole[s] += c
        saved += _bits(whole)
    return saved, present


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


class SegLzCodec(RansSegCodec):
    """Codec 10: codec 9's segments, where a segment may also be one zstd frame."""

    codec_id = SEG_LZ
    name = "seg-lz"
    segment_codecs = LZ_SEGMENT_CODECS

    def encode_view(self, view: PlaneView) -> Encoded | None:
        """The plane in :func:`segments`' cut, a segment zstd where :func:`_lz_plan` chose it;
        None where it chose no zstd segment (codec 9 then codes the plane as well)."""
        plan = _lz_plan(view)
        if plan is None:
            return None
        coded = threads.pool().map(_code_lz_segment, plan)
        return Encoded(assemble([(row[0].size, c, w, payload) for row, (c, w, payload)
                                 in zip(plan, coded)]))

    def max_decoded_len(self, stored_len: int) -> int:
        # Codec 9's bound, or one zstd segment's (codec 3's bound on its bytes) where that is
        # more: a frame of one RLE block holds up to 65,791 symbols in 11 bytes.
        from s4format import codecs

        body = stored_len - COUNT.size - SEGMENT.size
        if body <= 0:
            return 0
        return max(super().max_decoded_len(stored_len), codecs.get(ZSTD).max_decoded_len(body))

    def estimate_view(self, view: PlaneView) -> int | None:
        plan = _lz_plan(view)
        if plan is None:
            return None
        return COUNT.size + sum(SEGMENT.size + est for _p, _c, est, _alt in plan)


def _lz_plan(view: PlaneView) -> list[tuple[PlaneView, int, int, int]] | None:
    """Per segment of :func:`segments`' cut: (its view, codec ID, estimate, estimate of its
    order-0 choice), where zstd is estimated below that choice by :data:`LZ_SEGMENT_GAIN` on
    a segment whose runs pass the gate; None where no segment takes zstd (memoised)."""
    if "seg-lz" in view.memo:
        return view.memo["seg-lz"]
    from s4format import codecs
    from s4format.policy import LZ_RUNS, SEG_LZ_RUNS

    plan = None
    parts = _parts(view)
    if parts is not None:
        gate = view.memo.get(SEG_LZ_RUNS, LZ_RUNS)  # (the plane kind's, where set)
        zstd = codecs.get(ZSTD)

        def row(part: PlaneView) -> tuple[PlaneView, int, int, int]:
            cid, est = _segment_choice(part)
            if _runs_above_chance(part) > gate:
                z = zstd.estimate_view(part)
                if z < est * (1 - LZ_SEGMENT_GAIN):
                    return part, ZSTD, z, est
            return part, cid, est, est

        rows = threads.pool().map(row, parts)
        if any(c == ZSTD for _p, c, _e, _a in rows):
            plan = rows
    view.memo["seg-lz"] = plan
    return plan


def _runs_above_chance(part: PlaneView) -> float:
    """The share of a segment's bytes (in _RUN_CHUNKS evenly spaced chunks of a longer one)
    that equal the byte before or exceed it by one, less what independent draws from its
    histogram would give (as policy.lz_may_pay judges a plane)."""
    n = part.size
    if n < 2:
        return 0.0
    if n <= _RUN_CHUNKS * _RUN_CHUNK:
        chunks = [part.bytes_at(0, n)]
    else:
        chunks = [part.bytes_at(a, a + _RUN_CHUNK) for a in
                  np.linspace(0, n - _RUN_CHUNK, _RUN_CHUNKS).astype(np.int64).tolist()]
    runs = pairs = 0
    for b in chunks:
        steps = b[1:].astype(np.int16) - b[:-1]
        runs += int(np.count_nonzero(steps.view(np.uint16) <= 1))
        pairs += b.size - 1
    p = part.counts / n
    return runs / pairs - float(np.dot(p, p) + np.dot(p[1:], p[:-1]))


def _code_lz_segment(row: tuple[PlaneView, int, int, int]) -> tuple[int, int, np.ndarray | bytes]:
    """(codec ID, bitpack-w's width or 0, stored bytes) of a segment of :func:`_lz_plan`: its
    zstd frame where chosen and no larger than the order-0 choice's estimate, else that."""
    from s4format import codecs

    part, cid, _est, alt = row
    if cid == ZSTD:
        enc = codecs.get(ZSTD).encode_view(part)
        if enc.nbytes < alt:
            return ZSTD, 0, enc.payload
    return _code_segment(part)


register(RansSegCodec())
register(SegLzCodec())
