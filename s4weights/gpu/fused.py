"""rANS decode fused into the merge (``kernels/fused.cu``): the planning, on the host.

A split-layout tensor whose planes are all raw, bitpack (sign) or rans, with at most
``TABLES`` streams in RANS mode that share one ``log2_block``, is decoded by one warp per block
of its elements: the warp decodes the block of every RANS-mode stream in step, reads the other
planes in place and writes the merged words into the destination. The decoded planes never go
to device memory (no scratch for them, one pass fewer over them).

This module is pure numpy (no CUDA): :func:`fusable` decides from a tensor's plane records and
stream headers, :func:`plan` builds the kernel's tables from the streams validated by
``ranshost.parse_streams``. The CPU tests run the tables through a model of the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from s4format import codecs, layouts
from s4format.codecs import rans
from s4weights.gpu import plan as gplan

TABLES = 2          # kernels/fused.cu FUSED_TABLES: decoder tables in shared memory per CTA
SLOTS = 5           # planes per tensor in the tables (sign + up to 4 byte planes)
WARPS = 8           # kernels/fused.cu FUSED_WARPS
K_BYTES, K_BITS, K_RANS = 0, 1, 2
KERNEL = {layouts.BF16.layout_id: "decode_merge_bf16", layouts.FP16.layout_id: "decode_merge_fp16",
          layouts.FP32.layout_id: "decode_merge_fp32"}


def fusable(t, host: np.ndarray, at: list[int]) -> bool:
    """Whether tensor record ``t`` (a split layout the merge kernels know), whose planes' stored
    bytes start at ``host[at[j]]``, decodes fused: every plane raw, bitpack (sign) or rans, every
    plane as long as the tensor's elements, and 1..TABLES streams in RANS mode with one
    log2_block. Reads only the stream headers' mode and log2_block bytes; whether the streams
    are valid is checked with every other stream before anything launches."""
    if t.layout.layout_id not in KERNEL or len(t.planes) > SLOTS:
        return False
    n = t.planes[0].decoded_len if t.planes else 0
    if n == 0:
        return False
    lbs = []
    for j, p in enumerate(t.planes):
        if p.decoded_len != n:
            return False
        if (p.codec == codecs.BITPACK and j == 0) or p.codec == codecs.RAW:
            continue
        if p.codec != codecs.RANS:
            return False
        if p.stored_len >= rans.HEADER_SIZE and int(host[at[j]]) == rans.MODE_RANS:
            lbs.append(int(host[at[j] + 1]))
    return 1 <= len(lbs) <= TABLES and len(set(lbs)) == 1


@dataclass
class Plane:
    """One plane of a fused tensor: ``kind`` (K_BYTES, K_BITS or K_RANS until planned: a rans
    plane's kind follows its stream's mode), ``src`` its stored bytes' device address, ``row``
    its stream's row in the rANS batch (rans planes), ``lb`` its stream's log2_block."""
    kind: int
    src: int
    row: int = -1


@dataclass
class Tensor:
    pos: int                 # position in the group
    layout_id: int
    out: int                 # destination address
    n: int                   # elements
    planes: list[Plane]


@dataclass
class Plan:
    """The tables of one fused launch (one layout): see kernels/fused.cu for their meaning."""
    layout_id: int
    tensors: list[Tensor]
    cta_first: np.ndarray
    cta_warps: np.ndarray
    blk_tensor: np.ndarray
    t_out: np.ndarray
    t_n: np.ndarray
    t_first: np.ndarray
    t_lb: np.ndarray
    t_cum: np.ndarray
    tp_kind: np.ndarray
    tp_shift: np.ndarray
    tp_tab: np.ndarray
    tp_ptr: np.ndarray
    bp_words: np.ndarray
    bp_count: np.ndarray

    @property
    def nblocks(self) -> int:
        return int(self.blk_tensor.size)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The kernel's table arguments, in order."""
        return (self.cta_first, self.cta_warps, self.blk_tensor, self.t_out, self.t_n,
                self.t_first, self.t_lb, self.t_cum, self.tp_kind, self.tp_shift, self.tp_tab,
                self.tp_ptr, self.bp_words, self.bp_count)

    def where_block(self, b: int) -> tuple[int, int, int]:
        """(tensor index in ``tensors``, block within the tensor, the tensor's blocks)."""
        f = int(np.searchsorted(self.t_first, b, side="right") - 1)
        end = int(self.t_first[f + 1]) if f + 1 < self.t_first.size else self.nblocks
        return f, b - int(self.t_first[f]), end - int(self.t_first[f])


def plan(tensors: list[Tensor], host: np.ndarray, at: np.ndarray, st, tab_addr: int) -> Plan:
    """Tables for fused tensors of ONE layout. ``st`` is the ``ranshost.Streams`` of the rANS
    batch (rows as in ``Plane.row``), ``host[at[row]]`` each row's stream on the host, and
    ``tab_addr`` the device address of the batch's frequency prefix sums (u32[256] per row of
    ``st.freqs``)."""
    T = len(tensors)
    q_of_row = {int(r): q for q, r in enumerate(st.coded.tolist())}
    t_out = np.zeros(T, np.uint64)
    t_n = np.zeros(T, np.int64)
    t_lb = np.zeros(T, np.uint8)
    t_cum = np.zeros((T, TABLES), np.uint64)
    tp_kind = np.zeros((T, SLOTS), np.uint8)
    tp_shift = np.zeros((T, SLOTS), np.uint8)
    tp_tab = np.zeros((T, SLOTS), np.uint8)
    tp_ptr = np.zeros((T, SLOTS), np.uint64)
    nb = np.zeros(T, np.int64)
    spans: list[list[tuple[int, int, int]]] = []  # per tensor: (slot, first block in st, src)
    for f, t in enumerate(tensors):
        t_out[f], t_n[f] = t.out, t.n
        lb, ntab, span = None, 0, []
        for k, pl in enumerate(t.planes):
            if pl.kind != K_RANS:
                tp_kind[f, k], tp_ptr[f, k] = pl.kind, pl.src
                continue
            a = int(at[pl.row])
            mode, lg = int(host[a]), int(host[a + 1])
            if mode != rans.MODE_RANS:  # RAW bytes, or CONST fill bytes, after the header
                tp_kind[f, k], tp_ptr[f, k] = K_BYTES, pl.src + rans.HEADER_SIZE
                tp_shift[f, k] = 0 if mode == rans.MODE_RAW else lg
                continue
            q = q_of_row[pl.row]
            b0 = int(st.first[q])
            if (lb is not None and lg != lb) or ntab >= TABLES:
                raise ValueError("tensor is not fusable")  # fusable() rules this out
            lb = lg
            tp_kind[f, k], tp_tab[f, k] = K_RANS, ntab
            tp_ptr[f, k] = pl.src + int(st.states[b0])   # block j's states at + 128 j
            t_cum[f, ntab] = tab_addr + 1024 * int(st.table[b0])
            ntab += 1
            span.append((k, b0, pl.src))
        if lb is None:
            raise ValueError("tensor is not fusable")
        t_lb[f] = lb
        nb[f] = (t.n + (1 << lb) - 1) >> lb
        spans.append(span)
    t_first = np.zeros(T + 1, np.int64)
    np.cumsum(nb, out=t_first[1:])
    NB = int(t_first[-1])
    bp_words = np.zeros((NB, SLOTS), np.uint64)
    bp_count = np.zeros((NB, SLOTS), np.uint32)
    for f, span in enumerate(spans):
        lo, hi = int(t_first[f]), int(t_first[f + 1])
        for k, b0, src in span:
            blocks = slice(b0, b0 + hi - lo)
            bp_words[lo:hi, k] = np.uint64(src) + st.words[blocks].astype(np.uint64)
            bp_count[lo:hi, k] = st.count[blocks]
    cta_first, cta_warps = gplan.cta_table(t_first, WARPS)
    return Plan(tensors[0].layout_id if tensors else 0, tensors, cta_first, cta_warps,
                np.repeat(np.arange(T, dtype=np.uint32), nb), t_out, t_n,
                t_first[:-1].astype(np.uint32), t_lb, t_cum, tp_kind, tp_shift, tp_tab, tp_ptr,
                bp_words, bp_count)
