"""Regression tests for bugs found in review: each test fails on the code before its fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from s4format import Reader, S4Error, StorageError, UnsupportedVersionError
from s4format.schema import MAGIC
from s4format.source import FileSource


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
