"""Save side for a tensor too large for the workspace: coded in chunks of elements, so the
encoder's extra device memory stays under the workspace whatever the tensor's size.

The stored planes are byte for byte those of the one-group path (``Encoder.encode_group``):
a plane's rANS frequency table comes from the histogram of the whole plane, and a chunk is a
whole number of rANS blocks, so blocks (and their words, word counts and final states) do not
depend on how the tensor was cut. Three kinds of pass run over the chunks, each reading the
tensor's chunk (XORed with its parent's chunk for a delta) and splitting it into one reused
chunk of planes:

1. histograms of every plane (and the content hash's leaf digests: a chunk is a whole number
   of 64 KiB leaves). One host synchronisation at the end.
2. coding: packed sign bits and raw planes go to pinned host memory as they are; every rANS
   plane's blocks are encoded (``Encoder._rans``, one launch per chunk), and after that chunk's
   synchronisation its word counts, final states and words are compacted on the device and
   copied to their places in the plane's stream in pinned host memory. A plane whose stream
   would reach its raw size stops being coded (it is stored raw, as the one-group path would).
3. only for planes that stopped: their raw bytes, split again.

Plane checksums are left to the writer (CPU, from the host payloads). GDeflate does not run
here: a tensor this large under a GDeflate policy takes the one-group path.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, hashing, layouts
from s4format.codecs import rans
from s4format.hashing import LEAF_SIZE
from s4format.writer import CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import plan, ranshost, runtime
from s4weights.gpu.encode import (
    Coded,
    Encoder,
    Item,
    _Plane,
    launch_split,
    planes_from_hist,
    rans_runs,
)
from s4weights.gpu.hash import content_hashes_from_leaves


class _Chunks:
    """Chunks of one item's elements, split into one reused buffer of planes."""

    def __init__(self, it: Item, chunk: int) -> None:
        self.it = it
        self.word = it.layout.word_size(it.dtype.itemsize)
        self.n = it.nbytes // self.word
        self.chunk = chunk
        sizes = [runtime.align(chunk // 8)] + [runtime.align(chunk)] * (len(it.layout.fields) - 1)
        self.offs = np.concatenate(([0], np.cumsum(sizes)))
        self.buf = runtime.device_empty(int(self.offs[-1]))
        self.xbuf = runtime.device_empty(chunk * self.word) if it.parent is not None else None

    def __iter__(self):
        return iter(range(0, self.n, self.chunk))

    def plane(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of plane k of the chunk (0: the packed sign bits)."""
        return self.buf[int(self.offs[k]):int(self.offs[k]) + nbytes]

    def addr(self, k: int) -> int:
        return self.buf.data_ptr() + int(self.offs[k])

    def split(self, c0: int, hist_p: int) -> tuple[int, torch.Tensor]:
        """Split the chunk starting at element c0 into the plane buffer, adding its histograms
        at ``hist_p`` (1024 u64, then the set sign bits): (elements, the chunk's raw bytes)."""
        m = min(self.chunk, self.n - c0)
        lo, hi = c0 * self.word, (c0 + m) * self.word
        src = self.it.data[lo:hi]
        if self.it.parent is not None:
            from s4weights.gpu import xor

            src = xor(src, self.it.parent[lo:hi], out=self.xbuf[:hi - lo])
        launch_split(self.it.layout.layout_id, [src.data_ptr()], [m],
                     [[self.addr(k) for k in range(len(self.offs) - 1)]], hist_p,
                     hist_p + 8 * 1024)
        return m, src


def code_large(enc: Encoder, it: Item, workspace: int) -> Coded:
    """Code one split-layout tensor in chunks; extra device memory about ``workspace``."""
    lay, size = it.layout, it.dtype.itemsize
    n = it.nbytes // lay.word_size(size)
    lg = enc.log2_block
    xor = it.parent is not None

    # pass 1: histograms and content leaves (chunks hold whole 64 KiB leaves)
    ch = _Chunks(it, plan.large_chunk(lay, size, workspace, n, 0, False, xor, lg))
    hist = torch.zeros(1025, dtype=torch.int64, device="cuda")
    digests = []
    for c0 in ch:
        _m, src = ch.split(c0, hist.data_ptr())
        digests.append(runtime.leaf_digests([src.data_ptr()], [src.numel()])[0])
    nleaf = -(-it.nbytes // LEAF_SIZE)
    d = torch.cat(digests)[:nleaf].cpu().numpy().view(np.uint64)
    content = content_hashes_from_leaves([it.nbytes], d, [0, nleaf])[0]
    h = hist.cpu().numpy()  # sync
    del ch, digests

    # codec candidates and rANS tables from the whole tensor's histograms
    planes = planes_from_hist(0, lay, n, [0] * len(lay.fields), h[:1024], int(h[1024]))
    enc._candidates(planes)
    jobs = [i for i, p in enumerate(planes) if _rans_runs_first(p)]
    freqs = enc._freqs[jobs]
    st = _Streams(planes, jobs, freqs, n, lg)

    # pass 2: coding, chunk by chunk
    sign_rans = any(planes[i].field.kind == layouts.KIND_SIGN for i in jobs)
    ch = _Chunks(it, plan.large_chunk(lay, size, workspace, n, len(jobs), sign_rans, xor, lg))
    for c0 in ch:
        m, _src = ch.split(c0, hist.data_ptr())  # (histograms no longer read)
        st.copy_plain(c0, m, ch)
        if jobs:
            cj = [_Plane(0, planes[i].field, m, ch.addr(i), planes[i].counts) for i in jobs]
            r = enc._rans(cj, freqs)  # sync: the chunk's block word counts
            st.add_chunk(c0, r)
            del r
    # pass 3: byte planes whose rANS stream would reach their raw size are stored raw
    redo = [i for i in jobs if st.over[i] and st.varied[i]
            and planes[i].field.kind != layouts.KIND_SIGN]
    if redo:
        for c0 in ch:
            m, _src = ch.split(c0, hist.data_ptr())
            for i in redo:
                st.d2h(st.stream_at(i) + c0, ch.plane(i, m))
    torch.cuda.current_stream().synchronize()
    del ch

    coded = st.coded(enc)
    if sum(c.stored_len for c in coded) > it.nbytes:
        # splitting stores more than the raw bytes: the CPU coder codes the raw tensor
        return Coded(code_tensor(_host_bytes(it), it.dtype, enc.policy), content)
    return Coded(CodedTensor(lay, coded), content)


def code_host(enc: Encoder, it: Item) -> Coded:
    """A tensor the GPU does not split, too large for the workspace (or a delta of one): its
    bytes go to host memory in pieces and the CPU coder codes them, as the one-group path
    would, without a device copy of the whole tensor."""
    raw = _host_bytes(it)
    return Coded(code_tensor(raw, it.dtype, enc.policy), hashing.content_hash(raw))


def _rans_runs_first(p: _Plane) -> bool:
    """Whether the one-group path would run the rANS kernel on plane p (``Encoder._encode``):
    rANS is a candidate, bitpack does not rank before it, and the plane is not one symbol."""
    bitpack_first = codecs.BITPACK in p.est and codecs.RANS in p.est and \
        (p.est[codecs.BITPACK], codecs.BITPACK) < (p.est[codecs.RANS], codecs.RANS)
    return codecs.RANS in p.est and not bitpack_first and p.nsym > 1


def _host_bytes(it: Item, step: int = 64 << 20) -> np.ndarray:
    """The item's raw bytes (a delta's XOR) in host memory, copied in pieces."""
    out = np.empty(it.nbytes, dtype=np.uint8)
    xbuf = runtime.device_empty(step) if it.parent is not None else None
    for lo in range(0, it.nbytes, step):
        hi = min(it.nbytes, lo + step)
        src = it.data[lo:hi]
        if it.parent is not None:
            from s4weights.gpu import xor

            src = xor(src, it.parent[lo:hi], out=xbuf[:hi - lo])
        out[lo:hi] = src.cpu().numpy()
    return out


def _room(n: int) -> int:
    """A rANS stream of a plane of n bytes is kept only while it is shorter than this: the
    plane's raw size, past which the one-group path stores it raw too."""
    return n


class _Streams:
    """Every plane's stored bytes in pinned host memory, filled chunk by chunk.

    Plane i owns a region at ``at[i]``: the packed sign bits (n/8 bytes, kept in any case, as
    bitpack is the sign plane's fallback), then, for a plane the rANS kernel codes, room for its
    stream (n bytes: header and table, word counts, final states, words), which is filled only
    while the stream stays under n bytes; past that (``over``) the plane is stored raw (a sign
    plane as bitpack), and a byte plane's region takes its raw bytes. Byte planes the kernel does
    not code hold their raw bytes."""

    def __init__(self, planes: list[_Plane], jobs: list[int], freqs: np.ndarray, n: int,
                 lg: int) -> None:
        self.planes, self.jobs, self.n, self.lg = planes, jobs, n, lg
        self.nb = ranshost.n_blocks(n, lg)
        self.job = {i: j for j, i in enumerate(jobs)}
        self.prefix = {i: ranshost.rans_prefix(freqs[j], lg, n) for j, i in enumerate(jobs)}
        self.head = {i: len(self.prefix[i]) + rans.BLOCK_OVERHEAD * self.nb for i in jobs}
        self.room = _room(n)
        self.over = {i: self.head[i] >= self.room for i in jobs}
        self.words = {i: 0 for i in jobs}          # bytes of words so far
        self.firsts = {i: np.zeros(self.nb, np.uint8) for i in jobs}
        self.varied = {i: False for i in jobs}
        self.at, total = [], 0
        self.sign_len = (n + 7) // 8
        for i, p in enumerate(planes):
            self.at.append(total)
            if p.field.kind == layouts.KIND_SIGN:
                total += runtime.align(self.sign_len, 16) + (n if i in self.job else 0)
            else:
                total += runtime.align(n, 16)
        self.host = runtime.pinned(total)
        self.hnp = self.host.numpy()

    def stream_at(self, i: int) -> int:
        """Host offset of plane i's rANS stream (or raw bytes)."""
        sign = self.planes[i].field.kind == layouts.KIND_SIGN
        return self.at[i] + (runtime.align(self.sign_len, 16) if sign else 0)

    def d2h(self, host_off: int, src: torch.Tensor) -> None:
        if src.numel():
            self.host[host_off:host_off + src.numel()].copy_(src, non_blocking=True)

    def copy_plain(self, c0: int, m: int, ch: _Chunks) -> None:
        """The chunk's packed sign bits, and every byte plane the rANS kernel does not code."""
        for i, p in enumerate(self.planes):
            if p.field.kind == layouts.KIND_SIGN:
                self.d2h(self.at[i] + c0 // 8, ch.plane(0, (m + 7) // 8))
            elif i not in self.job:
                self.d2h(self.at[i] + c0, ch.plane(i, m))

    def add_chunk(self, c0: int, r: dict) -> None:
        """Record the chunk's block symbols, and copy its word counts, final states and words
        (laid out on the device by one copy launch) into the streams that still fit."""
        bt = r["bt"]
        b_lo = c0 >> self.lg
        nbj = np.diff(bt.first)
        fit = []
        for j, i in enumerate(self.jobs):
            self.firsts[i][b_lo:b_lo + nbj[j]] = r["firsts"][bt.first[j]:bt.first[j + 1]]
            self.varied[i] |= bool(r["plane_varied"][j])
            w = 2 * int(r["plane_words"][j])
            if not self.over[i] and self.head[i] + self.words[i] + w >= self.room:
                self.over[i] = True  # the stream would reach the raw size: stored raw
            if not self.over[i]:
                fit.append(j)
        if not fit:
            return
        size = [int(132 * nbj[j] + 2 * r["plane_words"][j]) for j in fit]
        offs = np.zeros(len(fit) + 1, np.int64)
        np.cumsum([runtime.align(s, 16) for s in size], out=offs[1:])
        staging = runtime.device_empty(int(offs[-1]))
        src, dst, ln = rans_runs(r, np.asarray(fit, np.int64),
                                 np.uint64(staging.data_ptr()) + offs[:-1].astype(np.uint64))
        keep = runtime.copy_ops(np.concatenate(src), np.concatenate(dst), np.concatenate(ln))
        for q, j in enumerate(fit):
            i = self.jobs[j]
            k, o = int(nbj[j]), int(offs[q])
            w = size[q] - 132 * k
            s0 = self.stream_at(i) + len(self.prefix[i])
            self.d2h(s0 + 4 * b_lo, staging[o:o + 4 * k])
            self.d2h(s0 + 4 * self.nb + 128 * b_lo, staging[o + 4 * k:o + 132 * k])
            self.d2h(s0 + 132 * self.nb + self.words[i], staging[o + 132 * k:o + 132 * k + w])
            self.words[i] += w
        del keep, staging  # stream-ordered: reused only after these copies

    def coded(self, enc: Encoder) -> tuple[CodedPlane, ...]:
        """Codecs and payloads, chosen as ``Encoder._finalise`` chooses them: the first candidate
        in rank order whose real size is under the plane's (only rANS and bitpack here)."""
        out = []
        for i, p in enumerate(self.planes):
            codec, payload = codecs.RAW, None
            if p.nsym == 1 and codecs.RANS in p.est:
                o = enc._rans_option(p, None)  # CONST stream of the whole plane
                if o[0] < p.n:
                    codec, payload = codecs.RANS, np.frombuffer(o[2], np.uint8)
            elif i in self.job:
                if not self.varied[i]:
                    head = ranshost.const_stream(self.firsts[i], self.lg, self.n)
                    if len(head) < p.n:
                        codec, payload = codecs.RANS, np.frombuffer(head, np.uint8)
                elif not self.over[i]:
                    at = self.stream_at(i)
                    end = at + self.head[i] + self.words[i]
                    self.hnp[at:at + len(self.prefix[i])] = np.frombuffer(self.prefix[i],
                                                                          np.uint8)
                    codec, payload = codecs.RANS, self.hnp[at:end]
            if payload is None and p.field.kind == layouts.KIND_SIGN:
                if codecs.BITPACK in p.est:
                    codec, payload = codecs.BITPACK, self.hnp[self.at[i]:self.at[i]
                                                              + self.sign_len]
                else:
                    raise AssertionError("a large sign plane always has bitpack")
            if payload is None:
                at = self.stream_at(i)
                codec, payload = codecs.RAW, self.hnp[at:at + p.n]
            out.append(CodedPlane(p.field.kind, p.field.index, codec, p.n, payload))
        return tuple(out)
