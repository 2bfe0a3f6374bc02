"""The GPU decoder's batched rANS stream validation (host only, no GPU): on valid streams it
yields the block table a per-stream parse gives; on damaged streams it refuses exactly the
streams the per-stream checks refuse, naming the right one."""

from __future__ import annotations

import re

import numpy as np
import pytest

from s4format.codecs import rans
from s4format.codecs.rans import RansCodec
from s4format.errors import CodecError
from s4weights.gpu.ransparse import StreamError, parse_streams

RNG = np.random.default_rng(5)


def _reference(payload: np.ndarray, n: int):
    """Per-stream parse (the checks the CPU decoder makes before decoding): per block
    (const, fill, words offset, count, states offset, freqs or None, start, length)."""
    if payload.size < rans.HEADER_SIZE:
        raise CodecError("short")
    mode, lg, reserved, count = rans.HEADER.unpack_from(payload[:rans.HEADER_SIZE].tobytes())
    if reserved or not rans.LOG2_BLOCK_MIN <= lg <= rans.LOG2_BLOCK_MAX or count != n:
        raise CodecError("header")
    nb = (n + (1 << lg) - 1) >> lg
    if mode == rans.MODE_RAW:
        if payload.size != rans.HEADER_SIZE + n:
            raise CodecError("raw length")
        return "raw", []
    starts = [b << lg for b in range(nb)]
    lens = [min(n - s, 1 << lg) for s in starts]
    if mode == rans.MODE_CONST:
        if payload.size != rans.HEADER_SIZE + nb:
            raise CodecError("const length")
        return "const", [(1, int(payload[rans.HEADER_SIZE + b]), 0, 0, 0, None, starts[b],
                          lens[b]) for b in range(nb)]
    if mode != rans.MODE_RANS:
        raise CodecError("mode")
    freqs, pos = rans._parse_table(payload, rans.HEADER_SIZE)
    words_at = pos + rans.BLOCK_OVERHEAD * nb
    if payload.size < words_at:
        raise CodecError("word area")
    counts = payload[pos:pos + 4 * nb].view("<u4").astype(np.int64)
    if (counts > np.array(lens, np.int64)).any():
        raise CodecError("counts")
    offs = np.concatenate(([0], np.cumsum(counts)))
    if payload.size != words_at + 2 * int(offs[-1]):
        raise CodecError("total")
    return "rans", [(0, 0, words_at + 2 * int(offs[b]), int(counts[b]), pos + 4 * nb + 128 * b,
                     freqs, starts[b], lens[b]) for b in range(nb)]


def _streams() -> list[tuple[np.ndarray, int]]:
    planes = [RNG.integers(0, 256, 5000, dtype=np.uint8),                  # RAW mode
              np.full(70_000, 3, np.uint8),                                 # CONST
              np.zeros(0, np.uint8),
              RNG.geometric(0.3, 200_001).clip(0, 255).astype(np.uint8),    # RANS, 4 blocks
              (RNG.random(1000) < 0.02).astype(np.uint8),
              np.repeat(RNG.integers(0, 256, 3, dtype=np.uint8), 1 << 16)]  # per-block CONST
    out = []
    for lg in (16, 5, 20):
        codec = RansCodec(lg)
        for p in planes:
            out.append((np.frombuffer(codec.encode(p).payload, np.uint8), p.size))
    return out


def _pack(streams):
    at, chunks, pos = [], [], 0
    for s, _n in streams:
        gap = int(RNG.integers(0, 40))
        chunks.append(RNG.integers(0, 256, gap, dtype=np.uint8))
        pos += gap
        at.append(pos)
        chunks.append(s)
        pos += s.size
    return np.concatenate(chunks), np.array(at), np.array([s.size for s, _ in streams]), \
        np.array([n for _, n in streams])


def _as_reference(st, at_rows) -> list:
    got = []
    for q, row in enumerate(st.coded.tolist()):
        for b in range(int(st.first[q]), int(st.first[q + 1])):
            t = int(st.table[b])
            got.append((row, int(st.const[b]), int(st.fill[b]), int(st.words[b]),
                        int(st.count[b]), int(st.states[b]),
                        None if t < 0 else st.freqs[t].tolist(), int(st.start[b]),
                        int(st.length[b])))
    return got


def test_valid_streams_give_the_per_stream_block_table() -> None:
    streams = _streams()
    host, at, stored, n = _pack(streams)
    st = parse_streams(host, at, stored, n)
    want = []
    for row, (s, k) in enumerate(streams):
        kind, blocks = _reference(s, k)
        assert int(st.mode[row]) == {"raw": 0, "const": 1, "rans": 2}[kind]
        if kind == "raw":
            assert int(st.data_at[row]) == rans.HEADER_SIZE
        for c, f, w, cnt, sa, fr, s0, ln in blocks:
            want.append((row, c, f, w, cnt, sa, None if fr is None else fr.tolist(), s0, ln))
    assert _as_reference(st, at) == want
    assert st.nblocks == len(want)


@pytest.mark.parametrize("seed", range(6))
def test_damaged_streams_are_refused_exactly_where_the_per_stream_checks_refuse(seed) -> None:
    rng = np.random.default_rng(seed)
    streams = [(s.copy(), k) for s, k in _streams()]
    for _ in range(200):
        row = int(rng.integers(len(streams)))
        s, k = streams[row]
        damaged = s.copy()
        cut = rng.random() < 0.2
        if cut:
            damaged = damaged[:int(rng.integers(0, damaged.size + 1))]
        elif damaged.size:
            # mostly the header, table and word counts, where the host checks look
            i = int(rng.integers(0, min(damaged.size, 400)))
            damaged[i] ^= np.uint8(1 << int(rng.integers(8)))
        try:
            _reference(damaged, k)
            ok = True
        except CodecError:
            ok = False
        trial = list(streams)
        trial[row] = (damaged, k)
        host, at, stored, n = _pack(trial)
        if ok:
            parse_streams(host, at, stored, n)
        else:
            with pytest.raises(StreamError) as e:
                parse_streams(host, at, stored, n)
            assert e.value.plane == row


def _damaged_batches(seed: int, fewest: int, most: int, batches: int = 60):
    """Batches of the streams of :func:`_streams` with ``fewest`` to ``most`` - 1 of them
    damaged (cut short, or a bit flipped where the host's checks look)."""
    rng = np.random.default_rng(seed)
    base = [(s.copy(), k) for s, k in _streams()]
    for _ in range(batches):
        trial = list(base)
        for row in rng.choice(len(trial), size=int(rng.integers(fewest, most)), replace=False):
            s, k = trial[int(row)]
            d = s.copy()
            if rng.random() < 0.3:
                d = d[:int(rng.integers(0, d.size + 1))]
            elif d.size:
                i = int(rng.integers(0, min(d.size, 400)))
                d[i] ^= np.uint8(1 << int(rng.integers(8)))
            trial[int(row)] = (d, k)
        yield trial


@pytest.mark.parametrize("seed", range(4))
def test_with_several_damaged_streams_the_lowest_failing_one_is_named(seed) -> None:
    for trial in _damaged_batches(100 + seed, 2, 6):
        failing = []
        for row, (s, k) in enumerate(trial):
            try:
                _reference(s, k)
            except CodecError:
                failing.append(row)
        host, at, stored, n = _pack(trial)
        if not failing:
            parse_streams(host, at, stored, n)
            continue
        with pytest.raises(StreamError) as e:
            parse_streams(host, at, stored, n)
        assert e.value.plane == failing[0]


def _block_check(message: str) -> bool:
    """A failure only the block checks find (the GPU decoder's host leaves them to rans_blocks)."""
    return bool(re.match(r"rans block \d+ stores \d+ words|rans RANS stream must be", message))


@pytest.mark.parametrize("seed", range(4))
def test_header_and_table_checks_alone_name_the_same_stream(seed) -> None:
    # blocks=False (the GPU decoder's host checks: the word counts are the device's) fails
    # exactly where the full checks fail on a header or table, with the same message; where
    # the full checks fail on word counts, it fails only on a later stream, or not at all
    for trial in _damaged_batches(200 + seed, 1, 4):
        host, at, stored, n = _pack(trial)
        try:
            parse_streams(host, at, stored, n)
            full = None
        except StreamError as e:
            full = (e.plane, str(e))
        try:
            parse_streams(host, at, stored, n, blocks=False)
            alone = None
        except StreamError as e:
            alone = (e.plane, str(e))
        if full is None or not _block_check(full[1]):
            assert alone == full
        else:
            assert alone is None or alone[0] > full[0] or alone == full


def test_edge_streams() -> None:
    codec = RansCodec(16)
    cases = []
    for plane in (np.zeros(0, np.uint8), np.full(10, 4, np.uint8),
                  np.arange(256, dtype=np.uint8).repeat(3)):  # k = 256: no table padding
        cases.append((np.frombuffer(codec.encode(plane).payload, np.uint8), plane.size))
    host, at, stored, n = _pack(cases)
    parse_streams(host, at, stored, n)
    # the same streams, one byte longer or shorter, or for another symbol count
    for row, (s, k) in enumerate(cases):
        for bad, nn in ((np.append(s, np.uint8(0)), k), (s[:-1], k), (s, k + 1)):
            trial = list(cases)
            trial[row] = (bad, nn)
            h, a, st, nv = _pack(trial)
            with pytest.raises(StreamError) as e:
                parse_streams(h, a, st, nv)
            assert e.value.plane == row
    # a stream that ends the host buffer exactly, cut inside its table
    s, k = cases[2]
    cut = s[:rans.HEADER_SIZE + 40].copy()
    with pytest.raises(StreamError):
        parse_streams(cut, [0], [cut.size], [k])


def _const_file(n: int, log2_block: int) -> bytes:
    """A raw-layout uint8 tensor of ``n`` zero bytes stored as one CONST stream of blocks of
    2^log2_block: one stored byte per block (valid, but no writer of ours makes it)."""
    import io

    import s4format
    from s4format import codecs, dtypes, hashing, layouts
    from s4format.writer import CodedPlane, CodedTensor

    plane = np.zeros(n, np.uint8)
    stream = rans._const_stream(plane, log2_block)
    buf = io.BytesIO()
    with s4format.Writer(buf) as w:
        ref = w.add_coded("z", dtypes.BY_NAME["uint8"], (n,), CodedTensor(
            layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, codecs.RANS, n, stream),)),
            hashing.content_hash(plane))
        w.set_tree({"z": ref})
    return buf.getvalue()


def test_streams_declaring_huge_block_tables_go_to_the_cpu_decoder() -> None:
    # 2^19 blocks from 512 KiB of stored bytes: ~80 MiB of block tables on the GPU path
    import s4format
    from s4weights.gpu import decode, ransparse, staging

    blob = _const_file(1 << 24, 5)
    r = s4format.Reader(blob)
    t = r.tensors[0]
    host = np.frombuffer(blob, np.uint8)
    p = t.planes[0]
    assert ransparse.stream_blocks(host, [p.offset], [p.stored_len], [p.decoded_len]).tolist() \
        == [1 << 19]
    st = staging.Staged(r, [0, 0], [(0, 0, p), (1, 0, p)], np.array([p.offset, p.offset]),
                       host, None)
    assert decode._tables_too_large(st) == {0, 1}
    # the writer's own CONST streams (blocks of 2^16 or 2^20) fit
    r2 = s4format.Reader(_const_file(1 << 24, 16))
    p2 = r2.tensors[0].planes[0]
    h2 = np.frombuffer(r2.source.read_at(0, r2.source.size()), np.uint8)
    st2 = staging.Staged(r2, [0], [(0, 0, p2)], np.array([p2.offset]), h2, None)
    assert decode._tables_too_large(st2) == set()
    # and the CPU decoder reads it
    assert not r.read_raw(0).any()


def test_stream_blocks_of_bad_headers_are_zero() -> None:
    from s4weights.gpu import ransparse

    host = np.zeros(40, np.uint8)
    host[0], host[1] = rans.MODE_CONST, 99        # log2_block out of range: clipped
    host[20], host[21] = rans.MODE_RAW, 16
    got = ransparse.stream_blocks(host, [0, 20, 39], [20, 20, 1], [1 << 20, 100, 5])
    assert got.tolist() == [1, 0, 0]


def test_streams_outside_the_buffer_are_refused_before_any_read() -> None:
    # (the compiled checks read host[at : at + stored] unchecked: offsets whose sum would wrap
    # around, negative lengths and tables of different lengths never reach them)
    host = np.zeros(100, np.uint8)
    for at, stored in (([1 << 62], [1 << 62]), ([-1], [20]), ([0], [-5]), ([90], [11])):
        for blocks in (True, False):
            with pytest.raises(ValueError, match="outside the host buffer"):
                parse_streams(host, at, stored, [5], blocks=blocks)
    with pytest.raises(ValueError, match="differ in length"):
        parse_streams(host, [0], [12], [5, 6])


@pytest.mark.parametrize("seed", range(3))
def test_a_refused_stream_gets_the_cpu_decoders_message(seed) -> None:
    # every check parse_streams makes words its failure as the CPU decoder does, values
    # included: header fields, lengths, the table, the word area and counts; damage in every
    # header byte and beyond. A stream it accepts fails on the CPU only inside a block's
    # bitstream (the device's checks)
    rng = np.random.default_rng(300 + seed)
    streams = _streams()
    checked = set()
    for _ in range(600):
        s, k = streams[int(rng.integers(len(streams)))]
        d = s.copy()
        what = rng.random()
        if what < 0.2:
            d = d[:int(rng.integers(0, d.size + 1))]
        elif what < 0.3:
            d = np.concatenate((d, rng.integers(0, 256, int(rng.integers(1, 9)), np.uint8)))
        elif d.size:
            i = int(rng.integers(0, min(d.size, 12 if what < 0.6 else 400)))
            d[i] ^= np.uint8(1 << int(rng.integers(8)))
        try:
            parse_streams(d, [0], [d.size], [k])
        except StreamError as e:
            ours = str(e)
        else:  # accepted: the CPU decoder refuses it only for a corrupt block's bitstream
            try:
                RansCodec().decode(d, k, b"")
            except CodecError as e:
                assert re.match(r"rans block \d+ of \d+ is corrupt: ", str(e)), str(e)
            continue
        with pytest.raises(CodecError) as cpu:
            RansCodec().decode(d, k, b"")
        assert ours == str(cpu.value)
        checked.add(re.sub(r"\d+", "N", ours))
    assert len(checked) >= 8, checked
