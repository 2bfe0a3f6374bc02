"""The rANS planes of a staged group, decoded in one launch: every stream's header and table
checked on the host (``ransparse``), the block table made and checked on the device
(``rans_blocks``: the host reads no word count), then every block decoded, a warp each.
The kernels are safe on any bytes once the headers and tables hold, and a stream that fails
the device's checks is skipped."""

from __future__ import annotations

import numpy as np
import torch

from s4format.codecs import rans
from s4format.errors import CodecError
from s4weights.gpu import plan, ransparse, runtime


class RansBatch:
    """Every rANS plane of a group: queued as arrays, its streams' headers and tables validated
    by ``ransparse.parse_streams`` (numpy over all planes at once), its block table made and
    checked on the device (``rans_blocks``: the host reads no word count), launched once."""

    def __init__(self, host: np.ndarray, where) -> None:
        self.host = host
        self._where = where  # plane position -> its name, for messages
        self.q = np.zeros(0, np.int64)
        self.pos = np.zeros(0, np.int64)   # per row: its tensor's position in the group
        self.nblocks = 0
        self.first = np.zeros(1, np.int64)
        self.coded = np.zeros(0, np.int64)
        self.names = None

    def add_many(self, q, a, stored, n, src, dst, pos, names=None) -> None:
        """Queue planes ``q`` (positions in the group; streams at ``host[a:]``, on the device at
        ``src``) to decode into ``dst`` (a RAW-mode stream is used in place: nothing decodes
        it, and its header is checked with every other before anything launches). ``names``:
        per row, None or what the stream is within its plane (a codec-9 segment), for
        messages."""
        self.q, self.pos = np.asarray(q, np.int64), np.asarray(pos, np.int64)
        self.names = names
        self.rows = (np.asarray(a, np.int64), np.asarray(stored, np.int64),
                     np.asarray(n, np.int64), np.asarray(src, np.uint64),
                     np.asarray(dst, np.uint64))

    def where(self, row: int) -> str:
        name = self.names[row] if self.names is not None else None
        plane = self._where(int(self.q[row]))
        return plane if name is None else f"{plane}: {name}"

    def prepare(self, keep: list[object]) -> None:
        """Validate every queued stream's header and table and queue the kernel that makes
        the block table (``rans_blocks``; the decode is :meth:`launch`)."""
        self._launch = None
        self.bad = None
        if not self.q.size:
            return
        a, stored, n, src, dst = self.rows
        try:
            st = ransparse.parse_streams(self.host, a, stored, n, blocks=False)
        except ransparse.StreamError as e:
            # a lower stream may fail a word-count check the host did not make: the full host
            # checks name the lowest failing stream, as the CPU reader meets them
            err = e
            try:
                ransparse.parse_streams(self.host, a, stored, n)
            except ransparse.StreamError as lowest:
                err = lowest
            self.failed = err.plane
            raise CodecError(f"{self.where(err.plane)}: {err}") from None
        self.first, self.coded = st.first, st.coded
        nb = self.nblocks = st.nblocks
        if not nb:
            return
        row = st.coded
        # per table the exclusive prefix sums of its frequencies: each CTA builds its decoder
        # table from them in shared memory (1 KiB per plane up instead of 16 KiB)
        cums = (np.cumsum(st.freqs, axis=1) - st.freqs).astype(np.uint32) if st.freqs.shape[0] \
            else np.zeros((1, 256), np.uint32)
        cta_first, cta_warps = plan.cta_table(self.first)
        batch = runtime.Batch()  # (the tables, cums among them, in one upload)
        ctaf_at, ctaw_at = batch.table(cta_first, cta_warps)
        # the block table's columns on the device, u64 ones first
        cols = runtime.device_empty(42 * nb)
        c0 = cols.data_ptr()
        words, states, dtab, out = (np.uint64(c0 + 8 * i * nb) for i in range(4))
        count, length = np.uint64(c0 + 32 * nb), np.uint64(c0 + 36 * nb)
        bmode, fill = np.uint64(c0 + 40 * nb), np.uint64(c0 + 41 * nb)
        self.bad = torch.zeros(row.size, dtype=torch.int32, device="cuda")
        batch.launch("rans", "rans_blocks", row.size, 256, *batch.table(
            src[row], stored[row], n[row], dst[row], st.nb[row], st.pos[row], self.first[:-1],
            cums, st.tab_of[row], st.lg[row].astype(np.uint8), st.mode[row].astype(np.uint8)),
            bmode, fill, words, count, states, dtab, out, length, runtime.ptr(self.bad))
        keep += [batch.run(), cols]
        self._launch = (cta_first.size, (batch.address(ctaf_at), batch.address(ctaw_at), bmode,
                                         fill, words, count, states, dtab, out, length))

    def failure(self, errors: np.ndarray, flags: np.ndarray) -> tuple | None:
        """The first failure of the batch's streams, plane by plane as the CPU reader meets
        them, as (tensor position, 0, error): a stream that failed ``rans_blocks``' checks
        (``flags``, per stream; named by the host's own check of that stream) or a corrupt
        block (``errors``, per block: blocks are in plane order, planes in tensor order)."""
        blk = np.flatnonzero(errors)
        bad = np.flatnonzero(flags)
        q_blk = int(np.searchsorted(self.first, blk[0], side="right") - 1) if blk.size else None
        q_bad = int(bad[0]) if bad.size else None
        if q_blk is None and q_bad is None:
            return None
        if q_blk is None or (q_bad is not None and q_bad < q_blk):
            row = int(self.coded[q_bad])
            a, stored, n, _src, _dst = self.rows
            try:
                ransparse.parse_streams(self.host, a[[row]], stored[[row]], n[[row]])
                msg = "rans stream failed the block checks"  # (not expected: the same checks)
            except ransparse.StreamError as ex:
                msg = str(ex)
            return int(self.pos[row]), 0, CodecError(f"{self.where(row)}: {msg}")
        b = int(blk[0])
        row = int(self.coded[q_blk])
        return int(self.pos[row]), 0, CodecError(
            f"{self.where(row)}: rans block {b - int(self.first[q_blk])} of "
            f"{int(self.first[q_blk + 1] - self.first[q_blk])} is corrupt: "
            f"{rans._ERR_TEXT.get(int(errors[b]), 'error')}")

    def launch(self) -> None:
        """Queue the decode of every block (after :meth:`prepare`); ``errs``: the per-block
        error codes (None with no block)."""
        self.errs = None
        if self._launch is None:
            return
        ctas, dp = self._launch
        self.errs = torch.zeros(self.nblocks, dtype=torch.int32, device="cuda")
        runtime.launch("rans", runtime.rans_decode_kernel(self.nblocks), ctas,
                       32 * plan.RANS_WARPS,
                       *(np.uint64(x) for x in dp), runtime.ptr(self.errs))
