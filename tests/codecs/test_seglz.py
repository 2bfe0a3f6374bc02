"""seg-lz (codec 10): codec 9's payload whose segments may also be zstd frames. Tested: a
reference decoder (test_ransseg's, each zstd segment decoded by the zstandard library first),
hand-built payloads with a segment of every codec decoded whole and in slices, codec 9's rules
kept under codec 10's name, codec 9 still refusing a zstd segment, the rules of a zstd segment
(content size, window, nothing after the frame), the writer's choice of codec 10 for a flat
buffer that repeats (stored size, a file's round trip and format 1.5, thread count) and of
codec 9 for one that does not, random segmentations and flipped bytes, and max_decoded_len."""

from __future__ import annotations

import io
import re
import struct
import time
from functools import cache

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format import Reader, Tensor, codecs, dtypes, layouts
from s4format.codecs import ransseg
from s4format.codecs.ransseg import RansSegCodec, SegLzCodec
from s4format.errors import CodecError
from s4format.writer import CodedPlane, CodedTensor, Writer, code_tensor
from tests.codecs.common import as_array
from tests.codecs.test_ransseg import (
    BITPACK,
    BITPACK_W,
    CODECS_TAKEN,
    DTYPES,
    KINDS,
    RANS_ID,
    RAW,
    UNIT,
    Segment,
    _with_threads,
    all_rule_cases,
    below,
    build,
    coded,
    exponents,
    flat_buffer,
    forms,
    ref_decode,
    ref_table,
    segment,
    with_record,
)
from tests.codecs.test_ransseg import decode as decode_9

CODEC = codecs.get(codecs.SEG_LZ)
SEG = codecs.get(codecs.RANS_SEG)
ZSTD = 3
LZ_TAKEN = "a segment takes raw (1), bitpack (2), zstd (3), rans (4) or bitpack-w (8)"
MAGIC = b"\x28\xb5\x2f\xfd"


# ---------------------------------------------------------------------------------------------
# The reference: test_ransseg's decoder, given each zstd segment already decoded by the
# zstandard library (RFC 8878) under codec 3's rules, as a raw segment.


def ref_zstd(stored: bytes, n: int) -> bytes:
    """A zstd segment of ``n`` symbols: one frame declaring ``n`` content bytes and a window
    of at most 2^27, nothing after it."""
    header = zstandard.get_frame_parameters(stored)
    assert header.content_size == n and header.window_size <= 1 << 27
    dec = zstandard.ZstdDecompressor().decompressobj()
    out = dec.decompress(stored)
    assert dec.eof and not dec.unused_data and len(out) == n
    return out


def ref_lz_decode(payload: bytes, decoded_len: int) -> bytes:
    """Decode a valid codec-10 payload (rules asserted: the reference for good payloads)."""
    table = ref_table(payload)
    at = 4 + 24 * len(table)
    as_9: list[Segment] = []
    for n, stored, codec, w, r1, r2 in table:
        body = payload[at:at + stored]
        at += stored
        if codec == ZSTD:
            assert (w, r1, r2) == (0, 0, 0)
            as_9.append((n, RAW, 0, ref_zstd(body, n)))
        else:
            assert (r1, r2) == (0, 0)
            as_9.append((n, codec, w, body))
    assert at == len(payload)
    return ref_decode(build(as_9), decoded_len)


def decode(payload: bytes, decoded_len: int, params: bytes = b"") -> bytes:
    return CODEC.decode(np.frombuffer(payload, np.uint8), decoded_len, params).tobytes()


def slices(codec, payload: bytes, n: int, piece: int) -> bytes:
    """The plane read back in pieces of ``piece`` symbols (rounded up to the slicer's
    alignment) through ``codec``'s slicer."""
    s = codec.slicer(np.frombuffer(payload, np.uint8), n, b"")
    piece = -(-piece // s.align) * s.align
    return np.concatenate([s.get(lo, min(n, lo + piece)) for lo in range(0, n, piece)]).tobytes()


# ---------------------------------------------------------------------------------------------
# Planes that repeat, where a zstd frame stores less than the order-0 bound


def sparse(n: int, seed: int) -> np.ndarray:
    """Zeros with one byte in a hundred random."""
    rng = np.random.default_rng(seed)
    plane = np.zeros(n, np.uint8)
    plane[rng.integers(0, n, n // 100)] = rng.integers(1, 256, n // 100, dtype=np.uint8)
    return plane


def zero_rows(n: int, seed: int) -> np.ndarray:
    """Rows of 256 bytes, each all zero or random 6-bit bytes (an unseen token's row)."""
    rng = np.random.default_rng(seed)
    plane = rng.integers(0, 64, n, dtype=np.uint8)
    zero = np.repeat(rng.random(-(-n // 256)) < 0.7, 256)[:n]
    plane[zero] = 0
    return plane


@cache
def good() -> tuple[bytes, bytes]:
    """A payload of seven segments, every codec a segment of codec 10 may take and zstd thrice
    (the last segment, partial, too), and the plane it decodes to."""
    planes = [(RANS_ID, exponents(UNIT, 0.02, 21)), (ZSTD, sparse(2 * UNIT, 22)),
              (RAW, below(UNIT, 256, 23)), (BITPACK, below(UNIT, 2, 24)),
              (ZSTD, zero_rows(UNIT, 25)), (BITPACK_W, below(UNIT, 16, 26)),
              (ZSTD, sparse(1001, 27))]
    payload = build([coded(c, p) for c, p in planes])
    assert forms(payload) == ["rans RANS", "zstd", "raw", "bitpack", "zstd", "bitpack-w 4",
                              "zstd"]
    return payload, np.concatenate([p for _c, p in planes]).tobytes()


K, BODY = 7, 4 + 24 * 7    # good()'s segment count and table size


# ---------------------------------------------------------------------------------------------
# The codec and hand-built payloads


def test_registered_as_codec_10_a_kind_of_codec_9() -> None:
    assert isinstance(CODEC, SegLzCodec) and isinstance(CODEC, RansSegCodec)
    assert (CODEC.codec_id, CODEC.name, codecs.name_of(10)) == (10, "seg-lz", "seg-lz")
    assert sorted(ransseg.LZ_SEGMENT_CODECS) == [RAW, BITPACK, ZSTD, RANS_ID, BITPACK_W]
    assert ZSTD not in ransseg.SEGMENT_CODECS


def test_a_payload_of_every_segment_codec_decodes_as_the_reference_does() -> None:
    payload, plane = good()
    assert ref_lz_decode(payload, len(plane)) == decode(payload, len(plane)) == plane


def lz_mixed(codecs_of: tuple[int, ...]) -> tuple[bytes, bytes]:
    """A payload of segments coded by ``codecs_of`` in turn, 65,536 symbols each but the last
    (1001), zstd ones of rows that repeat, and its plane."""
    makers = {RANS_ID: lambda n, s: exponents(n, 0.02, s), RAW: lambda n, s: below(n, 256, s),
              BITPACK_W: lambda n, s: below(n, 64, s), ZSTD: zero_rows}
    planes = [(c, makers[c](UNIT if i < len(codecs_of) - 1 else 1001, i))
              for i, c in enumerate(codecs_of)]
    return build([coded(c, p) for c, p in planes]), \
        np.concatenate([p for _c, p in planes]).tobytes()


def test_a_codec_9_payload_decodes_the_same_as_codec_10() -> None:
    # codec 10 adds a segment codec and changes nothing else
    payload, plane = lz_mixed((RANS_ID, RAW, BITPACK_W))
    assert decode(payload, len(plane)) == decode_9(payload, len(plane)) == plane


@pytest.mark.parametrize(("codecs_of", "align"), [
    ((), UNIT),                              # good(): every codec
    ((ZSTD, RAW, ZSTD), 1),                  # zstd segments are decoded whole: any piece
    ((BITPACK_W, ZSTD, BITPACK_W), 8),
    ((ZSTD, ZSTD), 1),
    ((RAW, ZSTD, RANS_ID, ZSTD), UNIT),
])
def test_slices_of_several_sizes_cross_zstd_segments(codecs_of: tuple[int, ...],
                                                     align: int) -> None:
    payload, plane = lz_mixed(codecs_of) if codecs_of else good()
    s = CODEC.slicer(np.frombuffer(payload, np.uint8), len(plane), b"")
    assert s is not None and s.align == align
    for piece in (999, UNIT - 1, 100_003, 3 * UNIT):
        assert slices(CODEC, payload, len(plane), piece) == plane, piece


def test_a_corrupt_zstd_segment_leaves_no_slicer_and_fails_by_name() -> None:
    payload, plane = good()
    table = ref_table(payload)
    bad = bytearray(payload)
    at = BODY + sum(r[1] for r in table[:4])      # segment 4, zstd: its block's first bytes
    bad[at + 12:at + 40] = b"\xff" * 28
    with pytest.raises(CodecError, match=f"^seg-lz segment 4 of {K} \\(zstd\\): zstd "):
        decode(bytes(bad), len(plane))
    assert CODEC.slicer(np.frombuffer(bytes(bad), np.uint8), len(plane), b"") is None


def test_a_file_with_a_small_plane_of_a_zstd_segment_round_trips() -> None:
    plane = np.arange(200, dtype=np.uint8) % 7
    payload = build([coded(ZSTD, plane)])
    coded_plane = CodedPlane(layouts.KIND_RAW, 0, codecs.SEG_LZ, plane.size, payload, b"")
    buf = io.BytesIO()
    w = Writer(buf)
    w.add_coded("t", dtypes.by_name("uint8"), (plane.size,),
                CodedTensor(layouts.RAW, (coded_plane,)), s4format.hashing.content_hash(plane))
    w.close()
    with Reader(buf.getvalue()) as r:
        assert r.tensors[0].planes[0].codec == codecs.SEG_LZ
        assert r.read_raw(0).tobytes() == plane.tobytes()


# ---------------------------------------------------------------------------------------------
# Which segment codecs each plane codec takes


def test_codec_9_refuses_a_zstd_segment_naming_codec_3() -> None:
    payload, plane = good()
    message = f"rans-seg segment 1 names codec 3; {CODECS_TAKEN}"
    with pytest.raises(CodecError, match=f"^{re.escape(message)}$"):
        decode_9(payload, len(plane))
    assert SEG.slicer(np.frombuffer(payload, np.uint8), len(plane), b"") is None


# 9 and 10 the segmented codecs themselves, 5 gdeflate, 6 nvcomp-ans, 0 and 7 unassigned, and
# 259 = 0x103 that a decoder reading one byte would take for zstd
@pytest.mark.parametrize("codec_id", [9, 10, 5, 6, 0, 7, 259, 0xFFFF])
def test_codec_10_refuses_a_segment_of_another_codec_listing_the_five(codec_id: int) -> None:
    payload, plane = good()
    bad = with_record(payload, 2, codec=codec_id)
    with pytest.raises(CodecError, match=f"^seg-lz segment 2 names codec {codec_id}; "
                                         f"{re.escape(LZ_TAKEN)}$"):
        decode(bad, len(plane))
    assert CODEC.slicer(np.frombuffer(bad, np.uint8), len(plane), b"") is None


def lz_rule_cases() -> dict[str, tuple[bytes, int, bytes, str]]:
    """test_ransseg's broken codec-9 payloads, refused by codec 10 in the same words but its
    name, the codecs it lists and, where the case names codec 3, what zstd finds."""
    cases = {}
    for case, (payload, n, params, message) in all_rule_cases().items():
        cases[case] = (payload, n, params, message.replace("rans-seg", "seg-lz")
                       .replace(CODECS_TAKEN, LZ_TAKEN))
    # a raw segment's bytes, read as a zstd frame, do not start with one
    payload, n, params, _message = cases["codec 3"]
    cases["codec 3"] = (payload, n, params, "seg-lz segment 3 of 8 (zstd): zstd plane does "
                                            "not start with a Zstandard frame")
    # (and with a plane one longer, the sums, checked before any segment, fail first)
    payload, n, params, _message = cases["codec 3 and the plane one longer"]
    cases["codec 3 and the plane one longer"] = (payload, n, params, f"seg-lz segments hold "
                                                                     f"{n - 1} symbols, plane "
                                                                     f"declares {n}")
    return cases


@pytest.mark.parametrize("case", sorted(lz_rule_cases()))
def test_codec_9s_rules_hold_under_codec_10s_name(case: str) -> None:
    payload, decoded_len, params, message = lz_rule_cases()[case]
    with pytest.raises(CodecError, match="^" + re.escape(message)):
        decode(payload, decoded_len, params)
    assert CODEC.slicer(np.frombuffer(payload, np.uint8), decoded_len, params) is None


# ---------------------------------------------------------------------------------------------
# A zstd segment's rules: those of a codec-3 plane of the segment's symbols


def frame(data: bytes | np.ndarray, write_content_size: bool = True) -> bytes:
    """One frame of ``data`` by the zstandard library."""
    return zstandard.ZstdCompressor(level=3, write_content_size=write_content_size).compress(
        bytes(data))


def rle_frame(n: int, window: int | None = None, declared: int | None = None) -> bytes:
    """A frame of one RLE block of ``n`` (<= 128 KiB) bytes 7, written by hand (RFC 8878
    3.1.1): single-segment, declaring ``declared`` (else ``n``) content bytes in its smallest
    field, or given ``window`` (a Window_Descriptor) that window and a 4-byte content size."""
    size = n if declared is None else declared
    if window is not None:
        head = bytes([0x80, window]) + struct.pack("<I", size)
    elif size < 256:
        head = bytes([0x20, size])
    elif size < 65792:
        head = b"\x60" + struct.pack("<H", size - 256)
    else:
        head = b"\xa0" + struct.pack("<I", size)
    return MAGIC + head + (1 | 1 << 1 | n << 3).to_bytes(3, "little") + b"\x07"


@cache
def three() -> tuple[list[Segment], bytes]:
    """Segments raw, zstd, zstd (the last of 1001 symbols) and the plane they hold."""
    planes = [(RAW, below(UNIT, 256, 31)), (ZSTD, sparse(UNIT, 32)), (ZSTD, sparse(1001, 33))]
    return [coded(c, p) for c, p in planes], np.concatenate([p for _c, p in planes]).tobytes()


def with_frame(i: int, stored: bytes) -> bytes:
    """three()'s payload with segment ``i``'s stored bytes replaced."""
    segments = list(three()[0])
    segments[i] = (*segments[i][:3], stored)
    return build(segments)


def zstd_cases() -> dict[str, tuple[bytes, int, str]]:
    """Broken zstd segments of three()'s payload: case -> (payload, the segment reported, the
    error's message after the segment's name)."""
    segments, plane = three()
    a, b = plane[UNIT:2 * UNIT], plane[2 * UNIT:]
    f1, f2 = segments[1][3], segments[2][3]
    moved = with_record(with_record(build(segments), 1, stored=len(f1) + 1), 2,
                        stored=len(f2) - 1)
    tail = frame(b[:5])
    return {
        "content one more": (with_frame(1, frame(a + b"\0")), 1,
                             f"zstd frame declares {UNIT + 1} content bytes, plane declares "
                             f"{UNIT}"),
        "the last's content one less": (with_frame(2, frame(b[:-1])), 2,
                                        "zstd frame declares 1000 content bytes, plane "
                                        "declares 1001"),
        "no content size": (with_frame(1, frame(a, write_content_size=False)), 1,
                            f"zstd frame declares -1 content bytes, plane declares {UNIT} (-1 "
                            "means the frame omits its size)"),
        "bytes after the frame": (with_frame(2, f2 + b"\0\0\0"), 2,
                                  "3 bytes follow the zstd frame"),
        # (the next segment, its magic's first byte gone, is broken too: the first is named)
        "a byte moved in from the next frame": (moved, 1, "1 bytes follow the zstd frame"),
        "a second frame after the first": (with_frame(2, frame(b) + tail), 2,
                                           f"{len(tail)} bytes follow the zstd frame"),
        "truncated by 2": (with_frame(1, f1[:-2]), 1, "zstd frame is truncated"),
        "the last truncated by 1": (with_frame(2, f2[:-1]), 2, "zstd frame is truncated"),
        "only the magic": (with_frame(2, MAGIC), 2, "zstd frame header is invalid"),
        "not a frame": (with_frame(1, a), 1, "zstd plane does not start with a Zstandard "
                                             "frame"),
        "a window of 2^27 + 2^24": (with_frame(1, rle_frame(UNIT, window=0x89)), 1,
                                    "zstd frame declares a window of 150994944 bytes, over "
                                    "the format's 134217728"),
        "a window of 2^31": (with_frame(2, rle_frame(1001, window=21 << 3)), 2,
                             "zstd frame declares a window of 2147483648 bytes, over the "
                             "format's 134217728"),
    }


@pytest.mark.parametrize("case", sorted(zstd_cases()))
def test_a_broken_zstd_segment_raises_naming_it(case: str) -> None:
    payload, i, message = zstd_cases()[case]
    n = len(three()[1])
    with pytest.raises(CodecError, match="^" + re.escape(f"seg-lz segment {i} of 3 (zstd): "
                                                         f"{message}")):
        decode(payload, n)
    assert CODEC.slicer(np.frombuffer(payload, np.uint8), n, b"") is None


def test_a_window_of_exactly_2_27_is_taken() -> None:
    plane = three()[1]
    payload = with_frame(1, rle_frame(UNIT, window=0x88))    # 2^(10 + 17), mantissa 0
    want = plane[:UNIT] + b"\x07" * UNIT + plane[2 * UNIT:]
    assert ref_lz_decode(payload, len(plane)) == decode(payload, len(plane)) == want
    assert slices(CODEC, payload, len(plane), 1000) == want


def test_a_segment_declaring_more_than_its_frame_can_hold_is_refused_before_decoding() -> None:
    # 2^27 + 65,536 symbols from an 11-byte frame: beyond codec 3's bound on its bytes, refused
    # from the records alone, before zstd would allocate what the frame declares
    n = (1 << 27) + UNIT
    frame = rle_frame(UNIT, declared=n)
    payload = build([(n, ZSTD, 0, frame)])
    start = time.perf_counter()
    with pytest.raises(CodecError, match="^" + re.escape(
            f"seg-lz segment 0 of 1 (zstd): declares {n} symbols from {len(frame)} stored "
            "bytes, beyond what zstd can produce")):
        decode(payload, n)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("params", [b"\x03", b"\x00", b"\x01\x02"])
def test_params_are_refused_even_zstds_level_byte(params: bytes) -> None:
    payload = build(three()[0])
    n = len(three()[1])
    with pytest.raises(CodecError, match=f"^seg-lz takes no parameters, got {len(params)} "
                                         "bytes$"):
        decode(payload, n, params)
    assert CODEC.slicer(np.frombuffer(payload, np.uint8), n, params) is None


def test_a_width_on_a_zstd_segment_is_refused() -> None:
    payload = with_record(build(three()[0]), 1, w=3)
    message = "seg-lz segment 1 sets a width (3) for a codec that takes none"
    with pytest.raises(CodecError, match=f"^{re.escape(message)}$"):
        decode(payload, len(three()[1]))


# ---------------------------------------------------------------------------------------------
# max_decoded_len


@pytest.mark.parametrize("n", [1, 200, 255, 65_791, 1 << 17])
def test_max_decoded_len_bounds_a_small_payload_of_a_library_frame(n: int) -> None:
    plane = np.zeros(n, np.uint8)
    payload = build([(n, ZSTD, 0, frame(plane))])
    assert decode(payload, n) == plane.tobytes()
    assert CODEC.max_decoded_len(len(payload)) >= n


# (a zstd frame of 10-12 bytes holds an RLE block of up to 65,791 symbols, over codec 9's
# bound for a payload that short: 8 symbols per byte below a rANS header)
@pytest.mark.parametrize("n", [255, 256, 65_791])
def test_max_decoded_len_bounds_a_small_payload_of_an_rle_frame(n: int) -> None:
    payload = build([(n, ZSTD, 0, rle_frame(n))])
    assert len(payload) <= 4 + 24 + 11
    assert decode(payload, n) == b"\x07" * n == ref_lz_decode(payload, n)
    assert CODEC.max_decoded_len(len(payload)) >= n


# ---------------------------------------------------------------------------------------------
# Random segmentations built by hand, zstd segments among them


def lz_segment(kind: str, n: int, seed: int) -> tuple[np.ndarray, Segment]:
    """test_ransseg's segments, and zstd ones of uniform bytes, bytes of 1 to 7 bits, sparse
    bytes or zero rows."""
    if not kind.startswith("zstd"):
        return segment(kind, n, seed)
    plane = {"zstd_bytes": lambda: below(n, 256, seed),
             "zstd_bits": lambda: below(n, 1 << (1 + seed % 7), seed),
             "zstd_sparse": lambda: sparse(n, seed),
             "zstd_rows": lambda: zero_rows(n, seed)}[kind]()
    return plane, coded(ZSTD, plane)


LZ_KINDS = KINDS | st.sampled_from(["zstd_bytes", "zstd_bits", "zstd_sparse", "zstd_rows"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=st.lists(st.tuples(LZ_KINDS, st.integers(1, 2), st.integers(0, 2**32)),
                     max_size=3),
       last=st.tuples(LZ_KINDS, st.integers(1, 2 * UNIT), st.integers(0, 2**32)),
       flip=st.tuples(st.integers(0, 2**32), st.integers(0, 7)))
def test_property_hand_built_segmentations_decode_and_a_flip_raises_or_decodes(
        head: list[tuple[str, int, int]], last: tuple[str, int, int],
        flip: tuple[int, int]) -> None:
    parts = [lz_segment(kind, units * UNIT, seed) for kind, units, seed in head]
    parts.append(lz_segment(*last))
    plane = np.concatenate([p for p, _ in parts]).tobytes()
    payload = build([s for _, s in parts])
    assert CODEC.max_decoded_len(len(payload)) >= len(plane)
    assert ref_lz_decode(payload, len(plane)) == decode(payload, len(plane)) == plane
    assert slices(CODEC, payload, len(plane), 300_000) == plane
    bad = bytearray(payload)
    bad[flip[0] % len(bad)] ^= 1 << flip[1]
    try:
        out = CODEC.decode(np.frombuffer(bytes(bad), np.uint8), len(plane), b"")
    except CodecError:
        return
    assert out.dtype == np.uint8 and out.shape == (len(plane),)


# ---------------------------------------------------------------------------------------------
# The writer: codec 10 where a flat buffer repeats, codec 9 where it does not


@cache
def moments() -> np.ndarray:
    """An fp32 flat buffer: 3 x 65,536 N(0, 0.02) weights, then an embedding's Adam moments
    as 6 x 65,536 values in rows of 256, 70% of the rows zero (tokens never seen)."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(3 * UNIT, dtype=np.float32) * np.float32(0.02)
    rows = rng.standard_normal((6 * UNIT // 256, 256), dtype=np.float32) * np.float32(1e-3)
    rows[rng.random(rows.shape[0]) < 0.7] = 0
    raw = np.concatenate([weights, rows.reshape(-1)]).astype("<f4").view(np.uint8)
    raw.flags.writeable = False
    return raw


def moments_state() -> dict[str, Tensor]:
    raw = moments()
    return {"flat": Tensor(dtypes.by_name("float32"), (raw.size // 4,), raw)}


def test_auto_takes_codec_10_where_a_flat_buffer_repeats() -> None:
    planes = code_tensor(moments(), dtypes.by_name("float32")).planes
    lz = [p for p in planes if p.codec == codecs.SEG_LZ]
    assert lz
    for p in lz:
        payload = as_array(p.payload).tobytes()
        # the cut falls where the weights end; zstd takes the moments, not the weights
        assert [r[0] for r in ref_table(payload)] == [3 * UNIT, 6 * UNIT]
        assert forms(payload)[0] != "zstd" and forms(payload)[1] == "zstd"
        assert ref_lz_decode(payload, p.decoded_len) == decode(payload, p.decoded_len)


def test_a_repeating_flat_buffer_round_trips_in_a_file_of_format_1_5_and_stores_less(
        monkeypatch) -> None:
    state = moments_state()
    blob = s4format.dumps(state)
    with Reader(blob) as r:
        assert r.version == (1, 5)
        planes = {(p.kind, p.index): p for p in r.tensors[0].planes}
        assert codecs.SEG_LZ in {p.codec for p in planes.values()}
        assert r.load()["flat"].data.tobytes() == moments().tobytes()
    codecs.get(codecs.SEG_LZ)   # loaded, so that removing it below sticks
    monkeypatch.delitem(codecs._REGISTRY, codecs.SEG_LZ)   # what a format 1.4 writer knows
    without = s4format.dumps(state)
    with Reader(without) as r:
        assert r.version == (1, 5)
        apart = {(p.kind, p.index): p for p in r.tensors[0].planes}
        assert r.load()["flat"].data.tobytes() == moments().tobytes()
    assert len(blob) < len(without)
    # each plane that took codec 10 stores less than the writer's best without it (codec 9
    # or one zstd frame of the whole plane)
    for key, p in planes.items():
        if p.codec == codecs.SEG_LZ:
            assert apart[key].codec != codecs.SEG_LZ
            assert p.stored_len < apart[key].stored_len, key


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_flat_buffer_of_gaussians_takes_codec_9_not_10(dtype: str) -> None:
    planes = code_tensor(flat_buffer(dtype), dtypes.by_name(dtype)).planes
    assert {p.codec for p in planes if p.kind == layouts.KIND_EXPONENT} == {codecs.RANS_SEG}
    assert codecs.SEG_LZ not in {p.codec for p in planes}


def test_coded_bytes_do_not_depend_on_the_thread_count(monkeypatch) -> None:
    out = []
    for n in (1, 2):
        _with_threads(monkeypatch, n)
        planes = [(p.codec, as_array(p.payload).tobytes())
                  for p in code_tensor(moments(), dtypes.by_name("float32")).planes]
        out.append((planes, s4format.dumps(moments_state())))
    assert out[0] == out[1]
    assert codecs.SEG_LZ in {cid for cid, _ in out[0][0]}
    with Reader(out[0][1]) as r:   # decoded on two threads, segments in parallel
        assert r.read_raw(0).tobytes() == moments().tobytes()


def test_seg_lz_is_not_tried_where_one_zstd_frame_stores_far_less(monkeypatch) -> None:
    # Sorted token IDs: their second byte climbs in long runs, which one zstd frame stores in
    # a thousandth of what rans-seg's segments take; seg-lz's trials there changed no byte.
    ids = np.sort(np.random.default_rng(0).integers(0, 50_000, 2_000_000)).astype("<i8")
    raw = ids.view(np.uint8)
    tried = []
    estimate = SegLzCodec.estimate_view
    monkeypatch.setattr(SegLzCodec, "estimate_view",
                        lambda self, view: tried.append(view.size) or estimate(self, view))
    planes = code_tensor(raw, dtypes.by_name("int64")).planes
    assert tried == []
    assert planes[1].codec == codecs.ZSTD
    assert planes[1].stored_len * 100 < ids.size
    # where the frame does not store far less, seg-lz is still tried (and taken)
    code_tensor(moments(), dtypes.by_name("float32"))
    assert tried
