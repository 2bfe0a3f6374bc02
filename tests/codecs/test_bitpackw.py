"""bitpack-w (codec 8): round trips, a from-the-spec reference, the worked examples of
spec/codecs.md, every decoding rule, and the expansion bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import s4format
from conformance import generate
from s4format import LimitError, Reader, UnsupportedCodecError, codecs, layouts
from s4format.codecs.bitpackw import BitpackWCodec, width_of
from s4format.errors import CodecError
from tests.codecs.common import as_array, check_corruption_raises, check_encode_decode

CODEC = codecs.get(codecs.BITPACK_W)


# A second, deliberately naive implementation written from spec/codecs.md alone: the stored
# bytes are the little-endian encoding of X = sum(plane[i] * 2^(w*i)) in ceil(n*w/8) bytes.

def ref_encode(plane: bytes, w: int) -> bytes:
    x = sum(b << (w * i) for i, b in enumerate(plane))
    return x.to_bytes(-(-len(plane) * w // 8), "little")


def ref_decode(stored: bytes, n: int, w: int) -> bytes:
    x = int.from_bytes(stored, "little")
    return bytes((x >> (w * i)) & ((1 << w) - 1) for i in range(n))


def plane_of_width(rng: np.random.Generator, n: int, w: int) -> np.ndarray:
    """``n`` random bytes below 2^w whose largest (when n > 0) is 2^w - 1."""
    plane = rng.integers(0, 1 << w, n, dtype=np.uint8)
    if n:
        plane[rng.integers(n)] = (1 << w) - 1
    return plane


def test_registered_as_codec_8() -> None:
    assert isinstance(CODEC, BitpackWCodec)
    assert (CODEC.codec_id, CODEC.name, codecs.name_of(8)) == (8, "bitpack-w", "bitpack-w")


def test_codec_7_stays_unassigned() -> None:
    # the frozen conformance vector codec_7 relies on it (spec/codecs.md, Registry)
    assert codecs.name_of(7) == "unknown-7"
    with pytest.raises(UnsupportedCodecError, match="unknown codec ID 7"):
        codecs.get(7)


@pytest.mark.parametrize("w", range(1, 8))
@pytest.mark.parametrize("n", [*range(18), 63, 64, 65, 1000, 4087, (1 << 20) + 3])
def test_round_trip_every_width_and_length(w: int, n: int) -> None:
    rng = np.random.default_rng(1000 * w + n)
    plane = plane_of_width(rng, n, w) if n else np.zeros(0, np.uint8)
    payload = check_encode_decode(CODEC, plane)
    assert payload is not None
    width = w if n else 1
    assert CODEC.encode(plane).params == bytes([width])
    assert len(payload) == -(-n * width // 8) == CODEC.estimate(plane)
    if n <= 4096:
        assert payload.tobytes() == ref_encode(plane.tobytes(), width)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 7).flatmap(lambda w: st.tuples(
    st.just(w), st.lists(st.integers(0, (1 << w) - 1), max_size=300))))
def test_property_round_trip_and_exact_size(case: tuple[int, list[int]]) -> None:
    w, values = case
    plane = np.array(values, np.uint8)
    enc = CODEC.encode(plane)
    width = width_of(plane)
    assert width <= w and enc.params == bytes([width])
    stored = as_array(enc.payload)
    assert len(stored) == -(-len(values) * width // 8)
    assert stored.tobytes() == ref_encode(bytes(values), width)
    assert CODEC.decode(stored, len(values), enc.params).tobytes() == bytes(values)
    # any width that holds the bytes decodes (writers may choose a wider one)
    wide = np.frombuffer(ref_encode(bytes(values), 7), np.uint8)
    assert CODEC.decode(wide, len(values), b"\x07").tobytes() == bytes(values)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.integers(0, 40), st.binary(max_size=40))
def test_property_decode_matches_the_reference_on_any_stored_bytes(w: int, n: int,
                                                                   stored: bytes) -> None:
    payload = np.frombuffer(stored, np.uint8)
    try:
        out = CODEC.decode(payload, n, bytes([w]))
    except CodecError:
        tail = n * w % 8
        assert len(stored) != -(-n * w // 8) or (tail and stored[-1] >> tail)
        return
    assert out.tobytes() == ref_decode(stored, n, w)


@pytest.mark.parametrize(("plane", "w", "stored"), [
    ("0502070003", 3, "d531"),
    ("057f004112336a017e2c", 7, "853f202899a9037e16"),
])
def test_the_worked_examples_of_the_spec(plane: str, w: int, stored: str) -> None:
    raw = np.frombuffer(bytes.fromhex(plane), np.uint8)
    enc = CODEC.encode(raw)
    assert (enc.params, as_array(enc.payload).tobytes().hex()) == (bytes([w]), stored)
    out = CODEC.decode(np.frombuffer(bytes.fromhex(stored), np.uint8), raw.size, bytes([w]))
    assert out.tobytes() == raw.tobytes()


def test_width_1_stores_what_bitpack_stores() -> None:
    plane = np.random.default_rng(5).integers(0, 2, 1001, dtype=np.uint8)
    packed = codecs.get(codecs.BITPACK).encode(plane)
    assert as_array(CODEC.encode(plane).payload).tobytes() == as_array(packed.payload).tobytes()


@pytest.mark.parametrize("top", [128, 200, 255])
def test_declines_planes_with_a_byte_of_128_or_more(top: int) -> None:
    plane = np.zeros(100, np.uint8)
    plane[37] = top
    assert CODEC.encode(plane) is None
    assert CODEC.estimate(plane) is None


@pytest.mark.parametrize(("params", "shown"), [
    (b"", "none"), (b"\x07\x00", "0700"), (b"\x00", "00"), (b"\x08", "08"), (b"\xff", "ff")])
def test_params_must_be_one_byte_in_1_to_7(params: bytes, shown: str) -> None:
    stored = np.frombuffer(ref_encode(bytes(range(8)), 7), np.uint8)
    with pytest.raises(CodecError, match=f"the width 1..7; got {shown}$"):
        CODEC.decode(stored, 8, params)


@pytest.mark.parametrize("w", range(1, 8))
@pytest.mark.parametrize("n", [1, 8, 13, 1001])
@pytest.mark.parametrize("delta", [-1, 1])
def test_stored_len_must_be_exact(w: int, n: int, delta: int) -> None:
    good = ref_encode(bytes(n), w)
    stored = good[:-1] if delta < 0 else good + b"\x00"
    with pytest.raises(CodecError, match=f"plane of {n} bytes at {w} bits must store "
                                         f"{len(good)} bytes, stores {len(stored)}"):
        CODEC.decode(np.frombuffer(stored, np.uint8), n, bytes([w]))


@pytest.mark.parametrize("w", range(1, 8))
@pytest.mark.parametrize("n", [1, 3, 5, 9, 1001])
def test_every_padding_bit_must_be_zero(w: int, n: int) -> None:
    plane = plane_of_width(np.random.default_rng(10 * w + n), n, w)
    good = bytearray(ref_encode(plane.tobytes(), w))
    tail = n * w % 8
    if not tail:
        pytest.skip("n * w is a whole number of bytes: no padding")
    out = CODEC.decode(np.frombuffer(bytes(good), np.uint8), n, bytes([w]))
    assert out.tobytes() == plane.tobytes()
    for bit in range(tail, 8):
        bad = bytearray(good)
        bad[-1] |= 1 << bit
        with pytest.raises(CodecError, match="padding bits in the last byte are not zero"):
            CODEC.decode(np.frombuffer(bytes(bad), np.uint8), n, bytes([w]))


def test_max_decoded_len_is_8_per_stored_byte_whatever_the_width() -> None:
    assert [CODEC.max_decoded_len(s) for s in (0, 1, 511, 1 << 40)] == [0, 8, 4088, 8 << 40]


def test_reader_refuses_a_declared_length_above_the_bound_before_decoding() -> None:
    plane = np.ones(100, np.uint8)
    coded = generate.force(plane, "uint8", layouts.RAW, [generate.bitpack_w(7)])
    blob = generate.write_file([generate.TensorSpec("p", "uint8", (100,), plane, coded)],
                               policy="auto")
    with Reader(blob) as r:
        assert r.read_raw(0).tobytes() == plane.tobytes()
    short = generate.replaced(blob, (0, 0), lambda old: old[:12])  # 8 x 12 = 96 < 100 bytes
    with pytest.raises(LimitError, match="bitpack-w"):
        Reader(short)


def test_corrupted_streams_decode_or_raise() -> None:
    rng = np.random.default_rng(7)
    for w in range(1, 8):
        check_corruption_raises(CODEC, plane_of_width(rng, 1003, w), rng, trials=100)


def test_a_format_1_0_reader_refuses_codec_8_at_open(monkeypatch) -> None:
    tensors = {"w": np.random.default_rng(3).integers(0, 128, 8192).astype(np.uint8)
               .view("<u2").view(np.float16)}
    new, old = s4format.dumps(tensors), s4format.dumps(tensors, policy="auto-1.0")
    with Reader(new) as r:
        assert codecs.BITPACK_W in {p.codec for t in r.tensors for p in t.planes}
    codecs.get(codecs.BITPACK_W)  # loaded, so that removing it below sticks
    monkeypatch.delitem(codecs._REGISTRY, codecs.BITPACK_W)  # what a 1.0 reader knows
    with pytest.raises(UnsupportedCodecError, match="'bitpack-w' \\(ID 8\\)"):
        Reader(new)
    with Reader(old) as r:
        assert r.read_raw(0).tobytes() == tensors["w"].tobytes()
