"""A tensor whose one-batch decode would hold more than the workspace, decoded on the GPU in
chunks of elements straight into its destination: every plane checked on the host first, every
level of a delta chain applied chunk by chunk, failures raised as the CPU reader meets them.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs import rans
from s4format.errors import (
    CodecError,
    ContentHashError,
    FormatError,
    ParentMismatchError,
    S4Error,
)
from s4format.hashing import LEAF_SIZE
from s4format.source import BufferSource
from s4weights.gpu import decode_group, failures, plan, ransparse, runtime, staging
from s4weights.gpu.hash import content_hashes_from_leaves

_LOAD_CODECS = (codecs.RAW, codecs.BITPACK, codecs.RANS, codecs.BITPACK_W)
BLOCK_TABLE = 64  # device bytes per rANS block of a chunk's launch: its table row, error code


def chunkable(reader, i: int) -> bool:
    """Whether tensor i decodes on the GPU in chunks (:func:`load_large`): the GPU decodes it,
    its planes are raw, bitpack, bitpack-w or rANS (GDeflate and nvCOMP streams decode whole),
    and for a
    delta so is its parent's tensor, down the chain."""
    from s4weights.gpu import decode

    t = reader.tensors[i]
    if not decode.decodable(reader, i) or any(p.codec not in _LOAD_CODECS for p in t.planes):
        return False
    if t.is_delta:
        j = decode.parent_index(reader, i)
        return j is not None and chunkable(reader.parent, j)
    return True


class _Level:
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


def load_large(reader, i: int, out: torch.Tensor, workspace: int, on_host: bool = False
               ) -> None:
    """:func:`_load_large`, failing as the CPU reader would: a stream or form failure is
    reported for the first plane that fails in the CPU reader's order (the host checks forms
    and stream headers before the device finds corrupt blocks), and a field overflow (found by
    tensor) in its words, by re-reading the tensor on the CPU, on this error path only.
    ``on_host``: ``out`` is host memory (page-locked, for the copies to overlap): each chunk
    is decoded into a device buffer (within the workspace) and copied down."""
    try:
        _load_large(reader, i, out, workspace, on_host)
    except FormatError as exc:  # (CodecError is one)
        failures.raise_as_cpu(reader, i, exc)
        raise


def _load_large(reader, i: int, out: torch.Tensor, workspace: int, on_host: bool = False
                ) -> None:
    """Decode tensor i into ``out`` (its raw bytes, flat uint8 on the current device) chunk by
    chunk, each chunk's device memory under ``workspace`` (at least one chunk of
    ``_Level.align()`` bytes). Every plane's checksum is verified (on the host, where its stored
    bytes are read) and every stream validated before any kernel runs. A delta's chain is
    applied chunk by chunk: the deepest ancestor's bytes for the chunk are decoded, then each
    delta's XORed in; every level's content hash is checked at the end (an ancestor's where
    its reader verifies hashes, a delta's always). Failures come in the CPU reader's order: a
    parent that fails its checks before decoding (no such tensor, size limit, checksums,
    headers) is reported after the delta's own planes have decoded without failure, and
    content hashes from the deepest level up, after every level's planes."""
    from s4weights.gpu import decode

    decode.check_limit(reader, i)
    levels = [_Level(reader, i)]
    deferred = None
    while levels[-1].t.is_delta:
        lv = levels[-1]
        try:
            j = decode.parent_index(lv.reader, lv.i)
            if j is None:
                raise ParentMismatchError(
                    f"{lv.reader.name}: parent {lv.reader.parent.name} holds no tensor with "
                    f"hash {lv.t.parent_hash.hex()} of {lv.t.raw_nbytes} bytes for delta "
                    f"{lv.t.name!r}")
            decode.check_limit(lv.reader.parent, j)  # R0 with the parent's own limit
            levels.append(_Level(lv.reader.parent, j))
        except S4Error as exc:
            deferred = exc
            break
    if deferred is not None:
        # The CPU reader meets a parent's failure only after decoding the delta's own planes
        # (R2-R4, then R5): each level before the failing one is decoded alone, in order, and
        # its first failure wins (on this error path only).
        for lv in levels:
            _decode_levels([lv], out, workspace, content=False, on_host=on_host)
        raise deferred
    _decode_levels(levels, out, workspace, on_host=on_host)


def _decode_levels(levels: list[_Level], out: torch.Tensor, workspace: int,
                   content: bool = True, on_host: bool = False) -> None:
    """Decode the chain ``levels`` (the requested tensor first) into ``out`` chunk by chunk
    and check it (``content``: and the content hashes). Each chunk is built from the deepest
    level up: its bytes first, then each delta's XORed in, so that after level d the chunk
    holds level d's raw bytes, whose leaves are hashed there when that level's content hash
    is to be checked (chunks are whole leaves but for the tensor's last). ``on_host``: the
    chunk is built in a device buffer and copied down into ``out`` (host memory).

    Every chunk is planned before the first is staged (:class:`_Run`), and the tables of all
    chunks' launches go to the device in one upload per window of chunks: the host's work per
    chunk is its copy into pinned memory, one host-to-device copy and the launches (a small
    state's load is bound by that host work, not by the device). One staging buffer and one
    buffer of decoded planes serve every chunk and level, in stream order."""
    nbytes = levels[0].t.raw_nbytes
    hashed = [d for d, lv in enumerate(levels)
              if content and (lv.reader.verify_hashes or lv.t.is_delta)]
    chunk, runs = _load_chunk(levels, nbytes, workspace, on_host, plans=True,
                              hashed=len(hashed))
    bounds = runs[0].bounds
    nleaf = -(-nbytes // LEAF_SIZE)
    digests = {d: torch.empty(max(nleaf, 1), dtype=torch.int64, device="cuda") for d in hashed}
    room = min(chunk, runtime.align(nbytes, 16))  # (a tensor smaller than one chunk)
    pbuf = runtime.device_empty(room) if len(levels) > 1 else None
    cbuf = runtime.device_empty(room) if on_host else None
    staged = max(int(r.staged.max(initial=0)) for r in runs)
    stage = runtime.device_empty(staged)
    scratch = runtime.device_empty(max(r.decoded for r in runs))
    pinned = [runtime.pinned(staged), runtime.pinned(staged) if len(bounds) * len(runs) > 1
              else None]
    events = [torch.cuda.Event(), torch.cuda.Event()]  # after each pinned buffer's last copy
    recorded = [False, False]
    # where chunk k is built: level d's bytes land in ``into`` (the deepest level) or in pbuf
    # (then XORed into ``into``)
    into_at = [(cbuf.data_ptr() if on_host else out.data_ptr() + lo) for lo, _hi in bounds]
    for d, r in enumerate(runs):
        r.addresses(stage.data_ptr(), scratch.data_ptr(),
                    into_at if d == len(levels) - 1 else [pbuf.data_ptr()] * len(bounds))
    errs = [torch.zeros(r.flags_at + len(bounds), dtype=torch.int32, device="cuda")
            for r in runs]  # per level: an error code per rANS row, then a merge flag per chunk
    lens = np.array([hi - lo for lo, hi in bounds], np.uint64)
    leaf_first = np.zeros((len(bounds), 2), np.int64)
    leaf_first[:, 1] = (lens.astype(np.int64) + LEAF_SIZE - 1) // LEAF_SIZE
    leaf_at = np.array([lo // LEAF_SIZE for lo, _hi in bounds], np.int64)
    leaf = sum(r.ntables for r in runs)  # (the leaf tables come after every level's)
    n = 0
    for w0, w1 in _windows(runs, workspace):
        arrays: list[np.ndarray] = []
        for r in runs:
            arrays += r.tables(w0, w1)
        if hashed:
            arrays += [np.array(into_at[w0:w1], np.uint64), lens[w0:w1], leaf_first[w0:w1],
                       leaf_at[w0:w1]]
        dev, addrs = runtime.upload(*arrays)
        for k in range(w0, w1):
            lo, hi = bounds[k]
            into = cbuf[:hi - lo] if on_host else out[lo:hi]
            for depth in range(len(levels) - 1, -1, -1):
                r = runs[depth]
                slot = n % 2
                if recorded[slot]:
                    events[slot].synchronize()  # its pinned buffer is free again
                deepest = depth == len(levels) - 1
                r.launch(k, w0, addrs[depth * r.ntables:(depth + 1) * r.ntables], stage,
                         pinned[slot], events[slot], errs[depth],
                         into if deepest else pbuf[:hi - lo])
                recorded[slot] = True
                if not deepest:
                    runtime.xor(into, pbuf[:hi - lo], out=into)
                if depth in digests:
                    i = k - w0
                    runtime.launch("hash", "leaf_digests", (int(leaf_first[k, 1]) + 7) // 8,
                                   256, np.int32(1), np.uint64(addrs[leaf] + 8 * i),
                                   np.uint64(addrs[leaf + 1] + 8 * i),
                                   np.uint64(addrs[leaf + 2] + 16 * i),
                                   np.uint64(addrs[leaf + 3] + 8 * i),
                                   runtime.ptr(digests[depth]))
                n += 1
            if on_host:  # (the next chunk's kernels write cbuf after this copy, in stream order)
                out[lo:hi].copy_(into, non_blocking=True)
        del dev  # stream-ordered: reused only after these launches
    _check(levels, runs, nbytes, errs, digests)


def _windows(runs: list[_Run], workspace: int) -> list[tuple[int, int]]:
    """Consecutive chunks whose launch tables (every level's) go to the device in one upload:
    as many as 1/:data:`TABLE_SHARE` of the workspace holds, at least one."""
    per = sum(r.table_bytes for r in runs)
    if not per.size:  # (an empty tensor: no chunks)
        return []
    cap = max(int(per.max()), workspace // TABLE_SHARE)
    out, w0, used = [], 0, 0
    for k, b in enumerate(per.tolist()):
        if used + b > cap and k > w0:
            out.append((w0, k))
            w0, used = k, 0
        used += b
    out.append((w0, per.size))
    return out


TABLE_SHARE = 16  # a window of chunks' launch tables holds at most 1/16 of the workspace
ROW_SIZES = (1, 1, 8, 4, 8, 8, 8, 4)  # bytes per rANS row of the decode kernel's columns


def _load_chunk(levels: list[_Level], nbytes: int, workspace: int, on_host: bool = False,
                plans: bool = False, hashed: int | None = None):
    """A chunk length (a multiple of every level's ``align()``) whose decode needs at most
    ``workspace`` (see :func:`_need`; or one ``align()`` when even that needs more). Starts
    from what the workspace would hold at the tensor's average need per byte and steps down
    by a tenth until it fits: within about a tenth of the largest that fits. ``hashed``: the
    levels whose leaves are digested (default: all). ``plans``: returns (the chunk, every
    level's :class:`_Run` at it)."""
    align = max(lv.align() for lv in levels)  # (powers of two)
    per_byte = max(lv.need(0, nbytes) for lv in levels) / max(nbytes, 1)
    per_byte += (len(levels) > 1) + on_host  # (the XOR buffer, the buffer built on the device)
    k = max(1, min(-(-nbytes // align), int(workspace / per_byte / align)))
    while True:
        chunk = k * align
        runs = [_Run(lv, [(lo, min(nbytes, lo + chunk)) for lo in range(0, nbytes, chunk)])
                for lv in levels]
        if _need(runs, chunk, nbytes, len(levels) > 1, on_host, workspace,
                 len(levels) if hashed is None else hashed) <= workspace or k == 1:
            break
        k = max(1, min(k - 1, k * 9 // 10))
    chunk = max(align, min(chunk, -(-nbytes // align) * align))
    return (chunk, runs) if plans else chunk


def _need(runs: list[_Run], chunk: int, nbytes: int, chain: bool, on_host: bool,
          workspace: int, hashed: int) -> int:
    """Device bytes a chunked decode holds at once: the staging buffer and the decoded planes
    (each sized by the largest chunk of any level), a window's launch tables
    (:func:`_windows`), every level's frequency tables and error codes (a code per rANS row, a
    flag per chunk), the leaf digests of the ``hashed`` levels (and the copy :func:`_check`
    reads back, of the codes and digests), with a chain the buffer an ancestor's bytes are
    decoded into for the XOR, for a host destination the buffer the chunk is built in, and
    4 KiB to spare."""
    room = min(chunk, runtime.align(nbytes, 16))
    windows = _windows(runs, workspace)
    per = sum(r.table_bytes for r in runs)
    tables = max((int(per[w0:w1].sum()) for w0, w1 in windows), default=0)
    codes = sum(4 * (r.flags_at + len(r.bounds)) for r in runs)
    digests = hashed * 8 * max(-(-nbytes // LEAF_SIZE), 1)
    return (max(int(r.staged.max(initial=0)) for r in runs) + max(r.decoded for r in runs)
            + tables + sum(1024 * r.ntabs for r in runs) + 2 * (codes + digests)
            + (room if chain else 0) + (room if on_host else 0) + 4096)


def _tables(lv: _Level) -> tuple[torch.Tensor | None, int]:
    """The level's rANS frequency prefix sums on the device (one 1 KiB row per stream)."""
    if lv.streams is None or not lv.streams.freqs.shape[0]:
        return None, 0
    s = lv.streams
    cums = (np.cumsum(s.freqs, axis=1) - s.freqs).astype(np.uint32)
    dev, (p,) = runtime.upload(cums)
    return dev, p


class _Run:
    """One level of a chunked decode, planned for all its chunks (``bounds``: byte ranges) at
    once. Per chunk: the host arrays staged back to back (each piece 16-byte aligned) and the
    staged bytes; the rows of the rANS launches (every chunk's, chunk after chunk, plane by
    plane inside a chunk), the CTAs of each chunk's launch, and the merge's segments (one per
    chunk). :meth:`addresses` fixes the device addresses; :meth:`tables` gives a window of
    chunks' tables to upload; :meth:`launch` stages and decodes one chunk."""

    def __init__(self, lv: _Level, bounds: list[tuple[int, int]]) -> None:
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


def _check(levels: list[_Level], runs: list[_Run], nbytes: int, errs: list[torch.Tensor],
           digests: dict[int, torch.Tensor]) -> None:
    """One synchronisation: every level's error codes (per rANS row, then a merge flag per
    chunk) and the leaf digests of the levels whose content hashes are checked. Failures are
    raised in the CPU reader's order, not chunk by chunk: per level (the requested tensor
    first, then its ancestors), the rANS error of the lowest block (blocks are numbered plane
    by plane, so: the first plane that fails, at its first failing block), then the merge
    flags; then the content hashes from the deepest level up (a delta reads its parent, hash
    checked, before its own hash is checked)."""
    parts = [e.view(torch.uint8) for e in errs]
    parts += [digests[d].view(torch.uint8) for d in sorted(digests)]
    back = torch.cat(parts).cpu().numpy()
    pos = 0
    for lv, r, e in zip(levels, runs, errs):
        v = back[pos:pos + 4 * e.numel()].view(np.int32)
        pos += 4 * e.numel()
        name = f"{lv.reader.name}: tensor {lv.t.name!r}"
        bad = np.flatnonzero(v[:r.rows])
        if bad.size:
            first = bad[np.argmin(r.blk[bad])]
            b, code = int(r.blk[first]), int(v[first])
            s = lv.streams
            q = int(np.searchsorted(s.first, b, side="right") - 1)
            p = lv.t.planes[lv.rans[int(s.coded[q])]]
            raise CodecError(f"{name} plane {p.label}: rans block {b - int(s.first[q])} of "
                             f"{int(s.first[q + 1] - s.first[q])} is corrupt: "
                             f"{rans._ERR_TEXT.get(code, 'error')}")
        if v[r.flags_at:].any():
            raise FormatError(f"{name}: a plane holds values wider than its field")
    nleaf = -(-nbytes // LEAF_SIZE)
    where = {}
    for d in sorted(digests):
        where[d] = pos
        pos += 8 * digests[d].numel()
    for d in sorted(digests, reverse=True):
        lv = levels[d]
        got = content_hashes_from_leaves([nbytes], back[where[d]:where[d] + 8 * nleaf].view(
            np.uint64), [0, nleaf])[0]
        if got != lv.t.content_hash:
            raise ContentHashError(f"{lv.reader.name}: tensor {lv.t.name!r} content hash "
                                   "mismatch after decoding: the file is corrupt or its parent "
                                   "is wrong")  # (the CPU reader's words)
