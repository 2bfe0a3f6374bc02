"""A fast writer of indexes (``spec/format.md`` §4), for closing files.

It builds the bytes of :data:`s4format.schema.Index` with ``struct``, several times as fast as
construct's compiled builder, which took about 14 ms of every save of a 735-tensor training
state on the 2-core machine (bench/RESULTS.md, 2026-12-03). It gives up (None) on anything
construct would refuse or that it does not build (extensions), and the writer then builds
with construct, which raises its error. tests/format/test_index_write.py checks that it
writes byte for byte what construct writes.
"""

from __future__ import annotations

import struct
from typing import Any

from s4format.indexread import _COUNT, _PLANE_HEAD, _PLANE_TAIL, _SHAPES, _TENSOR_FIELDS, _U16, _U64
from s4format.schema import TRANSFORM_XOR


def build_index(tensors: list[dict[str, Any]], parent_id: bytes, tree: bytes, metadata: bytes
                ) -> bytes | None:
    """The index of ``tensors`` (records as the writer keeps them: dicts of the schema's
    fields, each plane a dict), ``parent_id``, the encoded ``tree`` and ``metadata``, with no
    extension; None where construct's schema would refuse the fields."""
    try:
        return _build(tensors, parent_id, tree, metadata)
    except (struct.error, TypeError, ValueError, KeyError, IndexError, AttributeError,
            UnicodeEncodeError):
        return None


def _fixed(value: Any, size: int) -> bytes:
    """``value`` as exactly ``size`` bytes (struct's ``s`` format would pad or cut it)."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != size:
        raise ValueError("wrong length")
    return bytes(value)


def _build(tensors: list[dict[str, Any]], parent_id: bytes, tree: bytes, metadata: bytes
           ) -> bytes:
    parts = [b"S4IX", _COUNT.pack(len(tensors))]
    add = parts.append
    for t in tensors:
        name = t["name"].encode("utf-8")
        add(_U16.pack(len(name)))
        add(name)
        ndim, transform = t["ndim"], t["transform"]
        shape = t["shape"]
        if len(shape) != ndim:
            raise ValueError("shape and ndim differ")
        add(_TENSOR_FIELDS.pack(t["dtype"], t["layout"], transform, t["flags"], ndim))
        add(_SHAPES[ndim].pack(*shape))
        add(_U64.pack(t["raw_nbytes"]))
        add(_fixed(t["content_hash"], 16))
        parent_hash = t["parent_hash"]  # (construct needs the field whatever the transform)
        if transform == TRANSFORM_XOR:
            add(_fixed(parent_hash, 16))
        planes = t["planes"]
        add(bytes((len(planes),)))
        for p in planes:
            params = p["params"]
            if not isinstance(params, (bytes, bytearray)):
                raise TypeError("params are bytes")
            add(_PLANE_HEAD.pack(p["kind"], p["index"], p["codec"], len(params)))
            add(bytes(params))
            add(_PLANE_TAIL.pack(p["offset"], p["stored_len"], p["decoded_len"], p["checksum"]))
    add(_fixed(parent_id, 16))
    for part in (tree, metadata):
        if not isinstance(part, (bytes, bytearray)):
            raise TypeError("tree and metadata are bytes")
        add(_COUNT.pack(len(part)))
        add(bytes(part))
    add(b"\0\0")  # no extension
    return b"".join(parts)
