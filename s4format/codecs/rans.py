"""Codec 4, ``rans``: S4 rANS, the open order-0 entropy coder of exponent planes (``spec/rans.md``).

This module owns the CPU reference encoder and decoder of the S4 rANS stream. The spec is
normative; this code follows it step by step and names its constants after it. Invariants:

* One frequency table per plane (12-bit precision, sums to 4096), built by the spec's integer
  normalisation, so the GPU encoder emits the very same bytes.
* A block of ``2**log2_block`` symbols is coded by 32 interleaved lanes (symbol ``i`` of the block
  goes to lane ``i % 32``); blocks are independent, so both sides code runs of blocks on the
  worker threads and the output does not depend on the thread count.
* Decoding validates every length, offset and state before indexing: numba does not bounds-check,
  so the kernels only ever see indices that the Python-side checks have proven in range. A bad
  stream raises :class:`~s4format.errors.CodecError`; it never crashes, hangs or over-allocates.
* The kernels read and write little-endian words through native numpy views, which assumes a
  little-endian host (every platform numba supports).
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np

from s4format import threads
from s4format.codecs.abc import Codec, Encoded, Slicer
from s4format.codecs.registry import RANS, register
from s4format.codecs.view import PIECE, PlaneView
from s4format.errors import CodecError, LimitError
from s4format.jit import any_vectors, constant, intrinsic, kernel, permute8, vbmi2_vectors

LANES = 32
PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 15                      # states live in [STATE_LOW, STATE_HIGH)
STATE_HIGH = 1 << 31
WORD_BITS = 16
# Encoder renormalises while x >= freq << _XMAX_SHIFT, so that the coded state stays < 2**31.
_XMAX_SHIFT = 31 - PROB_BITS

MODE_RAW = 0
MODE_CONST = 1
MODE_RANS = 2
HEADER = struct.Struct("<BBHQ")          # mode, log2_block, reserved (0), symbol count n
HEADER_SIZE = HEADER.size                # 12
LOG2_BLOCK_MIN = 5
LOG2_BLOCK_MAX = 20
LOG2_BLOCK_DEFAULT = 16
MAX_SYMBOLS = 1 << 48                    # keeps count * 4096 exact in int64 during normalisation
BITMAP_SIZE = 32
BLOCK_OVERHEAD = 4 + 4 * LANES           # word count + 32 final states per block, in bytes
# One block decodes at about 1.0 ns a symbol on one core and two or more at about 0.6, the
# decoder interleaving their rows: at the default size a plane of SPLIT_FROM to SPLIT_BELOW
# symbols is cut into blocks of a quarter to a half of it (spec/rans.md, section 9).
SPLIT_FROM, SPLIT_BELOW = 1 << 15, 1 << 17

_ERR_STATE, _ERR_UNDERFLOW, _ERR_LEFTOVER, _ERR_FINAL = 1, 2, 3, 4
_ERR_TEXT = {
    _ERR_STATE: "a final state lies outside [2^15, 2^31)",
    _ERR_UNDERFLOW: "the decoder needs more words than the block stores",
    _ERR_LEFTOVER: "words are left over after the block's first row",
    _ERR_FINAL: "a lane does not end in the initial state 2^15",
}


# ---------------------------------------------------------------------------------------------
# Frequency table: normalisation and its compact encoding (spec/rans.md, "Frequency table")


def normalise(counts: np.ndarray) -> np.ndarray:
    """Scale symbol counts to integer frequencies summing to 4096 (spec's exact procedure).

    Every present symbol is reserved a frequency of 1; the remaining ``4096 - k`` are shared in
    proportion to the counts by floor division, and the few left over go one each to the largest
    remainders, ties to the lower symbol. Integer-only, so every implementation agrees.
    """
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if not counts.any():
        raise ValueError("cannot normalise an empty histogram")
    freqs = np.empty(256, dtype=np.int64)
    _normalise(counts, freqs)  # (compiled: 38 us in numpy, a few per plane)
    return freqs


@kernel()
def _normalise(counts, freqs):  # pragma: no cover - compiled
    total, k = 0, 0
    for s in range(256):
        total += counts[s]
        k += counts[s] > 0
    spare = PROB_SCALE - k
    left = PROB_SCALE
    # Each present symbol's remainder as a key that sorts the largest first, the lowest symbol
    # of equals first, with the symbol in its low byte. The units left are fewer than the
    # symbols present, so they go to that many symbols, one each. (A scan of all 256 for each
    # unit took up to 34 us a table, 3.5% of a CPU save of weights and AdamW state.)
    keys = np.empty(k, dtype=np.int64)
    m = 0
    for s in range(256):
        share = counts[s] * spare
        freqs[s] = share // total + (counts[s] > 0)
        left -= freqs[s]
        if counts[s] > 0:
            keys[m] = (total - 1 - share % total) * 256 + s
            m += 1
    if left > 0:
        keys.sort()
        for j in range(left):
            freqs[keys[j] & 255] += 1


@kernel(inline="always")
def table_len(k):
    """Bytes of :func:`table_bytes` for ``k`` present symbols."""
    size = BITMAP_SIZE + 2 * k
    return size + (4 - size % 4) % 4


# Bits a symbol of frequency f costs: 12 - log2(f) (index 0 unused).
SYMBOL_BITS = PROB_BITS - np.log2(np.maximum(np.arange(PROB_SCALE + 1), 1))


@kernel()
def _estimate_bits(counts, freqs, symbol_bits):  # pragma: no cover - compiled
    """(bits of the counted symbols under their normalised table, symbols present, total
    count), the table normalised into ``freqs`` where two symbols or more are present. The
    costs are summed in symbol order, as the GPU's estimate sums them, so the two agree."""
    total, k = 0, 0
    for s in range(256):
        total += counts[s]
        k += counts[s] > 0
    if k < 2:
        return 0.0, k, total
    _normalise(counts, freqs)
    bits = 0.0
    for s in range(256):
        bits += counts[s] * symbol_bits[freqs[s]]
    return bits, k, total


def table_bytes(freqs: np.ndarray) -> bytes:
    """Presence bitmap (32 bytes, LSB first) + u16 LE frequency per present symbol, 4-aligned."""
    present = freqs > 0
    bitmap = np.packbits(present, bitorder="little").tobytes()
    body = freqs[present].astype("<u2").tobytes()
    pad = -(BITMAP_SIZE + len(body)) % 4
    return bitmap + body + bytes(pad)


def _parse_table(buf: np.ndarray, pos: int) -> tuple[np.ndarray, int]:
    """Read and validate the table at ``pos``; return (freqs[256], position after it)."""
    freqs = np.zeros(256, dtype=np.int64)
    fault, k, end = _table_at(buf, pos, freqs)
    if fault == _TAB_BITMAP:
        raise CodecError("rans stream ends inside the frequency table's presence bitmap")
    if fault == _TAB_EMPTY:
        raise CodecError("rans frequency table marks no symbol present")
    if fault == _TAB_SHORT:
        raise CodecError(f"rans stream ends inside the frequency table ({k} symbols)")
    if fault == _TAB_ZERO:
        raise CodecError("rans frequency table gives a present symbol frequency 0")
    if fault == _TAB_SUM:
        raise CodecError(f"rans frequencies sum to {k}, must sum to 4096")
    if fault == _TAB_PAD:
        raise CodecError("rans frequency table padding is not zero")
    return freqs, end


# What :func:`_table_at` finds wrong with a table, in the order it checks.
_TAB_BITMAP, _TAB_EMPTY, _TAB_SHORT, _TAB_ZERO, _TAB_SUM, _TAB_PAD = 1, 2, 3, 4, 5, 6


@kernel()
def _table_at(buf, pos, freqs):  # pragma: no cover - compiled
    """The table at ``pos`` into ``freqs`` (zeros): (fault, k or the frequencies' sum, end).
    (Compiled with :func:`_block_index`: a stream's setup took 22 us in numpy, 12 us so, a
    share of each small plane's decode.)"""
    if buf.size < pos + BITMAP_SIZE:
        return _TAB_BITMAP, 0, 0
    k = 0
    for s in range(256):
        k += (buf[pos + (s >> 3)] >> (s & 7)) & 1
    if k == 0:
        return _TAB_EMPTY, 0, 0
    size = BITMAP_SIZE + 2 * k
    end = pos + size + (4 - size % 4) % 4
    if buf.size < end:
        return _TAB_SHORT, k, 0
    at, total, zero = pos + BITMAP_SIZE, 0, False
    for s in range(256):
        if (buf[pos + (s >> 3)] >> (s & 7)) & 1:
            f = np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8)
            freqs[s] = f
            zero |= f == 0
            total += f
            at += 2
    if zero:
        return _TAB_ZERO, 0, 0
    if total != PROB_SCALE:
        return _TAB_SUM, total, 0
    for i in range(at, end):
        if buf[i]:
            return _TAB_PAD, 0, 0
    return 0, k, end


def _encoder_table(freqs: np.ndarray) -> np.ndarray:
    """Per symbol: x_max, reciprocal, shift, bias, 4096 - freq (exact division by multiply).

    The reciprocal form computes exactly ``(x // f) * 4096 + x % f + cum`` for x < 2**31
    (F. Giesen's rANS encoder), avoiding a hardware divide per symbol.
    """
    tab = np.zeros((256, 5), dtype=np.int64)
    _encoder_rows(np.ascontiguousarray(freqs, dtype=np.int64), tab)
    return tab


@kernel()
def _encoder_rows(freqs, tab):  # pragma: no cover - compiled
    cum = 0
    for s in range(256):
        f = freqs[s]
        if f >= 1:
            rcp, shift = _reciprocal(f)
            tab[s, 0], tab[s, 1], tab[s, 2] = f << _XMAX_SHIFT, rcp, shift
            tab[s, 3] = cum + PROB_SCALE - 1 if f == 1 else cum
            tab[s, 4] = PROB_SCALE - f
        cum += f


@kernel(inline="always")
def _reciprocal(f):  # pragma: no cover - compiled
    """(reciprocal, shift) dividing by frequency ``f`` >= 1 exactly (f = 1: the bias does it)."""
    if f == 1:
        return (1 << 32) - 1, 0
    bits = 0  # ceil(log2 f)
    while (1 << bits) < f:
        bits += 1
    return ((1 << (bits + 31)) + f - 1) // f, bits - 1


def _decoder_table(freqs: np.ndarray) -> np.ndarray:
    """Slot -> (freq - 1) << 20 | (slot - cum) << 8 | symbol, one load per decoded symbol
    (``freqs``: 256 frequencies summing to 4096, as :func:`_parse_table` checks)."""
    return _decoder_slots(np.ascontiguousarray(freqs, dtype=np.int64))


@kernel()
def _decoder_slots(freqs: np.ndarray) -> np.ndarray:
    # (compiled: a plane's table took ~90 us in numpy, a share of a small plane's decode; each
    # symbol's run filled by adding to one entry, unsigned, 2.0-2.5 us against 6.3-6.5 with
    # the entry built per slot, one thread of AMD's Zen 2, 2026-12-07)
    tab = np.empty(PROB_SCALE, dtype=np.uint32)
    cum = np.uint64(0)
    step = np.uint32(1 << 8)
    for s in range(256):
        f = np.uint64(freqs[s])
        e = np.uint32(((np.int64(freqs[s]) - 1) << 20) | s)
        run = tab[cum:cum + f]
        for j in range(f):
            run[j] = e
            e += step
        cum += f
    return tab


# ---------------------------------------------------------------------------------------------
# Kernels. Indices are unsigned: numba then skips its negative-index wraparound, which took
# a third of the encoder's time. Encoder states are uint64, decoder states uint32 (all below 2**31).


# Blocks the vector coders code at once, a row of each in turn: a row waits on the row before
# of its own block (a gather, then the state's update), so the others' rows fill the gaps.
# One thread, 16M bf16 exponents: decoding 2.0-2.1 GB/s against 1.2-1.6 two blocks at once
# (six or eight at once ran slower, their states spilling out of registers); encoding
# 0.91-0.96 ns a symbol against 1.01-1.04 one block at a time.
GROUP = 4

# Blocks per piece of work on a worker thread (about a million symbols at the default size).
_PIECE_SYMBOLS = 1 << 20


@kernel()
def _blocks_constant(words, shift, mask, log2_block):  # pragma: no cover - compiled
    n = words.size
    for start in range(0, n, 1 << log2_block):
        end = min(start + (1 << log2_block), n)
        first = (np.int64(words[start]) >> shift) & mask
        for i in range(start + 1, end):
            if (np.int64(words[i]) >> shift) & mask != first:
                return False
    return True


def _packed_table(tab: np.ndarray) -> np.ndarray:
    """:func:`_encoder_table` as the kernel reads it (:func:`_packed_rows`)."""
    return _packed_rows(np.ascontiguousarray(tab, dtype=np.int64))


@kernel()
def _packed_rows(tab):  # pragma: no cover - compiled
    """Per symbol four uint64: x_max, rcp, bias and (4096 - freq) << 8 | (32 + shift)."""
    out = np.empty(4 * 256, np.uint64)
    for s in range(256):
        out[4 * s] = tab[s, 0]
        out[4 * s + 1] = tab[s, 1]
        out[4 * s + 2] = tab[s, 3]
        out[4 * s + 3] = (tab[s, 4] << 8) | (tab[s, 2] + 32)
    return out


def _encode_blocks(plane: np.ndarray, log2_block: int, tab: np.ndarray, scratch: np.ndarray,
                   counts: np.ndarray, states: np.ndarray) -> None:
    """Encode every block of a plane of bytes (as :func:`_encode_range` does a field's)."""
    _encode_range(plane, 0, 0xFF, log2_block, _packed_table(tab), scratch, counts, states, 0,
                  counts.size)


@kernel()
def _encode_range(words, shift, mask, log2_block, tab, scratch, counts, states, b0, b1
                  ):  # pragma: no cover - compiled
    """Encode blocks [b0, b1) of field (shift, mask) of ``words`` with the table of
    :func:`_packed_table`; block b's words go to scratch[b << log2_block:] (at most one per
    symbol)."""
    n = np.uint64(words.size)
    sh, mk = np.uint64(shift), np.uint64(mask)
    x = np.empty(LANES, dtype=np.uint64)
    # Full rows run on vectors where the table is the exact-reciprocal one that the compact
    # form reproduces; any other table (and a partial row) takes the scalar rows below.
    ctab = np.empty(256, dtype=np.uint64)
    vector = (_vector_coding() and _encoder_arrays(scratch) and mk <= np.uint64(0xFF)
              and sh < np.uint64(8 * words.itemsize)
              and _compact_table(tab, ctab))
    lanes = np.uint64(LANES)
    size = np.uint64(1) << np.uint64(log2_block)
    done = b0  # (the blocks before it coded in groups)
    if vector and size >= lanes:  # GROUP full blocks at a time, their rows in turn
        xs = np.empty((GROUP, LANES), dtype=np.uint64)
        ws = np.empty(GROUP, dtype=np.uint64)
        while done + GROUP <= b1 and (np.uint64(done) + np.uint64(GROUP)) * size <= n:
            start = np.uint64(done) * size
            xs[:] = STATE_LOW
            for k in range(GROUP):
                ws[k] = start + np.uint64(k) * size
            for row in range(np.uint64(0), size, lanes):
                for k in range(GROUP):
                    ws[k] = _encode_row_vector(words, start + np.uint64(k) * size + row, sh, mk,
                                               ctab, xs[k], scratch, ws[k])
            for k in range(GROUP):
                counts[done + k] = ws[k] - (start + np.uint64(k) * size)
                for lane in range(LANES):
                    states[(done + k) * LANES + lane] = xs[k, lane]
            done += GROUP
    for b in range(done, b1):
        start = np.uint64(b) << np.uint64(log2_block)
        end = min(start + (np.uint64(1) << np.uint64(log2_block)), n)
        x[:] = STATE_LOW
        w = start
        first = start
        if vector:
            while end - first >= lanes:
                w = _encode_row_vector(words, first, sh, mk, ctab, x, scratch, w)
                first += lanes
        for row in range(first, end, LANES):
            row = np.uint64(row)
            for lane in range(min(np.uint64(LANES), end - row)):
                t = ((np.uint64(words[row + np.uint64(lane)]) >> sh) & mk) << np.uint64(2)
                xv = x[lane]
                # Lanes renormalise in lane order within a row: the warp-ballot order. The
                # store is unconditional (branch-free: the branch is unpredictable); w never
                # passes the current symbol's index, so it stays inside this block's region.
                need = np.uint64(xv >= tab[t])
                scratch[w] = np.uint16(xv & np.uint64(0xFFFF))
                w += need
                xv >>= need << np.uint64(4)
                c = tab[t + np.uint64(3)]
                q = (xv * tab[t + np.uint64(1)]) >> (c & np.uint64(0xFF))
                x[lane] = xv + tab[t + np.uint64(2)] + q * (c >> np.uint64(8))
        counts[b] = w - start
        for lane in range(LANES):
            states[b * LANES + lane] = x[lane]


@kernel(inline="always")
def _compact_table(tab, ctab):  # pragma: no cover - compiled
    """Pack :func:`_packed_table` into one uint64 per symbol, rcp | bias << 32 | f << 45 |
    shift << 58, for :func:`_encode_row_vector`; False unless every symbol's entry is the one
    :func:`_encoder_rows` makes for its frequency (or an absent symbol's zeros), so that the
    compact form codes exactly the same states."""
    for s in range(256):
        xmax, rcp, bias, c = tab[4 * s], tab[4 * s + 1], tab[4 * s + 2], tab[4 * s + 3]
        if bias >= np.uint64(1 << 13):
            return False
        if xmax == 0 and rcp == 0:
            ctab[s] = bias << np.uint64(32)
            continue
        f = np.int64(xmax >> np.uint64(_XMAX_SHIFT))
        if f < 1 or f > PROB_SCALE or xmax != np.uint64(f << _XMAX_SHIFT):
            return False
        want, shift = _reciprocal(f)
        if rcp != np.uint64(want) or c != np.uint64(((PROB_SCALE - f) << 8) | (32 + shift)):
            return False
        ctab[s] = rcp | (bias << np.uint64(32)) | (np.uint64(f) << np.uint64(45)) | (
            np.uint64(shift) << np.uint64(58))
    return True


class _RowVectors:
    """The instructions a vector row needs on ``context``'s target: AVX-512 (16 lanes a vector:
    gathers, expanding loads and compresses) or AVX2 (8 lanes: gathers, and a permute by a
    table indexed by the lanes' mask where AVX2 has no expand or compress)."""

    def __init__(self, context, builder) -> None:
        from llvmlite import ir
        from numba.core import cgutils

        self.b = builder
        self.avx512 = vbmi2_vectors(context)
        self.width = 16 if self.avx512 else 8
        self.i1, self.i8, self.i16, self.i32, self.i64 = (
            ir.IntType(b) for b in (1, 8, 16, 32, 64))
        self.bits = ir.IntType(self.width)
        self.ctpop = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(self.bits, [self.bits]), f"llvm.ctpop.i{self.width}")

        def function(name, ret, *params):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params),
                                                  name)

        i1, i8, i16, i32, i64, vec = self.i1, self.i8, self.i16, self.i32, self.i64, self.vec
        ptr = ir.PointerType(i8)
        v8 = lambda t: ir.VectorType(t, 8)  # noqa: E731
        if self.avx512:
            # The table by 32-bit slots, 16 entries an instruction: a gather by 64-bit pointers
            # takes two (MiniLM-L6's bf16 planes on one thread: 0.556 ns a symbol against
            # 0.662). The encoder's 64-bit entries, eight an instruction, by 32-bit symbols: by
            # 64-bit pointers took longer (0.82 ns a symbol against 0.99).
            self._gather32 = function("llvm.x86.avx512.mask.gather.dpi.512", vec(i32),
                                      vec(i32), ptr, vec(i32), vec(i1), i32)
            self._gather64 = function("llvm.x86.avx512.mask.gather.dpq.512", v8(i64),
                                      v8(i64), ptr, v8(i32), v8(i1), i32)
            self._expand = function(f"llvm.masked.expandload.v{self.width}i16", vec(i16),
                                    ir.PointerType(i16), vec(i1), vec(i16))
            self._compress = function(f"llvm.experimental.vector.compress.v{self.width}i16",
                                      vec(i16), vec(i16), vec(i1), vec(i16))
        else:
            self._gather32 = function("llvm.x86.avx2.gather.d.d.256", v8(i32),
                                      v8(i32), ptr, v8(i32), v8(i32), i8)
            self._gather64 = function("llvm.x86.avx2.gather.d.q.256", ir.VectorType(i64, 4),
                                      ir.VectorType(i64, 4), ptr, ir.VectorType(i32, 4),
                                      ir.VectorType(i64, 4), i8)

    def vec(self, t):
        from llvmlite import ir

        return ir.VectorType(t, self.width)

    def broadcast(self, value, t):
        """The scalar ``value`` (of type ``t``) in every lane."""
        from llvmlite import ir

        vec = self.vec(t)
        v = self.b.insert_element(ir.Constant(vec, None), value, ir.Constant(self.i32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vec, None),
                                     ir.Constant(self.vec(self.i32), [0] * self.width))

    def splat(self, t, value):
        from llvmlite import ir

        return ir.Constant(self.vec(t), [value] * self.width)

    def count(self, need):
        """How many lanes ``need`` sets, as an int64."""
        return self.b.zext(self.b.call(self.ctpop, [self.b.bitcast(need, self.bits)]), self.i64)

    def _every_lane(self, n: int, entry, size: int) -> tuple:
        """A gather's mask taking all ``n`` lanes and its scale of ``size`` bytes an entry:
        AVX-512 masks by bits and scales by an i32, AVX2 by lanes of the entry's type and an
        i8."""
        from llvmlite import ir

        if self.avx512:
            return ir.Constant(ir.VectorType(self.i1, n), [1] * n), ir.Constant(self.i32, size)
        return ir.Constant(ir.VectorType(entry, n), [-1] * n), ir.Constant(self.i8, size)

    def gather32(self, table, slots):
        """table[slots] (uint32 entries; ``table`` an i8 pointer)."""
        from llvmlite import ir

        mask, scale = self._every_lane(self.width, self.i32, 4)
        return self.b.call(self._gather32, [ir.Constant(self.vec(self.i32), None), table, slots,
                                            mask, scale])

    def entries(self, table, slots, dom):
        """The decoder table's entries of ``slots``: :meth:`gather32`, or on AVX2, where
        ``dom`` (:func:`_dominant`, a u64) is not 0 and every slot is the dominant symbol's,
        its entry with each slot's bias."""
        from llvmlite import ir

        if self.avx512:
            return self.gather32(table, slots)
        b, i32, i64 = self.b, self.i32, self.i64
        vec = self.vec(i32)

        def field(at: int, bits: int):
            value = b.and_(b.lshr(dom, ir.Constant(i64, at)), ir.Constant(i64, (1 << bits) - 1))
            return self.broadcast(b.trunc(value, i32), i32)

        bias = b.sub(slots, field(32, 12))
        inside = b.bitcast(b.icmp_unsigned("<", bias, field(44, 13)), self.bits)
        every = b.and_(b.icmp_unsigned("!=", dom, ir.Constant(i64, 0)),
                       b.icmp_unsigned("==", inside, ir.Constant(self.bits, -1)))
        with b.if_else(every) as (then, otherwise):
            with then:
                fast = b.or_(field(0, 32), b.shl(bias, self.splat(i32, 8)))
                fast_block = b.block
            with otherwise:
                slow = self.gather32(table, slots)
                slow_block = b.block
        e = b.phi(vec)
        e.add_incoming(fast, fast_block)
        e.add_incoming(slow, slow_block)
        return e

    def gather64(self, table, slots):
        """table[slots] (uint64 entries; ``table`` an i8 pointer), half the lanes an
        instruction."""
        from llvmlite import ir

        b, half = self.b, self.width // 2
        kind = ir.VectorType(self.i64, half)
        mask, scale = self._every_lane(half, self.i64, 8)
        halves = [b.call(self._gather64, [
            ir.Constant(kind, None), table,
            b.shuffle_vector(slots, ir.Constant(self.vec(self.i32), None), ir.Constant(
                ir.VectorType(self.i32, half), list(range(a, a + half)))), mask, scale])
            for a in (0, half)]
        return b.shuffle_vector(halves[0], halves[1],
                                ir.Constant(self.vec(self.i32), list(range(self.width))))

    def _permuted(self, words, need, kind: str):
        """``words`` (<8 x i16>) permuted by mask ``need`` (:func:`permute8`)."""
        from llvmlite import ir

        b, v8 = self.b, lambda t: ir.VectorType(t, 8)
        return b.trunc(permute8(b, b.zext(words, v8(self.i32)), need, kind), v8(self.i16))

    def expand(self, wptr, p, need):
        """The words the lanes of ``need`` pop below p (the lowest lane the lowest word), and
        the new p; the caller leaves at least a vector's words above the block's first."""
        from llvmlite import ir

        b = self.b
        new_p = b.sub(p, self.count(need))
        if self.avx512:
            return b.call(self._expand, [b.gep(wptr, [new_p]), need,
                                         ir.Constant(self.vec(self.i16), None)]), new_p
        below = b.gep(wptr, [b.sub(p, ir.Constant(self.i64, 8))])
        words = b.load(b.bitcast(below, ir.PointerType(self.vec(self.i16))), align=2)
        return self._permuted(words, need, "below"), new_p

    def compress(self, words, need):
        """The lanes of ``words`` that ``need`` sets, in lane order, from lane 0."""
        from llvmlite import ir

        if self.avx512:
            return self.b.call(self._compress, [words, need,
                                                ir.Constant(self.vec(self.i16), None)])
        return self._permuted(words, need, "compress")


@intrinsic
def _encode_row_vector(typingctx, words, row, sh, mk, ctab, x, scratch, w
                       ):  # pragma: no cover - compiled
    """The scalar rows' code of one full row of symbols words[row:row + 32] on 16 lanes at a
    time (AVX-512; 8 on AVX2, :class:`_RowVectors`): the same states in x and words in
    scratch; returns the new w.

    The lanes of a vector that renormalise write their low 16 bits in lane order, so its words
    are its states compressed by the renormalisation mask. States stay below 2**32 and the
    reciprocal below 2**32, so the products are 32 x 32 -> 64-bit multiplies."""
    from llvmlite import ir
    from numba.core import cgutils, types

    def codegen(context, builder, signature, args):
        words_a, row, sh, mk, ctab_a, x_a, scratch_a, w = args
        if not _vector_coder(context):
            return w  # (never run: _vector_coding() is False in this compile; the IR stays valid)
        tw, _, _, _, tc, tx, ts, _ = signature.args
        warr = context.make_array(tw)(context, builder, words_a)
        cptr = context.make_array(tc)(context, builder, ctab_a).data
        xptr = context.make_array(tx)(context, builder, x_a).data
        sptr = context.make_array(ts)(context, builder, scratch_a).data
        rv = _RowVectors(context, builder)
        i16, i32, i64 = rv.i16, rv.i32, rv.i64
        width, vec, splat, broadcast = rv.width, rv.vec, rv.splat, rv.broadcast

        # Words are widened as the scalar rows' uint64 conversion does (signed words sign-
        # extended), in 32 bits where no bit above 31 can reach the field.
        wt, signed = ir.IntType(tw.dtype.bitwidth), tw.dtype.signed
        st = i64 if tw.dtype.bitwidth == 64 or signed else i32
        shift = broadcast(builder.trunc(sh, st) if st is i32 else sh, st)
        fmask = broadcast(builder.trunc(mk, i32), i32)
        table = builder.bitcast(cptr, ir.PointerType(ir.IntType(8)))
        low = splat(i64, 0xFFFFFFFF)

        def symbols(h):
            at = builder.add(row, ir.Constant(i64, width * h))
            if tw.layout == "C":
                ptr = builder.bitcast(builder.gep(warr.data, [at]), ir.PointerType(vec(wt)))
                v = builder.load(ptr, align=tw.dtype.bitwidth // 8)
            else:
                shape = cgutils.unpack_tuple(builder, warr.shape, 1)
                strides = cgutils.unpack_tuple(builder, warr.strides, 1)
                v = ir.Constant(vec(wt), None)
                for k in range(width):
                    ptr = cgutils.get_item_pointer2(
                        context, builder, warr.data, shape, strides, tw.layout,
                        [builder.add(at, ir.Constant(i64, k))])
                    v = builder.insert_element(v, builder.load(ptr), ir.Constant(i32, k))
            if wt.width < st.width:
                v = builder.sext(v, vec(st)) if signed else builder.zext(v, vec(st))
            v = builder.lshr(v, shift)
            v = builder.trunc(v, vec(i32)) if st is i64 else v
            return builder.and_(v, fmask)

        def lanes_at(h):
            return builder.bitcast(builder.gep(xptr, [ir.Constant(i64, width * h)]),
                                   ir.PointerType(vec(i64)))

        states, needs = [], []
        for h in range(LANES // width):
            e = rv.gather64(table, symbols(h))
            rcp = builder.and_(e, low)
            bias = builder.and_(builder.lshr(e, splat(i64, 32)), splat(i64, (1 << 13) - 1))
            f = builder.and_(builder.lshr(e, splat(i64, 45)), splat(i64, (1 << 13) - 1))
            qshift = builder.add(builder.lshr(e, splat(i64, 58)), splat(i64, 32))
            xv = builder.load(lanes_at(h), align=8)
            need = builder.icmp_unsigned(">=", xv, builder.shl(f, splat(i64, _XMAX_SHIFT)))
            needs.append((need, builder.trunc(xv, vec(i16))))
            xv = builder.select(need, builder.lshr(xv, splat(i64, WORD_BITS)), xv)
            q = builder.lshr(builder.mul(builder.and_(xv, low), rcp), qshift)
            cmpl = builder.and_(builder.sub(splat(i64, PROB_SCALE), f), low)
            states.append(builder.add(builder.add(xv, bias),
                                      builder.mul(builder.and_(q, low), cmpl)))
        for h in range(LANES // width):  # lanes 0..31 write in turn
            need, low16 = needs[h]
            packed = rv.compress(low16, need)
            # All the vector's words are stored: w + width <= row + 32, still inside this
            # block's region, and the words past the new w are overwritten later or never read.
            ptr = builder.bitcast(builder.gep(sptr, [w]), ir.PointerType(vec(i16)))
            builder.store(packed, ptr, align=2)
            w = builder.add(w, rv.count(need))
            builder.store(states[h], lanes_at(h), align=8)
        return w

    return types.uint64(words, row, sh, mk, ctab, x, scratch, w), codegen


@kernel()
def _gather_words(scratch, log2_block, counts, offsets, words, b0, b1
                  ):  # pragma: no cover - compiled
    for b in range(b0, b1):
        src = np.int64(b) << log2_block
        words[offsets[b]:offsets[b] + counts[b]] = scratch[src:src + counts[b]]


@kernel(inline="always")
def _decode_step(xv, dtab, out, at):  # pragma: no cover - compiled
    """Emit the symbol of state xv at out[at]; return the state before renormalisation."""
    e = np.uint64(dtab[xv & np.uint64(PROB_SCALE - 1)])
    out[at] = np.uint8(e & np.uint64(0xFF))
    return (((e >> np.uint64(20)) + np.uint64(1)) * (xv >> np.uint64(PROB_BITS))
            + ((e >> np.uint64(8)) & np.uint64(PROB_SCALE - 1)))


@kernel(inline="always")
def _decode_row_fast(words, p, x, dtab, out, row):  # pragma: no cover - compiled
    """Decode one full row; the caller guarantees >= 32 words remain below p.

    So words[p - 1] is always readable, and the pop is a branch-free select (a pop happens for
    about one symbol in six, too irregular for the branch predictor).
    """
    for k in range(LANES):
        lane = np.uint64(LANES - 1 - k)
        xv = _decode_step(np.uint64(x[lane]), dtab, out, row + lane)
        w = np.uint64(words[p - np.uint64(1)])
        need = xv < np.uint64(STATE_LOW)
        p -= np.uint64(need)
        x[lane] = np.uint32(((xv << np.uint64(WORD_BITS)) | w) if need else xv)
    return p


def _vector_coder(context) -> bool:
    """Whether the vector rows compile on ``context``'s target: AVX-512's 16 lanes a vector
    (:func:`vbmi2_vectors`) or AVX2's 8 (:class:`_RowVectors`)."""
    return any_vectors(context)


@intrinsic
def _vector_coding(typingctx):  # pragma: no cover - compiled
    """True where the vector rows compile (:func:`_vector_coder`): :func:`_decode_row_vector`
    and :func:`_encode_row_vector` run as gathers, word expands and compresses. A constant, so
    each kernel runs only one of its two row coders."""
    from numba.core import types

    return types.boolean(), constant(_vector_coder)


def _plain(*arrays) -> bool:
    """Whether each (numba type, dtype name) is a C-contiguous array of that dtype: the vector
    rows address arrays by their data pointer, so strided or other-typed ones take the scalar
    rows (no caller of ours passes them)."""
    from numba.core import types

    return all(isinstance(t, types.Array) and t.layout == "C" and str(t.dtype) == d
               for t, d in arrays)


@intrinsic
def _decoder_arrays(typingctx, words, dtab, out):  # pragma: no cover - compiled
    """True (a constant) where the vector decoder may take these arrays (:func:`_plain`)."""
    from numba.core import types

    ok = _plain((words, "uint16"), (dtab, "uint32"), (out, "uint8"))
    return types.boolean(words, dtab, out), constant(lambda _context: ok)


@intrinsic
def _encoder_arrays(typingctx, scratch):  # pragma: no cover - compiled
    """True (a constant) where the vector encoder may write ``scratch`` (:func:`_plain`)."""
    from numba.core import types

    ok = _plain((scratch, "uint16"))
    return types.boolean(scratch), constant(lambda _context: ok)


@intrinsic
def _decode_row_vector(typingctx, words, p, x, dtab, out, row, dom
                       ):  # pragma: no cover - compiled
    """:func:`_decode_row_fast` on 16 lanes at a time (AVX-512; 8 on AVX2,
    :class:`_RowVectors`): the same symbols, states and p. ``dom`` is :func:`_dominant` of
    the table (0: none); on AVX2 a vector whose slots all fall in that symbol's takes its
    entries from it, not from a gather.

    States are below 2**31, so uint32 arithmetic is exact. Renormalisation pops lanes 31..0 in
    order, so the lanes of a vector that need a word take the next popcount(need) words below
    p, the lowest lane the lowest word: exactly an expanding load from words[p - popcount].
    """
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        words_a, p, x_a, dtab_a, out_a, row, dom = args
        if not _vector_coder(context):
            return p  # (never run: _vector_coding() is False in this compile; the IR stays valid)
        tw, _, tx, td, to, _, _ = signature.args
        wptr = context.make_array(tw)(context, builder, words_a).data
        xptr = context.make_array(tx)(context, builder, x_a).data
        dptr = context.make_array(td)(context, builder, dtab_a).data
        optr = context.make_array(to)(context, builder, out_a).data
        rv = _RowVectors(context, builder)
        i8, i32, i64, width, vec, splat = rv.i8, rv.i32, rv.i64, rv.width, rv.vec, rv.splat
        table = builder.bitcast(dptr, ir.PointerType(i8))

        def lanes_at(h):
            return builder.bitcast(builder.gep(xptr, [ir.Constant(i64, width * h)]),
                                   ir.PointerType(vec(i32)))

        states, needs, symbols = [], [], []
        for h in range(LANES // width):
            xv = builder.load(lanes_at(h), align=4)
            e = rv.entries(table, builder.and_(xv, splat(i32, PROB_SCALE - 1)), dom)
            symbols.append(e)
            freq = builder.add(builder.lshr(e, splat(i32, 20)), splat(i32, 1))
            bias = builder.and_(builder.lshr(e, splat(i32, 8)), splat(i32, PROB_SCALE - 1))
            xv = builder.add(builder.mul(freq, builder.lshr(xv, splat(i32, PROB_BITS))), bias)
            states.append(xv)
            needs.append(builder.icmp_unsigned("<", xv, splat(i32, STATE_LOW)))
        # the row's 32 symbols in one store: truncating the lanes a vector at a time took
        # five instructions a vector on AVX2
        while len(symbols) > 1:
            n = len(symbols[0].type)
            symbols = [builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 2 * n),
                                                                list(range(2 * n))))
                       for a, b in zip(symbols[::2], symbols[1::2])]
        builder.store(builder.trunc(symbols[0], ir.VectorType(i8, LANES)), builder.bitcast(
            builder.gep(optr, [row]), ir.PointerType(ir.VectorType(i8, LANES))), align=1)
        for h in reversed(range(LANES // width)):  # lanes 31..0 pop in turn
            w, p = rv.expand(wptr, p, needs[h])
            pushed = builder.or_(builder.shl(states[h], splat(i32, WORD_BITS)),
                                 builder.zext(w, vec(i32)))
            builder.store(builder.select(needs[h], pushed, states[h]), lanes_at(h), align=4)
        return p

    return types.uint64(words, p, x, dtab, out, row, dom), codegen


# A symbol of at least this frequency (of 4096) is the table's dominant one (:func:`_dominant`):
# the 8 slots of an AVX2 vector then all fall in its range 3/4 of the time or more (its share
# to the 8th power), and those skip the gather, which takes most of a row's time on AMD's Zen 2.
# There, one thread, 4M symbols: 1.5% of them not the dominant one (a fine-tuning delta's kept
# top bytes) 0.81 against 1.10 ns a symbol; at 5%, with this bar at 3584, the mispredicted
# branches cost more than the gathers saved (1.24 against 1.07).
DOMINANT = 3952


@kernel(inline="always")
def _dominant(dtab):  # pragma: no cover - compiled
    """The decoder table's dominant symbol as one u64: its entry with a bias of 0 (low 32
    bits), its first slot (bits 32-43) and its frequency (from bit 44); 0 where no symbol
    reaches DOMINANT. Such a symbol holds more than half the slots, so slot 2048 is its."""
    e = np.uint64(dtab[PROB_SCALE // 2])
    f = (e >> np.uint64(20)) + np.uint64(1)
    if f < DOMINANT:
        return np.uint64(0)
    first = np.uint64(PROB_SCALE // 2) - ((e >> np.uint64(8)) & np.uint64(PROB_SCALE - 1))
    return (e & np.uint64(0xFFF000FF)) | (first << np.uint64(32)) | (f << np.uint64(44))


@kernel()
def _vector_probe():  # pragma: no cover - compiled
    return _vector_coding()


def vector_decoding() -> bool:
    """Whether this process's coder runs its full rows on vectors (AVX-512 or AVX2; else the
    scalar rows); both encode the same bytes, and decode the same bytes and find the same
    errors."""
    return bool(_vector_probe())


@kernel(inline="always")
def _decode_lanes(words, lo, p, x, dtab, out, row, m):  # pragma: no cover - compiled
    """Decode the row at ``row`` lane by lane, its lanes m-1 down to 0 (a row of fewer than
    LANES symbols, or one with fewer words left than lanes); (p, False) where it would pop a
    word below words[lo]."""
    one = np.uint64(1)
    for k in range(m):
        lane = m - one - np.uint64(k)
        xv = _decode_step(np.uint64(x[lane]), dtab, out, row + lane)
        if xv < STATE_LOW:
            if p == lo:
                return p, False
            p -= one
            xv = (xv << np.uint64(WORD_BITS)) | np.uint64(words[p])
        x[lane] = np.uint32(xv)
    return p, True


@kernel(inline="always")
def _decode_rows(words, lo, p, x, dtab, out, start, end, row):  # pragma: no cover - compiled
    """Decode the rows of symbols [start, row) backwards from uint32 lane states ``x`` (symbols
    [row, end) already decoded), popping words[p-1] down to words[lo]; 0, or the error code."""
    lanes = np.uint64(LANES)
    while row > start:  # rows backwards
        row -= lanes
        m = min(lanes, end - row)
        if m == lanes and p - lo >= lanes:
            if _vector_coding() and _decoder_arrays(words, dtab, out):
                p = _decode_row_vector(words, p, x, dtab, out, row, np.uint64(0))
            else:
                p = _decode_row_fast(words, p, x, dtab, out, row)
            continue
        p, ok = _decode_lanes(words, lo, p, x, dtab, out, row, m)
        if not ok:
            return _ERR_UNDERFLOW
    if p != lo:
        return _ERR_LEFTOVER
    for lane in range(LANES):
        if x[lane] != STATE_LOW:
            return _ERR_FINAL
    return 0


@kernel(inline="always")
def _load_states(states, x):  # pragma: no cover - compiled
    """Copy the 32 lane states into x; False if one lies outside [STATE_LOW, STATE_HIGH)."""
    for lane in range(LANES):
        if states[lane] < STATE_LOW or states[lane] >= STATE_HIGH:
            return False
        x[lane] = states[lane]
    return True


@kernel()
def _decode_block(words, lo, hi, states, dtab, out, start, end):  # pragma: no cover - compiled
    """Decode symbols [start, end) from the 32 lane ``states``, popping words[hi-1] down to
    words[lo]; 0, or the error code.

    Precondition (checked by the caller): lo <= hi <= words.size, end <= out.size.
    """
    x = np.empty(LANES, np.uint32)
    if not _load_states(states, x):
        return _ERR_STATE
    start, end = np.uint64(start), np.uint64(end)
    lanes, one = np.uint64(LANES), np.uint64(1)
    row = start + ((end - start - one) // lanes) * lanes + lanes
    return _decode_rows(words, np.uint64(lo), np.uint64(hi), x, dtab, out, start, end, row)


@kernel(inline="always")
def _decode_group(words, offsets, states, dtab, out, start, size, last, errors, group
                  ):  # pragma: no cover - compiled
    """:func:`_decode_block` of ``group`` blocks at once (their words between
    offsets[0..group], their symbols from out[start], ``size`` each but the last, which holds
    ``last``), their error codes into errors[0..group]; False where a state is out of range
    or the last block's top row runs out of words (the caller then decodes the blocks one by
    one, which names the error). Vector rows wait on a gather's latency, so the other blocks'
    rows fill the gaps."""
    x = np.empty((group, LANES), np.uint32)
    for k in range(group):
        if not _load_states(states[k * LANES:(k + 1) * LANES], x[k]):
            return False
    dom = _dominant(dtab)
    lo = np.empty(group, np.uint64)
    p = np.empty(group, np.uint64)
    first = np.empty(group, np.uint64)
    ends = np.empty(group, np.uint64)  # each block's symbols
    tops = np.empty(group, np.uint64)  # each block's rows still to decode: [0, tops[k])
    size = np.uint64(size)
    lanes = np.uint64(LANES)
    for k in range(group):
        lo[k] = np.uint64(offsets[k])
        p[k] = np.uint64(offsets[k + 1])
        first[k] = np.uint64(start) + np.uint64(k) * size
        ends[k] = size
        tops[k] = size
    g = group - 1
    ends[g] = np.uint64(last)
    tops[g] = (ends[g] // lanes) * lanes
    # the last block's top row, where partial, lane by lane (rows are decoded top down)
    p[g], ok = _decode_lanes(words, lo[g], p[g], x[g], dtab, out, first[g] + tops[g],
                             ends[g] - tops[g])
    if not ok:
        return False
    while True:
        room = True
        for k in range(group):
            room = room and tops[k] > 0 and p[k] - lo[k] >= lanes
        if not room:
            break
        for k in range(group):
            tops[k] -= lanes
            p[k] = _decode_row_vector(words, p[k], x[k], dtab, out, first[k] + tops[k], dom)
    for k in range(group):
        errors[k] = _decode_rows(words, lo[k], p[k], x[k], dtab, out, first[k],
                                 first[k] + ends[k], first[k] + tops[k])
    return True


@kernel()
def _decode_blocks(words, offsets, states, dtab, log2_block, n, out, errors, b0, b1
                   ):  # pragma: no cover - compiled
    """Decode blocks [b0, b1) of an n-symbol plane into out, block b0's first symbol at
    out[0]; errors[b - b0] gets each block's error code."""
    base = np.int64(b0) << log2_block
    size = np.int64(1) << log2_block
    # Blocks decoded in groups: all but the plane's last where it is under half a block (a
    # group runs its rows together only while its shortest block has rows left).
    grouped = b1
    if 2 * (n - base - (np.int64(b1 - 1 - b0) << log2_block)) < size:
        grouped = b1 - 1
    b = b0
    while b < b1:
        start = (np.int64(b) << log2_block) - base
        # (GROUP blocks at once where that many remain, else three, two or one; only the
        # plane's last block may be short, and it is then the group's last)
        done = False
        for group in (GROUP, 3, 2):
            if not done and _vector_coding() and _decoder_arrays(words, dtab, out) \
                    and b + group <= grouped:
                last = min(size, n - base - start - (group - 1) * size)
                if _decode_group(words, offsets[b:b + group + 1],
                                 states[b * LANES:(b + group) * LANES], dtab, out, start,
                                 size, last, errors[b - b0:b - b0 + group], group):
                    b += group
                    done = True
        if done:
            continue
        end = min(start + size, n - base)
        errors[b - b0] = _decode_block(words, offsets[b], offsets[b + 1],
                                       states[b * LANES:(b + 1) * LANES], dtab, out, start, end)
        b += 1


# ---------------------------------------------------------------------------------------------
# Stream assembly and parsing


def _n_blocks(n: int, log2_block: int) -> int:
    return (n + (1 << log2_block) - 1) >> log2_block


def _raw_stream(plane: np.ndarray, log2_block: int) -> np.ndarray:
    out = np.empty(HEADER_SIZE + plane.size, dtype=np.uint8)
    out[:HEADER_SIZE] = np.frombuffer(HEADER.pack(MODE_RAW, log2_block, 0, plane.size), np.uint8)
    out[HEADER_SIZE:] = plane
    return out


def _const_stream(view: PlaneView | np.ndarray, log2_block: int) -> np.ndarray:
    view = _as_view(view)
    head = HEADER.pack(MODE_CONST, log2_block, 0, view.size)
    firsts = (view.words[::1 << log2_block].astype(np.int64) >> view.shift) & view.mask
    return np.concatenate((np.frombuffer(head, np.uint8), firsts.astype(np.uint8)))


def _piece_blocks(log2_block: int) -> int:
    """Blocks in one piece of work: about a million symbols, at least one block."""
    return max(1, _PIECE_SYMBOLS >> log2_block)


def _block_pieces(nb: int, log2_block: int, fn) -> None:
    """``fn(b0, b1)`` over the blocks ``[0, nb)`` in pieces of :func:`_piece_blocks`."""
    per = _piece_blocks(log2_block)
    if nb <= per:
        fn(0, nb)
    else:
        threads.pool().map(lambda b0: fn(b0, min(nb, b0 + per)), range(0, nb, per))


def _as_view(plane: PlaneView | np.ndarray) -> PlaneView:
    return plane if isinstance(plane, PlaneView) else PlaneView.of(plane)


def _rans_stream(view: PlaneView | np.ndarray, log2_block: int, freqs: np.ndarray
                 ) -> np.ndarray:
    view = _as_view(view)
    n = view.size
    nb = _n_blocks(n, log2_block)
    counts = np.empty(nb, dtype=np.int64)
    states = np.empty(nb * LANES, dtype=np.int64)
    tab = _packed_table(_encoder_table(freqs))
    parts: dict[int, np.ndarray] = {}

    def piece(b0: int, b1: int) -> None:
        # Each piece's blocks are coded into this thread's scratch, then their words kept
        # compact: a scratch of the whole plane (up to a word a symbol) was mostly never
        # written, yet its pages were faulted and zeroed (a fifth of the coder's time).
        lo, hi = b0 << log2_block, min(n, b1 << log2_block)
        scratch = _scratch(hi - lo)
        _encode_range(view.words[lo:hi], view.shift, view.mask, log2_block, tab, scratch,
                      counts[b0:b1], states[b0 * LANES:b1 * LANES], 0, b1 - b0)
        at = np.zeros(b1 - b0 + 1, dtype=np.int64)
        np.cumsum(counts[b0:b1], out=at[1:])
        words = np.empty(int(at[-1]), dtype=np.uint16)
        _gather_words(scratch, log2_block, counts[b0:b1], at, words, 0, b1 - b0)
        parts[b0] = words

    _block_pieces(nb, log2_block, piece)
    out, words_at = _laid_out(np.ascontiguousarray(freqs, dtype=np.int64), log2_block, n,
                              counts, states)
    words = out[words_at:].view(np.uint16)
    at = 0
    for b0 in sorted(parts):
        part = parts[b0]
        words[at:at + part.size] = part
        at += part.size
    return out


@kernel()
def _laid_out(freqs, log2_block, n, counts, states):  # pragma: no cover - compiled
    """A RANS-mode stream of ``n`` symbols under ``freqs`` with its header, table, block word
    counts and final states written, and room after them for its coded words (the counts
    summed, two bytes each): (the stream, where its words start)."""
    nb = counts.size
    k, total = 0, 0
    for s in range(256):
        k += freqs[s] > 0
    for b in range(nb):
        total += counts[b]
    words_at = HEADER_SIZE + table_len(k) + BLOCK_OVERHEAD * nb
    out = np.empty(words_at + 2 * total, np.uint8)
    out[0], out[1], out[2], out[3] = MODE_RANS, log2_block, 0, 0
    for i in range(8):
        out[4 + i] = (n >> (8 * i)) & 0xFF
    out[HEADER_SIZE:HEADER_SIZE + BITMAP_SIZE] = 0
    at = HEADER_SIZE + BITMAP_SIZE
    for s in range(256):
        if freqs[s] > 0:
            out[HEADER_SIZE + (s >> 3)] |= 1 << (s & 7)
            out[at], out[at + 1] = freqs[s] & 0xFF, freqs[s] >> 8
            at += 2
    blocks_at = words_at - BLOCK_OVERHEAD * nb
    out[at:blocks_at] = 0  # (the table's padding)
    # (words_at and blocks_at are multiples of 4; the stream is little-endian, as this CPU)
    fixed = out[blocks_at:words_at].view(np.uint32)
    for b in range(nb):
        fixed[b] = counts[b]
    for j in range(nb * LANES):
        fixed[nb + j] = states[j]
    return out, words_at


@kernel()
def _rans_piece(words, shift, mask, log2_block, hist, scratch):  # pragma: no cover - compiled
    """:func:`_rans_stream` of field (shift, mask) of ``words`` (at most one piece of blocks)
    under the table normalised from ``hist``: (MODE_RANS, the stream), or (MODE_CONST, an
    empty array) where every block holds one symbol; ``scratch`` holds a word a symbol."""
    n = words.size
    nb = (n + (1 << log2_block) - 1) >> log2_block
    if _blocks_constant(words, shift, mask, log2_block):
        return MODE_CONST, np.empty(0, np.uint8)
    freqs = np.empty(256, np.int64)
    _normalise(hist, freqs)
    rows = np.zeros((256, 5), np.int64)
    _encoder_rows(freqs, rows)
    counts = np.empty(nb, np.int64)
    states = np.empty(nb * LANES, np.int64)
    _encode_range(words, shift, mask, log2_block, _packed_rows(rows), scratch, counts, states,
                  0, nb)
    out, words_at = _laid_out(freqs, log2_block, n, counts, states)
    coded = out[words_at:].view(np.uint16)
    at = 0
    for b in range(nb):
        src = b << log2_block
        coded[at:at + counts[b]] = scratch[src:src + counts[b]]
        at += counts[b]
    return MODE_RANS, out


# Scratch kept per thread for the encoder, up to this many symbols (a piece's: 2 MiB); a
# larger block's is made for the call.
_SCRATCH_KEPT = _PIECE_SYMBOLS
_local = threading.local()


def _scratch(symbols: int) -> np.ndarray:
    """This thread's encoder scratch of at least ``symbols`` words."""
    if symbols > _SCRATCH_KEPT:
        return np.empty(symbols, dtype=np.uint16)
    have = getattr(_local, "scratch", None)
    if have is None or have.size < symbols:
        have = _local.scratch = np.empty(_SCRATCH_KEPT, dtype=np.uint16)
    return have[:symbols]


def plane_log2_block(n: int, log2_block: int = LOG2_BLOCK_DEFAULT) -> int:
    """The block size an encoder configured with ``log2_block`` codes a plane of ``n``
    symbols in (spec/rans.md, section 7)."""
    if log2_block != LOG2_BLOCK_DEFAULT or not SPLIT_FROM <= n < SPLIT_BELOW:
        return log2_block
    return n.bit_length() - 2


class RansCodec(Codec):
    """S4 rANS; ``log2_block`` is the encoder's block size (the decoder reads it per stream),
    which at the default cuts planes of 2^15 to 2^17 symbols finer (:func:`plane_log2_block`)
    unless ``split`` is False."""

    codec_id = RANS
    name = "rans"
    counts_estimate = True

    def __init__(self, log2_block: int = LOG2_BLOCK_DEFAULT, split: bool = True) -> None:
        if not LOG2_BLOCK_MIN <= log2_block <= LOG2_BLOCK_MAX:
            raise ValueError(f"log2_block must be in [{LOG2_BLOCK_MIN}, {LOG2_BLOCK_MAX}]")
        self.log2_block = log2_block
        self.split = split

    def block_log2(self, n: int) -> int:
        """The block size this encoder codes a plane of ``n`` symbols in."""
        return plane_log2_block(n, self.log2_block) if self.split else self.log2_block

    def encode(self, plane: np.ndarray) -> Encoded:
        return self.encode_view(PlaneView.of(plane))

    def encode_view(self, view: PlaneView) -> Encoded:
        n = view.size
        if n >= MAX_SYMBOLS:
            raise LimitError(f"rans planes hold fewer than 2^48 bytes, got {n}")
        lb = self.block_log2(n)
        if n == 0:
            return Encoded(_raw_stream(view.bytes(), lb))
        if view.symbols == 1:
            return Encoded(_const_stream(view, LOG2_BLOCK_MAX))
        if _n_blocks(n, lb) <= _piece_blocks(lb):
            # (one piece of work: counted, coded and laid out by one kernel, where the steps'
            # calls took as long as the coding on a mid-size plane)
            mode, stream = _rans_piece(view.words, view.shift, view.mask, lb,
                                       np.ascontiguousarray(view.counts, dtype=np.int64),
                                       _scratch(n))
            if mode == MODE_CONST:
                return Encoded(_const_stream(view, lb))
        else:
            if _blocks_constant(view.words, view.shift, view.mask, lb):
                return Encoded(_const_stream(view, lb))
            stream = _rans_stream(view, lb, normalise(view.counts))
        if stream.size >= HEADER_SIZE + n:
            return Encoded(_raw_stream(view.bytes(), lb))
        return Encoded(stream)

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        if params:
            raise CodecError(f"rans takes no parameters, got {len(params)} bytes")
        buf = np.frombuffer(payload, np.uint8) if isinstance(payload, bytes | bytearray) \
            else np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        if buf.size < HEADER_SIZE:
            raise CodecError(f"rans stream of {buf.size} bytes is shorter than its 12-byte header")
        mode, log2_block, reserved, n = HEADER.unpack_from(buf)  # (contiguous, at least 12)
        if reserved:
            raise CodecError("rans header reserved field is not zero")
        if not LOG2_BLOCK_MIN <= log2_block <= LOG2_BLOCK_MAX:
            raise CodecError(f"rans log2_block {log2_block} outside [5, 20]")
        if n != decoded_len:
            raise CodecError(f"rans stream holds {n} symbols, plane declares {decoded_len}")
        if n >= MAX_SYMBOLS:
            raise CodecError(f"rans stream declares {n} symbols; streams hold fewer than 2^48")
        nb = _n_blocks(n, log2_block)
        if mode == MODE_RAW:
            _expect_size(buf, HEADER_SIZE + n, "RAW")
            return buf[HEADER_SIZE:].copy()
        if mode == MODE_CONST:
            _expect_size(buf, HEADER_SIZE + nb, "CONST")
            return np.repeat(buf[HEADER_SIZE:], _block_lengths(n, log2_block))
        if mode == MODE_RANS:
            whole = _decoded_at_once(buf, n, log2_block) \
                if nb <= _piece_blocks(log2_block) else None  # (else in pieces)
            return whole if whole is not None else _Blocks(buf, n, log2_block).all()
        raise CodecError(f"rans mode {mode} is not RAW (0), CONST (1) or RANS (2)")

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        buf = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        if params or buf.size < HEADER_SIZE:
            return None
        mode, log2_block, reserved, n = HEADER.unpack_from(buf[:HEADER_SIZE].tobytes())
        if reserved or not LOG2_BLOCK_MIN <= log2_block <= LOG2_BLOCK_MAX \
                or n != decoded_len or n >= MAX_SYMBOLS:
            return None
        nb = _n_blocks(n, log2_block)
        if mode == MODE_RAW and buf.size == HEADER_SIZE + n:
            return Slicer(1, lambda lo, hi: buf[HEADER_SIZE + lo:HEADER_SIZE + hi])
        if mode == MODE_CONST and buf.size == HEADER_SIZE + nb:
            firsts = buf[HEADER_SIZE:]
            return Slicer(1 << log2_block, lambda lo, hi: np.repeat(
                firsts[lo >> log2_block:_n_blocks(hi, log2_block)],
                _block_lengths(n, log2_block)[lo >> log2_block:_n_blocks(hi, log2_block)]),
                packs=lambda: _const_bits(firsts, n, log2_block))
        if mode == MODE_RANS and n <= PIECE:
            # (a plane a merge takes in one piece: decoded now; a stream with anything wrong
            # goes on below, which finds the corrupt blocks)
            whole = _decoded_at_once(buf, n, log2_block)
            if whole is not None:
                return Slicer(1 << log2_block, lambda lo, hi: whole[lo:hi])
        if mode == MODE_RANS:
            try:
                blocks = _Blocks(buf, n, log2_block)
            except CodecError:
                return None
            return Slicer(1 << log2_block, blocks.slice)
        return None

    def max_decoded_len(self, stored_len: int) -> int:
        # CONST is the densest mode: one stored byte per block of at most 2**20 symbols.
        return max(0, stored_len - HEADER_SIZE) << LOG2_BLOCK_MAX

    def estimate(self, plane: np.ndarray) -> int:
        return self.estimate_view(PlaneView.of(plane))

    def estimate_view(self, view: PlaneView) -> int:
        """Stored size predicted from the histogram, without encoding (spec/rans.md, "Estimate").

        The RANS term is the exact cross-entropy of the plane under the normalised table plus
        header, table and per-block overhead; it overshoots the real size by the information
        the final states carry (about 32 bytes per block) and undershoots per-block CONST.
        """
        return self.estimate_counts(view.counts, view.size)

    def estimate_counts(self, counts: np.ndarray, n: int) -> int:
        """:meth:`estimate_view` of an ``n``-byte plane whose histogram is ``counts``, or of
        which ``counts`` is a sample (its cross-entropy scaled to ``n``)."""
        if n == 0:
            return HEADER_SIZE
        estimate = _estimate(np.ascontiguousarray(counts, dtype=np.int64), n, self.block_log2(n),
                             SYMBOL_BITS)
        if estimate < 0:
            raise ValueError("cannot estimate an empty histogram")
        return estimate


@kernel()
def _estimate(counts, n, log2_block, symbol_bits):  # pragma: no cover - compiled
    """:meth:`RansCodec.estimate_counts` of ``n`` > 0 symbols (-1 for an empty histogram),
    in one call: its steps' calls took longer than their sums on a mid-size plane."""
    k = 0
    for s in range(256):
        k += counts[s] > 0
    nb = (n + (1 << log2_block) - 1) >> log2_block
    # Where the header and table alone reach the cap below (a small plane of many symbols: a
    # bias, a norm), the estimate is the cap, without normalising the table.
    if k > 1 and table_len(k) + BLOCK_OVERHEAD * nb >= n:
        return HEADER_SIZE + n
    freqs = np.empty(256, np.int64)
    bits, k, total = _estimate_bits(counts, freqs, symbol_bits)
    if k == 1:
        return HEADER_SIZE + ((n + (1 << LOG2_BLOCK_MAX) - 1) >> LOG2_BLOCK_MAX)
    if k == 0:
        return -1
    bits *= n / total
    rans = HEADER_SIZE + table_len(k) + BLOCK_OVERHEAD * nb + 2 * math.ceil(bits / WORD_BITS)
    return min(rans, HEADER_SIZE + n)


def _expect_size(buf: np.ndarray, size: int, mode: str) -> None:
    if buf.size != size:
        raise CodecError(f"rans {mode} stream must be {size} bytes, is {buf.size}")


def _const_bits(firsts: np.ndarray, n: int, log2_block: int) -> tuple[np.ndarray, int] | None:
    """A CONST stream of 0s and 1s (a sign plane of one sign) as bitpack's bytes, which a
    merge reads in place of the plane (:class:`Slicer`'s ``packs``); None for other
    symbols."""
    if n == 0 or int(firsts.max()) > 1:
        return None
    bits = np.repeat(firsts * np.uint8(0xFF), (_block_lengths(n, log2_block) + 7) // 8)
    if n % 8:  # (the last block's last byte: only its n % 8 low bits are symbols)
        bits[-1] &= np.uint8((1 << (n % 8)) - 1)
    return bits, 1


def _block_lengths(n: int, log2_block: int) -> np.ndarray:
    nb = _n_blocks(n, log2_block)
    lengths = np.full(nb, 1 << log2_block, dtype=np.int64)
    if nb:
        lengths[-1] = n - ((nb - 1) << log2_block)
    return lengths


class _Blocks:
    """A RANS-mode stream whose table, word counts and length are checked: decodes any run of
    whole blocks (block errors are reported per block, by code)."""

    def __init__(self, buf: np.ndarray, n: int, log2_block: int) -> None:
        freqs, pos = _parse_table(buf, HEADER_SIZE)
        nb = _n_blocks(n, log2_block)
        words_at = pos + BLOCK_OVERHEAD * nb
        if buf.size < words_at:
            raise CodecError(f"rans stream of {buf.size} bytes ends before the word area of "
                             f"its {nb} blocks (needs {words_at})")
        self.offsets = np.empty(nb + 1, dtype=np.int64)
        self.states = np.empty(nb * LANES, dtype=np.int64)
        over, count = _block_index(buf, pos, n, log2_block, self.offsets, self.states)
        if over >= 0:
            length = min(1 << log2_block, n - (over << log2_block))
            raise CodecError(f"rans block {over} stores {count} words for {length} symbols "
                             "(at most one word per symbol)")
        _expect_size(buf, words_at + 2 * int(self.offsets[-1]), "RANS")
        words = buf[words_at:].view("<u2")
        self.words = words if words.flags.aligned else words.copy()
        self.dtab = _decoder_table(freqs)
        self.n, self.log2_block, self.nb = n, log2_block, nb

    def decode(self, b0: int, b1: int, out: np.ndarray) -> np.ndarray:
        """Decode blocks [b0, b1) into ``out``; their error codes (0: none)."""
        errors = np.zeros(b1 - b0, dtype=np.int64)
        _decode_blocks(self.words, self.offsets, self.states, self.dtab, self.log2_block,
                       self.n, out, errors, b0, b1)
        return errors

    def all(self) -> np.ndarray:
        out = np.empty(self.n, dtype=np.uint8)
        errors = np.zeros(self.nb, dtype=np.int64)

        def piece(b0: int, b1: int) -> None:
            lo = b0 << self.log2_block
            errors[b0:b1] = self.decode(b0, b1, out[lo:lo + ((b1 - b0) << self.log2_block)])

        _block_pieces(self.nb, self.log2_block, piece)
        bad = np.flatnonzero(errors)
        if bad.size:
            b = int(bad[0])
            raise CodecError(f"rans block {b} of {self.nb} is corrupt: "
                             f"{_ERR_TEXT[int(errors[b])]}")
        return out

    def slice(self, lo: int, hi: int) -> np.ndarray | None:
        """Symbols [lo, hi) (lo a block start, hi one or n), or None if a block is corrupt."""
        out = np.empty(hi - lo, dtype=np.uint8)
        b0, b1 = lo >> self.log2_block, _n_blocks(hi, self.log2_block)
        return None if self.decode(b0, b1, out).any() else out


def _decoded_at_once(buf: np.ndarray, n: int, log2_block: int) -> np.ndarray | None:
    """The ``n`` symbols of RANS-mode stream ``buf`` decoded by one kernel call, where the
    steps' calls took a good share of a mid-size plane's decode; None where the stream is not
    2-byte aligned or anything in it is wrong (:class:`_Blocks` then decodes it, or finds
    what)."""
    out = np.empty(n, np.uint8)
    return None if _decode_piece(buf, n, log2_block, out) else out


@kernel()
def _decode_piece(buf, n, log2_block, out):  # pragma: no cover - compiled
    """Decode the RANS-mode stream ``buf`` of ``n`` symbols (header checked) into ``out``, as
    :class:`_Blocks` checks and decodes it: 0, or 1 where ``buf`` is not 2-byte aligned or
    anything is wrong (:class:`_Blocks` then finds what). (The alignment found here: numpy's
    ``ctypes.data`` took 2 us a plane.)"""
    if buf.ctypes.data % 2:
        return 1
    freqs = np.zeros(256, np.int64)
    fault, _k, pos = _table_at(buf, HEADER_SIZE, freqs)
    if fault:
        return 1
    nb = (n + (1 << log2_block) - 1) >> log2_block
    words_at = pos + BLOCK_OVERHEAD * nb
    if buf.size < words_at:
        return 1
    offsets = np.empty(nb + 1, np.int64)
    states = np.empty(nb * LANES, np.int64)
    over, _count = _block_index(buf, pos, n, log2_block, offsets, states)
    if over >= 0 or buf.size != words_at + 2 * offsets[nb]:
        return 1
    words = buf[words_at:].view(np.uint16)
    errors = np.zeros(nb, np.int64)
    _decode_blocks(words, offsets, states, _decoder_slots(freqs), log2_block, n, out, errors,
                   0, nb)
    for b in range(nb):
        if errors[b]:
            return 1
    return 0


@kernel()
def _block_index(buf, pos, n, log2_block, offsets, states):  # pragma: no cover - compiled
    """The blocks' word counts at ``pos`` summed into ``offsets`` and their final states
    into ``states`` (the caller has checked that both lie in ``buf``): (-1, 0), or the first
    block storing more words than its symbols and its count."""
    nb = offsets.size - 1
    offsets[0] = 0
    for b in range(nb):
        at = pos + 4 * b
        count = np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8) | \
            (np.int64(buf[at + 2]) << 16) | (np.int64(buf[at + 3]) << 24)
        if count > min(np.int64(1) << log2_block, n - (np.int64(b) << log2_block)):
            return b, count
        offsets[b + 1] = offsets[b] + count
    at = pos + 4 * nb
    for j in range(states.size):
        p = at + 4 * j
        states[j] = np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | \
            (np.int64(buf[p + 2]) << 16) | (np.int64(buf[p + 3]) << 24)
    return -1, 0

register(RansCodec())
