"""Save side of the CUDA path: code tensors that live on the GPU into ``CodedTensor``s.

Per group of consecutive tensors (``plan.groups``): (1) one fused split launch per layout writes
packed sign bits, the byte planes and their histograms, and the leaf digests of every tensor's
raw bytes give the content hashes; (2) the host picks codecs from the histograms exactly as
``s4format.policy`` ranks them (GPU codecs only), builds the rANS tables, and the device encodes
rANS blocks (one warp each) and GDeflate pages (nvCOMP, one batch); (3) the host sizes every
payload and the copy kernel assembles them all into one compacted device buffer, whose leaves are
hashed for the plane checksums and which goes to pinned host memory in one copy (the payloads
are views of that buffer and keep it alive as long as the caller holds them).

Tensors the GPU does not split (other dtypes, tensors under ``SPLIT_MIN`` bytes) and tensors whose
planes would store more than their raw bytes are copied to the host in the same buffer and coded
by the CPU coder, so the file is what the CPU path writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from s4format import codecs, layouts, policy
from s4format.codecs import rans
from s4format.dtypes import DType
from s4format.layouts import Layout
from s4format.writer import CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import gdeflate, plan, ranshost, runtime
from s4weights.gpu.hash import content_hash_from_leaves, plane_checksum_from_leaves

SPLIT_KERNEL = {layouts.BF16.layout_id: "split_bf16", layouts.FP16.layout_id: "split_fp16",
                layouts.FP32.layout_id: "split_fp32"}
MANTISSA_MODES = ("auto", "rans", "gdeflate", "raw")


@dataclass
class Item:
    """One tensor to code: raw bytes on the device (flat, contiguous uint8)."""
    dtype: DType
    shape: tuple[int, ...]
    data: torch.Tensor
    layout: Layout | None = None  # set by the encoder: GPU split layout, None = CPU coder

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


@dataclass
class Coded:
    coded: CodedTensor
    content_hash: bytes


@dataclass
class _Plane:
    """One plane of a GPU-split tensor through codec choice and assembly."""
    item: int
    field: layouts.Field
    n: int
    ptr: int                      # device address of the plane (sign: packed bits)
    counts: np.ndarray            # 256-bin histogram
    rans_job: int = -1
    gd_job: int = -1
    codec: int = codecs.RAW
    prefix: bytes = b""           # host bytes at the payload's start
    pieces: list[tuple[int, int]] = field(default_factory=list)  # device (address, length)
    size: int = 0
    params: bytes = b""
    est: dict[int, int | None] = field(default_factory=dict)


class Encoder:
    """Code GPU tensors for ``Writer.add_coded``; ``code(items)`` yields results in order."""

    def __init__(self, policy_name: str = "auto", *, mantissa: str = "auto",
                 log2_block: int = rans.LOG2_BLOCK_DEFAULT, workspace: int | None = None,
                 gdeflate_algorithm: int = gdeflate.DEFAULT_ALGORITHM) -> None:
        if mantissa not in MANTISSA_MODES:
            raise ValueError(f"mantissa must be one of {MANTISSA_MODES}")
        self.policy = policy.check_policy(policy_name)
        self.mantissa = mantissa
        self.log2_block = log2_block
        self.workspace = workspace
        self.gd_algorithm = gdeflate_algorithm
        self.gd = mantissa in ("auto", "gdeflate") and gdeflate.available()

    def code(self, items: list[Item]) -> Iterator[Coded]:
        for it in items:
            it.layout = plan.gpu_layout(it.dtype.name, it.nbytes)
        workspace = self.workspace or plan.default_workspace(sum(i.nbytes for i in items))
        for grp in plan.groups([i.nbytes for i in items], workspace):
            yield from self._group([items[i] for i in grp])

    # -- stage 1: split, histograms, content hashes ---------------------------------------

    def _group(self, items: list[Item]) -> list[Coded]:
        prof = runtime.Profile("encode")
        digests, first = runtime.leaf_digests([i.data.data_ptr() for i in items],
                                              [i.nbytes for i in items])
        prof.mark("content leaves")
        planes_buf, planes = self._split(items)
        prof.mark("split")
        hashes = digests.cpu().numpy().view(np.uint64)
        content = [content_hash_from_leaves(it.nbytes, hashes[first[k]:first[k + 1]])
                   for k, it in enumerate(items)]
        # -- stage 2: codec choice and encoding
        rans_out, gd = self._encode(planes)
        prof.mark("encode")
        # -- stage 3: sizes, fallbacks, assembly
        cpu = self._finalise(items, planes, rans_out, gd)
        prof.mark("finalise")
        host, payload_at, digests2, dfirst, cpu_at = self._assemble(items, planes, cpu)
        prof.mark("assemble+d2h")
        del planes_buf, rans_out, gd
        results = []
        pi = 0
        by_item: dict[int, list[_Plane]] = {}
        for p in planes:
            by_item.setdefault(p.item, []).append(p)
        for k, it in enumerate(items):
            if k in cpu:
                raw = host[cpu_at[k]:cpu_at[k] + it.nbytes]
                results.append(Coded(code_tensor(raw, it.dtype, self.policy), content[k]))
                continue
            coded_planes = []
            for p in by_item[k]:
                at = payload_at[pi]
                payload = host[at:at + p.size]
                checksum = plane_checksum_from_leaves(p.size, digests2[dfirst[pi]:dfirst[pi + 1]])
                coded_planes.append(CodedPlane(p.field.kind, p.field.index, p.codec, p.n,
                                               payload, p.params, checksum))
                pi += 1
            results.append(Coded(CodedTensor(it.layout, tuple(coded_planes)), content[k]))
        prof.mark("results")
        prof.report()
        return results

    def _split(self, items: list[Item]) -> tuple[torch.Tensor, list[_Plane]]:
        total = 0
        layout_of: list[tuple[int, list[int]]] = []
        for k, it in enumerate(items):
            if it.layout is None:
                continue
            n = it.nbytes // it.layout.word_size(it.dtype.itemsize)
            offs = [total]
            total += runtime.align((n + 7) // 8)
            for _ in it.layout.fields[1:]:
                offs.append(total)
                total += runtime.align(n)
            layout_of.append((k, offs))
        buf = runtime.device_empty(total)
        base = buf.data_ptr()
        planes: list[_Plane] = []
        for lay_id, kernel_name in SPLIT_KERNEL.items():
            segs = [(k, offs) for k, offs in layout_of if items[k].layout.layout_id == lay_id]
            if not segs:
                continue
            word = 4 if lay_id == layouts.FP32.layout_id else 2
            nelems = [items[k].nbytes // word for k, _ in segs]
            cs, c0 = plan.chunk_table(nelems)
            table = np.zeros((len(segs), 5), dtype=np.uint64)
            for j, (_k, offs) in enumerate(segs):
                table[j, :len(offs)] = [base + o for o in offs]
            src = np.array([items[k].data.data_ptr() for k, _ in segs], dtype=np.uint64)
            hist = torch.zeros(len(segs) * 1024 + len(segs), dtype=torch.int64, device="cuda")
            d_cs, d_c0, d_src = runtime.to_device(cs), runtime.to_device(c0), runtime.to_device(src)
            d_n, d_tab = runtime.to_device(np.asarray(nelems, np.int64)), runtime.to_device(table)
            runtime.launch("planes", kernel_name, cs.size, 256, runtime.ptr(d_cs),
                           runtime.ptr(d_c0), runtime.ptr(d_src), runtime.ptr(d_n),
                           runtime.ptr(d_tab),
                           runtime.ptr(hist), np.uint64(hist.data_ptr() + 8 * 1024 * len(segs)))
            h = hist.cpu().numpy()
            for j, (k, offs) in enumerate(segs):
                n = nelems[j]
                ones = int(h[1024 * len(segs) + j])
                for fi, f in enumerate(items[k].layout.fields):
                    counts = np.array([n - ones, ones] + [0] * 254, dtype=np.int64) if fi == 0 \
                        else h[j * 1024 + (fi - 1) * 256:j * 1024 + fi * 256].astype(np.int64)
                    planes.append(_Plane(k, f, n, base + offs[fi], counts))
        planes.sort(key=lambda p: (p.item, p.field.kind, p.field.index))
        return buf, planes

    # -- stage 2 ------------------------------------------------------------------------

    def _candidates(self, p: _Plane) -> dict[int, int | None]:
        """Codec -> size estimate for the candidates of ``policy.encode_plane`` that the GPU
        codes (estimate < n); GDeflate's is None: its real size, known after compression,
        stands in for the CPU's sampled estimate."""
        n, kind = p.n, p.field.kind
        if n < policy.MIN_CODED:
            return {}
        seed = self.policy == "seed"
        est: dict[int, int | None] = {}
        if kind == layouts.KIND_SIGN:
            est[codecs.BITPACK] = (n + 7) // 8
            if not seed:
                est[codecs.RANS] = ranshost.estimate(p.counts, self.log2_block)
        elif kind == layouts.KIND_EXPONENT:
            est[codecs.RANS] = ranshost.estimate(p.counts, self.log2_block)
        elif kind == layouts.KIND_MANTISSA:
            if self.gd and (seed or self.mantissa in ("auto", "gdeflate")):
                est[codecs.GDEFLATE] = None
            if not seed and self.mantissa in ("auto", "rans"):
                est[codecs.RANS] = ranshost.estimate(p.counts, self.log2_block)
        return {c: e for c, e in est.items() if e is None or e < n}

    def _encode(self, planes: list[_Plane]):
        jobs: list[_Plane] = []
        gd_jobs: list[_Plane] = []
        for p in planes:
            p.est = self._candidates(p)
            bitpack_first = codecs.BITPACK in p.est and codecs.RANS in p.est and \
                (p.est[codecs.BITPACK], codecs.BITPACK) < (p.est[codecs.RANS], codecs.RANS)
            # rANS runs unless bitpack (which always succeeds) ranks before it, or the plane
            # holds one symbol (a CONST stream the host writes).
            if codecs.RANS in p.est and not bitpack_first and np.count_nonzero(p.counts) > 1:
                p.rans_job = len(jobs)
                jobs.append(p)
            if codecs.GDEFLATE in p.est:
                p.gd_job = len(gd_jobs)
                gd_jobs.append(p)
        gd = gdeflate.Compressed([p.ptr for p in gd_jobs], [p.n for p in gd_jobs],
                                 self.gd_algorithm) if gd_jobs else None
        return self._rans(jobs), gd

    def _rans(self, jobs: list[_Plane]) -> dict | None:
        if not jobs:
            return None
        keep: list[torch.Tensor] = []
        srcs = []
        for p in jobs:
            if p.field.kind == layouts.KIND_SIGN:
                tmp = runtime.device_empty(p.n)
                runtime.launch("planes", "unpack_bits", min(4096, (p.n + 255) // 256), 256,
                               np.uint64(p.ptr), runtime.ptr(tmp), runtime.i64(p.n))
                keep.append(tmp)
                srcs.append(tmp.data_ptr())
            else:
                srcs.append(p.ptr)
        lg = self.log2_block
        bt = plan.block_table([p.n for p in jobs], lg)
        freqs = [rans.normalise(p.counts) for p in jobs]
        tabs = np.stack([ranshost.encoder_table(f) for f in freqs])
        d_tabs = runtime.to_device(tabs)
        scratch_off = np.zeros(len(jobs) + 1, dtype=np.int64)
        np.cumsum([runtime.align(2 * p.n) for p in jobs], out=scratch_off[1:])
        scratch = runtime.device_empty(int(scratch_off[-1]))
        srcs_a = np.asarray(srcs, dtype=np.uint64)
        blk_src = srcs_a[bt.plane] + bt.start.astype(np.uint64)
        blk_tab = np.uint64(d_tabs.data_ptr()) + bt.plane.astype(np.uint64) * np.uint64(4096)
        blk_scr = (np.uint64(scratch.data_ptr()) + scratch_off[bt.plane].astype(np.uint64)
                   + 2 * bt.start.astype(np.uint64))
        nb = bt.size
        out = torch.empty(nb * 4 * 34 + 2 * nb, dtype=torch.uint8, device="cuda")
        counts_p = out.data_ptr()
        states_p = counts_p + 4 * nb
        firsts_p = states_p + 128 * nb
        varied_p = firsts_p + nb
        d = [runtime.to_device(a) for a in (blk_src, bt.length, blk_tab, blk_scr)]
        warps = 4
        runtime.launch("rans", "rans_encode", (nb + warps - 1) // warps, 32 * warps,
                       np.int32(nb), *(runtime.ptr(x) for x in d), np.uint64(counts_p),
                       np.uint64(states_p), np.uint64(firsts_p), np.uint64(varied_p))
        meta = out[:4 * nb].cpu().numpy().view(np.uint32)
        fv = out[132 * nb:134 * nb].cpu().numpy()
        return dict(bt=bt, freqs=freqs, counts=meta.astype(np.int64), firsts=fv[:nb],
                    varied=fv[nb:], states_p=states_p, counts_p=counts_p,
                    scratch_off=scratch_off, scratch=scratch, keep=(keep, d, d_tabs, out))

    # -- stage 3 ------------------------------------------------------------------------

    def _rans_payload(self, p: _Plane, r: dict) -> None:
        """Size and pieces of the canonical rANS stream of plane p (spec/rans.md, section 7)."""
        lg, n = self.log2_block, p.n
        if np.count_nonzero(p.counts) == 1:
            sym = int(np.flatnonzero(p.counts)[0])
            nbm = ranshost.n_blocks(n, rans.LOG2_BLOCK_MAX)
            p.prefix, p.pieces = ranshost.const_stream(np.full(nbm, sym), rans.LOG2_BLOCK_MAX,
                                                       n), []
            return
        j = p.rans_job
        b0, b1 = int(r["bt"].first[j]), int(r["bt"].first[j + 1])
        if not r["varied"][b0:b1].any():
            p.prefix, p.pieces = ranshost.const_stream(r["firsts"][b0:b1], lg, n), []
            return
        counts = r["counts"][b0:b1]
        nb = b1 - b0
        prefix = ranshost.rans_prefix(r["freqs"][j], lg, n)
        size = len(prefix) + 132 * nb + 2 * int(counts.sum())
        if size >= ranshost.HEADER_SIZE + n:
            p.prefix = ranshost.header(rans.MODE_RAW, lg, n)
            p.prefix, p.pieces = b"", None
            return
        scr = r["scratch"].data_ptr() + int(r["scratch_off"][j])
        starts = r["bt"].start[b0:b1]
        p.prefix = prefix
        p.pieces = [(r["counts_p"] + 4 * b0, 4 * nb), (r["states_p"] + 128 * b0, 128 * nb)]
        p.pieces += [(scr + 2 * int(s), 2 * int(c)) for s, c in zip(starts, counts)]

    def _finalise(self, items: list[Item], planes: list[_Plane], r: dict | None,
                  gd: gdeflate.Compressed | None) -> set[int]:
        """Choose each plane's codec (in rank order, the first whose real size is < n, else
        raw) and return the items the CPU must code (tensor-level raw fallback)."""
        for p in planes:
            options = []  # (rank key, size, codec, prefix, pieces)
            for c, e in p.est.items():
                if c == codecs.RANS:
                    if p.rans_job < 0 and np.count_nonzero(p.counts) > 1:
                        continue  # ranked behind bitpack, which always succeeds
                    self._rans_payload(p, r)
                    if p.pieces is None:
                        continue  # RAW mode: never smaller than the plane
                    size = len(p.prefix) + sum(n for _a, n in p.pieces)
                    options.append(((e, c), size, c, p.prefix, p.pieces))
                elif c == codecs.BITPACK:
                    size = (p.n + 7) // 8
                    options.append(((e, c), size, c, b"", [(p.ptr, size)]))
                elif c == codecs.GDEFLATE:
                    head, pieces = gd.pieces(p.gd_job, p.ptr)
                    size = gd.payload_size(p.gd_job)
                    options.append(((size, c), size, c, head, pieces))
            options.sort(key=lambda o: o[0])
            chosen = next((o for o in options if o[1] < p.n), None)
            if chosen is None:
                chosen = (None, p.n, codecs.RAW, b"", [(p.ptr, p.n)])
            _key, p.size, p.codec, p.prefix, p.pieces = chosen
        cpu = {k for k, it in enumerate(items) if it.layout is None}
        stored: dict[int, int] = {}
        for p in planes:
            stored[p.item] = stored.get(p.item, 0) + p.size
        cpu |= {k for k, s in stored.items() if s > items[k].nbytes}
        return cpu

    def _assemble(self, items: list[Item], planes: list[_Plane], cpu: set[int]):
        live = [p for p in planes if p.item not in cpu]
        sizes = [p.size for p in live] + [items[k].nbytes for k in sorted(cpu)]
        offs = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum([runtime.align(s, 16) for s in sizes], out=offs[1:])
        total = int(offs[-1])
        out = runtime.device_empty(total)
        base = out.data_ptr()
        blob = b"".join(p.prefix for p in live)
        d_blob = runtime.to_device(np.frombuffer(blob, np.uint8)) if blob else None
        src, dst, ln = [], [], []
        bp = 0
        for j, p in enumerate(live):
            at = base + int(offs[j])
            if p.prefix:
                src.append(d_blob.data_ptr() + bp)
                dst.append(at)
                ln.append(len(p.prefix))
                bp += len(p.prefix)
                at += len(p.prefix)
            for a, n in p.pieces:
                src.append(a)
                dst.append(at)
                ln.append(n)
                at += n
        cpu_at = {}
        for j, k in enumerate(sorted(cpu)):
            at = int(offs[len(live) + j])
            cpu_at[k] = at
            src.append(items[k].data.data_ptr())
            dst.append(base + at)
            ln.append(items[k].nbytes)
        runtime.copy_ops(np.asarray(src, np.uint64), np.asarray(dst, np.uint64),
                         np.asarray(ln, np.uint64))
        digests, dfirst = runtime.leaf_digests([base + int(offs[j]) for j in range(len(live))],
                                               [p.size for p in live])
        # A fresh pinned buffer per group: the payloads are views of it and stay valid as long
        # as the caller holds them; torch's caching host allocator recycles it afterwards.
        host = runtime.pinned(runtime.align(total, 1 << 20))
        torch.cuda.current_stream().synchronize()
        prof = runtime.Profile("assemble")
        prof.mark("copy+hash kernels")
        host[:total].copy_(out[:total], non_blocking=True)
        d = digests.cpu().numpy().view(np.uint64)  # synchronises the stream
        torch.cuda.current_stream().synchronize()
        prof.mark(f"d2h {total} bytes")
        prof.report()
        del d_blob
        planes[:] = live
        return host.numpy(), offs, d, dfirst, cpu_at


def rans_stream(plane: torch.Tensor, log2_block: int = rans.LOG2_BLOCK_DEFAULT) -> np.ndarray:
    """The canonical S4 rANS stream (spec/rans.md, section 7) of a uint8 plane on the device,
    through the same kernels and assembly as the coder: equal to ``RansCodec.encode``."""
    plane = plane.reshape(-1).contiguous()
    n = int(plane.numel())
    if n == 0:
        return np.frombuffer(ranshost.header(rans.MODE_RAW, log2_block, 0), np.uint8)
    counts = torch.bincount(plane, minlength=256).cpu().numpy().astype(np.int64)
    enc = Encoder(log2_block=log2_block)
    p = _Plane(0, layouts.Field(layouts.KIND_EXPONENT, 0, 7, 8), n, plane.data_ptr(), counts)
    r = None
    if np.count_nonzero(counts) > 1:
        p.rans_job = 0
        r = enc._rans([p])
    enc._rans_payload(p, r)
    if p.pieces is None:
        head = ranshost.header(rans.MODE_RAW, log2_block, n)
        return np.concatenate([np.frombuffer(head, np.uint8), plane.cpu().numpy()])
    size = sum(length for _a, length in p.pieces)
    out = runtime.device_empty(size)
    at = np.cumsum([0] + [length for _a, length in p.pieces])[:-1]
    runtime.copy_ops(np.array([a for a, _ in p.pieces], np.uint64),
                     (out.data_ptr() + at).astype(np.uint64),
                     np.array([length for _a, length in p.pieces], np.uint64))
    body = out[:size].cpu().numpy()
    return np.concatenate([np.frombuffer(p.prefix, np.uint8), body])
