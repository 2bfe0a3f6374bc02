"""One group's payloads laid out in one compacted device buffer, once their codecs are chosen.

Copy ops are built with numpy over all planes at once and run in one copy launch: the host bytes
of every payload, frequency tables the device made, raw and bitpacked planes, the rANS planes'
word counts and final states, and the raw bytes of the items the CPU codes. One more launch
places every rANS block's words, two more hash the payloads. Planes the split already stored as
they are kept stay where it wrote them: runs of them are further parts of the group's payload
image, after the buffer's bytes.
"""

from __future__ import annotations

import numpy as np

from s4format.codecs import rans
from s4weights.gpu import gdeflate, ransencode, runtime
from s4weights.gpu.items import Item
from s4weights.gpu.planes import (
    ALIGN_PAYLOAD,
    FORM_BITPACK,
    FORM_BITPACK_W,
    FORM_GDEFLATE,
    FORM_RANS,
    FORM_RAW,
    Planes,
)


def assemble(items: list[Item], pl: Planes, cpu: list[int], r: dict | None,
             gd: gdeflate.Compressed | None):
    """Lay the payloads of ``pl`` (16-byte aligned) and the raw bytes of the items ``cpu`` out
    in one device buffer and queue the copies, the placement of the rANS words (``r``) and the
    payloads' checksums. Returns (buffer, bytes of the image, the buffer's bytes in it or -1
    for all, the other parts as (image offset, device bytes), the live rows, where each
    CPU-coded item's bytes are, the launches' tables to keep, the device checksum of each live
    row's payload)."""
    live = np.flatnonzero(~np.isin(pl.item, cpu)) if cpu else np.arange(len(pl))
    form, pw = pl.form[live], pl.pw[live]
    # the plane's bytes as the split stored them: raw bytes, sign bits for bitpack, a plane
    # packed at the width bitpack-w stores; those in ``pl.fixed`` are not moved
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
        head, total = total, _parts(pl, live[kept], total, parts)
    # every live payload's device address: where placed ones go, where kept ones are
    at = np.where(kept, pl.ptr[live], base + pl.offset[live].astype(np.uint64))
    keep: list[object] = []
    src, dst, ln = _plain_ops(pl, live, at, plain & placed, keep)
    # bitpack-w from bytes, or from a packed plane at another width; raw bytes from a packed
    # plane (width 8)
    packed = (((form == FORM_BITPACK_W) | (form == FORM_RAW)) & ~plain)
    pack = None
    if packed.any():
        pack = (pl.ptr[live][packed], at[packed], pl.n[live][packed],
                np.where(form[packed] == FORM_RAW, 8, pl.width[live][packed]), pw[packed])
    words = _rans_ops(pl, live, at, form == FORM_RANS, r, (src, dst, ln))
    _gdeflate_ops(pl, live, at, form, gd, (src, dst, ln))
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


def _plain_ops(pl: Planes, live: np.ndarray, at: np.ndarray, copied: np.ndarray,
               keep: list) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Copy ops (sources, destinations, lengths) of the planes ``copied`` as the split stored
    them, of the payloads' host bytes (uploaded once, the upload added to ``keep``) and of the
    frequency tables the device made, behind their stream's header."""
    src = [pl.ptr[live][copied]]
    dst = [at[copied]]
    ln = [pl.size[live][copied].astype(np.uint64)]
    headed = pl.head[live] > 0
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
    return src, dst, ln


def _rans_ops(pl: Planes, live: np.ndarray, at: np.ndarray, rans_rows: np.ndarray,
              r: dict | None, ops: tuple[list, list, list]) -> np.ndarray | None:
    """Copy ops of the RANS-mode streams' word counts and final states, added to ``ops``;
    returns where each rANS job's words go (0: not a RANS-mode stream), or None for none."""
    if not rans_rows.any():
        return None
    job = np.cumsum(pl.launched) - 1
    rows = live[rans_rows]
    starts = at[rans_rows] + (pl.head[rows] + pl.dtab[rows]).astype(np.uint64)
    for lst, new in zip(ops, ransencode.rans_runs(r, job[rows], starts, words=False)):
        lst += new
    first = r["bt"].first
    words = np.zeros(first.size - 1, np.uint64)
    words[job[rows]] = starts + (rans.BLOCK_OVERHEAD * np.diff(first)[job[rows]]
                                 ).astype(np.uint64)
    return words


def _gdeflate_ops(pl: Planes, live: np.ndarray, at: np.ndarray, form: np.ndarray,
                  gd: gdeflate.Compressed | None, ops: tuple[list, list, list]) -> None:
    """Copy ops of the GDeflate payloads' pages, added to ``ops`` (rare: a step per plane)."""
    src, dst, ln = ops
    for q in np.flatnonzero(form == FORM_GDEFLATE).tolist():
        row = int(live[q])
        _head, pieces = gd.pieces(int(pl.gd_job[row]), int(pl.ptr[row]))
        pa = np.array([a for a, _ in pieces], np.uint64)
        pn = np.array([c for _, c in pieces], np.uint64)
        src.append(pa)
        dst.append(at[q] + np.uint64(pl.head[row]) + np.cumsum(pn) - pn)
        ln.append(pn)


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
