"""Which codec each plane of a group takes, in ``s4format.policy``'s rank order, and the bytes
its payload starts with.

:func:`candidates` ranks the codecs the GPU codes for every plane from its histogram or the
device's figures, before any plane is coded; :func:`choose` takes the first whose real size is
under the plane's, once the rANS kernel has given its word counts, and lays out the host bytes
(stream headers and tables, whole CONST streams, GDeflate page tables).
"""

from __future__ import annotations

import numpy as np

from s4format import layouts, policy
from s4format.codecs import rans
from s4weights.gpu import gdeflate, ranshost
from s4weights.gpu.planes import (
    FORM_BITPACK,
    FORM_BITPACK_W,
    FORM_CODEC,
    FORM_CONST,
    FORM_GDEFLATE,
    FORM_RANS,
    FORM_RAW,
    Planes,
)


def candidates(pl: Planes, policy_name: str, mantissa: str, gd: bool, log2_block: int) -> None:
    """``policy.encode_plane``'s candidates for every plane, those the GPU codes, with their
    estimates (``ranshost.estimate_many``, or the same from the device: ``pl.stats``): sign
    planes bitpack and rANS (not under ``seed``), exponent planes rANS, mantissa planes rANS
    (``mantissa`` auto or rans, not ``seed``) or GDeflate (``gd``, under ``seed`` or
    ``mantissa="gdeflate"``: its real size ranks it). A candidate whose estimate is not under
    the plane's size is dropped; planes under ``policy.MIN_CODED`` bytes have none (stored
    raw)."""
    n, kind = pl.n, pl.kind
    want, bp_ok, bw_ok = candidate_kinds(n, kind, policy_name, mantissa)
    mant = kind == layouts.KIND_MANTISSA
    coded = n >= policy.MIN_CODED
    if pl.stats is not None:  # from the device: the same figures, every split row
        nsym, pl.sym0, pl.tsize = pl.stats[:, 0], pl.stats[:, 2] & 0xFFFF, pl.stats[:, 3]
        top = pl.stats[:, 2] >> 16
        est = np.where(want, pl.stats[:, 1], 0)
    else:
        nsym = np.count_nonzero(pl.counts, axis=1)
        est = np.zeros(n.size, np.int64)
        multi = np.flatnonzero(want & (nsym > 1))
        if pl.freqs is None:
            pl.freqs = np.zeros((n.size, 256), np.int64)
            if multi.size:
                pl.freqs[multi] = ranshost.normalise_many(pl.counts[multi])
        if multi.size:
            est[multi] = ranshost.estimate_many(pl.counts[multi], pl.freqs[multi], log2_block)
        single = want & (nsym == 1)
        est[single] = ranshost.HEADER_SIZE + ranshost.n_blocks(n[single], rans.LOG2_BLOCK_MAX)
        pl.sym0 = np.argmax(pl.counts > 0, axis=1)
        top = 255 - np.argmax(pl.counts[:, ::-1] > 0, axis=1)
        pl.tsize = ranshost.table_sizes(pl.freqs)
    pl.nsym, pl.est_rans = nsym, est
    pl.est_bp = (n + 7) // 8
    pl.cand_rans = want & (est < n)
    pl.cand_bp = bp_ok & (pl.est_bp < n)
    pl.cand_gd = coded & mant & gd & (policy_name == "seed" or mantissa == "gdeflate")
    # bitpack-w: ``width`` bits per byte, from the largest symbol present
    pl.width = np.maximum(1, np.frexp(np.asarray(top, np.float64))[1]).astype(np.int64)
    pl.est_bw = (n * pl.width + 7) // 8
    pl.cand_bw = bw_ok & (pl.width <= 7) & (pl.est_bw < n)
    # rank order is (estimate, codec id): bitpack (2) before rANS (4) on equal estimates;
    # bitpack always succeeds, so a rANS candidate behind it is never coded. Bitpack-w goes
    # first where rANS would not save 1/65 of it (policy.prefer_packed). A plane of one
    # symbol is a CONST stream the host writes.
    bitpack_first = pl.cand_bp & pl.cand_rans & (pl.est_bp <= est)
    pl.bw_first = pl.cand_bw & (~pl.cand_rans | policy.packed_wins(pl.est_bw, est))
    pl.runs_rans = pl.cand_rans & ~bitpack_first & ~pl.bw_first & (nsym > 1)
    pl.launched = pl.runs_rans  # the rows a rANS launch covers (``histograms``: more)


def candidate_kinds(n: np.ndarray, kind: np.ndarray, policy_name: str, mantissa: str
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per plane, what its kind and size allow (:func:`candidates`), before any figure: (rANS:
    sign planes (not under ``seed``), exponent planes, mantissa planes under ``mantissa``
    auto or rans (not ``seed``); bitpack: sign planes; bitpack-w: exponent planes, and
    mantissa planes under ``mantissa="auto"``, policy auto only). None for planes under
    ``policy.MIN_CODED`` bytes (stored raw)."""
    seed = policy_name == "seed"
    coded = n >= policy.MIN_CODED
    sign = kind == layouts.KIND_SIGN
    expo = kind == layouts.KIND_EXPONENT
    mant = kind == layouts.KIND_MANTISSA
    want = coded & ((sign & (not seed)) | expo
                    | (mant & (not seed) & (mantissa in ("auto", "rans"))))
    bw_ok = coded & (policy_name == "auto") & (expo | (mant & (mantissa == "auto")))
    return want, coded & sign, bw_ok


def choose(pl: Planes, r: dict | None, gd: gdeflate.Compressed | None, log2_block: int) -> None:
    """Each plane's codec: the first candidate in rank order whose real size is under the
    plane's, else raw (``policy.encode_plane``), and the host bytes of its payload. rANS sizes
    are real: CONST streams from the first symbols of blocks no symbol varies in, RANS streams
    from the kernel's word counts (``r``; the RAW mode is never smaller than the plane)."""
    size_r, one, jobs, ran, varied, nb = _rans_sizes(pl, r)
    form, size, use_r, rr = _forms(pl, size_r, jobs, ran, varied)
    is_job = np.zeros(pl.n.size, bool)
    is_job[jobs[ran]] = True
    parts = _rans_heads(pl, r, log2_block, form, use_r & one, use_r & is_job, jobs, nb, rr)
    parts += _gdeflate_heads(pl, gd, form, size)
    pl.head = np.zeros(pl.n.size, np.int64)
    pl.head_at = np.zeros(pl.n.size, np.int64)
    base = 0
    for rows, blob, start, length in parts:
        pl.head[rows] = length
        pl.head_at[rows] = base + start
        base += blob.size
    pl.heads = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.uint8)
    pl.form, pl.size, pl.codec = form, size, FORM_CODEC[form]


def _rans_sizes(pl: Planes, r: dict | None) -> tuple[np.ndarray, ...]:
    """The real size of every rANS candidate (-1: none): a CONST stream of the whole plane
    where one symbol is present, else what the rANS launch ``r`` coded. Also returns the
    one-symbol rows, the launch's jobs (its rows), which jobs the rule ran, which of those
    varied in some block, and each job's blocks."""
    n = pl.n
    hs = ranshost.HEADER_SIZE
    size_r = np.full(n.size, -1, np.int64)
    one = pl.cand_rans & (pl.nsym == 1)
    size_r[one] = hs + ranshost.n_blocks(n[one], rans.LOG2_BLOCK_MAX)
    # the jobs of the rANS launch, in row order; those of rows the rule does not run (a launch
    # queued before the rule, ``histograms``) coded nothing
    jobs = np.flatnonzero(pl.launched)
    ran = np.zeros(0, bool)
    varied = np.zeros(0, bool)
    nb = np.zeros(0, np.int64)
    if jobs.size:
        nb = np.diff(r["bt"].first)
        ran = pl.runs_rans[jobs]
        varied = r["plane_varied"].astype(bool) & ran
        full = np.zeros(jobs.size, np.int64)
        full[varied] = (hs + pl.tsize[jobs[varied]]
                        + rans.BLOCK_OVERHEAD * nb[varied] + 2 * r["plane_words"][varied])
        size_r[jobs[ran]] = np.where(varied, np.where(full < hs + n[jobs], full, -1),
                                     hs + nb)[ran]
    return size_r, one, jobs, ran, varied, nb


def _forms(pl: Planes, size_r: np.ndarray, jobs: np.ndarray, ran: np.ndarray,
           varied: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's form and stored size in rank order, before GDeflate; the rows rANS takes and
    those of them that are RANS-mode streams."""
    n = pl.n
    rans_ok = (size_r >= 0) & (size_r < n)
    rans_first = pl.est_rans < pl.est_bp    # (estimate, codec id) rank; bitpack wins ties
    use_r = rans_ok & (~pl.cand_bp | rans_first) & ~pl.bw_first
    use_bp = pl.cand_bp & ~use_r
    use_bw = pl.cand_bw & ~use_r   # first, or next after a rANS stream that did not pay
    form = np.full(n.size, FORM_RAW, np.int64)
    size = n.copy()
    form[use_bp] = FORM_BITPACK
    size[use_bp] = pl.est_bp[use_bp]
    form[use_bw] = FORM_BITPACK_W
    size[use_bw] = pl.est_bw[use_bw]
    form[use_r] = FORM_CONST
    size[use_r] = size_r[use_r]
    rr = jobs[varied]
    rr = rr[use_r[rr]]   # RANS-mode streams
    form[rr] = FORM_RANS
    return form, size, use_r, rr


def _rans_heads(pl: Planes, r: dict | None, log2_block: int, form: np.ndarray,
                whole: np.ndarray, coded: np.ndarray, jobs: np.ndarray, nb: np.ndarray,
                rr: np.ndarray) -> list[tuple]:
    """The host bytes of the rANS payloads, as (rows, bytes, start and length of each row's):
    RANS streams' headers and tables (``pl.dtab``: the bytes of a table the device made, copied
    after the header), CONST streams of the launch's blocks, and CONST streams of one-symbol
    planes (``whole``)."""
    n = pl.n
    parts = []
    pl.dtab = np.zeros(n.size, np.int64)
    if rr.size:
        if pl.tdev is None:
            body, blen = ranshost.table_bodies(pl.freqs[rr])
        else:  # the tables are on the device: the assembly copies them after the header
            body, blen = np.zeros(0, np.uint8), np.zeros(rr.size, np.int64)
            pl.dtab[rr] = pl.tsize[rr]
        parts.append((rr, *ranshost.stream_heads(rans.MODE_RANS, log2_block, n[rr], body, blen)))
    cj = np.flatnonzero(coded & (form == FORM_CONST))  # constant in every block
    if cj.size:
        jpos = np.searchsorted(jobs, cj)
        nbj = nb[jpos]
        b0 = r["bt"].first[jpos]
        firsts = r["firsts"][ranshost.ragged_positions(b0, nbj)]
        parts.append((cj, *ranshost.stream_heads(rans.MODE_CONST, log2_block, n[cj], firsts,
                                                 nbj)))
    oc = np.flatnonzero(whole)
    if oc.size:
        nbm = ranshost.n_blocks(n[oc], rans.LOG2_BLOCK_MAX)
        sym = pl.sym0[oc].astype(np.uint8)
        parts.append((oc, *ranshost.stream_heads(rans.MODE_CONST, rans.LOG2_BLOCK_MAX, n[oc],
                                                 np.repeat(sym, nbm), nbm)))
    return parts


def _gdeflate_heads(pl: Planes, gd: gdeflate.Compressed | None, form: np.ndarray,
                    size: np.ndarray) -> list[tuple]:
    """GDeflate where its pages store less than the plane (rare: asked for, a step per plane):
    the form and size of those rows, and their page tables' host bytes as :func:`_rans_heads`
    gives its own."""
    gd_rows = np.flatnonzero(pl.cand_gd)
    pl.gd_job = np.full(pl.n.size, -1, np.int64)
    if not gd_rows.size:
        return []
    pl.gd_job[gd_rows] = np.arange(gd_rows.size)
    heads = []
    for j, q in enumerate(gd_rows.tolist()):
        s = gd.payload_size(j)
        if s < pl.n[q]:
            form[q], size[q] = FORM_GDEFLATE, s
            heads.append((q, gd.pieces(j, int(pl.ptr[q]))[0]))
    if not heads:
        return []
    hb = [h for _, h in heads]
    ln = np.array([len(h) for h in hb], np.int64)
    return [(np.array([q for q, _ in heads], np.int64), np.frombuffer(b"".join(hb), np.uint8),
             np.cumsum(ln) - ln, ln)]
