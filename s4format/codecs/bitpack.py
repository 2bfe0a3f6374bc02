"""Codec 2, ``bitpack``: a plane whose every byte is 0 or 1 stored as one bit per byte.

Bit ``i`` of the plane lands in stored byte ``i // 8`` at bit position ``i % 8`` (LSB first);
the unused high bits of the last byte must be zero. Sign planes and ``bool`` tensors use it.
"""

from __future__ import annotations

import numpy as np

from s4format.codecs.abc import Codec, Encoded, Slicer
from s4format.codecs.bitpackw import pack_view, unpack_slicer
from s4format.codecs.registry import BITPACK, register
from s4format.codecs.view import PlaneView
from s4format.errors import CodecError


def form_error(decoded_len: int, params: bytes, stored: int, last: int) -> str | None:
    """What is wrong with a bitpack plane's form, from its parameters, stored length and last
    stored byte (checked in this order); None if nothing. The GPU decoder checks codec-9
    segments with it too."""
    if params:
        return f"bitpack takes no parameters, got {len(params)} bytes"
    if stored != (decoded_len + 7) // 8:
        return (f"bitpack plane of {decoded_len} bits must store {(decoded_len + 7) // 8} "
                f"bytes, stores {stored}")
    tail = decoded_len % 8
    if tail and last >> tail:
        return "bitpack padding bits in the last byte are not zero"
    return None


class BitpackCodec(Codec):
    codec_id = BITPACK
    name = "bitpack"
    counts_estimate = True

    def encode(self, plane: np.ndarray) -> Encoded | None:
        if plane.size and int(plane.max()) > 1:
            return None
        return Encoded(np.packbits(plane, bitorder="little"))

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        msg = form_error(decoded_len, params, len(payload),
                         int(payload[-1]) if len(payload) else 0)
        if msg is not None:
            raise CodecError(msg)
        return np.unpackbits(payload, count=decoded_len, bitorder="little")

    def max_decoded_len(self, stored_len: int) -> int:
        return stored_len * 8

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        if form_error(decoded_len, params, len(payload),
                      int(payload[-1]) if len(payload) else 0) is not None:
            return None
        return unpack_slicer(np.ascontiguousarray(payload, np.uint8), 1, decoded_len)

    def estimate(self, plane: np.ndarray) -> int | None:
        if plane.size and int(plane.max()) > 1:
            return None
        return (plane.size + 7) // 8

    def estimate_view(self, view: PlaneView) -> int | None:
        return None if view.bits > 1 else (view.size + 7) // 8

    def encode_view(self, view: PlaneView) -> Encoded | None:
        return None if view.bits > 1 else Encoded(pack_view(view, 1))


register(BitpackCodec())
