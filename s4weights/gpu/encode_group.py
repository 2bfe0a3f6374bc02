"""One group of tensors coded on the device, with one table upload and one synchronisation.

The split writes the group's planes (one launch per layout), one launch encodes every rANS
block, nvCOMP compresses GDeflate pages where asked for. The host reads the blocks' word
counts, chooses each plane's codec (``choose``) and lays the payloads out (``assemble``) while
the device hashes the tensors. The result is a :class:`DeviceGroup`: the payloads on the device,
with their hashes on their way to pinned host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from s4format import layouts
from s4format.writer import CodedPlane, CodedTensor, code_tensor
from s4weights.gpu import gdeflate, histograms, plan, ransencode, runtime
from s4weights.gpu.assemble import assemble
from s4weights.gpu.choose import choose
from s4weights.gpu.items import Coded, Item
from s4weights.gpu.planes import (
    SPLIT_KERNEL,
    Planes,
    kept_as_split,
    launch_split,
    pack_widths,
    params_of,
    place_split,
)


@dataclass
class DeviceGroup:
    """One group's result: the compacted payloads on the device and what a writer needs
    (codecs, sizes, offsets, and once :meth:`finish` has run, plane checksums and content
    hashes). The payloads are one image of ``total`` bytes: ``buffer``'s first ``head`` bytes,
    then the ``parts`` (image offset, device bytes), runs of planes left where the split wrote
    them (``fixed`` keeps their buffer). Offsets (``planes.offset``, ``cpu``) are in the image;
    ``cpu[k]`` is where item k's raw bytes are, for the CPU coder."""
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

    def _root_content(self) -> None:
        """The group's content hashes, once the device's have reached the host."""
        host, hashed = self.digests[:2]
        hashed.synchronize()
        b = host.numpy()[:16 * len(self.items)].tobytes()
        self.content = [b[16 * k:16 * (k + 1)] for k in range(len(self.items))]

    def finish(self) -> None:
        """Read the group's content hashes (unless done) and plane checksums, once they have
        reached the host (a wait only if the device is still at them)."""
        if self.digests is None:
            return
        if not self.content:
            self._root_content()
        host, arrived = self.digests[2:]
        arrived.synchronize()
        self.planes.checksum[self.live] = host.numpy()[:8 * self.live.size].view(np.uint64)
        self.digests = None

    def start_copy(self, cs: torch.cuda.Stream) -> None:
        """Start the group's D2H into pinned memory on the side stream ``cs``."""
        main = torch.cuda.current_stream()
        self.host = runtime.pinned(runtime.align(self.total, 1 << 20))
        ready = torch.cuda.Event()
        ready.record(main)
        cs.wait_event(ready)
        with torch.cuda.stream(cs):
            end = self.total if self.head < 0 else self.head
            if end:
                self.host[:end].copy_(self.buffer[:end], non_blocking=True)
            for at, part in self.parts:
                self.host[at:at + part.numel()].copy_(part, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(cs)

    def results(self, policy: str) -> list[Coded]:
        """Every item coded, its payloads views of the pinned copy, once it has arrived (the
        items the CPU codes, under ``policy``)."""
        self.finish()
        self.done.synchronize()
        host = self.host.numpy()
        self.buffer = self.fixed = None  # the copy has run: the device buffers can go
        self.parts = []
        pl = self.planes
        # rows are in item order: item k's planes are rows first[k] .. first[k + 1] - 1
        first = np.searchsorted(pl.item, np.arange(len(self.items) + 1)).tolist()
        kind, index, codec, n = (a.tolist() for a in (pl.kind, pl.index, pl.codec, pl.n))
        off, size, check = pl.offset.tolist(), pl.size.tolist(), pl.checksum.tolist()
        out = []
        for k, it in enumerate(self.items):
            if k in self.cpu:
                raw = host[self.cpu[k]:self.cpu[k] + it.nbytes]
                out.append(Coded(code_tensor(raw, it.dtype, policy), self.content[k]))
                continue
            coded = tuple(CodedPlane(kind[q], index[q], codec[q], n[q],
                                     host[off[q]:off[q] + size[q]], params_of(pl, q), check[q])
                          for q in range(first[k], first[k + 1]))
            out.append(Coded(CodedTensor(it.layout, coded), self.content[k]))
        return out


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
class Prepared:
    """A group's launch tables that need no device address (:func:`prepare`)."""
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


def prepare(enc, items: list[Item], pl: Planes) -> Prepared:
    """The group's launch tables that need no device address, made while the group before is
    on the device: where each split plane goes, the split launches' chunk tables, the rANS
    launch's CTA table."""
    rows = np.flatnonzero(pl.kind != layouts.KIND_RAW)
    n = pl.n[rows]
    width = pack_widths(pl)
    infix = kept_as_split(pl, width, enc.keep_raw)[rows]
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
    return Prepared(pl, rows, width[rows], off, total, infix, ftotal, launches,
                    ransencode.rans_plan(pl.n[jobs], enc.log2_block,
                                         None if pl.words is None else pl.words[jobs])
                    if jobs.size else None)


def _split(pl: Planes, prep: Prepared, batch: runtime.Batch) -> torch.Tensor:
    """The group's planes in one device buffer, one split launch per layout (in ``batch``): no
    histograms, the window has them. Sets the device address and stored width of every split
    row of ``pl``."""
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


def _encode(enc, pl: Planes, batch: runtime.Batch, meanwhile=None, planned: dict | None = None,
            after=None):
    """Queue the rANS launch behind the split in ``batch``, run it, start GDeflate where asked
    for, and read the blocks' word counts back. ``meanwhile()`` runs on the host while the
    device works; ``planned``: the jobs' ``rans_plan`` if made already; ``after(batch)``
    queues launches behind the counts' copy, their tables in the same upload."""
    gd_rows = np.flatnonzero(pl.cand_gd)
    launched, pl.rans_queued = pl.rans_queued, None
    if launched is None:
        jobs = np.flatnonzero(pl.runs_rans)
        launched = ransencode.rans_launch(
            pl.pw[jobs], pl.n[jobs], pl.ptr[jobs],
            None if pl.freqs is None else pl.freqs[jobs],
            None if pl.tab is None else pl.tab[jobs], batch, enc.log2_block,
            planned) if jobs.size else None
    stop = batch.mark()
    if after is not None:
        after(batch)
    tables = batch.run(stop)
    gd = gdeflate.Compressed(pl.ptr[gd_rows].tolist(), pl.n[gd_rows].tolist(),
                             enc.gd_algorithm) if gd_rows.size else None
    r = (ransencode.rans_collect(launched, meanwhile, batch) if launched is not None
         else None)
    if r is None:
        batch.run()
        if meanwhile is not None:
            meanwhile()
    del tables
    return r, gd


def _cpu_items(items: list[Item], pl: Planes) -> list[int]:
    """The items the CPU codes: those the GPU does not split, and those whose planes would
    store more than their raw bytes."""
    cpu = {k for k, it in enumerate(items) if it.layout is None}
    stored = np.bincount(pl.item, weights=pl.size, minlength=len(items))
    nbytes = np.array([it.nbytes for it in items], np.int64)
    cpu |= set(np.flatnonzero(stored > nbytes).tolist())
    return sorted(cpu)


def encode(enc, items: list[Item], pl: Planes | None, previous: DeviceGroup | None = None,
           prep: Prepared | None = None, ahead=None, fits: bool = False) -> DeviceGroup:
    """Code one group on the device for encoder ``enc``: its plane table from the encoder's
    plan, or None (split and histograms here, one more synchronisation). While its kernels
    run, the host finishes ``previous`` and runs ``ahead()`` (the next group's
    :func:`prepare`); ``prep``: this group's, if made that way. ``fits``: every plane's rANS
    scratch fits the workspace, so a group split here may queue its rANS launch early."""
    prof = runtime.Profile("encode")
    batch = runtime.Batch()  # split, rANS: their tables in one upload
    planned = None
    if pl is None:  # a group that needs no sizing: split and histograms in one pass
        pl, pl.tables, planes_buf = histograms.window_planes(
            enc, items, batch, split=True, queue_rans=fits)  # sync
        batch = runtime.Batch()
    else:
        if prep is None or prep.planes is not pl:
            prep = prepare(enc, items, pl)
        planes_buf = _split(pl, prep, batch)
        planned = prep.rans

    content: list = []
    roots: list[torch.Tensor] = []

    def after(b: runtime.Batch) -> None:
        # the content hashes, behind the rANS encoder and its word counts' copy: the device
        # hashes while the host chooses codecs and lays out the payload
        roots.append(runtime.content_hashes([i.data.data_ptr() for i in items],
                                            [i.nbytes for i in items], b))

    def meanwhile() -> None:
        content.extend(_to_pinned(roots[0], 2 * len(items)))  # (no synchronisation)
        if previous is not None:
            previous.finish()
        if ahead is not None:
            ahead()

    r, gd = _encode(enc, pl, batch, meanwhile, planned, after)  # sync: the word counts
    prof.mark("split+encode")
    choose(pl, r, gd, enc.log2_block)
    cpu = _cpu_items(items, pl)
    prof.mark("choose")
    buf, total, head, parts, live, cpu_at, keep, sums = assemble(items, pl, cpu, r, gd)
    fixed, pl.fixed = (pl.fixed if parts else None), None
    # the window's table inputs are no longer this group's once its copy is queued
    pl.tables = None
    prof.mark("assemble")
    # the payload digests go to the host without a synchronisation too: ``finish`` roots them
    host, arrived = _to_pinned(sums, live.size)
    prof.mark("payload hash")
    prof.report()
    del planes_buf, r, gd, keep
    g = DeviceGroup(items, buf, total, pl, live, cpu_at, [], head=head, parts=parts,
                    fixed=fixed)
    g.digests = (*content, host, arrived)
    if content[1].query():  # the input's hashes are there (hashed during the layout)
        g._root_content()
    return g
