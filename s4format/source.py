"""Byte sources a reader takes: random access by offset, so a reader fetches the header, the
footer, the index and then only the planes it needs (local files with ``pread``, in-memory
buffers here; S3 ranged GETs in ``s4weights.store``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from s4format.errors import StorageError, TruncatedError


def check_range(name: str, offset: int, length: int, size: int) -> None:
    """TruncatedError unless ``length`` bytes at ``offset`` lie inside a source of ``size``."""
    if offset < 0 or length < 0 or offset + length > size:
        raise TruncatedError(f"{name}: read of {length} bytes at offset {offset} runs past the "
                             f"end ({size} bytes)")


@runtime_checkable
class ByteSource(Protocol):
    name: str

    def size(self) -> int: ...

    def read_at(self, offset: int, length: int) -> np.ndarray:
        """Exactly ``length`` bytes from ``offset`` as a uint8 array, or TruncatedError."""
        ...


class BufferSource:
    def __init__(self, data: bytes | bytearray | memoryview | np.ndarray,
                 name: str = "<buffer>") -> None:
        self._data = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) \
            else data.reshape(-1).view(np.uint8)
        self.name = name

    def size(self) -> int:
        return int(self._data.size)

    def read_at(self, offset: int, length: int) -> np.ndarray:
        check_range(self.name, offset, length, int(self._data.size))
        return self._data[offset:offset + length]

    def close(self) -> None:
        pass


class FileSource:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.name = str(path)
        self._fd = -1  # so close() from __del__ works when the open below fails
        try:
            # non-blocking: opening a FIFO with no writer would wait for one forever
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0)
                               | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise StorageError(f"cannot open {self.name}: {exc.strerror}") from exc
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            self.close()
            raise StorageError(f"cannot stat {self.name}: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise StorageError(f"{self.name} is not a regular file (a reader needs random "
                               "access: read a pipe or device into memory and pass the bytes)")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(self._fd, True)  # what it was opened for is done
        self._size = st.st_size

    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, length: int) -> np.ndarray:
        check_range(self.name, offset, length, self._size)
        return self.read_into(offset, np.empty(length, dtype=np.uint8))

    def read_into(self, offset: int, buf: np.ndarray) -> np.ndarray:
        """Fill ``buf`` (writable, contiguous uint8) with the bytes at ``offset``; ``buf``."""
        length = buf.size
        check_range(self.name, offset, length, self._size)
        done = 0
        while done < length:
            try:
                n = os.preadv(self._fd, [memoryview(buf)[done:]], offset + done)
            except OSError as exc:
                raise StorageError(f"{self.name}: read failed at {offset + done}: {exc}") from exc
            if n == 0:
                raise TruncatedError(f"{self.name}: file shrank while reading at {offset + done}")
            done += n
        return buf

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


def open_source(src: str | os.PathLike[str] | bytes | bytearray | memoryview | ByteSource
                ) -> ByteSource:
    if isinstance(src, (FileSource, BufferSource)):
        return src  # (a store's: checked first, as the protocol's check below costs ~16 us)
    if isinstance(src, (str, Path, os.PathLike)):
        return FileSource(src)
    if isinstance(src, (bytes, bytearray, memoryview, np.ndarray)):
        return BufferSource(src)
    if isinstance(src, ByteSource):
        return src
    raise TypeError(f"cannot read .s4w from {type(src).__name__}")
