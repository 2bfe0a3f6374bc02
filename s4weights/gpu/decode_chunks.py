"""The plan of a chunked load, per level of a delta chain: the level's stored planes read and
checked once on the host (:class:`Level`), then every chunk's staging copies, rANS rows, merge
segments and launch tables made for all chunks at once (:class:`Run`), so the host's work per
chunk is a copy into pinned memory, one H2D and the launches.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs import rans
from s4format.errors import CodecError
from s4format.source import BufferSource
from s4weights.gpu import decode_group, failures, plan, ransparse, runtime, staging

BLOCK_TABLE = 64  # device bytes per rANS block of a chunk's launch: its table row, error code
ROW_SIZES = (1, 1, 8, 4, 8, 8, 8, 4)  # bytes per rANS row of the decode kernel's columns


class Level:
    """One tensor of a delta chain (the requested one first), its planes' verified stored
    bytes on the host and their rANS block tables, ready to decode any byte range."""

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
        self.rans = [j for j, p in enumerate(t.planes) if p.codec == codecs.RANS]
        for j, p in enumerate(t.planes):
            err = failures.plane_form_error(p, self.stored[j], j)
            if err:
                raise CodecError(f"{reader.name}: tensor {t.name!r} plane {p.label}: {err}")
        self.streams = None
        if self.rans:
            # validated where they lie in the tensor's span (no copy of the streams), or in
            # one copy of them when the planes were read one by one
            if span is not None:
                host, at = span[1], [t.planes[j].offset - span[0] for j in self.rans]
            else:
                host = np.concatenate([self.stored[j] for j in self.rans])
                at = np.cumsum([0] + [t.planes[j].stored_len for j in self.rans[:-1]])
            stored = [t.planes[j].stored_len for j in self.rans]
            nb = ransparse.stream_blocks(host, at, stored,
                                        [t.planes[j].decoded_len for j in self.rans])
            if not ransparse.tables_fit(int(nb.sum()), sum(stored)):
                raise ransparse.TablesTooLarge(f"{reader.name}: tensor {t.name!r}")
            try:
                self.streams = ransparse.parse_streams(
                    host, at, stored, [t.planes[j].decoded_len for j in self.rans])
            except ransparse.StreamError as e:
                p = t.planes[self.rans[e.plane]]
                raise CodecError(f"{reader.name}: tensor {t.name!r} plane {p.label}: {e}"
                                 ) from None
            self.lg = [int(self.stored[j][1]) for j in self.rans]  # header: log2_block
            s = self.streams
            # per block: the end of its words inside the concatenated streams
            self.words_end = s.words.astype(np.int64) + 2 * s.count.astype(np.int64)

    def blocks(self, q: int) -> tuple[int, int, int]:
        """(first block in the batch, blocks, log2_block) of rANS plane q's stream."""
        s = self.streams
        r = int(np.flatnonzero(s.coded == q)[0]) if (s.coded == q).any() else -1
        if r < 0:
            return 0, 0, 0
        b0, b1 = int(s.first[r]), int(s.first[r + 1])
        return b0, b1 - b0, self.lg[q]

    def pieces(self, lo: int, hi: int) -> list[tuple[str, int, list[np.ndarray], tuple]]:
        """What decoding bytes [lo, hi) of the tensor needs, per plane: (form, plane, host
        arrays to stage back to back (views), extra) where form is "plain" (a byte range of the
        stored plane, packed sign bits included), "rans" (its blocks' final states, then their
        words; extra = (first block, end block, states bytes, first word offset)) or "const"
        (CONST blocks only; extra = (first block, end block))."""
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
            else:
                q = self.rans.index(j)
                st = self.streams
                if st.mode[q] == rans.MODE_RAW:
                    a = int(st.data_at[q])
                    out.append(("plain", j, [s[a + e0:a + e1]], ()))
                    continue
                f, nb, lg = self.blocks(q)
                b0, b1 = f + (e0 >> lg), f + min(nb, -(-e1 >> lg))
                if st.mode[q] == rans.MODE_CONST:
                    out.append(("const", j, [], (b0, b1)))
                    continue
                w0, w1 = int(st.words[b0]), int(self.words_end[b1 - 1])
                s0, s1 = int(st.states[b0]), int(st.states[b1 - 1]) + 128
                out.append(("rans", j, [s[s0:s1], s[w0:w1]], (b0, b1, s1 - s0, s0, w0)))
        return out

    def align(self) -> int:
        """Bytes a chunk's length must be a multiple of, for this level: ``plan.large_align``
        elements of its coded rANS streams' block size (a CONST stream's blocks may be cut)."""
        lg = [self.lg[q] for q in range(len(self.rans))
              if self.streams.mode[q] == rans.MODE_RANS]
        return self.word * plan.large_align(max(lg, default=0))

    def span(self, blk: np.ndarray, e0, e1) -> tuple[np.ndarray, np.ndarray]:
        """(first symbol, symbols) of blocks ``blk`` clipped to symbols [e0, e1) (scalars, or
        one bound per block). Chunks of ``align()`` bytes hold whole blocks of coded streams;
        ranges that cut a CONST block are clipped, and cutting a rANS block is refused."""
        s = self.streams
        b_start = s.start[blk].astype(np.int64)
        b_end = b_start + s.length[blk].astype(np.int64)
        start, end = np.maximum(b_start, e0), np.minimum(b_end, e1)
        if (((start != b_start) | (end != b_end)) & (s.table[blk] >= 0)).any():
            raise ValueError("a chunk must not cut a rANS block")
        return start, (end - start).astype(np.uint32)

    def need(self, lo: int, hi: int) -> int:
        """Device bytes decoding [lo, hi) holds: staged bytes and decoded rANS planes."""
        e = (hi - lo) // self.word
        pcs = self.pieces(lo, hi)
        staged = sum(runtime.align(sum(a.size for a in x[2]), 16) for x in pcs)
        decoded = 0 if self.whole else sum(runtime.align(e, 16) for x in pcs
                                           if x[0] != "plain")
        blocks = sum(x[3][1] - x[3][0] for x in pcs if x[0] != "plain")
        return staged + decoded + BLOCK_TABLE * blocks + 4096


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
    once. Per chunk: the host arrays staged back to back (each piece 16-byte aligned) and the
    staged bytes; the rows of the rANS launches (every chunk's, chunk after chunk, plane by
    plane inside a chunk), the CTAs of each chunk's launch, and the merge's segments (one per
    chunk). :meth:`addresses` fixes the device addresses; :meth:`tables` gives a window of
    chunks' tables to upload; :meth:`launch` stages and decodes one chunk."""

    def __init__(self, lv: Level, bounds: list[tuple[int, int]]) -> None:
        self.lv, self.bounds = lv, bounds
        nk = len(bounds)
        self.pieces = [lv.pieces(lo, hi) for lo, hi in bounds]
        self.copies: list[list[tuple[int, np.ndarray]]] = []
        self.offsets = np.zeros((nk, len(lv.t.planes)), np.int64)  # per chunk, per piece
        self.staged = np.zeros(nk, np.int64)
        for k, pcs in enumerate(self.pieces):
            o, cps = 0, []
            for q, x in enumerate(pcs):
                self.offsets[k, q] = o
                p = o
                for a in x[2]:
                    if a.size:
                        cps.append((p, a))
                    p += a.size
                o += runtime.align(p - o, 16)
            self.copies.append(cps)
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
        # the launch's CTAs (each inside one (chunk, plane) segment of rows), per chunk a range
        seg_chunk, seg_count = [], []
        if self.rows:
            key = self.kb * (len(self.coded) + 1) + self.rank
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
        self.ntabs = len(lv.rans)  # (the level's frequency rows: 1 KiB each)
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
        if not self.rows:
            return
        kb, blk = self.kb, self.blk
        is_rans = s.table[blk] >= 0
        words = np.zeros(self.rows, np.int64)
        states = np.zeros(self.rows, np.int64)
        for rank, q in enumerate(self.coded):
            if self.pieces[0][q][0] != "rans":
                continue
            sel = self.rank == rank
            ext = np.array([self.pieces[k][q][3] for k in range(nk)], np.int64)  # b0 b1 slen s0 w0
            o = self.offsets[:, q]
            kk = kb[sel]
            words[sel] = stage + o[kk] + ext[kk, 2] + (s.words[blk[sel]].astype(np.int64)
                                                       - ext[kk, 4])
            states[sel] = stage + o[kk] + (s.states[blk[sel]].astype(np.int64) - ext[kk, 3])
        e_lo = np.array([lo // lv.word for lo, _hi in self.bounds], np.int64)[kb]
        start, length = lv.span(blk, e_lo, e_lo + self.e[kb])
        cols = [s.const[blk], s.fill[blk], np.where(is_rans, words, 0), s.count[blk],
                np.where(is_rans, states, 0),
                np.where(is_rans, np.uint64(tab_p) + s.table[blk].astype(np.uint64)
                         * np.uint64(1024), np.uint64(0)),
                targets[kb, self.rank] + (start - e_lo).astype(np.uint64), length]
        self.cols = [c.astype(f"u{size}") for c, size in zip(cols, ROW_SIZES)]

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
