"""construct schemas for the fixed header, the footer and the index (``spec/format.md``).

construct describes only the headers and tables; plane payloads are read by offset into numpy
buffers. Parsing here checks shape only (lengths, counts, constants); the semantic rules
(offsets, overlaps, sizes, IDs) live in :mod:`s4format.records` and :mod:`s4format.reader`.
"""

from __future__ import annotations

import functools

from construct import (
    Array,
    Bytes,
    Const,
    GreedyBytes,
    If,
    Int8ul,
    Int16ul,
    Int32ul,
    Int64ul,
    PaddedString,
    PascalString,
    Prefixed,
    PrefixedArray,
    Struct,
    Terminated,
    this,
)

MAGIC = b"\x89S4W\r\n\x1a\n"
END_MAGIC = b"\n\x1aS4WEND"
MAJOR = 1
# 1.1 added codec 8, bitpack-w; 1.3 codec 9, rans-seg; 1.4 masked tensors; 1.5 codec 10, seg-lz
# (spec/README.md, Versioning)
MINOR = 5

HEADER_SIZE = 32
FOOTER_SIZE = 40

# Flags (spec/format.md, "Flags"). v1 defines no flag of either class: every required bit
# must be zero for a v1 reader; optional bits may be ignored.
KNOWN_REQUIRED_FLAGS = 0

TRANSFORM_NONE = 0
TRANSFORM_XOR = 1

# TensorRecord flags (spec/format.md, 4.1). Bit 0 stays unassigned: the frozen conformance
# suite v1 uses it as its unknown flag (tensor_flags).
TENSOR_MASKED = 0x02
TENSOR_FLAGS = TENSOR_MASKED

Header = Struct(
    "magic" / Bytes(8),
    "major" / Int16ul,
    "minor" / Int16ul,
    "required_flags" / Int32ul,
    "optional_flags" / Int32ul,
    "align_log2" / Int8ul,
    "reserved" / Bytes(3),
    "checksum" / Int64ul,  # XXH3-64 of the 24 bytes before it
)

Footer = Struct(
    "index_offset" / Int64ul,
    "index_length" / Int64ul,
    "index_checksum" / Int64ul,  # XXH3-64 of the index bytes
    "checksum" / Int64ul,  # XXH3-64 of the 24 bytes before it
    "end_magic" / Const(END_MAGIC),
)

PlaneRecord = Struct(
    "kind" / Int8ul,
    "index" / Int8ul,
    "codec" / Int16ul,
    "params" / Prefixed(Int16ul, GreedyBytes),
    "offset" / Int64ul,
    "stored_len" / Int64ul,
    "decoded_len" / Int64ul,
    "checksum" / Int64ul,  # tree checksum of the stored bytes
)

TensorRecord = Struct(
    "name" / PascalString(Int16ul, "utf8"),
    "dtype" / Int8ul,
    "layout" / Int8ul,
    "transform" / Int8ul,
    "flags" / Int8ul,
    "ndim" / Int8ul,
    "shape" / Array(this.ndim, Int64ul),
    "raw_nbytes" / Int64ul,
    "content_hash" / Bytes(16),
    "parent_hash" / If(this.transform == TRANSFORM_XOR, Bytes(16)),
    "planes" / PrefixedArray(Int8ul, PlaneRecord),
)

Extension = Struct(
    "tag" / PaddedString(8, "ascii"),
    "required" / Int8ul,
    "data" / Prefixed(Int32ul, GreedyBytes),
)

Index = Struct(
    "index_magic" / Const(b"S4IX"),
    "tensors" / PrefixedArray(Int32ul, TensorRecord),
    "parent_id" / Bytes(16),  # checkpoint ID of the delta parent; all zero: no parent
    "tree" / Prefixed(Int32ul, GreedyBytes),  # the object tree (spec/objects.md)
    "metadata" / Prefixed(Int32ul, GreedyBytes),  # a str->str dict, same encoding
    "extensions" / PrefixedArray(Int16ul, Extension),
    Terminated,
)

NO_PARENT = bytes(16)


@functools.cache
def compiled_index():
    """``Index`` compiled by construct into Python code (same bytes and fields; about 5x faster
    to parse and 3x to build a checkpoint's index of thousands of records than the interpreted
    form)."""
    return Index.compile()
