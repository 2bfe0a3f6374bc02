"""The plan of a chunked load, per level of a delta chain: the level's stored planes read and
checked once on the host (:class:`Level`), then every chunk's staging copies, rANS rows, merge
segments and launch tables made for all chunks at once (:class:`Run`), so the host's work per
chunk is a copy into pinned memory, one H2D and the launches. A codec-9 plane is decoded into
its bytes segment by segment (rANS rows, copies, unpacks) and merged from them.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs import rans, ransseg
from s4format.errors import CodecError
from s4format.source import BufferSource
from s4weights.gpu import decode_group, failures, plan, ransparse, runtime, staging

BLOCK_TABLE = 64  # device bytes per rANS block of a chunk's launch: its table row, error code
ROW_SIZES = (1, 1, 8, 4, 8, 8, 8, 4)  # bytes per rANS row of the decode kernel's columns
OP_BYTES = 32  # device bytes per 64 KiB piece of a codec-9 segment's copy or unpack op table


class Level:
    """One tensor of a delta chain (the requested one first), its planes' verified stored
    bytes on the host and their rANS block tables, ready to decode any byte range. Its rANS
    streams are every rANS plane's and every rANS segment of its codec-9 planes, in plane
    order (``srow``): a codec-9 plane is decoded segment by segment into its bytes, like a
    rANS plane, and merged from them."""

    def __init__(self, reader, i: int) -> None:
        self.reader, self.i, self.t = reader, i, reader.tensors[i]
        t = self.t
        self.whole = t.layout.layout_id == layouts.RAW.layout_id
        self.word = 1 if self.whole else t.layout.word_size(t.dtype.itemsize)
        # the tensor's planes in one read (in parallel pieces, as the batches stage them:
        # one thread copies from the page cache at a fraction of the memory bandwidth), or
        # None: planes far apart, read one by one
        bounds = reader.compact_bounds(t)
        span = None
        if bounds is not None and isinstance(reader.source, BufferSource):
            # in memory already (bytes, a BytesIO's buffer): a view, not a copy
            span = (bounds[0], reader.source.read_at(bounds[0], bounds[1] - bounds[0]))
        elif bounds is not None:
            span = (bounds[0], np.empty(bounds[1] - bounds[0], np.uint8))
            staging.read_into(reader, bounds[0], span[1])
        self.stored = [reader.read_stored(t, j, span) for j in range(len(t.planes))]  # R1
        self.segs: dict[int, list[tuple]] = {}  # codec-9 plane -> ransseg.read_table's rows
        for j, p in enumerate(t.planes):
            err = failures.plane_form_error(p, self.stored[j], j)
            if err is None and p.codec == codecs.RANS_SEG:
                err = self._segments(j)
            if err:
                raise CodecError(f"{reader.name}: tensor {t.name!r} plane {p.label}: {err}")
        # the rANS streams: (plane, segment or -1, offset in the plane's stored bytes, stored
        # bytes, symbols, first symbol in the plane)
        self.srow: list[tuple[int, int, int, int, int, int]] = []
        for j, p in enumerate(t.planes):
            if p.codec == codecs.RANS:
                self.srow.append((j, -1, 0, p.stored_len, p.decoded_len, 0))
            for s, (n, at, lo, c, _sp, size) in enumerate(self.segs.get(j, ())):
                if c.codec_id == codecs.RANS:
                    self.srow.append((j, s, at, size, n, lo))
        self.row_at = {(j, s): r for r, (j, s, *_x) in enumerate(self.srow)}
        self.row_of = {j: r for (j, s), r in self.row_at.items() if s < 0}
        self.sub = [self.stored[j][at:at + size] for j, _s, at, size, _n, _lo in self.srow]
        self.streams = None
        self._coded_at: dict[int, int] | None = None
        if self.srow:
            # validated where they lie in the tensor's span (no copy of the streams), or in
            # one copy of them when the planes were read one by one
            stored = [size for _j, _s, _at, size, _n, _lo in self.srow]
            n = [x[4] for x in self.srow]
            if span is not None:
                host = span[1]
                at = [t.planes[j].offset - span[0] + a for j, _s, a, *_x in self.srow]
            else:
                host = np.concatenate(self.sub)
                at = np.cumsum([0, *stored[:-1]])
            nb = ransparse.stream_blocks(host, at, stored, n)
            if not ransparse.tables_fit(int(nb.sum()), sum(stored)):
                raise ransparse.TablesTooLarge(f"{reader.name}: tensor {t.name!r}")
            try:
                self.streams = ransparse.parse_streams(host, at, stored, n)
            except ransparse.StreamError as e:
                raise CodecError(f"{self.named(e.plane)}: {self.in_segment(e.plane, str(e))}"
                                 ) from None
            self.lg = [int(s[1]) for s in self.sub]  # header: log2_block
            s = self.streams
            # per block: the end of its words inside its stream, and its stream's first
            # symbol in the plane
            self.words_end = s.words.astype(np.int64) + 2 * s.count.astype(np.int64)
            lo = np.array([x[5] for x in self.srow], np.int64)
            self.block_lo = np.repeat(lo[s.coded], np.diff(s.first))

    def _segments(self, j: int) -> str | None:
        """Read codec-9 plane j's segment table into ``segs``, checked with the CPU decoder's
        checks (its parameters, the table, the raw and packed segments' forms), or what is
        wrong with it."""
        p = self.t.planes[j]
        if p.params:
            return ransseg.params_error(len(p.params))
        try:
            table = ransseg.read_table(self.stored[j], p.decoded_len)
        except CodecError as exc:
            return str(exc)
        self.segs[j] = table
        return ransseg.form_failure(self.stored[j], table)

    def named(self, row: int) -> str:
        """The tensor and plane of rANS stream ``row``, as a failure names them."""
        p = self.t.planes[self.srow[row][0]]
        return f"{self.reader.name}: tensor {self.t.name!r} plane {p.label}"

    def in_segment(self, row: int, msg: str) -> str:
        """``msg`` about rANS stream ``row``, in the CPU decoder's words: a codec-9 plane's
        names its segment."""
        j, s = self.srow[row][:2]
        return msg if s < 0 else ransseg.segment_message(s, len(self.segs[j]), "rans", msg)

    def blocks(self, q: int) -> tuple[int, int, int]:
        """(first block in the batch, blocks, log2_block) of rANS stream q."""
        s = self.streams
        if self._coded_at is None:  # (a codec-9 plane may hold thousands of streams)
            self._coded_at = {int(x): r for r, x in enumerate(s.coded.tolist())}
        r = self._coded_at.get(q, -1)
        if r < 0:
            return 0, 0, 0
        b0, b1 = int(s.first[r]), int(s.first[r + 1])
        return b0, b1 - b0, self.lg[q]

    def pieces(self, lo: int, hi: int) -> list[tuple[str, int, list[np.ndarray], tuple]]:
        """What decoding bytes [lo, hi) of the tensor needs, per plane: (form, plane, host
        arrays to stage, each on a 16-byte boundary (views), extra) where form is "plain" (a
        byte range of the stored plane, packed sign bits included), "rans" (its blocks' final
        states, then their words; extra = (first block, end block, states bytes, first state
        offset, first word offset)), "const" (CONST blocks only; extra = (first block, end
        block)) or "seg" (a codec-9 plane's segments in the range; extra = (first block, end
        block) of its rANS segments, then :meth:`_segment_parts`)."""
        e0, e1 = lo // self.word, hi // self.word
        out = []
        for j, p in enumerate(self.t.planes):
            s = self.stored[j]
            if p.codec == codecs.BITPACK:
                out.append(("plain", j, [s[e0 // 8:(e1 + 7) // 8]], ()))
            elif p.codec == codecs.BITPACK_W:  # e0 is a multiple of 8: a whole stored byte
                w = p.params[0]
                out.append(("plain", j, [s[e0 // 8 * w:(e1 * w + 7) // 8]], ()))
            elif p.codec == codecs.RAW:
                out.append(("plain", j, [s[e0:e1]], ()))
            elif p.codec == codecs.RANS:
                form, arrays, extra = self._stream(self.row_of[j], e0, e1)
                out.append((form, j, arrays, extra))
            else:
                arrays, parts = self._segment_parts(j, e0, e1)
                ranges = [x[4][:2] for x in parts if x[0] in ("rans", "const")]
                b0, b1 = (ranges[0][0], ranges[-1][1]) if ranges else (0, 0)
                out.append(("seg", j, arrays, (b0, b1, parts)))
        return out

    def _stream(self, q: int, x0: int, x1: int) -> tuple[str, list[np.ndarray], tuple]:
        """Symbols [x0, x1) of rANS stream q: (form, arrays, extra) as :meth:`pieces` says;
        a RAW-mode stream's bytes are "plain"."""
        st, s = self.streams, self.sub[q]
        if st.mode[q] == rans.MODE_RAW:
            a = int(st.data_at[q])
            return "plain", [s[a + x0:a + x1]], ()
        f, nb, lg = self.blocks(q)
        b0, b1 = f + (x0 >> lg), f + min(nb, -(-x1 >> lg))
        if st.mode[q] == rans.MODE_CONST:
            return "const", [], (b0, b1)
        w0, w1 = int(st.words[b0]), int(self.words_end[b1 - 1])
        s0, s1 = int(st.states[b0]), int(st.states[b1 - 1]) + 128
        return "rans", [s[s0:s1], s[w0:w1]], (b0, b1, s1 - s0, s0, w0)

    def _segment_parts(self, j: int, e0: int, e1: int) -> tuple[list[np.ndarray], list[tuple]]:
        """Codec-9 plane j's segments within symbols [e0, e1): (the arrays to stage, the parts
        as (form, stream row or -1, index of the part's first array, symbols, extra, offset in
        the range)) where form is "rans" or "const" (as :meth:`_stream`), "copy" (raw bytes:
        a raw segment's, a RAW-mode stream's) or "unpack" (extra = (width,): bitpack's 1 bit
        or bitpack-w's bits per symbol)."""
        arrays: list[np.ndarray] = []
        parts = []
        s = self.stored[j]
        for k, (n, at, lo, c, sp, size) in enumerate(self.segs[j]):
            a0, a1 = max(e0, lo), min(e1, lo + n)
            if a0 >= a1:
                continue
            x0, x1, seg, first = a0 - lo, a1 - lo, s[at:at + size], len(arrays)
            row = self.row_at.get((j, k), -1)
            if c.codec_id == codecs.RANS:
                form, got, extra = self._stream(row, x0, x1)
                form = "copy" if form == "plain" else form
            elif c.codec_id == codecs.RAW:
                form, got, extra = "copy", [seg[x0:x1]], ()
            else:  # (x0 is a multiple of 8: segments and chunks start on 2^16 symbols)
                w = 1 if c.codec_id == codecs.BITPACK else sp[0]
                form, got, extra = "unpack", [seg[x0 // 8 * w:(x1 * w + 7) // 8]], (w,)
            arrays += got
            parts.append((form, row, first, a1 - a0, extra, a0 - e0))
        return arrays, parts

    def align(self) -> int:
        """Bytes a chunk's length must be a multiple of, for this level: ``plan.large_align``
        elements of its coded rANS streams' block size (a CONST stream's blocks may be cut).
        A rANS segment of blocks over 2^16 symbols that does not start on a multiple of its
        block size would be cut mid-block: such a tensor is left to the CPU decoder."""
        coded = [q for q in range(len(self.srow)) if self.streams.mode[q] == rans.MODE_RANS]
        for q in coded:
            if self.lg[q] > 16 and self.srow[q][5] % (1 << self.lg[q]):
                raise ransparse.HostDecodes(
                    f"{self.named(q)}: a rANS segment's blocks cross the chunks")
        return self.word * plan.large_align(max((self.lg[q] for q in coded), default=0))

    def span(self, blk: np.ndarray, e0, e1) -> tuple[np.ndarray, np.ndarray]:
        """(first symbol in the plane, symbols) of blocks ``blk`` clipped to symbols [e0, e1)
        (scalars, or one bound per block). Chunks of ``align()`` bytes hold whole blocks of
        coded streams; ranges that cut a CONST block are clipped, and cutting a rANS block is
        refused."""
        s = self.streams
        b_start = s.start[blk].astype(np.int64) + self.block_lo[blk]
        b_end = b_start + s.length[blk].astype(np.int64)
        start, end = np.maximum(b_start, e0), np.minimum(b_end, e1)
        if (((start != b_start) | (end != b_end)) & (s.table[blk] >= 0)).any():
            raise ValueError("a chunk must not cut a rANS block")
        return start, (end - start).astype(np.uint32)

    def need(self, lo: int, hi: int) -> int:
        """Device bytes decoding [lo, hi) holds: staged bytes, decoded rANS and codec-9
        planes, the block tables and the segments' copy and unpack ops."""
        e = (hi - lo) // self.word
        pcs = self.pieces(lo, hi)
        staged = sum(runtime.align(a.size, 16) for x in pcs for a in x[2])
        decoded = 0 if self.whole else sum(runtime.align(e, 16) for x in pcs
                                           if x[0] != "plain")
        blocks = sum(x[3][1] - x[3][0] for x in pcs if x[0] != "plain")
        ops = sum(-(-part[3] // plan.COPY_PIECE) for x in pcs if x[0] == "seg"
                  for part in x[3][2] if part[0] in ("copy", "unpack"))
        return staged + decoded + BLOCK_TABLE * blocks + OP_BYTES * ops + 4096


def _tables(lv: Level) -> tuple[torch.Tensor | None, int]:
    """The level's rANS frequency prefix sums on the device (one 1 KiB row per stream)."""
    if lv.streams is None or not lv.streams.freqs.shape[0]:
        return None, 0
    s = lv.streams
    cums = (np.cumsum(s.freqs, axis=1) - s.freqs).astype(np.uint32)
    dev, (p,) = runtime.upload(cums)
    return dev, p


class Run:
    """One level of a chunked decode, planned for all its chunks (``bounds``: byte ranges) at
    once. Per chunk: the host arrays staged back to back (each on a 16-byte boundary) and the
    staged bytes, its codec-9 segments' copies and unpacks, the rows of the rANS launches
    (every chunk's, chunk after chunk, plane by plane inside a chunk), the CTAs of each
    chunk's launch, and the merge's segments (one per chunk). :meth:`addresses` fixes the
    device addresses; :meth:`tables` gives a window of chunks' tables to upload;
    :meth:`launch` stages and decodes one chunk."""

    def __init__(self, lv: Level, bounds: list[tuple[int, int]]) -> None:
        self.lv, self.bounds = lv, bounds
        nk = len(bounds)
        self.pieces = [lv.pieces(lo, hi) for lo, hi in bounds]
        self.copies: list[list[tuple[int, np.ndarray]]] = []
        self.offsets = np.zeros((nk, len(lv.t.planes)), np.int64)  # per chunk, per piece
        self.arrays_at: list[list[list[int]]] = []  # per chunk, per piece: each array's offset
        self.staged = np.zeros(nk, np.int64)
        for k, pcs in enumerate(self.pieces):
            o, cps, ats = 0, [], []
            for q, x in enumerate(pcs):
                self.offsets[k, q] = o
                ats.append([])
                for a in x[2]:
                    ats[-1].append(o)
                    if a.size:
                        cps.append((o, a))
                    o += runtime.align(a.size, 16)
            self.copies.append(cps)
            self.arrays_at.append(ats)
            self.staged[k] = o
        self.e = np.array([(hi - lo) // lv.word for lo, hi in bounds], np.int64)
        forms = [x[0] for x in self.pieces[0]] if nk else []
        self.coded = [q for q, f in enumerate(forms) if f != "plain"]
        self.stride = runtime.align(int(self.e.max(initial=0)), 16)
        self.decoded = 0 if lv.whole else len(self.coded) * self.stride
        # the rANS rows: per coded piece, chunk k's blocks b0..b1 (a CONST block cut by two
        # chunks is a row of each)
        parts = []
        for rank, q in enumerate(self.coded):
            b = np.array([self.pieces[k][q][3][:2] for k in range(nk)], np.int64).reshape(-1, 2)
            kb, off = plan.cut(b[:, 1] - b[:, 0], 1)  # (each row's chunk, its place there)
            parts.append((kb, np.full(kb.size, rank), b[kb, 0] + off))
        if parts:
            kb, rank, blk = (np.concatenate(x) for x in zip(*parts))
            order = np.lexsort((rank, kb))  # chunk by chunk, plane by plane, blocks in order
            self.kb, self.rank, self.blk = kb[order], rank[order], blk[order]
        else:
            self.kb = self.rank = self.blk = np.zeros(0, np.int64)
        self.rows = int(self.blk.size)
        self.flags_at = max(self.rows, 1)  # in the level's error buffer: the merge flags
        # the launch's CTAs, per chunk a range: each inside the rows of one stream in one
        # chunk, since a CTA decodes its rows with one table (a codec-9 plane's segments have
        # one each)
        seg_chunk, seg_count = [], []
        if self.rows:
            first_blk = lv.streams.first
            stream = np.searchsorted(first_blk, self.blk, side="right") - 1
            key = self.kb * first_blk.size + stream
            cut = np.flatnonzero(np.diff(key)) + 1
            starts = np.concatenate(([0], cut))
            seg_chunk = self.kb[starts]
            seg_count = np.diff(np.concatenate((starts, [self.rows])))
        first = np.concatenate(([0], np.cumsum(seg_count))).astype(np.int64)
        self.cta_first, self.cta_warps = plan.cta_table(first) if self.rows else (
            np.zeros(0, np.uint32), np.zeros(0, np.uint8))
        cta_seg = plan.cta_planes(first)[0] if self.rows else np.zeros(0, np.int64)
        cta_chunk = np.asarray(seg_chunk, np.int64)[cta_seg] if self.rows else cta_seg
        self.cta_at = np.searchsorted(cta_chunk, np.arange(nk + 1))
        self.row_at = np.searchsorted(self.kb, np.arange(nk + 1))
        # the merge's CTAs: one segment per chunk
        if lv.whole:
            self.m_seg = np.zeros(0, np.int32)
            self.m_first = np.zeros(0, np.int64)
        else:
            self.m_seg, self.m_first = plan.chunk_table(self.e)
        self.m_at = np.searchsorted(self.m_seg, np.arange(nk + 1))
        # device bytes of each chunk's tables (an upper bound): 42 per row, 5 per CTA, 64 per
        # merge segment and 12 per merge CTA, the leaf tables' 40, and up to 16 of alignment
        # for each of a window's 20 arrays
        self.table_bytes = (42 * np.diff(self.row_at) + 5 * np.diff(self.cta_at) + 64
                            + 12 * np.diff(self.m_at) + 40 + 16 * 20)
        self.ntabs = len(lv.srow)  # (at most the level's frequency rows: 1 KiB each)
        self.ntables = 16
        self.tab = None

    def addresses(self, stage: int, scratch: int, dsts: list[int]) -> None:
        """Fix the device addresses (the staging buffer, the decoded planes, each chunk's
        destination) and build every chunk's table rows."""
        lv, s = self.lv, self.lv.streams
        self.tab = _tables(lv)
        tab_p = self.tab[1]
        self.dsts = np.array(dsts, np.uint64)
        nk = len(self.bounds)
        targets = np.zeros((nk, max(len(self.coded), 1)), np.uint64)
        for rank in range(len(self.coded)):
            targets[:, rank] = self.dsts if lv.whole else np.uint64(scratch + rank * self.stride)
        planes = np.zeros((nk, 5), np.uint64)
        packed = np.array([1, 0, 0, 0, 0], np.uint8)
        for q, x in enumerate(self.pieces[0] if nk else []):
            j = x[1]
            if x[0] == "plain":
                planes[:, j] = np.uint64(stage) + self.offsets[:, q].astype(np.uint64)
                if j == 0 and lv.t.planes[0].codec != codecs.BITPACK:
                    packed[0] = 0
                if lv.t.planes[j].codec == codecs.BITPACK_W:
                    packed[j] = lv.t.planes[j].params[0]
            else:
                planes[:, j] = targets[:, self.coded.index(q)]
                if j == 0:
                    packed[0] = 0
        self.planes, self.packed = planes, np.tile(packed, (nk, 1))
        self.ops = [self._ops(k, stage, targets[k]) for k in range(nk)]
        if not self.rows:
            return
        kb, blk = self.kb, self.blk
        is_rans = s.table[blk] >= 0
        # each row's states and words, staged where its stream's "rans" part of its chunk is
        words = np.zeros(self.rows, np.int64)
        states = np.zeros(self.rows, np.int64)
        key_of = np.int64(s.nblocks + 1)
        row_key = (kb * (len(self.coded) + 1) + self.rank) * key_of + blk
        parts = [(k, rank, x, ats[0], ats[1])  # (chunk, rank, (b0, s0, w0), states, words)
                 for k in range(nk) for rank, q in enumerate(self.coded)
                 for x, ats in self._rans_parts(k, q)]
        if parts:
            pk, prank, pb0, sat, wat = (np.array(c, np.int64) for c in zip(*parts))
            part_key = (pk * (len(self.coded) + 1) + prank) * key_of + pb0[:, 0]
            at = np.searchsorted(part_key, row_key, side="right") - 1
            sel = np.flatnonzero(is_rans)
            a = at[sel]
            words[sel] = stage + wat[a] + (s.words[blk[sel]].astype(np.int64) - pb0[a, 2])
            states[sel] = stage + sat[a] + (s.states[blk[sel]].astype(np.int64) - pb0[a, 1])
        e_lo = np.array([lo // lv.word for lo, _hi in self.bounds], np.int64)[kb]
        start, length = lv.span(blk, e_lo, e_lo + self.e[kb])
        cols = [s.const[blk], s.fill[blk], np.where(is_rans, words, 0), s.count[blk],
                np.where(is_rans, states, 0),
                np.where(is_rans, np.uint64(tab_p) + s.table[blk].astype(np.uint64)
                         * np.uint64(1024), np.uint64(0)),
                targets[kb, self.rank] + (start - e_lo).astype(np.uint64), length]
        self.cols = [c.astype(f"u{size}") for c, size in zip(cols, ROW_SIZES)]

    def _rans_parts(self, k: int, q: int) -> list[tuple[tuple[int, int, int], tuple[int, int]]]:
        """The streams in "rans" form of chunk k's piece q: per stream ((its first block, first
        state offset, first word offset), (where its states and words are staged))."""
        x, ats = self.pieces[k][q], self.arrays_at[k][q]
        if x[0] == "rans":
            b0, _b1, _slen, s0, w0 = x[3]
            return [((b0, s0, w0), (ats[0], ats[1]))]
        if x[0] != "seg":
            return []
        return [((e[0], e[3], e[4]), (ats[first], ats[first + 1]))
                for form, _row, first, _n, e, _off in x[3][2] if form == "rans"]

    def _ops(self, k: int, stage: int, targets: np.ndarray) -> tuple[tuple, tuple]:
        """Chunk k's codec-9 segments that are not decoded by rANS rows: the copies of raw
        bytes (sources, destinations, bytes) and the unpacks of packed ones to a byte each
        (sources, destinations, symbols, source width), from the staged bytes into their
        ranges of the planes' decoded bytes (``targets``, by rank)."""
        copies: list[tuple[int, int, int]] = []
        unpacks: list[tuple[int, int, int, int]] = []
        for rank, q in enumerate(self.coded):
            x = self.pieces[k][q]
            if x[0] != "seg":
                continue
            for form, _row, first, n, extra, off in x[3][2]:
                if form not in ("copy", "unpack"):
                    continue
                src, dst = stage + self.arrays_at[k][q][first], int(targets[rank]) + off
                if form == "copy":
                    copies.append((src, dst, n))
                else:
                    unpacks.append((src, dst, n, extra[0]))
        return (tuple(np.array(c, np.uint64) for c in zip(*copies)),
                tuple(np.array(c, np.int64) for c in zip(*unpacks)))

    def tables(self, w0: int, w1: int) -> list[np.ndarray]:
        """The tables of chunks [w0, w1), :attr:`ntables` arrays to upload (:meth:`launch`
        takes their addresses)."""
        r0, r1 = int(self.row_at[w0]), int(self.row_at[w1])
        c0, c1 = int(self.cta_at[w0]), int(self.cta_at[w1])
        m0, m1 = int(self.m_at[w0]), int(self.m_at[w1])
        rows = [c[r0:r1] for c in self.cols] if self.rows else [np.zeros(0, np.uint8)] * 8
        return [self.cta_first[c0:c1], self.cta_warps[c0:c1], *rows,
                (self.m_seg[m0:m1] - w0).astype(np.int32), self.m_first[m0:m1],
                self.dsts[w0:w1], self.e[w0:w1], self.planes[w0:w1], self.packed[w0:w1]]

    def launch(self, k: int, w0: int, addrs: list[int], stage: torch.Tensor,
               pinned: torch.Tensor, copied: torch.cuda.Event, errs: torch.Tensor,
               dst: torch.Tensor) -> None:
        """Stage chunk k (of the window from w0, whose tables are at ``addrs``) through
        ``pinned`` (``copied`` recorded after its copy to the device) and decode it into
        ``dst``: rANS rows, then the merge (or, for a raw layout, its bytes copied)."""
        staging.copy_into(pinned.numpy(), self.copies[k])
        total = int(self.staged[k])
        if total:
            stage[:total].copy_(pinned[:total], non_blocking=True)
        copied.record()
        if self.lv.whole and not self.coded:  # one plain piece: its bytes are the chunk's
            o = int(self.offsets[k, 0])
            dst.copy_(stage[o:o + dst.numel()])
            return
        copies, unpacks = self.ops[k]
        if copies:
            runtime.copy_ops(*copies)
        if unpacks:  # (to a byte each: pack ops of width 8 from the stored width)
            src, to, n, width = unpacks
            runtime.pack_ops(src, to, n, np.full(n.size, 8), width)
        c0, c1 = int(self.cta_at[k]), int(self.cta_at[k + 1])
        if c1 > c0:
            cw, r0 = c0 - int(self.cta_at[w0]), int(self.row_at[w0])
            # the CTAs name rows by their number in the level, and the window's columns start
            # at row r0: each column's address moves back by r0 rows
            a = [np.uint64(addrs[0] + 4 * cw), np.uint64(addrs[1] + cw)]
            a += [np.uint64(x - r0 * size) for x, size in zip(addrs[2:10], ROW_SIZES)]
            runtime.launch("rans", runtime.rans_decode_kernel(int(self.row_at[k + 1]
                                                                   - self.row_at[k])),
                           c1 - c0, 32 * plan.RANS_WARPS, *a, runtime.ptr(errs))
        if self.lv.whole:
            return
        m0, m1 = int(self.m_at[k]), int(self.m_at[k + 1])
        mw = m0 - int(self.m_at[w0])
        runtime.launch("planes", decode_group.MERGE_KERNEL[self.lv.t.layout.layout_id], m1 - m0,
                       256, np.uint64(addrs[10] + 4 * mw), np.uint64(addrs[11] + 8 * mw),
                       *(np.uint64(x) for x in addrs[12:16]),
                       # (segment s of the window flags errors[s]: chunk w0 + s's flag)
                       np.uint64(errs.data_ptr() + 4 * (self.flags_at + w0)),
                       np.uint64(0), np.uint64(0))  # (content digests: the chunks' own launch)
