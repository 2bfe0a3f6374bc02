"""The rANS coder's two row coders (AVX-512 or AVX2 vectors, scalar) against each other.

Which one a process runs depends on its CPU, so the scalar rows are run in a child process
compiled for a generic CPU: the same planes and fields encode to the same bytes, and the same
streams, intact and damaged, decode to the same bytes and errors.
"""

from __future__ import annotations

import hashlib
import sys
import textwrap

import numpy as np
import pytest

from s4format.codecs import rans
from tests.generic_cpu import avx2_vectors_expected, on_generic_cpu, vbmi2_vectors_expected

CASES = textwrap.dedent('''
    import numpy as np
    from s4format.codecs import rans

    def planes():
        rng = np.random.default_rng(20261203)
        for n in (1, 31, 33, 4095, 65536, 65537, 3 * 65536 + 17):
            yield (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 23
                   ).astype(np.uint8)
            p = rng.integers(1, 256, n, dtype=np.uint8)
            p[rng.random(n) < 0.8] = 0
            yield p
            # a dominant symbol (at least DOMINANT of the 4096 slots: the AVX2 rows then
            # skip the gather of a vector whose slots all fall in its range), first and
            # among others
            for top in (0, 200):
                p = np.full(n, top, np.uint8)
                rare = rng.random(n) < 0.015
                p[rare] = rng.choice(np.array([3, 199, 201, 250], np.uint8), int(rare.sum()))
                yield p
            yield rng.integers(0, 256, n, dtype=np.uint8)
            yield np.minimum(rng.geometric(0.3, n), 255).astype(np.uint8)
        # Two symbols of frequency 2048, lanes 0-15 all the first: their states double from
        # 2^15 to exactly x_max = 2^30, the edge of renormalisation.
        yield np.tile(np.repeat(np.arange(2, dtype=np.uint8), 16), 2048)

    def streams():
        rng = np.random.default_rng(7)
        for lg in (5, 8, 16):
            codec = rans.RansCodec(lg)
            for plane in planes():
                payload = np.asarray(codec.encode(plane).payload)
                yield lg, plane, payload, False
                if payload[0] != rans.MODE_RANS:
                    continue
                for _ in range(3):
                    bad = payload.copy()
                    for _ in range(int(rng.integers(1, 4))):
                        i = int(rng.integers(rans.HEADER_SIZE + 40, bad.size))
                        bad[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
                    yield lg, plane, bad, True
                nb = rans._n_blocks(plane.size, lg)
                if nb >= 2:
                    # every word of the last block given to the one before it: the last
                    # block's top row runs out of words (a group then leaves its blocks to
                    # be decoded one by one), the one before has words left over
                    bad = payload.copy()
                    _freqs, pos = rans._parse_table(bad, rans.HEADER_SIZE)
                    at = pos + 4 * (nb - 2)
                    counts = bad[at:at + 8].view("<u4").copy()
                    bad[at:at + 8] = np.array([counts.sum(), 0], "<u4").view(np.uint8)
                    yield lg, plane, bad, True
        yield from edges()

    def edges():
        """Streams coded with a table whose top frequency is DOMINANT, and one less."""
        rng = np.random.default_rng(13)
        n = 3 * 65536 + 17
        for top in (rans.DOMINANT, rans.DOMINANT - 1):
            freqs = np.zeros(256, np.int64)
            freqs[[5, 99, 101, 180]] = (rans.PROB_SCALE - top) // 4
            freqs[5] += (rans.PROB_SCALE - top) % 4
            freqs[100] = top
            plane = rng.choice(256, n, p=freqs / rans.PROB_SCALE).astype(np.uint8)
            for lg in (8, 16):
                yield lg, plane, rans._rans_stream(plane, lg, freqs), False

    def fields():
        """Fields of 16- and 32-bit words as the CPU path codes them, in place."""
        from s4format.codecs.view import PlaneView

        rng = np.random.default_rng(11)
        for n in (33, 4096 + 7, 65537):
            f32 = rng.standard_normal(n).astype(np.float32) * np.float32(0.02)
            bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
            for words, shift, mask in ((bf16, 7, 0xFF), (bf16, 0, 0x7F), (bf16[::3], 7, 0xFF),
                                       (f32.view(np.uint32), 23, 0xFF),
                                       (f32.view(np.uint32), 13, 0xF)):
                field = (words.astype(np.int64) >> shift) & mask
                counts = np.bincount(field, minlength=256)
                view = PlaneView(words, shift, mask, int(np.bitwise_or.reduce(field)), counts, 0)
                for lg in (5, 16):
                    yield rans._rans_stream(view, lg, rans.normalise(counts))
''')


def _digest() -> str:
    """A digest of every encoded plane and field, and of every stream's outcome: blocks' error
    codes and bytes, decoded whole and from blocks 1 to 3 (which group the blocks in fours and
    pairs differently), or the parse error."""
    from s4format.errors import CodecError as Err

    ns: dict = {}
    exec(CASES, ns)
    h = hashlib.sha256()
    for stream in ns["fields"]():
        h.update(stream.tobytes())
    for lg, plane, payload, _damaged in ns["streams"]():
        h.update(payload.tobytes())
        try:
            blocks = rans._Blocks(payload, plane.size, lg)
        except Err as exc:
            h.update(str(exc).encode())
            continue
        nb = rans._n_blocks(plane.size, lg)
        for lo in sorted({0, *(k for k in (1, 2, 3) if nb > k + 1)}):
            out = np.zeros(plane.size - (lo << lg), np.uint8)
            h.update(blocks.decode(lo, nb, out).tobytes())
            h.update(out.tobytes())
    return h.hexdigest()


def test_round_trips_on_this_cpu():
    ns: dict = {}
    exec(CASES, ns)
    intact = 0
    for lg, plane, payload, damaged in ns["streams"]():
        if not damaged:
            assert np.array_equal(rans.RansCodec(lg).decode(payload, plane.size, b""), plane)
            intact += 1
    assert intact == 133


def test_vector_rows_where_the_cpu_has_them():
    # (a numba that renamed what the gate reads would fall back to the scalar rows silently)
    assert rans.vector_decoding() == (vbmi2_vectors_expected() or avx2_vectors_expected())


def test_strided_arrays_take_the_scalar_rows():
    plane = np.random.default_rng(3).integers(0, 40, 5 * 65536 + 99, dtype=np.uint8)
    payload = np.asarray(rans.RansCodec(16).encode(plane).payload)
    blocks = rans._Blocks(payload, plane.size, 16)
    nb = rans._n_blocks(plane.size, 16)
    backwards = np.zeros(plane.size, np.uint8)
    errors = np.zeros(nb, np.int64)
    rans._decode_blocks(blocks.words, blocks.offsets, blocks.states, blocks.dtab, 16,
                        plane.size, backwards[::-1], errors, 0, nb)
    assert not errors.any() and np.array_equal(backwards[::-1], plane)
    words = np.zeros(2 * plane.size, np.uint16)[::2]
    words[:] = plane
    assert np.array_equal(rans._rans_stream(words, 16, rans.normalise(np.bincount(
        plane, minlength=256))), payload)


@pytest.mark.skipif(sys.platform != "linux", reason="NUMBA_CPU_NAME is exercised on Linux")
def test_vector_and_scalar_rows_agree(tmp_path):
    # a generic CPU has no AVX2 nor AVX-512: the scalar rows ran there, and gave the same bytes
    there = on_generic_cpu(tmp_path, __name__, "[rans.vector_decoding(), _digest()]")
    assert there == [False, _digest()]



@pytest.mark.parametrize("f", [rans.DOMINANT - 1, rans.DOMINANT, rans.PROB_SCALE - 1,
                               rans.PROB_SCALE])
@pytest.mark.parametrize("symbol", [0, 100, 255])
def test_the_dominant_symbol_is_found_from_its_bar(f, symbol) -> None:
    # (its entry with a bias of 0, its first slot and its frequency, as the AVX2 rows unpack
    # them; below the bar, none)
    freqs = np.zeros(256, np.int64)
    freqs[symbol] = f
    rest = rans.PROB_SCALE - f
    below = rest if symbol == 255 else rest // 2 if symbol else 0
    freqs[symbol // 2] += below
    freqs[(symbol + 256) // 2] += rest - below
    dom = int(rans._dominant(rans._decoder_table(freqs)))
    if f < rans.DOMINANT:
        assert dom == 0
        return
    assert dom & 0xFFFFFFFF == ((f - 1) << 20) | symbol
    assert (dom >> 32) & 0xFFF == freqs[:symbol].sum() and dom >> 44 == f
