"""A window's histogram pass: the plane table of consecutive tensors with every plane's candidate
codecs, from one pass over their bytes on the device and one synchronisation.

One launch per layout histograms the tensors (and splits them, for a group that needs no
sizing); one launch normalises every plane's histogram into rANS frequencies, which stay on the
device as the encoder's table input. Only 41 bytes per plane come to the host. A pass that also
splits may queue the rANS launch before that synchronisation: ``rans_jobs`` picks on the device
the planes the host's rule will pick, and the host checks that both agree.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from s4format import layouts, policy
from s4weights.gpu import plan, ransencode, ranshost, runtime
from s4weights.gpu.choose import candidate_kinds
from s4weights.gpu.items import Item
from s4weights.gpu.planes import (
    SPLIT_KERNEL,
    Planes,
    field_rows,
    launch_split,
    narrow_fields,
    place_split,
)

log = logging.getLogger(__name__)


class _Rows:
    """The split rows of a window's tensors (a row per field, tensor by tensor) and its
    raw-layout items (a row each, their bytes in place); items the CPU codes have none."""

    def __init__(self, items: list[Item], pack: bool) -> None:
        self.split_k, self.raws, lays = [], [], []
        for k, it in enumerate(items):
            if it.layout is layouts.RAW:
                self.raws.append(k)
            elif it.layout is not None:
                self.split_k.append(k)
                lays.append(it.layout)
        (self.lay_ids, self.nf, self.seg, self.field, self.bits, self.kind, self.index,
         word) = field_rows(lays)
        self.n_el = np.array([items[k].nbytes for k in self.split_k], np.int64) // word
        self.n = self.n_el[self.seg]
        self.pack = pack
        # how the split stores each row: sign bits packed, narrow mantissa planes packed when
        # ``pack``, bytes otherwise (a histogram-only pass stores nothing: each group's split
        # decides, ``pack_widths``)
        self.pw = np.where(self.field == 0, 1,
                           np.where(pack & narrow_fields(self.kind, self.bits), self.bits, 8))
        self.infix = (self.field > 0) & (self.pw < 8)  # the packed narrow planes


def window_planes(enc, items: list[Item], batch: runtime.Batch | None = None,
                  split: bool = False, queue_rans: bool = False
                  ) -> tuple[Planes, tuple, torch.Tensor | None]:
    """The plane table of ``items`` for encoder ``enc``, with every plane's candidates, rows
    in item order. ``batch``: launches to run with this pass's. ``split``: the pass splits the
    tensors too, into the returned buffer, and the rows hold their addresses; else split rows
    have none yet, as each group splits its own. ``queue_rans`` (with ``split`` and
    ``enc.early_rans``; only where the workspace holds rANS scratch for every plane): the rANS
    launch is queued before the synchronisation, and the table holds it
    (``Planes.rans_queued``) where the host's rule agrees. Returns the table, the device
    tables to keep until the group's copy, and the planes' buffer (or None)."""
    rows = _Rows(items, split and enc.packs)
    buf = fixed = off = None
    rows_at = np.zeros(rows.n.size, np.uint64)
    if split:
        buf, fixed, rows_at, off = _split_buffers(rows)
    batch = runtime.Batch() if batch is None else batch
    hist, hpos = _queue_histograms(items, rows, rows_at if split else None, batch)
    ps = rows.n.size
    fc, meta, host, stats_p = _queue_normalise(rows, hist, hpos, batch, enc.log2_block)
    split_tab = np.uint64(fc.data_ptr()) + np.arange(ps, dtype=np.uint64) * np.uint64(2048)
    early = split and ps and queue_rans and enc.early_rans
    run_p = _queue_rans_jobs(enc, rows, stats_p, batch) if early else 0
    tables = batch.run()
    if ps:
        host.copy_(meta[plan.TABLE_STRIDE * ps:], non_blocking=True)
    queued = None
    if early:
        figures = torch.cuda.Event()
        figures.record()
        rb = runtime.Batch()
        queued = ransencode.rans_launch(rows.pw, rows.n, rows_at, None, split_tab, rb,
                                        enc.log2_block, run=run_p)
        queued["keep"][0].append(rb.run())

    def wait() -> None:
        if queued is not None:
            figures.synchronize()  # the group's one synchronisation before its rANS counts
        elif ps:
            torch.cuda.current_stream().synchronize()  # the window's one synchronisation

    pl, split_rows = _table(items, rows, rows_at, off, host, meta, split_tab, wait)
    pl.fixed = fixed
    enc.candidates(pl)
    if queued is not None:
        _adopt_early(enc, pl, queued, host.numpy()[40 * ps:41 * ps].astype(bool), split_rows)
    return pl, (fc, meta, tables), buf


def _split_buffers(rows: _Rows) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray,
                                         np.ndarray]:
    """The buffers a splitting pass writes the planes to, split rows in order, the packed ones
    in a buffer of their own: (planes buffer, packed buffer or None, each row's address, each
    row's offset in its buffer)."""
    off, total, ftotal = place_split(rows.n, rows.pw, rows.infix)
    buf = runtime.device_empty(total)
    fixed = runtime.device_empty(ftotal) if ftotal else None
    rows_at = np.uint64(buf.data_ptr()) + off.astype(np.uint64)
    if fixed is not None:
        rows_at[rows.infix] = np.uint64(fixed.data_ptr()) + off[rows.infix].astype(np.uint64)
    return buf, fixed, rows_at, off


def _queue_histograms(items: list[Item], rows: _Rows, rows_at: np.ndarray | None,
                      batch: runtime.Batch) -> tuple[torch.Tensor, np.ndarray]:
    """One histogram launch per layout (splitting too where ``rows_at`` gives the planes'
    addresses): (the histograms, 1025 u64 per tensor then its set sign bits, and each tensor's
    histogram position, by layout)."""
    nseg = len(rows.split_k)
    hist = torch.zeros(nseg * 1025 + 1, dtype=torch.int64, device="cuda")
    hp = hist.data_ptr()
    hpos = np.zeros(nseg, np.int64)
    first_row = np.cumsum(rows.nf) - rows.nf
    at = 0
    for lay_id in SPLIT_KERNEL:
        sel = np.flatnonzero(rows.lay_ids == lay_id)
        if not sel.size:
            continue
        hpos[sel] = np.arange(at, at + sel.size)
        addrs = rows_at[first_row[sel][:, None] + np.arange(int(rows.nf[sel[0]]))] \
            if rows_at is not None else None
        launch_split(lay_id, [items[rows.split_k[j]].data.data_ptr() for j in sel.tolist()],
                     rows.n_el[sel], addrs, hp + 8 * 1024 * at, hp + 8 * (1024 * nseg + at),
                     batch, "split_hist" if rows_at is not None else "hist",
                     pack=np.full(sel.size, rows.pack, np.uint8))
        at += sel.size
    return hist, hpos


def _queue_normalise(rows: _Rows, hist: torch.Tensor, hpos: np.ndarray, batch: runtime.Batch,
                     log2_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The launch that normalises every split plane's histogram on the device
    (``rans_normalise``), keeping the frequencies there as the encoder's table input, with the
    frequency tables' bytes. Returns (table inputs, 2 KiB a plane; then per plane its table
    bytes, then its figures (32 bytes), the bound on its words (8) and ``rans_jobs``' pick (1);
    the pinned buffer the figures come back to; the figures' device address)."""
    ps, nseg = rows.n.size, len(rows.split_k)
    hp = hist.data_ptr()
    bins = np.where(rows.field > 0,
                    np.uint64(hp) + (8 * (hpos[rows.seg] * 1024 + (rows.field - 1) * 256)
                                     ).astype(np.uint64), np.uint64(0))
    fc = runtime.device_empty(2048 * ps)
    meta = runtime.device_empty((plan.TABLE_STRIDE + 41) * ps)
    host = runtime.pinned(41 * ps)
    stats_p = meta.data_ptr() + plan.TABLE_STRIDE * ps
    batch.launch("rans", "rans_normalise", ps, 256, *batch.table(
        bins, np.uint64(hp) + (8 * (1024 * nseg + hpos[rows.seg])).astype(np.uint64), rows.n),
        runtime.constant("symbol_bits", ranshost.SYMBOL_BITS), runtime.ptr(fc),
        np.uint64(stats_p), runtime.ptr(meta), np.int32(log2_block),
        runtime.constant("word_cost", ranshost.WORD_COST), np.uint64(stats_p + 32 * ps))
    return fc, meta, host, stats_p


def _queue_rans_jobs(enc, rows: _Rows, stats_p: int, batch: runtime.Batch) -> int:
    """The launch that picks on the device the planes ``choose.candidates`` will pick on the
    host, so the rANS launch can be queued before the host reads the figures; returns the
    device address of its picks, a byte per plane."""
    ps = rows.n.size
    want, bp_ok, bw_ok = candidate_kinds(rows.n, rows.kind, enc.policy, enc.mantissa)
    rule = (want | bp_ok << 1 | bw_ok << 2).astype(np.uint8)
    run_p = stats_p + 40 * ps
    batch.launch("rans", "rans_jobs", -(-ps // 256), 256, np.uint64(stats_p),
                 *batch.table(rows.n, rule), np.int32(ps), np.int32(policy.PACKED_SLACK[0]),
                 np.int32(policy.PACKED_SLACK[1]), np.uint64(run_p))
    return run_p


def _table(items: list[Item], rows: _Rows, rows_at: np.ndarray, off: np.ndarray | None,
           host: torch.Tensor, meta: torch.Tensor, split_tab: np.ndarray, wait
           ) -> tuple[Planes, np.ndarray]:
    """The plane table, split rows and raw-layout rows put in item order while the device
    works, then (after ``wait()``) the device's figures. Returns it and the split rows'
    positions in it."""
    ps, raws = rows.n.size, rows.raws
    item = np.concatenate((np.asarray(rows.split_k, np.int64)[rows.seg], raws)).astype(np.int64)
    kind = np.concatenate((rows.kind, np.full(len(raws), layouts.KIND_RAW, np.int64)))
    bits = np.concatenate((rows.bits, np.full(len(raws), 8, np.int64)))
    pw = np.concatenate((rows.pw, np.full(len(raws), 8, np.int64)))
    fixed_off = np.concatenate((np.where(rows.infix, off, -1) if off is not None
                                else np.full(ps, -1), np.full(len(raws), -1))).astype(np.int64)
    index = np.concatenate((rows.index, np.zeros(len(raws), np.int64)))
    nrow = np.concatenate((rows.n, [items[k].nbytes for k in raws])).astype(np.int64)
    ptr = np.concatenate((rows_at, np.array([items[k].data.data_ptr() for k in raws],
                                            np.uint64)))
    split_tdev = np.uint64(meta.data_ptr()) + np.arange(ps, dtype=np.uint64) * np.uint64(
        plan.TABLE_STRIDE)
    order = np.argsort(item, kind="stable") if raws else None
    split_rows = np.arange(ps)
    if raws:
        at_row = np.empty(order.size, np.int64)   # split row i goes to row at_row[i]
        at_row[order] = np.arange(order.size)
        split_rows = at_row[:ps]
    wait()
    split_stats = host.numpy()[:32 * ps].view(np.int64).reshape(ps, 4)
    split_words = ranshost.word_bound(host.numpy()[32 * ps:40 * ps].view(np.int64))
    if raws:
        stats = np.zeros((order.size, 4), np.int64)
        stats[split_rows] = split_stats
        words = np.zeros(order.size, np.int64)
        words[split_rows] = split_words
        tab = np.zeros(order.size, np.uint64)
        tab[split_rows] = split_tab
        tdev = np.zeros(order.size, np.uint64)
        tdev[split_rows] = split_tdev
        item, nrow, ptr = item[order], nrow[order], ptr[order]
        kind, index = kind[order], index[order]
        bits, pw, fixed_off = bits[order], pw[order], fixed_off[order]
    else:  # split rows only: already in item order
        stats, tab, tdev, words = split_stats.copy(), split_tab, split_tdev, split_words
    pl = Planes(item, kind, index, nrow, ptr, None, stats, tdev, bits, pw)
    pl.words = words
    pl.fixed_off = fixed_off
    pl.tab = tab
    return pl, split_rows


def _adopt_early(enc, pl: Planes, queued: dict, picked: np.ndarray,
                 split_rows: np.ndarray) -> None:
    """Keep the rANS launch queued before the figures where ``rans_jobs`` picked the rows the
    host's rule picks; else (a bug) the host's rule codes again, with a warning."""
    if np.array_equal(picked, pl.runs_rans[split_rows]):  # (other rows never run rANS)
        pl.launched = np.zeros(len(pl), bool)
        pl.launched[split_rows] = True
        pl.rans_queued = queued
        return
    enc.mispredicted += 1
    log.warning("rans_jobs picked other planes than the host's rule: %s against %s; coding "
                "the host's", picked.tolist(), pl.runs_rans[split_rows].tolist())
