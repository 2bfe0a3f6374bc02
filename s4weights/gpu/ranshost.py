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


# -- vectorised over many planes (rows of a [P, 256] histogram): the same integer arithmetic as
# the per-plane functions above and ``s4format.codecs.rans``, without a Python loop per plane.

def normalise_many(counts: np.ndarray) -> np.ndarray:
    """``rans.normalise`` of every row (rows must be non-empty)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1, 256)
    p = counts.shape[0]
    total = counts.sum(axis=1, keepdims=True)
    present = counts > 0
    spare = rans.PROB_SCALE - present.sum(axis=1, keepdims=True)
    share = counts * spare
    freqs = share // total + present
    remainder = share - (freqs - present) * total
    leftover = rans.PROB_SCALE - freqs.sum(axis=1)   # < number of present symbols
    # the `leftover` present symbols with the largest remainders (ties: lower symbol) get one
    # more: one unique key per symbol (remainder < total <= 2^48 fits), absent symbols last;
    # a row's chosen keys are those up to its leftover-th smallest (numpy's sort of the keys,
    # no argsort: about half the time)
    key = np.where(present, -remainder * 256 + np.arange(256), np.int64(1) << 62)
    some = leftover > 0
    kth = np.sort(key, axis=1)[np.arange(p), np.maximum(leftover - 1, 0)]
    freqs += (key <= kth[:, None]) & some[:, None]
    return freqs


def encoder_tables(freqs: np.ndarray) -> np.ndarray:
    """``encoder_table`` of every row: [P, 256, 4] u32 (absent symbols are zero rows)."""
    freqs = np.asarray(freqs, dtype=np.int64).reshape(-1, 256)
    cum = np.cumsum(freqs, axis=1) - freqs
    f = np.maximum(freqs, 1)
    _m, bits = np.frexp((f - 1).astype(np.float64))  # bit_length(f - 1) for f > 1
    bits = bits.astype(np.int64)
    one = f == 1
    rcp = np.where(one, (1 << 32) - 1, ((np.int64(1) << (bits + 31)) + f - 1) // f)
    shift = np.where(one, 0, bits - 1)
    bias = np.where(one, cum + rans.PROB_SCALE - 1, cum)
    out = np.zeros((*freqs.shape, 4), dtype=np.uint32)
    live = freqs > 0
    out[..., 0] = np.where(live, freqs << (31 - rans.PROB_BITS), 0)
    out[..., 1] = np.where(live, rcp, 0)
    out[..., 2] = np.where(live, bias, 0)
    out[..., 3] = np.where(live, shift | ((rans.PROB_SCALE - freqs) << 8), 0)
    return out


def decoder_tables(freqs: np.ndarray) -> np.ndarray:
    """``rans._decoder_table`` of every row: [P, 4096] u32. Slot ``cum[s] + j`` of symbol s
    holds ``(f - 1) << 20 | j << 8 | s``: one ``np.repeat`` of a per-symbol base value
    ``(f - 1) << 20 | s`` minus ``cum << 8`` (mod 2**32), plus ``slot << 8``; no fancy
    indexing over the P * 4096 slots."""
    freqs = np.asarray(freqs, dtype=np.int64).reshape(-1, 256)
    p = freqs.shape[0]
    f = freqs.astype(np.uint32)
    cum = (np.cumsum(freqs, axis=1) - freqs).astype(np.uint32)
    key = ((f - np.uint32(1)) << np.uint32(20)) | np.arange(256, dtype=np.uint32)[None, :]
    base = np.repeat((key - (cum << np.uint32(8))).reshape(-1), freqs.reshape(-1))
    slot = np.arange(rans.PROB_SCALE, dtype=np.uint32) << np.uint32(8)
    return (base.reshape(p, rans.PROB_SCALE) + slot[None, :]).astype(np.uint32)


# PROB_BITS - log2(f) for every frequency f (f = 0: absent symbols, multiplied by a zero count):
# the same doubles as computing it per symbol, looked up instead of 256 log2 per plane (the
# device's rans_normalise gets this table too)
SYMBOL_BITS = rans.SYMBOL_BITS


# A bound on the 16-bit words rANS writes (the encoder's scratch, sized per plane and per block
# on the device: kernels/rans.cu rans_encode). A lane's state x stays in [2^15, 2^31): a symbol
# of frequency f first renormalises (x >= f << 19: one word out, x >>= 16, so x >= 8 f after),
# then x' = floor(x / f) * 4096 + x mod f + c < (4096 / f) (x + f), so
# log2 x' < log2 x + log2(4096 / f) + log2(9 / 8). Summed over a lane's symbols, with each word
# taking 16 bits off and the final state no smaller than the initial 2^15: 16 words <= the sum
# of (log2(4096 / f) + log2(9 / 8)). WORD_COST[f] is that cost in units of 2^-16 bit, rounded
# up (plus one unit for the doubles' rounding); the words of any set of lanes' symbols (a block,
# a plane) are at most the sum of their WORD_COST >> 20. The device sums it per plane
# (rans_normalise: the scratch the host sizes) and per block (rans_encode: each block's share).
WORD_COST = (np.floor((SYMBOL_BITS + np.log2(9 / 8)) * 65536) + 1).astype(np.uint32)
WORD_COST[0] = 0


def word_bound(cost_sum) -> np.ndarray:
    """The most words a plane (or block) whose symbols' WORD_COST sum to ``cost_sum`` writes."""
    return np.asarray(cost_sum, np.int64) >> 20


def estimate_many(counts: np.ndarray, freqs: np.ndarray, log2_block: int) -> np.ndarray:
    """``estimate`` of every row with more than one symbol present (others: don't care).
    The per-symbol bit costs are summed in symbol order, one addition at a time, as the
    device's ``rans_normalise`` and the per-plane estimate (``RansCodec.estimate_counts``) sum
    them, so all three give the same estimate."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1, 256)
    n = counts.sum(axis=1)
    f = np.asarray(freqs, dtype=np.int64)
    cost = counts * SYMBOL_BITS[f]  # absent symbols: 0 * 12.0
    bits = np.zeros(counts.shape[0])
    for t in range(256):
        bits += cost[:, t]
    k = (freqs > 0).sum(axis=1)
    table = rans.BITMAP_SIZE + 2 * k
    table += -table % 4
    nb = (n + (1 << log2_block) - 1) >> log2_block
    size = HEADER_SIZE + table + rans.BLOCK_OVERHEAD * nb + 2 * np.ceil(bits / rans.WORD_BITS
                                                                       ).astype(np.int64)
    return np.minimum(size, HEADER_SIZE + n)


# -- stream pieces of many planes at once: frequency tables, headers, CONST streams

def table_sizes(freqs: np.ndarray) -> np.ndarray:
    """``len(rans.table_bytes(f))`` of every row f: bitmap, u16 per symbol, 4-aligned."""
    size = rans.BITMAP_SIZE + 2 * (np.asarray(freqs).reshape(-1, 256) > 0).sum(axis=1)
    return size + -size % 4


def table_bodies(freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rans.table_bytes`` of every row, back to back: (bytes, length of each row's)."""
    freqs = np.asarray(freqs, np.int64).reshape(-1, 256)
    present = freqs > 0
    k = present.sum(axis=1)
    size = table_sizes(freqs)
    bitmap = np.packbits(present, axis=1, bitorder="little")
    body = freqs[present].astype("<u2").view(np.uint8)
    out = np.zeros(int(size.sum()), np.uint8)
    start = np.cumsum(size) - size
    out[(start[:, None] + np.arange(rans.BITMAP_SIZE)).reshape(-1)] = bitmap.reshape(-1)
    out[ragged_positions(start + rans.BITMAP_SIZE, 2 * k)] = body
    return out, size


def ragged_positions(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Positions ``start[r] + j`` for ``j < length[r]`` of every row r, in row order."""
    length = np.asarray(length, np.int64)
    first = np.cumsum(length) - length
    return np.repeat(np.asarray(start, np.int64) - first, length) + np.arange(int(length.sum()))


def stream_heads(mode, log2_block, n, body: np.ndarray, body_len
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host bytes of many rANS streams: row r is ``header(mode[r], log2_block[r], n[r])``
    followed by its ``body_len[r]`` bytes of ``body`` (rows' bodies back to back). Returns
    (bytes, start of each row's, length of each row's)."""
    n = np.asarray(n, np.int64).reshape(-1)
    body_len = np.asarray(body_len, np.int64).reshape(-1)
    hs = HEADER_SIZE
    length = hs + body_len
    start = np.cumsum(length) - length
    hdr = np.zeros((n.size, hs), np.uint8)
    hdr[:, 0] = mode
    hdr[:, 1] = log2_block
    hdr[:, 4:12] = n.astype("<u8").view(np.uint8).reshape(-1, 8)
    out = np.empty(int(length.sum()), np.uint8)
    out[(start[:, None] + np.arange(hs)).reshape(-1)] = hdr.reshape(-1)
    out[ragged_positions(start + hs, body_len)] = body
    return out, start, length


def const_whole(counts: np.ndarray, n: int) -> bytes:
    """The CONST stream of a plane of ``n`` bytes that hold one symbol."""
    sym = int(np.flatnonzero(counts)[0])
    nbm = n_blocks(n, rans.LOG2_BLOCK_MAX)
    return const_stream(np.full(nbm, sym), rans.LOG2_BLOCK_MAX, n)
