"""Codec 1, ``raw``: the plane bytes stored as they are. Always applicable; the floor of every
codec choice, so a plane never stores more than its own length."""

from __future__ import annotations

import numpy as np

from s4format.codecs.abc import Codec, Encoded, Slicer
from s4format.codecs.registry import RAW, register
from s4format.codecs.view import PlaneView
from s4format.errors import CodecError


def form_error(decoded_len: int, params: bytes, stored: int, last: int = 0) -> str | None:
    """What is wrong with a raw plane's form (checked in this order); None if nothing. The
    GPU decoder checks codec-9 segments with it too."""
    if params:
        return f"raw takes no parameters, got {len(params)} bytes"
    if stored != decoded_len:
        return f"raw plane stores {stored} bytes but declares {decoded_len}"
    return None


class RawCodec(Codec):
    codec_id = RAW
    name = "raw"
    counts_estimate = True

    def encode(self, plane: np.ndarray) -> Encoded:
        return Encoded(plane)

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        msg = form_error(decoded_len, params, len(payload))
        if msg is not None:
            raise CodecError(msg)
        return payload

    def max_decoded_len(self, stored_len: int) -> int:
        return stored_len

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        if form_error(decoded_len, params, len(payload)) is not None:
            return None
        return Slicer(1, lambda lo, hi: payload[lo:hi])

    def estimate(self, plane: np.ndarray) -> int:
        return int(plane.nbytes)

    def estimate_view(self, view: PlaneView) -> int:
        return view.size


register(RawCodec())
