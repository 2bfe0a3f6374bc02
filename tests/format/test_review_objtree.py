"""Regression tests for object-tree bugs found in review."""

from __future__ import annotations

import struct

import pytest

from s4format import FormatError, objtree

HUGE = 10**5000  # its repr exceeds Python's 4300-digit int-to-str limit (ValueError)


def _big(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x04" + struct.pack("<I", len(raw)) + raw


def test_a_huge_int_dict_key_is_encoded_and_decoded() -> None:
    tree = {HUGE: [1, 2], -HUGE: {"x": None}}
    assert objtree.decode(objtree.encode(tree), 0) == tree


def test_a_duplicate_huge_int_key_is_a_format_error() -> None:
    node = _big(HUGE)
    data = b"\x0a" + struct.pack("<I", 2) + node + b"\x00" + node + b"\x00"
    with pytest.raises(FormatError, match=r"duplicate dict key <int too large to show> at tree "
                                          r"offset 0"):
        objtree.decode(data, 0)
