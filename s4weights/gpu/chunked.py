"""Save side for a tensor too large for the workspace: coded in chunks of elements, so the
encoder's extra device memory stays under the workspace whatever the tensor's size.

The stored planes are byte for byte those of the one-group path (``Encoder._encode_group``):
a plane's rANS frequency table comes from the histogram of the whole plane, and a chunk is a
whole number of rANS blocks, so blocks (and their words, word counts and final states) do not
depend on how the tensor was cut. Three kinds of pass run over the chunks, each reading the
tensor's chunk (XORed with its parent's chunk for a delta) and splitting it into one reused
buffer of planes:

1. histograms of every plane (and the content hash's leaf digests: a chunk is a whole number
   of 64 KiB leaves). One host synchronisation at the end.
2. coding, with no synchronisation until the last chunk: packed sign bits and raw planes go to
   pinned host memory as they are; every rANS plane's blocks are encoded (one launch per
   chunk), their words gathered on the device (``rans_place``, behind a prefix sum of the
   word counts made there), and copied down to a slot of one byte per symbol in the plane's
   place in pinned host memory, with the blocks' word counts and final states. After the
   one synchronisation the host moves each chunk's words down behind the chunk before (and
   finds which streams reached their raw size: those planes are stored raw, as the one-group
   path would). A chunk whose words outgrow their slot (it codes to more than its raw bytes
   while the whole plane does not) makes the pass run again with slots of two bytes per
   symbol, the most a block writes.
3. only for planes whose streams went over their raw size: their raw bytes (or bitpack-w),
   split again.

Plane checksums are left to the writer (CPU, from the host payloads). GDeflate does not run
here: a tensor this large under a GDeflate policy takes the one-group path.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, hashing, layouts
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
from s4format.writer import CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import plan, ransencode, ranshost, ransparse, runtime
from s4weights.gpu.encode import Encoder
from s4weights.gpu.hash import content_hashes_from_leaves
from s4weights.gpu.items import Coded, Item
from s4weights.gpu.planes import Planes, launch_split


class _Chunks:
    """Chunks of one item's elements, split into one reused buffer of planes."""

    def __init__(self, it: Item, chunk: int) -> None:
        self.it = it
        self.word = it.layout.word_size(it.dtype.itemsize)
        self.n = it.nbytes // self.word
        self.chunk = chunk
        sizes = [runtime.align(chunk // 8)] + [runtime.align(chunk)] * (len(it.layout.fields) - 1)
        self.offs = np.concatenate(([0], np.cumsum(sizes)))
        self.buf: torch.Tensor | None = None  # the chunk's planes (made by the first split)
        self.xbuf = runtime.device_empty(chunk * self.word) if it.parent is not None else None

    def __iter__(self):
        return iter(range(0, self.n, self.chunk))

    def plane(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of plane k of the chunk (0: the packed sign bits)."""
        return self.buf[int(self.offs[k]):int(self.offs[k]) + nbytes]

    def addr(self, k: int) -> int:
        return self.buf.data_ptr() + int(self.offs[k])

    def raw(self, c0: int) -> tuple[int, torch.Tensor]:
        """(elements, the raw bytes) of the chunk starting at element c0: for a delta, its XOR
        with the parent's chunk, made now in the XOR buffer."""
        m = min(self.chunk, self.n - c0)
        lo, hi = c0 * self.word, (c0 + m) * self.word
        src = self.it.data[lo:hi]
        if self.it.parent is not None:
            src = runtime.xor(src, self.it.parent[lo:hi], out=self.xbuf[:hi - lo])
        return m, src

    def queue_split(self, c0: int, m: int, batch: runtime.Batch) -> None:
        """Queue in ``batch`` the split of the chunk at c0 (``m`` elements) into the plane
        buffer; a delta's chunk is read from the XOR buffer, where ``raw`` must have made it
        before the launch runs."""
        if self.buf is None:
            self.buf = runtime.device_empty(int(self.offs[-1]))
        src = (self.xbuf.data_ptr() if self.it.parent is not None
               else self.it.data.data_ptr() + c0 * self.word)
        launch_split(self.it.layout.layout_id, [src], [m],
                     [[self.addr(k) for k in range(len(self.offs) - 1)]], 0, 0,
                     kind="split", batch=batch)

    def split(self, c0: int, hist_p: int = 0) -> tuple[int, torch.Tensor]:
        """Split the chunk starting at element c0 into the plane buffer or, given ``hist_p``,
        only add its histograms there (1024 u64, then the set sign bits): (elements, the
        chunk's raw bytes)."""
        m, src = self.raw(c0)
        if hist_p:
            launch_split(self.it.layout.layout_id, [src.data_ptr()], [m], None, hist_p,
                         hist_p + 8 * 1024, kind="hist")
            return m, src
        batch = runtime.Batch()
        self.queue_split(c0, m, batch)
        batch.run()
        return m, src


def code_large(enc: Encoder, it: Item, workspace: int) -> Coded:
    """Code one split-layout tensor in chunks; extra device memory about ``workspace``."""
    lay, size = it.layout, it.dtype.itemsize
    n = it.nbytes // lay.word_size(size)
    lg = enc.log2_block
    xor = it.parent is not None

    prof = runtime.Profile("encode large")
    # pass 1: histograms and content leaves (chunks hold whole 64 KiB leaves)
    ch = _Chunks(it, plan.large_chunk(lay, size, workspace, n, 0, xor, lg))
    hist = torch.zeros(1025, dtype=torch.int64, device="cuda")
    digests = []
    for c0 in ch:
        _m, src = ch.split(c0, hist.data_ptr())
        digests.append(runtime.leaf_digests([src.data_ptr()], [src.numel()])[0])
    nleaf = -(-it.nbytes // LEAF_SIZE)
    d = torch.cat(digests)[:nleaf].cpu().numpy().view(np.uint64)
    content = content_hashes_from_leaves([it.nbytes], d, [0, nleaf])[0]
    h = hist.cpu().numpy()  # sync
    del ch, digests, src
    prof.mark("histograms")

    # codec candidates and rANS tables from the whole tensor's histograms
    planes = Planes.of_tensor(lay, n, h[:1024], int(h[1024]))
    enc.candidates(planes)
    jobs = np.flatnonzero(planes.runs_rans).tolist()
    freqs = planes.freqs[jobs]
    # bits per symbol the rANS kernel reads: the sign plane's packed bits, bytes otherwise
    width = np.where(planes.kind[jobs] == layouts.KIND_SIGN, 1, 8)

    # pass 2: coding, chunk by chunk, one synchronisation (again with wider slots if a
    # chunk's words outgrew theirs)
    tables = workspace // TABLE_SHARE
    for slot in SLOTS:
        ch = st = None  # a first pass's buffers (device and pinned) go before the next's
        ch = _Chunks(it, plan.large_chunk(lay, size, workspace - tables, n, len(jobs), xor, lg,
                                          packed=int(planes.cand_bw.sum()), slot=slot))
        st = _Streams(planes, jobs, freqs, n, lg, slot)
        if _code_chunks(enc, ch, st, width, tables):
            break
    else:
        raise AssertionError("a chunk's words outgrew a slot of a word per symbol")
    prof.mark(f"coding ({-(-n // ch.chunk)} chunks)")
    # pass 3: byte planes whose rANS stream would reach their raw size: bitpack-w where it
    # applies (the next candidate), else raw
    redo = [i for i in jobs if st.over[i] and st.varied[i]
            and planes.kind[i] != layouts.KIND_SIGN]
    st.packed |= {i for i in redo if planes.cand_bw[i]}
    if redo:
        for c0 in ch:
            m = ch.split(c0)[0]
            for i in redo:
                st.copy_plane(i, c0, m, ch)
    torch.cuda.current_stream().synchronize()
    del ch
    prof.mark("raw planes, D2H")

    coded = st.coded()
    prof.mark("assemble")
    prof.report()
    if sum(c.stored_len for c in coded) > it.nbytes:
        # splitting stores more than the raw bytes: the CPU coder codes the raw tensor
        return Coded(code_tensor(_host_bytes(it, workspace), it.dtype, enc.policy), content)
    return Coded(CodedTensor(lay, coded), content)


def code_host(enc: Encoder, it: Item, workspace: int) -> Coded:
    """A tensor the GPU does not split, too large for the workspace (or a delta of one): its
    bytes go to host memory in pieces and the CPU coder codes them, as the one-group path
    would, without a device copy of the whole tensor."""
    raw = _host_bytes(it, workspace)
    return Coded(code_tensor(raw, it.dtype, enc.policy), hashing.content_hash(raw))


def _host_bytes(it: Item, workspace: int) -> np.ndarray:
    """The item's raw bytes (a delta's XOR) in host memory, copied in pieces (a delta's XOR
    through a device buffer of at most the workspace, and at most 64 MiB)."""
    out = np.empty(it.nbytes, dtype=np.uint8)
    step = max(1 << 20, min(64 << 20, workspace) >> 20 << 20)
    xbuf = runtime.device_empty(step) if it.parent is not None else None
    for lo in range(0, it.nbytes, step):
        hi = min(it.nbytes, lo + step)
        src = it.data[lo:hi]
        if it.parent is not None:
            src = runtime.xor(src, it.parent[lo:hi], out=xbuf[:hi - lo])
        out[lo:hi] = src.cpu().numpy()
    return out


def _room(n: int) -> int:
    """A rANS stream of a plane of n bytes is kept only while it is shorter than this: the
    plane's raw size, past which the one-group path stores it raw too."""
    return n


# The coding pass's launch tables of a window of chunks hold at most this share of the
# workspace (and the chunks are sized from the rest): one upload per window, not per chunk.
# A window takes at most WINDOW_CHUNKS chunks: the device starts on the first window while the
# host makes the next one's tables (all of a 49 MB tensor's 35 chunks at once left the device
# idle for the 5.6 ms their tables took; bench/RESULTS.md, session 21)
TABLE_SHARE = 64
WINDOW_CHUNKS = 8

# Bytes per symbol of a chunk's slot for its words in host memory: one first (a stream kept is
# shorter than its plane), then two, the most a block writes (a word per symbol)
SLOTS = (1, 2)


def _code_chunks(enc: Encoder, ch: _Chunks, st: _Streams, width: np.ndarray,
                 table_bytes: int) -> bool:
    """Pass 2 of ``code_large``: every chunk split, its plain planes copied down and its rANS
    planes coded into ``st``, with one synchronisation at the end; the launch tables of a
    window of chunks go up at once, at most ``table_bytes`` of them (and at least a chunk's).
    False when a chunk's words outgrew their slot in a stream that stays under its raw size
    (``st`` is then unusable; run again with wider slots)."""
    jobs, lg, chunk = st.jobs, st.lg, ch.chunk
    nj = len(jobs)
    planes_bytes = int(ch.offs[-1])
    # one buffer: the chunk's planes and its planes packed to bitpack-w, then (once they have
    # gone down) the rANS words gathered for the copy down
    packed = [i for i in sorted(st.packed) if i not in st.job]
    pk_at = planes_bytes + runtime.align(chunk) * np.arange(len(packed))
    buf = runtime.device_empty(max(planes_bytes + runtime.align(chunk) * len(packed),
                                   plan.large_staging(chunk, nj, st.slot)))
    ch.buf = buf[:planes_bytes]
    staged = runtime.align(st.slot * chunk) * np.arange(nj)
    if nj:
        scratch = runtime.device_empty(nj * runtime.align(2 * chunk))
        nbf = -(-chunk >> lg)
        figures = ransencode.rans_meta_bytes(nj * nbf)
        meta = runtime.device_empty(figures + 8 * (nj * nbf + 1))
        excl = meta[figures:].view(torch.int64)
        excl[:1].zero_()
        # encoder-table inputs (frequencies, their exclusive prefix sums): up once
        fc = np.concatenate((st.freqs, np.cumsum(st.freqs, axis=1) - st.freqs), axis=1
                            ).astype(np.uint32)
        tab_buf, (tab_p,) = runtime.upload(fc)  # (kept until the synchronisation below)
        tabs = np.uint64(tab_p) + np.arange(nj, dtype=np.uint64) * np.uint64(2048)
        host_meta = runtime.pinned(134 * nj * st.nb)
        words = np.uint64(buf.data_ptr()) + staged.astype(np.uint64)
    outs = dict(zip(packed, (buf[int(a):int(a) + runtime.align(chunk)] for a in pk_at)))
    starts, lengths, off, k = list(ch), [], 0, 0
    while k < len(starts):
        # a window of chunks whose launch tables go up in one upload (at most
        # ``table_bytes`` and WINDOW_CHUNKS chunks, and always one chunk)
        batch, steps, per = runtime.Batch(), [], 0
        while k < len(starts) and (not steps or (batch.table_bytes() + per <= table_bytes
                                                 and len(steps) < WINDOW_CHUNKS)):
            c0 = starts[k]
            m = min(chunk, ch.n - c0)
            before, size = batch.mark(), batch.table_bytes()
            ch.queue_split(c0, m, batch)
            st.pack_plain(m, ch, outs, batch)
            blocks = 0
            if nj:
                r = ransencode.rans_launch(width, np.full(nj, m),
                                           np.array([ch.addr(i) for i in jobs], np.uint64),
                                           None, tabs, batch, enc.log2_block, scratch=scratch,
                                           out=meta)
                blocks = r["bt"].size
            steps.append((c0, m, batch.mark() - before, blocks))
            if nj:
                ransencode.place_words(r, words, batch, excl=excl.data_ptr(),
                                       cap=st.slot * m)
                del r
            per = max(per, batch.table_bytes() - size)
            k += 1
        for c0, m, first, blocks in steps:
            if ch.it.parent is not None:
                ch.raw(c0)  # the XOR the split reads
            batch.run(first)
            # the planes go down before the gathered words take their place in ``buf``
            st.copy_plain(c0, m, ch, outs)
            lengths.append(m)
            if not nj:
                continue
            torch.cumsum(meta[:4 * blocks].view(torch.int32), 0, dtype=torch.int64,
                         out=excl[1:blocks + 1])
            batch.run(1)  # rans_place
            # the whole slot goes down, whatever the words' length (the host reads the counts
            # only after the one synchronisation): ``slot`` bytes per symbol of PCIe traffic
            for j, i in enumerate(jobs):
                st.d2h(st.words_at(i) + st.slot * c0,
                       buf[int(staged[j]):int(staged[j]) + st.slot * m])
            host_meta[off:off + 134 * blocks].copy_(meta[:134 * blocks], non_blocking=True)
            off += 134 * blocks
    torch.cuda.current_stream().synchronize()
    if not nj:
        return True
    del tab_buf
    return st.collect(host_meta.numpy(), lengths)


class _Streams:
    """Every plane's stored bytes in pinned host memory, filled chunk by chunk.

    Plane i owns a region at ``at[i]``: the packed sign bits (n/8 bytes, kept in any case, as
    bitpack is the sign plane's fallback), then, for a plane the rANS kernel codes, room for its
    stream: header and table, word counts, final states, then the chunks' words, each chunk's
    in a slot of ``slot`` bytes per symbol until ``collect`` moves them together. A stream that
    reaches the plane's raw size (``over``) is not kept: the plane is stored raw (a sign plane
    as bitpack), and a byte plane's region takes its raw bytes. Byte planes the kernel does
    not code hold their raw bytes."""

    def __init__(self, planes: Planes, jobs: list[int], freqs: np.ndarray, n: int,
                 lg: int, slot: int = 1) -> None:
        self.planes, self.jobs, self.n, self.lg, self.slot = planes, jobs, n, lg, slot
        self.freqs = freqs
        self.nb = ranshost.n_blocks(n, lg)
        self.job = {i: j for j, i in enumerate(jobs)}
        self.prefix = {i: ranshost.rans_prefix(freqs[j], lg, n) for j, i in enumerate(jobs)}
        self.head = {i: len(self.prefix[i]) + rans.BLOCK_OVERHEAD * self.nb for i in jobs}
        self.room = _room(n)
        self.over = {i: self.head[i] >= self.room for i in jobs}
        self.words = {i: 0 for i in jobs}          # bytes of words
        self.firsts = {i: np.zeros(self.nb, np.uint8) for i in jobs}
        self.varied = {i: False for i in jobs}
        # byte planes stored as bitpack-w: those it ranks first, and those whose rANS stream
        # turns out not to pay (its next candidate, as policy.encode_plane codes them)
        self.packed = {i for i in range(len(planes)) if planes.bw_first[i]}
        self.at, total = [], 0
        self.sign_len = (n + 7) // 8
        for i, kind in enumerate(planes.kind.tolist()):
            self.at.append(total)
            stream = self.head[i] + slot * n if i in self.job else n
            if kind == layouts.KIND_SIGN:
                total += runtime.align(self.sign_len, 16) + (stream if i in self.job else 0)
            else:
                total += runtime.align(stream, 16)
        self.host = runtime.pinned(total)
        self.hnp = self.host.numpy()

    def stream_at(self, i: int) -> int:
        """Host offset of plane i's rANS stream (or raw bytes)."""
        sign = self.planes.kind[i] == layouts.KIND_SIGN
        return self.at[i] + (runtime.align(self.sign_len, 16) if sign else 0)

    def words_at(self, i: int) -> int:
        """Host offset of rANS plane i's words (behind its header, table, counts and states)."""
        return self.stream_at(i) + self.head[i]

    def d2h(self, host_off: int, src: torch.Tensor) -> None:
        if src.numel():
            self.host[host_off:host_off + src.numel()].copy_(src, non_blocking=True)

    def pack_plain(self, m: int, ch: _Chunks, outs: dict[int, torch.Tensor],
                   batch: runtime.Batch) -> None:
        """Queue in ``batch`` the packing of the chunk's byte planes ``outs`` (planes stored as
        bitpack-w that the rANS kernel does not code) into ``outs[i]``."""
        if outs:
            runtime.pack_ops([ch.addr(i) for i in outs], [o.data_ptr() for o in outs.values()],
                             [m] * len(outs), [int(self.planes.width[i]) for i in outs],
                             batch=batch)

    def copy_plain(self, c0: int, m: int, ch: _Chunks,
                   outs: dict[int, torch.Tensor] | None = None) -> None:
        """The chunk's packed sign bits, and every byte plane the rANS kernel does not code (a
        plane in ``outs``: packed there by ``pack_plain``)."""
        for i, kind in enumerate(self.planes.kind.tolist()):
            if kind == layouts.KIND_SIGN:
                self.d2h(self.at[i] + c0 // 8, ch.plane(0, (m + 7) // 8))
            elif i not in self.job:
                self.copy_plane(i, c0, m, ch, (outs or {}).get(i))

    def copy_plane(self, i: int, c0: int, m: int, ch: _Chunks,
                   packed: torch.Tensor | None = None) -> None:
        """The chunk's bytes of byte plane i as stored: raw, or packed on the device to
        bitpack-w (chunks start at multiples of 8 elements: on a whole stored byte; given
        ``packed``, already packed there)."""
        if i not in self.packed:
            self.d2h(self.stream_at(i) + c0, ch.plane(i, m))
            return
        w = int(self.planes.width[i])
        if packed is None:
            packed = runtime.device_empty((m * w + 7) // 8)
            runtime.pack_ops([ch.addr(i)], [packed.data_ptr()], [m], [w])
        self.d2h(self.stream_at(i) + c0 // 8 * w, packed[:(m * w + 7) // 8])
        del packed  # stream-ordered: reused only after the copy

    def collect(self, meta: np.ndarray, lengths: list[int]) -> bool:
        """After pass 2's synchronisation: each chunk's block figures (``meta``: per chunk, its
        launch's word counts, final states, first symbols and "varied" flags, as
        ``rans_encode`` wrote them) put in place, and every stream's words moved together
        behind its counts and states. False when a chunk's words outgrew their slot in a
        stream that stays under its raw size."""
        nj, lg = len(self.jobs), self.lg
        per = np.zeros((len(lengths), nj), np.int64)  # bytes of words, per chunk and job
        off, b_lo = 0, 0
        for k, m in enumerate(lengths):
            nbk = -(-m >> lg)
            t = nj * nbk
            counts = meta[off:off + 4 * t].view(np.uint32).reshape(nj, nbk)
            if (counts == 0xFFFFFFFF).any():  # (never: ranshost.WORD_COST bounds them)
                raise RuntimeError("rANS encoder: a block wrote more words than its bound "
                                   "(ranshost.WORD_COST); this is a bug")
            states = meta[off + 4 * t:off + 132 * t].reshape(nj, 128 * nbk)
            firsts = meta[off + 132 * t:off + 133 * t].reshape(nj, nbk)
            varied = meta[off + 133 * t:off + 134 * t].reshape(nj, nbk)
            for j, i in enumerate(self.jobs):
                s0 = self.stream_at(i) + len(self.prefix[i])
                self.hnp[s0 + 4 * b_lo:s0 + 4 * (b_lo + nbk)] = counts[j].view(np.uint8)
                s1 = s0 + 4 * self.nb + 128 * b_lo
                self.hnp[s1:s1 + 128 * nbk] = states[j]
                self.firsts[i][b_lo:b_lo + nbk] = firsts[j]
                self.varied[i] |= bool(varied[j].any())
            per[k] = 2 * counts.sum(axis=1, dtype=np.int64)
            off += 134 * t
            b_lo += nbk
        total = per.sum(axis=0)
        slots = self.slot * np.asarray(lengths, np.int64)
        for j, i in enumerate(self.jobs):
            self.over[i] = bool(self.head[i] + total[j] >= self.room)
            if self.over[i] or not self.varied[i]:
                continue  # its words are not stored
            if (per[:, j] > slots).any():
                return False
            w0, at, src = self.words_at(i), 0, 0
            for k in range(len(lengths)):
                w = int(per[k, j])
                if at != src:
                    self.hnp[w0 + at:w0 + at + w] = self.hnp[w0 + src:w0 + src + w]
                at += w
                src += int(slots[k])
            self.words[i] = at
        return True

    def coded(self) -> tuple[CodedPlane, ...]:
        """Codecs and payloads, chosen as ``encode.choose`` chooses them: the first candidate
        in rank order whose real size is under the plane's (rANS, bitpack and bitpack-w)."""
        out = []
        pl, n = self.planes, self.n
        for i in range(len(pl)):
            kind = int(pl.kind[i])
            codec, payload = codecs.RAW, None
            if pl.nsym[i] == 1 and pl.cand_rans[i]:
                head = ranshost.const_whole(pl.counts[i], n)  # CONST stream of the whole plane
                if len(head) < n:
                    codec, payload = codecs.RANS, np.frombuffer(head, np.uint8)
            elif i in self.job:
                if not self.varied[i]:
                    head = ranshost.const_stream(self.firsts[i], self.lg, self.n)
                    if len(head) < n:
                        codec, payload = codecs.RANS, np.frombuffer(head, np.uint8)
                elif not self.over[i]:
                    at = self.stream_at(i)
                    end = at + self.head[i] + self.words[i]
                    self.hnp[at:at + len(self.prefix[i])] = np.frombuffer(self.prefix[i],
                                                                          np.uint8)
                    codec, payload = codecs.RANS, self.hnp[at:end]
            if payload is None and i in self.packed:
                at = self.stream_at(i)
                out.append(CodedPlane(kind, int(pl.index[i]), codecs.BITPACK_W, n,
                                      self.hnp[at:at + int(pl.est_bw[i])],
                                      bytes([int(pl.width[i])])))
                continue
            if payload is None and kind == layouts.KIND_SIGN:
                if pl.cand_bp[i]:
                    codec, payload = codecs.BITPACK, self.hnp[self.at[i]:self.at[i]
                                                              + self.sign_len]
                else:
                    raise AssertionError("a large sign plane always has bitpack")
            if payload is None:
                at = self.stream_at(i)
                codec, payload = codecs.RAW, self.hnp[at:at + n]
            out.append(CodedPlane(kind, int(pl.index[i]), codec, n, payload))
        return tuple(out)


# -- load: a tensor whose one-batch decode would hold more than the workspace -----------------

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
        from s4weights.gpu import decode
        from s4weights.gpu.decode import plane_form_error

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
            decode.read_into(reader, bounds[0], span[1])
        self.stored = [reader.read_stored(t, j, span) for j in range(len(t.planes))]  # R1
        self.rans = [j for j, p in enumerate(t.planes) if p.codec == codecs.RANS]
        for j, p in enumerate(t.planes):
            err = plane_form_error(p, self.stored[j], j)
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
    from s4weights.gpu import decode

    try:
        _load_large(reader, i, out, workspace, on_host)
    except FormatError as exc:  # (CodecError is one)
        decode.raise_as_cpu(reader, i, exc)
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
        from s4weights.gpu import decode

        decode.copy_into(pinned.numpy(), self.copies[k])
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
        runtime.launch("planes", decode.MERGE_KERNEL[self.lv.t.layout.layout_id], m1 - m0, 256,
                       np.uint64(addrs[10] + 4 * mw), np.uint64(addrs[11] + 8 * mw),
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
