"""``Tensor``: a dtype, a shape and the raw bytes — the unit s4format reads and writes.

Raw bytes are the elements in C order, each little-endian, exactly as ``torch`` holds a
contiguous tensor on a little-endian machine. numpy arrays convert both ways; dtypes numpy lacks
(bfloat16, fp8, complex32) are views of unsigned integers of the same width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from s4format import dtypes
from s4format.dtypes import DType
from s4format.errors import FormatError


@dataclass(frozen=True, eq=False)
class Tensor:
    dtype: DType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, 1-D, C-contiguous

    def __post_init__(self) -> None:
        expected = math.prod(self.shape) * self.dtype.itemsize
        if self.data.dtype != np.uint8 or self.data.ndim != 1 or self.data.size != expected:
            raise FormatError(f"tensor data must be {expected} raw bytes (uint8, 1-D) for "
                              f"{self.dtype.name}{list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: str | None = None) -> Tensor:
        """Wrap a numpy array; ``dtype`` names the .s4w dtype when numpy's is only a stand-in
        (e.g. ``dtype="bfloat16"`` for a uint16 array of bf16 bits)."""
        dt = dtypes.by_name(dtype) if dtype else dtypes.from_numpy(array.dtype)
        if array.dtype.itemsize != dt.itemsize:
            raise FormatError(f"a {array.dtype} array cannot hold {dt.name} elements")
        arr = np.ascontiguousarray(array)
        if arr.dtype.byteorder == ">":
            arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
        return cls(dt, tuple(int(s) for s in array.shape), arr.reshape(-1).view(np.uint8))

    def to_numpy(self) -> np.ndarray:
        """The elements as a numpy array (bf16/fp8/complex32 as same-width unsigned ints)."""
        return self.data.view(np.dtype(self.dtype.numpy)).reshape(self.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.dtype.name}, shape={list(self.shape)})"
