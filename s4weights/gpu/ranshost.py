"""Host side of the GPU rANS coder: tables, estimates and stream pieces, all derived with the
CPU reference's own functions (``s4format.codecs.rans``) so both sides agree byte for byte."""

from __future__ import annotations

import numpy as np

from s4format.codecs import rans

HEADER_SIZE = rans.HEADER_SIZE


def header(mode: int, log2_block: int, n: int) -> bytes:
    return rans.HEADER.pack(mode, log2_block, 0, n)


def n_blocks(n: int, log2_block: int) -> int:
    return (n + (1 << log2_block) - 1) >> log2_block


def estimate(counts: np.ndarray, log2_block: int) -> int:
    """``RansCodec.estimate`` from a histogram instead of the plane (same arithmetic)."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        return HEADER_SIZE
    if np.count_nonzero(counts) == 1:
        return HEADER_SIZE + n_blocks(n, rans.LOG2_BLOCK_MAX)
    freqs = rans.normalise(counts)
    present = counts > 0
    bits = float(np.sum(counts[present] * (rans.PROB_BITS - np.log2(freqs[present]))))
    nb = n_blocks(n, log2_block)
    size = (HEADER_SIZE + len(rans.table_bytes(freqs)) + rans.BLOCK_OVERHEAD * nb
            + 2 * int(np.ceil(bits / rans.WORD_BITS)))
    return min(size, HEADER_SIZE + n)


def encoder_table(freqs: np.ndarray) -> np.ndarray:
    """256 x (x_max, rcp, bias, shift | (4096 - f) << 8) as u32: ``EncSym`` of rans.cu."""
    tab = rans._encoder_table(freqs)
    out = np.zeros((256, 4), dtype=np.uint32)
    out[:, 0] = tab[:, 0]
    out[:, 1] = tab[:, 1]
    out[:, 2] = tab[:, 3]
    out[:, 3] = tab[:, 2] | (tab[:, 4] << 8)
    return out


def decoder_table(freqs: np.ndarray) -> np.ndarray:
    return rans._decoder_table(freqs)


def const_stream(symbols: np.ndarray, log2_block: int, n: int) -> bytes:
    return header(rans.MODE_CONST, log2_block, n) + np.asarray(symbols, np.uint8).tobytes()


def rans_prefix(freqs: np.ndarray, log2_block: int, n: int) -> bytes:
    """Header and frequency table: the stream's bytes before the word counts."""
    return header(rans.MODE_RANS, log2_block, n) + rans.table_bytes(freqs)
