"""Masked tensors (``spec/planes.md``, "Masked tensors"; format 1.4): a mask plane of one bit
per word of the layout, and the layout's planes coded over the words whose bit is set, in
order. Every other word is zero. An XOR delta in which few words changed stores and decodes
only those (a fine-tuning step changes a fifth of bf16 weights): its decoding then costs about
what it changed, not what the tensor holds.

Bit ``i`` of the mask is bit ``i % 8`` (least significant first) of byte ``i // 8``; the bits
past the last word are zero, the set bits count the stored words, and no stored word is zero,
so that every tensor has one masked form.
"""

from __future__ import annotations

import numpy as np

from s4format import hashing, scratch
from s4format.codecs.view import PIECE, run_pieces
from s4format.errors import FormatError
from s4format.jit import (
    any_vectors,
    avx2_vectors,
    constant,
    intrinsic,
    kernel,
    permute8,
    shuffle8x16,
    vbmi2_vectors,
)
from s4format.layouts import _UINT, _readonly

_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.int64)


def mask_len(n: int) -> int:
    """Bytes of the mask plane of ``n`` words."""
    return (n + 7) // 8


def supported(word: int) -> bool:
    """Whether the kernels here take words of ``word`` bytes (else :func:`expand` works on
    rows of bytes with numpy)."""
    return word in _UINT


def word_dtype(word: int) -> np.dtype:
    """The little-endian unsigned integer of ``word`` bytes (one :func:`supported`)."""
    return _UINT[word]


def mask_of(words: np.ndarray, other: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """The mask of ``words`` (uint8/16/32/64), or of ``words ^ other`` (a delta, never
    materialised), and where each piece's non-zero words start among all of them, their total
    last (what :func:`kept_words` takes)."""
    n = words.size
    mask = np.empty(mask_len(n), dtype=np.uint8)
    other, xor = _other(words, other)
    return mask, _piece_starts(
        lambda lo, hi: _mask_bytes(words, other, xor, lo, hi, mask, _POPCOUNT), n)


def kept_words(words: np.ndarray, mask: np.ndarray, starts: np.ndarray,
               other: np.ndarray | None = None) -> np.ndarray:
    """The non-zero words of ``words`` (of ``words ^ other``), in order (``mask`` and
    ``starts`` from :func:`mask_of`)."""
    kept = np.empty(int(starts[-1]), dtype=words.dtype)
    words = _writable(words)
    other, xor = _other(words, other)
    run_pieces(lambda lo, hi: _by_mask(mask, lo, hi, words, kept, int(starts[lo // PIECE]),
                                       _COMPACT_XOR if xor else _COMPACT, other),
               words.size, PIECE)
    return kept


def _other(words: np.ndarray, other: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """``(other, True)``: the kernels XOR word ``i`` with ``other[i]``; ``(words, False)``
    where there is none (the kernels then leave it unread)."""
    if other is None:
        return words, False
    if other.dtype != words.dtype or other.shape != words.shape:
        raise ValueError(f"words to XOR are {other.dtype} {other.shape}, not {words.dtype} "
                         f"{words.shape}")
    return other, True  # (only read: a read-only parent needs no copy)


def expand(mask: np.ndarray, kept: np.ndarray, out: np.ndarray, word: int,
           xor: bool, leaves: np.ndarray | None = None) -> None:
    """Write (``xor``: XOR) the ``kept`` words (given as bytes) where ``mask`` has its bits
    into ``out``, the tensor's raw bytes of words of ``word`` bytes; with ``xor`` False,
    ``out`` must be zero (a new buffer). FormatError where the mask breaks a rule: its bits
    past the last word or its count of set bits (found before ``out`` is touched), or a zero
    word kept (found as the words are written: ``out`` is then spoiled). ``leaves``
    (:func:`hashing.leaves_for` of ``out``, where given): filled with the digests of ``out``'s
    leaves, as each piece is written where the words are :func:`supported` (its bytes are
    then in cache), else after."""
    n = out.size // word
    if mask.size != mask_len(n) or kept.size % word:
        raise FormatError(f"mask of {mask.size} bytes for {n} words, or kept words of "
                          f"{kept.size} bytes")
    m = kept.size // word
    if n % 8 and int(mask[-1]) >> (n % 8):
        raise FormatError(f"the mask sets bits past its last word ({n} words)")
    starts = _piece_starts(lambda lo, hi: _popcount(mask, lo, hi, _POPCOUNT), n)
    have = int(starts[-1])
    if have != m:
        raise FormatError(f"the mask sets {have} bits, its planes hold {m} words")
    if supported(word):
        vals, dest = _writable(kept).view(_UINT[word]), out.view(_UINT[word])
        zero = np.zeros(max(1, -(-n // PIECE)), dtype=np.bool_)

        def piece(lo: int, hi: int) -> None:
            zero[lo // PIECE] = _by_mask(mask, lo, hi, dest, vals, int(starts[lo // PIECE]),
                                         _XOR if xor else _PLACE, dest)
            if leaves is not None:  # (a piece is a multiple of 64 KiB but the last)
                hashing.hash_span(out, lo * word, hi * word, leaves)

        run_pieces(piece, n, PIECE)
        bad = bool(zero.any())
    else:
        rows = kept.reshape(m, word)
        bad = bool(m) and not rows.any(axis=1).all()
        if not bad:
            at = np.flatnonzero(np.unpackbits(mask, count=n, bitorder="little"))
            if xor:
                out.reshape(n, word)[at] ^= rows
            else:
                out.reshape(n, word)[at] = rows
    if bad:
        raise FormatError("a word the mask keeps is zero (its bit must be clear)")
    if leaves is not None and not supported(word):
        leaves[:] = hashing.leaf_digests(out)


# Words of a tensor whose kept bytes a reader decodes whole and puts in place in one call
# (:func:`expand_bytes`), past which it merges them a piece at a time: the planes then take at
# most twice the tensor's bytes besides it. The 2-core fine-tuning chain of
# bench/checkpoints.py, whose head of 2,048,000 words kept half of them, loaded its slowest
# step in 1.65-1.68 × a full load with this bound against 1.77-1.80 × at 2^20 (2026-12-07).
ONE_CALL_WORDS = 1 << 22


def expand_bytes(mask: np.ndarray, low: np.ndarray, high: np.ndarray, out: np.ndarray,
                 xor: bool, leaves: np.ndarray | None = None) -> bool:
    """:func:`expand` of 2-byte words kept as two byte planes (the bytes layout's, ``low``
    then ``high``) in one kernel call (for a tensor of at most :data:`ONE_CALL_WORDS` words:
    the caller's to bound): their words made in a reused buffer, then put in place (``xor``:
    XORed into ``out``). False where the mask or a kept word breaks a rule (:func:`expand`
    then names it; ``out`` may be spoiled where ``xor``). ``leaves``: filled with the digests
    of ``out``."""
    buf = scratch.take(2 * low.size)
    packed = (np.empty(low.size, np.uint16) if buf is None
              else buf[:2 * low.size].view(np.uint16))
    try:
        # (read-only views, whatever the codecs returned: one signature of the kernel)
        got = _place_bytes(_readonly(mask), _readonly(low), _readonly(high),
                           out.view(np.uint16), packed, _XOR if xor else _PLACE, _POPCOUNT)
    finally:
        scratch.give(buf)
    if got != 0:
        return False
    if leaves is not None:
        hashing.hash_span(out, 0, out.size, leaves)
    return True


# One call where a tensor's kept words took several (their planes' merge, the mask's count, the
# placing) and Python between them, which two threads take turns at: the steps of
# bench/checkpoints.py's CPU fine-tuning chain (19 such tensors a level) loaded 1.0-1.4 ms
# faster on 2 cores, 1.2-1.3 ms on one (2026-12-07).
@kernel()
def _place_bytes(mask, low, high, dense, packed, mode, table):  # pragma: no cover - compiled
    """The words ``low[j] | high[j] << 8`` put in ``dense`` (mode _PLACE or _XOR) at the set
    bits of ``mask``, through ``packed`` (at least ``low.size`` words): -1 where the set bits
    are not ``low.size`` or one lies past ``dense``'s words (nothing written), 1 where a kept
    word is zero, else 0."""
    n = dense.size
    m = low.size
    if high.size != m or packed.size < m or mask.size != (n + 7) // 8:
        return -1
    if n % 8 and mask[mask.size - 1] >> (n % 8):
        return -1
    if _popcount(mask, 0, n, table) != m:
        return -1
    for j in range(m):
        packed[j] = np.uint16(low[j]) | (np.uint16(high[j]) << np.uint16(8))
    return 1 if _by_mask(mask, 0, n, dense, packed[:m], 0, mode, dense) else 0


def _writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy where it is read-only (a plane as read from a file): _by_mask writes to
    either array in one of its modes, and numba will not compile a write to a read-only one."""
    return a if a.flags.writeable else a.copy()


def _piece_starts(counter, n: int) -> np.ndarray:
    """Each piece's first index among the kept words, and their total last (``counter(lo,
    hi)``: the kept words of words lo..hi). Pieces are PIECE words, a multiple of 64, so they
    split the mask at whole u64s, which the kernels read 64 words' bits at a time."""
    counts = np.zeros(max(1, -(-n // PIECE)) + 1, dtype=np.int64)

    def piece(lo: int, hi: int) -> None:
        counts[lo // PIECE + 1] = counter(lo, hi)

    run_pieces(piece, n, PIECE)
    return np.cumsum(counts)


@kernel()
def _mask_bytes(words, other, xor, lo, hi, mask, table):  # pragma: no cover - compiled
    """Mask bytes of words lo..hi (lo a multiple of 8), of ``words ^ other`` where ``xor``
    (:func:`_other`); returns the bits set. Each bit is computed, not branched on: a branch
    on which words changed mispredicts at random."""
    c = 0
    if _vector_masks(words, other):
        blocks = (hi - lo) >> 6
        m64 = mask[lo >> 3:(lo >> 3) + 8 * blocks].view(np.uint64)
        for q in range(blocks):
            bits = _mask_block(words, other, xor, lo + 64 * q)
            m64[q] = bits
            c += _ctpop64(bits)
        lo += 64 * blocks
    whole = lo + (hi - lo) // 8 * 8
    for b in range(lo >> 3, whole >> 3):
        byte = 0
        for k in range(8):
            i = 8 * b + k
            byte |= np.int64(_word(words, other, xor, i) != 0) << k
        mask[b] = byte
        c += table[byte]
    if whole < hi:
        byte = 0
        for i in range(whole, hi):
            byte |= np.int64(_word(words, other, xor, i) != 0) << (i - whole)
        mask[whole >> 3] = byte
        c += table[byte]
    return c


@kernel()
def _popcount(mask, lo, hi, table):  # pragma: no cover - compiled
    """Set bits of words lo..hi (lo a multiple of 64; the mask's bits past its words are 0),
    64 at a time."""
    first, end = lo >> 3, (hi + 7) >> 3
    whole = (end - first) >> 3
    c = 0
    for w in mask[first:first + 8 * whole].view(np.uint64):
        c += _ctpop64(w)
    for b in range(first + 8 * whole, end):
        c += table[mask[b]]
    return c


@intrinsic
def _ctpop64(typingctx, x):  # pragma: no cover - compiled
    """The set bits of a uint64 (one instruction where the CPU has one)."""
    from numba.core import types

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])
    return types.uint64(types.uint64), codegen


@intrinsic
def _ctz64(typingctx, x):  # pragma: no cover - compiled
    """The position of the lowest set bit of a non-zero uint64."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))
    return types.uint64(types.uint64), codegen


def _words_type(*arrays) -> int:
    """The bits of the words of numba array types ``arrays`` where the vector blocks take them:
    C-contiguous arrays of one unsigned integer type, addressed by their data pointers; else
    0 (the scalar loops then run)."""
    from numba.core import types

    first = arrays[0]
    if not all(isinstance(t, types.Array) and t.layout == "C" and t.dtype == first.dtype
               for t in arrays) or not isinstance(first.dtype, types.Integer) \
            or first.dtype.signed or first.dtype.bitwidth not in (8, 16, 32, 64):
        return 0
    return first.dtype.bitwidth


@intrinsic
def _vector_blocks(typingctx, dense, packed, other):  # pragma: no cover - compiled
    """True (a constant) where the kernels here move kept words 64 at a time as vectors
    (:class:`_Vectors`)."""
    from numba.core import types

    bits = _words_type(dense, packed, other)
    return types.boolean(dense, packed, other), constant(
        lambda context: bool(_Vectors.form(context, bits)))


@intrinsic
def _blocks_overrun(typingctx, dense, packed, other):  # pragma: no cover - compiled
    """True (a constant) where a vector block reads or writes up to 64 words from its first
    in ``packed`` whatever its kept words (the AVX2 blocks load and store whole vectors of 8
    words): the caller then leaves a block with less room to the word loop."""
    from numba.core import types

    bits = _words_type(dense, packed, other)
    return types.boolean(dense, packed, other), constant(
        lambda context: _Vectors.form(context, bits) == "avx2")


@intrinsic
def _vector_masks(typingctx, words, other):  # pragma: no cover - compiled
    """True (a constant) where masks are found 64 words at a time by comparing vectors of
    words with zero (AVX-512 or AVX2)."""
    from numba.core import types

    ok = bool(_words_type(words, other))
    return types.boolean(words, other), constant(
        lambda context: ok and any_vectors(context))


class _Vectors:
    """What the block intrinsics' code generation shares: the words' vector types (512 bits of
    words; 8 words on AVX2), the arrays' data pointers, and LLVM's intrinsics for them."""

    def __init__(self, context, builder, signature, args, arrays: tuple[int, ...]) -> None:
        from llvmlite import ir
        from numba.core import cgutils

        self.b = builder
        found = _words_type(*(signature.args[k] for k in arrays))
        self.bits = found or 16  # (16: IR that never runs, as _vector_blocks() is False)
        self.lanes = 512 // self.bits
        self.word = ir.IntType(self.bits)
        self.vec = ir.VectorType(self.word, self.lanes)
        self.flags = ir.VectorType(ir.IntType(1), self.lanes)
        self.i64 = ir.IntType(64)
        self.ptrs = [context.make_array(signature.args[k])(context, builder, args[k]).data
                     for k in arrays]
        self.kind = self.form(context, found)
        self.ok = self.kind == "avx512"
        name = f"v{self.lanes}i{self.bits}"
        module = builder.module
        self.expand = cgutils.get_or_insert_function(module, ir.FunctionType(
            self.vec, [ir.PointerType(self.word), self.flags, self.vec]),
            f"llvm.masked.expandload.{name}")
        # Compressed in a register, then stored under a mask of its first lanes: a
        # compressing store to memory took nine times longer on AMD's Zen 4 (1 ns a word).
        self.compress = cgutils.get_or_insert_function(module, ir.FunctionType(
            self.vec, [self.vec, self.flags, self.vec]),
            f"llvm.experimental.vector.compress.{name}")
        self.store = cgutils.get_or_insert_function(module, ir.FunctionType(
            ir.VoidType(), [self.vec, self.vec.as_pointer(), ir.IntType(32), self.flags]),
            f"llvm.masked.store.{name}.p0")
        self.ctpop = cgutils.get_or_insert_function(module, ir.FunctionType(
            ir.IntType(self.lanes), [ir.IntType(self.lanes)]), f"llvm.ctpop.i{self.lanes}")
        # (AVX2: 8 words at a time)
        self.i8 = ir.IntType(8)
        self.vec8 = ir.VectorType(self.word, 8)
        self.ctpop8 = cgutils.get_or_insert_function(module, ir.FunctionType(
            self.i8, [self.i8]), "llvm.ctpop.i8")

    @staticmethod
    def form(context, bits: int) -> str:
        """How words of ``bits`` bits move 64 at a time for numba's target in ``context``:
        "avx512" (expanding loads, compresses in registers), "avx2" (8 words of 16 or 32
        bits at a time, by a byte shuffle or a permute from a table), or "" (the word
        loops)."""
        if not bits:
            return ""
        if vbmi2_vectors(context):
            return "avx512"
        return "avx2" if bits in (16, 32) and avx2_vectors(context) else ""

    def at(self, ptr, index, vec=None):
        """The vector of words from word ``index`` of ``ptr``, as a pointer to load or store."""
        return self.b.bitcast(self.b.gep(ptr, [index]), (vec or self.vec).as_pointer())

    def index(self, start, chunk: int, lanes: int = 0):
        from llvmlite import ir

        return self.b.add(start, ir.Constant(self.i64, chunk * (lanes or self.lanes)))

    def chunk_bits(self, bits, chunk: int):
        """The bits of the mask's u64 ``bits`` for chunk ``chunk`` of the block: an integer of
        one bit per lane, and the same as a vector of flags."""
        from llvmlite import ir

        b = self.b
        part = b.lshr(bits, ir.Constant(self.i64, chunk * self.lanes))
        if self.lanes < 64:
            part = b.trunc(part, ir.IntType(self.lanes))
        return part, b.bitcast(part, self.flags)

    def byte_of(self, bits, chunk: int):
        """Byte ``chunk`` of the mask's u64 ``bits`` (the flags of 8 words), as an i8."""
        from llvmlite import ir

        return self.b.trunc(self.b.lshr(bits, ir.Constant(self.i64, 8 * chunk)), self.i8)

    def permute(self, words, byte, kind: str):
        """8 words (<8 x iN>) permuted by the mask byte ``byte`` as
        :func:`~s4format.jit.lane_picks` says for ``kind`` ("expand": the lanes the byte
        clears are zero)."""
        from llvmlite import ir

        if self.bits == 16:
            return shuffle8x16(self.b, words, byte, kind)
        flags = self.b.bitcast(byte, ir.VectorType(ir.IntType(1), 8))
        got = permute8(self.b, words, flags, kind)
        if kind == "expand":
            got = self.b.select(flags, got, ir.Constant(self.vec8, None))
        return got

    def widen(self, value):
        """An integer of at most 64 bits as an i64."""
        return value if value.type.width == 64 else self.b.zext(value, self.i64)

    @property
    def chunks(self) -> range:
        return range(64 // self.lanes)


@intrinsic
def _mask_block(typingctx, words, other, xor, at):  # pragma: no cover - compiled
    """The mask bits (a u64, bit k for word ``at + k``) of the 64 words from ``at`` of
    ``words``, of ``words ^ other`` where ``xor``: each vector of words compared with zero."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        v = _Vectors(context, builder, signature, args, (0, 1))
        if not any_vectors(context):
            return ir.Constant(v.i64, 0)  # (never run: _vector_masks() is False here)
        words_p, other_p = v.ptrs
        out = ir.Constant(v.i64, 0)
        for c in v.chunks:
            k = v.index(args[3], c)
            w = builder.load(v.at(words_p, k), align=1)
            x = builder.select(args[2], builder.xor(w, builder.load(v.at(other_p, k), align=1)),
                               w)
            set_ = builder.bitcast(builder.icmp_unsigned("!=", x, ir.Constant(v.vec, None)),
                                   ir.IntType(v.lanes))
            out = builder.or_(out, builder.shl(v.widen(set_),
                                               ir.Constant(v.i64, c * v.lanes)))
        return out

    return types.uint64(words, other, xor, at), codegen


@intrinsic
def _expand_block(typingctx, bits, dense, packed, at, j):  # pragma: no cover - compiled
    """XOR ``packed[j:]``'s words into the 64 words from ``at`` of ``dense`` whose bits are set
    in the u64 ``bits``, in order (an expanding load per vector; on AVX2 a load of 8 words
    permuted per 8, which reads up to 64 words from j); returns the next j and whether a
    word taken was zero (non-zero)."""
    from llvmlite import ir
    from numba.core import types

    ret = types.UniTuple(types.int64, 2)

    def codegen(context, builder, signature, args):
        v = _Vectors(context, builder, signature, args, (1, 2))
        bits_v, _d, _p, at_v, j_v = args
        zero = ir.Constant(v.i64, 0)
        dense_p, packed_p = v.ptrs
        if v.kind == "avx2":
            for c in range(8):
                byte = v.byte_of(bits_v, c)
                count = builder.call(v.ctpop8, [byte])
                got = v.permute(builder.load(v.at(packed_p, j_v, v.vec8), align=1), byte,
                                "expand")
                dest = v.at(dense_p, v.index(at_v, c, 8), v.vec8)
                builder.store(builder.xor(builder.load(dest, align=1), got), dest, align=1)
                # (the lanes cleared are zero: a zero word taken leaves fewer lanes set)
                set_ = builder.bitcast(builder.icmp_unsigned("!=", got,
                                                             ir.Constant(v.vec8, None)), v.i8)
                zero = builder.or_(zero, v.widen(builder.zext(builder.icmp_unsigned(
                    "!=", builder.call(v.ctpop8, [set_]), count), v.i8)))
                j_v = builder.add(j_v, v.widen(count))
            return context.make_tuple(builder, ret, [j_v, zero])
        if not v.ok:  # (never run: _vector_blocks() is False here)
            return context.make_tuple(builder, ret, [j_v, zero])
        for c in v.chunks:
            part, flags = v.chunk_bits(bits_v, c)
            got = builder.call(v.expand, [builder.gep(packed_p, [j_v]), flags,
                                          ir.Constant(v.vec, None)])
            dest = v.at(dense_p, v.index(at_v, c))
            builder.store(builder.xor(builder.load(dest, align=1), got), dest, align=1)
            zeros = builder.and_(builder.icmp_unsigned("==", got, ir.Constant(v.vec, None)),
                                 flags)
            zero = builder.or_(zero, v.widen(builder.bitcast(zeros, ir.IntType(v.lanes))))
            j_v = builder.add(j_v, v.widen(builder.call(v.ctpop, [part])))
        return context.make_tuple(builder, ret, [j_v, zero])

    return ret(bits, dense, packed, at, j), codegen


@intrinsic
def _compact_block(typingctx, bits, dense, packed, other, at, j, xor
                   ):  # pragma: no cover - compiled
    """Write the words of the 64 from ``at`` of ``dense`` (``dense ^ other`` where ``xor``)
    whose bits are set in the u64 ``bits`` to ``packed[j:]``, in order (per vector, compressed
    and stored under a mask of its first lanes: nothing is written past the kept words; on
    AVX2 8 words permuted and stored whole per 8, which writes up to 64 words from j);
    returns the next j."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        v = _Vectors(context, builder, signature, args, (1, 2, 3))
        bits_v, _d, _p, _o, at_v, j_v, xor_v = args
        dense_p, packed_p, other_p = v.ptrs
        if v.kind == "avx2":
            for c in range(8):
                byte = v.byte_of(bits_v, c)
                k = v.index(at_v, c, 8)
                w = builder.load(v.at(dense_p, k, v.vec8), align=1)
                x = builder.select(xor_v, builder.xor(
                    w, builder.load(v.at(other_p, k, v.vec8), align=1)), w)
                builder.store(v.permute(x, byte, "compress"), v.at(packed_p, j_v, v.vec8),
                              align=1)
                j_v = builder.add(j_v, v.widen(builder.call(v.ctpop8, [byte])))
            return j_v
        if not v.ok:
            return j_v  # (never run: _vector_blocks() is False here)
        for c in v.chunks:
            part, flags = v.chunk_bits(bits_v, c)
            k = v.index(at_v, c)
            w = builder.load(v.at(dense_p, k), align=1)
            x = builder.select(xor_v, builder.xor(w, builder.load(v.at(other_p, k), align=1)),
                               w)
            packed = builder.call(v.compress, [x, flags, ir.Constant(v.vec, None)])
            count = builder.call(v.ctpop, [part])
            lanes = ir.IntType(v.lanes)
            first = builder.select(  # (the lanes below count; a shift by all of them is poison)
                builder.icmp_unsigned("==", count, ir.Constant(lanes, 0)), ir.Constant(lanes, 0),
                builder.lshr(ir.Constant(lanes, -1),
                             builder.sub(ir.Constant(lanes, v.lanes), count)))
            builder.call(v.store, [packed, v.at(packed_p, j_v), ir.Constant(ir.IntType(32), 1),
                                   builder.bitcast(first, v.flags)])
            j_v = builder.add(j_v, v.widen(count))
        return j_v

    return types.int64(bits, dense, packed, other, at, j, xor), codegen


def vector_blocks() -> bool:
    """Whether this process finds masks and moves kept 16-bit words as vectors, 64 words at
    a time on AVX-512 and 8 on AVX2 (else word by word; on AVX2, 8- and 64-bit words and
    pieces with fewer than 1 word in VECTOR_SHARE kept still go word by word); both give the
    same bytes and find the same zero words."""
    w = np.zeros(64, np.uint16)
    return bool(_vector_probe(w, w, w))


@kernel()
def _vector_probe(dense, packed, other):  # pragma: no cover - compiled
    return _vector_blocks(dense, packed, other)


@kernel(inline="always")
def _word(words, other, xor, i):  # pragma: no cover - compiled
    return words[i] ^ other[i] if xor else words[i]


# (AVX2: the vector blocks where at least 1 word in VECTOR_SHARE is kept)
VECTOR_SHARE = 16

# What _by_mask does with each word whose mask bit is set.
_COMPACT, _PLACE, _XOR, _COMPACT_XOR = 0, 1, 2, 3


@kernel()
def _by_mask(mask, lo, hi, dense, packed, j, mode, other):  # pragma: no cover - compiled
    """For words lo..hi of ``dense`` whose mask bit is set, in order, with ``packed[j:]``:
    _COMPACT copies them into ``packed`` (_COMPACT_XOR: each XORed with ``other``'s),
    _PLACE writes ``packed``'s into them, _XOR XORs them in (lo is a multiple of 64).
    Returns whether a word taken from ``packed`` was zero. Its cost follows the set bits,
    not the words (a fine-tuning delta keeps a fifth); on vectors, the blocks of 64 words with
    a bit set."""
    zero = False
    whole = (hi - lo) >> 6
    m64 = mask[lo >> 3:(lo >> 3) + 8 * whole].view(np.uint64)
    vector = _vector_blocks(dense, packed, other)
    compact = mode in (_COMPACT, _COMPACT_XOR)
    stop = packed.size
    overrun = _blocks_overrun(dense, packed, other)
    if vector and overrun:
        # A block then touches 64 words from j: it takes the word loop once fewer lie before
        # ``stop``, the end of packed or of this piece's kept words (another thread's piece
        # follows them). Its 8 steps of 8 words cost what about 4 words do one by one, so
        # sparser pieces take the word loop (one thread on AMD's Zen 2, 2M 16-bit words put
        # in place: 2.4% kept, the vectors 0.40 ms and the word loop 0.33; 20% kept, 0.43 and
        # 1.00).
        kept = 0
        for q in range(whole):
            kept += _ctpop64(m64[q])
        if compact:
            stop = j + kept
        vector = kept * VECTOR_SHARE >= 64 * whole
    for q in range(whole):
        bits = m64[q]
        if not bits:  # (a sparse mask's blocks are mostly empty)
            continue
        base = lo + 64 * q
        if vector and (j + 64 <= stop or not overrun):
            if compact:
                j = _compact_block(bits, dense, packed, other, base, j, mode == _COMPACT_XOR)
            else:  # (_PLACE too: its words are zero, so the XOR writes the kept word)
                j, z = _expand_block(bits, dense, packed, base, j)
                zero |= z != 0
            continue
        while bits:
            zero |= _one(dense, packed, base + np.int64(_ctz64(bits)), j, mode, other)
            j += 1
            bits &= bits - np.uint64(1)
    for i in range(lo + 64 * whole, hi):
        if (mask[i >> 3] >> (i & 7)) & 1:
            zero |= _one(dense, packed, i, j, mode, other)
            j += 1
    return zero


@kernel(inline="always")
def _one(dense, packed, i, j, mode, other):  # pragma: no cover - compiled
    if mode == _COMPACT:
        packed[j] = dense[i]
        return False
    if mode == _COMPACT_XOR:
        packed[j] = dense[i] ^ other[i]
        return False
    v = packed[j]
    if mode == _XOR:
        dense[i] ^= v
    else:
        dense[i] = v
    return v == 0
