"""Regression tests for bugs found in review: each test fails on the code before its fix."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import s4format
from conformance import craft
from s4format import (
    ChecksumError,
    CodecError,
    FormatError,
    Reader,
    S4Error,
    StorageError,
    UnsupportedVersionError,
    codecs,
)
from s4format.schema import HEADER_SIZE, MAGIC
from s4format.source import FileSource
from tests.format.common import small_tree

BLOB = s4format.dumps(small_tree())
W, STEPS, MASK, EMB = range(4)  # the tensors of the small file, in index order


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_reader_closes_the_file_it_opened_when_the_open_fails(tmp_path: Path) -> None:
    path = tmp_path / "bad.s4w"
    path.write_bytes(MAGIC + b"\x02\x00" + bytes(100))  # major version 2
    before = _open_fds()
    held: list[S4Error] = []
    for _ in range(3):
        with pytest.raises(UnsupportedVersionError) as info:
            Reader(path)
        held.append(info.value)  # the traceback keeps the half-built Reader alive
    assert _open_fds() == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_file_source_closes_its_descriptor_when_stat_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.s4w"
    path.write_bytes(b"x")

    def fstat(fd: int) -> os.stat_result:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fstat", fstat)
    before = _open_fds()
    with pytest.raises(StorageError, match=r"cannot stat .*x\.s4w: Input/output error"):
        FileSource(path)
    monkeypatch.undo()
    assert _open_fds() == before


def test_merge_and_overlap_errors_and_verify_gaps_name_the_file_and_tensor(
        tmp_path: Path) -> None:
    parts = craft.parse(BLOB)
    emb = parts.tensors[EMB]
    words = emb["planes"][2]["decoded_len"]
    # A raw mantissa plane whose bytes use the 8th bit, which bf16's 7-bit mantissa lacks.
    mantissa = np.full(words, 0x80, dtype=np.uint8).tobytes()
    parts.data += bytes(-(HEADER_SIZE + len(parts.data)) % 64) + mantissa
    emb["planes"][2].update(codec=codecs.RAW, params=b"", stored_len=words,
                            offset=HEADER_SIZE + len(parts.data) - words)
    craft.set_plane_bytes(parts, EMB, 2, mantissa)
    path = tmp_path / "merge.s4w"
    path.write_bytes(craft.build(parts))
    with Reader(path) as r:
        with pytest.raises(FormatError, match=rf"^{re.escape(str(path))}: tensor 'emb': "
                                              "mantissa0 plane holds values wider"):
            r.read("emb")
        # The old mantissa plane is now a hole in the data section that verify reports.
        gaps = [str(p) for p in s4format.verify(r) if p.tensor is None]
        assert gaps and all(g.startswith(f"{path}: ") for g in gaps), gaps

    parts = craft.parse(BLOB)
    parts.tensors[STEPS]["planes"][0]["offset"] = parts.tensors[W]["planes"][0]["offset"]
    path = tmp_path / "overlap.s4w"
    path.write_bytes(craft.build(parts))
    with pytest.raises(FormatError, match=rf"^{re.escape(str(path))}: plane model\.steps/raw "):
        Reader(path)


def test_codec_errors_name_the_file_tensor_and_plane(tmp_path: Path) -> None:
    parts = craft.parse(BLOB)
    parts.tensors[W]["planes"][0]["params"] = b"\x01"
    path = tmp_path / "params.s4w"
    path.write_bytes(craft.build(parts))
    want = rf"^{re.escape(str(path))}: tensor 'model\.w' plane raw: raw takes no parameters"
    with Reader(path) as r:
        with pytest.raises(CodecError, match=want):
            r.read("model.w")
        assert [re.match(want, str(p)) is not None for p in s4format.verify(r)] == [True]


def test_every_plane_checksum_is_checked_before_any_plane_is_decoded() -> None:
    # validation.md: R1 (checksums) comes before R2 (decoding), and the GPU decoder checks all
    # of a tensor's checksums first; the CPU reader must report the same first broken rule.
    parts = craft.parse(BLOB)
    sign, exponent = parts.tensors[EMB]["planes"][:2]
    sign["params"] = b"\x01\x02"  # no codec takes two parameter bytes: sign fails to decode
    blob = bytearray(craft.build(parts))
    blob[exponent["offset"]] ^= 0x01  # and the exponent plane fails its checksum
    with Reader(bytes(blob)) as r, pytest.raises(
            ChecksumError, match=r"tensor 'emb' plane exponent: checksum of the"):
        r.read("emb")
