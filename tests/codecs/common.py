"""Checks every codec must pass (the contract in ``s4format/codecs/abc.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from s4format.codecs.abc import Codec
from s4format.errors import S4Error


def as_array(payload) -> np.ndarray:
    if isinstance(payload, np.ndarray):
        return payload
    return np.frombuffer(bytes(payload), dtype=np.uint8)


def check_encode_decode(codec: Codec, plane: np.ndarray) -> np.ndarray | None:
    """Round-trip ``plane``; returns the stored payload (or None when the codec declines)."""
    plane = np.ascontiguousarray(plane, dtype=np.uint8)
    original = plane.copy()
    enc = codec.encode(plane)
    assert np.array_equal(plane, original), "encode mutated its input"
    if enc is None:
        return None
    payload = as_array(enc.payload).copy()
    assert codec.max_decoded_len(len(payload)) >= plane.size
    out = codec.decode(payload, plane.size, enc.params)
    assert out.dtype == np.uint8 and out.shape == (plane.size,)
    assert np.array_equal(out, plane), "round trip is not bit-exact"
    again = codec.encode(plane)
    assert as_array(again.payload).tobytes() == payload.tobytes(), "encode is not deterministic"
    return payload


def check_corruption_raises(codec: Codec, plane: np.ndarray, rng: np.random.Generator,
                            trials: int = 200) -> None:
    """Flipped bytes and truncations either decode to *some* bytes or raise S4Error."""
    enc = codec.encode(np.ascontiguousarray(plane, dtype=np.uint8))
    if enc is None:
        pytest.skip("codec declined this plane")
    payload = as_array(enc.payload)
    for _ in range(trials):
        bad = payload.copy()
        if len(bad) and rng.random() < 0.7:
            bad[rng.integers(len(bad))] ^= np.uint8(1 << int(rng.integers(8)))
        else:
            bad = bad[: int(rng.integers(len(bad) + 1))].copy()
        try:
            out = codec.decode(bad, plane.size, enc.params)
        except S4Error:
            continue
        assert out.shape == (plane.size,) and out.dtype == np.uint8
