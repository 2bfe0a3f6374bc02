"""Save side of the CUDA path: code tensors that live on the GPU into ``CodedTensor``s.

Host work is numpy over all planes at once (:class:`Planes`), never a Python step per plane or
block, and the host synchronises once per window and once per group, whatever the number of
tensors, planes or blocks:

1. **Window** (consecutive tensors whose histograms and tables take at most 1/16 of the
   workspace): one histogram launch per layout (``hist_*``) reads every tensor once, and one
   launch normalises every plane's histogram into rANS frequencies (``rans_normalise``:
   rans.normalise's integer procedure; the encoder's table input and the streams' frequency
   tables stay on the device) and sums each plane's rANS size estimate. Synchronisation: 32
   bytes per plane come to the host (symbols present, estimate, first symbol, table size),
   which picks every plane's candidate codecs as ``s4format.policy`` ranks them (GPU codecs
   only: :func:`candidates`).
   Groups are then sized by what they really hold (``plan.group_need``: rANS scratch only for
   the planes the rANS kernel codes, and only the most words each can write: the bound
   ``ranshost.WORD_COST`` gives, which ``rans_normalise`` sums per plane, a third of a byte
   per symbol for a weight's exponents where the worst case is two), not by the worst case.
2. **Group**, one batch of launches with one table upload: one split launch per layout
   (packed sign bits and byte planes;
   a narrow mantissa plane that will be stored bit-packed at its field's width is written
   packed, see :func:`pack_widths`; those, and the planes with no candidate codec, go to a
   buffer of their own that the result keeps: :func:`kept_as_split`),
   and one launch that encodes every rANS block of the group (one warp each); GDeflate pages
   go to nvCOMP in one batch where asked for. Synchronisation: the word counts, first symbols
   and "varied" flags of the blocks come back; the content hashes of the raw bytes (leaf
   digests, then their XXH3-128 roots: ``runtime.content_hashes``) are queued behind them, so
   the device hashes while the host lays the payloads out.
   A group of a window that needs no sizing (it fits the workspace even if every plane took
   rANS) is split and histogrammed in one pass (``split_hist_*``) and queues its rANS launch
   right behind, before the host has read its figures: ``rans_jobs`` picks on the device the
   planes :func:`candidates` will pick (the blocks of the others code nothing). The host waits
   only for the figures, checks that both picks agree (if not, a bug, the host's rule codes
   again: ``Encoder.mispredicted``) and decides while the device codes.
3. the host sizes every payload and picks its codec (:func:`choose`), lays the payloads out in
   one compacted device buffer (16-byte aligned; the planes the split wrote as they are
   stored stay in their own buffer, the second part of the group's payload image), and one
   copy launch assembles them (with
   one more that places every rANS block's words, from the prefix sums of the word counts the
   host has read, in the batch's one upload); two hash launches make the plane checksums
   (the payload leaves' digests, then their roots: ``runtime.plane_checksums``). The content
   hashes (16 bytes a tensor) and the checksums (8 bytes a plane) go to pinned host memory
   without a synchronisation; ``Encoder.finish`` reads them once there, while the next group
   is coded. The host hashes nothing here (the chunked coder roots its one tensor's digests on
   the host).

The payload image with that metadata is the device-to-device result (:class:`DeviceGroup`).
For a file, the buffer goes to pinned host memory in one copy on a side stream, overlapped with
the next group's device work (``Encoder.code`` keeps one group in flight); payloads are views of
that pinned buffer and keep it alive as long as the caller holds them.

Tensors under ``SPLIT_MIN`` bytes are stored as one raw plane (raw layout, raw codec) copied on
the device: where the CPU writer might save a few hundred bytes on them with zstd, coding
hundreds of them on the host would cost more time than the whole GPU pass. Larger tensors the
GPU does not split (other dtypes) and tensors whose planes would store more than their raw
bytes are copied to the host in the same buffer and coded by the CPU coder, as the CPU path
codes them.

Codec choice, in the CPU policy's rank order: sign planes take bitpack or rANS (including
CONST); exponent and mantissa planes bitpack-w (policy auto; its width from the largest symbol
present), rANS or raw by the histogram estimate, bitpack-w first unless rANS would save over
1/65 of it (``policy.prefer_packed``). GDeflate (nvCOMP, far slower than the rANS kernels) runs
only where asked for: ``mantissa="gdeflate"`` or the ``seed`` policy; ``mantissa="auto"`` never
pays for it on the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from s4format import layouts, policy
from s4format.codecs import rans
from s4format.writer import SPLIT_MIN, CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import gdeflate, histograms, plan, ransencode, runtime
from s4weights.gpu.choose import candidates, choose
from s4weights.gpu.items import Coded, Item
from s4weights.gpu.planes import (
    ALIGN_PAYLOAD,
    FORM_BITPACK,
    FORM_BITPACK_W,
    FORM_GDEFLATE,
    FORM_RANS,
    FORM_RAW,
    SPLIT_KERNEL,
    Planes,
    kept_as_split,
    launch_split,
    pack_widths,
    params_of,
    place_split,
    stored_bound,
)

MANTISSA_MODES = ("auto", "rans", "gdeflate", "raw")

log = logging.getLogger(__name__)


@dataclass
class DeviceGroup:
    """Device-to-device result for one group: the compacted payloads on the device and every
    piece of metadata a writer needs (codec, sizes, offsets, plane checksums, content hashes;
    the last two once ``Encoder.finish`` has run, as ``encode_device`` and ``code`` do).
    ``cpu[k]`` is the offset of item k's raw bytes in the buffer where the CPU coder codes it.
    The payloads are one image of ``total`` bytes: ``buffer``'s first ``head`` bytes, then the
    ``parts`` (image offset, device bytes): runs of planes the split stored as they are stored,
    left where it put them (``Planes.fixed``, which ``fixed`` keeps while the parts are used;
    planes of it that took another form are in no part). Offsets (``planes.offset``, ``cpu``)
    are in the image."""
    items: list[Item]
    buffer: torch.Tensor
    total: int
    planes: Planes
    live: np.ndarray              # rows of ``planes`` stored from the buffer (not CPU-coded)
    cpu: dict[int, int]
    content: list[bytes]
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    digests: tuple | None = None  # content hashes and plane checksums on their way to the
    # host (``finish``)
    head: int = -1                # bytes of ``buffer`` in the image (-1: all ``total``)
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    fixed: torch.Tensor | None = None

    @property
    def device_bytes(self) -> int:
        """Device bytes the result holds."""
        held = 0 if self.buffer is None else self.buffer.numel()
        return held + (0 if self.fixed is None else self.fixed.numel())

    def payload(self, off: int, size: int) -> torch.Tensor:
        """The device bytes of the image at ``off`` (inside one part)."""
        for at, part in self.parts:
            if at <= off < at + part.numel():
                return part[off - at:off - at + size]
        return self.buffer[off:off + size]


def _to_pinned(digests: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    """The first ``count`` u64 ``digests`` copied to pinned host memory without a
    synchronisation, and the event after the copy (a spare byte when there are none)."""
    host = runtime.pinned(8 * count)
    if count:
        host.copy_(digests[:count].view(torch.uint8), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


@dataclass
class _Prepared:
    """A group's launch tables made before its launches (``Encoder._prepare``)."""
    planes: Planes            # the plane table they were made for
    rows: np.ndarray          # its split rows
    width: np.ndarray         # how the split stores them (``Planes.pw``)
    off: np.ndarray           # their offsets in the planes buffer, or the packed planes'
    total: int                # the planes buffer's bytes
    infix: np.ndarray         # the rows in the packed planes' buffer (``place_split``)
    fixed_total: int          # its bytes
    splits: list              # per layout: (id, sources, elements, rows per tensor, chunks,
    #                           pack flags)
    rans: dict | None         # ``ransencode.rans_plan`` of the rows the rANS kernel codes


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
        # a group split before its codecs are known (``histograms.window_planes``) stores its
        # narrow mantissa planes packed where bitpack-w is a candidate for them: the codec they
        # take unless rANS saves over 1/65 (then its kernel reads them packed), so the assembly
        # usually copies them as they are
        self.packs = self.policy == "auto" and mantissa == "auto"
        self._copy_stream: torch.cuda.Stream | None = None
        # a group split before its codecs are known queues its rANS launch before the host has
        # read its figures, the planes picked on the device (``histograms``); the groups
        # where that launch picked other planes than the host's rule (a bug: rans_jobs is
        # candidates' rule; the host's wins and codes again)
        self.early_rans = True
        self.mispredicted = 0
        # a sized group's split also writes the planes with no candidate codec (``stays_raw``)
        # where the result keeps them (``kept_as_split``)
        self.keep_raw = True

    def _workspace(self, items: list[Item]) -> int:
        return self.workspace or plan.default_workspace(sum(i.nbytes for i in items))

    def _budgets(self, items: list[Item]) -> tuple[int, int]:
        """(the share of the workspace a window's histogram pass may hold, what groups may
        hold: the rest)."""
        workspace = self._workspace(items)
        cap = workspace // plan.WINDOW_SHARE
        return cap, workspace - cap

    @staticmethod
    def _layouts(items: list[Item]) -> None:
        for it in items:
            it.layout = plan.gpu_layout(it.dtype.name, it.nbytes)
            if it.layout is None and it.nbytes < SPLIT_MIN:
                # small tensors (biases, norms, step counters: hundreds per state, a few KiB
                # in all) are stored as one raw plane, copied on the device: coding them on
                # the CPU costs more host time than all their bytes are worth
                it.layout = layouts.RAW

    def _plan(self, items: list[Item], pipelined: bool = False, chunked: bool = False
              ) -> Iterator[tuple[list[Item], Planes | None, int, tuple | None] | Item]:
        """The groups to code, in order, each as (its items, its plane table with candidates
        chosen or None, its device bytes, the next group's items and table when the next
        group is of the same window, else None). Consecutive tensors form windows (histograms and
        rANS tables of at most ``workspace / plan.WINDOW_SHARE`` bytes). A window that fits the
        workspace even if every plane took rANS (``plan.encode_need``) is one group, split and
        histogrammed in one pass when it is coded (table None). Otherwise one histogram pass
        over the window (``histograms.window_planes``, one synchronisation) decides every plane's
        candidates, so each group is sized by what it really holds (``plan.group_need``), not
        by the worst case. ``pipelined`` (``code``): the previous group's compacted buffer is
        still on the device while the next group is coded, and counts against the workspace.
        ``chunked``: a tensor that alone needs more than the workspace (and every item with a
        parent) is yielded on its own, an ``Item``, for the chunked coder; without it such a
        tensor is a group of its own, whatever it needs."""
        if not chunked and any(it.parent is not None for it in items):
            raise ValueError("an item with a parent is coded by Encoder.code only")
        self._layouts(items)
        cap, budget = self._budgets(items)
        needs: dict[tuple, tuple[int, int, bool]] = {}  # a model's layers repeat a few shapes

        def need_of(it: Item) -> tuple[int, int, bool]:
            """(the most it can need, its window tables' bytes, whether it is alone over the
            budget even with no plane rANS-coded (the least it can need): no sizing to do)."""
            key = (-1 if it.layout is None else it.layout.layout_id, it.nbytes,
                   it.dtype.itemsize)
            if (v := needs.get(key)) is None:
                least, most = (plan.encode_need(it.layout, it.nbytes, it.dtype.itemsize,
                                                self.gd, self.log2_block, rans=r)
                               for r in (False, True))
                v = needs[key] = (most, plan.window_meta(it.layout),
                                  it.layout is not layouts.RAW and least > budget)
            return v

        window: list[Item] = []
        meta = worst = 0
        for it in items:
            most, m, alone = need_of(it)
            large = it.parent is not None or (chunked and alone and not self.gd)
            if large or alone or (window and meta + m > cap):
                yield from self._window(window, budget, pipelined, chunked, worst)
                window, meta, worst = [], 0, 0
            if large:
                yield it
            elif alone:
                yield [it], None, most, None
            else:
                window.append(it)
                meta += m
                worst += most
        yield from self._window(window, budget, pipelined, chunked, worst)

    def _window(self, items: list[Item], budget: int, pipelined: bool, chunked: bool,
                worst: int) -> Iterator[tuple[list[Item], Planes | None, int, tuple | None]
                                        | Item]:
        if not items:
            return
        if worst <= budget:
            yield items, None, worst, None
            return
        pl, tables, _none = histograms.window_planes(self, items)
        nbytes = np.array([it.nbytes for it in items], np.int64)
        width = pack_widths(pl)
        kept = kept_as_split(pl, width, self.keep_raw)
        # a tensor that may store more than its raw bytes is copied raw for the CPU coder,
        # while its kept planes stay where the split wrote them: its need counts both
        bound = stored_bound(pl, width, kept, self.log2_block)
        may_cpu = np.bincount(pl.item, weights=bound, minlength=nbytes.size) > nbytes
        # the compacted payloads: a tensor that may go to the CPU coder (or has no rows: the
        # CPU codes it) copied raw, any other its rows' bounds but the kept ones' (16-byte
        # aligned each)
        rows = np.bincount(pl.item, minlength=nbytes.size)
        may_cpu |= rows == 0
        # (a may_cpu tensor the GPU codes after all: its rows' payloads, 16-byte aligned)
        payload = np.where(may_cpu, (nbytes + 255) // 256 * 256 + ALIGN_PAYLOAD * rows, np.bincount(
            pl.item, weights=np.where(kept, 0, (bound + ALIGN_PAYLOAD - 1) // ALIGN_PAYLOAD
                                      * ALIGN_PAYLOAD), minlength=nbytes.size)).astype(np.int64)
        need = plan.group_need(pl.item, width, pl.kind != layouts.KIND_RAW, pl.n,
                               pl.runs_rans, pl.cand_gd, nbytes, self.log2_block,
                               words=pl.words, payload=payload)
        # what a group's result holds on the device: its compacted payloads and the planes
        # kept where its split wrote them (counted whole: those of a tensor the CPU codes
        # stay there too)
        held = payload + np.bincount(pl.item, weights=np.where(
            kept, plan.split_plane_bytes(pl.n, width), 0), minlength=nbytes.size).astype(np.int64)
        first = np.searchsorted(pl.item, np.arange(len(items) + 1))
        run: list[int] = []

        def flush() -> Iterator[tuple[list[Item], Planes, int, tuple | None]]:
            groups = []
            for grp in plan.groups_by_need(need[run].tolist(), held[run].tolist(), budget,
                                           pipelined):
                k0, k1 = run[grp.start], run[grp.stop - 1] + 1  # runs are consecutive
                rows = np.arange(first[k0], first[k1])
                sub = pl.take(rows, pl.item[rows] - k0)
                sub.tables = tables  # table inputs and bytes: until the group's copy
                groups.append((items[k0:k1], sub, int(need[k0:k1].sum())))
            run.clear()
            for g, (its, sub, nd) in enumerate(groups):  # each with the next one's items
                yield its, sub, nd, groups[g + 1][:2] if g + 1 < len(groups) else None

        for k, it in enumerate(items):
            if chunked and need[k] > budget and not self.gd and it.layout is not layouts.RAW:
                yield from flush()
                yield it
            else:
                run.append(k)
        yield from flush()

    def code(self, items: list[Item]) -> Iterator[Coded]:
        """Coded tensors with payloads in pinned host memory, in order; one group's D2H is in
        flight while the next group runs on the device. A tensor too large for the workspace
        is coded alone, in chunks (``chunked``), once the group before it is done."""
        from s4weights.gpu import chunked

        pending: DeviceGroup | None = None
        ready: _Prepared | None = None  # the next group's tables, made while this one ran
        _cap, budget = self._budgets(items)
        for grp in self._plan(items, pipelined=True, chunked=True):
            if isinstance(grp, Item):
                if pending is not None:
                    yield from self._results(pending)
                    pending = None
                # the chunked coders get what groups get: a tensor handed out in the middle
                # of a window leaves the window's tables (up to the rest) on the device
                split = grp.layout is not None and grp.layout is not layouts.RAW
                yield (chunked.code_large(self, grp, budget) if split
                       else chunked.code_host(self, grp, budget))
                continue
            its, pl, need, following = grp
            if pending is not None and pending.device_bytes + need > budget:
                # the first group of a new window: wait for the previous group's copy
                yield from self._results(pending)
                pending = None
            box: list[_Prepared] = []
            g = self._encode_group(its, pl, pending, ready, self._ahead(following, box),
                                   fits=need <= budget)
            ready = box[0] if box else None
            self._to_host(g)
            if pending is not None:
                yield from self._results(pending)
            pending = g
        if pending is not None:
            yield from self._results(pending)

    def encode_device(self, items: list[Item]) -> list[DeviceGroup]:
        """Device-to-device: every group's compacted payload buffer stays on the device (so a
        tensor larger than the workspace is one group of its own, whatever it needs)."""
        out: list[DeviceGroup] = []
        ready: _Prepared | None = None
        _cap, budget = self._budgets(items)
        for its, pl, need, following in self._plan(items):
            # the previous group's hashes are rooted and the next group's tables made while
            # this group's kernels run
            box: list[_Prepared] = []
            out.append(self._encode_group(its, pl, out[-1] if out else None, ready,
                                          self._ahead(following, box), fits=need <= budget))
            ready = box[0] if box else None
        if out:
            self.finish(out[-1])
        return out

    def _ahead(self, following: tuple | None, box: list):
        """A callable that makes the ``following`` group's tables into ``box`` (or None)."""
        if following is None:
            return None
        return lambda: box.append(self._prepare(*following))

    # -- one window: histograms and candidates ---------------------------------------------

    # -- one group --------------------------------------------------------------------------

    def _encode_group(self, items: list[Item], pl: Planes | None,
                      previous: DeviceGroup | None = None, prep: _Prepared | None = None,
                      ahead=None, fits: bool = False) -> DeviceGroup:
        """Code one group (its plane table from :meth:`_plan`, or None: split and histograms
        here, one more synchronisation) on the device. While its kernels run, the host reads
        ``previous``'s hashes (the group before, if not read yet) and runs ``ahead()`` (the
        next group's :meth:`_prepare`); ``prep``: this group's, if made that way. ``fits``:
        the group's worst case (every plane rANS-coded) fits the workspace, so a group split
        here may queue its rANS launch before its figures (``histograms``)."""
        prof = runtime.Profile("encode")
        batch = runtime.Batch()  # split, rANS: their tables in one upload
        planned = None
        if pl is None:  # a group that needs no sizing: split and histograms in one pass
            pl, pl.tables, planes_buf = histograms.window_planes(
                self, items, batch, split=True, queue_rans=fits)  # sync
            batch = runtime.Batch()
        else:
            if prep is None or prep.planes is not pl:
                prep = self._prepare(items, pl)
            planes_buf = self._split(pl, prep, batch)
            planned = prep.rans

        content: list = []
        roots: list[torch.Tensor] = []

        def after(b: runtime.Batch) -> None:
            # the content hashes, their tables in the split's upload, launched behind the rANS
            # encoder and its word counts' copy: the device hashes while the host chooses
            # codecs and lays out the payload
            roots.append(runtime.content_hashes([i.data.data_ptr() for i in items],
                                                [i.nbytes for i in items], b))

        def meanwhile() -> None:
            # the hashes go to the host without a synchronisation
            content.extend(_to_pinned(roots[0], 2 * len(items)))
            if previous is not None:
                self.finish(previous)
            if ahead is not None:
                ahead()

        r, gd = self._encode(pl, batch, meanwhile, planned, after)  # sync: the word counts
        prof.mark("split+encode")
        choose(pl, r, gd, self.log2_block)
        cpu = {k for k, it in enumerate(items) if it.layout is None}
        stored = np.bincount(pl.item, weights=pl.size, minlength=len(items))
        nbytes = np.array([it.nbytes for it in items], np.int64)
        cpu |= set(np.flatnonzero(stored > nbytes).tolist())
        prof.mark("choose")
        buf, total, head, parts, live, cpu_at, keep, sums = self._assemble(
            items, pl, sorted(cpu), r, gd)
        fixed, pl.fixed = (pl.fixed if parts else None), None
        # the window's encoder-table inputs and frequency tables are no longer this group's
        # once its copy is queued (stream order keeps them until it has run)
        pl.tables = None
        prof.mark("assemble")
        # the payload digests go to the host without a synchronisation too: the next group's
        # work is queued behind them, and ``finish`` roots them once they are there
        host, arrived = _to_pinned(sums, live.size)
        prof.mark("payload hash")
        prof.report()
        del planes_buf, r, gd, keep
        g = DeviceGroup(items, buf, total, pl, live, cpu_at, [], head=head, parts=parts,
                        fixed=fixed)
        g.digests = (*content, host, arrived)
        if content[1].query():  # the input's hashes are there (hashed during the layout)
            self._root_content(g)
        return g

    @staticmethod
    def _root_content(g: DeviceGroup) -> None:
        """The group's content hashes, once the device's have reached the host."""
        host, hashed = g.digests[:2]
        hashed.synchronize()
        b = host.numpy()[:16 * len(g.items)].tobytes()
        g.content = [b[16 * k:16 * (k + 1)] for k in range(len(g.items))]

    def finish(self, g: DeviceGroup) -> None:
        """Read the group's content hashes (unless done) and plane checksums, once they have
        reached the host (a wait only if the device is still at them)."""
        if g.digests is None:
            return
        if not g.content:
            self._root_content(g)
        host, arrived = g.digests[2:]
        arrived.synchronize()
        g.planes.checksum[g.live] = host.numpy()[:8 * g.live.size].view(np.uint64)
        g.digests = None

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
            end = g.total if g.head < 0 else g.head
            if end:
                g.host[:end].copy_(g.buffer[:end], non_blocking=True)
            for at, part in g.parts:
                g.host[at:at + part.numel()].copy_(part, non_blocking=True)
            g.done = torch.cuda.Event()
            g.done.record(cs)

    def _results(self, g: DeviceGroup) -> list[Coded]:
        self.finish(g)
        g.done.synchronize()
        host = g.host.numpy()
        g.buffer = g.fixed = None  # the copy has run: the device buffers can go
        g.parts = []
        pl = g.planes
        # rows are in item order: item k's planes are rows first[k] .. first[k + 1] - 1
        first = np.searchsorted(pl.item, np.arange(len(g.items) + 1)).tolist()
        kind, index, codec, n = (a.tolist() for a in (pl.kind, pl.index, pl.codec, pl.n))
        off, size, check = pl.offset.tolist(), pl.size.tolist(), pl.checksum.tolist()
        out = []
        for k, it in enumerate(g.items):
            if k in g.cpu:
                raw = host[g.cpu[k]:g.cpu[k] + it.nbytes]
                out.append(Coded(code_tensor(raw, it.dtype, self.policy), g.content[k]))
                continue
            coded = tuple(CodedPlane(kind[q], index[q], codec[q], n[q],
                                     host[off[q]:off[q] + size[q]], params_of(pl, q), check[q])
                          for q in range(first[k], first[k + 1]))
            out.append(Coded(CodedTensor(it.layout, coded), g.content[k]))
        return out

    # -- stage 1: split and encode --------------------------------------------------------

    def _prepare(self, items: list[Item], pl: Planes) -> _Prepared:
        """The group's launch tables that need no device address (host work that can run while
        the group before is on the device): where each split plane goes in the planes buffer,
        the split launches' chunk tables, the rANS launch's CTA table."""
        rows = np.flatnonzero(pl.kind != layouts.KIND_RAW)
        n = pl.n[rows]
        width = pack_widths(pl)
        infix = kept_as_split(pl, width, self.keep_raw)[rows]
        off, total, ftotal = place_split(n, width[rows], infix)
        first = np.searchsorted(pl.item, np.arange(len(items) + 1))
        split = [k for k, it in enumerate(items)
                 if it.layout is not None and it.layout is not layouts.RAW]
        launches = []
        for lay_id in SPLIT_KERNEL:
            sel = [k for k in split if items[k].layout.layout_id == lay_id]
            if not sel:
                continue
            lay = items[sel[0]].layout
            nel = [items[k].nbytes // lay.word_size(items[k].dtype.itemsize) for k in sel]
            at_rows = first[sel][:, None] + np.arange(len(lay.fields))
            launches.append((lay_id, [items[k].data.data_ptr() for k in sel], nel, at_rows,
                             plan.chunk_table(nel),
                             (width[at_rows] < 8)[:, 1:].any(axis=1).astype(np.uint8)))
        jobs = np.flatnonzero(pl.runs_rans)
        return _Prepared(pl, rows, width[rows], off, total, infix, ftotal, launches,
                         ransencode.rans_plan(pl.n[jobs], self.log2_block,
                                    None if pl.words is None else pl.words[jobs])
                         if jobs.size else None)

    def _split(self, pl: Planes, prep: _Prepared, batch: runtime.Batch) -> torch.Tensor:
        """The group's planes in one device buffer, one split launch per layout (in ``batch``):
        packed sign bits, byte planes and the narrow mantissa planes ``pack_widths`` packs, no
        histograms (the window has them). Sets the device address and the stored width of
        every split row of ``pl``."""
        buf = runtime.device_empty(prep.total)
        pl.ptr[prep.rows] = np.uint64(buf.data_ptr()) + prep.off.astype(np.uint64)
        pl.pw[prep.rows] = prep.width
        if prep.fixed_total:
            pl.fixed = runtime.device_empty(prep.fixed_total)
            fr = prep.rows[prep.infix]
            pl.ptr[fr] = np.uint64(pl.fixed.data_ptr()) + prep.off[prep.infix].astype(np.uint64)
            pl.fixed_off[fr] = prep.off[prep.infix]
        for lay_id, src, nel, at_rows, chunks, pack in prep.splits:
            launch_split(lay_id, src, nel, pl.ptr[at_rows], 0, 0, batch, "split", chunks, pack)
        return buf

    def candidates(self, pl: Planes) -> None:
        candidates(pl, self.policy, self.mantissa, self.gd, self.log2_block)

    def _encode(self, pl: Planes, batch: runtime.Batch, meanwhile=None,
                planned: dict | None = None, after=None):
        """Queue the rANS launch behind the split in ``batch``, run it, start GDeflate where
        asked for, and read the blocks' word counts back (``meanwhile()`` runs on the host while
        the device works; ``planned``: the jobs' ``rans_plan``, when made beforehand;
        ``after(batch)`` queues launches that go behind the counts' copy, their tables in the
        same upload)."""
        gd_rows = np.flatnonzero(pl.cand_gd)
        launched, pl.rans_queued = pl.rans_queued, None
        if launched is None:
            jobs = np.flatnonzero(pl.runs_rans)
            launched = ransencode.rans_launch(
                pl.pw[jobs], pl.n[jobs], pl.ptr[jobs],
                None if pl.freqs is None else pl.freqs[jobs],
                None if pl.tab is None else pl.tab[jobs], batch, self.log2_block,
                planned) if jobs.size else None
        stop = batch.mark()
        if after is not None:
            after(batch)
        tables = batch.run(stop)
        gd = gdeflate.Compressed(pl.ptr[gd_rows].tolist(), pl.n[gd_rows].tolist(),
                                 self.gd_algorithm) if gd_rows.size else None
        r = (ransencode.rans_collect(launched, meanwhile, batch) if launched is not None
             else None)
        if r is None:
            batch.run()
            if meanwhile is not None:
                meanwhile()
        del tables
        return r, gd

    # -- stage 3: assembly ----------------------------------------------------------------

    def _assemble(self, items: list[Item], pl: Planes, cpu: list[int], r: dict | None,
                  gd: gdeflate.Compressed | None):
        """Lay the payloads out (16-byte aligned) in one compacted device buffer and fill it
        with one copy launch, the copy ops built with numpy over all planes at once: the host
        bytes of every payload (``pl.heads``), the frequency tables the device made
        (``pl.dtab``), raw and bitpacked planes, the rANS planes' word counts and final states,
        and the raw bytes of the items the CPU codes; one launch places every rANS block's
        words (:meth:`_place`); then launch the payloads' checksums. Planes the split packed
        as they are stored stay where it put them (``Planes.fixed``): each run of them there
        that no other plane interrupts is a part of the group's payload image, after the
        buffer's bytes. Returns (buffer, bytes of the image, the buffer's bytes in it or -1 for
        all, the other parts (image offset, device bytes), the live rows, where each CPU-coded
        item's bytes are, the launches' tables to keep, the device checksum of each live
        row's payload)."""
        live = np.flatnonzero(~np.isin(pl.item, cpu)) if cpu else np.arange(len(pl))
        form, pw = pl.form[live], pl.pw[live]
        # the plane's bytes as the split stored them: raw bytes, sign bits for bitpack, a
        # plane packed at the width bitpack-w stores; those in ``pl.fixed`` are not moved
        plain = (((form == FORM_RAW) & (pw == 8)) | (form == FORM_BITPACK)
                 | ((form == FORM_BITPACK_W) & (pw == pl.width[live])))
        kept = plain & (pl.fixed_off[live] >= 0)
        placed = ~kept
        sizes = np.concatenate((pl.size[live][placed], [items[k].nbytes for k in cpu])
                               ).astype(np.int64)
        offs = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum((sizes + ALIGN_PAYLOAD - 1) // ALIGN_PAYLOAD * ALIGN_PAYLOAD, out=offs[1:])
        total = int(offs[-1])
        out = runtime.device_empty(total)
        base = np.uint64(out.data_ptr())
        nplaced = int(placed.sum())
        pl.offset[live[placed]] = offs[:nplaced]
        head, parts = -1, []
        if kept.any():
            head, total = total, self._parts(pl, live[kept], total, parts)
        # every live payload's device address: where placed ones go, where kept ones are
        at = np.where(kept, pl.ptr[live], base + pl.offset[live].astype(np.uint64))
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        ln: list[np.ndarray] = []
        copied = plain & placed
        src.append(pl.ptr[live][copied])
        dst.append(at[copied])
        ln.append(pl.size[live][copied].astype(np.uint64))
        headed = pl.head[live] > 0
        keep = []
        if headed.any():
            d_heads, (hp,) = runtime.upload(pl.heads)
            keep.append(d_heads)
            src.append(np.uint64(hp) + pl.head_at[live][headed].astype(np.uint64))
            dst.append(at[headed])
            ln.append(pl.head[live][headed].astype(np.uint64))
        dtab = pl.dtab[live] > 0  # RANS streams' frequency tables, made on the device
        if dtab.any():
            src.append(pl.tdev[live][dtab])
            dst.append(at[dtab] + pl.head[live][dtab].astype(np.uint64))
            ln.append(pl.dtab[live][dtab].astype(np.uint64))
        # bitpack-w from bytes, or from a packed plane at another width; raw bytes from a packed
        # plane (width 8)
        packed = (((form == FORM_BITPACK_W) | (form == FORM_RAW)) & ~plain)
        pack = None
        if packed.any():
            pack = (pl.ptr[live][packed], at[packed], pl.n[live][packed],
                    np.where(form[packed] == FORM_RAW, 8, pl.width[live][packed]), pw[packed])
        rans_rows = form == FORM_RANS
        words = None  # where each rANS job's words go (0: not a RANS-mode stream)
        if rans_rows.any():
            job = np.cumsum(pl.launched) - 1
            rows = live[rans_rows]
            starts = at[rans_rows] + (pl.head[rows] + pl.dtab[rows]).astype(np.uint64)
            s_, d_, l_ = ransencode.rans_runs(r, job[rows], starts, words=False)
            src += s_
            dst += d_
            ln += l_
            first = r["bt"].first
            words = np.zeros(first.size - 1, np.uint64)
            words[job[rows]] = starts + (rans.BLOCK_OVERHEAD * np.diff(first)[job[rows]]
                                         ).astype(np.uint64)
        for q in np.flatnonzero(form == FORM_GDEFLATE).tolist():  # rare: a step per plane
            row = int(live[q])
            _head, pieces = gd.pieces(int(pl.gd_job[row]), int(pl.ptr[row]))
            pa = np.array([a for a, _ in pieces], np.uint64)
            pn = np.array([c for _, c in pieces], np.uint64)
            src.append(pa)
            dst.append(at[q] + np.uint64(pl.head[row]) + np.cumsum(pn) - pn)
            ln.append(pn)
        cpu_at = {k: int(offs[nplaced + j]) for j, k in enumerate(cpu)}
        if cpu:
            src.append(np.array([items[k].data.data_ptr() for k in cpu], np.uint64))
            dst.append(base + offs[nplaced:-1].astype(np.uint64))
            ln.append(np.array([items[k].nbytes for k in cpu], np.uint64))
        batch = runtime.Batch()  # the copies and the payload digests, tables in one upload
        runtime.copy_ops(np.concatenate(src), np.concatenate(dst), np.concatenate(ln), batch)
        if pack is not None:
            runtime.pack_ops(*pack, batch=batch)
        if words is not None:  # every block's words after the words of its stream's blocks before
            ransencode.place_words(r, words, batch)
        sums = runtime.plane_checksums(at, pl.size[live], batch)
        keep.append(batch.run())
        return out, total, head, parts, live, cpu_at, keep, sums

    @staticmethod
    def _parts(pl: Planes, kept: np.ndarray, at: int, parts: list) -> int:
        """Image parts of the planes ``kept`` where the split put them in ``pl.fixed``: each run
        of them there with no other plane between (a plane that took another form, or of a
        CPU-coded item, leaves its bytes out of the image), from image offset ``at`` on (16-byte
        aligned). Sets their offsets and appends the parts; returns the image's end."""
        rows = np.flatnonzero(pl.fixed_off >= 0)
        rows = rows[np.argsort(pl.fixed_off[rows], kind="stable")]  # in their buffer's order
        keep = np.zeros(len(pl), bool)
        keep[kept] = True
        keep = keep[rows]  # (np.isin costs ~50 µs on a few rows)
        # runs: consecutive kept rows of that order
        starts = np.flatnonzero(keep & ~np.concatenate(([False], keep[:-1])))
        ends = np.flatnonzero(keep & ~np.concatenate((keep[1:], [False]))) + 1
        for a, b in zip(starts.tolist(), ends.tolist()):
            run = rows[a:b]
            lo = int(pl.fixed_off[run[0]])
            hi = int(pl.fixed_off[run[-1]] + pl.size[run[-1]])
            at = (at + ALIGN_PAYLOAD - 1) // ALIGN_PAYLOAD * ALIGN_PAYLOAD
            pl.offset[run] = at + pl.fixed_off[run] - lo
            parts.append((at, pl.fixed[lo:hi]))
            at += hi - lo
        return at


def file_of(enc: Encoder, tensors: dict[str, torch.Tensor]) -> bytes:
    """A file image of ``tensors`` coded by ``enc`` (``Encoder.code``), each a top-level entry
    under its name: what the device-to-device benchmarks and the coder's tests read back (no
    torch object tree, no deltas; ``s4weights.save`` writes real checkpoints)."""
    import io

    from s4format import objtree
    from s4format.writer import Writer

    items = [Item.of(t) for t in tensors.values()]
    buf = io.BytesIO()
    with Writer(buf) as w:
        for (name, t), it, c in zip(tensors.items(), items, enc.code(items)):
            w.add_coded(name, it.dtype, tuple(t.shape), c.coded, c.content_hash)
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(tensors)})
    return buf.getvalue()


