"""Signs and 7-bit fields packed from 16- and 32-bit words 64 at a time as vectors give the
bytes the group loop gives: against a reference built by numpy on this CPU, and in a child
process compiled for a generic CPU (where LLVM lowers the same vectors otherwise)."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest

from s4format.codecs.bitpackw import pack_view
from s4format.codecs.view import PlaneView
from tests.generic_cpu import on_generic_cpu

LENGTHS = (0, 1, 7, 8, 63, 64, 65, 127, 128, 1000, (1 << 19) + 13, 3 * (1 << 19) + 64 + 5)


def _reference(words: np.ndarray, shift: int, w: int) -> np.ndarray:
    plane = ((words.astype(np.uint64) >> np.uint64(shift)) & np.uint64((1 << w) - 1))
    bits = np.unpackbits(plane.astype(np.uint8)[:, None], axis=1, bitorder="little")[:, :w]
    return np.packbits(bits.reshape(-1), bitorder="little")


def _cases():
    rng = np.random.default_rng(20261205)
    for dtype in (np.uint16, np.uint32):
        top = 8 * np.dtype(dtype).itemsize
        for n in LENGTHS:
            words = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
            for w in (1, 7):
                for shift in sorted({0, 3, top - w}):
                    yield words, shift, w


def _digest() -> str:
    h = hashlib.sha256()
    for words, shift, w in _cases():
        mask = (1 << w) - 1
        h.update(pack_view(PlaneView(words, shift, mask, mask, None, 0), w).tobytes())
    return h.hexdigest()


def test_blocks_pack_what_numpy_packs() -> None:
    for words, shift, w in _cases():
        mask = (1 << w) - 1
        got = pack_view(PlaneView(words, shift, mask, mask, None, 0), w)
        assert np.array_equal(got, _reference(words, shift, w)), (words.dtype, words.size,
                                                                  shift, w)


@pytest.mark.skipif(sys.platform != "linux", reason="NUMBA_CPU_NAME is exercised on Linux")
def test_a_generic_cpu_packs_the_same_bytes(tmp_path) -> None:
    assert on_generic_cpu(tmp_path, __name__, "_digest()") == _digest()
