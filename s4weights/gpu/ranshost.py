"""Host side of the GPU rANS coder: tables, estimates and stream pieces, all derived with the
CPU reference's own functions (``s4format.codecs.rans``) so both sides agree byte for byte."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from s4format.codecs import rans

HEADER_SIZE = rans.HEADER_SIZE
# (module constants, for the compiled checks)
LOG2_MIN, LOG2_MAX = rans.LOG2_BLOCK_MIN, rans.LOG2_BLOCK_MAX
MODE_RAW, MODE_CONST, MODE_RANS = rans.MODE_RAW, rans.MODE_CONST, rans.MODE_RANS
BITMAP, BLOCK_OVERHEAD, PROB_SCALE = rans.BITMAP_SIZE, rans.BLOCK_OVERHEAD, rans.PROB_SCALE


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
SYMBOL_BITS = rans.PROB_BITS - np.log2(np.maximum(np.arange(rans.PROB_SCALE + 1), 1))


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
    device's ``rans_normalise`` sums them, so both give the same estimate. The per-plane
    estimate sums with numpy's pairwise order instead: the two can differ in the last ulp,
    which moves the estimate by one word on a knife edge (the estimate only ranks candidates;
    sizes are real)."""
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


# -- parsing many streams at once (the GPU decoder's validation) ------------------------------

class StreamError(rans.CodecError):
    """A malformed stream found by :func:`parse_streams`; ``plane`` is its row in the batch."""

    def __init__(self, plane: int, message: str) -> None:
        super().__init__(message)
        self.plane = plane


@dataclass
class Streams:
    """The block table of a batch of rANS streams (spec/rans.md), validated.

    Per stream (input row): ``mode`` and ``data_at`` (for RAW mode, where its plane bytes start
    inside the stream). Streams in CONST or RANS mode own blocks ``first[q] .. first[q + 1] - 1``
    where q counts those streams in input order (``coded`` maps q to the row). Per block:
    ``const`` (1 = fill with ``fill``), ``words``/``states`` (offsets inside the stream),
    ``count`` (words), ``table`` (row of ``freqs`` or -1), ``start`` (first symbol), ``length``."""
    mode: np.ndarray
    data_at: np.ndarray
    coded: np.ndarray
    first: np.ndarray
    const: np.ndarray
    fill: np.ndarray
    words: np.ndarray
    count: np.ndarray
    states: np.ndarray
    table: np.ndarray
    start: np.ndarray
    length: np.ndarray
    freqs: np.ndarray
    # per stream: log2 of its block size, its blocks, where its block section starts (the word
    # counts of a RANS stream, the fill bytes of a CONST one) and its row of ``freqs`` (or -1)
    lg: np.ndarray | None = None
    nb: np.ndarray | None = None
    pos: np.ndarray | None = None
    tab_of: np.ndarray | None = None

    @property
    def nblocks(self) -> int:
        return int(self.first[-1])


TABLE_BYTES = 160  # host and device bytes the GPU decoder spends per rANS block (tables)
TABLE_CAP = 64 << 20  # block tables a GPU decode may build beyond twice its stored bytes


class TablesTooLarge(Exception):
    """Streams that declare more blocks than the GPU decoder builds tables for: decoded by the
    CPU decoder instead (valid, but no writer of ours makes them)."""


def tables_fit(nblocks: int, stored: int) -> bool:
    """Whether the GPU decoder builds tables for ``nblocks`` blocks of streams that store
    ``stored`` bytes: a RANS-mode block stores 132 bytes or more, so those always fit."""
    return nblocks * TABLE_BYTES <= max(TABLE_CAP, 2 * stored)


def stream_blocks(host: np.ndarray, at, stored, n) -> np.ndarray:
    """Blocks each stream ``host[at[q]:at[q] + stored[q]]`` of ``n[q]`` symbols declares in its
    header (0 for RAW mode and for headers :func:`parse_streams` will refuse), read before
    parsing: a CONST stream stores one byte per block, so a hostile one can declare 2^27 blocks
    in 128 MiB, and the block tables would cost ~TABLE_BYTES each."""
    host = np.asarray(host, np.uint8).reshape(-1)
    at = np.asarray(at, np.int64).reshape(-1)
    n = np.asarray(n, np.int64).reshape(-1)
    ok = (np.asarray(stored, np.int64).reshape(-1) >= HEADER_SIZE) & (at + 1 < host.size)
    a = np.where(ok, at, 0)
    mode = np.where(ok, host[a], rans.MODE_RAW) if host.size else np.zeros(at.size, np.int64)
    lg = np.where(ok, host[np.minimum(a + 1, max(host.size - 1, 0))], rans.LOG2_BLOCK_MAX) \
        if host.size else np.full(at.size, rans.LOG2_BLOCK_MAX)
    lg = np.clip(lg.astype(np.int64), rans.LOG2_BLOCK_MIN, rans.LOG2_BLOCK_MAX)
    coded = (mode == rans.MODE_CONST) | (mode == rans.MODE_RANS)
    return np.where(coded, (n + (np.int64(1) << lg) - 1) >> lg, 0)


# The header and table checks of one stream, in the CPU decoder's order: a stream's first
# failing check is its code here (0: none), its message from _MESSAGES, the CPU decoder's
# words (s4format.codecs.rans), with the stream's values ``args`` where it names them.
(_OK, _SHORT, _RESERVED, _LOG2, _COUNT, _MAX, _MODE, _RAW_LEN, _CONST_LEN, _IN_BITMAP,
 _NO_SYMBOL, _IN_TABLE, _ZERO_FREQ, _SUM, _PADDING, _WORD_AREA) = range(16)
_MESSAGES = {
    _SHORT: "rans stream of {} bytes is shorter than its 12-byte header",
    _RESERVED: "rans header reserved field is not zero",
    _LOG2: "rans log2_block {} outside [5, 20]",
    _COUNT: "rans stream holds {} symbols, plane declares {}",
    _MAX: "rans stream declares {} symbols; streams hold fewer than 2^48",
    _MODE: "rans mode {} is not RAW (0), CONST (1) or RANS (2)",
    _RAW_LEN: "rans RAW stream must be {} bytes, is {}",
    _CONST_LEN: "rans CONST stream must be {} bytes, is {}",
    _IN_BITMAP: "rans stream ends inside the frequency table's presence bitmap",
    _NO_SYMBOL: "rans frequency table marks no symbol present",
    _IN_TABLE: "rans stream ends inside the frequency table ({} symbols)",
    _ZERO_FREQ: "rans frequency table gives a present symbol frequency 0",
    _SUM: "rans frequencies sum to {}, must sum to 4096",
    _PADDING: "rans frequency table padding is not zero",
    _WORD_AREA: "rans stream of {} bytes ends before the word area of its {} blocks (needs {})",
}
_MAX_SYMBOLS = rans.MAX_SYMBOLS


@njit(cache=True)
def _check_streams(host, at, stored, n, fail, arg, mode, lg, nb, pos, tab_of, freqs):
    """Per stream q (``host[at[q]:at[q] + stored[q]]``, decoding to ``n[q]`` symbols; every
    stream inside ``host``): ``fail[q]``, its first failing check (``arg[q]``: the values its
    message names, u64), and its mode, log2 block size, blocks (0 once failed), where its block
    section starts (the word counts of a RANS stream: after its table) and the row of
    ``freqs`` its table fills (-1: none). A RANS stream whose header holds gets a row, even if
    its table then fails (as parse_streams has always numbered them). Returns the rows used."""
    rows = 0
    for q in range(at.size):
        a, ln = at[q], stored[q]
        lg[q] = LOG2_MIN
        nb[q] = 0
        pos[q] = 0
        tab_of[q] = -1
        mode[q] = -1
        if ln < HEADER_SIZE:
            fail[q], arg[q, 0] = _SHORT, ln
            continue
        m = host[a]
        g = host[a + 1]
        count = np.uint64(0)
        for i in range(8):
            count |= np.uint64(host[a + 4 + i]) << np.uint64(8 * i)
        mode[q] = m
        if host[a + 2] != 0 or host[a + 3] != 0:
            fail[q] = _RESERVED
            continue
        if g < LOG2_MIN or g > LOG2_MAX:
            fail[q], arg[q, 0] = _LOG2, g
            continue
        if count != np.uint64(n[q]):
            fail[q], arg[q, 0], arg[q, 1] = _COUNT, count, n[q]
            continue
        if count >= np.uint64(_MAX_SYMBOLS):
            fail[q], arg[q, 0] = _MAX, count
            continue
        lg[q] = g
        blocks = (n[q] + (np.int64(1) << g) - 1) >> g
        if m == MODE_RAW:
            if ln != HEADER_SIZE + n[q]:
                fail[q], arg[q, 0], arg[q, 1] = _RAW_LEN, HEADER_SIZE + n[q], ln
            continue
        if m == MODE_CONST:
            if ln != HEADER_SIZE + blocks:
                fail[q], arg[q, 0], arg[q, 1] = _CONST_LEN, HEADER_SIZE + blocks, ln
            else:
                nb[q] = blocks
            continue
        if m != MODE_RANS:
            fail[q], arg[q, 0] = _MODE, m
            lg[q] = LOG2_MIN
            continue
        tab_of[q] = rows
        rows += 1
        if ln < HEADER_SIZE + BITMAP:
            fail[q] = _IN_BITMAP
            continue
        k = 0
        for sym in range(256):
            k += (np.int64(host[a + HEADER_SIZE + (sym >> 3)]) >> (sym & 7)) & 1
        if k == 0:
            fail[q] = _NO_SYMBOL
            continue
        size = BITMAP + 2 * k
        end = HEADER_SIZE + size + (-size) % 4
        if ln < end:
            fail[q], arg[q, 0] = _IN_TABLE, k
            continue
        f = freqs[tab_of[q]]
        body = a + HEADER_SIZE + BITMAP
        r = 0
        total = 0
        zero = False
        for sym in range(256):
            if (host[a + HEADER_SIZE + (sym >> 3)] >> (sym & 7)) & 1:
                f[sym] = np.int64(host[body + 2 * r]) | np.int64(host[body + 2 * r + 1]) << 8
                zero |= f[sym] == 0
                total += f[sym]
                r += 1
        if zero:
            fail[q] = _ZERO_FREQ
            continue
        if total != PROB_SCALE:
            fail[q], arg[q, 0] = _SUM, total
            continue
        pad_at = a + HEADER_SIZE + size
        if end > HEADER_SIZE + size and (host[pad_at] | host[pad_at + 1]) != 0:
            fail[q] = _PADDING
            continue
        if ln < end + BLOCK_OVERHEAD * blocks:
            fail[q], arg[q, 0], arg[q, 1], arg[q, 2] = (_WORD_AREA, ln, blocks,
                                                        end + BLOCK_OVERHEAD * blocks)
            continue
        pos[q] = end
        nb[q] = blocks
    return rows


def _rans_length(want: int, got: int) -> str:
    """The CPU decoder's message for a RANS stream whose length its word counts contradict."""
    return f"rans RANS stream must be {want} bytes, is {got}"


def parse_streams(host: np.ndarray, at, stored, n, blocks: bool = True) -> Streams:
    """Validate every stream ``host[at[q] : at[q] + stored[q]]`` that must decode to ``n[q]``
    symbols, exactly as the CPU decoder's checks before decoding (header, table, word counts,
    lengths). A failing stream is reported as the CPU reader would report it, decoding streams
    in order: :class:`StreamError` for the lowest failing stream, with the first check it
    fails. The per-block checks of the bitstream itself (states, word underflow, final states)
    are the kernel's. The header and table checks run stream by stream, compiled
    (:func:`_check_streams`: a few microseconds where numpy over the streams took ~0.4 ms of
    the GPU decode's host time); the block checks with numpy over all blocks at once.

    ``blocks=False``: only the checks of each stream's header and table, and no block table
    (the per-block fields are None); the GPU decoder's ``rans_blocks`` kernel reads the word
    counts, makes the block table and runs the two checks left (a block's word count, the
    stream's length against its word counts) on the device.

    A stream that failed a check is left out of the later ones, and every gather clips its
    indices into ``host``, so the values a failed stream yields are never used and never read
    out of bounds."""
    host = np.asarray(host, np.uint8).reshape(-1)
    at = np.asarray(at, np.int64).reshape(-1)
    stored = np.asarray(stored, np.int64).reshape(-1)
    n = np.asarray(n, np.int64).reshape(-1)
    if not at.size == stored.size == n.size:
        raise ValueError("at, stored and n differ in length")
    if (n < 0).any():
        raise ValueError("negative symbol count")
    # (no sum that could wrap: the compiled checks read host[at : at + stored] unchecked)
    if (at < 0).any() or (stored < 0).any() or (at > host.size).any() \
            or (stored > host.size - at).any():
        raise ValueError("stream outside the host buffer")
    buf = host if host.size else np.zeros(1, np.uint8)
    top = buf.size - 1

    def get(idx: np.ndarray) -> np.ndarray:
        return buf[np.clip(idx, 0, top)]

    s = at.size
    fail, arg = np.zeros(s, np.int64), np.zeros((s, 3), np.uint64)
    mode, lg, nb = np.zeros(s, np.int64), np.zeros(s, np.int64), np.zeros(s, np.int64)
    pos, tab_of = np.zeros(s, np.int64), np.zeros(s, np.int64)
    freqs = np.zeros((s, 256), np.int64)
    freqs = freqs[:_check_streams(buf, at, stored, n, fail, arg, mode, lg, nb, pos, tab_of,
                                  freqs)]
    ok = fail == 0
    first: list = [None]  # (stream, message) of the lowest failing stream so far
    bad_q = np.flatnonzero(~ok)
    if bad_q.size:
        q = int(bad_q[0])
        first[0] = (q, _MESSAGES[int(fail[q])].format(*(int(v) for v in arg[q])))

    def check(bad: np.ndarray, msg, rows: np.ndarray | None = None) -> None:
        rows_all = np.arange(at.size) if rows is None else rows
        bad = bad & ok[rows_all]
        if not bad.any():
            return
        i = int(np.flatnonzero(bad)[0])
        q = int(rows_all[i])
        if first[0] is None or q < first[0][0]:
            first[0] = (q, msg(i) if callable(msg) else msg)
        ok[rows_all[bad]] = False

    raw = (mode == rans.MODE_RAW) & ok
    const = (mode == rans.MODE_CONST) & ok
    coded_r = (mode == rans.MODE_RANS) & ok
    # blocks of the CONST and RANS streams (failed streams have none)
    ci = np.flatnonzero(~raw & ok)
    nbc = nb[ci]
    first_blk = np.zeros(ci.size + 1, np.int64)
    np.cumsum(nbc, out=first_blk[1:])
    section = np.where(coded_r, pos, HEADER_SIZE)  # per stream: where its block section starts
    if not blocks:
        # a RANS stream without blocks (n = 0) is its header and table exactly: no kernel
        # looks at it, so its length is checked here
        empty = coded_r & (nb == 0)
        check(empty & (stored != pos),
              lambda i: _rans_length(int(pos[i]), int(stored[i])))
        if first[0] is not None:
            raise StreamError(*first[0])
        return Streams(mode=mode, data_at=np.where(raw, HEADER_SIZE, 0), coded=ci,
                       first=first_blk, const=None, fill=None, words=None, count=None,
                       states=None, table=None, start=None, length=None, freqs=freqs,
                       lg=lg, nb=nb, pos=section, tab_of=tab_of)
    owner = np.repeat(np.arange(ci.size), nbc)
    row = ci[owner]
    j = np.arange(int(first_blk[-1]), dtype=np.int64) - first_blk[:-1][owner]
    start = j << lg[row]
    length = np.minimum(n[row] - start, np.int64(1) << lg[row])
    is_const = const[row]
    is_rans = ~is_const
    fill = np.zeros(j.size, np.uint8)
    fill[is_const] = get(at[row[is_const]] + HEADER_SIZE + j[is_const])
    count = np.zeros(j.size, np.int64)
    ca = at[row[is_rans]] + pos[row[is_rans]] + 4 * j[is_rans]
    count[is_rans] = (get(ca).astype(np.int64) | get(ca + 1).astype(np.int64) << 8
                      | get(ca + 2).astype(np.int64) << 16 | get(ca + 3).astype(np.int64) << 24)
    check(count > length, lambda i: (f"rans block {int(j[i])} stores {int(count[i])} words for "
                                     f"{int(length[i])} symbols (at most one word per symbol)"),
          row)
    plane_words = np.zeros(ci.size, np.int64)
    np.add.at(plane_words, owner, count)
    words_at = pos + rans.BLOCK_OVERHEAD * nb             # per stream (RANS rows)
    want = words_at[ci] + 2 * plane_words
    check(coded_r[ci] & (stored[ci] != want),
          lambda i: _rans_length(int(want[i]), int(stored[ci[i]])), ci)
    if first[0] is not None:
        raise StreamError(*first[0])
    csum = np.cumsum(count) - count                       # words before each block, batch-wide
    within = csum - np.append(csum, 0)[first_blk[:-1]][owner]
    return Streams(
        mode=mode, data_at=np.where(raw, HEADER_SIZE, 0), coded=ci, first=first_blk,
        const=is_const.astype(np.uint8), fill=fill,
        words=np.where(is_rans, words_at[row] + 2 * within, 0),
        count=count.astype(np.uint32),
        states=np.where(is_rans, pos[row] + 4 * nb[row] + 128 * j, 0),
        table=np.where(is_rans, tab_of[row], -1), start=start, length=length.astype(np.uint32),
        freqs=freqs, lg=lg, nb=nb, pos=section, tab_of=tab_of)
