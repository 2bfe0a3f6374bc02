"""A tensor too large for the workspace, coded in chunks of elements, so the encoder's extra
device memory stays under the workspace whatever the tensor's size.

The stored planes are byte for byte those of the one-group path: a plane's rANS frequencies
come from the whole plane's histogram, and a chunk is a whole number of rANS blocks. Three
passes run over the chunks: the histograms and content leaves (one synchronisation); the coding,
each chunk's words gathered on the device and copied to pinned host memory, where the host
moves them together after the one synchronisation; and, for planes whose rANS stream would
reach their raw size, their raw or bitpack-w bytes. GDeflate does not run here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from s4format import codecs, hashing, layouts
from s4format.codecs import rans
from s4format.hashing import LEAF_SIZE
from s4format.writer import CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import plan, ransencode, ranshost, runtime
from s4weights.gpu.hash import content_hashes_from_leaves
from s4weights.gpu.items import Coded, Item
from s4weights.gpu.planes import Planes, launch_split

if TYPE_CHECKING:
    from s4weights.gpu.encode import Encoder


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
    """Code one split-layout tensor in chunks, its extra device memory about ``workspace``:
    histograms first, then the coding pass (again with wider slots if a chunk's words outgrew
    theirs), then the planes whose streams did not pay, copied down as stored."""
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


# The coding pass's launch tables of a window of chunks hold at most 1/TABLE_SHARE of the
# workspace (the chunks are sized from the rest): one upload per window, not per chunk. A
# window takes at most WINDOW_CHUNKS chunks, so the device starts on the first window while the
# host makes the next one's tables.
TABLE_SHARE = 16
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
    c = _Coding(ch, st)
    starts, lengths, k = list(ch), [], 0
    while k < len(starts):
        batch, steps, k = c.queue_window(enc, width, starts, k, table_bytes)
        c.run_window(batch, steps, lengths)
    torch.cuda.current_stream().synchronize()
    if not c.nj:
        return True
    c.tab_buf = None
    return st.collect(c.host_meta.numpy(), lengths)


class _Coding:
    """Pass 2's device buffers, reused by every chunk in stream order: one buffer for the
    chunk's planes and its planes packed to bitpack-w, then (once they have gone down) the
    rANS words gathered for the copy down; the rANS scratch and the blocks' figures; the
    encoder-table inputs, uploaded once."""

    def __init__(self, ch: _Chunks, st: _Streams) -> None:
        self.ch, self.st = ch, st
        jobs, lg, chunk = st.jobs, st.lg, ch.chunk
        self.nj = nj = len(jobs)
        planes_bytes = int(ch.offs[-1])
        packed = [i for i in sorted(st.packed) if i not in st.job]
        pk_at = planes_bytes + runtime.align(chunk) * np.arange(len(packed))
        self.buf = buf = runtime.device_empty(max(
            planes_bytes + runtime.align(chunk) * len(packed),
            plan.large_staging(chunk, nj, st.slot)))
        ch.buf = buf[:planes_bytes]
        self.staged = runtime.align(st.slot * chunk) * np.arange(nj)
        if nj:
            self.scratch = runtime.device_empty(nj * runtime.align(2 * chunk))
            nbf = -(-chunk >> lg)
            figures = ransencode.rans_meta_bytes(nj * nbf)
            self.meta = runtime.device_empty(figures + 8 * (nj * nbf + 1))
            self.excl = self.meta[figures:].view(torch.int64)
            self.excl[:1].zero_()
            # encoder-table inputs (frequencies, their exclusive prefix sums): up once
            fc = np.concatenate((st.freqs, np.cumsum(st.freqs, axis=1) - st.freqs), axis=1
                                ).astype(np.uint32)
            self.tab_buf, (tab_p,) = runtime.upload(fc)  # (kept until the synchronisation)
            self.tabs = np.uint64(tab_p) + np.arange(nj, dtype=np.uint64) * np.uint64(2048)
            self.host_meta = runtime.pinned(134 * nj * st.nb)
            self.words = np.uint64(buf.data_ptr()) + self.staged.astype(np.uint64)
        self.outs = dict(zip(packed, (buf[int(a):int(a) + runtime.align(chunk)]
                                      for a in pk_at)))
        self.off = 0  # in ``host_meta``

    def queue_window(self, enc: Encoder, width: np.ndarray, starts: list[int], k: int,
                     table_bytes: int) -> tuple[runtime.Batch, list, int]:
        """Queue the launches of a window of chunks from chunk k on, whose tables go up in one
        upload (at most ``table_bytes`` and WINDOW_CHUNKS chunks, and always one chunk).
        Returns the batch, each chunk's (start, elements, launches, blocks) and the next k."""
        ch, st, nj = self.ch, self.st, self.nj
        batch, steps, per = runtime.Batch(), [], 0
        while k < len(starts) and (not steps or (batch.table_bytes() + per <= table_bytes
                                                 and len(steps) < WINDOW_CHUNKS)):
            c0 = starts[k]
            m = min(ch.chunk, ch.n - c0)
            before, size = batch.mark(), batch.table_bytes()
            ch.queue_split(c0, m, batch)
            st.pack_plain(m, ch, self.outs, batch)
            blocks = 0
            if nj:
                r = ransencode.rans_launch(width, np.full(nj, m),
                                           np.array([ch.addr(i) for i in st.jobs], np.uint64),
                                           None, self.tabs, batch, enc.log2_block,
                                           scratch=self.scratch, out=self.meta)
                blocks = r["bt"].size
            steps.append((c0, m, batch.mark() - before, blocks))
            if nj:
                ransencode.place_words(r, self.words, batch, excl=self.excl.data_ptr(),
                                       cap=st.slot * m)
                del r
            per = max(per, batch.table_bytes() - size)
            k += 1
        return batch, steps, k

    def run_window(self, batch: runtime.Batch, steps: list, lengths: list[int]) -> None:
        """Run a window's launches chunk by chunk, each chunk's planes and gathered words
        copied down as soon as they are made."""
        ch, st, nj = self.ch, self.st, self.nj
        for c0, m, first, blocks in steps:
            if ch.it.parent is not None:
                ch.raw(c0)  # the XOR the split reads
            batch.run(first)
            # the planes go down before the gathered words take their place in ``buf``
            st.copy_plain(c0, m, ch, self.outs)
            lengths.append(m)
            if not nj:
                continue
            torch.cumsum(self.meta[:4 * blocks].view(torch.int32), 0, dtype=torch.int64,
                         out=self.excl[1:blocks + 1])
            batch.run(1)  # rans_place
            # the whole slot goes down, whatever the words' length (the host reads the counts
            # only after the one synchronisation): ``slot`` bytes per symbol of PCIe traffic
            for j, i in enumerate(st.jobs):
                st.d2h(st.words_at(i) + st.slot * c0,
                       self.buf[int(self.staged[j]):int(self.staged[j]) + st.slot * m])
            self.host_meta[self.off:self.off + 134 * blocks].copy_(self.meta[:134 * blocks],
                                                                   non_blocking=True)
            self.off += 134 * blocks


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
