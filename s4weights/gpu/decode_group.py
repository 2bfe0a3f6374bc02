"""One staged group decoded on the device into its destination tensors, with one host
synchronisation (two with GDeflate or nvCOMP planes, whose checksums are checked first: nvCOMP
must not see unverified bytes).

Every plane's checksum is made on the device. The rANS streams are checked on the host and
their decode queued at once (``ransdecode``); the host checks the other planes' stored forms
while the device decodes. One merge launch per layout writes the destinations and digests
their full 64 KiB leaves. The checksums, error codes, flags and content hashes then come back
in one copy, and the failure raised is the one the CPU reader would meet first; by then the
destinations may hold bytes decoded from a damaged plane.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs import gdeflate as cpu_gdeflate
from s4format.codecs import rans
from s4format.errors import ChecksumError, CodecError, ContentHashError, FormatError
from s4format.hashing import LEAF_SIZE
from s4weights.gpu import gdeflate, nvans, ransparse, runtime, segdecode
from s4weights.gpu.failures import about, form_failure
from s4weights.gpu.plan import chunk_table
from s4weights.gpu.ransdecode import RansBatch
from s4weights.gpu.staging import SLOT_ALIGN, Staged

MERGE_KERNEL = {layouts.BF16.layout_id: "merge_bf16", layouts.FP16.layout_id: "merge_fp16",
                layouts.FP32.layout_id: "merge_fp32"}


def decode_staged(st: Staged, outs: list[torch.Tensor]) -> None:
    """Check every plane, decode, merge into ``outs``, and check the content hashes. A delta
    tensor comes out as its XOR bytes, unchecked: ``decode.read_tensors`` applies its parent
    and checks it."""
    reader = st.reader
    prof = runtime.Profile("decode")
    prof.mark("staged")  # (profiling only) the H2D that stage() started, if still in flight
    base = st.device.data_ptr()
    # every plane's checksum of its stored bytes, made on the device
    sums = runtime.plane_checksums(base + st.at, [p.stored_len for _k, _j, p in st.planes])
    nsum = len(st.planes)
    # Every checksum is verified before a plane's decoded bytes are used (spec R1 before R2).
    # nvCOMP must not even see unverified bytes: with its planes the checksums come first, in
    # a synchronisation of their own. The other kernels are safe on any bytes, so they decode
    # while the device hashes, and the checksums come back with the decode's flags.
    early = any(p.codec in (codecs.GDEFLATE, codecs.NVCOMP_ANS) for _k, _j, p in st.planes)
    if early:
        bad = _checksum_failure(st, sums[:nsum].cpu().numpy().view(np.uint64))
        if bad is not None:
            raise about(bad[1], reader, st.idx[bad[0]])
    prof.mark("checksums")
    keep: list[object] = []
    ptrs, packed, copies, rb, scratch = _prepare_checked(st, outs, base, keep, sums, early)
    prof.mark("validate")
    if copies:
        keep.append(runtime.copy_ops(*(np.array(c, np.uint64) for c in zip(*copies))))
    prof.mark("rans")
    merged = _Merge(st, outs, ptrs, packed, keep)
    prof.mark("merge")
    parts = [None if early or not nsum else sums[:nsum].view(torch.uint8),
             rb.errs.view(torch.uint8) if rb.errs is not None else None,
             rb.bad.view(torch.uint8) if rb.errs is not None else None,
             *(lerr.view(torch.uint8) for _sel, lerr in merged.errors)]
    if merged.checked:
        parts.append(merged.content_hashes())
    parts = [x for x in parts if x is not None]
    back = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.uint8)  # sync
    found = _failures(st, back, 0 if early else nsum, rb, merged)
    if found:
        k, _rank, exc = min(found, key=lambda f: f[:2])
        raise about(exc, reader, st.idx[k])
    prof.mark("content hash")
    prof.report()
    del keep, scratch


def _checksum_failure(st: Staged, d: np.ndarray) -> tuple[int, Exception] | None:
    """The first plane (in order) whose stored bytes' checksum (the device's, ``d``) misses
    its own: (tensor position, error)."""
    reader = st.reader
    for (k, _j, p), got in zip(st.planes, d.tolist()):
        if got != p.checksum:
            t = reader.tensors[st.idx[k]]
            return k, ChecksumError(
                f"{reader.name}: tensor {t.name!r} plane {p.label}: checksum of the "
                f"{p.stored_len} stored bytes at offset {p.offset} mismatch")
    return None


def _prepare_checked(st: Staged, outs: list[torch.Tensor], base: int, keep: list[object],
                     sums: torch.Tensor, early: bool):
    """:func:`prepare`, where a plane's form or stream header that fails (no merge has run)
    is outranked by a checksum failure of the same tensor or an earlier one."""
    try:
        return prepare(st, outs, base, keep)
    except CodecError as exc:
        if not early:
            bad = _checksum_failure(st, sums[:len(st.planes)].cpu().numpy().view(np.uint64))
            at = getattr(exc, "s4_tensor", None)
            if bad is not None and (at is None or at[0] is not st.reader or at[1] not in st.idx
                                    or bad[0] <= st.idx.index(at[1])):
                raise about(bad[1], st.reader, st.idx[bad[0]]) from None
        raise


class _Merge:
    """The merge launches of a group, one per layout, straight into the destinations: each
    also digests the full 64 KiB leaves it writes, for the content hashes of ``checked``
    tensors (a delta's is checked only after its parent's XOR)."""

    def __init__(self, st: Staged, outs: list[torch.Tensor], ptrs: np.ndarray,
                 packed: np.ndarray, keep: list[object]) -> None:
        reader, nt = st.reader, len(st.idx)
        self.outs = outs
        self.checked = [k for k in range(nt)
                        if not reader.tensors[st.idx[k]].is_delta] if reader.verify_hashes else []
        self.cnb = np.array([outs[k].numel() for k in self.checked], np.int64)
        self.cfirst = np.zeros(self.cnb.size + 1, np.int64)
        np.cumsum((self.cnb + LEAF_SIZE - 1) // LEAF_SIZE, out=self.cfirst[1:])
        # the leaf digests, with a slot before each tensor's for its root
        self.cd = runtime.device_empty(8 * (int(self.cfirst[-1]) + self.cnb.size))
        dfirst = np.full(nt, -1, np.int64)
        dfirst[self.checked] = self.cfirst[:-1] + np.arange(1, self.cnb.size + 1)
        self.merged = np.zeros(nt, bool)
        self.errors: list[tuple[np.ndarray, torch.Tensor]] = []  # (positions, flags) a launch
        for lay_id, kernel_name in MERGE_KERNEL.items():
            sel = [k for k in range(nt) if reader.tensors[st.idx[k]].layout.layout_id == lay_id
                   and outs[k].numel()]
            if not sel:
                continue
            self.merged[sel] = True
            word = 4 if lay_id == layouts.FP32.layout_id else 2
            nel = [outs[k].numel() // word for k in sel]
            cs, c0 = chunk_table(nel)
            dev, dp = runtime.upload(cs, c0, np.array([outs[k].data_ptr() for k in sel],
                                                      np.uint64),
                                     np.asarray(nel, np.int64), ptrs[sel].reshape(-1),
                                     packed[sel].reshape(-1), dfirst[sel])
            keep.append(dev)
            # merge flags go to a per-launch array, mapped back to tensor positions on the
            # host (no index upload from pageable memory: that copy would wait for the kernels)
            lerr = torch.zeros(len(sel), dtype=torch.int32, device="cuda")
            runtime.launch("planes", kernel_name, cs.size, 256, *(np.uint64(x) for x in dp[:6]),
                           runtime.ptr(lerr), runtime.ptr(self.cd), np.uint64(dp[6]))
            self.errors.append((np.asarray(sel, np.int64), lerr))

    def content_hashes(self) -> torch.Tensor:
        """The checked tensors' content hashes, 16 bytes each, on the device."""
        ptrs = [self.outs[k].data_ptr() for k in self.checked]
        return content_roots(ptrs, self.cnb, self.cfirst, self.merged[self.checked],
                             self.cd).view(torch.uint8)[:16 * self.cnb.size]


def _failures(st: Staged, back: np.ndarray, nsum: int, rb: RansBatch, merged: _Merge
              ) -> list[tuple[int, int, Exception]]:
    """Every failure found after decoding, from the bytes that came back (``nsum`` plane
    checksums first, if not checked already), as (tensor position, rank, error): the lowest
    position is raised, and on one tensor a checksum, then a rANS error, its merge flag, its
    content hash, in the order the CPU reader meets them."""
    reader = st.reader
    found: list[tuple[int, int, Exception]] = []
    pos = 8 * nsum  # (an empty plane has a checksum too: the hash of its length alone)
    if nsum and (bad := _checksum_failure(st, back[:pos].view(np.uint64))) is not None:
        found.append((bad[0], -1, bad[1]))
    if rb.errs is not None:
        e = back[pos:pos + 4 * rb.nblocks].view(np.int32)
        pos += 4 * rb.nblocks
        flags = back[pos:pos + 4 * rb.coded.size].view(np.int32)
        pos += 4 * rb.coded.size
        if (err := rb.failure(e, flags)) is not None:
            found.append(err)
    me = np.zeros(len(st.idx), np.int32)
    for sel_a, _lerr in merged.errors:
        me[sel_a] = back[pos:pos + 4 * sel_a.size].view(np.int32)
        pos += 4 * sel_a.size
    wide = np.flatnonzero(me)
    if wide.size:  # (the merge flags the tensor, not the field: read_tensors words it as the
        # CPU reader does, which names the field, by raise_as_cpu)
        k = int(wide[0])
        found.append((k, 1, FormatError(f"{reader.name}: tensor "
                                        f"{reader.tensors[st.idx[k]].name!r}: a plane holds "
                                        "values wider than its field")))
    hashes = back[pos:pos + 16 * merged.cnb.size].tobytes()
    for j, k in enumerate(merged.checked):
        t = reader.tensors[st.idx[k]]
        if hashes[16 * j:16 * (j + 1)] != t.content_hash:
            found.append((k, 2, ContentHashError(
                f"{reader.name}: tensor {t.name!r} content hash mismatch after decoding: the "
                "file is corrupt or its parent is wrong")))  # (the CPU reader's words)
            break
    return found


def content_roots(ptrs, nbytes: np.ndarray, first: np.ndarray, merged: np.ndarray,
                  digests: torch.Tensor) -> torch.Tensor:
    """Queue the content hashes of tensors whose merges digested their full leaves into
    ``digests`` (tensor k, ``nbytes[k]`` bytes at ``ptrs[k]``: its length's slot at
    ``first[k] + k``, its leaves' digests after it, ``first`` the leaf prefix sums): one launch
    digests the leaves a merge did not (every leaf of a tensor not ``merged``, the last partial
    leaf of one merged), one roots them all (XXH3-128). Returns the device hashes, 16 bytes
    each (canonical), without a synchronisation."""
    nbytes = np.asarray(nbytes, np.int64)
    full = np.where(merged, nbytes // LEAF_SIZE, 0)  # the leaves the merge digests
    start = full * LEAF_SIZE
    todo = np.flatnonzero(nbytes > start)
    batch = runtime.Batch()
    runtime.leaf_digests(np.asarray(ptrs, np.uint64)[todo] + start[todo].astype(np.uint64),
                         (nbytes - start)[todo], batch, out=digests,
                         at=(first[:-1] + np.arange(1, nbytes.size + 1) + full)[todo])
    roots = runtime.roots_over(digests, nbytes, first, batch, wide=True)
    batch.run()
    return roots


class _Planes:
    """A staged group's planes as arrays, and where each one's decoded bytes go: a raw-layout
    tensor's straight to its destination, a split tensor's rANS and GDeflate planes to slots
    of a scratch buffer, in plane order, for the merge."""

    def __init__(self, st: Staged, outs: list[torch.Tensor], base: int) -> None:
        reader, nt = st.reader, len(st.idx)
        self.st, self.outs = st, outs
        self.k, self.j, self.codec, self.n, self.stored, _nparams = st.meta.T
        self.whole = np.fromiter((reader.tensors[i].layout.layout_id == layouts.RAW.layout_id
                                  for i in st.idx), bool, nt)[self.k]
        self.dst_t = np.fromiter((o.data_ptr() for o in outs), np.uint64, nt)
        self.at = np.asarray(st.at, np.int64)
        self.base = np.uint64(base)
        self.src = self.base + self.at.astype(np.uint64)
        codec, n, whole = self.codec, self.n, self.whole
        self.rn, self.gd = codec == codecs.RANS, codec == codecs.GDEFLATE
        self.seg = codec == codecs.RANS_SEG
        # rANS streams: RAW-mode ones are used in place (their bytes follow the header)
        self.raw_mode = self.rn & ransparse.raw_mode(st.host, self.at, self.stored)
        # a codec-9 plane of a split tensor is decoded whole into a slot, then merged as bytes
        self.slot = ~whole & ((self.rn & ~self.raw_mode) | self.gd | self.seg)
        sizes = np.where(self.slot, (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN, 0)
        scratch_need = int((np.where(~whole & (self.rn | self.gd | self.seg), (n + SLOT_ALIGN - 1)
                                     // SLOT_ALIGN * SLOT_ALIGN, 0)).sum())
        self.scratch = runtime.device_empty(scratch_need)
        self.slot_at = np.uint64(self.scratch.data_ptr()) + (np.cumsum(sizes) - sizes).astype(
            np.uint64)

    def where(self, q: int) -> str:
        reader = self.st.reader
        return (f"{reader.name}: tensor {reader.tensors[self.st.idx[self.k[q]]].name!r} plane "
                f"{self.st.planes[q][2].label}")

    def plane_dst(self, q: np.ndarray) -> np.ndarray:
        """Where planes ``q`` decode to: a raw-layout tensor's destination, else its slot."""
        return np.where(self.whole[q], self.dst_t[self.k[q]], self.slot_at[q])

    def rans_rows(self, keep: list[object]):
        """The group's rANS streams as the batch's rows, in plane order: every rANS plane's,
        and the rANS segments of codec-9 planes, each decoding into its range of the plane.
        A segment's stream starts anywhere in its plane's bytes, and the decoder reads its
        states as 4-byte words: a segment's stream not on a 16-byte boundary is copied to
        one first (the copies queued here). Returns (rows' planes, their stored offsets,
        stored and symbol counts, sources, destinations, tensor positions, names of the
        segments' rows)."""
        rq = np.flatnonzero(self.rn)
        sg = segdecode.of(self.st)
        r = sg.rows(codecs.RANS)
        raw = sg.raw[r]
        src = self.base + sg.at[r].astype(np.uint64)
        move = np.flatnonzero((src % np.uint64(SLOT_ALIGN) != 0) & ~raw)  # (RAW ones: copied)
        if move.size:
            size = (sg.stored[r][move] + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
            moved = runtime.device_empty(int(size.sum()))
            keep.append(moved)
            to = np.uint64(moved.data_ptr()) + (np.cumsum(size) - size).astype(np.uint64)
            keep.append(runtime.copy_ops(src[move], to, sg.stored[r][move]))
            src[move] = to
        q = np.concatenate([rq, sg.q[r]])
        at = np.concatenate([self.at[rq], sg.at[r]])
        dst = np.concatenate([self.plane_dst(rq), self.plane_dst(sg.q[r])
                              + sg.lo[r].astype(np.uint64)])
        order = np.argsort(q, kind="stable")  # (a plane's segments stay in order)
        names = [None] * rq.size + [sg.label(x) for x in r.tolist()]
        return (q[order], at[order], np.concatenate([self.stored[rq], sg.stored[r]])[order],
                np.concatenate([self.n[rq], sg.n[r]])[order],
                np.concatenate([self.src[rq], src])[order],
                dst[order], self.k[q[order]], [names[x] for x in order.tolist()])

    def segment_ops(self) -> tuple[list, tuple | None]:
        """Codec-9 planes' other segments: copies of raw ones and of RAW-mode rANS streams'
        bytes (src, dst, n), and bitpack and bitpack-w ones unpacked to a byte per symbol
        (pack ops' columns: src, dst, n, source width; None when there are none). Only for
        a group whose forms and stream headers passed."""
        sg = segdecode.of(self.st)
        dst = self.plane_dst(sg.q) + sg.lo.astype(np.uint64)
        src = self.base + sg.at.astype(np.uint64)
        rc = np.concatenate([sg.rows(codecs.RAW), np.flatnonzero(sg.raw)])
        hdr = np.where(sg.codec[rc] == codecs.RANS, rans.HEADER_SIZE, 0).astype(np.uint64)
        copies = list(zip((src[rc] + hdr).tolist(), dst[rc].tolist(), sg.n[rc].tolist()))
        pk = np.flatnonzero((sg.codec == codecs.BITPACK) | (sg.codec == codecs.BITPACK_W))
        if not pk.size:
            return copies, None
        width = np.where(sg.codec[pk] == codecs.BITPACK, 1, sg.width[pk])
        return copies, (src[pk], dst[pk], sg.n[pk], width)

    def fail(self, q: int, msg: str) -> CodecError:
        return about(CodecError(f"{self.where(q)}: {msg}"), self.st.reader,
                     self.st.idx[self.k[q]])

    def nvcomp_upto(self, limit: int) -> None:
        """nvCOMP's planes, one by one and in order, up to plane ``limit`` (not included)."""
        st, codec, whole, k = self.st, self.codec, self.whole, self.k
        for q in np.flatnonzero((self.gd & ~whole) | (codec == codecs.NVCOMP_ANS) & whole
                                ).tolist():
            if q >= limit:
                break
            a, p = int(self.at[q]), st.planes[q][2]
            try:
                if codec[q] == codecs.NVCOMP_ANS:
                    nvans.decode_into(st.device[a:a + p.stored_len], p.decoded_len, p.params,
                                      self.outs[k[q]], self.where(q))
                else:
                    entries, offsets = cpu_gdeflate.parse_page_table(
                        st.host[a:a + p.stored_len], p.decoded_len)
                    gdeflate.decompress(st.device[a:], entries, offsets, int(self.slot_at[q]),
                                        p.decoded_len)
            except CodecError as exc:  # named by its plane, like every other failure
                named = exc if str(exc).startswith(self.where(q)) \
                    else CodecError(f"{self.where(q)}: {exc}")
                raise about(named, st.reader, st.idx[k[q]]) from None

    def merge_inputs(self, width: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """The merge's input planes of split tensors (the plane's bytes in place, its RAW-mode
        stream's bytes, or its decoded slot) and their stored forms (the sign plane packed bits
        only when bitpacked, another plane bitpack-w's values of ``width``), and the copies of
        raw-layout tensors' raw planes and RAW-mode streams into place."""
        k, j, codec, whole, src = self.k, self.j, self.codec, self.whole, self.src
        nt = len(self.st.idx)
        split = ~whole
        bp = codec == codecs.BITPACK
        inp = np.where(self.raw_mode, src + np.uint64(rans.HEADER_SIZE),
                       np.where(self.slot, self.slot_at, src))
        ptrs = np.zeros((nt, 5), np.uint64)
        ptrs[k[split], j[split]] = inp[split]
        packed = np.zeros((nt, 5), np.uint8)
        packed[k[split], j[split]] = np.where(bp, 1, width)[split]
        cp = whole & ((codec == codecs.RAW) | self.raw_mode)
        copies = list(zip(np.where(self.raw_mode[cp], src[cp] + np.uint64(rans.HEADER_SIZE),
                                   src[cp]).tolist(), self.dst_t[k[cp]].tolist(),
                          self.n[cp].tolist()))
        return ptrs, packed, copies


def prepare(st: Staged, outs: list[torch.Tensor], base: int, keep: list[object]):
    """Host side of a group's decode up to the merge: check the rANS streams and queue their
    decode first (the device decodes while the host does the rest), then check every plane's
    stored form, run nvCOMP's planes, and plan the copies and the merge inputs. Of the failures
    the host finds, the one raised is the first plane's in order, whichever check found it.
    Returns (merge plane pointers [tensors, 5], their stored forms [tensors, 5]: the merge
    kernels' ``width``, copies, the rANS batch with its decode queued, scratch)."""
    reader = st.reader
    pl = _Planes(st, outs, base)
    k = pl.k
    # the rANS streams first: the kernels are safe on any bytes once the host has checked the
    # headers and tables (the device checks every block's words), whatever the other planes
    rb = RansBatch(st.host, pl.where)
    rq, *rows, names = pl.rans_rows(keep)
    rb.add_many(rq, *rows, names=names)
    try:
        rb.prepare(keep)
    except CodecError as exc:  # a stream's header or table (row ``failed`` of the batch)
        q = int(rq[rb.failed])
        first_bad, msg, _width = form_failure(st, pl.whole)
        pl.nvcomp_upto(min(first_bad, q))
        if first_bad <= q:  # (on the same plane the CPU reader checks the form first)
            raise pl.fail(first_bad, msg) from None
        raise about(exc, reader, st.idx[k[q]]) from None
    rb.launch()
    keep.append(pl.scratch)
    first_bad, msg, width = form_failure(st, pl.whole)
    pl.nvcomp_upto(first_bad)
    if first_bad < len(st.planes):
        raise pl.fail(first_bad, msg)
    ptrs, packed, copies = pl.merge_inputs(width)
    more, unpack = pl.segment_ops()
    if unpack is not None:  # (to a byte each: pack ops of width 8 from the stored width)
        src, dst, n, sw = unpack
        keep.append(runtime.pack_ops(src, dst, n, np.full(n.size, 8), sw))
    return ptrs, packed, copies + more, rb, pl.scratch
