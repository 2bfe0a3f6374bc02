"""S4 rANS (codec 4): round trips, a from-the-spec reference, corruption, frozen vectors."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s4format import threads
from s4format.codecs import RANS, get, rans
from s4format.codecs.rans import (
    HEADER_SIZE,
    LOG2_BLOCK_MAX,
    MODE_CONST,
    MODE_RANS,
    MODE_RAW,
    PROB_SCALE,
    RansCodec,
    _decoder_table,
    _encoder_table,
    _rans_stream,
    normalise,
)
from s4format.errors import CodecError
from tests.codecs.common import as_array, check_corruption_raises, check_encode_decode

GOLDEN = Path(__file__).parent / "golden"
SMALL = RansCodec(log2_block=7)          # 128-symbol blocks: many blocks from small planes
DEFAULT = RansCodec()
B = 1 << SMALL.log2_block


# ---------------------------------------------------------------------------------------------
# A second, deliberately naive implementation written from spec/rans.md alone (Python ints,
# true division). The numba codec must agree with it byte for byte.


def ref_normalise(counts: list[int]) -> list[int]:
    total = sum(counts)
    present = [s for s in range(256) if counts[s]]
    spare = 4096 - len(present)
    freqs = [1 + counts[s] * spare // total if counts[s] else 0 for s in range(256)]
    rem = {s: counts[s] * spare % total for s in present}
    for s in sorted(present, key=lambda s: (-rem[s], s))[:4096 - sum(freqs)]:
        freqs[s] += 1
    return freqs


def ref_encode(plane: bytes, log2_block: int, raw_fallback: bool = True) -> bytes:
    n, size = len(plane), 1 << log2_block
    head = lambda mode, lb: struct.pack("<BBHQ", mode, lb, 0, n)  # noqa: E731
    if n == 0:
        return head(MODE_RAW, log2_block)
    if len(set(plane)) == 1:
        return head(MODE_CONST, 20) + plane[:1]
    blocks = [plane[i:i + size] for i in range(0, n, size)]
    if all(len(set(b)) == 1 for b in blocks):
        return head(MODE_CONST, log2_block) + bytes(b[0] for b in blocks)
    freqs = ref_normalise([plane.count(s) for s in range(256)])
    cum = [sum(freqs[:s]) for s in range(256)]
    bitmap = bytearray(32)
    for s in range(256):
        if freqs[s]:
            bitmap[s // 8] |= 1 << (s % 8)
    table = bytes(bitmap) + b"".join(struct.pack("<H", f) for f in freqs if f)
    table += bytes(-len(table) % 4)
    counts, states, words = b"", b"", b""
    for block in blocks:
        x, out = [1 << 15] * 32, []
        for i, s in enumerate(block):
            lane, f = i % 32, freqs[s]
            if x[lane] >= f << 19:
                out.append(x[lane] & 0xFFFF)
                x[lane] >>= 16
            x[lane] = (x[lane] // f) * 4096 + x[lane] % f + cum[s]
        counts += struct.pack("<I", len(out))
        states += struct.pack("<32I", *x)
        words += struct.pack(f"<{len(out)}H", *out)
    stream = head(MODE_RANS, log2_block) + table + counts + states + words
    if raw_fallback and len(stream) >= 12 + n:
        return head(MODE_RAW, log2_block) + plane
    return stream


def ref_decode_rans(stream: bytes) -> bytes:
    """Decode a valid RANS-mode stream (no validation: the reference for good streams only)."""
    _, log2_block, _, n = struct.unpack_from("<BBHQ", stream)
    present = [s for s in range(256) if stream[12 + s // 8] >> (s % 8) & 1]
    freqs = dict(zip(present, struct.unpack_from(f"<{len(present)}H", stream, 44), strict=True))
    slots = [s for s in present for _ in range(freqs[s])]
    cum = {s: slots.index(s) for s in present}
    pos = 44 + 2 * len(present)
    pos += -pos % 4
    nb = -(-n // (1 << log2_block))
    counts = struct.unpack_from(f"<{nb}I", stream, pos)
    word_at = pos + 132 * nb
    out = bytearray(n)
    for b in range(nb):
        x = list(struct.unpack_from("<32I", stream, pos + 4 * nb + 128 * b))
        start = b << log2_block
        length = min(1 << log2_block, n - start)
        word_at += 2 * counts[b]
        p = word_at
        for i in range(length - 1, -1, -1):
            lane = i % 32
            s = slots[x[lane] & 4095]
            out[start + i] = s
            x[lane] = freqs[s] * (x[lane] >> 12) + (x[lane] & 4095) - cum[s]
            if x[lane] < 1 << 15:
                p -= 2
                x[lane] = (x[lane] << 16) | struct.unpack_from("<H", stream, p)[0]
        assert x == [1 << 15] * 32 and p == word_at - 2 * counts[b]
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Planes


def skewed(n: int, seed: int = 0) -> np.ndarray:
    """bf16 exponent bytes of N(0, 0.02) values: the plane rANS is built for."""
    values = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    return (((values.view(np.uint32) >> 16) >> 7) & 0xFF).astype(np.uint8)


EDGE_LENGTHS = [0, 1, 2, 31, 32, 33, 63, 64, 65, B - 1, B, B + 1, 3 * B - 1, 3 * B, 3 * B + 1]


def planes_of(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    two = (rng.random(n) < 0.1).astype(np.uint8) * 0xAA
    return {
        "one_symbol": np.full(n, 0x7E, dtype=np.uint8),
        "two_symbols": two,
        "uniform256": rng.integers(0, 256, n, dtype=np.uint8),
        "skewed": skewed(n, seed=n),
    }


def mode_of(payload) -> int:
    return int(as_array(payload)[0])


def test_registered() -> None:
    assert isinstance(get(RANS), RansCodec)


@pytest.mark.parametrize("n", EDGE_LENGTHS)
@pytest.mark.parametrize("kind", ["one_symbol", "two_symbols", "uniform256", "skewed"])
def test_edge_lengths_round_trip_and_match_reference(n: int, kind: str) -> None:
    plane = planes_of(n)[kind]
    payload = check_encode_decode(SMALL, plane)
    assert payload.tobytes() == ref_encode(plane.tobytes(), SMALL.log2_block)


@pytest.mark.parametrize("n", [1, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 3 << 16, (3 << 16) + 1])
def test_default_block_size_round_trips(n: int) -> None:
    payload = check_encode_decode(DEFAULT, skewed(n))
    assert mode_of(payload) == (MODE_CONST if n == 1 else MODE_RANS)


@pytest.mark.parametrize("n,log2_block", [
    ((1 << 15) - 1, 16), (1 << 15, 14), ((1 << 16) - 1, 14), (1 << 16, 15), (100_000, 15),
    ((1 << 17) - 1, 15), (1 << 17, 16), (3 << 16, 16)])
def test_planes_of_two_to_four_default_blocks_are_cut_finer(n: int, log2_block: int) -> None:
    # spec/rans.md, section 7: 2^15 <= n < 2^17 at the default size takes blocks of
    # 2^(bit_length(n) - 2), at least two whole ones, which the decoder interleaves
    payload = check_encode_decode(DEFAULT, skewed(n))
    assert mode_of(payload) == MODE_RANS
    assert payload[1] == log2_block == rans.plane_log2_block(n) == DEFAULT.block_log2(n)
    whole = as_array(RansCodec(split=False).encode(skewed(n)).payload)
    assert whole[1] == 16
    # (at most three blocks more, 132 bytes each, less what their final states carry)
    assert payload.size <= whole.size + 3 * rans.BLOCK_OVERHEAD
    assert RansCodec(12).block_log2(n) == 12  # a configured size is kept as it is


def test_modes_chosen_as_the_spec_says() -> None:
    assert mode_of(DEFAULT.encode(np.zeros(0, np.uint8)).payload) == MODE_RAW
    const = as_array(DEFAULT.encode(np.full(5000, 9, np.uint8)).payload)
    assert const.tobytes() == struct.pack("<BBHQ", MODE_CONST, LOG2_BLOCK_MAX, 0, 5000) + b"\x09"
    uniform = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    assert mode_of(DEFAULT.encode(uniform).payload) == MODE_RAW
    per_block = np.repeat(np.array([1, 2, 1], np.uint8), [B, B, 5])
    stream = as_array(SMALL.encode(per_block).payload)
    assert stream.tobytes() == struct.pack("<BBHQ", MODE_CONST, 7, 0, per_block.size) + b"\1\2\1"


def test_extremely_skewed_plane() -> None:
    plane = np.zeros(1 << 21, dtype=np.uint8)
    plane[[12345, 1 << 20]] = 200            # ~1e-6 of the symbols
    payload = check_encode_decode(DEFAULT, plane)
    assert mode_of(payload) == MODE_RANS
    assert payload.size < plane.size // 100


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=3000), log2_block=st.integers(5, 9))
def test_random_bytes_match_reference(data: bytes, log2_block: int) -> None:
    codec = RansCodec(log2_block)
    payload = check_encode_decode(codec, np.frombuffer(data, np.uint8))
    assert payload.tobytes() == ref_encode(data, log2_block)


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0, 1), min_size=1, max_size=256), seed=st.integers(0, 2**32),
       n=st.integers(1, 20_000), log2_block=st.integers(5, 12))
def test_random_distributions_round_trip(weights: list[float], seed: int, n: int,
                                         log2_block: int) -> None:
    p = np.array(weights) + 1e-12
    rng = np.random.default_rng(seed)
    symbols = rng.permutation(256)[:p.size].astype(np.uint8)
    plane = symbols[rng.choice(p.size, size=n, p=p / p.sum())]
    payload = check_encode_decode(RansCodec(log2_block), plane)
    if mode_of(payload) == MODE_RANS and n <= 4000:
        assert ref_decode_rans(payload.tobytes()) == plane.tobytes()


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 2**40), min_size=256, max_size=256).filter(any))
def test_normalise_matches_reference(counts: list[int]) -> None:
    freqs = normalise(np.array(counts))
    assert freqs.tolist() == ref_normalise(counts)
    assert int(freqs.sum()) == 4096
    assert all((f > 0) == (c > 0) for f, c in zip(freqs, counts, strict=True))


def test_normalise_ties_go_to_the_lower_symbol() -> None:
    counts = np.zeros(256, np.int64)
    counts[[5, 9, 200]] = 1                  # 4093 spare split 1364 each, 1 left: symbol 5 wins
    assert normalise(counts)[[5, 9, 200]].tolist() == [1366, 1365, 1365]


def test_reciprocal_encoder_is_exact_division() -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.integers(1 << 15, 1 << 31, 4000), [1 << 15, (1 << 31) - 1]])
    for f in range(1, 4097):
        freqs = np.zeros(256, np.int64)
        freqs[0], freqs[1] = f, 4096 - f
        xmax, rcp, shift, bias, cmpl = _encoder_table(freqs)[0]
        xs = x[x < xmax] if f < 4096 else x
        q = ((xs * rcp) >> 32) >> shift
        assert np.array_equal(xs + bias + q * cmpl, (xs // f) * 4096 + xs % f), f


def test_deterministic_across_thread_counts(monkeypatch) -> None:
    plane = skewed(40 << 16, seed=7)  # several pieces of blocks
    coded = []
    for n in (1, 4):
        monkeypatch.setattr(threads, "_pool", threads.Pool(n))
        coded.append(as_array(DEFAULT.encode(plane).payload).tobytes())
        assert DEFAULT.decode(as_array(coded[-1]), plane.size, b"").tobytes() == plane.tobytes()
    assert coded[0] == coded[1]


def test_max_decoded_len_is_a_real_bound() -> None:
    assert DEFAULT.max_decoded_len(0) == 0 and DEFAULT.max_decoded_len(HEADER_SIZE) == 0
    for plane in (np.full((1 << 20) + 1, 3, np.uint8), skewed(1 << 18), np.zeros(1, np.uint8)):
        stored = DEFAULT.encode(plane).nbytes
        assert DEFAULT.max_decoded_len(stored) >= plane.size
    assert DEFAULT.max_decoded_len(14) == 2 << 20     # two CONST blocks of 2^20


def test_never_stores_more_than_raw_plus_header() -> None:
    for plane in planes_of(3 * B + 1).values():
        assert SMALL.encode(plane).nbytes <= plane.size + HEADER_SIZE


def test_estimate_is_close() -> None:
    for plane in (skewed(1 << 20), planes_of(1 << 18)["two_symbols"]):
        real = DEFAULT.encode(plane).nbytes
        assert abs(DEFAULT.estimate(plane) / real - 1) < 0.01
    assert DEFAULT.estimate(np.zeros(0, np.uint8)) == HEADER_SIZE
    assert DEFAULT.estimate(np.full(100, 1, np.uint8)) == HEADER_SIZE + 1
    uniform = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    assert DEFAULT.estimate(uniform) == uniform.size + HEADER_SIZE


# ---------------------------------------------------------------------------------------------
# Bad streams


def small_rans_stream() -> tuple[np.ndarray, bytes]:
    plane = skewed(1100, seed=11)            # three blocks of 512, the last one partial
    payload = as_array(RansCodec(9).encode(plane).payload).tobytes()
    assert payload[0] == MODE_RANS
    return plane, payload


def decode_or_check(payload: bytes, n: int) -> None:
    try:
        out = SMALL.decode(np.frombuffer(payload, np.uint8), n, b"")
    except CodecError:
        return
    assert out.shape == (n,) and out.dtype == np.uint8


def test_every_byte_and_bit_flip_is_caught_or_harmless() -> None:
    plane, payload = small_rans_stream()
    for i in range(len(payload)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(payload)
            bad[i] ^= mask
            decode_or_check(bytes(bad), plane.size)


def test_every_truncation_raises() -> None:
    plane, payload = small_rans_stream()
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            SMALL.decode(np.frombuffer(payload[:cut], np.uint8), plane.size, b"")
    with pytest.raises(CodecError):
        SMALL.decode(np.frombuffer(payload + b"\0\0", np.uint8), plane.size, b"")


@pytest.mark.parametrize("kind", ["skewed", "two_symbols", "one_symbol", "uniform256"])
def test_check_corruption_raises(kind: str) -> None:
    plane = planes_of(3 * B + 1)[kind]
    check_corruption_raises(SMALL, plane, np.random.default_rng(0), trials=300)


def patched(payload: bytes, at: int, fmt: str, value: int) -> np.ndarray:
    bad = bytearray(payload)
    struct.pack_into(fmt, bad, at, value)
    return np.frombuffer(bytes(bad), np.uint8)


def test_bad_streams_raise_with_a_reason() -> None:
    plane, good = small_rans_stream()
    n = plane.size
    nb = -(-n // 512)
    k = sum(bin(b).count("1") for b in good[12:44])
    table_end = 44 + 2 * k + (-(44 + 2 * k) % 4)
    cases = {
        "mode 3": patched(good, 0, "<B", 3),
        "log2_block 4": patched(good, 1, "<B", 4),
        "log2_block 21": patched(good, 1, "<B", 21),
        "reserved": patched(good, 2, "<H", 1),
        f"holds {n + 1} symbols": patched(good, 4, "<Q", n + 1),
        "sum to": patched(good, 44, "<H", 1 + struct.unpack_from("<H", good, 44)[0]),
        "frequency 0": patched(good, 44, "<H", 0),
        "marks no symbol": np.frombuffer(good[:12] + bytes(32) + good[44:], np.uint8),
        "at most one word": patched(good, table_end, "<I", 513),
        "outside [2^15": patched(good, table_end + 4 * nb, "<I", 1 << 31),
    }
    if (44 + 2 * k) % 4:
        cases["padding"] = patched(good, 44 + 2 * k, "<B", 1)
    for reason, bad in cases.items():
        with pytest.raises(CodecError, match=reason.replace("[", r"\[").replace("^", r"\^")):
            SMALL.decode(bad, n, b"")
    with pytest.raises(CodecError, match="parameters"):
        SMALL.decode(np.frombuffer(good, np.uint8), n, b"\0")
    with pytest.raises(CodecError, match="plane declares"):
        SMALL.decode(np.frombuffer(good, np.uint8), n - 1, b"")


def test_state_and_word_errors_are_named() -> None:
    plane, good = small_rans_stream()
    nb = -(-plane.size // 512)
    k = sum(bin(b).count("1") for b in good[12:44])
    table_end = 44 + 2 * k + (-(44 + 2 * k) % 4)
    states_at = table_end + 4 * nb
    # A final state of exactly 2^15 is in range, but decoding it cannot end back at 2^15.
    bad = patched(good, states_at, "<I", (1 << 15) + 12345)
    with pytest.raises(CodecError, match="block 0 of"):
        SMALL.decode(bad, plane.size, b"")
    # Moving a word from block 0 to block 1 keeps the total, so only the decoders notice.
    counts = struct.unpack_from(f"<{nb}I", good, table_end)
    moved = bytearray(good)
    struct.pack_into("<2I", moved, table_end, counts[0] - 1, counts[1] + 1)
    with pytest.raises(CodecError, match="rans block"):
        SMALL.decode(np.frombuffer(bytes(moved), np.uint8), plane.size, b"")


def test_bad_const_and_raw_streams() -> None:
    const = struct.pack("<BBHQ", MODE_CONST, 5, 0, 100)
    with pytest.raises(CodecError, match="CONST stream must be 16 bytes"):
        SMALL.decode(np.frombuffer(const + b"\1\2\3", np.uint8), 100, b"")
    assert SMALL.decode(np.frombuffer(const + b"\1\2\3\4", np.uint8), 100, b"").tolist() == \
        [1] * 32 + [2] * 32 + [3] * 32 + [4] * 4
    raw = struct.pack("<BBHQ", MODE_RAW, 16, 0, 3)
    with pytest.raises(CodecError, match="RAW stream must be 15 bytes"):
        SMALL.decode(np.frombuffer(raw + b"ab", np.uint8), 3, b"")
    with pytest.raises(CodecError, match="shorter than its 12-byte header"):
        SMALL.decode(np.frombuffer(raw[:11], np.uint8), 3, b"")


# ---------------------------------------------------------------------------------------------
# Frozen conformance vectors (written once by make_golden_rans.py; never regenerated silently)


GOLDEN_INDEX = json.loads((GOLDEN / "rans.json").read_text())


@pytest.mark.parametrize("name", sorted(GOLDEN_INDEX))
def test_golden_vector(name: str) -> None:
    entry = GOLDEN_INDEX[name]
    plane_bytes = (GOLDEN / entry["input"]).read_bytes()
    stream = (GOLDEN / entry["stream"]).read_bytes()
    assert hashlib.sha256(plane_bytes).hexdigest() == entry["input_sha256"]
    assert hashlib.sha256(stream).hexdigest() == entry["stream_sha256"]
    plane = np.frombuffer(plane_bytes, np.uint8)
    out = DEFAULT.decode(np.frombuffer(stream, np.uint8), plane.size, b"")
    assert out.tobytes() == plane_bytes
    if entry["mode"] == MODE_RANS:
        assert ref_decode_rans(stream) == plane_bytes
    log2_block, forced = entry["log2_block"], entry["forced_rans"]
    if forced:
        encoded = _rans_stream(plane, log2_block, normalise(np.bincount(plane, minlength=256)))
    else:
        encoded = as_array(RansCodec(log2_block).encode(plane).payload)
    assert encoded.tobytes() == stream
    assert ref_encode(plane_bytes, log2_block, raw_fallback=not forced) == stream


def test_a_stream_declaring_2_48_symbols_is_refused() -> None:
    # rans.md section 1: n < 2^48 (the overflow argument relies on it); a CONST stream can
    # declare it in a few bytes
    import pytest

    from s4format.codecs import rans
    from s4format.errors import CodecError

    n = 1 << 48
    head = rans.HEADER.pack(rans.MODE_CONST, rans.LOG2_BLOCK_MAX, 0, n)
    stream = np.frombuffer(head + bytes(8), np.uint8)  # refused from the header alone
    with pytest.raises(CodecError, match="2\\^48"):
        rans.RansCodec().decode(stream, n, b"")


def test_the_decoder_table_maps_every_slot_to_its_symbol() -> None:
    # slot -> (freq - 1) << 20 | (slot - cum) << 8 | symbol, built by a compiled loop: against
    # the definition, slot by slot, for random tables, one symbol alone and all 256
    rng = np.random.default_rng(11)
    tables = [np.eye(256, dtype=np.int64)[7] * PROB_SCALE,
              np.full(256, PROB_SCALE // 256, np.int64)]
    for k in rng.integers(1, 257, 300):
        cuts = np.sort(rng.choice(np.arange(1, PROB_SCALE), k - 1, replace=False))
        freqs = np.zeros(256, np.int64)
        freqs[rng.choice(256, k, replace=False)] = np.diff(
            np.concatenate(([0], cuts, [PROB_SCALE])))
        tables.append(freqs)
    for freqs in tables:
        cum = np.concatenate(([0], np.cumsum(freqs)[:-1]))
        sym = np.repeat(np.arange(256), freqs)
        slot = np.arange(PROB_SCALE)
        want = ((freqs[sym] - 1) << 20) | ((slot - cum[sym]) << 8) | sym
        got = _decoder_table(freqs)
        assert got.dtype == np.uint32 and (got.astype(np.int64) == want).all()


def test_a_stream_at_an_odd_address_decodes_the_same() -> None:
    # the one-call decoder reads the coded words as u16 and refuses a stream at an odd
    # address (found in the kernel); the block decoder then takes a copy
    rng = np.random.default_rng(5)
    plane = (rng.geometric(0.2, 50_000) % 256).astype(np.uint8)
    stream = as_array(get(RANS).encode(plane).payload)
    held = np.zeros(stream.size + 1, np.uint8)
    odd = held[1:]
    odd[:] = stream
    assert odd.ctypes.data % 2 == 1 and stream[0] == rans.MODE_RANS
    assert rans._decode_piece(odd, plane.size, int(stream[1]), np.empty(plane.size, np.uint8))
    assert (get(RANS).decode(odd, plane.size, b"") == plane).all()
    assert (get(RANS).decode(stream, plane.size, b"") == plane).all()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 1 << 20), min_size=256, max_size=256),
       st.one_of(st.integers(1, 1 << 34), st.integers(1 << 14, 1 << 18)))
def test_estimate_is_its_formula_summed_in_symbol_order(counts: list[int], n: int) -> None:
    """spec/rans.md's estimate: header, table, blocks and 2 bytes per 16 bits of the counted
    symbols' cross-entropy scaled to n, the bits summed symbol by symbol (as the GPU sums
    them), capped at the stored form."""
    _check_estimate(counts, n)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 3), min_size=256, max_size=256), st.integers(1, 2048))
def test_estimate_of_small_planes_is_its_formula(counts: list[int], n: int) -> None:
    """The same for small planes of few or many symbols, where the header and table alone may
    reach the cap (the estimate then skips normalising the table)."""
    _check_estimate(counts, n)


def _check_estimate(counts: list[int], n: int) -> None:
    from s4format.codecs import rans

    c = np.array(counts, np.int64)
    k = int(np.count_nonzero(c))
    if k == 0:
        with pytest.raises(ValueError):
            DEFAULT.estimate_counts(c, n)
        return
    if k == 1:
        want = HEADER_SIZE + rans._n_blocks(n, rans.LOG2_BLOCK_MAX)
    else:
        f = rans.normalise(c)
        bits = 0.0
        for s in range(256):
            bits += float(c[s]) * float(rans.SYMBOL_BITS[f[s]])  # 12 - log2(f)
        bits *= n / int(c.sum())
        want = min(HEADER_SIZE + len(rans.table_bytes(f)) + rans.BLOCK_OVERHEAD
                   * rans._n_blocks(n, DEFAULT.block_log2(n)) + 2 * int(np.ceil(bits / 16)),
                   HEADER_SIZE + n)
    assert DEFAULT.estimate_counts(c, n) == want


def test_pieces_coded_in_reused_scratch_give_the_stream_of_fresh_scratch(monkeypatch) -> None:
    """Planes of several pieces, and smaller ones after them on the same threads, code in each
    thread's kept scratch to the bytes that a fresh scratch per piece gives, and decode."""
    rng = np.random.default_rng(20261205)
    planes = [rng.integers(0, 40, n, dtype=np.uint8)
              for n in (5 * (1 << 20) // 2 + 77, 1000, 3 * 65536 + 5, (1 << 20) + 1)]
    codec = rans.RansCodec()
    kept = [np.asarray(codec.encode(p).payload) for p in planes]
    monkeypatch.setattr(rans, "_SCRATCH_KEPT", 0)  # every piece's scratch made for it
    for plane, stream in zip(planes, kept):
        assert np.array_equal(np.asarray(codec.encode(plane).payload), stream)
        assert np.array_equal(codec.decode(stream, plane.size, b""), plane)


@pytest.mark.parametrize("dtype,shift,mask", [("<u2", 7, 0xFF), ("<u2", 0, 0x7F),
                                               ("<u4", 23, 0xFF), ("<u4", 8, 0xFF)])
def test_a_plane_of_one_piece_codes_as_the_stepwise_coder_does(dtype: str, shift: int,
                                                               mask: int) -> None:
    """A field of words coded by the one-call coder (planes of one piece of work) gives the
    stream of the stepwise coder (normalise, tables, blocks, layout), around block edges and
    for block sizes down to one row."""
    from s4format.codecs.view import counted

    rng = np.random.default_rng(20261205)
    for n in (33, 4097, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 3 * (1 << 16) + 5):
        values = (rng.standard_normal(n) * 0.02).astype("<f4").view("<u4")
        words = (values >> 16).astype("<u2") if dtype == "<u2" else values
        view = counted(words, np.array([shift]), np.array([mask]))[0]
        for log2_block in (5, 10, 16):
            mode, stream = rans._rans_piece(view.words, shift, mask, log2_block,
                                            view.counts.astype(np.int64), rans._scratch(n))
            assert mode == MODE_RANS
            want = _rans_stream(view, log2_block, normalise(view.counts))
            assert np.array_equal(stream, want), (n, log2_block)
            assert np.array_equal(RansCodec(log2_block).decode(stream, n, b""),
                                  ((words.astype(np.int64) >> shift) & mask).astype(np.uint8))


def test_a_plane_of_one_piece_decodes_whole_in_one_call_and_names_what_is_wrong() -> None:
    """Whole-plane decodes of one piece take the one-call decoder; a stream it finds anything
    wrong in fails with the block-by-block decoder's message."""
    rng = np.random.default_rng(20261205)
    plane = (rng.standard_normal(70_000) * 2 + 100).clip(0, 255).astype(np.uint8)
    good = as_array(DEFAULT.encode(plane).payload)
    assert mode_of(good) == MODE_RANS
    assert DEFAULT.decode(good, plane.size, b"").tobytes() == plane.tobytes()
    bad = good.copy()
    bad[-3] ^= 0x5A
    with pytest.raises(CodecError, match="rans block 2 of 3 is corrupt"):
        DEFAULT.decode(bad, plane.size, b"")
