"""Byte sources: files and buffers, exact reads or TruncatedError/StorageError."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from s4format import Reader, StorageError, TruncatedError
from s4format.source import BufferSource, FileSource, open_source
from tests.format.common import small_file


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_missing_file_is_a_storage_error_and_nothing_else(tmp_path) -> None:
    path = tmp_path / "absent.s4w"
    with pytest.raises(StorageError, match=f"cannot open {path}: No such file or directory"):
        Reader(path)
    gc.collect()  # the half-built source's __del__ must not fail either


def test_directory_is_a_storage_error(tmp_path) -> None:
    with pytest.raises(StorageError, match=f"{tmp_path} is not a regular file"):
        Reader(tmp_path)


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path) -> None:
    # opening a FIFO with no writer blocks, unless non-blocking
    fifo = tmp_path / "f.s4w"
    os.mkfifo(fifo)
    with pytest.raises(StorageError, match=r"is not a regular file .* read a pipe"):
        Reader(fifo)


@pytest.mark.parametrize("make", [lambda b, p: BufferSource(b), lambda b, p: FileSource(p)])
def test_reads_are_exact_or_truncated(tmp_path, make) -> None:
    data = bytes(range(200))
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    src = make(data, path)
    assert src.size() == 200
    assert src.read_at(10, 5).tobytes() == data[10:15]
    assert src.read_at(200, 0).tobytes() == b""
    for offset, length in ((195, 6), (201, 0), (-1, 2), (0, -1)):
        with pytest.raises(TruncatedError, match=f"read of {length} bytes at offset {offset} "
                                                 "runs past the end"):
            src.read_at(offset, length)
    src.close()


def test_buffer_source_takes_numpy_and_memoryview() -> None:
    blob = small_file()
    for source in (np.frombuffer(blob, np.uint8), memoryview(blob), bytearray(blob)):
        with Reader(source) as r:
            assert len(r.tensors) == 4


def test_unknown_source_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"cannot read \.s4w from int"):
        open_source(3)
