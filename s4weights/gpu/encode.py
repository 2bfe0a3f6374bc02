"""Save side of the CUDA path: code tensors that live on the GPU into ``CodedTensor``s.

Per group of consecutive tensors (``plan.groups``), with three host synchronisations whatever
the number of tensors, planes or blocks:

1. one fused split launch per layout writes packed sign bits, the byte planes and all their
   histograms into one device array; the leaf digests of every tensor's raw bytes (content
   hashes) are launched too. Sync 1: the histograms come to the host (a few KiB).
2. the host picks candidate codecs from the histograms as ``s4format.policy`` ranks them (GPU
   codecs only), normalises every frequency table and builds every rANS encoder table in a
   few vectorised numpy calls (``ranshost.*_many``), and one launch encodes every rANS block of
   the group (one warp each); GDeflate pages go to nvCOMP in one batch where asked for.
   Sync 2: the word counts, first symbols and "varied" flags of the blocks come back.
3. the host sizes every payload (vectorised per plane, never a loop over blocks), lays the
   payloads out in one compacted device buffer (16-byte aligned), and one copy launch
   assembles them; one hash launch digests the payload leaves. Sync 3: the digests (payload
   leaves and content leaves) come back, and the host roots them into plane checksums and
   content hashes.

The compacted buffer with that metadata is the device-to-device result (:class:`DeviceGroup`).
For a file, the buffer goes to pinned host memory in one copy on a side stream, overlapped with
the next group's device work (``Encoder.code`` keeps one group in flight); payloads are views of
that pinned buffer and keep it alive as long as the caller holds them.

Tensors under ``SPLIT_MIN`` bytes are stored as one raw plane (raw layout, raw codec) copied on
the device: where the CPU writer might save a few hundred bytes on them with zstd, coding
hundreds of them on the host would cost more time than the whole GPU pass. Larger tensors the
GPU does not split (other dtypes) and tensors whose planes would store more than their raw
bytes are copied to the host in the same buffer and coded by the CPU coder, as the CPU path
codes them.

Codec choice: sign planes take bitpack or rANS (including CONST) in the CPU policy's rank order;
exponent planes rANS or raw; mantissa planes rANS or raw by the histogram estimate. GDeflate
(nvCOMP, far slower than the rANS kernels) runs only where asked for: ``mantissa="gdeflate"``
or the ``seed`` policy; ``mantissa="auto"`` never pays for it on the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from s4format import codecs, layouts, policy
from s4format.codecs import rans
from s4format.dtypes import DType
from s4format.layouts import Layout
from s4format.writer import SPLIT_MIN, CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import gdeflate, plan, ranshost, runtime
from s4weights.gpu.hash import content_hashes_from_leaves, plane_checksums_from_leaves

SPLIT_KERNEL = {layouts.BF16.layout_id: "split_bf16", layouts.FP16.layout_id: "split_fp16",
                layouts.FP32.layout_id: "split_fp32"}
MANTISSA_MODES = ("auto", "rans", "gdeflate", "raw")
ALIGN_PAYLOAD = 16
_NO_COUNTS = np.zeros(256, np.int64)  # raw planes: no histogram, no candidates but raw


@dataclass
class Item:
    """One tensor to code: raw bytes on the device (flat, contiguous uint8)."""
    dtype: DType
    shape: tuple[int, ...]
    data: torch.Tensor
    layout: Layout | None = None  # set by the encoder: GPU split layout, None = CPU coder
    # a delta coded without a device copy of the XOR: the item is ``data ^ parent`` (same
    # length), formed chunk by chunk (``chunked``); such items never share a group
    parent: torch.Tensor | None = None

    @functools.cached_property
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
    nsym: int = 0                 # distinct symbols
    est: dict[int, int | None] = field(default_factory=dict)
    rans_job: int = -1
    gd_job: int = -1
    codec: int = codecs.RAW
    kind: str = "raw"             # payload form: raw | bitpack | const | rans | gdeflate
    prefix: bytes = b""           # host bytes at the payload's start
    size: int = 0
    params: bytes = b""
    offset: int = 0               # in the group's compacted buffer
    checksum: int = 0


@dataclass
class DeviceGroup:
    """Device-to-device result for one group: the compacted payloads on the device and every
    piece of metadata a writer needs (codec, sizes, offsets, plane checksums, content hashes).
    ``cpu[k]`` is the offset of item k's raw bytes in the buffer where the CPU coder codes it."""
    items: list[Item]
    buffer: torch.Tensor
    total: int
    planes: list[_Plane]
    cpu: dict[int, int]
    content: list[bytes]
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None


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
        self.gd = (mantissa == "gdeflate" or self.policy == "seed") and gdeflate.available()
        self._copy_stream: torch.cuda.Stream | None = None

    def _workspace(self, items: list[Item]) -> int:
        return self.workspace or plan.default_workspace(sum(i.nbytes for i in items))

    def _groups(self, items: list[Item], pipelined: bool = False, chunked: bool = False
                ) -> list[list[Item] | Item]:
        """Consecutive groups whose worst-case device bytes (``plan.encode_need``) fit the
        workspace. ``pipelined`` (``code``): the previous group's compacted buffer is still on
        the device while the next group is coded, and counts against it. ``chunked``: a tensor
        that alone needs more than the workspace (and every item with a parent) is returned on
        its own, not in a list, for the chunked coder."""
        for it in items:
            it.layout = plan.gpu_layout(it.dtype.name, it.nbytes)
            if it.layout is None and it.nbytes < SPLIT_MIN:
                # small tensors (biases, norms, step counters: hundreds per state, a few KiB
                # in all) are stored as one raw plane, copied on the device: coding them on
                # the CPU costs more host time than all their bytes are worth
                it.layout = layouts.RAW
        workspace = self._workspace(items)
        need = [plan.encode_need(it.layout, it.nbytes, it.dtype.itemsize, self.gd)
                for it in items]
        out: list[list[Item] | Item] = []
        run: list[int] = []

        def flush() -> None:
            grouped = plan.groups_by_need([need[i] for i in run],
                                          [items[i].nbytes for i in run], workspace, pipelined)
            out.extend([items[run[i]] for i in grp] for grp in grouped)
            run.clear()

        for i, it in enumerate(items):
            large = it.parent is not None or (
                need[i] > workspace and not self.gd and it.layout is not layouts.RAW)
            if chunked and large:
                flush()
                out.append(it)
            else:
                if it.parent is not None:
                    raise ValueError("an item with a parent is coded by Encoder.code only")
                run.append(i)
        flush()
        return out

    def code(self, items: list[Item]) -> Iterator[Coded]:
        """Coded tensors with payloads in pinned host memory, in order; one group's D2H is in
        flight while the next group runs on the device. A tensor too large for the workspace
        is coded alone, in chunks (``chunked``), once the group before it is done."""
        from s4weights.gpu import chunked

        pending: DeviceGroup | None = None
        workspace = self._workspace(items)
        for grp in self._groups(items, pipelined=True, chunked=True):
            if isinstance(grp, Item):
                if pending is not None:
                    yield from self._results(pending)
                    pending = None
                split = grp.layout is not None and grp.layout is not layouts.RAW
                yield (chunked.code_large(self, grp, workspace) if split
                       else chunked.code_host(self, grp, workspace))
                continue
            g = self.encode_group(grp)
            self._to_host(g)
            if pending is not None:
                yield from self._results(pending)
            pending = g
        if pending is not None:
            yield from self._results(pending)

    def encode_device(self, items: list[Item]) -> list[DeviceGroup]:
        """Device-to-device: every group's compacted payload buffer stays on the device (so a
        tensor larger than the workspace is one group of its own, whatever it needs)."""
        return [self.encode_group(grp) for grp in self._groups(items)]

    # -- one group ------------------------------------------------------------------------

    def encode_group(self, items: list[Item]) -> DeviceGroup:
        prof = runtime.Profile("encode")
        content_dig, content_first = runtime.leaf_digests(
            [i.data.data_ptr() for i in items], [i.nbytes for i in items])
        planes_buf, planes = self._split(items)          # sync 1 (histograms)
        prof.mark("split+hist")
        r, gd = self._encode(planes)                       # sync 2 (block word counts)
        prof.mark("encode")
        cpu = self._finalise(items, planes, r, gd)
        prof.mark("choose")
        buf, total, live, cpu_at, keep = self._assemble(items, planes, cpu, r)
        prof.mark("assemble")
        pay_dig, pay_first = runtime.leaf_digests([buf.data_ptr() + p.offset for p in live],
                                                  [p.size for p in live])
        nc = int(content_first[-1])
        both = torch.cat((content_dig[:nc], pay_dig[:int(pay_first[-1])])).cpu()  # sync 3
        d = both.numpy().view(np.uint64)
        prof.mark("payload hash")
        content = content_hashes_from_leaves([it.nbytes for it in items], d[:nc], content_first)
        sums = plane_checksums_from_leaves([p.size for p in live], d[nc:], pay_first)
        for p, c in zip(live, sums):
            p.checksum = c
        prof.mark("roots")
        prof.report()
        del planes_buf, r, gd, keep
        return DeviceGroup(items, buf, total, live, cpu_at, content)

    def _to_host(self, g: DeviceGroup) -> None:
        """Start the group's D2H into pinned memory on a side stream."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        g.host = runtime.pinned(runtime.align(g.total, 1 << 20))
        ready = torch.cuda.Event()
        ready.record(main)
        cs = self._copy_stream
        cs.wait_event(ready)
        with torch.cuda.stream(cs):
            if g.total:
                g.host[:g.total].copy_(g.buffer[:g.total], non_blocking=True)
            g.done = torch.cuda.Event()
            g.done.record(cs)

    def _results(self, g: DeviceGroup) -> list[Coded]:
        g.done.synchronize()
        host = g.host.numpy()
        g.buffer = None  # the copy has run: the device buffer can go
        by_item: dict[int, list[_Plane]] = {}
        for p in g.planes:
            by_item.setdefault(p.item, []).append(p)
        out = []
        for k, it in enumerate(g.items):
            if k in g.cpu:
                raw = host[g.cpu[k]:g.cpu[k] + it.nbytes]
                out.append(Coded(code_tensor(raw, it.dtype, self.policy), g.content[k]))
                continue
            coded = tuple(CodedPlane(p.field.kind, p.field.index, p.codec, p.n,
                                     host[p.offset:p.offset + p.size], p.params, p.checksum)
                          for p in by_item[k])
            out.append(Coded(CodedTensor(it.layout, coded), g.content[k]))
        return out

    # -- stage 1: split and histograms ----------------------------------------------------

    def _split(self, items: list[Item]) -> tuple[torch.Tensor, list[_Plane]]:
        total = 0
        segs: list[tuple[int, list[int]]] = []
        for k, it in enumerate(items):
            if it.layout is None or it.layout is layouts.RAW:
                continue
            n = it.nbytes // it.layout.word_size(it.dtype.itemsize)
            offs = [total]
            total += runtime.align((n + 7) // 8)
            for _ in it.layout.fields[1:]:
                offs.append(total)
                total += runtime.align(n)
            segs.append((k, offs))
        buf = runtime.device_empty(total)
        base = buf.data_ptr()
        nseg = len(segs)
        hist = torch.zeros(nseg * 1025 + 1, dtype=torch.int64, device="cuda")
        hp = hist.data_ptr()
        order: list[int] = []  # segment index -> position in segs, by layout
        keep = []
        for lay_id in SPLIT_KERNEL:
            sel = [j for j, (k, _) in enumerate(segs) if items[k].layout.layout_id == lay_id]
            if not sel:
                continue
            s0 = len(order)
            order += sel
            word = 4 if lay_id == layouts.FP32.layout_id else 2
            keep.append(launch_split(
                lay_id, [items[segs[j][0]].data.data_ptr() for j in sel],
                [items[segs[j][0]].nbytes // word for j in sel],
                [[base + o for o in segs[j][1]] for j in sel],
                hp + 8 * 1024 * s0, hp + 8 * (1024 * nseg + s0)))
        h = hist.cpu().numpy() if nseg else np.zeros(1, np.int64)  # sync 1
        planes: list[_Plane] = []
        for pos, j in enumerate(order):
            k, offs = segs[j]
            it = items[k]
            n = it.nbytes // it.layout.word_size(it.dtype.itemsize)
            planes += planes_from_hist(k, it.layout, n, [base + o for o in offs],
                                       h[pos * 1024:(pos + 1) * 1024], int(h[1024 * nseg + pos]))
        for k, it in enumerate(items):
            if it.layout is layouts.RAW:
                planes.append(_Plane(k, layouts.RAW.fields[0], it.nbytes, it.data.data_ptr(),
                                     _NO_COUNTS))
        planes.sort(key=lambda p: (p.item, p.field.kind, p.field.index))
        return buf, planes

    # -- stage 2: candidates and encoding -------------------------------------------------

    def _candidates(self, planes: list[_Plane]) -> None:
        """Codec -> size estimate for the candidates of ``policy.encode_plane`` that the GPU
        codes (estimate < n); GDeflate's is None (its real size ranks it)."""
        if not planes:
            return
        counts = np.stack([p.counts for p in planes])
        nsym = np.count_nonzero(counts, axis=1)
        multi = np.flatnonzero(nsym > 1)
        est_rans = np.zeros(len(planes), np.int64)
        freqs = np.zeros_like(counts)
        if multi.size:
            freqs[multi] = ranshost.normalise_many(counts[multi])
            est_rans[multi] = ranshost.estimate_many(counts[multi], freqs[multi],
                                                     self.log2_block)
        single = np.flatnonzero(nsym == 1)
        est_rans[single] = ranshost.HEADER_SIZE + (
            (counts[single].sum(axis=1) + (1 << rans.LOG2_BLOCK_MAX) - 1) >> rans.LOG2_BLOCK_MAX)
        self._freqs = freqs
        seed = self.policy == "seed"
        for i, p in enumerate(planes):
            p.nsym = int(nsym[i])
            n, kind = p.n, p.field.kind
            if n < policy.MIN_CODED:
                p.est = {}
                continue
            est: dict[int, int | None] = {}
            if kind == layouts.KIND_SIGN:
                est[codecs.BITPACK] = (n + 7) // 8
                if not seed:
                    est[codecs.RANS] = int(est_rans[i])
            elif kind == layouts.KIND_EXPONENT:
                est[codecs.RANS] = int(est_rans[i])
            elif kind == layouts.KIND_MANTISSA:
                if self.gd and (seed or self.mantissa == "gdeflate"):
                    est[codecs.GDEFLATE] = None
                if not seed and self.mantissa in ("auto", "rans"):
                    est[codecs.RANS] = int(est_rans[i])
            p.est = {c: e for c, e in est.items() if e is None or e < n}

    def _encode(self, planes: list[_Plane]):
        self._candidates(planes)
        jobs: list[_Plane] = []
        gd_jobs: list[_Plane] = []
        job_rows: list[int] = []
        for i, p in enumerate(planes):
            if runs_rans(p):
                p.rans_job = len(jobs)
                jobs.append(p)
                job_rows.append(i)
            if codecs.GDEFLATE in p.est:
                p.gd_job = len(gd_jobs)
                gd_jobs.append(p)
        gd = gdeflate.Compressed([p.ptr for p in gd_jobs], [p.n for p in gd_jobs],
                                 self.gd_algorithm) if gd_jobs else None
        r = self._rans(jobs, self._freqs[job_rows]) if jobs else None
        return r, gd

    def _rans(self, jobs: list[_Plane], freqs: np.ndarray) -> dict:
        """Encode every block of every job in one launch; read back the per-block counts."""
        keep: list[object] = []
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
        nb = bt.size
        scratch_off = np.zeros(len(jobs) + 1, dtype=np.int64)
        np.cumsum([runtime.align(2 * p.n) for p in jobs], out=scratch_off[1:])
        scratch = runtime.device_empty(int(scratch_off[-1]))
        out = torch.empty(nb * 4 * 34 + 2 * nb, dtype=torch.uint8, device="cuda")
        counts_p = out.data_ptr()
        states_p = counts_p + 4 * nb
        firsts_p = states_p + 128 * nb
        varied_p = firsts_p + nb
        # per job: frequencies and their exclusive prefix sums; each CTA builds its encoder
        # table from them in shared memory (2 KiB per plane up instead of a 4 KiB table)
        fc = np.concatenate((freqs, np.cumsum(freqs, axis=1) - freqs), axis=1).astype(np.uint32)
        d_tabs, (tab_p,) = runtime.upload(fc)
        srcs_a = np.asarray(srcs, dtype=np.uint64)
        blk_src = srcs_a[bt.plane] + bt.start.astype(np.uint64)
        blk_tab = np.uint64(tab_p) + bt.plane.astype(np.uint64) * np.uint64(2048)
        blk_scr = (np.uint64(scratch.data_ptr()) + scratch_off[bt.plane].astype(np.uint64)
                   + 2 * bt.start.astype(np.uint64))
        cta_first, cta_warps = plan.cta_table(bt.first)
        dev, (cf_p, cw_p, src_p, len_p, bt_tab_p, scr_p) = runtime.upload(
            cta_first, cta_warps, blk_src, bt.length, blk_tab, blk_scr)
        keep += [d_tabs, dev]
        runtime.launch("rans", "rans_encode", cta_first.size, 32 * plan.RANS_WARPS,
                       np.uint64(cf_p), np.uint64(cw_p), np.uint64(src_p), np.uint64(len_p),
                       np.uint64(bt_tab_p),
                       np.uint64(scr_p), np.uint64(counts_p), np.uint64(states_p),
                       np.uint64(firsts_p), np.uint64(varied_p))
        meta = torch.cat((out[:4 * nb], out[132 * nb:134 * nb])).cpu().numpy()  # sync 2
        counts = meta[:4 * nb].view(np.uint32).astype(np.int64)
        fv = meta[4 * nb:]
        first = bt.first
        ne = first[1:] > first[:-1]
        plane_words = np.zeros(len(jobs), np.int64)
        plane_varied = np.zeros(len(jobs), bool)
        if nb:
            idx = first[:-1][ne]
            plane_words[ne] = np.add.reduceat(counts, idx)
            plane_varied[ne] = np.logical_or.reduceat(fv[nb:] != 0, idx)
        return dict(bt=bt, freqs=freqs, counts=counts, firsts=fv[:nb], plane_words=plane_words,
                    plane_varied=plane_varied, states_p=states_p, counts_p=counts_p,
                    scratch_off=scratch_off, scratch=scratch, keep=(keep, out))

    # -- stage 3: choice and assembly -----------------------------------------------------

    def _rans_option(self, p: _Plane, r: dict | None) -> tuple[int, str, bytes] | None:
        """(size, form, host prefix) of plane p's canonical rANS stream (spec/rans.md,
        section 7), or None where it would be the RAW mode (never smaller than the plane)."""
        lg, n = self.log2_block, p.n
        if p.nsym == 1:
            sym = int(np.flatnonzero(p.counts)[0])
            nbm = ranshost.n_blocks(n, rans.LOG2_BLOCK_MAX)
            head = ranshost.const_stream(np.full(nbm, sym), rans.LOG2_BLOCK_MAX, n)
            return len(head), "const", head
        if p.rans_job < 0:
            return None
        j = p.rans_job
        b0, b1 = int(r["bt"].first[j]), int(r["bt"].first[j + 1])
        if not r["plane_varied"][j]:
            head = ranshost.const_stream(r["firsts"][b0:b1], lg, n)
            return len(head), "const", head
        prefix = ranshost.rans_prefix(r["freqs"][j], lg, n)
        size = len(prefix) + rans.BLOCK_OVERHEAD * (b1 - b0) + 2 * int(r["plane_words"][j])
        if size >= ranshost.HEADER_SIZE + n:
            return None
        return size, "rans", prefix

    def _finalise(self, items: list[Item], planes: list[_Plane], r: dict | None,
                  gd: gdeflate.Compressed | None) -> set[int]:
        """Choose each plane's codec (in rank order, the first whose real size is < n, else
        raw) and return the items the CPU must code (tensor-level raw fallback)."""
        for p in planes:
            options = []  # (rank key, size, codec, form, prefix)
            for c, e in p.est.items():
                if c == codecs.RANS:
                    if p.rans_job < 0 and p.nsym > 1:
                        continue  # ranked behind bitpack, which always succeeds
                    o = self._rans_option(p, r)
                    if o is not None:
                        options.append(((e, c), o[0], c, o[1], o[2]))
                elif c == codecs.BITPACK:
                    size = (p.n + 7) // 8
                    options.append(((e, c), size, c, "bitpack", b""))
                elif c == codecs.GDEFLATE:
                    head, _pieces = gd.pieces(p.gd_job, p.ptr)
                    size = gd.payload_size(p.gd_job)
                    options.append(((size, c), size, c, "gdeflate", head))
            options.sort(key=lambda o: o[0])
            chosen = next((o for o in options if o[1] < p.n), None)
            if chosen is None:
                chosen = (None, p.n, codecs.RAW, "raw", b"")
            _key, p.size, p.codec, p.kind, p.prefix = chosen
        cpu = {k for k, it in enumerate(items) if it.layout is None}
        stored: dict[int, int] = {}
        for p in planes:
            stored[p.item] = stored.get(p.item, 0) + p.size
        cpu |= {k for k, s in stored.items() if s > items[k].nbytes}
        self._gd = gd
        return cpu

    def _assemble(self, items: list[Item], planes: list[_Plane], cpu: set[int], r: dict | None):
        """Lay the payloads out (16-byte aligned) in one compacted device buffer and fill it
        with one copy launch. The copy ops are built with numpy over all planes at once: the
        rANS planes' pieces (word counts, final states, one word run per block) in a few
        vector operations, never a numpy call per plane or per block."""
        live = [p for p in planes if p.item not in cpu]
        cpu_items = sorted(cpu)
        sizes = np.array([p.size for p in live] + [items[k].nbytes for k in cpu_items],
                         dtype=np.int64)
        offs = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum((sizes + ALIGN_PAYLOAD - 1) // ALIGN_PAYLOAD * ALIGN_PAYLOAD, out=offs[1:])
        total = int(offs[-1])
        out = runtime.device_empty(total)
        base = out.data_ptr()
        blob_parts: list[bytes] = []
        blob_at: list[int] = []   # op index -> offset in blob (host-sourced ops)
        blob_dst: list[int] = []
        blob_len: list[int] = []
        bp = 0
        # scalar ops as Python ints; vector ops as numpy arrays
        s_src: list[int] = []
        s_dst: list[int] = []
        s_len: list[int] = []
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        ln: list[np.ndarray] = []
        rans_job: list[int] = []
        rans_at: list[int] = []

        for j, p in enumerate(live):
            p.offset = int(offs[j])
            at = base + p.offset
            if p.prefix:
                blob_parts.append(p.prefix)
                blob_at.append(bp)
                blob_dst.append(at)
                blob_len.append(len(p.prefix))
                bp += len(p.prefix)
                at += len(p.prefix)
            if p.kind == "raw":
                s_src.append(p.ptr)
                s_dst.append(at)
                s_len.append(p.n)
            elif p.kind == "bitpack":
                s_src.append(p.ptr)
                s_dst.append(at)
                s_len.append(p.size)
            elif p.kind == "rans":
                rans_job.append(p.rans_job)
                rans_at.append(at)
            elif p.kind == "gdeflate":
                _head, pieces = self._gd.pieces(p.gd_job, p.ptr)
                pa = np.array([a for a, _ in pieces], np.int64)
                pn = np.array([n for _, n in pieces], np.int64)
                src.append(pa.astype(np.uint64))
                dst.append((at + np.cumsum(pn) - pn).astype(np.uint64))
                ln.append(pn.astype(np.uint64))
            # const: the prefix is the whole stream
        if rans_job:
            s_, d_, l_ = rans_runs(r, np.asarray(rans_job, np.int64),
                                   np.asarray(rans_at, np.uint64))
            src += s_
            dst += d_
            ln += l_
        cpu_at = {}
        for j, k in enumerate(cpu_items):
            at = int(offs[len(live) + j])
            cpu_at[k] = at
            s_src.append(items[k].data.data_ptr())
            s_dst.append(base + at)
            s_len.append(items[k].nbytes)
        if s_src:
            src.append(np.asarray(s_src, np.uint64))
            dst.append(np.asarray(s_dst, np.uint64))
            ln.append(np.asarray(s_len, np.uint64))
        keep = []
        if blob_parts:
            blob = np.frombuffer(b"".join(blob_parts), np.uint8)
            d_blob, (bptr,) = runtime.upload(blob)
            keep.append(d_blob)
            src.append(np.uint64(bptr) + np.asarray(blob_at, np.uint64))
            dst.append(np.asarray(blob_dst, np.uint64))
            ln.append(np.asarray(blob_len, np.uint64))
        if src:
            keep.append(runtime.copy_ops(np.concatenate(src), np.concatenate(dst),
                                         np.concatenate(ln)))
        return out, total, live, cpu_at, keep


def runs_rans(p: _Plane) -> bool:
    """Whether the rANS kernel codes plane p (after ``Encoder._candidates``): rANS is a
    candidate, unless bitpack (which always succeeds) ranks before it, or the plane holds one
    symbol (a CONST stream the host writes)."""
    bitpack_first = codecs.BITPACK in p.est and codecs.RANS in p.est and \
        (p.est[codecs.BITPACK], codecs.BITPACK) < (p.est[codecs.RANS], codecs.RANS)
    return codecs.RANS in p.est and not bitpack_first and p.nsym > 1


def planes_from_hist(item: int, layout: Layout, n: int, addrs: list[int], hist: np.ndarray,
                     ones: int) -> list[_Plane]:
    """The planes of one split tensor of ``n`` elements (sign first) with their histograms:
    ``hist`` holds the split kernel's 256 bins per byte plane, ``ones`` its set sign bits."""
    out = []
    for fi, f in enumerate(layout.fields):
        if fi == 0:
            counts = np.zeros(256, np.int64)
            counts[0], counts[1] = n - ones, ones
        else:
            counts = hist[(fi - 1) * 256:fi * 256]
        out.append(_Plane(item, f, n, addrs[fi], counts))
    return out


def launch_split(layout_id: int, src: list[int], nelems: list[int], planes: list[list[int]],
                 hist_p: int, ones_p: int) -> torch.Tensor:
    """One split launch (``kernels/planes.cu``) for tensors of one layout: tensor r has
    ``nelems[r]`` elements at address ``src[r]`` and its planes (packed sign bits first) at
    ``planes[r]``; its byte histograms are added to the 1024 u64 at ``hist_p + 8192 * r`` and its
    count of set sign bits to the u64 at ``ones_p + 8 * r``. Returns the launch's device table
    (stream-ordered: keep it or drop it, the caching allocator reuses it after the launch)."""
    cs, c0 = plan.chunk_table(list(nelems))
    table = np.zeros((len(src), 5), dtype=np.uint64)
    for r, addrs in enumerate(planes):
        table[r, :len(addrs)] = addrs
    dev, ptrs = runtime.upload(cs, c0, np.asarray(src, dtype=np.uint64),
                               np.asarray(nelems, dtype=np.int64), table)
    runtime.launch("planes", SPLIT_KERNEL[layout_id], cs.size, 256,
                   *(np.uint64(p) for p in ptrs), np.uint64(hist_p), np.uint64(ones_p))
    return dev


def rans_runs(r: dict, jobs: np.ndarray, at: np.ndarray
              ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Copy ops (sources, destinations, lengths) that lay rANS job ``jobs[q]`` of an ``_rans``
    result out at device address ``at[q]`` as a stream's sections (spec/rans.md, section 2):
    word counts, final states, then the words of every block back to back. Built with numpy
    over all jobs and blocks at once, never a call per plane or per block."""
    bt = r["bt"]
    b0 = bt.first[jobs]
    nbk = bt.first[jobs + 1] - b0
    nb_u = nbk.astype(np.uint64)
    # word counts and final states: two runs per plane
    src = [np.uint64(r["counts_p"]) + 4 * b0.astype(np.uint64),
           np.uint64(r["states_p"]) + 128 * b0.astype(np.uint64)]
    dst = [at, at + 4 * nb_u]
    ln = [4 * nb_u, 128 * nb_u]
    # one word run per block: blocks of plane q are b0[q] .. b0[q] + nbk[q] - 1
    q = np.repeat(np.arange(jobs.size), nbk)
    firstq = np.cumsum(nbk) - nbk
    blk = np.arange(q.size, dtype=np.int64) - firstq[q] + b0[q]
    c = r["counts"][blk]
    run_start = np.zeros(c.size + 1, np.int64)
    np.cumsum(c, out=run_start[1:])
    within = run_start[:-1] - run_start[firstq][q]
    src.append(np.uint64(r["scratch"].data_ptr()) + r["scratch_off"][jobs][q].astype(np.uint64)
               + 2 * bt.start[blk].astype(np.uint64))
    dst.append(at[q] + 132 * nb_u[q] + 2 * within.astype(np.uint64))
    ln.append(2 * c.astype(np.uint64))
    return src, dst, ln


def rans_stream(plane: torch.Tensor, log2_block: int = rans.LOG2_BLOCK_DEFAULT) -> np.ndarray:
    """The canonical S4 rANS stream (spec/rans.md, section 7) of a uint8 plane on the device,
    through the same kernels and assembly as the coder: equal to ``RansCodec.encode``."""
    plane = plane.reshape(-1).contiguous()
    n = int(plane.numel())
    if n == 0:
        return np.frombuffer(ranshost.header(rans.MODE_RAW, log2_block, 0), np.uint8)
    counts = torch.bincount(plane, minlength=256).cpu().numpy().astype(np.int64)
    enc = Encoder(log2_block=log2_block)
    p = _Plane(0, layouts.Field(layouts.KIND_EXPONENT, 0, 7, 8), n, plane.data_ptr(), counts,
               nsym=int(np.count_nonzero(counts)))
    r = None
    if p.nsym > 1:
        p.rans_job = 0
        r = enc._rans([p], rans.normalise(counts)[None, :])
    o = enc._rans_option(p, r)
    if o is None:
        head = ranshost.header(rans.MODE_RAW, log2_block, n)
        return np.concatenate([np.frombuffer(head, np.uint8), plane.cpu().numpy()])
    p.size, p.kind, p.prefix = o
    p.codec = codecs.RANS
    out, _total, _live, _cpu, _keep = enc._assemble([Item(None, (n,), plane)], [p], set(), r)
    return out[:p.size].cpu().numpy().copy()
