"""The fused rANS-decode + merge path's planning (``s4weights.gpu.fused``), on the CPU: planes
coded by the CPU coder are laid out in a byte array standing in for device memory, the tables
``fused.plan`` builds are run through a model of ``kernels/fused.cu`` (same per-lane
arithmetic, rows from the last, lanes in step), and the words it writes must be the tensor's
bytes. Damaged words must give the block and plane the kernel reports. The kernel itself runs
in the GPU tests (every read through the GPU decoder of a bf16/fp16/fp32 tensor with rANS
planes goes this way)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from s4format import codecs, layouts
from s4format.codecs import rans
from s4format.codecs.rans import RansCodec
from s4weights.gpu import fused
from s4weights.gpu.ranshost import parse_streams

RNG = np.random.default_rng(11)
BASE = 1 << 40  # "device" address of mem[0]
LAYOUT = {2: {"bfloat16": layouts.BF16, "float16": layouts.FP16}, 4: {"float32": layouts.FP32}}


@dataclass
class P:  # a plane record, as the reader's
    codec: int
    decoded_len: int
    stored_len: int


@dataclass
class T:  # a tensor record, as the reader's
    layout: layouts.Layout
    planes: list[P]


def _words(dtype: str, n: int) -> np.ndarray:
    if dtype == "float32":
        w = (RNG.standard_normal(n).astype(np.float32) * np.float32(0.02)).view(np.uint32)
        w &= np.uint32(0xFFF0FFFF)  # a skewed first mantissa byte: its stream codes in RANS mode
        w[::97] = RNG.integers(0, 2**32, w[::97].size, dtype=np.uint32)  # any bit pattern
        return w
    w = RNG.standard_normal(n).astype(np.float32) * np.float32(0.02)
    w = (w.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" \
        else w.astype(np.float16).view(np.uint16)
    if dtype == "bfloat16":
        w &= np.uint16(0xFFF0)  # a skewed mantissa: its stream codes in RANS mode
    w[::89] = RNG.integers(0, 2**16, w[::89].size, dtype=np.uint16)
    return w


def _code(plane: np.ndarray, how: str, lb: int) -> tuple[int, np.ndarray]:
    if how == "bitpack":
        return codecs.BITPACK, np.packbits(plane, bitorder="little")
    if how == "raw":
        return codecs.RAW, plane.copy()
    if how == "raw-stream":  # a rans stream in RAW mode
        return codecs.RANS, rans._raw_stream(plane, lb)
    return codecs.RANS, RansCodec(lb).encode(plane).payload


class Mem:
    """A byte array addressed from BASE; objects are placed 16-byte aligned."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def put(self, data: np.ndarray) -> int:
        self.buf += bytes(-len(self.buf) % 16)
        at = len(self.buf)
        self.buf += np.ascontiguousarray(data).view(np.uint8).tobytes()
        return BASE + at

    def array(self) -> np.ndarray:
        return np.frombuffer(bytes(self.buf), np.uint8).copy()


def _stage(specs, lb: int = 9):
    """Code each (dtype, n, plane codings) tensor; lay the stored planes out in one host buffer
    (the staging) mirrored at BASE, as decode.stage does. Returns the records, the original
    words, the fused tensors (destinations allocated in mem), the staging and the streams."""
    mem, host_at, records, originals, ftens, rows = Mem(), [], [], [], [], []
    for pos, (dtype, n, hows) in enumerate(specs):
        words = _words(dtype, n)
        isz = words.itemsize
        lay = LAYOUT[isz][dtype]
        planes = lay.split(words.view(np.uint8), isz)
        recs, ats, srcs = [], [], []
        for plane, how in zip(planes, hows):
            codec, stored = _code(plane, how, lb)
            a = mem.put(stored)
            recs.append(P(codec, plane.size, stored.size))
            ats.append(a - BASE)
            srcs.append(a)
        records.append(T(lay, recs))
        originals.append(words)
        host_at.append(ats)
        out = mem.put(np.full(n * isz, 0xAB, np.uint8))
        ftens.append((pos, lay.layout_id, out, n, recs, srcs))
    host = mem.array()
    # the rANS batch: every rans plane of every tensor, in order
    fts = []
    for pos, lay_id, out, n, recs, srcs in ftens:
        ft = fused.Tensor(pos, lay_id, out, n, [])
        for p, src in zip(recs, srcs):
            if p.codec == codecs.RANS:
                rows.append((src - BASE, p.stored_len, p.decoded_len))
                ft.planes.append(fused.Plane(fused.K_RANS, src, len(rows) - 1))
            else:
                ft.planes.append(fused.Plane(fused.K_BITS if p.codec == codecs.BITPACK
                                             else fused.K_BYTES, src))
        fts.append(ft)
    at = np.array([r[0] for r in rows], np.int64)
    st = parse_streams(host, at, [r[1] for r in rows], [r[2] for r in rows])
    cums = (np.cumsum(st.freqs, axis=1) - st.freqs).astype(np.uint32)
    tab_addr = BASE + host.size + (-host.size % 16)
    host = np.concatenate([host, np.zeros(-host.size % 16, np.uint8), cums.view(np.uint8).ravel()])
    return records, originals, host_at, fts, host, at, st, tab_addr


def _u32(mem, addr, count):
    a = addr - BASE
    return mem[a:a + 4 * count].view("<u4").astype(np.int64)


def _dtab(cum: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = np.append(cum, 4096)
    s = np.searchsorted(c, np.arange(4096), side="right") - 1
    return s, c[s + 1] - c[s], np.arange(4096) - c[s]  # symbol, freq, slot - cum


def run_model(fp: fused.Plan, mem: np.ndarray, word_size: int):
    """The kernel, block by block: returns (per-block error codes, per-tensor range flags) and
    writes the merged words into ``mem``."""
    lay = layouts.by_id(fp.layout_id)
    shifts = [f.shift for f in lay.planes(word_size)[1:]]
    masks = [(1 << f.bits) - 1 for f in lay.planes(word_size)[1:]]
    top = 8 * word_size - 1
    blk_err = np.zeros(fp.nblocks, np.int64)
    t_err = np.zeros(len(fp.tensors), np.int64)
    lanes = np.arange(32)
    for b in range(fp.nblocks):
        t = int(fp.blk_tensor[b])
        tabs = [_dtab(_u32(mem, int(fp.t_cum[t, s]), 256)) if fp.t_cum[t, s] else None
                for s in range(fused.TABLES)]
        lb = int(fp.t_lb[t])
        j = b - int(fp.t_first[t])
        start = j << lb
        ln = min(1 << lb, int(fp.t_n[t]) - start)
        nk = len(lay.planes(word_size))
        kind = fp.tp_kind[t, :nk].astype(int)
        x, p, err = {}, {}, 0
        for k in range(nk):
            if kind[k] == fused.K_RANS:
                x[k] = _u32(mem, int(fp.tp_ptr[t, k]) + 128 * j, 32)
                p[k] = int(fp.bp_count[b, k])
                if ((x[k] < 1 << 15) | (x[k] >= 1 << 31)).any() and not err:
                    err = 1 | k << 8
        if err:
            blk_err[b] = err
            continue
        bad = 0
        for r in range((ln + 31) // 32 - 1, -1, -1):
            i = 32 * r + lanes
            act = i < ln
            e = start + i
            w = np.zeros(32, np.int64)
            for k in range(nk):
                if kind[k] == fused.K_RANS:
                    sym, f, off = tabs[int(fp.tp_tab[t, k])]
                    slot = x[k] & 4095
                    v = np.where(act, sym[slot], 0)
                    x[k] = np.where(act, f[slot] * (x[k] >> 12) + off[slot], x[k])
                    need = act & (x[k] < 1 << 15)
                    total = int(need.sum())
                    if total > p[k]:
                        err = err or 2 | k << 8
                        continue
                    p[k] -= total
                    idx = p[k] + np.cumsum(need) - need
                    wa = int(fp.bp_words[b, k]) - BASE
                    got = mem[wa + 2 * idx] | mem[wa + 2 * idx + 1].astype(np.int64) << 8
                    x[k] = np.where(need, x[k] << 16 | got, x[k])
                else:
                    src = int(fp.tp_ptr[t, k]) - BASE
                    if kind[k] == fused.K_BITS:
                        v = (mem[src + (e[act] >> 3)].astype(np.int64) >> (e[act] & 7)) & 1
                    else:
                        v = mem[src + (e[act] >> int(fp.tp_shift[t, k]))].astype(np.int64)
                    full = np.zeros(32, np.int64)
                    full[act] = v
                    v = full
                bad |= int((v & ~(1 if k == 0 else masks[k - 1])).any())
                w |= v << (top if k == 0 else shifts[k - 1])
            if err:
                break
            o = int(fp.t_out[t]) - BASE + word_size * (start + i[act])
            for q in range(word_size):
                mem[o + q] = (w[act] >> (8 * q)) & 0xFF
        for k in range(nk):
            if kind[k] == fused.K_RANS and not err:
                if p[k]:
                    err = 3 | k << 8
                elif (x[k] != 1 << 15).any():
                    err = 4 | k << 8
        blk_err[b] = err
        t_err[t] |= bad
    return blk_err, t_err


SPECS = {
    "bf16 sign bitpack, exponent and mantissa rans":
        [("bfloat16", 3001, ["bitpack", "rans", "rans"])],
    "bf16 raw sign, raw-mode mantissa": [("bfloat16", 1000, ["raw", "rans", "raw-stream"])],
    "fp16 with a raw plane": [("float16", 2100, ["bitpack", "rans", "rans", "raw"])],
    "fp32": [("float32", 1500, ["bitpack", "rans", "rans", "raw", "raw"])],
    "several tensors": [("bfloat16", 700, ["bitpack", "rans", "rans"]),
                        ("bfloat16", 600, ["bitpack", "rans", "raw"]),
                        ("bfloat16", 5000, ["bitpack", "rans", "rans"])],
}


def _plan(specs, lb=9, edit=None):
    records, originals, host_at, fts, host, at, st, tab_addr = _stage(specs, lb)
    for rec, ats in zip(records, host_at):
        assert fused.fusable(rec, host, ats)
    fp = fused.plan(fts, host, at, st, tab_addr)
    mem = host.copy()
    if edit:
        edit(mem, fp, st, at)
    return fp, mem, originals


@pytest.mark.parametrize("name", list(SPECS))
def test_model_decodes_every_tensor(name):
    fp, mem, originals = _plan(SPECS[name])
    isz = originals[0].itemsize
    blk_err, t_err = run_model(fp, mem, isz)
    assert not blk_err.any() and not t_err.any()
    for ft, w in zip(fp.tensors, originals):
        o = ft.out - BASE
        assert np.array_equal(mem[o:o + w.nbytes].view(w.dtype), w), name


def test_const_and_raw_mode_planes_become_byte_sources():
    # a non-negative tensor: its sign plane (one symbol) is a CONST stream, read at its
    # log2_block's granularity
    w = _words("float32", 1500) & np.uint32(0x7FFFFFFF)
    lay = layouts.FP32
    planes = lay.split(w.view(np.uint8), 4)
    stream = RansCodec(9).encode(planes[0]).payload
    assert stream[0] == rans.MODE_CONST
    mem = Mem()
    srcs, recs = [], []
    for plane, how in zip(planes, ["rans", "rans", "rans", "raw", "raw"]):
        codec, stored = _code(plane, how, 9)
        srcs.append(mem.put(stored))
        recs.append(P(codec, plane.size, stored.size))
    out = mem.put(np.zeros(w.nbytes, np.uint8))
    host = mem.array()
    rows, ft = [], fused.Tensor(0, lay.layout_id, out, w.size, [])
    for p, src in zip(recs, srcs):
        if p.codec == codecs.RANS:
            rows.append((src - BASE, p.stored_len, p.decoded_len))
            ft.planes.append(fused.Plane(fused.K_RANS, src, len(rows) - 1))
        else:
            ft.planes.append(fused.Plane(fused.K_BYTES, src))
    at = np.array([r[0] for r in rows], np.int64)
    assert fused.fusable(T(lay, recs), host, [s - BASE for s in srcs])
    st = parse_streams(host, at, [r[1] for r in rows], [r[2] for r in rows])
    cums = (np.cumsum(st.freqs, axis=1) - st.freqs).astype(np.uint32)
    tab_addr = BASE + host.size + (-host.size % 16)
    host = np.concatenate([host, np.zeros(-host.size % 16, np.uint8), cums.view(np.uint8).ravel()])
    fp = fused.plan([ft], host, at, st, tab_addr)
    assert fp.tp_kind[0, 0] == fused.K_BYTES and fp.tp_shift[0, 0] == rans.LOG2_BLOCK_MAX
    blk_err, t_err = run_model(fp, host, 4)
    assert not blk_err.any() and not t_err.any()
    assert np.array_equal(host[out - BASE:out - BASE + w.nbytes].view(np.uint32), w)


def test_not_fusable():
    specs = [("bfloat16", 3001, ["bitpack", "rans", "rans"])]
    records, _o, host_at, _f, host, _a, _s, _t = _stage(specs)
    rec, ats = records[0], host_at[0]
    assert fused.fusable(rec, host, ats)
    # streams with different block sizes
    _r2, _o2, at2, _f2, host2, *_ = _stage([("bfloat16", 3001, ["bitpack", "rans", "rans"])])
    h = host2.copy()
    h[at2[0][2] + 1] = 7
    assert not fused.fusable(_r2[0], h, at2[0])
    # a codec the kernel does not read in place
    for codec in (codecs.GDEFLATE, codecs.ZSTD):
        planes = list(rec.planes)
        planes[2] = P(codec, planes[2].decoded_len, planes[2].stored_len)
        assert not fused.fusable(T(rec.layout, planes), host, ats)
    # bitpack on a plane other than the sign
    planes = list(rec.planes)
    planes[2] = P(codecs.BITPACK, planes[2].decoded_len, planes[2].stored_len)
    assert not fused.fusable(T(rec.layout, planes), host, ats)
    # no RANS-mode stream at all (a plain merge does it)
    _r3, _o3, at3, *_rest = _stage([("bfloat16", 500, ["bitpack", "raw", "raw-stream"])])
    assert not fused.fusable(_r3[0], _rest[1], at3[0])
    # a raw layout, and an empty tensor
    assert not fused.fusable(T(layouts.RAW, rec.planes), host, ats)
    assert not fused.fusable(T(rec.layout, [P(codecs.RAW, 0, 0)] * 3), host, ats)


def test_damaged_words_name_block_and_plane():
    specs = [("bfloat16", 3001, ["bitpack", "rans", "rans"])]

    def flip(mem, fp, st, at):
        # a word of block 5's mantissa stream (plane 2)
        a = int(fp.bp_words[5, 2]) - BASE
        mem[a + 2] ^= 0x5A

    fp, mem, _ = _plan(specs, edit=flip)
    blk_err, _t = run_model(fp, mem, 2)
    bad = np.flatnonzero(blk_err)
    assert bad.size and bad[0] == 5 and blk_err[5] >> 8 == 2 and blk_err[5] & 0xFF in (2, 3, 4)
    f, j, nb = fp.where_block(5)
    assert (f, j, nb) == (0, 5, -(-3001 // 512))
    assert fp.tensors[f].planes[2].row == 1  # the mantissa's stream row: names the plane


def test_out_of_range_state_and_field_bits():
    specs = [("bfloat16", 700, ["bitpack", "rans", "rans"]),
             ("bfloat16", 500, ["raw", "rans", "raw"])]

    def edit(mem, fp, st, at):
        a = int(fp.tp_ptr[0, 1]) - BASE + 128 * 1  # block 1 of plane 1: a state of 0
        mem[a:a + 4] = 0
        o = int(fp.tp_ptr[1, 0]) - BASE           # tensor 1's raw sign byte: 2 is not a bit
        mem[o + 7] = 2

    fp, mem, _ = _plan(specs, edit=edit)
    blk_err, t_err = run_model(fp, mem, 2)
    assert blk_err.tolist()[:2] == [0, 1 | 1 << 8]
    assert t_err.tolist() == [0, 1]


def test_tables_are_per_layout_launch_shaped():
    specs = SPECS["several tensors"]
    fp, _mem, _o = _plan(specs)
    assert fp.t_first.tolist() == [0, 2, 4]
    assert fp.nblocks == 2 + 2 + 10
    assert fp.bp_words.shape == (fp.nblocks, fused.SLOTS)
    # every CTA takes blocks of one tensor
    for c, n in zip(fp.cta_first.tolist(), fp.cta_warps.tolist()):
        assert len(set(fp.blk_tensor[c:c + n].tolist())) == 1
    # a tensor with one RANS-mode stream uses one table slot
    assert fp.t_cum[1, 1] == 0 and fp.t_cum[1, 0] != 0
