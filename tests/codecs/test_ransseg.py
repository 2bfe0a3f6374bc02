"""rans-seg (codec 9): the codec contract on flat-buffer planes, a reference decoder written
from the payload description (24-byte records naming each segment's codec), every decoding
rule, hostile segment tables, the writer's cut and per-segment codec choice, its choice of
codec 9 for flat buffers (stored size, round trips, thread count), and slices across segments
of different codecs."""

from __future__ import annotations

import io
import itertools
import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format import Reader, Tensor, UnsupportedCodecError, codecs, dtypes, layouts, threads
from s4format.codecs import ransseg
from s4format.codecs.rans import MODE_CONST, MODE_RANS, MODE_RAW, RansCodec
from s4format.codecs.ransseg import RansSegCodec
from s4format.errors import CodecError
from s4format.writer import CodedPlane, CodedTensor, Writer, code_tensor
from tests.codecs.common import as_array, check_corruption_raises, check_encode_decode

CODEC = codecs.get(codecs.RANS_SEG)
RANS = RansCodec(split=False)  # (as the writer codes its segments)
RAW, BITPACK, RANS_ID, BITPACK_W = 1, 2, 4, 8   # the codecs a segment may take
UNIT = 1 << 16  # a segment other than the last holds a multiple of this many symbols
RECORD = "<QQHBBI"  # symbols, stored, codec, w, r1, r2
FIELDS = ("symbols", "stored", "codec", "w", "r1", "r2")
MODE_NAMES = {MODE_RAW: "RAW", MODE_CONST: "CONST", MODE_RANS: "RANS"}
Segment = tuple[int, int, int, bytes]  # symbols, codec, w, stored bytes


# ---------------------------------------------------------------------------------------------
# A second, deliberately naive decoder written from the payload description alone: u32 k,
# k x 24-byte records (u64 symbols, u64 stored, u16 codec, u8 w, u8 r1, u32 r2), then the k
# segments' stored bytes back to back. Raw, bitpack and bitpack-w segments are read from
# their spec sections; rANS segments by codec 4, which has its own tests.


def ref_table(payload: bytes) -> list[tuple[int, int, int, int, int, int]]:
    (k,) = struct.unpack_from("<I", payload)
    return [struct.unpack_from(RECORD, payload, 4 + 24 * i) for i in range(k)]


def ref_unpack(stored: bytes, n: int, w: int) -> bytes:
    """Plane byte i is stored bits w*i .. w*i + w - 1, its own bit b at bit w*i + b; stored
    bit t is bit t % 8 of stored byte t // 8 (bitpack is the case w = 1)."""
    assert len(stored) == (n * w + 7) // 8
    bits = np.unpackbits(np.frombuffer(stored, np.uint8), bitorder="little").astype(np.int64)
    assert not bits[n * w:].any()
    return (bits[:n * w].reshape(n, w) @ (1 << np.arange(w))).astype(np.uint8).tobytes()


def ref_segment(codec: int, w: int, stored: bytes, n: int) -> bytes:
    if codec == RAW:
        assert w == 0 and len(stored) == n
        return stored
    if codec == BITPACK:
        assert w == 0
        return ref_unpack(stored, n, 1)
    if codec == BITPACK_W:
        assert 1 <= w <= 7
        return ref_unpack(stored, n, w)
    assert codec == RANS_ID and w == 0
    return RANS.decode(np.frombuffer(stored, np.uint8), n, b"").tobytes()


def ref_decode(payload: bytes, decoded_len: int) -> bytes:
    """Decode a valid payload (the rules asserted, not reported: the reference for good
    payloads only)."""
    table = ref_table(payload)
    k = len(table)
    assert k >= 1 and sum(r[0] for r in table) == decoded_len
    assert 4 + 24 * k + sum(r[1] for r in table) == len(payload)
    out, at = bytearray(), 4 + 24 * k
    for i, (n, stored, codec, w, r1, r2) in enumerate(table):
        assert n >= 1 and (i == k - 1 or n % UNIT == 0) and r1 == r2 == 0
        out += ref_segment(codec, w, payload[at:at + stored], n)
        at += stored
    return bytes(out)


def build(segments: list[Segment]) -> bytes:
    """A payload of ``(symbols, codec, w, stored bytes)`` segments, as the description lays
    it out."""
    head = struct.pack("<I", len(segments))
    head += b"".join(struct.pack(RECORD, n, len(s), c, w, 0, 0) for n, c, w, s in segments)
    return head + b"".join(s for *_x, s in segments)


def with_record(payload: bytes, i: int, **fields: int) -> bytes:
    """``payload`` with fields of segment ``i``'s record changed."""
    bad = bytearray(payload)
    record = dict(zip(FIELDS, struct.unpack_from(RECORD, bad, 4 + 24 * i)))
    record.update(fields)
    struct.pack_into(RECORD, bad, 4 + 24 * i, *record.values())
    return bytes(bad)


def coded(codec_id: int, plane: np.ndarray, rans: RansCodec = RANS) -> Segment:
    """``plane`` coded as one segment by the real codec: (symbols, codec, w, stored bytes)."""
    if codec_id == RAW:
        return plane.size, RAW, 0, plane.tobytes()
    enc = (rans if codec_id == RANS_ID else codecs.get(codec_id)).encode(plane)
    w = enc.params[0] if codec_id == BITPACK_W else 0
    return plane.size, codec_id, w, as_array(enc.payload).tobytes()


def stream_of(plane: np.ndarray, codec: RansCodec = RANS) -> bytes:
    return coded(RANS_ID, plane, codec)[3]


def decode(payload: bytes, decoded_len: int, params: bytes = b"") -> bytes:
    return CODEC.decode(np.frombuffer(payload, np.uint8), decoded_len, params).tobytes()


def forms(payload: bytes) -> list[str]:
    """Each segment's codec as a name: ``rans`` with its stream's mode, ``bitpack-w`` with its
    width."""
    table = ref_table(payload)
    at = 4 + 24 * len(table) + np.cumsum([0] + [r[1] for r in table[:-1]])
    return [f"rans {MODE_NAMES[payload[a]]}" if codec == RANS_ID
            else f"bitpack-w {w}" if codec == BITPACK_W else codecs.name_of(codec)
            for (_n, _s, codec, w, _r1, _r2), a in zip(table, at.tolist())]


def encoded(plane: np.ndarray) -> bytes:
    return as_array(CODEC.encode(plane).payload).tobytes()


# ---------------------------------------------------------------------------------------------
# Planes


def exponents(n: int, scale: float, seed: int) -> np.ndarray:
    """Exponent bytes of N(0, scale) floats: one distribution per scale, a few octaves apart."""
    values = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    return (((values * np.float32(scale)).view(np.uint32) >> 23) & 0xFF).astype(np.uint8)


def below(n: int, limit: int, seed: int) -> np.ndarray:
    """``n`` uniformly random bytes below ``limit``."""
    return np.random.default_rng(seed).integers(0, limit, n, dtype=np.uint8)


@cache
def flat(name: str) -> np.ndarray:
    """Planes of a flat buffer: differently distributed runs end to end, >= 4 x 65,536 bytes."""
    parts = {
        "three_scales": [exponents(150_000, 0.02, 1), exponents(150_000, 1e-3, 2),
                         exponents(100_001, 1.0, 3)],
        "const_and_random_runs": [exponents(130_000, 0.02, 4), np.full(140_000, 0x3F, np.uint8),
                                  below(120_000, 256, 9), exponents(70_000, 1e-4, 5)],
        "unit_aligned": [exponents(2 * UNIT, 0.02, 1), exponents(2 * UNIT, 1.0, 2),
                         exponents(UNIT + 17, 1e-3, 3)],
        # a run for each choice the writer makes for a segment, in this order: rANS, bitpack-w
        # (7 bits), rANS CONST, bitpack, bitpack-w (3 bits), raw, bitpack-w (5 bits)
        "every_codec": [exponents(2 * UNIT, 0.02, 1), below(2 * UNIT, 128, 2),
                        np.full(2 * UNIT, 0x3F, np.uint8), below(2 * UNIT, 2, 3),
                        below(2 * UNIT, 8, 4), below(2 * UNIT, 256, 5), below(UNIT + 3, 32, 6)],
    }[name]
    plane = np.concatenate(parts)
    plane.flags.writeable = False
    return plane


FLAT = ("three_scales", "const_and_random_runs", "unit_aligned", "every_codec")


# ---------------------------------------------------------------------------------------------
# The codec contract


def test_registered_as_codec_9() -> None:
    assert isinstance(CODEC, RansSegCodec)
    assert (CODEC.codec_id, CODEC.name, codecs.name_of(9)) == (9, "rans-seg", "rans-seg")
    assert (ransseg.SEGMENT.format, ransseg.SEGMENT.size) == (RECORD, 24)
    assert sorted(ransseg.SEGMENT_CODECS) == [RAW, BITPACK, RANS_ID, BITPACK_W]


def test_the_modules_assemble_lays_out_the_described_payload() -> None:
    segments = [coded(RANS_ID, exponents(UNIT, 0.02, 1)), coded(BITPACK_W, below(UNIT, 16, 2)),
                coded(RAW, below(100, 256, 3))]
    as_arrays = [(n, c, w, np.frombuffer(s, np.uint8)) for n, c, w, s in segments]
    assert ransseg.assemble(segments).tobytes() == build(segments)
    assert ransseg.assemble(as_arrays).tobytes() == build(segments)


@pytest.mark.parametrize("name", FLAT)
def test_flat_planes_round_trip_and_corruption_raises_or_decodes(name: str) -> None:
    plane = flat(name)
    payload = check_encode_decode(CODEC, plane)
    assert payload is not None and len(ref_table(payload.tobytes())) >= 2
    check_corruption_raises(CODEC, plane, np.random.default_rng(len(name)), trials=100)


@pytest.mark.parametrize("kind", ["one_distribution", "one_symbol", "random_bytes",
                                  "random_7_bits", "mixed_but_under_4_units"])
def test_a_plane_of_one_segment_is_declined(kind: str) -> None:
    n = 6 * UNIT + 5
    plane = {
        "one_distribution": exponents(n, 0.02, 7),
        "one_symbol": np.full(n, 0x7E, np.uint8),
        "random_bytes": below(n, 256, 7),
        "random_7_bits": below(n, 128, 7),
        "mixed_but_under_4_units": np.concatenate([exponents(2 * UNIT, 0.02, 1),
                                                   below(2 * UNIT - 1, 8, 2)]),
    }[kind]
    assert CODEC.encode(plane) is None
    assert CODEC.estimate(plane) is None


def test_4_units_is_the_shortest_plane_cut() -> None:
    plane = np.concatenate([exponents(2 * UNIT, 0.02, 1), exponents(2 * UNIT, 1.0, 2)])
    payload = check_encode_decode(CODEC, plane).tobytes()
    assert [r[0] for r in ref_table(payload)] == [2 * UNIT, 2 * UNIT]


@pytest.mark.parametrize("name", FLAT)
def test_the_reference_decoder_agrees_and_the_estimate_is_close(name: str) -> None:
    plane = flat(name)
    payload = encoded(plane)
    table = ref_table(payload)
    assert all(r[0] % UNIT == 0 for r in table[:-1]) and table[-1][0] >= 1
    assert all(r[4:] == (0, 0) for r in table)
    assert ref_decode(payload, plane.size) == decode(payload, plane.size) == plane.tobytes()
    assert abs(CODEC.estimate(plane) / len(payload) - 1) < 0.01
    assert len(payload) < RANS.encode(plane).nbytes * (1 - 1 / 64)


def test_cuts_fall_on_the_run_boundaries() -> None:
    aligned = encoded(flat("unit_aligned"))
    assert [r[0] for r in ref_table(aligned)] == [2 * UNIT, 2 * UNIT, UNIT + 17]
    mixed = encoded(flat("const_and_random_runs"))
    assert {"rans RANS", "rans CONST", "raw"} <= set(forms(mixed))


def test_the_writer_codes_each_segment_as_a_plane_of_its_own() -> None:
    # 7-bit random bytes: rANS cannot save 1/65 of bitpack-w; one byte value: rANS CONST
    plane = flat("every_codec")
    payload = encoded(plane)
    table = ref_table(payload)
    assert [r[0] for r in table] == [2 * UNIT] * 6 + [UNIT + 3]
    assert forms(payload) == ["rans RANS", "bitpack-w 7", "rans CONST", "bitpack",
                              "bitpack-w 3", "raw", "bitpack-w 5"]
    assert [r[1] for r in table[1:]] == [2 * UNIT * 7 // 8, 13, 2 * UNIT // 8, 2 * UNIT * 3 // 8,
                                         2 * UNIT, ((UNIT + 3) * 5 + 7) // 8]


def test_the_estimate_of_raw_and_packed_segments_is_exact() -> None:
    plane = np.concatenate([below(2 * UNIT, 128, 1), below(2 * UNIT, 256, 2),
                            below(2 * UNIT, 2, 3), below(2 * UNIT + 5, 8, 4)])
    payload = encoded(plane)
    assert forms(payload) == ["bitpack-w 7", "raw", "bitpack", "bitpack-w 3"]
    assert CODEC.estimate(plane) == len(payload) == 4 + 4 * 24 + sum(
        (r[0] * b + 7) // 8 for r, b in zip(ref_table(payload), (7, 8, 1, 3)))


def test_views_of_a_tensors_words_code_as_their_bytes() -> None:
    bits = bf16_bits(np.concatenate(runs_of((200_000, 150_000, 120_000))))
    for view in layouts.BF16.views(bits.view(np.uint8), 2):
        alone = view.bytes().copy()
        enc, est = CODEC.encode_view(view), CODEC.estimate_view(view)
        again = CODEC.encode(alone)
        assert (enc is None) == (again is None) and est == CODEC.estimate(alone)
        if enc is not None:
            assert as_array(enc.payload).tobytes() == as_array(again.payload).tobytes()
    exponent = layouts.BF16.views(bits.view(np.uint8), 2)[1]
    assert CODEC.encode_view(exponent) is not None


def test_max_decoded_len_is_a_tight_bound() -> None:
    assert [CODEC.max_decoded_len(s) for s in (0, 28, 29, 39, 40, 41, 1000)] == \
        [0, 0, 8, 88, 96, 1 << 20, 960 << 20]
    plane = np.full(3 << 20, 5, np.uint8)   # one CONST segment: the densest payload
    payload = build([coded(RANS_ID, plane)])
    assert len(payload) == 4 + 24 + 12 + 3
    assert CODEC.max_decoded_len(len(payload)) == plane.size
    assert decode(payload, plane.size) == plane.tobytes()


@pytest.mark.parametrize(("codec_id", "plane"), [
    (RAW, np.arange(1, dtype=np.uint8)), (RAW, np.arange(12, dtype=np.uint8)),
    (BITPACK, np.ones(96, np.uint8)), (BITPACK_W, np.full(32, 7, np.uint8)),
], ids=["raw 1", "raw 12", "bitpack 96", "bitpack-w 32 x 3 bits"])
def test_max_decoded_len_bounds_a_small_valid_payload(codec_id: int, plane: np.ndarray) -> None:
    payload = build([coded(codec_id, plane)])
    assert len(payload) <= 40 and decode(payload, plane.size) == plane.tobytes()
    assert CODEC.max_decoded_len(len(payload)) >= plane.size


def test_a_file_with_a_small_valid_plane_round_trips() -> None:
    plane = np.arange(5, dtype=np.uint8)
    coded_plane = CodedPlane(layouts.KIND_RAW, 0, codecs.RANS_SEG, plane.size,
                             build([coded(RAW, plane)]), b"")
    buf = io.BytesIO()
    w = Writer(buf)
    w.add_coded("t", dtypes.by_name("uint8"), (5,), CodedTensor(layouts.RAW, (coded_plane,)),
                s4format.hashing.content_hash(plane))
    w.close()
    with Reader(buf.getvalue()) as r:
        assert r.read_raw(0).tobytes() == plane.tobytes()


# ---------------------------------------------------------------------------------------------
# Decoding rules: hand-built payloads of real segments, each case breaking one rule


@cache
def good() -> tuple[bytes, bytes]:
    """A payload of eight segments, every codec a segment may take (rANS in each of its
    modes, bitpack-w at three widths, the last one partial), and the plane it decodes to."""
    planes = [(RANS_ID, exponents(UNIT, 0.02, 11)), (RANS_ID, np.full(2 * UNIT, 0x7E, np.uint8)),
              (RANS_ID, below(UNIT, 256, 12)), (RAW, below(UNIT, 256, 13)),
              (BITPACK, below(UNIT, 2, 14)), (BITPACK_W, below(UNIT, 8, 15)),
              (BITPACK_W, below(UNIT, 32, 16)), (BITPACK_W, below(1001, 128, 17))]
    payload = build([coded(c, p) for c, p in planes])
    assert forms(payload) == ["rans RANS", "rans CONST", "rans RAW", "raw", "bitpack",
                              "bitpack-w 3", "bitpack-w 5", "bitpack-w 7"]
    return payload, np.concatenate([p for _c, p in planes]).tobytes()


K, BODY = 8, 4 + 24 * 8    # good()'s segment count and table size
CODECS_TAKEN = "a segment takes raw (1), bitpack (2), rans (4) or bitpack-w (8)"


def test_the_hand_built_payload_decodes() -> None:
    payload, plane = good()
    assert ref_decode(payload, len(plane)) == decode(payload, len(plane)) == plane


def table_cases() -> dict[str, tuple[bytes, int, bytes, str]]:
    """Rules of the payload's size, the count and the sums: case -> (payload, decoded_len,
    params, the whole error message)."""
    payload, plane = good()
    n, size = len(plane), len(payload)
    table = ref_table(payload)
    (n0, s0, *_x), (n1, s1, *_x), (n7, s7, *_x) = table[0], table[1], table[7]
    stored = sum(r[1] for r in table)
    store = f"rans-seg segments store {{}} bytes after a {BODY}-byte table, the payload has {{}}"
    hold = "rans-seg segments hold {} symbols, plane declares {}"
    multiple = "rans-seg segment {} holds {} symbols, not a multiple of 65536 (only the last " \
               "segment may)"
    return {
        "empty": (b"", n, b"", "rans-seg payload of 0 bytes is shorter than its count"),
        "3 bytes": (payload[:3], n, b"", "rans-seg payload of 3 bytes is shorter than its count"),
        "k = 0": (bytes(4) + payload[4:], n, b"", "rans-seg payload holds 0 segments"),
        "table past payload": (payload[:BODY - 1], n, b"", f"rans-seg segment table of {K} "
                               f"segments needs {BODY} bytes, the payload has {BODY - 1}"),
        "first of 0 symbols": (with_record(payload, 0, symbols=0), n, b"",
                               "rans-seg segment 0 holds 0 symbols"),
        "last of 0 symbols": (with_record(payload, 7, symbols=0), n, b"",
                              "rans-seg segment 7 holds 0 symbols"),
        "first not a multiple": (with_record(with_record(payload, 0, symbols=n0 + 1), 7,
                                             symbols=n7 - 1), n, b"",
                                 multiple.format(0, n0 + 1)),
        "middle not a multiple": (with_record(with_record(payload, 1, symbols=n1 - 1), 7,
                                              symbols=n7 + 1), n, b"",
                                  multiple.format(1, n1 - 1)),
        "plane one longer": (payload, n + 1, b"", hold.format(n, n + 1)),
        "plane one shorter": (payload, n - 1, b"", hold.format(n, n - 1)),
        "last one symbol more": (with_record(payload, 7, symbols=n7 + 1), n, b"",
                                 hold.format(n + 1, n)),
        "stored one more": (with_record(payload, 7, stored=s7 + 1), n, b"",
                            store.format(stored + 1, size)),
        "stored one less": (with_record(payload, 0, stored=s0 - 1), n, b"",
                            store.format(stored - 1, size)),
        "payload one longer": (payload + b"\0", n, b"", store.format(stored, size + 1)),
        "payload one shorter": (payload[:-1], n, b"", store.format(stored, size - 1)),
        "params": (payload, n, b"\0", "rans-seg takes no parameters, got 1 bytes"),
        # a decoder summing in u64 would take these wrapped sums for the right ones
        "symbols wrap at 2^64": (with_record(with_record(payload, 0, symbols=n0 + (1 << 63)),
                                             1, symbols=n1 + (1 << 63)), n, b"",
                                 hold.format(n + (1 << 64), n)),
        "stored wraps at 2^64": (with_record(with_record(payload, 0, stored=s0 + (1 << 63)), 1,
                                             stored=s1 + (1 << 63)), n, b"",
                                 store.format(stored + (1 << 64), size)),
    }


def record_cases() -> dict[str, tuple[bytes, int, bytes, str]]:
    """Rules of a record's codec, width and reserved bytes (checked before the sums, the first
    segment breaking any record rule reported): case -> as :func:`table_cases`."""
    payload, plane = good()
    n = len(plane)
    nested = build([coded(RAW, below(UNIT, 256, 13))])   # a rans-seg payload as a segment
    at3 = BODY + sum(r[1] for r in ref_table(payload)[:3])
    cases = {
        f"codec {c}": (with_record(payload, 3, codec=c), n, b"",
                       f"rans-seg segment 3 names codec {c}; {CODECS_TAKEN}")
        # 3 zstd, 5 gdeflate, 6 nvcomp-ans, 7 and 0 unassigned, 260 = 0x104 and 2052 = 0x804
        # read as 4 and 8 by a decoder taking one byte
        for c in (0, 3, 5, 6, 7, 260, 2052, 0xFFFF)}
    return cases | {
        "codec 9, rans-seg itself": (
            with_record(payload[:at3] + nested + payload[at3 + UNIT:], 3, codec=9,
                        stored=len(nested)), n, b"",
            f"rans-seg segment 3 names codec 9; {CODECS_TAKEN}"),
        "bitpack-w of width 0": (with_record(payload, 5, w=0), n, b"",
                                 "rans-seg segment 5 is bitpack-w of width 0, not 1 to 7"),
        "bitpack-w of width 8": (with_record(payload, 7, w=8), n, b"",
                                 "rans-seg segment 7 is bitpack-w of width 8, not 1 to 7"),
        "bitpack-w of width 255": (with_record(payload, 6, w=255), n, b"",
                                   "rans-seg segment 6 is bitpack-w of width 255, not 1 to 7"),
        "a width on rans": (with_record(payload, 0, w=7), n, b"",
                            "rans-seg segment 0 sets a width (7) for a codec that takes none"),
        "a width on raw": (with_record(payload, 3, w=8), n, b"",
                           "rans-seg segment 3 sets a width (8) for a codec that takes none"),
        "a width on bitpack": (with_record(payload, 4, w=1), n, b"",
                               "rans-seg segment 4 sets a width (1) for a codec that takes none"),
        "r1 = 1": (with_record(payload, 2, r1=1), n, b"",
                   "rans-seg segment 2 has reserved bytes that are not zero"),
        "r2 = 1": (with_record(payload, 6, r2=1), n, b"",
                   "rans-seg segment 6 has reserved bytes that are not zero"),
        "r2's top bit on the last": (with_record(payload, 7, r2=1 << 31), n, b"",
                                     "rans-seg segment 7 has reserved bytes that are not zero"),
        "reserved on 1, codec 3 on 4": (
            with_record(with_record(payload, 1, r1=0x80), 4, codec=3), n, b"",
            "rans-seg segment 1 has reserved bytes that are not zero"),
        "codec 9 on 2, 0 symbols on 5": (
            with_record(with_record(payload, 2, codec=9), 5, symbols=0), n, b"",
            f"rans-seg segment 2 names codec 9; {CODECS_TAKEN}"),
        "width 0 on 5, a width on 7": (
            with_record(with_record(payload, 7, codec=RAW), 5, w=0), n, b"",
            "rans-seg segment 5 is bitpack-w of width 0, not 1 to 7"),
        "not a multiple on 6, r2 on 7": (
            with_record(with_record(payload, 6, symbols=UNIT - 8), 7, r2=2), n, b"",
            f"rans-seg segment 6 holds {UNIT - 8} symbols, not a multiple of 65536 (only the "
            "last segment may)"),
        "codec 3 and the plane one longer": (with_record(payload, 3, codec=3), n + 1, b"",
                                             f"rans-seg segment 3 names codec 3; "
                                             f"{CODECS_TAKEN}"),
    }


def segment_cases() -> dict[str, tuple[bytes, int, bytes, str]]:
    """Segments invalid for their own codec (the message names the segment, its codec and
    what its codec found; the first such segment reported): case -> as :func:`table_cases`."""
    payload, plane = good()
    n = len(plane)
    sizes = [r[1] for r in ref_table(payload)]
    starts = (BODY + np.cumsum([0, *sizes[:-1]])).tolist()

    def moved(i: int, d: int) -> bytes:    # d stored bytes moved from segment i + 1 to i
        return with_record(with_record(payload, i, stored=sizes[i] + d), i + 1,
                           stored=sizes[i + 1] - d)

    def seg(i: int, name: str) -> str:
        return f"rans-seg segment {i} of {K} ({name}): "

    mode_3 = bytearray(payload)
    mode_3[starts[1]] = 3
    padded = bytearray(payload)
    padded[-1] |= 0x80       # 1001 x 7 bits leave the last byte's top bit as padding
    w7, w3 = (1001 * 7 + 7) // 8, (1001 * 3 + 7) // 8
    return {
        "rans stream in mode 3": (bytes(mode_3), n, b"", seg(1, "rans") +
                                  "rans mode 3 is not RAW (0), CONST (1) or RANS (2)"),
        "a byte moved from rans 1 to 0": (moved(0, 1), n, b"", seg(0, "rans")),
        "a byte moved from rans 0 to 1": (moved(0, -1), n, b"", seg(0, "rans")),
        "a rans stream of another count": (
            with_record(with_record(payload, 1, symbols=UNIT), 7, symbols=1001 + UNIT), n, b"",
            seg(1, "rans") + f"rans stream holds {2 * UNIT} symbols, plane declares {UNIT}"),
        "raw one byte short": (moved(3, -1), n, b"", seg(3, "raw") +
                               f"raw plane stores {UNIT - 1} bytes but declares {UNIT}"),
        "bitpack one byte short": (moved(4, -1), n, b"", seg(4, "bitpack") +
                                   f"bitpack plane of {UNIT} bits must store {UNIT // 8} "
                                   f"bytes, stores {UNIT // 8 - 1}"),
        "bitpack-w one byte short": (moved(5, -1), n, b"", seg(5, "bitpack-w") +
                                     f"bitpack-w plane of {UNIT} bytes at 3 bits must store "
                                     f"{UNIT * 3 // 8} bytes, stores {UNIT * 3 // 8 - 1}"),
        "the last bitpack-w one byte short": (
            with_record(payload, 7, stored=w7 - 1)[:-1], n, b"", seg(7, "bitpack-w") +
            f"bitpack-w plane of 1001 bytes at 7 bits must store {w7} bytes, stores {w7 - 1}"),
        "bitpack-w padding bit set": (bytes(padded), n, b"", seg(7, "bitpack-w") +
                                      "bitpack-w padding bits in the last byte are not zero"),
        "bitpack-w of 7 bits declared 3": (with_record(payload, 7, w=3), n, b"",
                                           seg(7, "bitpack-w") + "bitpack-w plane of 1001 "
                                           f"bytes at 3 bits must store {w3} bytes, stores {w7}"),
        "raw declared bitpack": (with_record(payload, 3, codec=BITPACK), n, b"",
                                 seg(3, "bitpack") + f"bitpack plane of {UNIT} bits must store "
                                 f"{UNIT // 8} bytes, stores {UNIT}"),
        "bitpack declared raw": (with_record(payload, 4, codec=RAW), n, b"", seg(4, "raw") +
                                 f"raw plane stores {UNIT // 8} bytes but declares {UNIT}"),
        "bitpack-w declared bitpack": (with_record(payload, 6, codec=BITPACK, w=0), n, b"",
                                       seg(6, "bitpack") + f"bitpack plane of {UNIT} bits must "
                                       f"store {UNIT // 8} bytes, stores {UNIT * 5 // 8}"),
        "rans CONST declared raw": (with_record(payload, 1, codec=RAW), n, b"", seg(1, "raw") +
                                    f"raw plane stores {sizes[1]} bytes but declares "
                                    f"{2 * UNIT}"),
        "raw declared rans": (with_record(payload, 3, codec=RANS_ID), n, b"", seg(3, "rans")),
    }


def all_rule_cases() -> dict[str, tuple[bytes, int, bytes, str]]:
    return table_cases() | record_cases() | segment_cases()


@pytest.mark.parametrize("case", sorted(all_rule_cases()))
def test_each_broken_rule_raises_a_named_codec_error(case: str) -> None:
    payload, decoded_len, params, message = all_rule_cases()[case]
    with pytest.raises(CodecError, match="^" + re.escape(message)):
        decode(payload, decoded_len, params)
    assert CODEC.slicer(np.frombuffer(payload, np.uint8), decoded_len, params) is None


# ---------------------------------------------------------------------------------------------
# Hostile tables: refused at once, before the plane is allocated


def test_a_count_of_2_32_minus_1_with_a_short_payload_is_refused_at_once() -> None:
    payload = struct.pack("<I", (1 << 32) - 1) + bytes(60)
    start = time.perf_counter()
    with pytest.raises(CodecError, match=f"table of 4294967295 segments needs "
                                         f"{4 + 24 * ((1 << 32) - 1)} bytes, the payload has "
                                         f"64$"):
        decode(payload, CODEC.max_decoded_len(len(payload)), b"")
    assert time.perf_counter() - start < 0.5


def test_huge_symbol_counts_are_refused_before_allocating_the_plane() -> None:
    stream = stream_of(np.full(16 << 20, 1, np.uint8))   # a CONST stream of 16 blocks
    for symbols in ((1 << 64) - 1, 1 << 63, (16 << 20) + 1):
        payload = build([(symbols, RANS_ID, 0, stream)])
        decoded_len = CODEC.max_decoded_len(len(payload))
        assert decoded_len == 16 << 20
        tracemalloc.start()
        try:
            with pytest.raises(CodecError, match=f"hold {symbols} symbols, plane declares "
                                                 f"{decoded_len}$"):
                decode(payload, decoded_len)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < decoded_len // 16


LONG = 32_000   # 768 KB of table


@pytest.mark.parametrize(("last", "message"), [
    ((UNIT, 0, RAW, 0, 0, 0), f"rans-seg segments hold {LONG * UNIT} symbols, plane declares 1$"),
    ((UNIT, 0, 3, 0, 0, 0), f"rans-seg segment {LONG - 1} names codec 3;"),
    ((UNIT, 0, BITPACK_W, 0, 0, 0), f"rans-seg segment {LONG - 1} is bitpack-w of width 0,"),
    ((UNIT, 0, RAW, 0, 0, 1), f"rans-seg segment {LONG - 1} has reserved bytes"),
])
def test_a_long_segment_table_is_refused_in_linear_time(last: tuple[int, ...],
                                                        message: str) -> None:
    # every segment but the last declaring 65,536 raw symbols and no bytes
    payload = struct.pack("<I", LONG) + struct.pack(RECORD, UNIT, 0, RAW, 0, 0, 0) * (LONG - 1) \
        + struct.pack(RECORD, *last)
    start = time.perf_counter()
    with pytest.raises(CodecError, match=message):
        decode(payload, 1)
    assert CODEC.slicer(np.frombuffer(payload, np.uint8), 1, b"") is None
    assert time.perf_counter() - start < 0.5


# ---------------------------------------------------------------------------------------------
# Random segmentations built by hand from real segments of every codec


def segment(kind: str, n: int, seed: int) -> tuple[np.ndarray, Segment]:
    """A plane of ``n`` bytes and its segment: rANS (RANS, CONST or RAW mode, in 64K-symbol
    blocks or, ``small_blocks``, 512-symbol ones), raw, bitpack or bitpack-w (width from the
    seed)."""
    rng = np.random.default_rng(seed)
    if kind == "const":
        return (plane := np.full(n, seed % 256, np.uint8)), coded(RANS_ID, plane)
    if kind in ("raw", "rans_raw"):
        plane = rng.integers(0, 256, n, dtype=np.uint8)
        return plane, coded(RAW if kind == "raw" else RANS_ID, plane)
    if kind == "bitpack":
        return (plane := rng.integers(0, 2, n, dtype=np.uint8)), coded(BITPACK, plane)
    if kind == "bitpack_w":
        plane = rng.integers(0, 1 << (1 + seed % 7), n, dtype=np.uint8)
        plane[0] = (1 << (1 + seed % 7)) - 1     # its width is exactly 1 + seed % 7
        return plane, coded(BITPACK_W, plane)
    plane = exponents(n, 10.0 ** -int(rng.integers(0, 5)), seed)
    return plane, coded(RANS_ID, plane, RansCodec(9) if kind == "small_blocks" else RANS)


KINDS = st.sampled_from(["rans", "const", "rans_raw", "small_blocks", "raw", "bitpack",
                         "bitpack_w"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=st.lists(st.tuples(KINDS, st.integers(1, 2), st.integers(0, 2**32)), max_size=3),
       last=st.tuples(KINDS, st.integers(1, 3 * UNIT), st.integers(0, 2**32)))
def test_property_hand_built_segmentations_decode(head: list[tuple[str, int, int]],
                                                  last: tuple[str, int, int]) -> None:
    parts = [segment(kind, units * UNIT, seed) for kind, units, seed in head]
    parts.append(segment(*last))
    plane = np.concatenate([p for p, _ in parts]).tobytes()
    payload = build([s for _, s in parts])
    assert CODEC.max_decoded_len(len(payload)) >= len(plane)
    assert ref_decode(payload, len(plane)) == plane
    assert decode(payload, len(plane)) == plane
    s = CODEC.slicer(np.frombuffer(payload, np.uint8), len(plane), b"")
    piece = -(-300_000 // s.align) * s.align   # pieces crossing segments of any codec
    got = [s.get(lo, min(len(plane), lo + piece)) for lo in range(0, len(plane), piece)]
    assert np.concatenate(got).tobytes() == plane


def run_of(kind: str, n: int, seed: int) -> np.ndarray:
    if kind == "exponents":
        return exponents(n, 10.0 ** -(seed % 5), seed)
    if kind == "const":
        return np.full(n, seed, np.uint8)
    return below(n, 1 << (1 + seed % 8), seed)   # 1 to 8 random bits


RUNS = st.tuples(st.sampled_from(["exponents", "const", "below"]), st.integers(UNIT, 2 * UNIT),
                 st.integers(0, 255))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs=st.lists(RUNS, min_size=4, max_size=6))   # >= 4 units, so that runs may be cut
def test_property_the_writers_segments_decode(runs: list[tuple[str, int, int]]) -> None:
    plane = np.concatenate([run_of(*r) for r in runs])
    enc = CODEC.encode(plane)
    if enc is None:
        return
    payload = as_array(enc.payload).tobytes()
    assert ref_decode(payload, plane.size) == decode(payload, plane.size) == plane.tobytes()
    assert abs(CODEC.estimate(plane) - len(payload)) <= len(payload) // 50 + 64


# ---------------------------------------------------------------------------------------------
# The writer on flat buffers


def runs_of(lengths: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    """fp32 runs as a flat buffer holds them, in turn: N(0, 0.02), N(0, 1e-3) and N(0, 1)
    weights, ones (a norm's weight) and small integers kept as floats."""
    rng = np.random.default_rng(seed)
    makers: list[Callable[[int], np.ndarray]] = [
        lambda n: rng.standard_normal(n, dtype=np.float32) * np.float32(0.02),
        lambda n: rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3),
        lambda n: rng.standard_normal(n, dtype=np.float32),
        lambda n: np.ones(n, np.float32),
        lambda n: rng.integers(-8, 9, n).astype(np.float32),
    ]
    return [make(n).astype("<f4") for make, n in zip(itertools.cycle(makers), lengths)]


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.view("<u4") >> 16).astype("<u2")


UNALIGNED = (300_000, 250_001, 300_000, 280_000, 300_000)
ALIGNED = (4 * UNIT, 4 * UNIT, 4 * UNIT, 4 * UNIT, 250_000)
DTYPES = {"bfloat16": bf16_bits, "float32": lambda v: v}


def raw_of(values: np.ndarray, dtype: str) -> np.ndarray:
    return DTYPES[dtype](values).view(np.uint8).reshape(-1)


@cache
def flat_buffer(dtype: str, lengths: tuple[int, ...] = UNALIGNED) -> np.ndarray:
    raw = raw_of(np.concatenate(runs_of(lengths)), dtype)
    raw.flags.writeable = False
    return raw


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_auto_takes_codec_9_for_a_flat_buffer_and_no_other_policy_does(dtype: str) -> None:
    raw = flat_buffer(dtype)
    chosen = {p.kind: p.codec for p in code_tensor(raw, dtypes.by_name(dtype), "auto").planes}
    assert chosen[layouts.KIND_EXPONENT] == codecs.RANS_SEG
    for policy in ("auto-1.0", "seed"):
        coded = code_tensor(raw, dtypes.by_name(dtype), policy)
        assert codecs.RANS_SEG not in {p.codec for p in coded.planes}, policy


def test_a_flat_buffers_segments_take_every_codec() -> None:
    # sign planes bitpack, mantissa planes bitpack-w or raw, runs of ones rANS CONST
    taken = {form for dt in DTYPES for p in code_tensor(flat_buffer(dt), dtypes.by_name(dt)).planes
             if p.codec == codecs.RANS_SEG for form in forms(as_array(p.payload).tobytes())}
    assert {"raw", "bitpack", "bitpack-w 7", "rans CONST", "rans RANS"} <= taken


def test_a_byte_tensor_of_every_segment_codec_round_trips_through_a_file() -> None:
    plane = flat("every_codec")
    state = {"bytes": Tensor(dtypes.by_name("uint8"), (plane.size,), plane)}
    with Reader(s4format.dumps(state)) as r:
        assert [p.codec for p in r.tensors[0].planes] == [codecs.RANS_SEG]
        assert r.load()["bytes"].data.tobytes() == plane.tobytes()


def flat_and_apart(dtype: str, lengths: tuple[int, ...]) -> tuple[int, int]:
    """Stored bytes of the runs as one flat tensor and coded each apart."""
    dt = dtypes.by_name(dtype)
    apart = sum(code_tensor(raw_of(r, dtype), dt).stored for r in runs_of(lengths))
    return code_tensor(flat_buffer(dtype, lengths), dt).stored, apart


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_flat_buffer_of_unit_aligned_runs_stores_within_1_5_percent_of_its_parts(
        dtype: str) -> None:
    together, apart = flat_and_apart(dtype, ALIGNED)
    assert together <= apart * 1.015


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_run_boundary_inside_a_unit_costs_at_most_a_bit_per_symbol_of_it(dtype: str) -> None:
    # Segments start on multiples of 65,536 symbols, so a unit straddling two runs is coded
    # with one table: at most one bit per symbol above its two parts, plus a table's bytes.
    together, apart = flat_and_apart(dtype, UNALIGNED)
    boundaries = sum(1 for at in itertools.accumulate(UNALIGNED[:-1]) if at % UNIT)
    planes = len(layouts.preferred(dtype, dtypes.by_name(dtype).itemsize).planes(
        dtypes.by_name(dtype).itemsize))
    assert together <= apart + boundaries * planes * (UNIT // 8 + 1024)


@cache
def flat_state() -> dict[str, Tensor]:
    state = {}
    for name in DTYPES:
        dt = dtypes.by_name(name)
        raw = flat_buffer(name)
        state[f"flat_{name}"] = Tensor(dt, (raw.size // dt.itemsize,), raw)
    return state


def test_a_file_of_flat_buffers_round_trips_and_declares_format_1_5(monkeypatch) -> None:
    state = flat_state()
    blob = s4format.dumps(state)
    with Reader(blob) as r:
        assert r.version == (1, 5)
        for t in r.tensors:
            assert {codecs.RANS_SEG, codecs.SEG_LZ} & {p.codec for p in t.planes}, t.name
        got = r.load()
    assert {k: v.data.tobytes() for k, v in got.items()} == \
        {k: v.data.tobytes() for k, v in state.items()}
    for policy, minor in (("seed", 1), ("auto-1.0", 0)):
        with Reader(s4format.dumps(state, policy=policy)) as r:
            assert r.version == (1, minor)
    codecs.get(codecs.RANS_SEG)  # loaded, so that removing it below sticks
    monkeypatch.delitem(codecs._REGISTRY, codecs.RANS_SEG)  # what a format 1.1 reader knows
    with pytest.raises(UnsupportedCodecError, match="'rans-seg' \\(ID 9\\)"):
        Reader(blob)


def test_s4weights_round_trips_flat_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    import s4weights

    state = {"flat_bf16": torch.from_numpy(flat_buffer("bfloat16").view(np.int16).copy())
             .view(torch.bfloat16),
             "flat_fp32": torch.from_numpy(flat_buffer("float32").view(np.float32).copy()),
             "step": 7}
    buf = io.BytesIO()
    s4weights.save(state, buf)
    with Reader(buf.getvalue()) as r:
        assert all(codecs.RANS_SEG in {p.codec for p in t.planes} for t in r.tensors)
    got = s4weights.load(buf.getvalue())
    assert got["step"] == 7 and got["flat_bf16"].dtype == torch.bfloat16
    assert torch.equal(got["flat_bf16"].view(torch.int16), state["flat_bf16"].view(torch.int16))
    assert torch.equal(got["flat_fp32"].view(torch.int32), state["flat_fp32"].view(torch.int32))


def _with_threads(monkeypatch, n: int) -> None:
    monkeypatch.setenv("S4_THREADS", str(n))
    monkeypatch.setattr(threads, "_pool", None)
    assert threads.pool().threads == n


def test_coded_bytes_do_not_depend_on_the_thread_count(monkeypatch) -> None:
    out = []
    for n in (1, 2):
        _with_threads(monkeypatch, n)
        planes = [(p.codec, as_array(p.payload).tobytes())
                  for dt in DTYPES for p in code_tensor(flat_buffer(dt), dtypes.by_name(dt)).planes]
        out.append((planes, s4format.dumps(flat_state())))
    assert out[0] == out[1]
    assert codecs.RANS_SEG in {cid for cid, _ in out[0][0]}
    with Reader(out[0][1]) as r:   # decoded on two threads, segments in parallel
        assert r.read_raw(0).tobytes() == flat_buffer("bfloat16").tobytes()


# ---------------------------------------------------------------------------------------------
# Slices (the reader merges a plane a piece at a time)


@pytest.mark.parametrize("name", FLAT)
def test_slices_of_every_piece_size_are_the_plane(name: str) -> None:
    plane = flat(name)
    payload = as_array(CODEC.encode(plane).payload)
    s = CODEC.slicer(payload, plane.size, b"")
    assert s is not None and s.align == UNIT
    for piece in (UNIT, 3 * UNIT, 1 << 20):
        got = [s.get(lo, min(plane.size, lo + piece)) for lo in range(0, plane.size, piece)]
        assert np.concatenate(got).tobytes() == plane.tobytes()


def mixed(codecs_of: tuple[int, ...]) -> tuple[bytes, bytes]:
    """A payload of segments coded by ``codecs_of`` in turn, 65,536 symbols each but the last
    (1001), and its plane."""
    makers: dict[int, Callable[[int, int], np.ndarray]] = {
        RANS_ID: lambda n, seed: exponents(n, 0.02, seed), RAW: lambda n, seed: below(n, 256, seed),
        BITPACK: lambda n, seed: below(n, 2, seed), BITPACK_W: lambda n, seed: below(n, 64, seed)}
    planes = [(c, makers[c](UNIT if i < len(codecs_of) - 1 else 1001, i))
              for i, c in enumerate(codecs_of)]
    plane = np.concatenate([p for _c, p in planes]).tobytes()
    return build([coded(c, p) for c, p in planes]), plane


@pytest.mark.parametrize(("codecs_of", "align"), [
    ((), UNIT),                     # good(): every codec, rANS in each mode
    ((RAW, BITPACK, BITPACK_W, RANS_ID), UNIT),
    ((RAW, BITPACK, BITPACK_W), 8),    # packed segments slice by 8 bytes, raw ones by 1
    ((BITPACK_W, RAW, BITPACK_W), 8),
    ((RAW, RAW), 1),
])
def test_slices_cross_segments_of_different_codecs(codecs_of: tuple[int, ...],
                                                   align: int) -> None:
    payload, plane = mixed(codecs_of) if codecs_of else good()
    s = CODEC.slicer(np.frombuffer(payload, np.uint8), len(plane), b"")
    assert s is not None and s.align == align
    for piece in (-(-999 // align) * align, -(-100_003 // align) * align):
        got = [s.get(lo, min(len(plane), lo + piece)) for lo in range(0, len(plane), piece)]
        assert np.concatenate(got).tobytes() == plane


def test_a_corrupt_segment_spoils_only_its_slices() -> None:
    plane = flat("unit_aligned")
    payload = as_array(CODEC.encode(plane).payload).copy()
    payload[-3] ^= 0x10  # inside the last segment's words
    s = CODEC.slicer(payload, plane.size, b"")
    got = [s.get(lo, min(plane.size, lo + UNIT)) for lo in range(0, plane.size, UNIT)]
    # the last segment holds pieces 4 and 5: only its slices may fail
    assert [g is None for g in got[:4]] == [False] * 4 and any(g is None for g in got[4:])
    assert got[0].tobytes() == plane[:UNIT].tobytes()


def test_no_slicer_for_a_broken_table_and_wide_blocks_decoded_whole() -> None:
    plane = flat("every_codec")
    payload = as_array(CODEC.encode(plane).payload)
    assert CODEC.slicer(payload, plane.size + 1, b"") is None
    assert CODEC.slicer(payload, plane.size, b"\x00") is None
    wide = RansCodec(log2_block=17)  # blocks of 2^17 do not start on every segment start
    payload = build([coded(RANS_ID, plane[:2 * UNIT], wide),
                     coded(BITPACK_W, plane[2 * UNIT:4 * UNIT]),
                     coded(RANS_ID, plane[4 * UNIT:], wide)])
    s = CODEC.slicer(np.frombuffer(payload, np.uint8), plane.size, b"")
    assert s is not None and s.align == 8
    got = [s.get(lo, min(plane.size, lo + 1000)) for lo in range(0, plane.size, 1000)]
    assert np.concatenate(got).tobytes() == plane.tobytes() == decode(payload, plane.size)
