"""The rANS encode launch over many planes at once (``kernels/rans.cu`` ``rans_encode``) and
what comes back of it: every block's word count, first symbol and "varied" flag, read in one
copy, and copy ops that lay the blocks' words out as streams (``spec/rans.md``).

A launch's result is a dict (``rans_launch``, then ``rans_collect``): its blocks (``bt``), the
device buffers of its words (``scratch``) and figures, and per job the words and flags summed.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format.codecs import rans
from s4weights.gpu import plan, ranshost, runtime


def rans_meta_bytes(nb: int) -> int:
    """Device bytes of a rANS launch's figures of ``nb`` blocks: word counts (4 bytes each),
    final states (128) and a spare word (4), first symbols and "varied" flags (1 each) from
    the start, then, 8-byte aligned, the places of the blocks' words (8): 146 per block."""
    return runtime.align(nb * 4 * 34 + 2 * nb, 8) + 8 * nb



def rans_plan(n: np.ndarray, log2_block: int, words: np.ndarray | None = None) -> dict:
    """The address-free tables of a rANS launch over jobs of ``n`` symbols: blocks, scratch
    offsets (two bytes per symbol, or per word of ``words``: each job's bound, the kernel's
    ``p_cap``), CTAs; a row per job or CTA, none per block."""
    n = np.asarray(n, np.int64)
    bt = plan.blocks(n, log2_block)
    scratch_off = np.zeros(n.size + 1, dtype=np.int64)
    np.cumsum(runtime.align(2 * (n if words is None else np.asarray(words, np.int64))),
              out=scratch_off[1:])
    return dict(bt=bt, scratch_off=scratch_off, cta=plan.cta_planes(bt.first),
                cap=None if words is None else np.asarray(words, np.uint64))



def rans_encode(width: np.ndarray, n: np.ndarray, ptr: np.ndarray, freqs: np.ndarray,
                log2_block: int, tabs: np.ndarray | None = None, meanwhile=None) -> dict:
    """Encode every block of every job (a plane of ``n[j]`` symbols at ``ptr[j]``, stored
    at ``width[j]`` bits each: 8 bytes, fewer packed as bitpack-w, a sign plane's bits at
    1; the kernel unpacks as it reads) in one launch; read back the per-block counts.
    Job j's frequencies are ``freqs[j]``; ``tabs[j]``, where given, is the device address
    of its encoder-table input (``rans_normalise``'s output), else it is uploaded.
    ``meanwhile()`` runs on the host while the kernel runs."""
    batch = runtime.Batch()
    launched = rans_launch(width, n, ptr, freqs, tabs, batch, log2_block)
    launched["keep"][0].append(batch.run())
    return rans_collect(launched, meanwhile)



def rans_launch(width: np.ndarray, n: np.ndarray, ptr: np.ndarray, freqs: np.ndarray | None,
                tabs: np.ndarray | None, batch: runtime.Batch, log2_block: int,
                planned: dict | None = None, run: int = 0,
                scratch: torch.Tensor | None = None, out: torch.Tensor | None = None) -> dict:
    """Queue in ``batch`` one rANS launch over every block of every job (as
    :func:`rans_encode`) and return what :func:`rans_collect` reads back. ``planned``:
    ``rans_plan(n)`` if made already. ``run``: the device address of a byte per job, 0 where
    its blocks code nothing (``rans_jobs``); 0 for none: every job codes. ``scratch`` and
    ``out``: the caller's buffers for the words and the blocks' figures
    (``rans_meta_bytes``), reused across launches in stream order."""
    keep: list[object] = []
    n = np.asarray(n, np.int64)
    srcs = np.asarray(ptr, np.uint64)
    planned = planned or rans_plan(n, log2_block)
    bt, scratch_off = planned["bt"], planned["scratch_off"]
    nb = bt.size
    if scratch is None:
        scratch = runtime.device_empty(int(scratch_off[-1]))
    flags = rans_meta_bytes(nb) - 8 * nb
    if out is None:
        out = torch.empty(flags + 8 * nb, dtype=torch.uint8, device="cuda")
    counts_p = out.data_ptr()
    states_p = counts_p + 4 * nb
    firsts_p = states_p + 128 * nb
    varied_p = firsts_p + nb
    boff_p = counts_p + flags  # each block's words' place in its job's scratch
    # per job: frequencies and their exclusive prefix sums; each CTA builds its encoder
    # table from them in shared memory (2 KiB per plane up instead of a 4 KiB table)
    if tabs is None:
        fc = np.concatenate((freqs, np.cumsum(freqs, axis=1) - freqs), axis=1
                            ).astype(np.uint32)
        d_tabs, (tab_p,) = runtime.upload(fc)
        keep.append(d_tabs)
        tabs = np.uint64(tab_p) + np.arange(n.size, dtype=np.uint64) * np.uint64(2048)
    cta_plane, cta_block, cta_warps = planned["cta"]
    job_scratch = np.uint64(scratch.data_ptr()) + scratch_off[:-1].astype(np.uint64)
    tabs_at = batch.table(cta_plane, cta_block, cta_warps, srcs, n,
                          np.asarray(tabs, np.uint64), job_scratch, bt.first[:-1],
                          np.asarray(width, np.uint8))
    # a job sized by its bound: its capacity in words and its cursor (blocks take their
    # shares of it); otherwise none (fixed slots of a word per symbol)
    cap = planned.get("cap")
    bounded = (*batch.table(cap, np.zeros(n.size, np.uint64)),) if cap is not None \
        else (np.uint64(0), np.uint64(0))
    batch.launch("rans", "rans_encode", cta_plane.size, 32 * plan.RANS_WARPS, *tabs_at,
                 np.int32(log2_block), np.uint64(counts_p), np.uint64(states_p),
                 np.uint64(firsts_p), np.uint64(varied_p), np.uint64(run), *bounded,
                 np.uint64(boff_p), runtime.constant("word_cost", ranshost.WORD_COST))
    return dict(bt=bt, n=n, out=out, states_p=states_p, counts_p=counts_p, boff_p=boff_p,
                scratch_off=scratch_off, scratch=scratch, keep=(keep, out),
                log2_block=log2_block, bounded=cap is not None)



def rans_collect(launched: dict, meanwhile=None, rest: runtime.Batch | None = None) -> dict:
    """After the launch has been queued: copy the blocks' word counts, first symbols and
    "varied" flags to the host, launch ``rest``'s queued launches, run ``meanwhile()``,
    wait for the copies (not for what ``rest`` or ``meanwhile`` queued), and sum them per
    job."""
    bt, out = launched["bt"], launched.pop("out")
    nb = bt.size
    meta_h = runtime.pinned(6 * nb)
    if nb:
        meta_h[:4 * nb].copy_(out[:4 * nb], non_blocking=True)
        meta_h[4 * nb:6 * nb].copy_(out[132 * nb:134 * nb], non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    if rest is not None:
        rest.run()
    if meanwhile is not None:
        meanwhile()  # host work that does not wait for the kernel (it may queue more)
    copied.synchronize()  # not what ``meanwhile`` queued
    meta = meta_h.numpy()
    counts = meta[:4 * nb].view(np.uint32).astype(np.int64)
    if nb and (counts == 0xFFFFFFFF).any():  # (never: ranshost.WORD_COST bounds them)
        raise RuntimeError("rANS encoder: a block wrote more words than its bound "
                           "(ranshost.WORD_COST); this is a bug")
    fv = meta[4 * nb:6 * nb]
    first = bt.first
    jobs = launched.pop("n").size
    ne = first[1:] > first[:-1]
    plane_words = np.zeros(jobs, np.int64)
    plane_varied = np.zeros(jobs, bool)
    if nb:
        idx = first[:-1][ne]
        plane_words[ne] = np.add.reduceat(counts, idx)
        plane_varied[ne] = np.logical_or.reduceat(fv[nb:] != 0, idx)
    launched.update(counts=counts, firsts=fv[:nb], plane_words=plane_words,
                    plane_varied=plane_varied)
    return launched



def place_words(r: dict, words: np.ndarray, batch: runtime.Batch, excl: int = 0,
                cap: int = 0) -> None:
    """Queue in ``batch`` the launch that copies every rANS block's words to its stream
    (``words[j]``: where job j's words start; 0: not a RANS-mode stream), at the block's
    place among its stream's words: the exclusive prefix sum of the word counts (a table
    of the batch, from the counts the host has read; or, where ``excl`` is given, the
    device address of that sum made on the device: int64 per block; the kernel subtracts
    its stream's first). ``cap``: the bytes each destination holds (0: enough); a block
    whose words would end past it is left out."""
    first = r["bt"].first
    scratch = np.uint64(r["scratch"].data_ptr()) + r["scratch_off"][:-1].astype(np.uint64)
    if not excl:
        counts = r["counts"]
        at = batch.table(np.cumsum(counts) - counts)
    batch.launch("copy", "rans_place", int(first[-1]), 256, np.int32(first.size - 1),
                 *batch.table(first.astype(np.int64), scratch, words),
                 np.uint64(r["boff_p"]), np.uint64(r["counts_p"]),
                 *(at if not excl else (np.uint64(excl),)), np.uint64(cap))



def rans_runs(r: dict, jobs: np.ndarray, at: np.ndarray, words: bool = True
              ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Copy ops (sources, destinations, lengths) that lay rANS job ``jobs[q]`` of a launch's
    result out at device address ``at[q]`` as a stream's sections (spec/rans.md, section 2):
    word counts, final states, then (``words``) the words of every block back to back. Built
    with numpy over all jobs and blocks at once, never a call per plane or per block."""
    bt = r["bt"]
    b0 = bt.first[jobs]
    nbk = bt.first[jobs + 1] - b0
    nb_u = nbk.astype(np.uint64)
    # word counts and final states: two runs per plane
    src = [np.uint64(r["counts_p"]) + 4 * b0.astype(np.uint64),
           np.uint64(r["states_p"]) + 128 * b0.astype(np.uint64)]
    dst = [at, at + 4 * nb_u]
    ln = [4 * nb_u, 128 * nb_u]
    if not words:
        return src, dst, ln
    if r["bounded"]:  # (the blocks' regions are the device's: rans_place moves those words)
        raise ValueError("rans_runs lays out the words of fixed-slot launches only")
    # one word run per block (in its fixed slot): blocks of plane q are b0[q] .. b0[q] +
    # nbk[q] - 1
    q = np.repeat(np.arange(jobs.size), nbk)
    firstq = np.cumsum(nbk) - nbk
    blk = np.arange(q.size, dtype=np.int64) - firstq[q] + b0[q]
    c = r["counts"][blk]
    run_start = np.zeros(c.size + 1, np.int64)
    np.cumsum(c, out=run_start[1:])
    within = run_start[:-1] - run_start[firstq][q]
    start = (blk - b0[q]) << r["log2_block"]  # the block's first symbol in its plane
    src.append(np.uint64(r["scratch"].data_ptr()) + r["scratch_off"][jobs][q].astype(np.uint64)
               + 2 * start.astype(np.uint64))
    dst.append(at[q] + 132 * nb_u[q] + 2 * within.astype(np.uint64))
    ln.append(2 * c.astype(np.uint64))
    return src, dst, ln



def rans_stream(plane: torch.Tensor, log2_block: int = rans.LOG2_BLOCK_DEFAULT) -> np.ndarray:
    """The canonical S4 rANS stream (spec/rans.md, section 7) of a uint8 plane on the device,
    through the same kernels, stream heads and copy ops as the coder: equal to
    ``RansCodec.encode``."""
    plane = plane.reshape(-1).contiguous()
    n = int(plane.numel())
    if n == 0:
        return np.frombuffer(ranshost.header(rans.MODE_RAW, log2_block, 0), np.uint8)
    counts = torch.bincount(plane, minlength=256).cpu().numpy().astype(np.int64)
    if np.count_nonzero(counts) == 1:
        return np.frombuffer(ranshost.const_whole(counts, n), np.uint8)
    freqs = rans.normalise(counts)[None, :]
    r = rans_encode(np.full(1, 8), np.array([n]), np.array([plane.data_ptr()], np.uint64), freqs,
                    log2_block)
    if not r["plane_varied"][0]:
        return np.frombuffer(ranshost.const_stream(r["firsts"], log2_block, n), np.uint8)
    body, blen = ranshost.table_bodies(freqs)
    head = ranshost.stream_heads(rans.MODE_RANS, log2_block, [n], body, blen)[0]
    size = head.size + rans.BLOCK_OVERHEAD * r["bt"].size + 2 * int(r["plane_words"][0])
    if size >= ranshost.HEADER_SIZE + n:
        return np.concatenate([np.frombuffer(ranshost.header(rans.MODE_RAW, log2_block, n),
                                             np.uint8), plane.cpu().numpy()])
    out = runtime.device_empty(size)
    s, d, ln = rans_runs(r, np.zeros(1, np.int64), np.array([out.data_ptr() + head.size],
                                                            np.uint64))
    keep = runtime.copy_ops(np.concatenate(s), np.concatenate(d), np.concatenate(ln))
    res = out[:size].cpu().numpy().copy()
    del keep
    res[:head.size] = head
    return res
