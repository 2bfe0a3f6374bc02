"""Plane layouts (``spec/planes.md``): how a tensor's raw bytes split into planes and back.

A layout sees the raw bytes as ``n`` little-endian *words* of ``word`` bytes and cuts each word
into bit fields; plane ``k`` holds field ``k`` of every word, one byte per word (the sign plane
too: one byte 0/1 per word, which the ``bitpack`` codec stores as bits). The generic ``BYTES``
layout takes byte ``j`` of every element as plane ``j``. Split and merge are exact inverses for
every bit pattern; merge refuses plane bytes with bits outside their field, so every file has
exactly one meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from s4format import codecs, hashing, threads
from s4format.codecs.abc import Slicer
from s4format.codecs.view import (
    PIECE,
    SAMPLE_CHUNK,
    SAMPLE_CHUNKS,
    WINDOW_MIN,
    PlaneView,
    counted,
    counted_window,
    run_pieces,
    sampled,
)
from s4format.errors import FormatError, S4Error, UnsupportedFeatureError
from s4format.jit import constant, intrinsic, kernel, target_has

# Plane kinds (spec/planes.md). The plane record's ``index`` distinguishes planes of one kind.
KIND_RAW = 0
KIND_SIGN = 1
KIND_EXPONENT = 2
KIND_MANTISSA = 3
KIND_BYTE = 4
KIND_MASK = 5  # a masked tensor's first plane (s4format.masked)
KIND_NAMES = {KIND_RAW: "raw", KIND_SIGN: "sign", KIND_EXPONENT: "exponent",
              KIND_MANTISSA: "mantissa", KIND_BYTE: "byte", KIND_MASK: "mask"}


def plane_label(kind: int, index: int) -> str:
    """The plane's name in messages and the CLI: sign, exponent, mantissa0, byte3, raw."""
    name = KIND_NAMES.get(kind, f"kind{kind}")
    return name + (str(index) if kind in (KIND_MANTISSA, KIND_BYTE) else "")


@dataclass(frozen=True)
class Field:
    kind: int
    index: int
    shift: int
    bits: int

    @property
    def label(self) -> str:
        return plane_label(self.kind, self.index)


@dataclass(frozen=True)
class Layout:
    layout_id: int
    name: str
    word: int  # bytes per word; 0 = the dtype's item size (BYTES layout)
    fields: tuple[Field, ...]

    def word_size(self, itemsize: int) -> int:
        return self.word or itemsize

    def planes(self, itemsize: int) -> tuple[Field, ...]:
        if self.layout_id == BYTES.layout_id:
            return tuple(Field(KIND_BYTE, j, 8 * j, 8) for j in range(itemsize))
        return self.fields

    def check_applies(self, raw_nbytes: int, itemsize: int) -> int:
        """Number of words, or FormatError when the raw length is not whole words."""
        w = self.word_size(itemsize)
        if raw_nbytes % w:
            raise FormatError(f"layout {self.name} needs whole {w}-byte words, "
                              f"raw length {raw_nbytes} is not a multiple")
        return raw_nbytes // w

    def split(self, raw: np.ndarray, itemsize: int) -> list[np.ndarray]:
        """Cut raw bytes (uint8, C-contiguous) into planes, one uint8 array per field."""
        w = self.word_size(itemsize)
        n = self.check_applies(raw.size, itemsize)
        if self.layout_id == RAW.layout_id:
            return [raw]
        if self.layout_id == BYTES.layout_id:
            rows = raw.reshape(n, w)
            return [np.ascontiguousarray(rows[:, j]) for j in range(w)]
        out = np.empty((len(self.fields), n), dtype=np.uint8)
        words, (shifts, masks) = raw.view(_UINT[w]), self.shifts_masks(itemsize)
        run_pieces(lambda lo, hi: _split_fields(words, shifts, masks, out, lo, hi), n, PIECE)
        return list(out)

    def views(self, raw: np.ndarray, itemsize: int, count: bool = True) -> list[PlaneView]:
        """The planes of :meth:`split` as views of the raw words. Sign and exponent planes are
        counted in one pass over the words (they are nearly always entropy coded); the others
        are sampled and ORed in another, and counted only if their coder needs it. With
        ``count=False`` every plane of a tensor over the sample's size is judged from its
        sample alone, its width taken as its field's: a quick estimate, without a pass over
        the words (smaller tensors are counted whole)."""
        self.check_applies(raw.size, itemsize)
        one = (np.zeros(1, np.int64), np.full(1, 0xFF, np.int64))
        if self.layout_id == RAW.layout_id:
            return sampled(raw, *one, ors=count)
        fields = self.planes(itemsize)
        w = self.word_size(itemsize)
        if w not in _UINT:  # (16-byte elements under BYTES: complex128)
            return [sampled(p, *one, ors=count)[0] for p in self.split(raw, itemsize)]
        words = raw.view(_UINT[w])
        all_shifts, all_masks = self.shifts_masks(itemsize)
        if words.size <= SAMPLE_CHUNKS * SAMPLE_CHUNK and words.size < WINDOW_MIN:
            # (every plane of a tensor this small is counted whole, sampled or not: in one
            # call, as two would count them the same way)
            return counted(words, all_shifts, all_masks)
        views: list[PlaneView | None] = [None] * len(fields)
        exact = [count and f.kind in (KIND_SIGN, KIND_EXPONENT) for f in fields]
        window = None  # (the counted fields' window gives the ORs of the others inside it)
        ks = [k for k in range(len(fields)) if exact[k]]
        if ks:
            made, window = counted_window(words, all_shifts[ks], all_masks[ks])
            for k, v in zip(ks, made):
                views[k] = v
        ks = [k for k in range(len(fields)) if not exact[k]]
        if ks:
            made = sampled(words, all_shifts[ks], all_masks[ks], ors=count, window=window)
            for k, v in zip(ks, made):
                views[k] = v
        return views

    def merge(self, planes: list[np.ndarray], raw_nbytes: int, itemsize: int) -> np.ndarray:
        """Inverse of :meth:`split`; returns ``raw_nbytes`` bytes."""
        w = self.word_size(itemsize)
        n = self.check_applies(raw_nbytes, itemsize)
        if self.layout_id == RAW.layout_id:
            return planes[0]
        if self.layout_id == BYTES.layout_id and w not in _UINT:
            out = np.empty((n, w), dtype=np.uint8)
            for j, p in enumerate(planes):
                out[:, j] = p
            return out.reshape(-1)
        fields = self.planes(itemsize)
        words = np.empty(n, dtype=_UINT[w])
        src = tuple(_readonly(p) for p in planes)
        shifts = tuple(f.shift for f in fields)
        masks = tuple(np.uint8((1 << f.bits) - 1) for f in fields)
        over = np.zeros(max(1, -(-n // PIECE)), dtype=np.uint8)

        def piece(lo: int, hi: int) -> None:
            over[lo // PIECE] = self._merge_words(src, shifts, masks, words, lo, hi, False)

        run_pieces(piece, n, PIECE)
        if over.any():
            for f, p in zip(fields, planes):
                if int(np.bitwise_or.reduce(p)) >> f.bits:
                    raise FormatError(f"{f.label} plane holds values wider than its "
                                      f"{f.bits} bits")
        return words.view(np.uint8)

    def merges_in_pieces(self, itemsize: int) -> bool:
        """Whether :meth:`merge_slices` merges this layout's planes (else it returns None at
        once): not the raw layout, and words of 1, 2, 4 or 8 bytes."""
        return self.layout_id != RAW.layout_id and self.word_size(itemsize) in _UINT

    def merge_slices(self, slicers: list[Slicer], raw_nbytes: int, itemsize: int,
                     xor_into: np.ndarray | None = None, leaves: np.ndarray | None = None
                     ) -> np.ndarray | None:
        """:meth:`merge` of planes given as slicers, a piece of every plane at a time, so that
        no plane is decoded whole; None for the raw layout, where a slice is corrupt, or where
        a plane holds values wider than its field (decoding whole planes and :meth:`merge`
        then say what is wrong). ``xor_into``: ``raw_nbytes`` bytes to XOR the merged words
        into instead of returning new ones (a delta applied as it is merged: the split is a
        permutation of bits, so merging commutes with XOR); partly XORed where None is
        returned. ``leaves`` (:func:`hashing.leaves_for` the raw bytes): filled with the leaf
        digests of the merged (or XORed) bytes, each piece hashed as it is merged; whole
        only where the bytes are returned."""
        w = self.word_size(itemsize)
        n = self.check_applies(raw_nbytes, itemsize)
        if not self.merges_in_pieces(itemsize):
            return None
        if xor_into is not None and (xor_into.nbytes != raw_nbytes
                                     or not xor_into.flags.writeable):
            raise ValueError("xor_into must be the tensor's writable raw bytes")
        fields = self.planes(itemsize)
        words = np.empty(n, dtype=_UINT[w]) if xor_into is None else xor_into.view(_UINT[w])
        shifts = tuple(f.shift for f in fields)
        masks = tuple(np.uint8((1 << f.bits) - 1) for f in fields)
        # every alignment is a power of two, so the largest is a multiple of the others
        piece = max(PIECE, *(s.align for s in slicers))
        bad = np.zeros(max(1, -(-n // piece)), dtype=bool)
        raw = words.view(np.uint8)

        def hashed(lo: int, hi: int) -> None:
            # (a piece's bytes start on a leaf: PIECE words of any size are whole leaves)
            if leaves is not None and not bad[lo // piece]:
                hashing.hash_span(raw, lo * w, hi * w, leaves)
        packed = self._packed_sign_mantissa(slicers)
        if packed is not None:
            signs, mants = packed
            rest = [s for k, s in enumerate(slicers) if k not in (0, 2)]
            xor = xor_into is not None

            def merge_packed(lo: int, hi: int) -> None:
                parts = [s.get(lo, hi) for s in rest]
                if any(p is None for p in parts):
                    bad[lo // piece] = True
                    return
                exp, *low = (_readonly(p) for p in parts)
                low1, low2 = low or (exp, exp)
                _merge_packed(signs, exp, mants, low1, low2, words[lo:hi], lo, bool(low), xor)
                hashed(lo, hi)

            run_pieces(merge_packed, n, piece)
            return None if bad.any() else raw

        def merge(lo: int, hi: int) -> None:
            parts = [s.get(lo, hi) for s in slicers]
            if any(p is None for p in parts):
                bad[lo // piece] = True
            else:
                src = tuple(_readonly(p) for p in parts)
                bad[lo // piece] = self._merge_words(src, shifts, masks, words[lo:hi], 0,
                                                     hi - lo, xor_into is not None)
                hashed(lo, hi)

        run_pieces(merge, n, piece)
        return None if bad.any() else raw

    def _merge_words(self, src: tuple, shifts: tuple, masks: tuple, words: np.ndarray,
                     lo: int, hi: int, xor: bool) -> int:
        """Merge the planes ``src`` into words[lo:hi] (``xor``: XOR into them); the OR of the
        bits found above their field's width (none under the bytes layout, whose fields are
        whole bytes)."""
        if self.layout_id == BYTES.layout_id:
            _merge_bytes(src, words, lo, hi, xor)
            return 0
        return _merge_fields(src, shifts, masks, words, lo, hi, xor)

    def _packed_sign_mantissa(self, slicers: list[Slicer]
                              ) -> tuple[np.ndarray, np.ndarray] | None:
        """The stored sign and 7-bit mantissa planes of a bf16 or fp32 layout whose slicers
        have them bit-packed (bitpack and bitpack-w at 7 bits, the writer's usual choice), which
        :func:`_merge_packed` merges without unpacking them first; else None."""
        if self.layout_id not in (BF16.layout_id, FP32.layout_id):
            return None
        mantissa = slicers[2].packed
        if mantissa is None or mantissa[1] != 7:
            return None
        sign = slicers[0].packed_form()  # (made only where the mantissa plane is packed)
        if sign is None or sign[1] != 1:
            return None
        return _readonly(sign[0]), _readonly(mantissa[0])

    def shifts_masks(self, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
        """Each plane's shift and mask in the word (of :meth:`planes`), as the counting and
        splitting kernels take them."""
        fields = self.planes(itemsize)
        return (np.array([f.shift for f in fields], dtype=np.int64),
                np.array([(1 << f.bits) - 1 for f in fields], dtype=np.int64))


_UINT = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def merge_stored(layout: Layout, itemsize: int, raw_nbytes: int,
                 planes: list[tuple[int, np.ndarray, int, bytes]],
                 xor_into: np.ndarray | None = None, leaves: np.ndarray | None = None
                 ) -> np.ndarray | None:
    """A tensor's raw bytes from its stored planes, each ``(codec ID, stored bytes, decoded
    length, params)``, merged a piece at a time (:meth:`Layout.merge_slices`, which says what
    ``xor_into`` and ``leaves`` do); a plane whose codec decodes only whole planes is decoded
    whole first.
    None for the raw layout or where anything is wrong: decoding plane by plane then names
    it."""
    if layout.layout_id == RAW.layout_id:
        return None

    def slicer(plane: tuple[int, np.ndarray, int, bytes]) -> Slicer:
        codec = codecs.get(plane[0])
        s = codec.slicer(*plane[1:])
        if s is None:
            whole = codec.decode(*plane[1:])
            if whole.shape != (plane[2],):
                raise FormatError("plane decoded to another length")
            s = Slicer(1, lambda lo, hi: whole[lo:hi])
        return s

    try:
        slicers = threads.map_sized(slicer, planes, raw_nbytes)
    except S4Error:
        return None
    return layout.merge_slices(slicers, raw_nbytes, itemsize, xor_into, leaves)


def _readonly(plane: np.ndarray) -> np.ndarray:
    # numba types writable and read-only arrays differently; a tuple mixing them (planes read
    # from a buffer are read-only) is not indexable, so hand it read-only views only.
    view = np.ascontiguousarray(plane, dtype=np.uint8).view()
    view.flags.writeable = False
    return view


@kernel()
def _split_fields(words, shifts, masks, out, lo, hi):  # pragma: no cover - compiled
    for i in range(np.uint64(lo), np.uint64(hi)):
        w = np.int64(words[i])
        for k in range(shifts.size):
            out[k, i] = (w >> shifts[k]) & masks[k]


# One pass per word over every field: with the planes, shifts and masks as tuples the field
# loop unrolls (measured 1.7 GB/s against 0.65 GB/s field by field). The out-of-range check
# is an OR of every byte's bits outside its field, tested once per piece.
@kernel()
def _merge_fields(planes, shifts, masks, words, lo, hi, xor=False
                  ):  # pragma: no cover - compiled
    """Fill words[lo:hi] (``xor``: XOR into them); return the OR of the bits found above
    their field's width."""
    over = np.uint8(0)
    for i in range(np.uint64(lo), np.uint64(hi)):
        w = words.dtype.type(0)
        for k in range(len(planes)):
            v = planes[k][i]
            over |= v & ~masks[k]
            w |= words.dtype.type(v) << shifts[k]
        if xor:
            words[i] ^= w
        else:
            words[i] = w
    return over


# The bytes layout's planes are whole bytes at bits 0, 8, 16...: with the shifts constant and no
# field to check, the loop runs as vectors (bytes of 2-byte words, in cache: 0.14 against the
# field merge's 0.34 ns a word; 4 bytes 0.27 against 0.61, 8 bytes 0.59 against 1.09).
@kernel()
def _merge_bytes(planes, words, lo, hi, xor):  # pragma: no cover - compiled
    """Fill words[lo:hi] (``xor``: XOR into them) with byte ``k`` of each word from
    ``planes[k]``."""
    if xor:
        for i in range(np.uint64(lo), np.uint64(hi)):
            w = words.dtype.type(0)
            for k in range(len(planes)):
                w |= words.dtype.type(planes[k][i]) << words.dtype.type(8 * k)
            words[i] ^= w
    else:
        for i in range(np.uint64(lo), np.uint64(hi)):
            w = words.dtype.type(0)
            for k in range(len(planes)):
                w |= words.dtype.type(planes[k][i]) << words.dtype.type(8 * k)
            words[i] = w


# The sign and the first mantissa plane read packed, 8 words per group from one sign byte and 7
# mantissa bytes: one pass where unpacking both planes and merging took three (bf16, in cache,
# 0.60 ns a word against 1.19). Each case runs its own loop, its flags constants (with them
# tested per word, 2 times slower).
@kernel()
def _merge_packed(signs, exp, mants, low1, low2, words, lo, wide, xor
                  ):  # pragma: no cover - compiled
    """Fill words[i] (``xor``: XOR into them) with word ``lo + i`` of a bf16 layout (``wide``
    False: sign, exponent, mantissa at bits 15, 7, 0) or an fp32 one (``wide``: those at bits
    31, 23, 16, and bytes ``low1``, ``low2`` at 8, 0), from the packed ``signs`` (1 bit each)
    and ``mants`` (7 bits each) of the whole plane and the exponents ``exp[i]``. ``lo`` is a
    multiple of 8."""
    if wide and xor:
        _packed_words(signs, exp, mants, low1, low2, words, lo, True, True)
    elif wide:
        _packed_words(signs, exp, mants, low1, low2, words, lo, True, False)
    elif xor:
        _packed_words(signs, exp, mants, low1, low2, words, lo, False, True)
    else:
        _packed_words(signs, exp, mants, low1, low2, words, lo, False, False)


@kernel(inline="always")
def _packed_words(signs, exp, mants, low1, low2, words, lo, wide, xor
                  ):  # pragma: no cover - compiled
    n = np.uint64(words.size)
    g0 = np.uint64(lo) // np.uint64(8)
    first = np.uint64(0)  # the first group the loop below merges
    if _vector_merge(signs, exp, mants, low1, low2, words):
        block = np.uint64(BLOCK_WORDS)
        while first * np.uint64(8) + block <= n:
            _merge_block(signs, exp, mants, low1, low2, words, g0 + first,
                         first * np.uint64(8), xor)
            first += block // np.uint64(8)
    for i in range(first, n // np.uint64(8)):
        g = g0 + i
        sb = np.uint64(signs[g])
        at = np.uint64(7) * g
        acc = np.uint64(0)
        for b in range(7):
            acc |= np.uint64(mants[at + np.uint64(b)]) << np.uint64(8 * b)
        base = np.uint64(8) * i
        for j in range(8):
            k = base + np.uint64(j)
            top = (((sb >> np.uint64(j)) & np.uint64(1)) << np.uint64(15)) | (
                np.uint64(exp[k]) << np.uint64(7)) | ((acc >> np.uint64(7 * j)) & np.uint64(0x7F))
            _put_word(words, k, top, low1, low2, wide, xor)
    for k in range(n - n % np.uint64(8), n):  # the plane's last, partial group
        t = np.uint64(lo) + k
        bit = np.uint64(7) * t
        m = np.uint64(mants[bit >> np.uint64(3)]) >> (bit & np.uint64(7))
        if bit & np.uint64(7) > np.uint64(1):
            m |= np.uint64(mants[(bit >> np.uint64(3)) + np.uint64(1)]) << (
                np.uint64(8) - (bit & np.uint64(7)))
        top = (((np.uint64(signs[t >> np.uint64(3)]) >> (t & np.uint64(7))) & np.uint64(1))
               << np.uint64(15)) | (np.uint64(exp[k]) << np.uint64(7)) | (m & np.uint64(0x7F))
        _put_word(words, k, top, low1, low2, wide, xor)


@kernel(inline="always")
def _put_word(words, k, top, low1, low2, wide, xor):  # pragma: no cover - compiled
    w = (top << np.uint64(16)) | (np.uint64(low1[k]) << np.uint64(8)) | np.uint64(low2[k]) \
        if wide else top
    if xor:
        words[k] ^= words.dtype.type(w)
    else:
        words[k] = words.dtype.type(w)


# Words a vector merge makes at once: 64 bytes of exponents, 56 of packed mantissas, 8 of signs.
BLOCK_WORDS = 64


def _vectors_take(context, signs, exp, mants, low1, low2, words) -> bool:
    """Whether :func:`_merge_block` runs for these arrays (numba types) on ``context``'s target:
    AVX2 or better, and the C-contiguous arrays it addresses by their data pointers: uint8
    planes, and uint16 (bf16) or uint32 (fp32) words. AVX-512 BW and VBMI do the mantissas'
    byte permutes and per-word shifts in one instruction each; AVX2 in a few (a Zen 2 core,
    8M words: bf16 0.21 ns a word against the word loop's 0.77, fp32 0.40 against 1.23)."""
    from numba.core import types

    planes = (signs, exp, mants, low1, low2)
    return all(isinstance(t, types.Array) and t.layout == "C" for t in (*planes, words)) \
        and all(str(t.dtype) == "uint8" for t in planes) \
        and str(words.dtype) in ("uint16", "uint32") \
        and target_has(context, "avx2")


@intrinsic
def _vector_merge(typingctx, signs, exp, mants, low1, low2, words
                  ):  # pragma: no cover - compiled
    """True (a constant) where :func:`_merge_block` runs (:func:`_vectors_take`)."""
    from numba.core import types

    arrays = (signs, exp, mants, low1, low2, words)
    return types.boolean(*arrays), constant(lambda context: _vectors_take(context, *arrays))


@intrinsic
def _merge_block(typingctx, signs, exp, mants, low1, low2, words, g, k, xor
                 ):  # pragma: no cover - compiled
    """:func:`_packed_words` of the BLOCK_WORDS words from words[k] (word 8 * ``g`` of the
    plane) as vectors: word j's 7 mantissa bits start at bit 7 * j of the block's 56 bytes, so
    two byte shuffles fetch the bytes holding them and a shift per word aligns them."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        tw = signature.args[5]
        *planes, words_a, g, k, xor = args
        ptrs = [context.make_array(t)(context, builder, a).data
                for t, a in zip(signature.args[:5], planes)]
        sptr, eptr, mptr, l1ptr, l2ptr = ptrs
        wptr = context.make_array(tw)(context, builder, words_a).data
        if not _vectors_take(context, *signature.args[:6]):
            return context.get_dummy_value()  # (never run: _vector_merge() is False here)
        n = BLOCK_WORDS
        i1, i8, i16, i64 = (ir.IntType(b) for b in (1, 8, 16, 64))
        wide = str(tw.dtype) == "uint32"
        wt = ir.IntType(32 if wide else 16)
        vec = lambda t, m=n: ir.VectorType(t, m)  # noqa: E731
        splat = lambda t, v: ir.Constant(vec(t), [v] * n)  # noqa: E731

        def load(ptr, at, ty):
            return builder.load(builder.bitcast(builder.gep(ptr, [at]), ir.PointerType(ty)),
                                align=1)

        def bytes_at(ptr):
            return builder.zext(load(ptr, k, vec(i8)), vec(wt))

        signs64 = builder.bitcast(load(sptr, g, i64), vec(i1))
        top = builder.shl(builder.zext(signs64, vec(wt)), splat(wt, 15))
        top = builder.or_(top, builder.shl(bytes_at(eptr), splat(wt, 7)))
        m56 = load(mptr, builder.mul(g, ir.Constant(i64, 7)), vec(i8, 56))
        zero = ir.Constant(vec(i8, 56), None)  # (index 56: the byte past the block, as 0)
        lo_at = [7 * j // 8 for j in range(n)]
        low = builder.shuffle_vector(m56, zero, ir.Constant(vec(ir.IntType(32)), lo_at))
        high = builder.shuffle_vector(m56, zero,
                                      ir.Constant(vec(ir.IntType(32)), [a + 1 for a in lo_at]))
        pair = builder.or_(builder.zext(low, vec(i16)),
                           builder.shl(builder.zext(high, vec(i16)), splat(i16, 8)))
        mant = builder.and_(builder.lshr(pair, ir.Constant(vec(i16), [7 * j % 8
                                                                      for j in range(n)])),
                            splat(i16, 0x7F))
        top = builder.or_(top, builder.zext(mant, vec(wt)) if wide else mant)
        out = top
        if wide:
            out = builder.or_(builder.shl(top, splat(wt, 16)),
                              builder.or_(builder.shl(bytes_at(l1ptr), splat(wt, 8)),
                                          bytes_at(l2ptr)))
        at = builder.bitcast(builder.gep(wptr, [k]), ir.PointerType(vec(wt)))
        with builder.if_else(xor) as (then, otherwise):
            with then:
                builder.store(builder.xor(builder.load(at, align=1), out), at, align=1)
            with otherwise:
                builder.store(out, at, align=1)
        return context.get_dummy_value()

    return types.void(signs, exp, mants, low1, low2, words, types.uint64, types.uint64,
                      types.boolean), codegen


@kernel()
def _vector_probe(signs, words):  # pragma: no cover - compiled
    return _vector_merge(signs, signs, signs, signs, signs, words)


def vector_merging() -> bool:
    """Whether this process merges packed bf16 and fp32 planes as vectors (else word by word);
    both give the same words."""
    planes = np.zeros(8, np.uint8)
    return bool(_vector_probe(planes, np.zeros(8, np.uint16))) and \
        bool(_vector_probe(planes, np.zeros(8, np.uint32)))


RAW = Layout(0, "raw", 1, (Field(KIND_RAW, 0, 0, 8),))
BF16 = Layout(1, "bf16", 2, (Field(KIND_SIGN, 0, 15, 1), Field(KIND_EXPONENT, 0, 7, 8),
                             Field(KIND_MANTISSA, 0, 0, 7)))
FP16 = Layout(2, "fp16", 2, (Field(KIND_SIGN, 0, 15, 1), Field(KIND_EXPONENT, 0, 10, 5),
                             Field(KIND_MANTISSA, 0, 8, 2), Field(KIND_MANTISSA, 1, 0, 8)))
FP32 = Layout(3, "fp32", 4, (Field(KIND_SIGN, 0, 31, 1), Field(KIND_EXPONENT, 0, 23, 8),
                             Field(KIND_MANTISSA, 0, 16, 7), Field(KIND_MANTISSA, 1, 8, 8),
                             Field(KIND_MANTISSA, 2, 0, 8)))
BYTES = Layout(4, "bytes", 0, ())

BY_ID = {lay.layout_id: lay for lay in (RAW, BF16, FP16, FP32, BYTES)}

# The layout a writer uses by default for each dtype name (others: BYTES if itemsize > 1).
PREFERRED = {"bfloat16": BF16, "float16": FP16, "complex32": FP16, "float32": FP32,
             "complex64": FP32}


def by_id(layout_id: int) -> Layout:
    try:
        return BY_ID[layout_id]
    except KeyError:
        raise UnsupportedFeatureError(
            f"unknown plane layout ID {layout_id}; v1 defines {sorted(BY_ID)}") from None


def preferred(dtype_name: str, itemsize: int) -> Layout:
    return PREFERRED.get(dtype_name, BYTES if itemsize > 1 else RAW)
