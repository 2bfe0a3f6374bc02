"""Files that break two rules get the error of the rule the spec checks first (the verdicts
of 2026-12-01, spec/README.md): each test holds a file whose two rules two readers had
reported differently, and the class the spec now names."""

from __future__ import annotations

import struct

import pytest

from s4format.errors import FormatError, LimitError
from s4format.objtree import decode

DEEP = 300  # beyond the depth limit of 256 (rule O3)


def _exactly(cls: type[Exception], fn, *args) -> str:
    with pytest.raises(cls) as info:
        fn(*args)
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
