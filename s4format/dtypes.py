"""The dtype table of .s4w v1 (``spec/format.md``, "Dtypes"): codes, names, item sizes.

Codes are registered in the spec and never reused. Names are PyTorch's dtype names without the
``torch.`` prefix, so the torch layer maps them with ``getattr(torch, name)``. ``numpy`` gives the
numpy dtype a tensor's raw bytes can be viewed as (little-endian); dtypes numpy lacks (bfloat16,
the fp8 family, complex32) view as unsigned integers of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from s4format.errors import FormatError, UnsupportedFeatureError


@dataclass(frozen=True)
class DType:
    code: int
    name: str
    itemsize: int
    numpy: str
    kind: str  # "float", "int", "uint", "bool", "complex"


_TABLE = (
    DType(1, "bool", 1, "|b1", "bool"),
    DType(2, "uint8", 1, "|u1", "uint"),
    DType(3, "int8", 1, "|i1", "int"),
    DType(4, "int16", 2, "<i2", "int"),
    DType(5, "int32", 4, "<i4", "int"),
    DType(6, "int64", 8, "<i8", "int"),
    DType(7, "uint16", 2, "<u2", "uint"),
    DType(8, "uint32", 4, "<u4", "uint"),
    DType(9, "uint64", 8, "<u8", "uint"),
    DType(10, "float16", 2, "<f2", "float"),
    DType(11, "bfloat16", 2, "<u2", "float"),
    DType(12, "float32", 4, "<f4", "float"),
    DType(13, "float64", 8, "<f8", "float"),
    DType(14, "complex32", 4, "<u4", "complex"),
    DType(15, "complex64", 8, "<c8", "complex"),
    DType(16, "complex128", 16, "<c16", "complex"),
    DType(17, "float8_e4m3fn", 1, "|u1", "float"),
    DType(18, "float8_e5m2", 1, "|u1", "float"),
    DType(19, "float8_e4m3fnuz", 1, "|u1", "float"),
    DType(20, "float8_e5m2fnuz", 1, "|u1", "float"),
    DType(21, "float8_e8m0fnu", 1, "|u1", "float"),
    DType(22, "float4_e2m1fn_x2", 1, "|u1", "float"),
)

BY_CODE: dict[int, DType] = {d.code: d for d in _TABLE}
BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}

_FROM_NUMPY = {np.dtype(d.numpy): d for d in _TABLE if d.name not in ("bfloat16", "complex32")
               and not d.name.startswith("float")} | {
    np.dtype("<f2"): BY_NAME["float16"],
    np.dtype("<f4"): BY_NAME["float32"],
    np.dtype("<f8"): BY_NAME["float64"],
}


def by_code(code: int) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise UnsupportedFeatureError(
            f"unknown dtype code {code}; this reader knows 1..{max(BY_CODE)}") from None


def by_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise FormatError(f"unknown dtype name {name!r}") from None


def from_numpy(dtype: np.dtype) -> DType:
    """The .s4w dtype of a numpy array (native byte order is normalised to little-endian)."""
    key = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    try:
        return _FROM_NUMPY[key]
    except KeyError:
        raise FormatError(f"numpy dtype {dtype} has no .s4w dtype; wrap it in a Tensor") from None
