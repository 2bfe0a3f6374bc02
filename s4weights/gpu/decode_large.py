"""A tensor whose one-batch decode would hold more than the workspace, decoded on the GPU in
chunks straight into its destination. Every plane of every level of its delta chain is checked
on the host first (``decode_chunks``); each chunk is decoded from the deepest level up, each
delta XORed in; the content hashes are checked at the end, and failures are raised as the CPU
reader meets them.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs
from s4format.codecs import rans
from s4format.errors import (
    CodecError,
    ContentHashError,
    FormatError,
    ParentMismatchError,
    S4Error,
)
from s4format.hashing import LEAF_SIZE
from s4weights.gpu import decode, failures, runtime
from s4weights.gpu.decode_chunks import Level, Run
from s4weights.gpu.hash import content_hashes_from_leaves

_LOAD_CODECS = (codecs.RAW, codecs.BITPACK, codecs.RANS, codecs.BITPACK_W, codecs.RANS_SEG)
TABLE_SHARE = 16  # a window of chunks' launch tables holds at most 1/16 of the workspace


def chunkable(reader, i: int) -> bool:
    """Whether tensor i decodes on the GPU in chunks (:func:`load_large`): the GPU decodes it,
    its planes are raw, bitpack, bitpack-w, rANS or codec 9 (GDeflate and nvCOMP streams
    decode whole), and for a delta so is its parent's tensor, down the chain."""
    t = reader.tensors[i]
    if not decode.decodable(reader, i) or any(p.codec not in _LOAD_CODECS for p in t.planes):
        return False
    if t.is_delta:
        j = decode.parent_index(reader, i)
        return j is not None and chunkable(reader.parent, j)
    return True


def load_large(reader, i: int, out: torch.Tensor, workspace: int, on_host: bool = False
               ) -> None:
    """:func:`_load_large`, failing as the CPU reader would: a stream or form failure is
    reported for the first plane that fails in the CPU reader's order (the host checks forms
    and stream headers before the device finds corrupt blocks), and a field overflow (found by
    tensor) in its words, by re-reading the tensor on the CPU, on this error path only.
    ``on_host``: ``out`` is host memory (page-locked, for the copies to overlap): each chunk
    is decoded into a device buffer (within the workspace) and copied down."""
    try:
        _load_large(reader, i, out, workspace, on_host)
    except FormatError as exc:  # (CodecError is one)
        failures.raise_as_cpu(reader, i, exc)
        raise


def _load_large(reader, i: int, out: torch.Tensor, workspace: int, on_host: bool = False
                ) -> None:
    """Decode tensor i into ``out`` (flat uint8 bytes on the current device) chunk by chunk,
    each chunk's device memory under ``workspace``. Every plane is checked on the host before
    any kernel runs, and every level's content hash at the end. Failures come in the CPU
    reader's order: a parent that fails its checks is reported only after the delta's own
    planes decoded, and content hashes from the deepest level up."""
    decode.check_limit(reader, i)
    levels = [Level(reader, i)]
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
            levels.append(Level(lv.reader.parent, j))
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


def _decode_levels(levels: list[Level], out: torch.Tensor, workspace: int,
                   content: bool = True, on_host: bool = False) -> None:
    """Decode the chain ``levels`` (the requested tensor first) into ``out`` chunk by chunk
    and check it (``content``: and the content hashes). Each chunk is built from the deepest
    level up: its bytes first, then each delta's XORed in, so that after level d the chunk
    holds level d's raw bytes, whose leaves are hashed there when that level's content hash is
    checked. ``on_host``: the chunk is built in a device buffer and copied down into ``out``
    (host memory). The launch tables of a window of chunks go up in one upload."""
    nbytes = levels[0].t.raw_nbytes
    hashed = [d for d, lv in enumerate(levels)
              if content and (lv.reader.verify_hashes or lv.t.is_delta)]
    chunk, runs = _load_chunk(levels, nbytes, workspace, on_host, plans=True,
                              hashed=len(hashed))
    chain = _Chain(levels, runs, out, chunk, hashed, on_host)
    for w0, w1 in _windows(runs, workspace):
        chain.window(w0, w1)
    _check(levels, runs, nbytes, chain.errs, chain.digests)


class _Chain:
    """A chunked load's device buffers, shared by every chunk and level in stream order: one
    staging buffer, one of decoded planes, two pinned buffers taking turns, an ancestor's
    bytes for the XOR, and the content leaves' digests of the levels checked."""

    def __init__(self, levels: list[Level], runs: list[Run], out: torch.Tensor, chunk: int,
                 hashed: list[int], on_host: bool) -> None:
        nbytes = levels[0].t.raw_nbytes
        self.levels, self.runs, self.out, self.on_host = levels, runs, out, on_host
        self.bounds = bounds = runs[0].bounds
        nleaf = -(-nbytes // LEAF_SIZE)
        self.digests = {d: torch.empty(max(nleaf, 1), dtype=torch.int64, device="cuda")
                        for d in hashed}
        room = min(chunk, runtime.align(nbytes, 16))  # (a tensor smaller than one chunk)
        self.pbuf = runtime.device_empty(room) if len(levels) > 1 else None
        self.cbuf = runtime.device_empty(room) if on_host else None
        staged = max(int(r.staged.max(initial=0)) for r in runs)
        self.stage = runtime.device_empty(staged)
        self.scratch = runtime.device_empty(max(r.decoded for r in runs))
        self.pinned = [runtime.pinned(staged),
                       runtime.pinned(staged) if len(bounds) * len(runs) > 1 else None]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]  # after each one's last copy
        self.recorded = [False, False]
        # where chunk k is built: level d's bytes land in ``into`` (the deepest level) or in
        # pbuf (then XORed into ``into``)
        self.into_at = [(self.cbuf.data_ptr() if on_host else out.data_ptr() + lo)
                        for lo, _hi in bounds]
        for d, r in enumerate(runs):
            r.addresses(self.stage.data_ptr(), self.scratch.data_ptr(),
                        self.into_at if d == len(levels) - 1
                        else [self.pbuf.data_ptr()] * len(bounds))
        # per level: an error code per rANS row, then a merge flag per chunk
        self.errs = [torch.zeros(r.flags_at + len(bounds), dtype=torch.int32, device="cuda")
                     for r in runs]
        self.lens = np.array([hi - lo for lo, hi in bounds], np.uint64)
        self.leaf_first = np.zeros((len(bounds), 2), np.int64)
        self.leaf_first[:, 1] = (self.lens.astype(np.int64) + LEAF_SIZE - 1) // LEAF_SIZE
        self.leaf_at = np.array([lo // LEAF_SIZE for lo, _hi in bounds], np.int64)
        self.leaf = sum(r.ntables for r in runs)  # (the leaf tables come after every level's)
        self.n = 0

    def window(self, w0: int, w1: int) -> None:
        """Upload the tables of chunks [w0, w1) and decode them."""
        arrays: list[np.ndarray] = []
        for r in self.runs:
            arrays += r.tables(w0, w1)
        if self.digests:
            arrays += [np.array(self.into_at[w0:w1], np.uint64), self.lens[w0:w1],
                       self.leaf_first[w0:w1], self.leaf_at[w0:w1]]
        dev, addrs = runtime.upload(*arrays)
        for k in range(w0, w1):
            self._chunk(k, w0, addrs)
        del dev  # stream-ordered: reused only after these launches

    def _chunk(self, k: int, w0: int, addrs: list[int]) -> None:
        """Chunk k built level by level from the deepest, each checked level's leaves hashed."""
        lo, hi = self.bounds[k]
        into = self.cbuf[:hi - lo] if self.on_host else self.out[lo:hi]
        deepest_level = len(self.levels) - 1
        for depth in range(deepest_level, -1, -1):
            r = self.runs[depth]
            slot = self.n % 2
            if self.recorded[slot]:
                self.events[slot].synchronize()  # its pinned buffer is free again
            deepest = depth == deepest_level
            r.launch(k, w0, addrs[depth * r.ntables:(depth + 1) * r.ntables], self.stage,
                     self.pinned[slot], self.events[slot], self.errs[depth],
                     into if deepest else self.pbuf[:hi - lo])
            self.recorded[slot] = True
            if not deepest:
                runtime.xor(into, self.pbuf[:hi - lo], out=into)
            if depth in self.digests:
                i, leaf = k - w0, self.leaf
                runtime.launch("hash", "leaf_digests", (int(self.leaf_first[k, 1]) + 7) // 8,
                               256, np.int32(1), np.uint64(addrs[leaf] + 8 * i),
                               np.uint64(addrs[leaf + 1] + 8 * i),
                               np.uint64(addrs[leaf + 2] + 16 * i),
                               np.uint64(addrs[leaf + 3] + 8 * i),
                               runtime.ptr(self.digests[depth]))
            self.n += 1
        if self.on_host:  # (the next chunk's kernels write cbuf after this copy, stream order)
            self.out[lo:hi].copy_(into, non_blocking=True)


def _windows(runs: list[Run], workspace: int) -> list[tuple[int, int]]:
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


def _load_chunk(levels: list[Level], nbytes: int, workspace: int, on_host: bool = False,
                plans: bool = False, hashed: int | None = None):
    """A chunk length (a multiple of every level's ``align()``) whose decode needs at most
    ``workspace`` (see :func:`_need`; or one ``align()`` when even that needs more). Starts
    from what the workspace would hold at the tensor's average need per byte and steps down
    by a tenth until it fits: within about a tenth of the largest that fits. ``hashed``: the
    levels whose leaves are digested (default: all). ``plans``: returns (the chunk, every
    level's :class:`Run` at it)."""
    align = max(lv.align() for lv in levels)  # (powers of two)
    per_byte = max(lv.need(0, nbytes) for lv in levels) / max(nbytes, 1)
    per_byte += (len(levels) > 1) + on_host  # (the XOR buffer, the buffer built on the device)
    k = max(1, min(-(-nbytes // align), int(workspace / per_byte / align)))
    while True:
        chunk = k * align
        runs = [Run(lv, [(lo, min(nbytes, lo + chunk)) for lo in range(0, nbytes, chunk)])
                for lv in levels]
        if _need(runs, chunk, nbytes, len(levels) > 1, on_host, workspace,
                 len(levels) if hashed is None else hashed) <= workspace or k == 1:
            break
        k = max(1, min(k - 1, k * 9 // 10))
    chunk = max(align, min(chunk, -(-nbytes // align) * align))
    return (chunk, runs) if plans else chunk


def _need(runs: list[Run], chunk: int, nbytes: int, chain: bool, on_host: bool,
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


def _check(levels: list[Level], runs: list[Run], nbytes: int, errs: list[torch.Tensor],
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
            row = int(s.coded[q])
            raise CodecError(f"{lv.named(row)}: " + lv.in_segment(
                row, f"rans block {b - int(s.first[q])} of {int(s.first[q + 1] - s.first[q])} "
                f"is corrupt: {rans._ERR_TEXT.get(code, 'error')}"))
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
