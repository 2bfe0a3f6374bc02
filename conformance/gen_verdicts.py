"""The v1 vectors of the verdicts of 2026-12-01 (``spec/README.md``): files that break two rules,
which two readers had answered differently, each pinning down the order the spec now gives,
and the zstd frames that declare a content size of 0.

- the object tree is decoded in one pass and a dict key refused at its tag (O7), O13 before O8;
- the file is checked before its parent is opened (A1, then the parent's own rules, then A2);
- a delta's parent tensor is found before its planes are read (R5 before R1);
- a plane decoded to another length is its codec's error (R3: CodecError);
- the whole index is parsed (I2) and its extensions checked (I3) before any T rule.

Built from the files of :mod:`conformance.generate` with its helpers; every file is new.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from conformance import craft
from conformance import generate as g
from s4format import codecs, layouts

u32 = struct.Struct("<I").pack
DEEP = 300  # beyond the depth limit of 256 (O3)
NOT_S4W = "not_s4w.s4w"
TREE = ["objects.md#rules", "objects.md#order", "validation.md#X4"]


def nested(tag: bytes, depth: int) -> bytes:
    """``depth`` one-item containers of ``tag`` (list 08, tuple 09), each holding the next,
    around None."""
    return (tag + u32(1)) * depth + b"\x00"


def tree_vectors(two: bytes) -> list[g.Vector]:
    def tree(raw: bytes) -> bytes:
        return g.edited(two, lambda p: p.index.update(tree=raw))

    def keyed(key: bytes) -> bytes:
        return tree(b"\x0a" + u32(1) + key + b"\x00")
    keys = [1 + k * g.HASH_PRIME for k in range(64)] + [1]  # the 65th equals the first
    pairs = b"".join(g.tree_bytes(k) + b"\x00" for k in keys)
    return [
        g.fail("tree_key_list_300_deep", "a dict key that is a list nested 300 deep: refused at "
               "its tag (O7), before decoding it would reach the depth limit (O3)", TREE,
               "FormatError", keyed(nested(b"\x08", DEEP))),
        g.fail("tree_key_tuple_list_300_deep", "a dict key that is a tuple holding a list "
               "nested 300 deep: refused at the list's tag (O7)", TREE, "FormatError",
               keyed(b"\x09" + u32(1) + nested(b"\x08", DEEP))),
        g.fail("tree_key_typed_300_deep", "a dict key that is a typed value holding lists "
               "nested 300 deep: refused at its tag (O7)", TREE, "FormatError",
               keyed(b"\x0c" + struct.pack("<H", 8) + b"user.Key" + nested(b"\x08", DEEP))),
        g.fail("tree_key_tuple_300_deep", "a dict key of tuples nested 300 deep: every tag may "
               "start a key, and the depth limit applies inside keys (O3)", TREE, "LimitError",
               keyed(nested(b"\x09", DEEP))),
        g.fail("tree_keys_65_one_hash_duplicate", "a dict of 64 int keys 1 + k(2^61 - 1), all "
               "of one hash, then 1 again: the 65th key of one hash (O13) is refused before it "
               "is compared with the others (O8)", TREE, "LimitError",
               tree(b"\x0a" + u32(len(keys)) + pairs)),
    ]


def parent_vectors(deltas: list[g.Vector]) -> list[g.Vector]:
    base, child = deltas[0].data, deltas[1].data
    attach = ["validation.md#a--attaching-a-parent-deltas"]
    garbage = b"This is not an .s4w file: a reader given it as a parent refuses it.\n" * 2
    damaged_header = g.patch(child, 20, bytes([child[20] ^ 1]))  # align_log2, checksum kept
    parts = craft.parse(child)
    # tensor w's largest plane, one stored byte changed, its checksum kept
    plane = max(range(len(parts.tensors[0]["planes"])),
                key=lambda k: parts.tensors[0]["planes"][k]["stored_len"])
    at = parts.tensors[0]["planes"][plane]["offset"]
    damaged = g.patch(child, at, bytes([child[at] ^ 1]))
    # (craft keeps the records' plane checksums: the damage stays unnoticed but by R1)
    damaged_unknown = g.edited(damaged, lambda p: p.tensors[0].update(parent_hash=bytes(16)))
    r5 = ["validation.md#R5", "validation.md#R1", "format.md#10"]
    return [
        g.fail("not_s4w", "a text file: not an .s4w file (the parent of the vectors below)",
               ["validation.md#H1"], "BadMagicError", garbage, file=NOT_S4W),
        g.fail("delta_header_damaged_not_s4w_parent", "delta_child with its header damaged "
               "(checksum not updated) given not_s4w as its parent: the file is checked "
               "before its parent is opened", [*attach, "validation.md#H4"], "ChecksumError",
               damaged_header, parent=NOT_S4W),
        g.fail("delta_not_s4w_parent", "delta_child given not_s4w as its parent: the parent's "
               "own error", [*attach, "validation.md#H1"], "BadMagicError", child,
               parent=NOT_S4W, file="delta_child.s4w"),
        g.fail("base_given_not_s4w_parent", "a base (no parent_id) given not_s4w as its "
               "parent: A1 is checked before the parent is opened", attach, "ParentMismatchError",
               base, parent=NOT_S4W, file="delta_base.s4w"),
        g.fail("delta_plane_damaged", "delta_child with a stored byte of a plane of delta "
               "tensor w changed (checksum not updated), with its parent", r5, "ChecksumError",
               damaged, parent="delta_base.s4w", file="delta_child_plane_damaged.s4w"),
        g.fail("delta_plane_damaged_parent_missing", "the same file read without its parent: "
               "R5 is checked before the planes are read", r5, "ParentMismatchError", damaged,
               file="delta_child_plane_damaged.s4w"),
        g.fail("delta_plane_damaged_parent_hash_unknown", "the same damage, and tensor w's "
               "parent_hash names no tensor of the parent", r5, "ParentMismatchError",
               damaged_unknown, parent="delta_base.s4w"),
    ]



def _zstd_frame(fcs: int, block: bytes) -> bytes:
    """A single-segment Zstandard frame (RFC 8878) declaring ``fcs`` content bytes, whose one
    and last block is ``block`` (its 3-byte header included)."""
    if fcs < 256:
        return b"\x28\xb5\x2f\xfd\x20" + bytes([fcs]) + block
    return b"\x28\xb5\x2f\xfd\x60" + struct.pack("<H", fcs - 256) + block


def _block(kind: int, size: int, body: bytes) -> bytes:
    """A last block: ``kind`` 0 raw, 1 RLE, 2 compressed; ``size`` its Block_Size."""
    return (1 | kind << 1 | size << 3).to_bytes(3, "little") + body


def length_vectors(read_base: bytes) -> list[g.Vector]:
    """R3: a plane whose codec yields another length than ``decoded_len`` is a CodecError; and
    zstd frames that declare Frame_Content_Size 0, which some one-shot decoders return as
    empty without decoding their blocks."""
    n, h_n = 4087, 66000  # tensors w and h of read_base, as generate.read_vectors builds them
    mant = layouts.BF16.split(g.weights_bf16(60, n).view(np.uint8).copy(), 2)[2].tobytes()
    h = (np.uint16(0x3C00) | (g.rand_bytes(61, h_n) & 0x01).astype(np.uint16)).view(np.uint8)
    short = _zstd_frame(n, _block(0, n - 1, mant[:-1]))
    rules = ["validation.md#R3", "codecs.md"]
    out = [g.fail("zstd_blocks_short_of_content_size", "a zstd frame declaring "
                  "Frame_Content_Size = decoded_len whose one raw block holds a byte fewer: the "
                  "plane decodes short (R3), its codec's error", [*rules, "codecs.md#3--zstd"],
                  "CodecError", g.replaced(read_base, (0, 2), short))]
    gdeflate = codecs.get(codecs.GDEFLATE)
    out.append(g.fail("gdeflate_page_short", "GDeflate page 0 replaced by a stream of its first "
                      "65535 bytes: the page decodes a byte short (R3)",
                      [*rules, "gdeflate.md#5"], "CodecError",
                      g.replaced(read_base, (1, 3), lambda old: _short_page(
                          old, layouts.FP16.split(h, 2)[3], gdeflate))))
    z = np.zeros(0, np.uint8)

    def empty_zstd(frame: bytes) -> list[g.TensorSpec]:
        code = (lambda _plane: (frame, b"\x03", codecs.ZSTD))  # noqa: E731
        return [g.TensorSpec("e", "uint8", (0,), z, g.force(z, "uint8", layouts.RAW, [code]))]
    fcs0 = ["codecs.md#3--zstd"]
    out += [
        g.valid("zstd_fcs_0_empty", "an empty plane as a zstd frame declaring "
                "Frame_Content_Size 0 with one empty raw block", fcs0,
                empty_zstd(_zstd_frame(0, _block(0, 0, b"")))),
        g.fail("zstd_fcs_0_corrupt_block", "an empty plane as a zstd frame declaring "
               "Frame_Content_Size 0 whose compressed block is corrupt: its blocks are decoded "
               "as in any frame", fcs0, "CodecError",
               g.write_file(empty_zstd(_zstd_frame(0, _block(2, 5, b"\xff\xfe\xfd\xfc\xfb"))))),
        g.fail("zstd_fcs_0_block_content", "an empty plane as a zstd frame declaring "
               "Frame_Content_Size 0 whose RLE block holds 5 bytes", fcs0, "CodecError",
               g.write_file(empty_zstd(_zstd_frame(0, _block(1, 5, b"A"))))),
    ]
    return out


def _short_page(payload: bytes, plane: np.ndarray, gdeflate: Any) -> bytes:
    """A GDeflate payload with page 0's stream replaced by one coding its first 65535 bytes."""
    head, (_entry0, entry1) = payload[:8], struct.unpack_from("<II", payload, 8)
    page1 = payload[len(payload) - (entry1 & 0x7FFFFFFF):]
    coded = bytes(gdeflate.encode(plane[:65535]).payload)
    (entry,) = struct.unpack_from("<I", coded, 8)
    assert entry >> 31 == 0, "page 0 must stay a compressed page"
    return head + struct.pack("<II", entry, entry1) + coded[12:] + page1


def index_vectors(tiny: bytes, two: bytes) -> list[g.Vector]:
    """The whole index is parsed (I2) and its extensions checked (I3) before any T rule."""
    rules = ["validation.md#i--index", "validation.md#t--each-tensor-record"]

    def broken(blob: bytes, edit, extra: bytes = b"", name_at: bytes | None = None) -> bytes:
        parts = craft.parse(blob)
        edit(parts)
        idx = craft.index_bytes(parts.index) + extra
        if name_at is not None:  # a tensor name made invalid UTF-8 (construct builds only str)
            at = idx.index(name_at) + 2
            idx = idx[:at] + b"\xff" + idx[at + 1:]
        return craft.build(parts, index=idx)
    flags = lambda p: p.tensors[0].update(flags=1)  # noqa: E731
    ndim_65 = lambda p: p.tensors[0].update(ndim=65, shape=[1] * 65)  # noqa: E731

    def ndim_65_required(p: craft.Parts) -> None:
        ndim_65(p)
        p.index["extensions"].append(dict(tag="future", required=1, data=b""))
    return [
        g.fail("index_trailing_byte_tensor_flags", "tensor flags 1 (T1) and a byte after the "
               "last extension (I2)", rules, "FormatError", broken(tiny, flags, b"\x00")),
        g.fail("index_name_not_utf8_after_ndim_65", "tensor a of 65 dimensions (T3), then "
               "tensor b's name not UTF-8 (I2)", rules, "FormatError",
               broken(two, ndim_65, name_at=b"\x01\x00b\x02")),
        g.fail("extension_required_ndim_65", "tensor w of 65 dimensions (T3) and an unknown "
               "must-understand extension (I3)", rules, "UnsupportedFeatureError",
               broken(tiny, ndim_65_required)),
    ]


def vectors(tiny: bytes, two: bytes, deltas: list[g.Vector], read_base: bytes) -> list[g.Vector]:
    return (tree_vectors(two) + parent_vectors(deltas) + length_vectors(read_base)
            + index_vectors(tiny, two))
