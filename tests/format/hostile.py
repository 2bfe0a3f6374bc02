"""Builders of hostile .s4w files, made from the spec (a CONST rANS stream written by hand,
index fields changed with ``conformance.craft``), for the test_hostile_* tests. Each takes the
size of its attack so the tests can run it scaled down and measure how cost grows."""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance import craft
from conformance.generate import tree_bytes
from s4format import codecs, dtypes, hashing, layouts
from s4format.objtree import TensorRef, Typed
from s4format.writer import CodedPlane, CodedTensor, Writer

HASH_MODULUS = (1 << 61) - 1  # CPython's numeric hash is the value modulo this prime
MAX_RANS_BLOCK = 1 << 20  # symbols per block at log2_block 20, the largest the spec allows


def const_stream(n: int, symbol: int = 0) -> bytes:
    """An S4 rANS CONST stream (spec/rans.md section 2) of ``n`` copies of ``symbol`` in
    blocks of 2^20: 12 header bytes and one byte per block."""
    blocks = -(-n // MAX_RANS_BLOCK)
    return struct.pack("<BBHQ", 1, 20, 0, n) + bytes([symbol]) * blocks


@functools.cache
def zeros_hash(nbytes: int) -> bytes:
    # np.zeros maps untouched pages: hashing them costs time, not memory
    return hashing.content_hash(np.zeros(nbytes, np.uint8))


def const_tensor(w: Writer, name: str, nbytes: int) -> TensorRef:
    """A uint8 tensor of ``nbytes`` zeros stored as one CONST rANS plane (a few bytes a MiB)."""
    plane = CodedPlane(layouts.KIND_RAW, 0, codecs.RANS, nbytes, const_stream(nbytes))
    return w.add_coded(name, dtypes.by_name("uint8"), (nbytes,),
                       CodedTensor(layouts.RAW, (plane,)), zeros_hash(nbytes))


def file_with(tree: Any, tensors: Sequence[tuple[str, int]] = (), *,
              raw_tree: bytes | None = None) -> bytes:
    """A file of CONST tensors (name, bytes) and ``tree`` (a function of their references
    when callable), or ``raw_tree``'s bytes, written without the writer's checks."""
    buf = io.BytesIO()
    w = Writer(buf)
    refs = [const_tensor(w, name, n) for name, n in tensors]
    w.close()
    parts = craft.parse(buf.getvalue())
    parts.index["tree"] = raw_tree if raw_tree is not None \
        else tree_bytes(tree(refs) if callable(tree) else tree)
    return craft.build(parts)


# -- the cases of the review, one builder each ---------------------------------------------

def nested_attrs(levels: int) -> bytes:
    """Case 2: ``s4.attrs`` typed values nested ``levels`` deep, none around a real object."""
    node: Any = None
    for _ in range(levels):
        node = Typed("s4.attrs", (node, {}))
    return file_with(node)


def numpy_refs(count: int, nbytes: int) -> bytes:
    """Case 3: one stored tensor of ``nbytes`` referenced ``count`` times as a numpy array."""
    return file_with(lambda refs: [Typed("numpy.ndarray", refs[0])] * count, [("t", nbytes)])


def long_keys(depth: int, key_len: int) -> bytes:
    """Case 4: dicts nested ``depth`` deep, each keyed by ``key_len`` bytes, a tensor at the
    bottom: a key path there is ``depth * key_len`` long (four times that as a bytes repr)."""
    def tree(refs: list[TensorRef]) -> Any:
        node: Any = refs[0]
        for level in range(depth):
            node = {bytes([level % 256]) * key_len: node}
        return node
    return file_with(tree, [("t", 16)])


def colliding_keys(count: int) -> bytes:
    """Case 5: a dict of ``count`` int keys that all share one CPython hash (written pair by
    pair: building it as a Python dict is the quadratic work itself)."""
    pairs = b"".join(tree_bytes(1 + i * HASH_MODULUS) + b"\x00" for i in range(count))
    return file_with(None, raw_tree=b"\x0a" + struct.pack("<I", count) + pairs)


def many_const(count: int, nbytes: int) -> bytes:
    """Case 6: ``count`` CONST tensors of ``nbytes`` each (twelve of 1 GiB: a 14 KB file)."""
    return file_with(lambda refs: {f"t{i}": r for i, r in enumerate(refs)},
                     [(f"t{i}", nbytes) for i in range(count)])


def with_shape(shape: tuple[int, ...]) -> bytes:
    """Case 7: a zero-element uint8 tensor whose record says ``shape`` (any u64 dims)."""
    parts = craft.parse(file_with(lambda refs: {"t": refs[0]}, [("t", 0)]))
    parts.tensors[0].update(ndim=len(shape), shape=list(shape))
    return craft.build(parts)


def view(**changes: Any) -> bytes:
    """Case 7: one ``s4.view`` of a 16-byte storage, its fields changed by ``changes``."""
    def tree(refs: list[TensorRef]) -> Any:
        fields = {"storage": refs[0], "dtype": "uint8", "offset": 0, "shape": (16,),
                  "stride": (1,), "device": "cpu", "requires_grad": False,
                  "parameter": False}
        return {"v": Typed("s4.view", {**fields, **changes})}
    return file_with(tree, [("s", 16)])


def typed(name: str, value: Any) -> bytes:
    """Case 7: one typed value, e.g. ``torch.Size`` of ``(2**70,)``."""
    return file_with({"x": Typed(name, value)})
