"""A plane's stored bytes held as consecutive buffers, so a payload assembled from parts (a
codec-9 plane's segment table and its segments, coded apart) reaches the file without being
copied into one buffer first: the writer writes the parts in order and checksums them as one."""

from __future__ import annotations

import numpy as np


class Pieces:
    """Buffers whose concatenation is a plane's stored bytes (``nbytes`` in all)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts) -> None:
        self.parts = [memoryview(p if isinstance(p, bytes | bytearray) else
                                 np.ascontiguousarray(p)).cast("B") for p in parts]
        self.parts = [p for p in self.parts if len(p)]
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        return b"".join(self.parts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The bytes as one array (a copy: for readers of a payload, not the writer's path)."""
        if copy is False:
            raise ValueError("a payload in pieces has no single buffer to view")
        out = np.frombuffer(self.tobytes(), np.uint8)
        return out if dtype is None else out.astype(dtype)
