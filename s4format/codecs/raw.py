"""Codec 1, ``raw``: the plane bytes stored as they are. Always applicable; the floor of every
codec choice, so a plane never stores more than its own length."""

from __future__ import annotations

import numpy as np

from s4format.codecs.abc import Codec, Encoded, Slicer
from s4format.codecs.registry import RAW, register
from s4format.codecs.view import PlaneView
from s4format.errors import CodecError


class RawCodec(Codec):
    codec_id = RAW
    name = "raw"
    counts_estimate = True

    def encode(self, plane: np.ndarray) -> Encoded:
        return Encoded(plane)

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        if params:
            raise CodecError(f"raw takes no parameters, got {len(params)} bytes")
        if len(payload) != decoded_len:
            raise CodecError(f"raw plane stores {len(payload)} bytes but declares {decoded_len}")
        return payload

    def max_decoded_len(self, stored_len: int) -> int:
        return stored_len

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        if params or len(payload) != decoded_len:
            return None
        return Slicer(1, lambda lo, hi: payload[lo:hi])

    def estimate(self, plane: np.ndarray) -> int:
        return int(plane.nbytes)

    def estimate_view(self, view: PlaneView) -> int:
        return view.size


register(RawCodec())
