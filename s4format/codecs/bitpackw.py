"""Codec 8, ``bitpack-w``: a plane whose every byte is below ``2^w`` stored as ``w`` bits per
byte, ``1 <= w <= 7`` (``params`` = the one byte ``w``).

Plane byte ``i`` takes bits ``w*i .. w*i + w - 1`` of the stored bit string, its own bit ``b``
at bit ``w*i + b``; stored bit ``t`` is bit ``t % 8`` of stored byte ``t // 8`` (LSB first, as
``bitpack``, which is the case ``w = 1``). So eight plane bytes fill exactly ``w`` stored bytes,
the little-endian integer ``sum(plane[8g + j] << (w*j))``. The unused high bits of the last
byte must be zero. The 7-bit mantissa planes of bf16 and fp32 are its main use: for trained
weights they are within about 0.2% of their order-0 entropy, so rANS gains little there,
while this codes and decodes at memory speed.
"""

from __future__ import annotations

import sys

import numpy as np

from s4format.codecs.abc import Codec, Encoded, Slicer
from s4format.codecs.registry import BITPACK_W, register
from s4format.codecs.view import PlaneView, run_pieces
from s4format.errors import CodecError
from s4format.jit import constant, intrinsic, kernel


def width_of(plane: np.ndarray) -> int:
    """Bits per byte the plane needs (``max`` bit length, at least 1)."""
    return max(1, int(plane.max()).bit_length()) if plane.size else 1


def stored_len(n: int, w: int) -> int:
    return (n * w + 7) // 8


_GROUPS = 1 << 16  # 8-byte groups per piece of work (512 KiB of plane)
_LITTLE = sys.byteorder == "little"  # (plane bytes stored as a whole word need it)


def pack_view(view: PlaneView, w: int) -> np.ndarray:
    """The ``w``-bit packing of a plane whose bytes are all below ``2**w``, read from its words
    (bitpack, codec 2, is the case ``w = 1``)."""
    n = view.size
    out = np.empty(stored_len(n, w), np.uint8)
    groups = n // 8
    run_pieces(lambda lo, hi: _pack(view.words, view.shift, view.mask, w, lo, hi, out),
               groups + 1, _GROUPS)
    return out


# Indices are unsigned so that numba skips its negative-index wraparound (measured 1.3 to 1.6
# times faster). The group loops are inlined with the common widths (1: signs, 7: mantissas)
# as constants, which LLVM unrolls: measured 2 to 5 times faster than with a variable width.
@kernel()
def _pack(words, shift, mask, w, g0, g1, out):  # pragma: no cover - compiled
    # groups [g0, g1) of eight plane bytes -> w stored bytes, as one little-endian integer;
    # group n // 8 (in the last piece) is the partial one at the end
    if _pack_vectors(words, out) and (w == 1 or w == 7):
        g0 = _pack_blocks(words, shift, w, g0, g1, out)
    if w == 1:
        _pack_groups(words, shift, mask, 1, g0, g1, out)
    elif w == 7:
        _pack_groups(words, shift, mask, 7, g0, g1, out)
    else:
        _pack_groups(words, shift, mask, w, g0, g1, out)


@kernel(inline="always")
def _pack_groups(words, shift, mask, w, g0, g1, out):  # pragma: no cover - compiled
    n = np.uint64(words.size)
    g = n // np.uint64(8)
    sh, mk, ww = np.uint64(shift), np.uint64(mask), np.uint64(w)
    for i in range(np.uint64(g0), min(np.uint64(g1), g)):
        acc = np.uint64(0)
        at = np.uint64(8) * i
        for j in range(8):
            acc |= ((np.uint64(words[at + np.uint64(j)]) >> sh) & mk) << (ww * np.uint64(j))
        at = ww * i
        for b in range(w):
            out[at + np.uint64(b)] = np.uint8(acc >> np.uint64(8 * b))
    if np.uint64(g1) > g:
        acc = np.uint64(0)
        for j in range(n - np.uint64(8) * g):
            v = (np.uint64(words[np.uint64(8) * g + np.uint64(j)]) >> sh) & mk
            acc |= v << (ww * np.uint64(j))
        for b in range(np.uint64(out.size) - ww * g):
            out[ww * g + np.uint64(b)] = np.uint8((acc >> np.uint64(8 * b)) & np.uint64(0xFF))


# A block of 64 words packed as vectors of the words' own width: a sign plane (w = 1) by one
# compare per word, its 64 bits one store; a 7-bit plane by three shift-and-merge steps that
# close the gaps between 7-bit fields within each 8 bytes, then one shuffle that drops every
# eighth byte (bf16 mantissas: 0.41 ns a word, in cache, for the group loop above).
BLOCK = 64


@kernel(inline="always")
def _pack_blocks(words, shift, w, g0, g1, out):  # pragma: no cover - compiled
    """Groups [g0, g1) up to the last whole block of BLOCK words packed as vectors (w 1 or 7:
    the fields' masks); returns the first group left."""
    per = np.uint64(BLOCK // 8)  # groups a block
    whole = np.uint64(words.size) // np.uint64(BLOCK)  # whole blocks in the plane
    g = np.uint64(g0)
    if g % per:  # (pieces start on block bounds; any other start takes the group loop)
        return np.int64(g)
    ww = np.uint64(w)
    while g + per <= np.uint64(g1) and g // per < whole:
        if w == 1:
            _pack1_block(words, np.uint64(8) * g, shift, out, g)
        else:
            _pack7_block(words, np.uint64(8) * g, shift, out, ww * g)
        g += per
    return np.int64(g)


def _vectors_take(words, out) -> bool:
    """Whether the block packers take these numba array types: C-contiguous words of 2 or 4
    bytes and a C-contiguous uint8 output, addressed by their data pointers."""
    from numba.core import types

    return all(isinstance(t, types.Array) and t.layout == "C" and t.ndim == 1
               for t in (words, out)) and str(out.dtype) == "uint8" \
        and str(words.dtype) in ("uint16", "uint32")


@intrinsic
def _pack_vectors(typingctx, words, out):  # pragma: no cover - compiled
    """True (a constant) where :func:`_pack_blocks` takes ``words`` and ``out``."""
    from numba.core import types

    ok = _vectors_take(words, out)
    return types.boolean(words, out), constant(lambda _context: ok)


def _field_vector(context, builder, signature, args, bits):
    """The field of ``bits`` bits at ``shift`` of the BLOCK words from ``at``, as a vector of
    the words' width, and the output's data pointer (args: words, at, shift, out, ...)."""
    from llvmlite import ir

    tw, _, _, to = signature.args[:4]
    words_a, at, shift, out_a = args[:4]
    it = ir.IntType(tw.dtype.bitwidth)
    vec = ir.VectorType(it, BLOCK)
    wptr = context.make_array(tw)(context, builder, words_a).data
    optr = context.make_array(to)(context, builder, out_a).data
    v = builder.load(builder.bitcast(builder.gep(wptr, [at]), vec.as_pointer()), align=1)

    def splat(value):
        return ir.Constant(vec, [value] * BLOCK) if isinstance(value, int) else \
            builder.shuffle_vector(
                builder.insert_element(ir.Constant(vec, None), builder.trunc(value, it),
                                       ir.Constant(ir.IntType(32), 0)),
                ir.Constant(vec, None), ir.Constant(ir.VectorType(ir.IntType(32), BLOCK),
                                                    [0] * BLOCK))

    return builder.and_(builder.lshr(v, splat(shift)), splat((1 << bits) - 1)), optr


@intrinsic
def _pack1_block(typingctx, words, at, shift, out, g):  # pragma: no cover - compiled
    """Bits ``shift`` of words[at:at + BLOCK] into out[g:g + 8], word j at bit j."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        if not _vectors_take(signature.args[0], signature.args[3]):
            return context.get_dummy_value()  # (never run: _pack_vectors() is False)
        field, optr = _field_vector(context, builder, signature, args, 1)
        ones = builder.icmp_unsigned("!=", field, ir.Constant(field.type, [0] * BLOCK))
        i64 = ir.IntType(64)
        builder.store(builder.bitcast(ones, i64),
                      builder.bitcast(builder.gep(optr, [args[4]]), i64.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(words, at, shift, out, g), codegen


@intrinsic
def _pack7_block(typingctx, words, at, shift, out, o):  # pragma: no cover - compiled
    """The 7 bits at ``shift`` of words[at:at + BLOCK] into out[o:o + 56], word j at bits
    7j to 7j + 6."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        if not _vectors_take(signature.args[0], signature.args[3]):
            return context.get_dummy_value()  # (never run: _pack_vectors() is False)
        field, optr = _field_vector(context, builder, signature, args, 7)
        i8, i64 = ir.IntType(8), ir.IntType(64)
        q = builder.bitcast(builder.trunc(field, ir.VectorType(i8, BLOCK)),
                            ir.VectorType(i64, BLOCK // 8))
        # each step halves the fields' count: pairs of 7 into 14 bits, of 14 into 28, of 28
        # into 56, the upper one of each pair shifted down over the gap below it
        for keep, gap in ((0x00FF00FF00FF00FF, 1), (0x0000FFFF0000FFFF, 2),
                          (0x00000000FFFFFFFF, 4)):
            lo = builder.and_(q, ir.Constant(q.type, [keep] * (BLOCK // 8)))
            hi = builder.and_(q, ir.Constant(q.type, [~keep & (1 << 64) - 1] * (BLOCK // 8)))
            q = builder.or_(lo, builder.lshr(hi, ir.Constant(q.type, [gap] * (BLOCK // 8))))
        kept = [8 * g + b for g in range(BLOCK // 8) for b in range(7)]
        packed = builder.shuffle_vector(builder.bitcast(q, ir.VectorType(i8, BLOCK)),
                                        ir.Constant(ir.VectorType(i8, BLOCK), None),
                                        ir.Constant(ir.VectorType(ir.IntType(32), len(kept)),
                                                    kept))
        builder.store(packed, builder.bitcast(builder.gep(optr, [args[4]]),
                                              packed.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(words, at, shift, out, o), codegen


@kernel()
def _unpack(payload, w, n, out, g0, g1):  # pragma: no cover - compiled
    # groups [g0, g1) as _pack cuts them (the padding bits of the last byte are form_error's
    # to check)
    if w == 1:
        _unpack_groups(payload, 1, n, out, g0, g1)
    elif w == 7:
        _unpack_groups(payload, 7, n, out, _unpack7_words(payload, n, out, g0, g1), g1)
    else:
        _unpack_groups(payload, w, n, out, g0, g1)


@kernel(inline="always")
def _unpack_groups(payload, w, n, out, g0, g1):  # pragma: no cover - compiled
    mask = np.uint64((1 << w) - 1)
    ww = np.uint64(w)
    n = np.uint64(n)
    g = n // np.uint64(8)
    for i in range(np.uint64(g0), min(np.uint64(g1), g)):
        acc = np.uint64(0)
        at = ww * i
        for b in range(w):
            acc |= np.uint64(payload[at + np.uint64(b)]) << np.uint64(8 * b)
        at = np.uint64(8) * i
        for j in range(8):
            out[at + np.uint64(j)] = np.uint8((acc >> (ww * np.uint64(j))) & mask)
    if np.uint64(g1) > g:
        acc = np.uint64(0)
        for b in range(np.uint64(payload.size) - ww * g):
            acc |= np.uint64(payload[ww * g + np.uint64(b)]) << np.uint64(8 * b)
        for j in range(n - np.uint64(8) * g):
            out[np.uint64(8) * g + np.uint64(j)] = np.uint8((acc >> (ww * np.uint64(j))) & mask)


@kernel(inline="always")
def _unpack7_words(payload, n, out, g0, g1):  # pragma: no cover - compiled
    """The whole groups among [g0, g1) of a 7-bit plane, each written as one 8-byte word
    (measured 1.5 times faster than eight byte stores); returns the first group it left to
    :func:`_unpack_groups` (the partial last one, or all of them on a big-endian host)."""
    whole = np.uint64(n) // np.uint64(8)
    end = min(np.uint64(g1), whole)
    if not _LITTLE or np.uint64(g0) >= end:
        return np.uint64(g0)
    words = out[:np.uint64(8) * whole].view(np.uint64)
    for i in range(np.uint64(g0), end):
        acc = np.uint64(0)
        at = np.uint64(7) * i
        for b in range(7):
            acc |= np.uint64(payload[at + np.uint64(b)]) << np.uint64(8 * b)
        v = np.uint64(0)
        for j in range(8):
            v |= ((acc >> np.uint64(7 * j)) & np.uint64(0x7F)) << np.uint64(8 * j)
        words[i] = v
    return end


def unpack_slicer(payload: np.ndarray, w: int, n: int) -> Slicer:
    """Slices of a ``w``-bit packed plane of ``n`` bytes whose form is checked."""
    def get(lo: int, hi: int) -> np.ndarray:
        out = np.empty(hi - lo, np.uint8)
        at = w * (lo // 8)
        _unpack(payload[at:at + stored_len(hi - lo, w)], w, hi - lo, out, 0, (hi - lo) // 8 + 1)
        return out

    return Slicer(8, get, (payload, w))


def form_error(decoded_len: int, params: bytes, stored: int, last: int) -> str | None:
    """What is wrong with a bitpack-w plane's form, from its parameters, stored length and last
    stored byte (checked in this order); None if nothing. The GPU decoder checks with it too."""
    if len(params) != 1 or not 1 <= params[0] <= 7:
        return f"bitpack-w takes one parameter byte, the width 1..7; got {params.hex() or 'none'}"
    w = params[0]
    need = stored_len(decoded_len, w)
    if stored != need:
        return (f"bitpack-w plane of {decoded_len} bytes at {w} bits must store {need} bytes, "
                f"stores {stored}")
    if (decoded_len * w) % 8 and last >> ((decoded_len * w) % 8):
        return "bitpack-w padding bits in the last byte are not zero"
    return None


class BitpackWCodec(Codec):
    codec_id = BITPACK_W
    name = "bitpack-w"
    counts_estimate = True

    def encode(self, plane: np.ndarray) -> Encoded | None:
        w = width_of(plane)
        if w >= 8:
            return None
        return Encoded(pack_view(PlaneView.of(plane), w), bytes([w]))

    def encode_view(self, view: PlaneView) -> Encoded | None:
        w = view.width
        return None if w >= 8 else Encoded(pack_view(view, w), bytes([w]))

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        msg = form_error(decoded_len, params, len(payload),
                         int(payload[-1]) if len(payload) else 0)
        if msg is not None:
            raise CodecError(msg)
        out = np.empty(decoded_len, np.uint8)
        src, w = np.ascontiguousarray(payload, np.uint8), params[0]
        run_pieces(lambda lo, hi: _unpack(src, w, decoded_len, out, lo, hi),
                   decoded_len // 8 + 1, _GROUPS)
        return out

    def max_decoded_len(self, stored_len: int) -> int:
        return stored_len * 8  # w >= 1

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        if form_error(decoded_len, params, len(payload),
                      int(payload[-1]) if len(payload) else 0) is not None:
            return None
        return unpack_slicer(np.ascontiguousarray(payload, np.uint8), params[0], decoded_len)

    def estimate(self, plane: np.ndarray) -> int | None:
        w = width_of(plane)
        return None if w >= 8 else stored_len(plane.size, w)

    def estimate_view(self, view: PlaneView) -> int | None:
        w = view.width
        return None if w >= 8 else stored_len(view.size, w)


register(BitpackWCodec())
