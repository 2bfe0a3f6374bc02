"""Stored rANS streams checked on the host before the GPU decodes them (``spec/rans.md``): every
header and frequency table, with the CPU decoder's checks and messages, and the block table
the decode kernels read. A failure names the lowest failing stream, as the CPU reader meets
them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from s4format.codecs import rans

# (module constants, for the compiled checks)
HEADER_SIZE = rans.HEADER_SIZE
LOG2_MIN, LOG2_MAX = rans.LOG2_BLOCK_MIN, rans.LOG2_BLOCK_MAX
MODE_RAW, MODE_CONST, MODE_RANS = rans.MODE_RAW, rans.MODE_CONST, rans.MODE_RANS
BITMAP, BLOCK_OVERHEAD, PROB_SCALE = rans.BITMAP_SIZE, rans.BLOCK_OVERHEAD, rans.PROB_SCALE


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


class HostDecodes(Exception):
    """A valid tensor the GPU decoder leaves to the CPU decoder (no writer of ours makes
    them)."""


class TablesTooLarge(HostDecodes):
    """Streams that declare more blocks than the GPU decoder builds tables for."""


def tables_fit(nblocks: int, stored: int) -> bool:
    """Whether the GPU decoder builds tables for ``nblocks`` blocks of streams that store
    ``stored`` bytes: a RANS-mode block stores 132 bytes or more, so those always fit."""
    return nblocks * TABLE_BYTES <= max(TABLE_CAP, 2 * stored)


def raw_mode(host: np.ndarray, at, stored) -> np.ndarray:
    """Which streams ``host[at[q]:at[q] + stored[q]]`` declare RAW mode (their bytes follow the
    header: used in place or copied, not decoded), read before any check of theirs."""
    at, stored = np.asarray(at, np.int64), np.asarray(stored, np.int64)
    raw = stored >= HEADER_SIZE
    raw[raw] = host[at[raw]] == MODE_RAW
    return raw


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
def _check_table(host, a, ln, blocks, f, arg):
    """The frequency table of the RANS stream at ``host[a:a + ln]`` into ``f``, and the room of
    its ``blocks``' sections: (its first failing check or 0, where its block section starts),
    the values the message names in ``arg``."""
    if ln < HEADER_SIZE + BITMAP:
        return _IN_BITMAP, 0
    k = 0
    for sym in range(256):
        k += (np.int64(host[a + HEADER_SIZE + (sym >> 3)]) >> (sym & 7)) & 1
    if k == 0:
        return _NO_SYMBOL, 0
    size = BITMAP + 2 * k
    end = HEADER_SIZE + size + (-size) % 4
    if ln < end:
        arg[0] = k
        return _IN_TABLE, 0
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
        return _ZERO_FREQ, 0
    if total != PROB_SCALE:
        arg[0] = total
        return _SUM, 0
    pad_at = a + HEADER_SIZE + size
    if end > HEADER_SIZE + size and (host[pad_at] | host[pad_at + 1]) != 0:
        return _PADDING, 0
    if ln < end + BLOCK_OVERHEAD * blocks:
        arg[0], arg[1], arg[2] = ln, blocks, end + BLOCK_OVERHEAD * blocks
        return _WORD_AREA, 0
    return _OK, end


@njit(cache=True)
def _check_streams(host, at, stored, n, fail, arg, mode, lg, nb, pos, tab_of, freqs):
    """Per stream q (``host[at[q]:at[q] + stored[q]]``, decoding to ``n[q]`` symbols; every
    stream inside ``host``): ``fail[q]``, its first failing check (``arg[q]``: the values its
    message names, u64), and its mode, log2 block size, blocks (0 once failed), where its block
    section starts (the word counts of a RANS stream: after its table) and the row of
    ``freqs`` its table fills (-1: none). A RANS stream whose header holds gets a row, even if
    its table then fails. Returns the rows used."""
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
        code, end = _check_table(host, a, ln, blocks, freqs[tab_of[q]], arg[q])
        if code != _OK:
            fail[q] = code
            continue
        pos[q] = end
        nb[q] = blocks
    return rows


def _rans_length(want: int, got: int) -> str:
    """The CPU decoder's message for a RANS stream whose length its word counts contradict."""
    return f"rans RANS stream must be {want} bytes, is {got}"


class _Failures:
    """The lowest failing stream of a batch so far, and which streams are still fine: a stream
    that failed one check is left out of the later ones."""

    def __init__(self, fail: np.ndarray, arg: np.ndarray) -> None:
        self.ok = fail == 0
        self.first: tuple[int, str] | None = None
        bad = np.flatnonzero(~self.ok)
        if bad.size:
            q = int(bad[0])
            self.first = (q, _MESSAGES[int(fail[q])].format(*(int(v) for v in arg[q])))

    def check(self, bad: np.ndarray, msg, rows: np.ndarray | None = None) -> None:
        """Streams ``rows`` (all, in order, by default) fail where ``bad``; ``msg(i)`` (or a
        string) words the first one's failure."""
        rows_all = np.arange(self.ok.size) if rows is None else rows
        bad = bad & self.ok[rows_all]
        if not bad.any():
            return
        i = int(np.flatnonzero(bad)[0])
        q = int(rows_all[i])
        if self.first is None or q < self.first[0]:
            self.first = (q, msg(i) if callable(msg) else msg)
        self.ok[rows_all[bad]] = False

    def raise_first(self) -> None:
        if self.first is not None:
            raise StreamError(*self.first)


def _inputs(host: np.ndarray, at, stored, n) -> tuple[np.ndarray, ...]:
    """The arguments of :func:`parse_streams` as arrays, every stream inside ``host`` (no sum
    that could wrap: the compiled checks read ``host[at : at + stored]`` unchecked)."""
    host = np.asarray(host, np.uint8).reshape(-1)
    at = np.asarray(at, np.int64).reshape(-1)
    stored = np.asarray(stored, np.int64).reshape(-1)
    n = np.asarray(n, np.int64).reshape(-1)
    if not at.size == stored.size == n.size:
        raise ValueError("at, stored and n differ in length")
    if (n < 0).any():
        raise ValueError("negative symbol count")
    if (at < 0).any() or (stored < 0).any() or (at > host.size).any() \
            or (stored > host.size - at).any():
        raise ValueError("stream outside the host buffer")
    return host, at, stored, n


def parse_streams(host: np.ndarray, at, stored, n, blocks: bool = True) -> Streams:
    """Validate every stream ``host[at[q] : at[q] + stored[q]]`` that must decode to ``n[q]``
    symbols with the CPU decoder's checks before decoding (header, table, word counts,
    lengths), and raise :class:`StreamError` for the lowest failing stream with the first check
    it fails. The bitstream's own checks (states, word underflow, final states) are the
    kernel's. ``blocks=False``: the header and table checks only, no block table; the
    ``rans_blocks`` kernel reads the word counts and makes the table on the device."""
    host, at, stored, n = _inputs(host, at, stored, n)
    buf = host if host.size else np.zeros(1, np.uint8)
    s = at.size
    fail, arg = np.zeros(s, np.int64), np.zeros((s, 3), np.uint64)
    mode, lg, nb = np.zeros(s, np.int64), np.zeros(s, np.int64), np.zeros(s, np.int64)
    pos, tab_of = np.zeros(s, np.int64), np.zeros(s, np.int64)
    freqs = np.zeros((s, 256), np.int64)
    freqs = freqs[:_check_streams(buf, at, stored, n, fail, arg, mode, lg, nb, pos, tab_of,
                                  freqs)]
    failures = _Failures(fail, arg)
    ok = failures.ok
    raw = (mode == rans.MODE_RAW) & ok
    coded_r = (mode == rans.MODE_RANS) & ok
    ci = np.flatnonzero(~raw & ok)  # the CONST and RANS streams (failed streams have none)
    first_blk = np.zeros(ci.size + 1, np.int64)
    np.cumsum(nb[ci], out=first_blk[1:])
    section = np.where(coded_r, pos, HEADER_SIZE)  # per stream: where its block section starts
    data_at = np.where(raw, HEADER_SIZE, 0)
    if not blocks:
        # a RANS stream without blocks (n = 0) is its header and table exactly: no kernel
        # looks at it, so its length is checked here
        empty = coded_r & (nb == 0)
        failures.check(empty & (stored != pos),
                       lambda i: _rans_length(int(pos[i]), int(stored[i])))
        failures.raise_first()
        return Streams(mode=mode, data_at=data_at, coded=ci, first=first_blk, const=None,
                       fill=None, words=None, count=None, states=None, table=None, start=None,
                       length=None, freqs=freqs, lg=lg, nb=nb, pos=section, tab_of=tab_of)
    table = _block_table(buf, at, stored, n, mode, lg, nb, pos, tab_of, ci, first_blk, failures)
    return Streams(mode=mode, data_at=data_at, coded=ci, first=first_blk, **table, freqs=freqs,
                   lg=lg, nb=nb, pos=section, tab_of=tab_of)


def _block_table(buf: np.ndarray, at, stored, n, mode, lg, nb, pos, tab_of, ci, first_blk,
                 failures: _Failures) -> dict:
    """The per-block fields of :class:`Streams` for the CONST and RANS streams ``ci`` (their
    blocks ``first_blk``), after the checks of every block's word count and of every RANS
    stream's length against its counts. Every gather clips its indices into ``buf``: a failed
    stream's values are never used and never read out of bounds."""
    top = buf.size - 1

    def get(idx: np.ndarray) -> np.ndarray:
        return buf[np.clip(idx, 0, top)]

    const = mode == rans.MODE_CONST
    coded_r = mode == rans.MODE_RANS
    owner = np.repeat(np.arange(ci.size), nb[ci])
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
    failures.check(count > length, lambda i: (
        f"rans block {int(j[i])} stores {int(count[i])} words for {int(length[i])} symbols "
        "(at most one word per symbol)"), row)
    plane_words = np.zeros(ci.size, np.int64)
    np.add.at(plane_words, owner, count)
    words_at = pos + rans.BLOCK_OVERHEAD * nb             # per stream (RANS rows)
    want = words_at[ci] + 2 * plane_words
    failures.check(coded_r[ci] & (stored[ci] != want),
                   lambda i: _rans_length(int(want[i]), int(stored[ci[i]])), ci)
    failures.raise_first()
    csum = np.cumsum(count) - count                       # words before each block, batch-wide
    within = csum - np.append(csum, 0)[first_blk[:-1]][owner]
    return dict(const=is_const.astype(np.uint8), fill=fill,
                words=np.where(is_rans, words_at[row] + 2 * within, 0),
                count=count.astype(np.uint32),
                states=np.where(is_rans, pos[row] + 4 * nb[row] + 128 * j, 0),
                table=np.where(is_rans, tab_of[row], -1), start=start,
                length=length.astype(np.uint32))
