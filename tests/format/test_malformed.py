"""Each validation rule, exercised alone: the file is otherwise valid (``craft`` recomputes every
checksum and length), and the reader raises the specific S4Error subclass with a message that
says what is wrong and where."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import s4format
from conformance import craft
from s4format import (
    BadMagicError,
    ChecksumError,
    CodecError,
    FormatError,
    LimitError,
    Reader,
    TruncatedError,
    UnsupportedCodecError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
    codecs,
    objtree,
)
from s4format.schema import FOOTER_SIZE, HEADER_SIZE, MAGIC, MINOR
from tests.format.common import assert_same_tree, small_file, small_tree

BLOB = small_file()
W, STEPS, MASK, EMB = range(4)  # the tensors of the small file, in index order


def edited(change: Callable[[craft.Parts], object]) -> bytes:
    parts = craft.parse(BLOB)
    change(parts)
    return craft.build(parts)


def plane(parts: craft.Parts, tensor: int, k: int = 0) -> dict:
    return parts.tensors[tensor]["planes"][k]


def test_craft_rebuilds_the_file_unchanged() -> None:
    assert craft.build(craft.parse(BLOB)) == BLOB


# -- header ------------------------------------------------------------------------------------

@pytest.mark.parametrize("head", [b"PK\x03\x04" + bytes(60), b"hello", b"\x00" * 100,
                                  b"\x89PNG\r\n\x1a\n" + bytes(100)])
def test_bad_magic(head: bytes) -> None:
    with pytest.raises(BadMagicError, match=r"not a \.s4w file \(starts with"):
        Reader(head)


def test_damaged_magic() -> None:
    blob = bytearray(BLOB)
    blob[6] = 0x1B
    with pytest.raises(BadMagicError, match="its magic is damaged"):
        Reader(bytes(blob))


@pytest.mark.parametrize("damage", [
    lambda b: b.replace(b"\n", b"\r\n"),  # written or sent in text mode on Windows
    lambda b: b.replace(b"\r\n", b"\n"),  # CRLF converted back to LF
])
def test_text_mode_damage_is_named(damage) -> None:
    with pytest.raises(BadMagicError, match=r"text-mode damage .* transfer it in binary mode"):
        Reader(damage(BLOB))


@pytest.mark.parametrize("blob", [b"", MAGIC[:5], MAGIC + bytes(30)])
def test_too_short_for_header_and_footer(blob: bytes) -> None:
    with pytest.raises(TruncatedError, match=r"shorter than a header and footer .* truncated"):
        Reader(blob)


@pytest.mark.parametrize("major", [0, 2, 0xFFFF])
def test_unknown_major_version(major: int) -> None:
    def change(p: craft.Parts) -> None:
        p.header["major"] = major
    with pytest.raises(UnsupportedVersionError,
                       match=f"format version {major}.{MINOR}; this reader understands major "
                             "version 1 only — upgrade"):
        Reader(edited(change))


def test_newer_minor_version_is_read() -> None:
    def change(p: craft.Parts) -> None:
        p.header["minor"] = 9
    with Reader(edited(change)) as r:
        assert r.version == (1, 9)
        assert_same_tree(r.load(), small_tree())


def test_header_checksum() -> None:
    blob = bytearray(BLOB)
    blob[14] ^= 1  # an optional flag bit, under the header checksum
    with pytest.raises(ChecksumError, match=r"header checksum mismatch \(bytes 0\.\.31"):
        Reader(bytes(blob))


@pytest.mark.parametrize("bit", [0, 7, 31])
def test_unknown_must_understand_flag(bit: int) -> None:
    def change(p: craft.Parts) -> None:
        p.header["required_flags"] = 1 << bit
    with pytest.raises(UnsupportedFeatureError,
                       match=f"must-understand flags {1 << bit:#010x} are not known"):
        Reader(edited(change))


@pytest.mark.parametrize("flags", [1, 0x80000000, 0xFFFFFFFF])
def test_unknown_optional_flags_are_ignored(flags: int) -> None:
    def change(p: craft.Parts) -> None:
        p.header["optional_flags"] = flags
    with Reader(edited(change)) as r:
        assert r.header.optional_flags == flags
        assert_same_tree(r.load(), small_tree())
        assert s4format.verify(r) == []


def test_reserved_header_bytes() -> None:
    def change(p: craft.Parts) -> None:
        p.header["reserved"] = b"\x00\x01\x00"
    with pytest.raises(FormatError, match="reserved header bytes are not zero"):
        Reader(edited(change))


def test_alignment_beyond_limit() -> None:
    def change(p: craft.Parts) -> None:
        p.header["align_log2"] = 17
    with pytest.raises(LimitError, match=r"alignment 2\^17 exceeds 2\^16"):
        Reader(edited(change))


# -- footer ------------------------------------------------------------------------------------

def test_missing_footer() -> None:
    with pytest.raises(TruncatedError, match="no footer at the end of the file: truncated"):
        Reader(BLOB + b"\x00")


def test_footer_checksum() -> None:
    blob = bytearray(BLOB)
    blob[-FOOTER_SIZE] ^= 4
    with pytest.raises(ChecksumError, match="footer checksum mismatch"):
        Reader(bytes(blob))


def test_index_length_larger_than_the_file() -> None:
    with pytest.raises(LimitError, match=f"index of {10**6} bytes exceeds the limit of "
                                         f"{len(BLOB)}"):
        Reader(craft.with_footer(BLOB, index_length=10**6))


def test_index_length_beyond_2_to_63() -> None:
    with pytest.raises(LimitError, match="exceeds the limit"):
        Reader(craft.with_footer(BLOB, index_length=2**64 - 1))


def test_index_larger_than_the_readers_limit() -> None:
    length = craft.parse(BLOB).footer["index_length"]
    with pytest.raises(LimitError, match=f"index of {length} bytes exceeds the limit of 100"):
        Reader(BLOB, max_index_size=100)


@pytest.mark.parametrize("offset", [0, HEADER_SIZE - 1, 1000, 2**64 - 1])
def test_index_that_does_not_end_at_the_footer(offset: int) -> None:
    with pytest.raises(FormatError, match="does not end where the footer starts"):
        Reader(craft.with_footer(BLOB, index_offset=offset))


def test_index_checksum() -> None:
    parts = craft.parse(BLOB)
    blob = bytearray(BLOB)
    blob[parts.footer["index_offset"] + 10] ^= 0x20
    with pytest.raises(ChecksumError, match="index checksum mismatch"):
        Reader(bytes(blob))


# -- index structure ---------------------------------------------------------------------------

def _with_index(index: bytes) -> bytes:
    return craft.build(craft.parse(BLOB), index=index)


@pytest.mark.parametrize("index", [b"", b"S4IX", b"XXXX" + bytes(40), b"S4IX\xff\xff\xff\xff"])
def test_malformed_index(index: bytes) -> None:
    with pytest.raises(FormatError, match="malformed index"):
        Reader(_with_index(index))


def test_trailing_bytes_after_the_index() -> None:
    with pytest.raises(FormatError, match="malformed index"):
        Reader(_with_index(craft.index_bytes(craft.parse(BLOB).index) + b"\x00"))


def test_tensor_name_that_is_not_utf8() -> None:
    parts = craft.parse(BLOB)
    index = craft.index_bytes(parts.index)
    name = parts.tensors[W]["name"].encode()
    bad = index.replace(struct.pack("<H", len(name)) + name,
                        struct.pack("<H", len(name)) + b"\xff" * len(name), 1)
    assert bad != index
    with pytest.raises(FormatError, match="malformed index"):
        Reader(_with_index(bad))


def test_unknown_codec_id() -> None:
    def change(p: craft.Parts) -> None:
        plane(p, W)["codec"] = 999
    with pytest.raises(UnsupportedCodecError,
                       match=r"tensor 0 'model\.w' plane raw: unknown codec ID 999; this reader"):
        Reader(edited(change))


def test_registered_codec_that_is_not_installed() -> None:
    if codecs.NVCOMP_ANS in codecs.available():
        pytest.skip("nvcomp-ans is installed here")

    def change(p: craft.Parts) -> None:
        plane(p, W)["codec"] = codecs.NVCOMP_ANS
    with pytest.raises(UnsupportedCodecError,
                       match=r"'model\.w' plane raw: codec 'nvcomp-ans' \(ID 6\) is not "
                             "available in this installation"):
        Reader(edited(change))


@pytest.mark.parametrize("layout", [5, 200])
def test_unknown_layout(layout: int) -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["layout"] = layout
    with pytest.raises(UnsupportedFeatureError,
                       match=f"tensor 0 'model.w': unknown plane layout ID {layout}"):
        Reader(edited(change))


@pytest.mark.parametrize("code", [0, 23, 255])
def test_unknown_dtype_code(code: int) -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["dtype"] = code
    with pytest.raises(UnsupportedFeatureError,
                       match=f"tensor 0 'model.w': unknown dtype code {code}; this reader knows"):
        Reader(edited(change))


@pytest.mark.parametrize("transform", [2, 255])
def test_unknown_transform(transform: int) -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["transform"] = transform
    with pytest.raises(UnsupportedFeatureError,
                       match=f"tensor 0 'model.w': unknown transform {transform}"):
        Reader(edited(change))


def test_reserved_tensor_flags() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["flags"] = 0x40
    with pytest.raises(UnsupportedFeatureError, match="reserved tensor flags 0x40 are set"):
        Reader(edited(change))


def test_too_many_dimensions() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["ndim"] = 65
        p.tensors[W]["shape"] = [48] + [1] * 64
    with pytest.raises(LimitError, match="65 dimensions, the limit is 64"):
        Reader(edited(change))


def test_raw_nbytes_disagrees_with_shape() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["shape"] = [47]
    with pytest.raises(FormatError, match=r"raw_nbytes 192 != 188 for float32\[47\]"):
        Reader(edited(change))


def test_layout_whose_words_do_not_divide_the_tensor() -> None:
    def change(p: craft.Parts) -> None:
        t = p.tensors[MASK]  # 37 one-byte bools
        t["layout"] = 1
    with pytest.raises(FormatError, match=r"tensor 2 'model\.mask': layout bf16 needs whole 2-byte "
                                          "words, raw length 37 is not a multiple"):
        Reader(edited(change))


def test_plane_count_disagrees_with_layout() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["layout"] = 3  # fp32 layout takes five planes
    with pytest.raises(FormatError, match="layout fp32 has 5 planes, record lists 1"):
        Reader(edited(change))


def test_plane_kind_disagrees_with_layout() -> None:
    def change(p: craft.Parts) -> None:
        plane(p, EMB, 1)["kind"] = 3
    with pytest.raises(FormatError, match="layout bf16 expects plane exponent here"):
        Reader(edited(change))


def test_overlapping_planes() -> None:
    def change(p: craft.Parts) -> None:
        plane(p, STEPS)["offset"] = plane(p, W)["offset"]
    with pytest.raises(FormatError, match=r"plane model\.steps/raw \(bytes 64\.\.132\) overlaps "
                                          r"plane model\.w/raw starting at 64"):
        Reader(edited(change))


def test_plane_offset_past_the_data_section() -> None:
    parts = craft.parse(BLOB)
    data_end = parts.footer["index_offset"]
    beyond = data_end + (-data_end % 64) + 64

    def change(p: craft.Parts) -> None:
        plane(p, W)["offset"] = beyond
    with pytest.raises(FormatError, match=f"bytes {beyond}..{beyond + 192} run past the data "
                                          f"section, which ends at {data_end}"):
        Reader(edited(change))


def test_plane_running_into_the_index() -> None:
    def change(p: craft.Parts) -> None:
        plane(p, EMB, 2)["stored_len"] += 64
    with pytest.raises(FormatError, match="run past the data section"):
        Reader(edited(change))


@pytest.mark.parametrize("offset", [65, 96, 0])
def test_unaligned_or_header_plane_offset(offset: int) -> None:
    def change(p: craft.Parts) -> None:
        plane(p, W)["offset"] = offset
    with pytest.raises(FormatError, match=f"offset {offset} is not an aligned offset in the data "
                                          r"section \(alignment 64\)"):
        Reader(edited(change))


def test_declared_alignment_the_planes_do_not_keep() -> None:
    def change(p: craft.Parts) -> None:
        p.header["align_log2"] = 12
    with pytest.raises(FormatError, match=r"is not an aligned offset .* \(alignment 4096\)"):
        Reader(edited(change))


def test_duplicate_tensor_names() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[MASK]["name"] = p.tensors[W]["name"]
    with pytest.raises(FormatError, match=r"tensor name 'model\.w' appears twice"):
        Reader(edited(change))


def test_delta_record_in_a_file_without_parent() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["transform"] = 1
        p.tensors[W]["parent_hash"] = bytes(16)
    with pytest.raises(FormatError, match="delta tensors but no parent checkpoint ID"):
        Reader(edited(change))


def test_must_understand_extension() -> None:
    def change(p: craft.Parts) -> None:
        p.index["extensions"] = [dict(tag="future", required=1, data=b"x")]
    with pytest.raises(UnsupportedFeatureError,
                       match="must-understand index extension 'future' is unknown"):
        Reader(edited(change))


def test_optional_extension_is_ignored() -> None:
    def change(p: craft.Parts) -> None:
        p.index["extensions"] = [dict(tag="notes", required=0, data=b"anything")]
    with Reader(edited(change)) as r:
        assert_same_tree(r.load(), small_tree())


@pytest.mark.parametrize("metadata", [[1, 2], {"epoch": 3}, {1: "x"}])
def test_metadata_that_is_not_str_to_str(metadata) -> None:
    def change(p: craft.Parts) -> None:
        p.index["metadata"] = objtree.encode(metadata)
    with pytest.raises(FormatError, match="metadata must be a dict of str to str"):
        Reader(edited(change))


# -- huge declared sizes: refused before anything is allocated --------------------------------

def _peak_while(fn: Callable[[], object]) -> tuple[BaseException, int]:
    tracemalloc.start()
    try:
        fn()
    except s4format.S4Error as exc:
        error = exc
    else:
        raise AssertionError("no S4Error raised")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return error, peak


@pytest.mark.parametrize("size", [2**63, 2**62])
def test_huge_consistent_size_is_a_limit_error_without_allocating(size: int) -> None:
    # Shape, raw_nbytes and the plane's decoded length all agree on `size` bytes. 2^63 is over
    # the 2^62 raw-size limit; 2^62 is at it, and then fails the codec's bound: a raw plane of
    # 192 stored bytes cannot decode to 2^62.
    def change(p: craft.Parts) -> None:
        t = p.tensors[W]
        t["dtype"], t["shape"], t["raw_nbytes"] = 2, [size], size
        plane(p, W)["decoded_len"] = size
    blob = edited(change)
    error, peak = _peak_while(lambda: Reader(blob))
    assert type(error) is LimitError
    if size > 2**62:
        assert f"raw size {size} exceeds 2^62 bytes" in str(error)
    else:
        assert f"declares {size} decoded bytes from 192 stored, beyond what codec raw" in \
            str(error)
    assert peak < 4 << 20


@pytest.mark.parametrize("size", [2**63, 2**62])
def test_huge_decoded_length_alone_is_a_format_error(size: int) -> None:
    # Only the plane's decoded length is huge: the rule that a plane's decoded length is what
    # its layout needs (here the tensor's 192 raw bytes) fires before the codec bound.
    def change(p: craft.Parts) -> None:
        plane(p, W)["decoded_len"] = size
    blob = edited(change)
    error, peak = _peak_while(lambda: Reader(blob))
    assert type(error) is FormatError
    assert f"decoded length {size}, layout needs 192" in str(error)
    assert peak < 4 << 20


def test_huge_shape_product_is_a_limit_error() -> None:
    def change(p: craft.Parts) -> None:
        p.tensors[W]["ndim"], p.tensors[W]["shape"] = 4, [2**64 - 1] * 4
    with pytest.raises(LimitError, match="exceeds 2\\^62 bytes"):
        Reader(edited(change))


def test_zstd_frame_that_declares_less_than_the_plane() -> None:
    # Within the codec's bound, but the frame's own content size disagrees: refused before
    # decompressing, and the reader allocates nothing near the declared size.
    def change(p: craft.Parts) -> None:
        t = p.tensors[STEPS]
        t["shape"], t["raw_nbytes"] = [250_000], 2_000_000
        plane(p, STEPS)["decoded_len"] = 2_000_000
    with Reader(edited(change)) as r:
        assert r.tensors[STEPS].planes[0].codec == codecs.ZSTD
        error, peak = _peak_while(lambda: r.read(STEPS))
    assert type(error) is CodecError
    assert "zstd frame declares 320 content bytes, plane declares 2000000" in str(error)
    assert peak < 1 << 20


# -- payloads with valid checksums but invalid contents ----------------------------------------

def test_raw_plane_with_parameters() -> None:
    parts = craft.parse(BLOB)
    plane(parts, W)["params"] = b"\x01"
    with Reader(craft.build(parts)) as r:
        with pytest.raises(CodecError, match="raw takes no parameters, got 1 bytes"):
            r.read(W)
        problems = s4format.verify(r)
    assert [(p.tensor, p.plane) for p in problems] == [("model.w", "raw")]


def test_split_plane_with_bits_outside_its_field() -> None:
    parts = craft.parse(BLOB)
    words = plane(parts, EMB, 2)["decoded_len"]
    # A raw mantissa plane whose bytes use the 8th bit, which bf16's 7-bit mantissa lacks.
    mantissa = np.full(words, 0x80, dtype=np.uint8).tobytes()
    parts.data += bytes(-(HEADER_SIZE + len(parts.data)) % 64) + mantissa
    plane(parts, EMB, 2).update(codec=codecs.RAW, params=b"", stored_len=words,
                                offset=HEADER_SIZE + len(parts.data) - words)
    craft.set_plane_bytes(parts, EMB, 2, mantissa)
    with Reader(craft.build(parts)) as r, \
            pytest.raises(FormatError, match="mantissa0 plane holds values wider than its 7 bits"):
        r.read("emb")


def test_plane_checksum_names_tensor_plane_and_offset() -> None:
    parts = craft.parse(BLOB)
    p = plane(parts, EMB, 1)
    blob = bytearray(BLOB)
    blob[p["offset"] + 3] ^= 0x01
    with Reader(bytes(blob)) as r:
        with pytest.raises(ChecksumError, match=f"tensor 'emb' plane exponent: checksum of the "
                                                f"{p['stored_len']} stored bytes at offset "
                                                f"{p['offset']} mismatch"):
            r.read("emb")
        assert r.read("model.w").data.tobytes() == small_tree()["model"]["w"].tobytes()


def test_nonzero_padding_is_reported_by_verify_only() -> None:
    blob = bytearray(BLOB)
    blob[HEADER_SIZE + 5] = 0xAA  # padding between the header and the first plane
    with Reader(bytes(blob)) as r:
        assert_same_tree(r.load(), small_tree())
        problems = s4format.verify(r)
    assert [str(p) for p in problems] == [f"<buffer>: padding at {HEADER_SIZE}..64 is not zero"]


def test_a_damaged_tree_error_names_the_file() -> None:
    root = Path(__file__).parents[2] / "conformance" / "v1"
    for name, part, error in (("tree_bad_utf8.s4w", "object tree", FormatError),
                              ("tree_depth_257.s4w", "object tree", LimitError),
                              ("metadata_tensor_ref.s4w", "metadata", FormatError)):
        with pytest.raises(error, match=rf"{name}: {part}: "):
            Reader(root / name)
