"""Sweeps over damaged copies of a small valid file: every truncation, every single bit flip.

Every damaged copy must be refused with an S4Error (never another exception) and no damage may
go unnoticed: each flipped file fails to open, fails to read, or verify() lists a problem. The
file is about 2 KB, so the flip sweep is some 18,000 files; each is opened from memory.
"""

from __future__ import annotations

import functools

import pytest

import s4format
from conformance import craft
from s4format import (
    BadMagicError,
    ChecksumError,
    Reader,
    S4Error,
    TruncatedError,
    UnsupportedVersionError,
)
from s4format.schema import FOOTER_SIZE, HEADER_SIZE
from tests.format.common import small_file

BLOB = small_file()
INDEX_OFFSET = craft.parse(BLOB).footer["index_offset"]


def _outcome(blob: bytes) -> tuple[str, BaseException | list]:
    """Where damage is caught: ("open", error), ("read", error), ("verify", problems) or
    ("undetected", [])."""
    try:
        r = Reader(blob)
    except S4Error as exc:
        return "open", exc
    with r:
        try:
            for i in range(len(r.tensors)):
                r.read(i)
        except S4Error as exc:
            return "read", exc
        problems = s4format.verify(r)
    return ("verify", problems) if problems else ("undetected", [])


def test_the_undamaged_file_is_valid() -> None:
    assert 1500 < len(BLOB) < 4096
    assert _outcome(BLOB) == ("undetected", [])


def test_every_truncation_is_a_truncated_error() -> None:
    wrong = []
    for n in range(len(BLOB)):
        stage, error = _outcome(BLOB[:n])
        if stage != "open" or type(error) is not TruncatedError or "truncated" not in str(error):
            wrong.append((n, stage, repr(error)))
    assert wrong == []


def test_truncations_through_a_file(tmp_path) -> None:
    path = tmp_path / "cut.s4w"
    for n in [*range(0, 80), *range(80, len(BLOB), 61), len(BLOB) - 1]:
        path.write_bytes(BLOB[:n])
        with pytest.raises(TruncatedError, match=f"{path}: .*truncated"):
            Reader(path)


def test_every_cut_out_of_the_middle_is_refused() -> None:
    # The footer survives but the bytes before it were cut short (a partial copy that kept the
    # tail): the footer's index offset and length no longer fit the file.
    footer = BLOB[-FOOTER_SIZE:]
    wrong = []
    for n in range(len(BLOB) - FOOTER_SIZE):
        stage, error = _outcome(BLOB[:n] + footer)
        if stage != "open":
            wrong.append((n, stage, repr(error)))
    assert wrong == []


def _expected(byte: int) -> tuple[type[S4Error], str] | None:
    """The error a flip at ``byte`` must raise on opening (None: caught later)."""
    if byte < 8:
        return BadMagicError, "not a .s4w file"
    if byte < 10:
        return UnsupportedVersionError, "format version"
    if byte < HEADER_SIZE:
        return ChecksumError, "header checksum mismatch"
    if byte < INDEX_OFFSET:
        return None
    if byte < len(BLOB) - FOOTER_SIZE:
        return ChecksumError, "index checksum mismatch"
    if byte < len(BLOB) - 8:
        return ChecksumError, "footer checksum mismatch"
    return TruncatedError, "no footer"


def test_every_bit_flip_is_detected() -> None:
    r = Reader(BLOB)
    plane_at = {}
    for t in r.tensors:
        for p in t.planes:
            for b in range(p.offset, p.offset + p.stored_len):
                plane_at[b] = (t.name, p.label)
    wrong = []
    stages = {"open": 0, "read": 0, "verify": 0}
    for bit in range(8 * len(BLOB)):
        byte = bit // 8
        damaged = bytearray(BLOB)
        damaged[byte] ^= 1 << (bit % 8)
        stage, found = _outcome(bytes(damaged))
        if stage == "undetected":
            wrong.append((bit, "undetected"))
            continue
        stages[stage] += 1
        want = _expected(byte)
        if want is not None:
            cls, text = want
            if stage != "open" or type(found) is not cls or text not in str(found):
                wrong.append((bit, stage, repr(found)))
        elif byte in plane_at:
            # A damaged plane fails its checksum when read, naming tensor and plane.
            name, label = plane_at[byte]
            if stage != "read" or type(found) is not ChecksumError or \
                    f"tensor {name!r} plane {label}: checksum" not in str(found):
                wrong.append((bit, stage, repr(found)))
        elif stage != "verify" or [str(p) for p in found] != \
                [f"<buffer>: padding at {_gap(byte)} is not zero"]:
            wrong.append((bit, stage, found))
    assert wrong == []
    assert stages["open"] == 8 * (HEADER_SIZE + len(BLOB) - INDEX_OFFSET)
    assert stages["verify"] == 8 * (INDEX_OFFSET - HEADER_SIZE - len(plane_at))


def _gap(byte: int) -> str:
    """The padding run ``start..end`` holding ``byte``, as verify names it."""
    start = max(e for e in _spans()[0] if e <= byte)
    end = min(s for s in _spans()[1] if s > byte)
    return f"{start}..{end}"


@functools.cache
def _spans() -> tuple[list[int], list[int]]:
    r = Reader(BLOB)
    ends = sorted([HEADER_SIZE] + [p.offset + p.stored_len for t in r.tensors for p in t.planes])
    starts = sorted([p.offset for t in r.tensors for p in t.planes] + [r.data_end])
    return ends, starts
