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

from s4format.codecs.view import PIECE, run_pieces
from s4format.errors import FormatError
from s4format.jit import intrinsic, kernel
from s4format.layouts import _UINT

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
           xor: bool) -> None:
    """Write (``xor``: XOR) the ``kept`` words (given as bytes) where ``mask`` has its bits
    into ``out``, the tensor's raw bytes of words of ``word`` bytes; with ``xor`` False,
    ``out`` must be zero (a new buffer). FormatError where the mask breaks a rule: its bits
    past the last word or its count of set bits (found before ``out`` is touched), or a zero
    word kept (found as the words are written: ``out`` is then spoiled)."""
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


@kernel(inline="always")
def _word(words, other, xor, i):  # pragma: no cover - compiled
    return words[i] ^ other[i] if xor else words[i]


# What _by_mask does with each word whose mask bit is set.
_COMPACT, _PLACE, _XOR, _COMPACT_XOR = 0, 1, 2, 3


@kernel()
def _by_mask(mask, lo, hi, dense, packed, j, mode, other):  # pragma: no cover - compiled
    """For words lo..hi of ``dense`` whose mask bit is set, in order, with ``packed[j:]``:
    _COMPACT copies them into ``packed`` (_COMPACT_XOR: each XORed with ``other``'s),
    _PLACE writes ``packed``'s into them, _XOR XORs them in (lo is a multiple of 64).
    Returns whether a word taken from ``packed`` was zero. Its cost follows the set bits,
    not the words: a fine-tuning delta keeps a fifth."""
    zero = False
    whole = (hi - lo) >> 6
    m64 = mask[lo >> 3:(lo >> 3) + 8 * whole].view(np.uint64)
    for q in range(whole):
        bits = m64[q]
        base = lo + 64 * q
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
