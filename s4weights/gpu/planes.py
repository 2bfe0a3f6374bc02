"""The plane table of a group of tensors, and the split launch that writes the planes.

A group's planes are rows of numpy arrays (:class:`Planes`), so the host decides for every plane
at once. This module says what each row is and how the split stores it: sign bits packed, narrow
mantissa planes packed where bitpack-w is sure to take them, other planes a byte per element.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs import rans
from s4format.layouts import Layout
from s4weights.gpu import plan, ranshost, runtime

SPLIT_KERNEL = {layouts.BF16.layout_id: "split_bf16", layouts.FP16.layout_id: "split_fp16",
                layouts.FP32.layout_id: "split_fp32"}
# kernels/planes.cu: the planes, only their histograms, or both in one pass
SPLIT_KINDS = ("split", "hist", "split_hist")
ALIGN_PAYLOAD = 16  # payload offsets in a group's buffer

# how a row is stored once chosen (``choose.choose``)
FORM_RAW, FORM_BITPACK, FORM_CONST, FORM_RANS, FORM_GDEFLATE, FORM_BITPACK_W = range(6)
FORM_CODEC = np.array([codecs.RAW, codecs.BITPACK, codecs.RANS, codecs.RANS, codecs.GDEFLATE,
                       codecs.BITPACK_W], np.int64)


class Planes:
    """The planes of a group (or of one large tensor), one row per plane: items in order, each
    item's planes in its layout's field order, as its ``CodedTensor`` lists them. A training
    state has about 1,600 planes, and a Python step per plane cost more host time than the
    whole device pass, so every stage works on all rows at once.

    At creation a row says what the plane is and where it lies: ``item``, ``kind``, ``index``,
    ``n`` (elements), ``bits`` (its field's), ``ptr`` (device address), ``pw`` (bits per
    element as stored there: 8, or packed as bitpack-w), and either ``counts`` (a [P, 256]
    histogram) or the device's figures ``stats`` and table bytes ``tdev``. ``choose.candidates``
    then adds each plane's candidate codecs and estimates, ``choose.choose`` its codec, stored
    size and host bytes, and the assembly its ``offset`` and ``checksum``."""

    def __init__(self, item, kind, index, n, ptr, counts, stats=None, tdev=None,
                 bits=None, pw=None) -> None:
        self.item = np.asarray(item, np.int64)
        self.kind = np.asarray(kind, np.int64)
        self.index = np.asarray(index, np.int64)
        self.n = np.asarray(n, np.int64)
        self.ptr = np.asarray(ptr, np.uint64)
        self.bits = np.full(self.n.size, 8, np.int64) if bits is None else np.asarray(
            bits, np.int64)
        self.pw = (np.where(self.kind == layouts.KIND_SIGN, 1, 8) if pw is None
                   else np.asarray(pw, np.int64))
        self.counts = None if counts is None else np.asarray(counts, np.int64).reshape(-1, 256)
        self.stats = None if stats is None else np.asarray(stats, np.int64).reshape(-1, 4)
        self.tdev = None if tdev is None else np.asarray(tdev, np.uint64)
        self.offset = np.full(self.n.size, -1, np.int64)
        self.checksum = np.zeros(self.n.size, np.uint64)
        # normalised frequencies already made (the device's ``rans_normalise``), and the
        # device address of each row's encoder-table input (0: none), or None
        self.freqs: np.ndarray | None = None
        self.tab: np.ndarray | None = None
        self.tables: object = None  # the device buffer ``tab`` points into, while needed
        # the buffer of the planes the split packs (``place_split``), their offsets in it (-1:
        # a row not there)
        self.fixed: torch.Tensor | None = None
        self.fixed_off = np.full(self.n.size, -1, np.int64)
        # a rANS launch already queued over rows ``launched`` (``histograms``), or None
        self.rans_queued: dict | None = None
        # the most rANS words each row can take (``ranshost.WORD_COST``: the device's
        # rans_normalise sums it), where the window's figures came from the device, or None
        self.words: np.ndarray | None = None

    _CHOSEN = ("nsym", "sym0", "tsize", "est_rans", "est_bp", "cand_rans", "cand_bp", "cand_gd",
               "runs_rans", "launched", "width", "est_bw", "cand_bw", "bw_first", "words")

    def take(self, rows: np.ndarray, item: np.ndarray) -> Planes:
        """Rows ``rows`` as a table of their own, ``item`` their items' positions there (a
        group's rows of its window's table), with what ``choose.candidates`` set."""
        out = Planes(item, self.kind[rows], self.index[rows], self.n[rows], self.ptr[rows],
                     None if self.counts is None else self.counts[rows],
                     None if self.stats is None else self.stats[rows],
                     None if self.tdev is None else self.tdev[rows], self.bits[rows],
                     self.pw[rows])
        out.freqs = None if self.freqs is None else self.freqs[rows]
        out.tab = None if self.tab is None else self.tab[rows]
        for name in self._CHOSEN:
            if getattr(self, name, None) is not None:
                setattr(out, name, getattr(self, name)[rows])
        return out

    def __len__(self) -> int:
        return int(self.n.size)

    @classmethod
    def of_tensor(cls, layout: Layout, n: int, hist: np.ndarray, ones: int) -> Planes:
        """The planes of one split tensor of ``n`` elements from the split kernel's histograms
        (``hist``: 256 bins per byte plane; ``ones``: set sign bits); no device addresses
        (the chunked coder gives each chunk's)."""
        nf = len(layout.fields)
        counts = np.zeros((nf, 256), np.int64)
        counts[0, :2] = n - ones, ones
        counts[1:] = np.asarray(hist, np.int64)[:256 * (nf - 1)].reshape(nf - 1, 256)
        return cls(np.zeros(nf), [f.kind for f in layout.fields],
                   [f.index for f in layout.fields], np.full(nf, n), np.zeros(nf), counts,
                   bits=[f.bits for f in layout.fields])


@functools.cache
def _field_table() -> np.ndarray:
    """[layout id, 4, 5] int64, for the layouts the GPU splits (``plan.SPLIT_DTYPES``): the
    fields' bits, kinds and indexes (padded to 5 fields), then the word size and field count
    (read-only)."""
    lays = {lay.layout_id: lay for lay in plan.SPLIT_DTYPES.values()}
    out = np.zeros((max(lays) + 1, 4, 5), np.int64)
    for i, lay in lays.items():
        f = lay.fields
        out[i, 0, :len(f)] = [x.bits for x in f]
        out[i, 1, :len(f)] = [x.kind for x in f]
        out[i, 2, :len(f)] = [x.index for x in f]
        out[i, 3, :2] = lay.word, len(f)
    out.flags.writeable = False
    return out


def field_rows(lays: list[Layout]) -> tuple[np.ndarray, ...]:
    """The split rows of tensors of split layouts ``lays`` (a row per field, tensor by tensor),
    without a Python step per row: (each tensor's layout id, field count; each row's tensor,
    field, bits, kind and index; each tensor's word size)."""
    ids = np.array([lay.layout_id for lay in lays], np.int64)
    tab = _field_table()
    word, nf = tab[ids, 3, 0], tab[ids, 3, 1]
    seg = np.repeat(np.arange(ids.size), nf)
    field = np.arange(int(nf.sum())) - np.repeat(np.cumsum(nf) - nf, nf)
    at = ids[seg]
    return ids, nf, seg, field, tab[at, 0, field], tab[at, 1, field], tab[at, 2, field], word


def params_of(pl: Planes, q: int) -> bytes:
    """The codec parameters of row q's payload: bitpack-w's width byte, else none."""
    return bytes([int(pl.width[q])]) if pl.form[q] == FORM_BITPACK_W else b""


def narrow(pl: Planes) -> np.ndarray:
    """Rows of mantissa fields narrower than a byte (the bf16 and fp32 7-bit, the fp16 2-bit
    planes): the split kernels can store these as bitpack-w at the field's width."""
    return narrow_fields(pl.kind, pl.bits)


def narrow_fields(kind, bits) -> np.ndarray:
    """Which fields (``kind``, ``bits``) are mantissa fields narrower than a byte."""
    return (np.asarray(kind, np.int64) == layouts.KIND_MANTISSA) & (np.asarray(bits) < 8)


def pack_widths(pl: Planes) -> np.ndarray:
    """How a group's split stores each row once its candidates are known (``Planes.pw``): sign
    bits packed (1); a narrow mantissa plane whose codec is sure to be bitpack-w at its field's
    full width (ranked first: no other candidate can take it) packed at that width, so the
    assembly copies it as it is; every other plane a byte per element."""
    packed = narrow(pl) & pl.bw_first & (pl.width == pl.bits)
    return np.where(pl.kind == layouts.KIND_SIGN, 1, np.where(packed, pl.bits, 8))


def stays_raw(pl: Planes) -> np.ndarray:
    """Split rows with no candidate codec (``choose.candidates``): stored raw whatever the rANS
    kernel finds, their payload the split's bytes as they are (the uniform low mantissa bytes
    of fp32 tensors and optimizer state: about half of their bytes)."""
    return ((pl.kind != layouts.KIND_RAW) & (pl.kind != layouts.KIND_SIGN)
            & ~(pl.cand_rans | pl.cand_bp | pl.cand_bw | pl.cand_gd))


def kept_as_split(pl: Planes, width: np.ndarray, raw: bool = True) -> np.ndarray:
    """The rows whose payload is sure to be the split's bytes as stored (``width``:
    :func:`pack_widths`): narrow planes packed at their field's width and (``raw``) planes with
    no candidate. The split writes them where the group's result keeps them, so the assembly
    copies nothing for them and ``plan.group_need`` counts their bytes once."""
    kept = narrow(pl) & (width < 8)
    return kept | stays_raw(pl) if raw else kept


def stored_bound(pl: Planes, width: np.ndarray, kept: np.ndarray,
                 log2_block: int = rans.LOG2_BLOCK_DEFAULT) -> np.ndarray:
    """An upper bound on each row's stored bytes before the codecs are chosen, to size a group
    (``width``: :func:`pack_widths`, ``kept``: :func:`kept_as_split`): a kept row's packed
    bytes; the size of a codec sure to be chosen (bitpack-w or bitpack ranked first, a
    one-symbol CONST stream, a rANS stream whose most words stay under the plane's bytes);
    else the plane's bytes, as raw is never larger. A tensor whose bounds sum past its raw
    bytes may go to the CPU coder."""
    n = pl.n
    bp_sure = pl.cand_bp & ~(pl.cand_rans & (pl.est_rans < pl.est_bp))
    out = np.where(pl.bw_first, pl.est_bw, np.where(bp_sure, pl.est_bp, n))
    # a plane of one symbol whose CONST stream (its estimate, exactly) ranks first
    const_sure = (pl.cand_rans & (pl.nsym == 1) & ~pl.bw_first
                  & (~pl.cand_bp | (pl.est_rans < pl.est_bp)))
    out = np.where(const_sure, pl.est_rans, out)
    if pl.words is not None:
        # runs_rans: rANS ranks first (not bitpack's nor bitpack-w's turn); a stream of at
        # most ``most`` bytes under n is sure to be taken (choose: its real size is under n)
        most = (ranshost.HEADER_SIZE + pl.tsize + rans.BLOCK_OVERHEAD * -(-n >> log2_block)
                + 2 * pl.words)
        out = np.where(pl.runs_rans & (most < n), most, out)
    return np.where(kept, plan.packed_bytes(n, width), out)


def place_split(n: np.ndarray, width: np.ndarray, packed: np.ndarray
                ) -> tuple[np.ndarray, int, int]:
    """Where a group's split stores its rows (``n`` elements at ``width`` bits each): the
    ``packed`` rows back to back in a buffer the group's result keeps as payload, the others
    in the planes buffer, freed after the assembly. Returns (each row's offset in its buffer,
    the planes buffer's bytes, the packed one's)."""
    size = plan.split_plane_bytes(n, width)
    off = np.zeros(size.size, np.int64)
    totals = []
    for sel in (~packed, packed):
        s_ = size[sel]
        off[sel] = np.cumsum(s_) - s_
        totals.append(int(s_.sum()))
    return off, totals[0], totals[1]


def launch_split(layout_id: int, src: list[int], nelems,
                 planes: list[list[int]] | np.ndarray | None, hist_p: int, ones_p: int,
                 batch: runtime.Batch | None = None, kind: str = "split",
                 chunks: tuple[np.ndarray, np.ndarray] | None = None,
                 pack: np.ndarray | None = None) -> torch.Tensor | None:
    """One split launch (``kernels/planes.cu``) over tensors of one layout. Tensor r has
    ``nelems[r]`` elements at ``src[r]`` and its planes, packed sign bits first, at
    ``planes[r]``. ``kind`` "split" writes the planes; "hist" adds each tensor's byte
    histograms (1024 u64 at ``hist_p + 8192 r``) and set sign bits (a u64 at ``ones_p + 8 r``);
    "split_hist" does both. ``pack[r]``: tensor r's narrow mantissa plane is stored as
    bitpack-w at its field's width (4-byte aligned). ``chunks``: ``plan.chunk_table(nelems)``
    if made already. With a ``batch`` the launch joins it; else it runs now and its device
    table is returned (stream-ordered: keep it or drop it)."""
    if kind not in SPLIT_KINDS:
        raise ValueError(f"kind must be one of {SPLIT_KINDS}")
    cs, c0 = plan.chunk_table(nelems) if chunks is None else chunks
    table = np.zeros((len(src), 5), dtype=np.uint64)
    if isinstance(planes, np.ndarray):
        table[:, :planes.shape[1]] = planes
    elif planes is not None:
        for r, addrs in enumerate(planes):
            table[r, :len(addrs)] = addrs
    own = batch is None
    batch = runtime.Batch() if own else batch
    name = SPLIT_KERNEL[layout_id].replace("split", kind, 1)
    pack = np.zeros(len(src), np.uint8) if pack is None else np.asarray(pack, np.uint8)
    if pack.any() and (table[pack != 0, 2] % 4).any():
        raise ValueError("a packed plane must be 4-byte aligned")
    batch.launch("planes", name, cs.size, 256,
                 *batch.table(cs, c0, np.asarray(src, dtype=np.uint64),
                              np.asarray(nelems, dtype=np.int64), table, pack),
                 np.uint64(hist_p), np.uint64(ones_p))
    return batch.run() if own else None
