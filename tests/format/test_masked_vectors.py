"""The masked-word kernels run 64 words at a time as vectors where the CPU has them (masks by
comparing words with zero; kept words, on AVX-512, by compressing in registers and expanding
loads, on AVX2, 16- and 32-bit words by shuffles from a table, 8 at a time): they give the
bytes and find the zero words that the word-by-word loops of every other CPU do, at lengths
around a block and a piece of work, sparse and dense, and for every dtype."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest

from s4format import FormatError, masked
from tests.generic_cpu import avx2_vectors_expected, on_generic_cpu, vbmi2_vectors_expected

LENGTHS = (0, 1, 7, 63, 64, 65, 127, 128, 200, masked.PIECE - 1, masked.PIECE + 65,
           2 * masked.PIECE + 3)
SHARES = (0.0, 0.02, 0.07, 0.3, 0.97, 1.0)
UINT = (np.uint8, np.uint16, np.uint32, np.uint64)


def _cases(seed: int):
    """(dtype, n, words, parent) of every case: words of each dtype, length and share non-zero,
    and a random parent."""
    rng = np.random.default_rng(seed)
    for dtype in UINT:
        top = np.iinfo(dtype).max
        for n in LENGTHS:
            for share in SHARES:
                words = rng.integers(1, top, n, dtype=dtype, endpoint=True)
                words[rng.random(n) >= share] = 0
                yield dtype, n, words, rng.integers(0, top, n, dtype=dtype, endpoint=True)


def _zero_found(mask: np.ndarray, kept: np.ndarray, word: int, n: int, at: int) -> bool:
    """Whether expand refuses the kept words with word ``at`` of them made zero."""
    bad = kept.copy()
    bad[at] = 0
    try:
        masked.expand(mask, bad.view(np.uint8), np.zeros(n * word, np.uint8), word, False)
    except FormatError as exc:
        assert "zero" in str(exc)
        return True
    return False


def _digest() -> str:
    """A digest of every mask, kept word and expanded tensor of the cases, and of which
    zero words expand found."""
    h = hashlib.sha256()
    for dtype, n, words, parent in _cases(5):
        word = np.dtype(dtype).itemsize
        mask, starts = masked.mask_of(words)
        kept = masked.kept_words(words, mask, starts)
        d_mask, d_starts = masked.mask_of(words ^ parent, parent)
        d_kept = masked.kept_words(words ^ parent, d_mask, d_starts, parent)
        placed = np.zeros(n * word, np.uint8)
        masked.expand(mask, kept.view(np.uint8), placed, word, False)
        xored = parent.copy().view(np.uint8)
        masked.expand(mask, kept.view(np.uint8), xored, word, True)
        for a in (mask, kept, starts, d_mask, d_kept, placed, xored):
            h.update(np.ascontiguousarray(a).tobytes())
        if kept.size:  # the first, one in the middle, the last
            for at in {0, kept.size // 2, kept.size - 1}:
                h.update(bytes([_zero_found(mask, kept, word, n, at)]))
    return h.hexdigest()


def test_the_cases_follow_the_spec() -> None:
    """On this machine's kernels (vectors or not), against numpy's reading of the spec."""
    for dtype, n, words, parent in _cases(6):
        mask, starts = masked.mask_of(words ^ parent, parent)
        nonzero = words != 0
        assert mask.tobytes() == np.packbits(nonzero, bitorder="little").tobytes()
        kept = masked.kept_words(words ^ parent, mask, starts, parent)
        assert kept.tobytes() == words[nonzero].tobytes()
        out = parent.copy().view(np.uint8)
        masked.expand(mask, kept.view(np.uint8), out, dtype().itemsize, True)
        assert out.tobytes() == (parent ^ words).tobytes()
        if kept.size:
            assert _zero_found(mask, kept, dtype().itemsize, n, kept.size - 1)


def test_vector_blocks_where_the_cpu_has_it() -> None:
    # (a numba that renamed what the gate reads would fall back to the word loops silently)
    assert masked.vector_blocks() == (vbmi2_vectors_expected() or avx2_vectors_expected())


@pytest.mark.skipif(sys.platform != "linux", reason="NUMBA_CPU_NAME is exercised on Linux")
def test_vector_and_word_loops_agree(tmp_path) -> None:
    # a generic CPU has no AVX-512 nor AVX2: the word loops ran there, and gave the same bytes
    there = on_generic_cpu(tmp_path, __name__, "[masked.vector_blocks(), _digest()]")
    assert there == [False, _digest()]


@pytest.mark.parametrize("dtype", UINT)
def test_kept_words_are_written_within_their_array(dtype) -> None:
    # The words after the last kept one (here a sentinel in the same buffer) are never
    # written, whatever the vector's length: AVX-512 stores each vector under a mask of its
    # kept lanes, AVX2 leaves the blocks near the piece's last kept word to the word loop.
    rng = np.random.default_rng(7)
    top = np.iinfo(dtype).max
    for n in (64, 100, 130, masked.PIECE + 70):
        words = rng.integers(1, top, n, dtype=dtype, endpoint=True)
        words[rng.random(n) < 0.5] = 0
        words[-3:] = 1
        mask, starts = masked.mask_of(words)
        m = int(starts[-1])
        guarded = np.empty(m + 64, dtype=dtype)
        guarded.view(np.uint8)[:] = 0x5A
        sentinel = guarded[m:].copy()
        # (one piece at a time, as kept_words runs them, into the front of the guarded array;
        # last first, so that words a piece wrote past its own would not be written again)
        for lo in reversed(range(0, n, masked.PIECE)):
            masked._by_mask(mask, lo, min(n, lo + masked.PIECE), words, guarded,
                            int(starts[lo // masked.PIECE]), masked._COMPACT, words)
        assert guarded[:m].tobytes() == words[words != 0].tobytes()
        assert guarded[m:].tobytes() == sentinel.tobytes()
