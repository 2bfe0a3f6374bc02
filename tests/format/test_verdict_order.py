"""Files that break two rules get the error of the rule the spec checks first (the verdicts
of 2026-12-01, spec/README.md): each test holds a file whose two rules two readers had
reported differently, and the class the spec now names."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from conformance import craft
from s4format import Reader, cli, codecs
from s4format.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    FormatError,
    LimitError,
    ParentMismatchError,
)
from s4format.objtree import decode

V1 = Path(__file__).resolve().parents[2] / "conformance" / "v1"

DEEP = 300  # beyond the depth limit of 256 (rule O3)


def _exactly(cls: type[Exception], fn, *args, **kwargs) -> str:
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    return str(info.value)


def _nested(tag: bytes, depth: int) -> bytes:
    """``depth`` containers of ``tag`` (list 08 or tuple 09), each holding the next, around
    None."""
    return (tag + struct.pack("<I", 1)) * depth + b"\x00"


def _dict_with_key(key: bytes) -> bytes:
    return b"\x0a" + struct.pack("<I", 1) + key + b"\x00"


@pytest.mark.parametrize(("key", "at", "what"), [
    (_nested(b"\x08", DEEP), 5, "a list"),
    (b"\x09\x01\x00\x00\x00" + _nested(b"\x08", DEEP), 10, "a list"),
    (b"\x0c\x03\x00abc" + _nested(b"\x08", DEEP), 5, "a typed value"),
    (b"\x0d" + struct.pack("<I", 0), 5, "an ordered dict"),
], ids=["list", "list-in-tuple", "typed", "odict"])
def test_a_forbidden_key_is_refused_at_its_tag(key: bytes, at: int, what: str) -> None:
    """O7 at the key's tag: a key nested 300 deep is a FormatError, not the LimitError of
    decoding it first (O3 applies only to what may be decoded)."""
    message = _exactly(FormatError, decode, _dict_with_key(key), 0)
    assert f"{what} at tree offset {at} in a dict key" in message


def test_depth_still_bounds_a_key_of_nested_tuples() -> None:
    message = _exactly(LimitError, decode, _dict_with_key(_nested(b"\x09", DEEP)), 0)
    assert "nested deeper than 256" in message


def test_a_key_of_tuples_within_the_depth_limit_decodes() -> None:
    assert decode(_dict_with_key(_nested(b"\x09", 255)), 0) is not None


# -- a parent given (rules A) and a delta read (R5) --------------------------------------------

def _delta_files() -> tuple[bytes, bytes]:
    return (V1 / "delta_base.s4w").read_bytes(), (V1 / "delta_child.s4w").read_bytes()


def _damaged_plane(blob: bytes, tensor: int, plane: int) -> bytes:
    """``blob`` with a stored byte of one plane flipped, its checksum left as it was."""
    parts = craft.parse(blob)
    at = parts.tensors[tensor]["planes"][plane]["offset"]
    return blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:]


GARBAGE = b"not an .s4w file, " * 8


def test_the_child_is_checked_before_its_parent_is_opened() -> None:
    """A damaged child header with a garbage parent: the child's H4 (ChecksumError), not the
    parent's H1 (BadMagicError) of opening the parent first."""
    _base, child = _delta_files()
    bad_header = child[:20] + bytes([child[20] ^ 1]) + child[21:]
    _exactly(ChecksumError, Reader, bad_header, parent=GARBAGE)


def test_a_garbage_parent_is_refused_with_its_own_error() -> None:
    _base, child = _delta_files()
    assert "not a .s4w file" in _exactly(BadMagicError, Reader, child, parent=GARBAGE)


def test_a1_is_checked_before_the_parent_is_opened() -> None:
    base, _child = _delta_files()
    _exactly(ParentMismatchError, Reader, base, parent=GARBAGE)


def test_a_delta_without_its_parent_is_refused_before_its_planes_are_read() -> None:
    """R5's parent tensor is looked up before R1: a delta with a damaged plane read without its
    parent, or with a parent that lacks its tensor, is a ParentMismatchError."""
    base, child = _delta_files()
    damaged = _damaged_plane(child, 0, 1)
    with Reader(damaged) as r:
        assert "open the file with its parent" in _exactly(ParentMismatchError, r.read_raw, 0)
    other = (V1 / "delta_other_base.s4w").read_bytes()
    unknown = craft.parse(damaged)
    unknown.tensors[0]["parent_hash"] = bytes(16)
    with Reader(craft.build(unknown), parent=base) as r:
        assert "holds no tensor with hash" in _exactly(ParentMismatchError, r.read_raw, 0)
    # with its parent, the damaged plane is what is wrong
    with Reader(damaged, parent=base) as r:
        _exactly(ChecksumError, r.read_raw, 0)
    _exactly(ParentMismatchError, Reader, damaged, parent=other)


def test_an_opened_parent_is_closed_with_its_child(tmp_path: Path) -> None:
    base, child = _delta_files()
    (tmp_path / "base.s4w").write_bytes(base)
    with Reader(child, parent=tmp_path / "base.s4w") as r:
        parent = r.parent
        assert r.read_raw(0).size == 8192
    assert parent.source._fd == -1  # the file descriptor it opened is closed


# -- R3: a plane of another length is its codec's error ----------------------------------------

def test_a_plane_decoded_to_another_length_is_a_codec_error(monkeypatch) -> None:
    """R3 names CodecError, as codecs.md's "exactly decoded_len bytes or CodecError" does: a
    codec whose decoder returns a short plane (here raw's, made to drop a byte) is reported
    as that codec's error, not FormatError."""
    raw = codecs.get(codecs.RAW)
    decode = raw.decode
    monkeypatch.setattr(raw, "decode", lambda payload, n, params: decode(payload, n, params)[1:])
    with Reader(V1 / "appendix_a.s4w") as r:
        message = _exactly(CodecError, r.read_raw, 0)
    assert "plane raw decoded to 7 bytes, declared 8" in message


def test_verify_opens_the_parent_after_the_file(tmp_path: Path, capsys) -> None:
    """``verify FILE --parent P``: FILE's own rules first (it opened P first, so a garbage P
    hid a damaged FILE)."""
    _base, child = _delta_files()
    (tmp_path / "child.s4w").write_bytes(child[:20] + bytes([child[20] ^ 1]) + child[21:])
    (tmp_path / "garbage.s4w").write_bytes(GARBAGE)
    status = cli.main(["verify", str(tmp_path / "child.s4w"), "--parent",
                       str(tmp_path / "garbage.s4w")])
    assert status == 2
    assert "header checksum mismatch" in capsys.readouterr().err
