"""Shared fixtures data and comparisons for the format tests."""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

import numpy as np

import s4format
from s4format import Reader, Tensor, TensorRef, Typed, policy

POLICIES = policy.POLICIES


def small_tree() -> OrderedDict:
    """A few tensors of different kinds (one large enough to be split into planes) in a tree
    with every kind of plain value; written, it is a file of about 2 KB."""
    rng = np.random.default_rng(7)
    values = np.array([0.5, -0.5, 0.25, -0.25, 1.0, -1.0, 2.0, -0.125], dtype="<f4")
    bf16 = (values[rng.integers(0, 8, 2048)].view("<u4") >> 16).astype("<u2")
    return OrderedDict(
        model={"w": rng.standard_normal(48).astype("<f4"),
               "steps": np.arange(40, dtype="<i8"),
               "mask": rng.random(37) < 0.5},
        emb=Tensor.from_numpy(bf16, dtype="bfloat16"),
        cfg={"lr": 3e-4, "name": "tiny", "betas": (0.9, 0.999), "big": 2**80,
             "nan": float("nan"), "raw": b"\x00\x01", "none": None, "flag": True},
    )


def index_of(blob: bytes) -> bytes | None:
    """The index bytes a file's footer points at, or None where the footer does not parse or
    points past the end."""
    from construct import ConstructError

    from s4format.schema import FOOTER_SIZE, Footer

    if len(blob) < FOOTER_SIZE:
        return None
    try:
        f = Footer.parse(blob[-FOOTER_SIZE:])
    except ConstructError:
        return None
    if f.index_offset + f.index_length > len(blob):
        return None
    return blob[f.index_offset:f.index_offset + f.index_length]


def small_file() -> bytes:
    return s4format.dumps(small_tree(), metadata={"framework": "test"})


def read_everything(source: Any, **kwargs: Any) -> list[Tensor]:
    """Open, decode every tensor, and run verify(); raises the first error."""
    with Reader(source, **kwargs) as r:
        tensors = [r.read(i) for i in range(len(r.tensors))]
        problems = s4format.verify(r)
        assert problems == [], [str(p) for p in problems]
        return tensors


def raw_bytes(x: Tensor | np.ndarray) -> bytes:
    """Little-endian C-order bytes of a tensor or array, whatever its strides and byte order."""
    if isinstance(x, Tensor):
        return x.data.tobytes()
    a = np.ascontiguousarray(x)
    return a.astype(a.dtype.newbyteorder("<")).tobytes()


def assert_same_tree(got: Any, want: Any, path: str = "<root>") -> None:
    """Exact equality of a loaded tree and the written one: types, float bits, tensor bytes."""
    if isinstance(want, np.ndarray | Tensor):
        assert isinstance(got, Tensor), f"{path}: {type(got)}"
        want_t = want if isinstance(want, Tensor) else Tensor.from_numpy(want)
        assert got.dtype == want_t.dtype, path
        assert got.shape == want_t.shape, path
        assert got.data.tobytes() == raw_bytes(want), path
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got} != {want}"
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert len(got) == len(want), path
        assert [_key(k) for k in got] == [_key(k) for k in want], f"{path}: keys differ"
        for (k, g), w in zip(got.items(), want.values()):
            assert_same_tree(g, w, f"{path}[{k!r}]")
    elif isinstance(want, Typed):
        assert got.name == want.name, path
        assert_same_tree(got.value, want.value, f"{path}<{want.name}>")
    elif isinstance(want, TensorRef):
        assert got == want, path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _key(k: Any) -> Any:
    if isinstance(k, float):
        return ("float", struct.pack("<d", k))
    return (type(k).__name__, k)
