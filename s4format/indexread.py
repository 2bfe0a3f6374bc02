"""A fast reader of well-formed indexes, for opening files (``spec/format.md`` §4).

It reads the grammar of :data:`s4format.schema.Index` with ``struct``, about four times as
fast as construct's compiled parser, which took 12% of the main thread of a load from memory
on the H200's host (bench/RESULTS.md, 2026-12-02). It gives up (None) on anything irregular,
an index with extensions included, and the reader then parses with construct, which reports
what is malformed. tests/format/test_index_read.py checks that what it returns is field for
field what construct returns.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from s4format.schema import TRANSFORM_XOR

_COUNT = struct.Struct("<I")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_TENSOR_FIELDS = struct.Struct("<5B")  # dtype, layout, transform, flags, ndim
_PLANE_HEAD = struct.Struct("<BBHH")  # kind, index, codec, params length
_PLANE_TAIL = struct.Struct("<4Q")  # offset, stored_len, decoded_len, checksum
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(256)]
_MAGIC = b"S4IX"


class FastIndex(NamedTuple):
    """The fields of :data:`s4format.schema.Index` the reader uses; each tensor a dict of its
    record's fields (planes a list of dicts), as construct's containers hold them."""
    tensors: list[dict[str, Any]]
    parent_id: bytes
    tree: bytes
    metadata: bytes
    extensions: tuple[()]
    plain: bool = False  # each tensor a checked TensorInfo (``reader._parse_index``)


_PLANE_KEYS = ("kind", "index", "codec", "params", "offset", "stored_len", "decoded_len",
               "checksum")


def _as_record(name: str, dtype: int, layout: int, transform: int, flags: int, ndim: int,
               shape: list[int], raw_nbytes: int, content_hash: bytes,
               parent_hash: bytes | None, planes: list[tuple]) -> dict[str, Any]:
    """A tensor record as construct's container holds it."""
    return {"name": name, "dtype": dtype, "layout": layout, "transform": transform,
            "flags": flags, "ndim": ndim, "shape": shape, "raw_nbytes": raw_nbytes,
            "content_hash": content_hash, "parent_hash": parent_hash,
            "planes": [dict(zip(_PLANE_KEYS, p)) for p in planes]}


def read_index(raw: bytes, record: Callable[..., Any] = _as_record) -> FastIndex | None:
    """The index in ``raw``, or None where it is not a well-formed index without extensions
    (construct then says what is wrong). Each tensor is what ``record`` makes of its fields
    (by default the dict construct would give), its planes as tuples of ``_PLANE_KEYS``; a
    record that makes None gives None for the whole index."""
    try:
        return _read(raw, record)
    except (struct.error, UnicodeDecodeError, IndexError, ValueError):
        return None


def _read(raw: bytes, record: Callable[..., Any]) -> FastIndex | None:
    # A field cut short needs no check of its own: the next fixed field read past the end
    # raises, and an index whose last field ends elsewhere than 2 bytes before its end (the
    # extension count) is refused at the end.
    end = len(raw)
    if raw[:4] != _MAGIC or end < 8:
        return None
    count = _COUNT.unpack_from(raw, 4)[0]
    pos = 8
    tensors = []
    for _ in range(count):
        n = _U16.unpack_from(raw, pos)[0]
        pos += 2
        name = str(raw[pos:pos + n], "utf-8")
        pos += n
        dtype, layout, transform, flags, ndim = _TENSOR_FIELDS.unpack_from(raw, pos)
        pos += 5
        shape = list(_SHAPES[ndim].unpack_from(raw, pos))
        pos += 8 * ndim
        raw_nbytes = _U64.unpack_from(raw, pos)[0]
        pos += 8
        content_hash = raw[pos:pos + 16]
        pos += 16
        parent_hash = None
        if transform == TRANSFORM_XOR:
            parent_hash = raw[pos:pos + 16]
            pos += 16
        planes = []
        pos += 1
        for _p in range(raw[pos - 1]):
            kind, index, codec, m = _PLANE_HEAD.unpack_from(raw, pos)
            pos += 6
            params = raw[pos:pos + m]
            pos += m
            planes.append((kind, index, codec, params, *_PLANE_TAIL.unpack_from(raw, pos)))
            pos += 32
        rec = record(name, dtype, layout, transform, flags, ndim, shape, raw_nbytes,
                     content_hash, parent_hash, planes)
        if rec is None:
            return None
        tensors.append(rec)
    parent_id = raw[pos:pos + 16]
    pos += 16
    parts = []
    for _ in range(2):  # the tree, then the metadata
        n = _COUNT.unpack_from(raw, pos)[0]
        pos += 4
        parts.append(raw[pos:pos + n])
        pos += n
    if end - pos != 2 or _U16.unpack_from(raw, pos)[0] != 0:  # no extension, nothing after
        return None
    return FastIndex(tensors, parent_id, parts[0], parts[1], ())
