"""Generate the .s4w v1 conformance vectors: format 1.0's into ``conformance/v1/``, what each
later minor adds into its own folder (``v1.1/`` to ``v1.5/``), or one suite into
``--out DIR``.

Deterministic: fixed seeds (PCG64's raw bit stream, which numpy keeps stable), no timestamps,
sorted JSON. Expected tensor bytes are hashed from the arrays built here, *before* writing, and
trees are converted from the Python objects given to the writer: nothing expected comes from our
reader. Vectors of a released version are frozen: an existing file is never overwritten with
different bytes unless ``--force`` is given (see ``README.md``).

    python -m conformance.generate [--suite v1|v1.1|v1.2|v1.3|v1.4|v1.5 [--out DIR]] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from conformance import craft
from s4format import codecs, dtypes, hashing, layouts
from s4format.codecs.rans import MODE_CONST, MODE_RANS, MODE_RAW, RansCodec
from s4format.codecs.ransseg import assemble
from s4format.conformance import OPTIONAL_CODECS, tree_to_json
from s4format.layouts import Layout
from s4format.objtree import TensorRef, Typed
from s4format.tensor import Tensor
from s4format.writer import CodedPlane, CodedTensor, Writer, code_masked, masked_form

ROOT = Path(__file__).resolve().parent
SUITE = ROOT / "v1"  # format 1.0, frozen
SUITE_1_1 = ROOT / "v1.1"  # what format 1.1 adds
SIZE_BUDGET = 8 << 20  # per suite; tests/conformance/test_generate.py holds all suites to it


# -- deterministic data -----------------------------------------------------------------------

def bits(seed: int, n: int) -> np.ndarray:
    """``n`` uint64 words of PCG64's raw output: stable across numpy versions."""
    return np.random.PCG64(seed).random_raw(n).astype(np.uint64) if n else np.zeros(0, np.uint64)


def rand_bytes(seed: int, n: int) -> np.ndarray:
    return bits(seed, (n + 7) // 8).view(np.uint8)[:n].copy()


def weights_bf16(seed: int, n: int) -> np.ndarray:
    """bf16 bit patterns shaped like trained weights: random sign and mantissa, an exponent
    around 2^-6 with a geometric tail (low entropy, as real exponent planes are)."""
    r = bits(seed, n)
    sign = (r >> np.uint64(63)).astype(np.uint16)
    mant = (r & np.uint64(0x7F)).astype(np.uint16)
    tail = np.minimum((r >> np.uint64(7)) & np.uint64(0xFFFF), np.uint64(0xFFFF))
    drop = np.zeros(n, dtype=np.uint16)
    for k in range(6):  # P(drop >= k+1) = 2^-(k+1)
        drop += ((tail >> np.uint64(k)) & np.uint64(1) == 0).astype(np.uint16) * (drop == k)
    exp = (121 - drop).astype(np.uint16)
    return (sign << 15) | (exp << 7) | mant


def weights_f32(seed: int, n: int) -> np.ndarray:
    """fp32 patterns: the bf16 weights above with 16 random low mantissa bits."""
    hi = weights_bf16(seed, n).astype(np.uint32) << 16
    return hi | (bits(seed + 1, n) & np.uint64(0xFFFF)).astype(np.uint32)


# -- vectors ----------------------------------------------------------------------------------

@dataclass
class TensorSpec:
    """A tensor to write: its raw bytes as built here, and optionally a forced coding."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    raw: np.ndarray  # uint8
    coded: CodedTensor | None = None  # None: our writer's own choice
    parent: np.ndarray | None = None  # raw bytes of the parent tensor (delta candidates)

    def expected(self) -> dict[str, Any]:
        return dict(name=self.name, dtype=self.dtype, shape=list(self.shape),
                    sha256=hashlib.sha256(self.raw.tobytes()).hexdigest())


@dataclass
class Vector:
    id: str
    description: str
    rules: list[str]
    data: bytes
    expect: str = "valid"
    error: str | None = None
    tensors: list[dict[str, Any]] | None = None
    tree: Any = None
    parent: str | None = None
    file: str | None = None  # defaults to id + ".s4w"; vectors may share a file
    tags: list[str] = field(default_factory=list)
    # optional codec -> what a reader lacking it answers, where that is not
    # UnsupportedCodecError (a rule broken before P3 reaches the codec's first plane)
    without: dict[str, str] = field(default_factory=dict)

    def entry(self) -> dict[str, Any]:
        e: dict[str, Any] = dict(id=self.id, file=self.file or f"{self.id}.s4w",
                                 description=self.description, rules=self.rules,
                                 expect=self.expect)
        if self.expect == "valid":
            e.update(tensors=self.tensors, tree=self.tree)
        else:
            e["error"] = self.error
        if self.parent:
            e["parent"] = self.parent
        e["codecs"] = sorted(codecs_used(self.data))
        lacking = [c for c in e["codecs"] if c in OPTIONAL_CODECS]
        if lacking:
            e["without"] = {c: self.without.get(c, "UnsupportedCodecError") for c in lacking}
        if self.tags:
            e["tags"] = self.tags
        return e


def codecs_used(blob: bytes) -> set[str]:
    try:
        parts = craft.parse(blob)
    except Exception:
        return set()
    return {codecs.name_of(p["codec"]) for t in parts.tensors for p in t["planes"]}


def write_file(tensors: list[TensorSpec], tree: Any = None, *, align_log2: int = 6,
               parent_id: bytes | None = None, metadata: dict[str, str] | None = None,
               policy: str = "auto-1.0", minor: int | None = None) -> bytes:
    """The vectors frozen before format 1.1 are 1.0 files, written under ``auto-1.0``.
    ``minor`` pins the header's minor version where a suite's files must keep declaring theirs
    after the writer's default moves on."""
    buf = io.BytesIO()
    w = Writer(buf, align_log2=align_log2, parent_id=parent_id, policy=policy)
    for t in tensors:
        dt = dtypes.by_name(t.dtype)
        if t.coded is not None:
            w.add_coded(t.name, dt, t.shape, t.coded, hashing.content_hash(t.raw),
                        parent_hash=None if t.parent is None else hashing.content_hash(t.parent))
        else:
            parent = None if t.parent is None else Tensor(dt, t.shape, t.parent)
            w.add(t.name, Tensor(dt, t.shape, t.raw), parent=parent)
    w.set_tree(tree)
    if metadata:
        w.set_metadata(metadata)
    w.close()
    if minor is None or minor == w.minor:
        return buf.getvalue()
    return edited(buf.getvalue(), lambda p: p.header.update(minor=minor))


def valid(vid: str, description: str, rules: list[str], tensors: list[TensorSpec],
          tree: Any = None, tags: list[str] | None = None, **kw: Any) -> Vector:
    if tree is None:
        tree = {t.name: TensorRef(i) for i, t in enumerate(tensors)}
    data = write_file(tensors, tree, **kw)
    return Vector(vid, description, rules, data, tensors=[t.expected() for t in tensors],
                  tree=tree_to_json(tree), tags=tags or [])


def force(raw: np.ndarray, dtype: str, layout: Layout, plane_codecs: list[Any],
          modes: dict[int, int] | None = None) -> CodedTensor:
    """Code ``raw`` with ``layout`` and the given codec per plane (a codec ID, a codec instance
    or a callable returning (payload, params)); ``modes`` maps plane number -> the rANS mode
    byte its stream must have (checked: vectors must exercise what they claim)."""
    dt = dtypes.by_name(dtype)
    fields = layout.planes(dt.itemsize)
    planes = []
    for k, (f, plane) in enumerate(zip(fields, layout.split(raw, dt.itemsize), strict=True)):
        c = plane_codecs[k]
        if callable(c) and not hasattr(c, "encode"):
            payload, params, cid = c(plane)
        else:
            codec = codecs.get(c) if isinstance(c, int) else c
            enc = codec.encode(plane)
            if enc is None:
                raise ValueError(f"codec {codec.name} declined plane {f.label} of {dtype}")
            payload, params, cid = bytes(np.asarray(enc.payload, np.uint8).tobytes()
                                         if not isinstance(enc.payload, bytes)
                                         else enc.payload), enc.params, codec.codec_id
        if modes and k in modes and payload[0] != modes[k]:
            raise AssertionError(f"plane {f.label}: rANS mode {payload[0]}, wanted {modes[k]}")
        planes.append(CodedPlane(f.kind, f.index, cid, plane.size, payload, params))
    return CodedTensor(layout, tuple(planes))


def zstd_frame(*, checksum: bool = False, level: int = 3, params: bytes = b"\x03"):
    def code(plane: np.ndarray) -> tuple[bytes, bytes, int]:
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=checksum,
                                        write_content_size=True)
        return cctx.compress(plane.tobytes()), params, codecs.ZSTD
    return code


def zstd_windowed(log2: int):
    """A frame coded with a 1 KiB window, so that its header has a Window_Descriptor (it is
    not one segment), then that descriptor set to declare 2^log2 bytes: the data decodes the
    same."""
    def code(plane: np.ndarray) -> tuple[bytes, bytes, int]:
        zp = zstandard.ZstdCompressionParameters.from_level(3, window_log=10,
                                                            write_content_size=True)
        frame = bytearray(zstandard.ZstdCompressor(compression_params=zp)
                          .compress(plane.tobytes()))
        if frame[4] & 0x20:
            raise AssertionError("a single-segment frame has no Window_Descriptor")
        frame[5] = (log2 - 10) << 3
        return bytes(frame), b"\x03", codecs.ZSTD
    return code


# -- valid vectors ----------------------------------------------------------------------------

def dtype_vectors() -> list[Vector]:
    out = []
    for dt in dtypes.BY_CODE.values():
        small = rand_bytes(100 + dt.code, 6 * dt.itemsize)
        # Big enough for the writer to split, and compressible so the split is kept.
        big = np.repeat(rand_bytes(200 + dt.code, 512 * dt.itemsize).reshape(512, dt.itemsize),
                        4, axis=0).reshape(-1)
        if dt.name in ("bfloat16",):
            big = weights_bf16(dt.code, 2048).view(np.uint8)
        elif dt.name in ("float32", "complex64"):
            big = weights_f32(dt.code, big.size // 4).view(np.uint8)
        n_big = big.size // dt.itemsize
        tensors = [TensorSpec("small", dt.name, (2, 3), small),
                   TensorSpec("big", dt.name, (n_big,), big)]
        out.append(valid(f"dtype_{dt.name}", f"{dt.name} (code {dt.code}): a 2x3 tensor (raw "
                         "layout) and a larger one in the writer's layout for the dtype",
                         ["format.md#5", "planes.md"], tensors))
    return out


def codec_vectors() -> list[Vector]:
    out = []
    w = weights_bf16(1, 5000).view(np.uint8).copy()
    out.append(valid("codec_raw_bitpack_zstd", "bf16 split: sign bitpack, exponent zstd "
                     "(params 03), mantissa raw; a bool tensor bitpacked with n % 8 != 0",
                     ["codecs.md#1", "codecs.md#2", "codecs.md#3"],
                     [TensorSpec("w", "bfloat16", (50, 100), w,
                                 force(w, "bfloat16", layouts.BF16,
                                       [codecs.BITPACK, codecs.ZSTD, codecs.RAW])),
                      TensorSpec("mask", "bool", (1001,), (rand_bytes(2, 1001) & 1),
                                 force(rand_bytes(2, 1001) & 1, "bool", layouts.RAW,
                                       [codecs.BITPACK]))]))
    z = weights_bf16(3, 3000).view(np.uint8).copy()
    out.append(valid("codec_zstd_variants", "zstd frames: empty params, a frame with "
                     "Content_Checksum, level 19 (params ignored by readers)", ["codecs.md#3"],
                     [TensorSpec("a", "bfloat16", (3000,), z,
                                 force(z, "bfloat16", layouts.BF16,
                                       [zstd_frame(params=b""), zstd_frame(checksum=True),
                                        zstd_frame(level=19, params=b"\x13")]))]))
    out.append(valid("codec_zstd_window_2p27", "a zstd frame whose Window_Descriptor declares "
                     "2^27 bytes, the most a reader must accept (its content needs 1 KiB)",
                     ["codecs.md#3"],
                     [TensorSpec("a", "bfloat16", (3000,), z,
                                 force(z, "bfloat16", layouts.BF16,
                                       [codecs.BITPACK, zstd_windowed(27), codecs.RAW]))]))
    # rANS: one vector per mode, the mode byte checked when the vector is built.
    n = 5000
    exp_rans = weights_bf16(4, n).view(np.uint8).copy()
    one_binade = (weights_bf16(5, n) & np.uint16(0x807F)) | np.uint16(0x3F80)
    per_block = ((weights_bf16(6, n) & np.uint16(0x807F))
                 | ((np.arange(n) // 256 % 5 + 118).astype(np.uint16) << 7))
    r8 = RansCodec(8)
    out.append(valid("rans_modes", "S4 rANS in each mode: RANS (log2_block 8, 20 blocks, the "
                     "last partial), CONST with one symbol (log2_block 20), CONST per block "
                     "(5 symbols, one per 256-symbol block), RAW (uniform bytes), and RAW of "
                     "an empty plane",
                     ["rans.md#2", "rans.md#5", "rans.md#6", "rans.md#7"],
                     [TensorSpec("rans", "bfloat16", (n,), exp_rans,
                                 force(exp_rans, "bfloat16", layouts.BF16,
                                       [codecs.BITPACK, r8, r8], {1: MODE_RANS, 2: MODE_RAW})),
                      TensorSpec("const", "bfloat16", (n,), one_binade.view(np.uint8),
                                 force(one_binade.view(np.uint8), "bfloat16", layouts.BF16,
                                       [r8, r8, codecs.RAW], {1: MODE_CONST})),
                      TensorSpec("block_const", "bfloat16", (n,), per_block.view(np.uint8),
                                 force(per_block.view(np.uint8), "bfloat16", layouts.BF16,
                                       [codecs.BITPACK, r8, codecs.RAW], {1: MODE_CONST})),
                      TensorSpec("raw_mode", "float32", (n,), weights_f32(7, n).view(np.uint8),
                                 force(weights_f32(7, n).view(np.uint8), "float32",
                                       layouts.FP32, [codecs.BITPACK, r8, codecs.RAW,
                                                      codecs.RAW, r8], {4: MODE_RAW})),
                      TensorSpec("empty", "bfloat16", (0,), np.zeros(0, np.uint8),
                                 force(np.zeros(0, np.uint8), "bfloat16", layouts.RAW, [r8],
                                       {0: MODE_RAW}))]))
    # GDeflate: page 0 compressible, page 1 random (stored RAW), page 2 partial (100 bytes).
    n = 2 * 65536 + 100
    low = (rand_bytes(8, n) & 0x0F)
    low[65536:131072] = rand_bytes(9, 65536)
    h = (np.uint16(0x3C00) | low.astype(np.uint16))
    gd = codecs.get(codecs.GDEFLATE)
    out.append(valid("gdeflate_pages", "GDeflate: a 3-page mantissa plane (a compressed page, "
                     "a RAW page of random bytes, a partial 100-byte page) and an empty plane "
                     "(page_count 0)", ["gdeflate.md#3", "gdeflate.md#5"],
                     [TensorSpec("h", "float16", (n,), h.view(np.uint8),
                                 force(h.view(np.uint8), "float16", layouts.FP16,
                                       [codecs.BITPACK, codecs.RANS, codecs.RANS, gd])),
                      TensorSpec("empty", "float16", (0, 7), np.zeros(0, np.uint8),
                                 force(np.zeros(0, np.uint8), "float16", layouts.RAW,
                                       [gd]))]))
    return out


def layout_vectors() -> list[Vector]:
    """Any layout applies to any dtype whose raw length is whole words (planes.md)."""
    def mk(name: str, dtype: str, layout: Layout, seed: int) -> TensorSpec:
        size = dtypes.by_name(dtype).itemsize
        # 16 random elements repeated: every plane compresses, so the split keeps the size
        # guarantee (format.md §14) whatever the layout.
        raw = np.tile(rand_bytes(seed, 16 * size), 2048 // size)
        fields = layout.planes(size)
        plane_codecs = [codecs.BITPACK if f.kind == layouts.KIND_SIGN else codecs.ZSTD
                        for f in fields]
        return TensorSpec(name, dtype, (raw.size // size,), raw,
                          force(raw, dtype, layout, plane_codecs))
    tensors = [mk("bf16_on_int16", "int16", layouts.BF16, 1),
               mk("fp16_on_complex32", "complex32", layouts.FP16, 2),
               mk("fp32_on_int32", "int32", layouts.FP32, 3),
               mk("fp32_on_complex64", "complex64", layouts.FP32, 4),
               mk("bytes_on_complex128", "complex128", layouts.BYTES, 5),
               mk("bytes_on_bfloat16", "bfloat16", layouts.BYTES, 6),
               mk("bytes_on_uint8", "uint8", layouts.BYTES, 7),
               mk("bf16_on_uint8", "uint8", layouts.BF16, 8),
               mk("raw_on_float64", "float64", layouts.RAW, 9)]
    return [valid("layouts_any_dtype", "every layout on dtypes it is not the writer's choice "
                  "for (bf16 on int16 and uint8, fp32 on int32, bytes on complex128 with 16 "
                  "planes, ...); sign planes bitpacked, the others zstd",
                  ["planes.md#layout-registry"], tensors)]


def shape_vectors() -> list[Vector]:
    z = np.zeros(0, np.uint8)
    f32 = dtypes.by_name("float32")
    tensors = [
        TensorSpec("scalar_f32", "float32", (), np.array([-2.5], "<f4").view(np.uint8)),
        TensorSpec("scalar_i64", "int64", (), np.array([-(2 ** 63)], "<i8").view(np.uint8)),
        TensorSpec("scalar_bool", "bool", (), np.array([1], np.uint8)),
        TensorSpec("empty_1d", "float32", (0,), z),
        TensorSpec("wide_empty", "float32", (0, 2 ** 40), z),
        TensorSpec("empty_wide", "bfloat16", (2 ** 40, 0), z),
        TensorSpec("empty_mid", "int64", (3, 0, 5), z),
        TensorSpec("empty_split", "float32", (0, 4), z,
                   force(z, "float32", layouts.FP32, [codecs.RAW, codecs.BITPACK, codecs.RAW,
                                                      codecs.RAW, codecs.RAW])),
        TensorSpec("empty_zstd", "float32", (0,), z,
                   force(z, "float32", layouts.RAW, [zstd_frame()])),
        TensorSpec("ones_64d", "float32", (1,) * 64, np.array([7.0], "<f4").view(np.uint8)),
        TensorSpec("ones_63d_by_3", "int16", (1,) * 63 + (3,),
                   np.array([1, -1, 32767], "<i2").view(np.uint8)),
        TensorSpec("", "uint8", (1,), np.array([42], np.uint8)),
        TensorSpec("名前/ünïcödé 🙂 \x00 nul", "int8", (2,), np.array([1, 255], np.uint8)),
    ]
    assert f32.itemsize == 4
    return [valid("shapes_edge", "0-d tensors, empty tensors incl. shapes (0, 2^40) and "
                  "(2^40, 0), an empty tensor split into five zero-length planes, 64 dims of "
                  "size 1, an empty name and a Unicode name with NUL",
                  ["format.md#41-tensorrecord", "validation.md#T3", "validation.md#T4",
                   "validation.md#X2"], tensors)]


def alignment_vectors() -> list[Vector]:
    out = []
    for a in (0, 1, 3, 12, 16):
        w = weights_bf16(20 + a, 2048).view(np.uint8).copy()
        tensors = [TensorSpec("b", "uint8", (13,), rand_bytes(30 + a, 13)),
                   TensorSpec("c", "int16", (3,), rand_bytes(40 + a, 6))]
        if a < 16:  # at 2^16 each of its planes would cost up to 64 KiB of padding
            tensors.insert(0, TensorSpec("w", "bfloat16", (2048,), w))
        out.append(valid(f"align_{a}", f"align_log2 = {a} (alignment {1 << a})",
                         ["format.md#alignment", "validation.md#P5"], tensors, align_log2=a))
    return out


def container_vectors() -> list[Vector]:
    """Valid files that use the freedom the spec gives writers and readers must accept."""
    out = []
    base = valid("x", "", [], [TensorSpec("a", "float32", (4,), np.arange(4, dtype="<f4")
                                          .view(np.uint8)),
                               TensorSpec("b", "int16", (3,), np.array([5, -5, 0], "<i2")
                                          .view(np.uint8))])

    def variant(vid: str, description: str, rules: list[str], edit: Callable) -> None:
        parts = craft.parse(base.data)
        edited = edit(parts)
        blob = craft.build(parts) if edited is None else edited
        out.append(Vector(vid, description, rules, blob, tensors=base.tensors, tree=base.tree))

    variant("minor_version_9", "minor version 9: every minor of major 1 is read",
            ["README.md#versioning", "validation.md#H3"],
            lambda p: p.header.update(minor=9))
    variant("optional_flags_all", "every optional flag bit set: ignored",
            ["format.md#flags", "validation.md#H5"],
            lambda p: p.header.update(optional_flags=0xFFFFFFFF))
    variant("extension_optional", "an index extension with required = 0 and an unknown tag",
            ["format.md#11-index-extensions", "validation.md#I3"],
            lambda p: p.index["extensions"].append(dict(tag="future", required=0,
                                                        data=b"ignored")))

    def reorder(p: craft.Parts) -> bytes:
        # Plane payloads in reverse index order: the data section's order is free.
        t0, t1 = p.tensors[0]["planes"][0], p.tensors[1]["planes"][0]
        d0, d1 = craft.plane_bytes(p, 0, 0), craft.plane_bytes(p, 1, 0)
        p.data = bytes(32) + d1 + bytes(64 - len(d1)) + d0
        t1["offset"], t0["offset"] = 64, 128
        p.data = p.data[:96 + len(d0)]
        return craft.build(p)
    variant("planes_reordered", "plane payloads stored in reverse index order",
            ["format.md#3-data-section"], reorder)
    meta = {"framework": "torch 2.4", "step": "1200", "": "empty key", "ünï": "cödé"}
    out.append(valid("metadata", "non-empty metadata (str -> str, Unicode, empty key)",
                     ["format.md#44-metadata", "validation.md#X5"],
                     [TensorSpec("a", "uint8", (3,), np.array([1, 2, 3], np.uint8))],
                     metadata=meta))
    out.append(Vector("appendix_a", "the annotated file of format.md Appendix A, byte for byte",
                      ["format.md#appendix-a-a-complete-file-annotated"], appendix_a(),
                      tensors=[dict(name="w", dtype="float32", shape=[2],
                                    sha256=hashlib.sha256(np.array([0.0, 1.0], "<f4")
                                                          .tobytes()).hexdigest())],
                      tree=tree_to_json({"w": TensorRef(0)})))
    return out


def appendix_a() -> bytes:
    blob = write_file([TensorSpec("w", "float32", (2,), np.array([0.0, 1.0], "<f4")
                                  .view(np.uint8))], {"w": TensorRef(0)})
    assert len(blob) == 246 and blob[24:32].hex() == "955f36f4166f1672", "Appendix A changed"
    return blob


def tree_vectors() -> list[Vector]:
    t0 = TensorSpec("t", "float32", (2, 2), np.arange(4, dtype="<f4").view(np.uint8))
    t1 = TensorSpec("s", "int64", (), np.array([7], "<i8").view(np.uint8))
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]
    neg_qnan = struct.unpack("<d", struct.pack("<Q", 0xFFF8DEADBEEF0001))[0]
    tree = {
        "none": None, "false": False, "true": True,
        "ints": [0, 1, -1, 2 ** 63 - 1, -(2 ** 63)],
        "bigints": [2 ** 63, -(2 ** 63) - 1, 2 ** 64, -(2 ** 64), 2 ** 200 + 12345, -(3 ** 99),
                    2 ** 64 - 1, 255 << 64],
        "floats": [0.0, -0.0, 1.5, float("inf"), float("-inf"), nan_payload, neg_qnan,
                   5e-324, 1.7976931348623157e308],
        "str": "plain ascii", "unicode": "日本語 ü 🙂 \x00", "empty_str": "",
        "bytes": bytes(range(256)), "empty_bytes": b"",
        "list": [1, [2, [3, []]]], "tuple": (1, "two", (3.0,), ()), "empty_dict": {},
        "odict": OrderedDict([("z", 1), ("a", 2), ("m", OrderedDict())]),
        "keys": {None: 1, True: 2, 0: 3, 2.5: 4, "s": 5, b"b": 6, (1, ("x", None)): 7,
                 TensorRef(1): 8, -(2 ** 70): 9},
        "refs": [TensorRef(0), TensorRef(0), TensorRef(1)],
        "typed": [Typed("torch.Size", (2, 2)), Typed("torch.dtype", "bfloat16"),
                  Typed("torch.device", "cuda:0"), Typed("numpy.ndarray", TensorRef(0)),
                  Typed("numpy.scalar", TensorRef(1)),
                  Typed("s4.view", {"storage": TensorRef(0), "dtype": "float32", "offset": 1,
                                    "shape": (2,), "stride": (2,), "device": "cpu",
                                    "requires_grad": False, "parameter": True}),
                  Typed("s4.attrs", ({"w": TensorRef(0)}, {"_metadata": {"": {"version": 1}}})),
                  Typed("user.unknown.Thing", {"kept": "opaque"})],
    }
    deep: Any = "bottom"
    for i in range(256):
        deep = [deep] if i % 2 else (deep,)
    return [valid("tree_all_tags", "an object tree with every tag: None, bools, i64 extremes, "
                  "big ints, floats (-0.0, infinities, NaN payloads, subnormal), str, bytes, "
                  "list, tuple, dict, ordered dict, tensor references (repeated), every typed "
                  "name of the registry plus an unknown one (opaque), keys of every allowed "
                  "kind", ["objects.md#encoding", "objects.md#rules", "objects.md#typed-values"],
                  [t0, t1], tree),
            valid("tree_depth_256", "a tree nested to depth 256, the limit (the leaf is at "
                  "depth 256)", ["objects.md#rules"], [], deep)]


def f32_specials() -> np.ndarray:
    vals = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
            0x7F800001, 0xFF800001, 0x7FBFFFFF, 0xFFBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
            0x7FC00001, 0x7FA12345, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,
            0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000,
            0x00400000, 0x34000000]
    for sign in (0, 0x80000000):
        for quiet in (0, 0x00400000):
            for b in range(22):  # one payload bit at a time, quiet and signalling
                vals.append(sign | 0x7F800000 | quiet | (1 << b))
    return np.array(vals, dtype="<u4")


def f64_specials() -> np.ndarray:
    vals = [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
            0xFFF8000000000000, 0x7FF0000000000001, 0x7FF7FFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF,
            0x7FF8DEADBEEF0001, 1, (1 << 63) | 1, 0x000FFFFFFFFFFFFF, 0x0010000000000000,
            0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF]
    vals += [0x7FF0000000000000 | (1 << b) for b in range(52)]
    return np.array(vals, dtype="<u8")


def adversarial_vectors() -> list[Vector]:
    out = []
    every = np.arange(65536, dtype="<u2")
    perm = np.argsort(bits(77, 65536), kind="stable").astype("<u2")
    for dt, lay in (("bfloat16", layouts.BF16), ("float16", layouts.FP16)):
        nplanes = len(lay.fields)
        tensors = [TensorSpec("sequential", dt, (256, 256), every.view(np.uint8)),
                   TensorSpec("shuffled", dt, (65536,), perm.view(np.uint8)),
                   TensorSpec("split_forced", dt, (65536,), every.view(np.uint8),
                              force(every.view(np.uint8), dt, lay,
                                    [codecs.BITPACK] + [RansCodec(7)] * (nplanes - 2)
                                    + [codecs.RAW], {k: MODE_CONST for k in (1, nplanes - 2)}))]
        out.append(valid(f"{dt}_all_patterns", f"all 65,536 {dt} bit patterns: in order and "
                         "shuffled (writer's coding), and split with rANS CONST per "
                         "128-symbol block and the low mantissa plane raw",
                         ["planes.md", "format.md#41-tensorrecord"], tensors,
                         tags=["adversarial"]))
    f32 = f32_specials()
    f32_big = np.tile(f32, -(-1024 // f32.size))  # >= 4096 bytes: the writer splits it
    f64 = f64_specials()
    tensors = [
        TensorSpec("f32", "float32", (f32.size,), f32.view(np.uint8)),
        TensorSpec("f32_split", "float32", (f32_big.size,), f32_big.view(np.uint8),
                   force(f32_big.view(np.uint8), "float32", layouts.FP32,
                         [codecs.BITPACK, codecs.RANS, codecs.RANS, codecs.ZSTD, codecs.ZSTD])),
        TensorSpec("f32_tiled", "float32", (f32_big.size,), f32_big.view(np.uint8)),
        TensorSpec("f64", "float64", (f64.size,), f64.view(np.uint8)),
        TensorSpec("c64", "complex64", (f32_big.size // 2,), f32_big.view(np.uint8),
                   force(f32_big.view(np.uint8), "complex64", layouts.FP32,
                         [codecs.BITPACK, codecs.ZSTD, codecs.ZSTD, codecs.ZSTD, codecs.ZSTD])),
        TensorSpec("bool_bytes", "bool", (256,), np.arange(256, dtype=np.uint8)),
    ]
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e8m0fnu", "float4_e2m1fn_x2", "int8", "uint8"):
        tensors.append(TensorSpec(f"all_{name}", name, (16, 16), np.arange(256, dtype=np.uint8)))
    out.append(valid("float_specials", "fp32 NaNs of every class (quiet, signalling, each "
                     "payload bit, both signs), +-Inf, +-0, subnormals, extremes — plain, "
                     "split, and tiled past the split threshold; the same for fp64; complex64 "
                     "with NaN parts; bool bytes 0..255 (stored as they are); all 256 patterns "
                     "of every 1-byte dtype", ["planes.md#fp32-nan-with-payload-0x7fa12345",
                                               "format.md#41-tensorrecord"],
                     tensors, tags=["adversarial"]))
    return out


def delta_vectors() -> list[Vector]:
    w = weights_bf16(40, 4096).view(np.uint8).copy()
    w2 = w.copy()
    w2[::97] ^= 1  # a few mantissa bits change: the XOR delta is mostly zero
    f = weights_f32(41, 2048).view(np.uint8).copy()
    other = rand_bytes(42, 4096)
    base_t = [TensorSpec("w", "bfloat16", (4096,), w), TensorSpec("f", "float32", (2048,), f),
              TensorSpec("gone", "uint8", (4096,), other)]
    base = valid("delta_base", "a base checkpoint (parent of delta_child)", ["format.md#10"],
                 base_t)
    parent_id = checkpoint_id(base_t)
    child_t = [TensorSpec("w", "bfloat16", (4096,), w2, parent=w),
               TensorSpec("f", "float32", (2048,), f, parent=f),
               TensorSpec("new", "int32", (1024,), rand_bytes(43, 4096))]
    child = valid("delta_child", "a delta: w and f are XOR deltas against delta_base, new is "
                  "stored in full", ["format.md#10", "validation.md#A2", "validation.md#R5",
                                     "validation.md#R6"], child_t, parent_id=parent_id)
    child.parent = "delta_base.s4w"
    kinds = [t["transform"] for t in craft.parse(child.data).tensors]
    assert kinds == [1, 1, 0], kinds
    other_t = [TensorSpec("w", "bfloat16", (4096,), w2)]
    other_base = valid("delta_other_base", "another base checkpoint (the wrong parent)",
                       ["format.md#9"], other_t)
    return [base, child, other_base]


def checkpoint_id(tensors: list[TensorSpec]) -> bytes:
    import xxhash
    return xxhash.xxh3_128_digest(struct.pack("<I", len(tensors)) + b"".join(
        hashing.content_hash(t.raw) for t in tensors))


# -- must-fail vectors ------------------------------------------------------------------------

def tree_bytes(obj: Any) -> bytes:
    """``obj`` in the object-tree encoding of spec/objects.md, written here from the spec and
    without the writer's checks: for trees that break a rule on purpose."""
    t = type(obj)
    u32 = struct.Struct("<I").pack
    if obj is None or t is bool:
        return bytes([{None: 0, False: 1, True: 2}[obj]])
    if t is int and -(1 << 63) <= obj < 1 << 63:
        return b"\x03" + struct.pack("<q", obj)
    if t is int:  # O4: L = floor((bitlen(|v|) + 8) / 8)
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        return b"\x04" + u32(len(raw)) + raw
    if t is float:
        return b"\x05" + struct.pack("<d", obj)
    if t is str or t is bytes:
        raw = obj.encode() if t is str else obj
        return (b"\x06" if t is str else b"\x07") + u32(len(raw)) + raw
    if t is list or t is tuple:
        return (b"\x08" if t is list else b"\x09") + u32(len(obj)) \
            + b"".join(tree_bytes(x) for x in obj)
    if t is dict or t is OrderedDict:
        return (b"\x0a" if t is dict else b"\x0d") + u32(len(obj)) \
            + b"".join(tree_bytes(k) + tree_bytes(v) for k, v in obj.items())
    if t is TensorRef:
        return b"\x0b" + u32(obj.index)
    if t is Typed:
        name = obj.name.encode()
        return b"\x0c" + struct.pack("<H", len(name)) + name + tree_bytes(obj.value)
    raise TypeError(f"not an object-tree value: {t.__name__}")


def fail(vid: str, description: str, rules: list[str], error: str, data: bytes,
         parent: str | None = None, file: str | None = None,
         without: dict[str, str] | None = None) -> Vector:
    return Vector(vid, description, rules, data, expect="error", error=error, parent=parent,
                  file=file, without=without or {})


def edited(blob: bytes, edit: Callable[[craft.Parts], Any]) -> bytes:
    parts = craft.parse(blob)
    result = edit(parts)
    return result if isinstance(result, bytes) else craft.build(parts)


def patch(blob: bytes, at: int, new: bytes) -> bytes:
    at = at % len(blob)
    return blob[:at] + new + blob[at + len(new):]


def payload_edited(blob: bytes, plane: tuple[int, int],
                   fn: Callable[[bytearray], Any]) -> bytes:
    """Edit the stored bytes of plane (tensor, plane) in place (same length), checksum fixed."""
    def edit(p: craft.Parts) -> None:
        b = bytearray(craft.plane_bytes(p, *plane))
        fn(b)
        craft.set_plane_bytes(p, *plane, bytes(b))
    return edited(blob, edit)


def replaced(blob: bytes, plane: tuple[int, int], new: bytes | Callable[[bytes], bytes],
             params: bytes | None = None) -> bytes:
    """Give plane (tensor, plane) new stored bytes of any length, appended to the data section
    (and new params, if given), checksum fixed."""
    def edit(p: craft.Parts) -> None:
        old = craft.plane_bytes(p, *plane)
        payload = new(old) if callable(new) else new
        rec = p.tensors[plane[0]]["planes"][plane[1]]
        p.data += bytes(-(len(p.data) + 32) % 64)
        rec.update(offset=32 + len(p.data), stored_len=len(payload),
                   checksum=hashing.plane_checksum(payload))
        if params is not None:
            rec["params"] = params
        p.data += payload
    return edited(blob, edit)


def header_vectors(tiny: bytes) -> list[Vector]:
    h = lambda **kw: edited(tiny, lambda p: p.header.update(**kw))  # noqa: E731
    rest = tiny[8:]
    return [
        fail("magic_png", "a PNG signature instead of the magic", ["validation.md#H1"],
             "BadMagicError", b"\x89PNG\r\n\x1a\n" + rest),
        fail("magic_high_bit_stripped", "magic byte 0 as a 7-bit channel leaves it (09)",
             ["validation.md#H1"], "BadMagicError", b"\x09" + tiny[1:]),
        fail("magic_lf_to_crlf", "the file after a Unix->DOS text conversion: 0A -> 0D 0A "
             "(in the magic and everywhere else)", ["format.md#magic", "validation.md#H1"],
             "BadMagicError", tiny.replace(b"\n", b"\r\n")),
        fail("magic_crlf_to_lf", "the file after a DOS->Unix text conversion: 0D 0A -> 0A",
             ["format.md#magic", "validation.md#H1"], "BadMagicError",
             tiny.replace(b"\r\n", b"\n")),
        fail("empty_file", "0 bytes", ["validation.md#H2"], "TruncatedError", b""),
        fail("magic_prefix_only", "the first 5 bytes of the magic and nothing else",
             ["validation.md#H1", "validation.md#H2"], "TruncatedError", tiny[:5]),
        fail("short_71", "a 71-byte file starting with a valid header", ["validation.md#H2"],
             "TruncatedError", tiny[:71]),
        fail("major_2", "major version 2 (checksum correct)", ["validation.md#H3"],
             "UnsupportedVersionError", h(major=2)),
        fail("major_0", "major version 0 (checksum correct)", ["validation.md#H3"],
             "UnsupportedVersionError", h(major=0)),
        fail("major_2_bad_checksum", "major version 2 and a header checksum for version 1: the "
             "version is checked first", ["validation.md#H3", "validation.md#H4"],
             "UnsupportedVersionError", patch(tiny, 8, b"\x02\x00")),
        fail("header_checksum", "header checksum with one bit flipped", ["validation.md#H4"],
             "ChecksumError", patch(tiny, 24, bytes([tiny[24] ^ 1]))),
        fail("header_byte_damaged", "align_log2 changed without updating the checksum",
             ["validation.md#H4"], "ChecksumError", patch(tiny, 20, b"\x07")),
        fail("required_flag_bit0", "must-understand flag bit 0 set", ["validation.md#H5"],
             "UnsupportedFeatureError", h(required_flags=1)),
        fail("required_flag_bit31", "must-understand flag bit 31 set", ["validation.md#H5"],
             "UnsupportedFeatureError", h(required_flags=1 << 31)),
        fail("header_reserved", "reserved header byte 22 is 01", ["validation.md#H6"],
             "FormatError", h(reserved=b"\x00\x01\x00")),
        fail("align_log2_17", "align_log2 = 17", ["validation.md#H7"], "LimitError",
             h(align_log2=17)),
        fail("align_log2_255", "align_log2 = 255", ["validation.md#H7"], "LimitError",
             h(align_log2=255)),
    ]


def footer_vectors(tiny: bytes) -> list[Vector]:
    size = len(tiny)
    foot = craft.parse(tiny).footer

    def with_footer(**kw: int) -> bytes:
        return craft.with_footer(tiny, **kw)
    return [
        fail("end_magic_damaged", "the end magic's last byte changed", ["validation.md#F1"],
             "TruncatedError", patch(tiny, -1, b"E")),
        fail("trailing_garbage", "16 bytes appended after the footer", ["validation.md#F1"],
             "TruncatedError", tiny + bytes(16)),
        fail("footer_checksum", "footer checksum with one bit flipped", ["validation.md#F2"],
             "ChecksumError", patch(tiny, -16, bytes([tiny[-16] ^ 0x80]))),
        fail("index_length_over_size", "index_length = file size + 1", ["validation.md#F3"],
             "LimitError", with_footer(index_length=size + 1)),
        fail("index_length_2p63", "index_length = 2^63", ["validation.md#F3"], "LimitError",
             with_footer(index_length=1 << 63)),
        fail("index_offset_wrong", "the index does not end where the footer starts",
             ["validation.md#F4"], "FormatError",
             with_footer(index_offset=foot["index_offset"] - 1)),
        fail("index_offset_in_header", "index_offset 16 (inside the header)",
             ["validation.md#F4"], "FormatError",
             with_footer(index_offset=16, index_length=size - 56)),
        fail("index_offset_wraps", "index_offset = 2^64 - 1: index_offset + index_length wraps "
             "a 64-bit sum", ["validation.md#F4", "validation.md#arithmetic"], "FormatError",
             with_footer(index_offset=(1 << 64) - 1)),
    ]


def index_vectors(tiny: bytes) -> list[Vector]:
    parts = craft.parse(tiny)
    idx = craft.Index.build(parts.index)

    def raw_index(new: bytes) -> bytes:
        return craft.build(craft.parse(tiny), index=new)

    def t(**kw: Any) -> bytes:
        return edited(tiny, lambda p: p.tensors[0].update(**kw))

    def pl(**kw: Any) -> bytes:
        return edited(tiny, lambda p: p.tensors[0]["planes"][0].update(**kw))
    name_at = idx.index(b"\x01\x00w") + 2
    ext = dict(tag="future", required=1, data=b"")
    return [
        fail("index_checksum", "index checksum (footer) with one bit flipped, the footer's "
             "own checksum recomputed", ["validation.md#I1"], "ChecksumError",
             craft.with_footer(tiny, index_checksum=craft.parse(tiny).footer["index_checksum"]
                               ^ 4)),
        fail("index_byte_damaged", "a byte of the index changed, checksum not updated",
             ["validation.md#I1"], "ChecksumError", patch(tiny, len(tiny) - 41,
                                                          bytes([tiny[-41] ^ 1]))),
        fail("index_magic", "index magic S4IY", ["validation.md#I2"], "FormatError",
             raw_index(b"S4IY" + idx[4:])),
        fail("index_trailing_byte", "one byte after the last extension", ["validation.md#I2"],
             "FormatError", raw_index(idx + b"\x00")),
        fail("index_cut_short", "the index ends inside the extension count",
             ["validation.md#I2"], "FormatError", raw_index(idx[:-1])),
        fail("tensor_count_too_big", "tensor_count 2 with one record",
             ["validation.md#I2"], "FormatError", raw_index(idx[:4] + b"\x02" + idx[5:])),
        fail("name_not_utf8", "a tensor name that is not UTF-8 (FF)", ["validation.md#I2"],
             "FormatError", raw_index(idx[:name_at] + b"\xff" + idx[name_at + 1:])),
        fail("extension_required", "an unknown must-understand extension",
             ["validation.md#I3"], "UnsupportedFeatureError",
             edited(tiny, lambda p: p.index["extensions"].append(ext))),
        fail("tensor_flags", "tensor record flags = 1", ["validation.md#T1"],
             "UnsupportedFeatureError", t(flags=1)),
        fail("dtype_0", "dtype code 0", ["validation.md#T2"], "UnsupportedFeatureError",
             t(dtype=0)),
        fail("dtype_23", "dtype code 23 (unassigned)", ["validation.md#T2"],
             "UnsupportedFeatureError", t(dtype=23)),
        fail("ndim_65", "65 dimensions of size 1", ["validation.md#T3"], "LimitError",
             t(ndim=65, shape=[1] * 63 + [2, 1])),
        fail("raw_nbytes_2p63", "raw_nbytes = 2^63", ["validation.md#T4"], "LimitError",
             t(raw_nbytes=1 << 63)),
        fail("shape_product_overflow", "shape (2^32, 2^32, 2^32): the product wraps 64 bits "
             "to 0", ["validation.md#T4", "validation.md#arithmetic"], "LimitError",
             t(ndim=3, shape=[1 << 32] * 3, raw_nbytes=0)),
        fail("raw_nbytes_mismatch", "raw_nbytes 12 for a float32 [2]", ["validation.md#T5"],
             "FormatError", t(raw_nbytes=12)),
        fail("transform_2", "transform 2 (unassigned)", ["validation.md#T6"],
             "UnsupportedFeatureError", t(transform=2)),
        fail("layout_5", "layout 5 (unassigned)", ["validation.md#T7"],
             "UnsupportedFeatureError", t(layout=5)),
        fail("layout_word_mismatch", "uint8 [3] with the bf16 layout (2-byte words)",
             ["validation.md#T8"], "FormatError",
             t(dtype=2, shape=[3], raw_nbytes=3, layout=1)),
        fail("plane_count_wrong", "the fp32 layout with one plane record",
             ["validation.md#T9"], "FormatError", t(layout=3)),
        fail("plane_kind_wrong", "plane record kind exponent where the raw layout has raw",
             ["validation.md#P1"], "FormatError", pl(kind=2)),
        fail("decoded_len_wrong", "decoded_len 4 for an 8-byte raw plane",
             ["validation.md#P2"], "FormatError", pl(decoded_len=4)),
        fail("codec_0", "codec ID 0 (never assigned)", ["validation.md#P3"],
             "UnsupportedCodecError", pl(codec=0)),
        fail("codec_7", "codec ID 7 (unassigned)", ["validation.md#P3"],
             "UnsupportedCodecError", pl(codec=7)),
        fail("codec_65535", "codec ID 65535", ["validation.md#P3"], "UnsupportedCodecError",
             pl(codec=65535)),
        fail("declared_2p62", "uint8 shape (2^62,): raw_nbytes 2^62 (the limit) from an "
             "8-byte raw plane", ["validation.md#T4", "validation.md#P4"], "LimitError",
             edited(tiny, lambda p: (p.tensors[0].update(dtype=2, shape=[1 << 62],
                                                         raw_nbytes=1 << 62),
                                     p.tensors[0]["planes"][0].update(decoded_len=1 << 62)))),
        fail("declared_2p62_plus_1", "uint8 shape (2^62 + 1,)", ["validation.md#T4"],
             "LimitError",
             edited(tiny, lambda p: (p.tensors[0].update(dtype=2, shape=[(1 << 62) + 1],
                                                         raw_nbytes=(1 << 62) + 1)))),
        fail("declared_zstd_over_bound", "a zstd plane declaring more than 32768 x stored + 18 "
             "bytes", ["validation.md#P4", "codecs.md#3"], "LimitError",
             edited(tiny, lambda p: (p.tensors[0].update(dtype=2, shape=[8 * 32768 + 19],
                                                         raw_nbytes=8 * 32768 + 19),
                                     p.tensors[0]["planes"][0].update(
                                         codec=3, decoded_len=8 * 32768 + 19)))),
        fail("stored_len_2p64_minus_1", "a zstd plane with stored_len 2^64 - 1 (offset + "
             "stored_len wraps 64 bits)", ["validation.md#P6", "validation.md#arithmetic"],
             "FormatError", pl(codec=3, stored_len=(1 << 64) - 1)),
        fail("stored_len_2p63", "a raw plane with stored_len 2^63 and decoded_len matching "
             "the tensor", ["validation.md#P4", "validation.md#P6"], "FormatError",
             pl(stored_len=1 << 63)),
        fail("offset_unaligned", "plane offset 65 with alignment 64", ["validation.md#P5"],
             "FormatError", pl(offset=65)),
        fail("offset_in_header", "plane offset 0", ["validation.md#P5"], "FormatError",
             edited(tiny, lambda p: (p.header.update(align_log2=0),
                                     p.tensors[0]["planes"][0].update(offset=0)))),
        fail("plane_past_data", "a plane that runs into the index", ["validation.md#P6"],
             "FormatError", pl(offset=128)),
        fail("plane_offset_wraps", "offset 2^64 - 64: offset + stored_len wraps 64 bits",
             ["validation.md#P6", "validation.md#arithmetic"], "FormatError",
             pl(offset=(1 << 64) - 64)),
    ]


def cross_vectors(two: bytes) -> list[Vector]:
    def tree(raw: bytes) -> bytes:
        return edited(two, lambda p: p.index.update(tree=raw))

    def meta(raw: bytes) -> bytes:
        return edited(two, lambda p: p.index.update(metadata=raw))
    s = lambda text: b"\x06" + struct.pack("<I", len(text)) + text  # noqa: E731
    deep = b"\x08\x01\x00\x00\x00" * 257 + b"\x00"
    return [
        fail("duplicate_names", "two tensors named a", ["validation.md#X1"], "FormatError",
             edited(two, lambda p: p.tensors[1].update(name="a"))),
        fail("planes_overlap", "two planes at the same offset", ["validation.md#X2"],
             "FormatError", edited(two, lambda p: p.tensors[1]["planes"][0].update(
                 offset=p.tensors[0]["planes"][0]["offset"]))),
        fail("delta_without_parent_id", "a tensor with transform 1 in a file with no parent",
             ["validation.md#X3"], "FormatError",
             edited(two, lambda p: p.tensors[0].update(transform=1, parent_hash=bytes(16)))),
        fail("tree_unknown_tag", "object tag 0E", ["validation.md#X4", "objects.md#encoding"],
             "FormatError", tree(b"\x0e")),
        fail("tree_trailing", "a byte after the root node", ["objects.md#rules"],
             "FormatError", tree(b"\x00\x00")),
        fail("tree_empty", "an empty tree field", ["objects.md#rules"], "FormatError",
             tree(b"")),
        fail("tree_depth_257", "lists nested 257 deep", ["objects.md#rules"], "LimitError",
             tree(deep)),
        fail("tree_count_too_big", "a list claiming 2^32 - 1 items", ["objects.md#rules"],
             "FormatError", tree(b"\x08\xff\xff\xff\xff\x00")),
        fail("tree_bigint_in_i64", "tag 04 for the value 1", ["objects.md#rules"],
             "FormatError", tree(b"\x04\x01\x00\x00\x00\x01")),
        fail("tree_bigint_long", "2^64 as a big int with a redundant byte",
             ["objects.md#rules"], "FormatError",
             tree(b"\x04\x0a\x00\x00\x00" + (1 << 64).to_bytes(10, "little"))),
        fail("tree_dup_keys", "dict keys 1 and True (equal)", ["objects.md#rules"],
             "FormatError", tree(b"\x0a\x02\x00\x00\x00\x03" + (1).to_bytes(8, "little")
                                 + b"\x00\x02\x00")),
        fail("tree_list_key", "a list as a dict key", ["objects.md#rules"], "FormatError",
             tree(b"\x0a\x01\x00\x00\x00\x08\x00\x00\x00\x00\x00")),
        fail("tree_ref_out_of_range", "tensor reference 2 of 2 tensors", ["objects.md#rules"],
             "FormatError", tree(b"\x0b\x02\x00\x00\x00")),
        fail("tree_bad_utf8", "a surrogate (ED A0 80) in a string", ["objects.md#rules"],
             "FormatError", tree(s(b"\xed\xa0\x80"))),
        fail("tree_truncated", "a string whose length runs past the field",
             ["objects.md#rules"], "FormatError", tree(b"\x06\x05\x00\x00\x00ab")),
        fail("metadata_list", "metadata that is a list", ["validation.md#X5"], "FormatError",
             meta(b"\x08\x00\x00\x00\x00")),
        fail("metadata_int_value", "metadata {'k': 1}", ["validation.md#X5"], "FormatError",
             meta(b"\x0a\x01\x00\x00\x00" + s(b"k") + b"\x03" + bytes(8))),
        fail("metadata_tensor_ref", "metadata {'k': tensor 0}", ["validation.md#X5"],
             "FormatError", meta(b"\x0a\x01\x00\x00\x00" + s(b"k") + b"\x0b" + bytes(4))),
    ]


# P4 of a plane before h's GDeflate plane: every reader owes it, with GDeflate or without
P4_FIRST = {"gdeflate": "LimitError"}


def read_vectors() -> list[Vector]:
    """R rules: the file opens; reading a tensor fails."""
    n = 4087  # n % 8 = 7: the bitpacked sign plane has unused high bits
    w = weights_bf16(60, n).view(np.uint8).copy()
    H_N = 66000  # two GDeflate pages, the second partial
    h = (np.uint16(0x3C00) | (rand_bytes(61, H_N) & 0x01).astype(np.uint16)).view(np.uint8)
    r8 = RansCodec(8)
    base = write_file([
        TensorSpec("w", "bfloat16", (n,), w, force(w, "bfloat16", layouts.BF16,
                                                   [codecs.BITPACK, r8, codecs.ZSTD],
                                                   {1: MODE_RANS})),
        TensorSpec("h", "float16", (H_N,), h,
                   force(h, "float16", layouts.FP16, [r8, r8, r8,
                                                      codecs.get(codecs.GDEFLATE)],
                         {0: MODE_CONST, 1: MODE_CONST, 2: MODE_CONST})),
        TensorSpec("r", "int32", (4,), np.arange(4, dtype="<i4").view(np.uint8)),
    ])
    W_SIGN, W_EXP, W_MANT = (0, 0), (0, 1), (0, 2)
    H_MANT1, _R_RAW = (1, 3), (2, 0)

    def payload_edit(plane: tuple[int, int], fn: Callable[[bytearray], Any]) -> bytes:
        return payload_edited(base, plane, fn)

    def replace(plane: tuple[int, int], new: bytes | Callable[[bytes], bytes],
                params: bytes | None = None) -> bytes:
        return replaced(base, plane, new, params)

    def set_u32(at: int, value: int) -> Callable[[bytearray], None]:
        return lambda b: b.__setitem__(slice(at, at + 4), struct.pack("<I", value))

    zc = zstandard.ZstdCompressor(level=3, write_content_size=False)
    mant = layouts.BF16.split(w, 2)[2].tobytes()
    rans_stream = craft.plane_bytes(craft.parse(base), *W_EXP)
    nb = -(-n // 256)
    table_len = _rans_table_len(rans_stream)
    states_at = 12 + table_len + 4 * nb
    out = [
        Vector("read_base", "the valid file the R-rule vectors below are made from: bitpack "
               "with n % 8 = 7, rANS RANS and CONST, zstd, GDeflate (2 pages), raw", [], base,
               tensors=[TensorSpec("w", "bfloat16", (n,), w).expected(),
                        TensorSpec("h", "float16", (H_N,), h).expected(),
                        TensorSpec("r", "int32", (4,), np.arange(4, dtype="<i4")
                                   .view(np.uint8)).expected()],
               tree=None),
        fail("plane_checksum", "a stored byte of the raw plane changed, checksum not updated",
             ["validation.md#R1"], "ChecksumError",
             edited(base, lambda p: setattr(p, "data", p.data[:-1] + bytes([p.data[-1] ^ 1])))),
        fail("content_hash", "tensor r's content hash with one bit flipped",
             ["validation.md#R6"], "ContentHashError",
             edited(base, lambda p: p.tensors[2].update(
                 content_hash=bytes([p.tensors[2]["content_hash"][0] ^ 1])
                 + p.tensors[2]["content_hash"][1:]))),
        fail("merge_sign_bit_2", "bf16 sign plane stored raw holding the value 2 (wider than "
             "its 1-bit field)", ["validation.md#R4", "planes.md#words-and-fields"],
             "FormatError", _raw_sign_plane(base, n)),
        fail("raw_params", "raw codec with a parameter byte", ["codecs.md#1"], "CodecError",
             edited(base, lambda p: p.tensors[2]["planes"][0].update(params=b"\x00"))),
        fail("bitpack_high_bits", "bitpack: an unused high bit of the last byte set",
             ["codecs.md#2"], "CodecError",
             payload_edit(W_SIGN, lambda b: b.__setitem__(-1, b[-1] | 0x80))),
        fail("bitpack_short", "bitpack: one stored byte missing, so decoded_len exceeds 8 x "
             "stored_len (checked before decoding)", ["validation.md#P4", "codecs.md#2"],
             "LimitError", replace(W_SIGN, lambda old: old[:-1]), without=P4_FIRST),
        fail("zstd_no_content_size", "zstd frame without Frame_Content_Size", ["codecs.md#3"],
             "CodecError", replace(W_MANT, zc.compress(mant))),
        fail("zstd_wrong_content_size", "zstd frame whose content size is one byte short",
             ["codecs.md#3"], "CodecError",
             replace(W_MANT, zstandard.ZstdCompressor(level=3).compress(mant[:-1]))),
        fail("zstd_trailing_bytes", "a byte after the zstd frame", ["codecs.md#3"],
             "CodecError", replace(W_MANT, lambda old: old + b"\x00")),
        fail("zstd_skippable_frame", "a skippable frame before the zstd frame",
             ["codecs.md#3"], "CodecError",
             replace(W_MANT, lambda old: b"\x50\x2a\x4d\x18" + bytes(4) + old)),
        fail("zstd_params_2", "zstd params of 2 bytes", ["codecs.md#3"], "CodecError",
             edited(base, lambda p: p.tensors[0]["planes"][2].update(params=b"\x03\x00"))),
        fail("zstd_bad_content_checksum", "zstd frame with a wrong Content_Checksum",
             ["codecs.md#3"], "CodecError",
             replace(W_MANT, lambda old: (lambda f: f[:-1] + bytes([f[-1] ^ 1]))(
                 zstandard.ZstdCompressor(level=3, write_checksum=True).compress(mant)))),
        fail("zstd_window_2p28", "a zstd frame whose Window_Descriptor declares 2^28 bytes "
             "(its content, 4,087 bytes, needs 1 KiB)", ["codecs.md#3"], "CodecError",
             replace(W_MANT, zstd_windowed(28)(np.frombuffer(mant, np.uint8))[0])),
        fail("rans_mode_3", "rANS mode byte 3", ["rans.md#6"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(0, 3))),
        fail("rans_reserved", "rANS reserved field 1", ["rans.md#6"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(2, 1))),
        fail("rans_log2_block_4", "rANS log2_block 4", ["rans.md#6"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(1, 4))),
        fail("rans_n_mismatch", "rANS n one more than the plane", ["rans.md#6"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(4, b[4] + 1))),
        fail("rans_params", "rANS with a parameter byte", ["rans.md#2"], "CodecError",
             edited(base, lambda p: p.tensors[0]["planes"][1].update(params=b"\x00"))),
        fail("rans_table_sum", "rANS table whose first frequency is one higher (sum 4097)",
             ["rans.md#3"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(44, b[44] + 1))),
        fail("rans_final_state_low", "rANS block 0 lane 0 final state 2^15 - 1",
             ["rans.md#6"], "CodecError", payload_edit(W_EXP, set_u32(states_at, 0x7FFF))),
        fail("rans_final_state_changed", "rANS block 0 lane 5 final state changed",
             ["rans.md#5", "rans.md#6"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(states_at + 20, b[states_at + 20] ^ 1))),
        fail("rans_word_count", "rANS block 0 word count + 1 (words no longer add up)",
             ["rans.md#6"], "CodecError",
             payload_edit(W_EXP, lambda b: b.__setitem__(12 + table_len,
                                                         b[12 + table_len] + 1))),
        fail("rans_const_length", "rANS CONST stream (log2_block 8) one block byte short",
             ["rans.md#6"], "CodecError",
             replace((1, 1), struct.pack("<BBHQ", MODE_CONST, 8, 0, H_N)
                     + bytes([15]) * (-(-H_N // 256) - 1))),
        fail("rans_const_empty_body", "rANS CONST stream with no block bytes: 12 stored bytes "
             "cannot decode to a non-empty plane (checked before decoding)",
             ["validation.md#P4", "rans.md#8"], "LimitError",
             replace((1, 1), struct.pack("<BBHQ", MODE_CONST, 20, 0, H_N)), without=P4_FIRST),
        fail("gdeflate_page_log2", "GDeflate page_log2 15", ["gdeflate.md#5"], "CodecError",
             payload_edit(H_MANT1, lambda b: b.__setitem__(0, 15))),
        fail("gdeflate_reserved", "GDeflate reserved byte 1", ["gdeflate.md#5"], "CodecError",
             payload_edit(H_MANT1, lambda b: b.__setitem__(1, 1))),
        fail("gdeflate_page_count", "GDeflate page_count 3 for 2 pages", ["gdeflate.md#5"],
             "CodecError", payload_edit(H_MANT1, set_u32(4, 3))),
        fail("gdeflate_raw_size", "GDeflate raw page entry of the wrong size",
             ["gdeflate.md#5"], "CodecError",
             payload_edit(H_MANT1, set_u32(12, (1 << 31) | (H_N - 65536 - 1)))),
        fail("gdeflate_sizes_sum", "GDeflate page sizes one short of the payload",
             ["gdeflate.md#5"], "CodecError", replace(H_MANT1, lambda old: old + b"\x00")),
        fail("gdeflate_stream_zeroed", "GDeflate page 0's stream overwritten with zero bytes",
             ["gdeflate.md#5"], "CodecError",
             payload_edit(H_MANT1, lambda b: b.__setitem__(
                 slice(16, 16 + struct.unpack_from("<I", b, 8)[0]),
                 bytes(struct.unpack_from("<I", b, 8)[0])))),
    ]
    for cut in (4, 31, 71, 72, 200, len(base) // 2, len(base) - 40, len(base) - 1):
        out.append(fail(f"truncated_{cut}", f"read_base cut to {cut} bytes",
                        ["validation.md#H1", "validation.md#H2", "validation.md#F1"],
                        "TruncatedError", base[:cut]))
    return out


def _rans_table_len(stream: bytes) -> int:
    k = sum(bin(b).count("1") for b in stream[12:44])
    return 32 + 2 * k + (-(32 + 2 * k)) % 4


def _raw_sign_plane(base: bytes, n: int) -> bytes:
    """read_base with tensor w's sign plane stored raw, holding a 2 at element 0."""
    def edit(p: craft.Parts) -> None:
        payload = bytes([2]) + bytes(n - 1)
        rec = p.tensors[0]["planes"][0]
        p.data += bytes(-(len(p.data) + 32) % 64)
        rec.update(codec=codecs.RAW, params=b"", offset=32 + len(p.data), stored_len=n,
                   checksum=hashing.plane_checksum(payload))
        p.data += payload
    return edited(base, edit)


def parent_vectors(deltas: list[Vector]) -> list[Vector]:
    child = deltas[1].data

    def bad_parent_hash(p: craft.Parts) -> None:
        p.tensors[0]["parent_hash"] = bytes(16)
    return [
        fail("delta_wrong_parent", "delta_child given delta_other_base as its parent",
             ["validation.md#A2"], "ParentMismatchError", child,
             parent="delta_other_base.s4w", file="delta_child.s4w"),
        fail("delta_parent_missing", "delta_child read without its parent",
             ["validation.md#R5"], "ParentMismatchError", child, file="delta_child.s4w"),
        fail("base_given_parent", "a base (no parent_id) given a parent",
             ["validation.md#A1"], "ParentMismatchError", deltas[0].data,
             parent="delta_other_base.s4w", file="delta_base.s4w"),
        fail("delta_parent_hash_unknown", "a delta tensor whose parent_hash names no tensor "
             "of the parent", ["validation.md#R5"], "ParentMismatchError",
             edited(child, bad_parent_hash), parent="delta_base.s4w"),
        fail("delta_content_hash", "a delta tensor with a wrong content hash (must be checked "
             "even when hashes are off)", ["validation.md#R6"], "ContentHashError",
             edited(child, lambda p: p.tensors[1].update(content_hash=bytes(16))),
             parent="delta_base.s4w"),
    ]


# -- hostile files (spec/README.md, the clarifications of 2026-12-01) -------------------------

HASH_PRIME = (1 << 61) - 1  # CPython's numeric hash: the value modulo this prime (O13)
O12 = ["objects.md#rules", "objects.md#typed-values", "validation.md#X4"]


def hostile_vectors(two: bytes) -> list[Vector]:
    """One must-fail vector per way a small file made readers hang, exhaust memory or hand
    torch a value it fails on, with the valid case at each limit."""
    z = np.zeros(0, np.uint8)

    def shaped(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
        blob = write_file([TensorSpec(name, dtype, (0,), z)])
        return edited(blob, lambda p: p.tensors[0].update(ndim=len(shape), shape=list(shape)))

    def tree(obj: Any) -> bytes:
        return edited(two, lambda p: p.index.update(tree=tree_bytes(obj)))

    colliding = [1 + k * HASH_PRIME for k in range(65)]
    assert len({hash(k) for k in colliding}) == 1
    pairs = b"".join(tree_bytes(k) + b"\x00" for k in colliding)
    at_limit = {k: None for k in colliding[:64]}
    shapes = ["format.md#41-tensorrecord", "validation.md#T4", "validation.md#arithmetic"]
    return [
        fail("shape_zero_by_2p64_minus_1", "an empty uint8 tensor of shape (0, 2^64 - 1): no "
             "bytes, but a size torch cannot hold (T4 counts a 0 as 1)", shapes, "LimitError",
             shaped("e", "uint8", (0, (1 << 64) - 1))),
        fail("shape_zero_strides_over_2p62", "an empty float32 tensor of shape (0, 2^31, "
             "2^30): every size fits 63 bits, their product (zeros counted as 1) times 4 is "
             "2^63", shapes, "LimitError", shaped("e", "float32", (0, 1 << 31, 1 << 30))),
        valid("tree_keys_64_one_hash", "a dict of 64 int keys 1 + k(2^61 - 1), all of one "
              "Python hash: the most rule O13 allows", ["objects.md#rules"],
              [TensorSpec("a", "uint8", (3,), np.array([1, 2, 3], np.uint8))], at_limit),
        fail("tree_keys_65_one_hash", "a dict of 65 int keys 1 + k(2^61 - 1), all of one "
             "Python hash (a hash table of them fills in quadratic time)",
             ["objects.md#rules"], "LimitError",
             edited(two, lambda p: p.index.update(
                 tree=b"\x0a" + struct.pack("<I", 65) + pairs))),
        *typed_vectors(tree),
    ]


def typed_vectors(tree: Callable[[Any], bytes]) -> list[Vector]:
    """Rule O12 in a file of two uint8 tensors, a (3,) and b (2,): one departure each."""
    view = {"storage": TensorRef(0), "dtype": "uint8", "offset": 0, "shape": (3,),
            "stride": (1,), "device": "cpu", "requires_grad": False, "parameter": False}

    def v(**change: Any) -> Any:
        fields = {**view, **change}
        return {"x": Typed("s4.view", {k: x for k, x in fields.items() if x is not None})}

    def t(name: str, value: Any) -> Any:
        return {"x": Typed(name, value)}

    attrs = Typed("s4.attrs", (OrderedDict(), {"_metadata": {}}))
    cases = [
        ("size_negative", "torch.Size((-5,))", "FormatError", t("torch.Size", (-5,))),
        ("size_2p63", "torch.Size((2^63,)): over torch's int64", "LimitError",
         t("torch.Size", (1 << 63,))),
        ("size_list", "torch.Size of a list, not a tuple", "FormatError",
         t("torch.Size", [2, 3])),
        ("dtype_int", "torch.dtype of an int", "FormatError", t("torch.dtype", 5)),
        ("device_bytes", "torch.device of bytes", "FormatError", t("torch.device", b"cpu")),
        ("ndarray_list", "numpy.ndarray of a list, not a tensor reference", "FormatError",
         t("numpy.ndarray", [1, 2])),
        ("scalar_1d", "numpy.scalar referring to a tensor of shape (3,)", "FormatError",
         t("numpy.scalar", TensorRef(0))),
        ("view_requires_grad_int", "s4.view with requires_grad 1, an int", "FormatError",
         v(requires_grad=1)),
        ("view_no_parameter", "s4.view without its parameter key", "FormatError",
         v(parameter=None)),
        ("view_extra_key", "s4.view with a ninth key", "FormatError", v(grad_fn="x")),
        ("view_dtype_alias", "s4.view of dtype 'float', torch's alias, not a format name",
         "FormatError", v(dtype="float")),
        ("view_offset_2p63", "s4.view at offset 2^63", "LimitError",
         v(offset=1 << 63, shape=(0,))),
        ("view_ndim_65", "s4.view of 65 sizes of 1", "FormatError",
         v(shape=(1,) * 65, stride=(1,) * 65)),
        ("view_lengths_differ", "s4.view of shape (3,) and stride (1, 1)", "FormatError",
         v(stride=(1, 1))),
        ("view_zero_by_2p63_minus_1", "an empty s4.view of shape (0, 2^63 - 1): sizes "
         "(zeros counted as 1) over 2^62 bytes", "LimitError",
         v(shape=(0, (1 << 63) - 1), stride=(1, 1))),
        ("view_past_storage", "s4.view of 4 bytes on a 3-byte storage", "FormatError",
         v(shape=(4,))),
        ("view_offset_past_storage", "an empty s4.view at offset 4 of a 3-byte storage",
         "FormatError", v(offset=4, shape=(0,))),
        ("attrs_nested", "s4.attrs whose object is another s4.attrs", "FormatError",
         t("s4.attrs", (attrs, {}))),
        ("attrs_int_name", "s4.attrs with the attribute name 1", "FormatError",
         t("s4.attrs", (OrderedDict(), {1: 2}))),
        ("attrs_single", "s4.attrs of a 1-tuple", "FormatError",
         t("s4.attrs", (OrderedDict(),))),
    ]
    limits = {"x": [Typed("torch.Size", (0, (1 << 63) - 1)),
                    Typed("s4.view", {**view, "shape": (0, 1 << 62), "stride": (1, 1)}),
                    Typed("s4.view", {**view, "offset": 3, "shape": (0,)}),
                    Typed("numpy.scalar", TensorRef(2)), attrs]}
    two_and_scalar = [TensorSpec("a", "uint8", (3,), np.array([1, 2, 3], np.uint8)),
                      TensorSpec("b", "uint8", (2,), np.array([4, 5], np.uint8)),
                      TensorSpec("s", "int8", (), np.array([7], np.uint8))]
    return [valid("typed_at_limits", "registered typed values at O12's limits: torch.Size "
                  "(0, 2^63 - 1), an empty s4.view of shape (0, 2^62) and one at the end of "
                  "its storage, a numpy.scalar of a 0-d tensor, s4.attrs on an ordered dict",
                  O12, two_and_scalar, limits)] + [
        fail(f"typed_{vid}", description, O12, error, tree(obj))
        for vid, description, error, obj in cases]


def all_vectors() -> list[Vector]:
    tiny = appendix_a()
    two = write_file([TensorSpec("a", "uint8", (3,), np.array([1, 2, 3], np.uint8)),
                      TensorSpec("b", "uint8", (2,), np.array([4, 5], np.uint8))],
                     {"a": TensorRef(0), "b": TensorRef(1)})
    deltas = delta_vectors()
    vectors = (dtype_vectors() + codec_vectors() + layout_vectors() + shape_vectors()
               + alignment_vectors() + container_vectors() + tree_vectors()
               + adversarial_vectors() + deltas + header_vectors(tiny) + footer_vectors(tiny)
               + index_vectors(tiny) + cross_vectors(two) + read_vectors()
               + parent_vectors(deltas) + hostile_vectors(two))
    for v in vectors:
        if v.id == "read_base":
            v.tree = tree_to_json(None)
            read_base = v.data
    from conformance import gen_verdicts
    return vectors + gen_verdicts.vectors(tiny, two, deltas, read_base)


# -- format 1.1 (v1.1/): codec 8, bitpack-w -------------------------------------------------
#
# v1/ is frozen as the suite of format 1.0, which a 1.0 reader passes; what 1.1 adds is in its
# own folder (README.md, "Frozen vectors"). A 1.1 reader passes v1/ and v1.1/.

POLICY_1_1 = "auto"  # files that may use codec 8, their header pinned to MINOR_1_1
MINOR_1_1 = 1
BITPACK_W_RULES = ["codecs.md#8--bitpack-w"]


def bitpack_w(w: int, params: bytes | None = None
              ) -> Callable[[np.ndarray], tuple[bytes, bytes, int]]:
    """Code a plane with bitpack-w at width ``w`` straight from the bit layout of codecs.md
    (bit ``b`` of plane byte ``i`` is stored bit ``w*i + b``, LSB first), not with s4format's
    codec; ``params`` replaces the one byte ``w`` in the plane record."""
    def code(plane: np.ndarray) -> tuple[bytes, bytes, int]:
        if plane.size and int(plane.max()) >> w:
            raise ValueError(f"a plane byte does not fit in {w} bits")
        planebits = (plane[:, None] >> np.arange(w, dtype=np.uint8)) & 1
        payload = np.packbits(planebits.reshape(-1), bitorder="little").tobytes()
        return payload, bytes([w]) if params is None else params, codecs.BITPACK_W
    return code


def packed_planes(blob: bytes) -> list[tuple[str, int]]:
    """(tensor name, plane number) of every codec-8 plane in a file."""
    return [(t["name"], k) for t in craft.parse(blob).tensors
            for k, p in enumerate(t["planes"]) if p["codec"] == codecs.BITPACK_W]


def bitpackw_vectors() -> list[Vector]:
    out = []
    tensors = []
    for w in range(1, 8):
        for k, n in enumerate((1000, 1001, w)):  # n % 8 = 0; padding bits; one partial group
            plane = rand_bytes(300 + 10 * w + k, n) & np.uint8((1 << w) - 1)
            plane[0] = (1 << w) - 1  # the width is exactly w
            tensors.append(TensorSpec(f"w{w}_n{n}", "uint8", (n,), plane,
                                      force(plane, "uint8", layouts.RAW, [bitpack_w(w)])))
    narrow = rand_bytes(380, 1003) & np.uint8(3)
    empty = np.zeros(0, np.uint8)
    tensors += [TensorSpec("w7_holding_2_bits", "uint8", (1003,), narrow,
                           force(narrow, "uint8", layouts.RAW, [bitpack_w(7)])),
                TensorSpec("empty", "uint8", (0,), empty,
                           force(empty, "uint8", layouts.RAW, [bitpack_w(7)]))]
    out.append(valid("bitpackw_widths", "bitpack-w at every width 1..7 (uint8, raw layout, "
                     "largest byte 2^w - 1) over 1000 bytes (n % 8 = 0, no padding), 1001 bytes "
                     "(padding bits in the last stored byte) and w bytes (one partial group); "
                     "a 2-bit plane at width 7 (any width that holds the bytes is valid); an "
                     "empty plane", BITPACK_W_RULES, tensors, policy=POLICY_1_1,
                     minor=MINOR_1_1))
    examples = []
    for name, w, plane, stored in (("w3", 3, "0502070003", "d531"),
                                   ("w7", 7, "057f004112336a017e2c", "853f202899a9037e16")):
        raw = np.frombuffer(bytes.fromhex(plane), np.uint8).copy()
        coded = force(raw, "uint8", layouts.RAW, [bitpack_w(w)])
        assert coded.planes[0].payload.hex() == stored, f"codecs.md's example {name} changed"
        examples.append(TensorSpec(name, "uint8", (raw.size,), raw, coded))
    out.append(valid("bitpackw_spec_examples", "the two worked examples of codecs.md, byte for "
                     "byte: 05 02 07 00 03 at w = 3 -> D5 31; a 10-byte plane at w = 7 -> "
                     "85 3F 20 28 99 A9 03 7E 16", BITPACK_W_RULES, examples,
                     policy=POLICY_1_1, minor=MINOR_1_1))
    spec_examples = out[-1]
    assert spec_examples.data[10] == 1, "a 1.1 file declares minor 1"
    out.append(Vector("bitpackw_in_minor_0", "the spec examples in a file whose header says "
                      "minor 0: readers decode what the records name, whatever minor the "
                      "header declares", ["README.md#versioning", "validation.md#H3",
                                          "validation.md#P3", *BITPACK_W_RULES],
                      edited(spec_examples.data, lambda p: p.header.update(minor=0)),
                      tensors=spec_examples.tensors, tree=spec_examples.tree))
    n = 4096
    w16 = weights_bf16(81, n).view(np.uint8).copy()
    f32 = weights_f32(82, n).view(np.uint8).copy()
    h = rand_bytes(83, 2 * n)  # any fp16 patterns: exponent 5 bits, mantissa0 2 bits
    auto = valid("bitpackw_weights", "the writer's choice (policy auto) on bf16 and fp32 "
                 "weights: the 7-bit mantissa0 planes are bitpack-w; fp16 with its 5-bit "
                 "exponent and 2-bit mantissa0 planes forced to bitpack-w",
                 [*BITPACK_W_RULES, "codecs.md#choosing-codecs-informative", "planes.md"],
                 [TensorSpec("bf16", "bfloat16", (64, 64), w16),
                  TensorSpec("f32", "float32", (n,), f32),
                  TensorSpec("f16", "float16", (n,), h,
                             force(h, "float16", layouts.FP16,
                                   [codecs.BITPACK, bitpack_w(5), bitpack_w(2), codecs.RAW]))],
                 policy=POLICY_1_1, minor=MINOR_1_1)
    assert packed_planes(auto.data) == [("bf16", 2), ("f32", 2), ("f16", 1), ("f16", 2)], \
        packed_planes(auto.data)
    out.append(auto)
    return out


def bitpackw_read_vectors() -> list[Vector]:
    """The rules of codec 8 (R2), its expansion bound (P4) and merge (R4), one each."""
    n = 4087  # 7·n % 8 = 1: the bf16 mantissa plane's last stored byte has 7 padding bits
    w = weights_bf16(90, n).view(np.uint8).copy()
    # fp16 patterns with the 4 low mantissa bits clear: mantissa1 takes 16 values, so rANS
    # gains back the padding the packed planes cost (the split must not outgrow the raw bytes)
    h = (rand_bytes(91, 2 * n).view("<u2") & np.uint16(0xFFF0)).view(np.uint8)
    base_t = [TensorSpec("w", "bfloat16", (n,), w,
                         force(w, "bfloat16", layouts.BF16,
                               [codecs.BITPACK, codecs.RANS, bitpack_w(7)])),
              TensorSpec("h", "float16", (n,), h,
                         force(h, "float16", layouts.FP16,
                               [codecs.BITPACK, bitpack_w(5), bitpack_w(2), codecs.RANS]))]
    base = valid("bitpackw_base", "the valid file the bitpack-w must-fail vectors are made "
                 "from: bf16 mantissa at w = 7 (n = 4087), fp16 exponent at w = 5 and mantissa0 "
                 "at w = 2", BITPACK_W_RULES, base_t, policy=POLICY_1_1, minor=MINOR_1_1)
    W_MANT, H_EXP = (0, 2), (1, 1)
    mant = layouts.BF16.split(w, 2)[2]
    stored = craft.plane_bytes(craft.parse(base.data), *W_MANT)
    assert len(stored) == -(-7 * n // 8) == 3577

    def params(new: bytes) -> bytes:
        return edited(base.data, lambda p: p.tensors[0]["planes"][2].update(params=new))

    exp = layouts.FP16.split(h, 2)[1].copy()
    exp[0] = 32  # fits 6 bits, not the 5-bit exponent field
    wide_exp = bitpack_w(6)(exp)[0]
    at_bound = ["validation.md#P4", *BITPACK_W_RULES]
    return [
        base,
        fail("bitpackw_params_empty", "bitpack-w with no params byte", BITPACK_W_RULES,
             "CodecError", params(b"")),
        fail("bitpackw_params_2", "bitpack-w params 07 00 (two bytes)", BITPACK_W_RULES,
             "CodecError", params(b"\x07\x00")),
        fail("bitpackw_w_0", "bitpack-w params 00 (width 0; the stored bytes of width 7 kept, "
             "so the expansion bound holds)", BITPACK_W_RULES, "CodecError", params(b"\x00")),
        fail("bitpackw_w_8", "bitpack-w params 08, the stored bytes being the plane itself "
             "(width 8 is not allowed: that is raw)", BITPACK_W_RULES, "CodecError",
             replaced(base.data, W_MANT, mant.tobytes(), b"\x08")),
        fail("bitpackw_width_mismatch", "bitpack-w params 06 with the 3577 stored bytes of "
             "width 7 (width 6 needs 3066)", BITPACK_W_RULES, "CodecError", params(b"\x06")),
        fail("bitpackw_stored_short", "bitpack-w at width 7: one stored byte missing (3576 of "
             "3577; within the expansion bound)", BITPACK_W_RULES, "CodecError",
             replaced(base.data, W_MANT, lambda old: old[:-1])),
        fail("bitpackw_stored_long", "bitpack-w at width 7: one stored byte too many (3578)",
             BITPACK_W_RULES, "CodecError",
             replaced(base.data, W_MANT, lambda old: old + b"\x00")),
        fail("bitpackw_padding_high", "bitpack-w: the highest padding bit (bit 7) of the last "
             "stored byte set", BITPACK_W_RULES, "CodecError",
             payload_edited(base.data, W_MANT, lambda b: b.__setitem__(-1, b[-1] | 0x80))),
        fail("bitpackw_padding_low", "bitpack-w: the lowest padding bit (bit 7·n mod 8 = 1) of "
             "the last stored byte set", BITPACK_W_RULES, "CodecError",
             payload_edited(base.data, W_MANT, lambda b: b.__setitem__(-1, b[-1] | 0x02))),
        fail("bitpackw_at_bound", "bitpack-w at width 7 with 511 stored bytes: decoded_len 4087 "
             "is within 8 x stored_len, so the file opens; the length rule fails on reading",
             at_bound, "CodecError", replaced(base.data, W_MANT, lambda old: old[:511])),
        fail("bitpackw_over_bound", "bitpack-w with 510 stored bytes: decoded_len 4087 exceeds "
             "8 x stored_len (checked before decoding)", at_bound, "LimitError",
             replaced(base.data, W_MANT, lambda old: old[:510])),
        fail("bitpackw_merge_wide", "fp16 exponent plane at width 6 holding 32, wider than its "
             "5-bit field: the codec decodes it, merge rejects it",
             ["validation.md#R4", "planes.md#words-and-fields", *BITPACK_W_RULES],
             "FormatError", replaced(base.data, H_EXP, wide_exp, b"\x06")),
    ]


def all_vectors_1_1() -> list[Vector]:
    return bitpackw_vectors() + bitpackw_read_vectors()


# -- format 1.3 (v1.3/): codec 9, rans-seg --------------------------------------------------
#
# A 1.3 reader passes v1/ to v1.3/; an older one refuses every file here at open, each having a
# codec-9 plane (UnsupportedCodecError, rule P3).

MINOR_1_3 = 3
RANS_SEG_RULES = ["codecs.md#9--rans-seg"]
SEG_UNIT = 1 << 16  # every segment but the last holds a multiple of this many symbols
U64_WRAP = 1 << 64
RECORD = struct.Struct("<QQHBBI")  # symbols, stored, codec, w, r1, r2
RANS_MODES = {MODE_RAW: "RAW", MODE_CONST: "CONST", MODE_RANS: "RANS"}


@dataclass(frozen=True)
class Segment:
    """A codec-9 segment: its record's fields and stored bytes; ``stored_len`` overrides the
    record's stored length where a vector makes the two disagree."""
    symbols: int
    codec: int
    stored: bytes
    w: int = 0
    r1: int = 0
    r2: int = 0
    stored_len: int | None = None


SegmentCoder = Callable[[np.ndarray], Segment]


def rans_seg_payload(segments: list[Segment]) -> bytes:
    """A codec-9 payload laid out by codecs.md: k, the k 24-byte records, the segments' stored
    bytes back to back."""
    records = b"".join(RECORD.pack(s.symbols, len(s.stored) if s.stored_len is None
                                   else s.stored_len, s.codec, s.w, s.r1, s.r2)
                       for s in segments)
    return struct.pack("<I", len(segments)) + records + b"".join(s.stored for s in segments)


def rans_stream(plane: np.ndarray, mode: int, codec: RansCodec) -> bytes:
    """``plane`` as one codec-4 stream, whose mode byte is checked to be ``mode``."""
    stream = np.asarray(codec.encode(plane).payload, np.uint8).tobytes()
    if stream[0] != mode:
        raise AssertionError(f"a segment's rANS mode is {stream[0]}, wanted {mode}")
    return stream


def raw_segment(part: np.ndarray) -> Segment:
    return Segment(part.size, codecs.RAW, part.tobytes())


def bitpack_segment(part: np.ndarray) -> Segment:
    """Codec 2's bit layout is bitpack-w's at width 1 (codecs.md)."""
    return Segment(part.size, codecs.BITPACK, bitpack_w(1)(part)[0])


def rans_segment(mode: int, coder: RansCodec | None = None) -> SegmentCoder:
    return lambda part: Segment(part.size, codecs.RANS,
                                rans_stream(part, mode, coder or RansCodec(split=False)))


def bitpackw_segment(w: int) -> SegmentCoder:
    return lambda part: Segment(part.size, codecs.BITPACK_W, bitpack_w(w)(part)[0], w=w)


def rans_seg(cuts: list[int], coders: list[SegmentCoder]
             ) -> Callable[[np.ndarray], tuple[bytes, bytes, int]]:
    """Code a plane as rans-seg cut at symbol offsets ``cuts``, segment ``i`` by
    ``coders[i]``."""
    def code(plane: np.ndarray) -> tuple[bytes, bytes, int]:
        edges = [0, *cuts, plane.size]
        segments = [c(plane[a:b]) for a, b, c in zip(edges[:-1], edges[1:], coders, strict=True)]
        return rans_seg_payload(segments), b"", codecs.RANS_SEG
    return code


def skewed(seed: int, n: int, low: int) -> np.ndarray:
    """Bytes ``low``, ``low + 1``, ... with halving probabilities (a low-entropy plane)."""
    r = bits(seed, n)
    run = np.zeros(n, np.uint8)
    for k in range(7):  # the trailing ones of r, at most 7: P(run >= k + 1) = 2^-(k + 1)
        run += ((r >> np.uint64(k)) & np.uint64(1)).astype(np.uint8) * (run == k)
    return run + np.uint8(low)


def gaussian_f32(seed: int, n: int, scale: float) -> np.ndarray:
    """About N(0, scale^2) as fp32, from 12 uniform 16-bit draws per value (Irwin-Hall): integer
    sums and IEEE-rounded arithmetic, no library math, so every platform makes the same bits."""
    r = bits(seed, 3 * n).reshape(n, 3)
    s = np.zeros(n, np.int64)
    for k in range(12):
        s += ((r[:, k // 4] >> np.uint64(16 * (k % 4))) & np.uint64(0xFFFF)).astype(np.int64)
    return ((s - 6 * 65535) / 65536.0 * scale).astype(np.float32)


def bf16_of(f32: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 bit patterns (nearest, ties to even), as torch does."""
    u = f32.view(np.uint32).astype(np.uint64)
    return ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
            ).astype(np.uint16)


def flat_buffer() -> np.ndarray:
    """Parameters of different scales end to end, as in an FSDP1 FlatParameter or a flat
    optimizer partition: N(0, 0.02), N(0, 1e-4), ones, zeros, 65,536 of each."""
    return np.concatenate([gaussian_f32(500, SEG_UNIT, 0.02), gaussian_f32(501, SEG_UNIT, 1e-4),
                           np.ones(SEG_UNIT, np.float32), np.zeros(SEG_UNIT, np.float32)])


def segment_codecs(blob: bytes, codec: int = codecs.RANS_SEG
                   ) -> dict[tuple[str, int], list[tuple[int, str]]]:
    """(tensor name, plane number) of every plane of ``codec`` (9 or 10) in a file -> its
    segments' symbols and codec, read from the records as codecs.md lays them out (rANS's with
    its mode, bitpack-w's with its width)."""
    parts = craft.parse(blob)
    out = {}
    for t, tensor in enumerate(parts.tensors):
        for k, plane in enumerate(tensor["planes"]):
            if plane["codec"] != codec:
                continue
            payload = craft.plane_bytes(parts, t, k)
            (count,) = struct.unpack_from("<I", payload)
            at, segs = 4 + RECORD.size * count, []
            for i in range(count):
                n, stored, cid, w, _r1, _r2 = RECORD.unpack_from(payload, 4 + RECORD.size * i)
                name = codecs.name_of(cid)
                if cid == codecs.RANS:
                    name += "/" + RANS_MODES[payload[at]]
                elif cid == codecs.BITPACK_W:
                    name += f"/{w}"
                segs.append((n, name))
                at += stored
            out[(tensor["name"], k)] = segs
    return out


def ransseg_vectors() -> list[Vector]:
    n_last = 1234  # 7·n_last % 8 = 6: the last stored byte has 2 padding bits
    parts = [rand_bytes(601, SEG_UNIT), rand_bytes(603, SEG_UNIT) & np.uint8(1),
             skewed(600, SEG_UNIT, 100),
             np.repeat(np.array([0x7F, 0x80, 0x7F, 0x00], np.uint8), SEG_UNIT // 4),
             rand_bytes(604, SEG_UNIT), rand_bytes(605, SEG_UNIT) & np.uint8(7),
             rand_bytes(606, n_last) & np.uint8(0x7F)]
    parts[5][0], parts[6][0] = 7, 0x7F  # the widths are exactly 3 and 7
    plane = np.concatenate(parts)
    coders = [raw_segment, bitpack_segment, rans_segment(MODE_RANS, RansCodec(12)),
              rans_segment(MODE_CONST, RansCodec(14)), rans_segment(MODE_RAW),
              bitpackw_segment(3), bitpackw_segment(7)]
    cuts = [SEG_UNIT * i for i in range(1, len(parts))]
    every_codec = valid(
        "ransseg_every_codec", "rans-seg in 7 segments, one per codec a segment may take, "
        "65,536 symbols each but the last: raw (uniform bytes), bitpack (0/1 bytes), rans in "
        "RANS mode (16 blocks), in CONST (4 blocks of their own bytes) and in RAW (uniform "
        "bytes), bitpack-w at width 3, then a partial last segment of 1234 symbols in "
        "bitpack-w at width 7 (2 padding bits)", RANS_SEG_RULES,
        [TensorSpec("flat", "uint8", (plane.size,), plane,
                    force(plane, "uint8", layouts.RAW, [rans_seg(cuts, coders)]))],
        policy="auto", minor=MINOR_1_3)
    assert [c for _n, c in segment_codecs(every_codec.data)[("flat", 0)]] == [
        "raw", "bitpack", "rans/RANS", "rans/CONST", "rans/RAW", "bitpack-w/3", "bitpack-w/7"]
    w = weights_bf16(610, 4000).view(np.uint8).copy()
    one = valid("ransseg_one_segment", "a bf16 exponent plane as rans-seg of one segment "
                "(k = 1, rans in RANS mode): valid, though our writer codes such a plane as "
                "codec 4", RANS_SEG_RULES, [TensorSpec("w", "bfloat16", (4000,), w, force(
                    w, "bfloat16", layouts.BF16,
                    [codecs.BITPACK, rans_seg([], [rans_segment(MODE_RANS)]), codecs.RAW]))],
                policy="auto", minor=MINOR_1_3)
    in_minor_1 = Vector("ransseg_in_minor_1", "ransseg_every_codec in a file whose header says "
                        "minor 1: readers decode what the records name, whatever minor the "
                        "header declares", ["README.md#versioning", "validation.md#H3",
                                            "validation.md#P3", *RANS_SEG_RULES],
                        edited(every_codec.data, lambda p: p.header.update(minor=1)),
                        tensors=every_codec.tensors, tree=every_codec.tree)
    return [every_codec, one, flat_weights_vector(), in_minor_1]


def flat_weights_vector() -> Vector:
    flat = flat_buffer()
    weights = valid("ransseg_flat_weights", "the writer's choice (policy auto) on a flat buffer "
                    "of bf16 and of fp32 parameters, N(0, 0.02), N(0, 1e-4), ones and zeros, "
                    "65,536 each, end to end: every plane is rans-seg; the sign and mantissa0 "
                    "planes in two segments (bitpack, bitpack-w at width 7, then rans in CONST "
                    "mode over the ones and zeros), the exponent planes in four of rans "
                    "(RANS, RANS, CONST, CONST), fp32's mantissa1 and mantissa2 in three (rans "
                    "in RANS mode, raw, rans in CONST mode)",
                    [*RANS_SEG_RULES, "codecs.md#choosing-codecs-informative", "planes.md"],
                    [TensorSpec("bf16", "bfloat16", (flat.size,), bf16_of(flat).view(np.uint8)),
                     TensorSpec("f32", "float32", (flat.size,), flat.view(np.uint8))],
                    policy="auto", minor=MINOR_1_3)
    half, unit = 2 * SEG_UNIT, SEG_UNIT
    sign = [(half, "bitpack"), (half, "rans/CONST")]
    exponent = [(unit, "rans/RANS")] * 2 + [(unit, "rans/CONST")] * 2
    mantissa0 = [(half, "bitpack-w/7"), (half, "rans/CONST")]
    low = [(unit, "rans/RANS"), (unit, "raw"), (half, "rans/CONST")]
    chosen = segment_codecs(weights.data)
    assert chosen == {("bf16", 0): sign, ("bf16", 1): exponent, ("bf16", 2): mantissa0,
                      ("f32", 0): sign, ("f32", 1): exponent, ("f32", 2): mantissa0,
                      ("f32", 3): low, ("f32", 4): low}, chosen
    return weights


def two_segment_base(vid: str, description: str, rules: list[str], head: np.ndarray,
                     head_coder: SegmentCoder, seed: int, plane_codec: Callable,
                     minor: int) -> tuple[Vector, list[Segment], np.ndarray]:
    """A valid uint8 plane of two segments, ``head`` coded by ``head_coder`` then 3001 bytes of
    width 3 (from ``seed``) in bitpack-w, as codec 9 or 10 (``plane_codec``: rans_seg or
    seg_lz): the file, its two segments and the second one's bytes."""
    packed = rand_bytes(seed, 3001) & np.uint8(7)
    packed[0] = 7
    plane = np.concatenate([head, packed])
    coders = [head_coder, bitpackw_segment(3)]
    base = valid(vid, description, rules, [TensorSpec("p", "uint8", (plane.size,), plane, force(
        plane, "uint8", layouts.RAW, [plane_codec([SEG_UNIT], coders)]))],
        policy="auto", minor=minor)
    return base, [coders[0](head), coders[1](packed)], packed


def ransseg_read_vectors() -> list[Vector]:
    """The rules of codec 9 (R2), one each, made from a valid plane of two segments: 65,536
    symbols in rans (RANS mode, one block), then 3001 in bitpack-w at width 3."""
    low = np.where(rand_bytes(620, SEG_UNIT) < 16, 11, 10).astype(np.uint8)
    base, segs, packed = two_segment_base(
        "ransseg_base", "the valid file the rans-seg must-fail vectors are made from: a uint8 "
        "plane in two segments, 65,536 symbols in rans (RANS mode) and 3001 in bitpack-w at "
        "width 3", RANS_SEG_RULES, low, rans_segment(MODE_RANS), 621, rans_seg, MINOR_1_3)
    plane = np.concatenate([low, packed])
    coders = [rans_segment(MODE_RANS), bitpackw_segment(3)]
    PLANE = (0, 0)
    payload = craft.plane_bytes(craft.parse(base.data), *PLANE)
    assert payload == rans_seg_payload(segs) == assemble(
        [(s.symbols, s.codec, s.w, s.stored) for s in segs]).tobytes()
    assert len(segs[1].stored) == -(-3 * 3001 // 8) == 1126
    at = 4 + 2 * RECORD.size  # segment 0's rANS stream in the payload
    states_at = at + 12 + _rans_table_len(segs[0].stored) + 4  # one block's word count

    def rebuilt(*segments: Segment) -> bytes:
        return replaced(base.data, PLANE, rans_seg_payload(list(segments)))

    def set_u32(offset: int, value: int) -> bytes:
        return payload_edited(base.data, PLANE, lambda b: b.__setitem__(
            slice(offset, offset + 4), struct.pack("<I", value)))

    def last(part: np.ndarray) -> Segment:
        return bitpackw_segment(3)(part)

    assert payload[at + 44] < 0xFF  # the +1 edit below carries no bit
    cut = SEG_UNIT + 1
    return [
        base,
        fail("ransseg_params_1", "rans-seg with a parameter byte", RANS_SEG_RULES, "CodecError",
             edited(base.data, lambda p: p.tensors[0]["planes"][0].update(params=b"\x00"))),
        fail("ransseg_k_0", "rans-seg segment count k = 0, the rest of the payload kept",
             RANS_SEG_RULES, "CodecError", set_u32(0, 0)),
        fail("ransseg_table_past_payload", f"rans-seg k = {(len(payload) - 4) // 24 + 1}: its "
             f"records need more than the payload's {len(payload)} bytes", RANS_SEG_RULES,
             "CodecError", set_u32(0, (len(payload) - 4) // 24 + 1)),
        fail("ransseg_k_max", "rans-seg k = 2^32 - 1: records of 4 + 24 k bytes, past the "
             "payload (and past 2^32: a size computed in 32 bits wraps)", RANS_SEG_RULES,
             "CodecError", set_u32(0, 0xFFFFFFFF)),
        fail("ransseg_payload_3", "the plane stored in 3 bytes: decoded_len exceeds "
             "max_decoded_len(3) = 0 (checked before decoding)",
             ["validation.md#P4", *RANS_SEG_RULES], "LimitError",
             replaced(base.data, PLANE, b"\x01\x00\x00")),
        fail("ransseg_symbols_0", "a first segment of 0 symbols (raw, 0 stored bytes) before "
             "the two valid ones", RANS_SEG_RULES, "CodecError",
             rebuilt(Segment(0, codecs.RAW, b""), *segs)),
        fail("ransseg_not_multiple", f"the plane cut after {cut:,} symbols: a segment other "
             "than the last that is not a multiple of 65,536 (both segments valid)",
             RANS_SEG_RULES, "CodecError",
             rebuilt(coders[0](plane[:cut]), last(plane[cut:]))),
        fail("ransseg_codec_3", "segment 0's record names codec 3 (zstd), not one a segment "
             "may take", RANS_SEG_RULES, "CodecError",
             rebuilt(replace(segs[0], codec=codecs.ZSTD), segs[1])),
        fail("ransseg_codec_9", "segment 0's record names codec 9 (rans-seg itself)",
             RANS_SEG_RULES, "CodecError",
             rebuilt(replace(segs[0], codec=codecs.RANS_SEG), segs[1])),
        fail("ransseg_bitpackw_w_0", "segment 1, bitpack-w, of width 0 (its stored bytes of "
             "width 3 kept)", RANS_SEG_RULES, "CodecError",
             rebuilt(segs[0], replace(segs[1], w=0))),
        fail("ransseg_bitpackw_w_8", "segment 1, bitpack-w, of width 8, its stored bytes the "
             "3001 plane bytes themselves (width 8 is not allowed: that is raw)",
             RANS_SEG_RULES, "CodecError",
             rebuilt(segs[0], replace(segs[1], w=8, stored=packed.tobytes()))),
        fail("ransseg_width_on_rans", "segment 0, rans, with w = 3 (a width belongs to "
             "bitpack-w only)", RANS_SEG_RULES, "CodecError",
             rebuilt(replace(segs[0], w=3), segs[1])),
        fail("ransseg_reserved_r1", "segment 1's first reserved byte (r1) is 1",
             RANS_SEG_RULES, "CodecError", rebuilt(segs[0], replace(segs[1], r1=1))),
        fail("ransseg_reserved_r2", "segment 0's reserved u32 (r2) is 2^31", RANS_SEG_RULES,
             "CodecError", rebuilt(replace(segs[0], r2=1 << 31), segs[1])),
        fail("ransseg_symbols_over", "the last segment codes one symbol more (3002): the "
             "segments hold decoded_len + 1 symbols", RANS_SEG_RULES, "CodecError",
             rebuilt(segs[0], last(np.append(packed, packed[:1])))),
        fail("ransseg_symbols_under", "the last segment codes one symbol less (3000): the "
             "segments hold decoded_len - 1 symbols", RANS_SEG_RULES, "CodecError",
             rebuilt(segs[0], last(packed[:-1]))),
        fail("ransseg_stored_short", "a byte after the last segment: the stored lengths sum to "
             "one short of the payload", RANS_SEG_RULES, "CodecError",
             replaced(base.data, PLANE, payload + b"\x00")),
        fail("ransseg_stored_long", "the last segment's stored length one more than its "
             "bytes: the stored lengths sum to one past the payload", RANS_SEG_RULES,
             "CodecError", rebuilt(segs[0], replace(segs[1], stored_len=1127))),
        fail("ransseg_symbols_wrap", "segments of 131,072 (rans, CONST), 2^64 - 65,536 (a "
             "CONST stream of one block byte) and 3001 symbols: their sum is decoded_len only "
             "modulo 2^64 (a reader summing in u64 would write 131,072 bytes into a "
             "68,537-byte plane)", RANS_SEG_RULES, "CodecError",
             rebuilt(rans_segment(MODE_CONST)(np.full(2 * SEG_UNIT, 0x55, np.uint8)),
                     Segment(U64_WRAP - SEG_UNIT, codecs.RANS, struct.pack(
                         "<BBHQ", MODE_CONST, 20, 0, U64_WRAP - SEG_UNIT) + b"\x55"),
                     segs[1])),
        fail("ransseg_stored_wrap", "both stored lengths 2^63 more than their bytes: their "
             "sum matches the payload only modulo 2^64", RANS_SEG_RULES, "CodecError",
             rebuilt(*(replace(s, stored_len=len(s.stored) + (1 << 63)) for s in segs))),
        fail("ransseg_segment_n", "segment 0's rANS stream declares n = 65,537 for its 65,536 "
             "symbols", ["rans.md#6", *RANS_SEG_RULES], "CodecError",
             payload_edited(base.data, PLANE, lambda b: b.__setitem__(at + 4, b[at + 4] + 1))),
        fail("ransseg_segment_table_sum", "segment 0's rANS frequency table with its first "
             "frequency one higher (sum 4097)", ["rans.md#3", *RANS_SEG_RULES], "CodecError",
             payload_edited(base.data, PLANE, lambda b: b.__setitem__(at + 44, b[at + 44] + 1))),
        fail("ransseg_segment_final_state", "segment 0's block 0 lane 0 final state 2^15 - 1",
             ["rans.md#6", *RANS_SEG_RULES], "CodecError", set_u32(states_at, 0x7FFF)),
        fail("ransseg_bitpackw_width_mismatch", "segment 1, bitpack-w, of width 2 with the "
             "1126 stored bytes of width 3 (width 2 needs 751)",
             [*BITPACK_W_RULES, *RANS_SEG_RULES], "CodecError",
             rebuilt(segs[0], replace(segs[1], w=2))),
    ]


def ransseg_bound_vectors() -> list[Vector]:
    """Codec 9's expansion bound (P4), met and exceeded, and the one payload under 4 bytes
    that the bound lets through: that of an empty plane."""
    rules = ["validation.md#P4", *RANS_SEG_RULES]
    c = np.full(1 << 20, 0x3C, np.uint8)
    at_bound = valid("ransseg_at_bound", "2^20 bytes of one value in one segment, rans in "
                     "CONST mode of one 2^20-symbol block: 41 stored bytes, decoded_len exactly "
                     "max_decoded_len(41) = (41 - 40) · 2^20",
                     rules, [TensorSpec("c", "uint8", (c.size,), c, force(
                         c, "uint8", layouts.RAW, [rans_seg([], [rans_segment(MODE_CONST)])]))],
                     policy="auto", minor=MINOR_1_3)
    stored = craft.parse(at_bound.data).tensors[0]["planes"][0]["stored_len"]
    assert stored == 41 and (stored - 40) << 20 == c.size
    no_block_byte = struct.pack("<BBHQ", MODE_CONST, 20, 0, c.size)
    empty = np.zeros(0, np.uint8)
    short = force(empty, "uint8", layouts.RAW,
                  [lambda _plane: (b"\x01\x00\x00", b"", codecs.RANS_SEG)])
    return [
        at_bound,
        fail("ransseg_over_bound", "ransseg_at_bound's CONST stream without its block byte: "
             "40 stored bytes, decoded_len 2^20 exceeds max_decoded_len(40) = 0 (checked "
             "before decoding)", rules, "LimitError",
             replaced(at_bound.data, (0, 0),
                      rans_seg_payload([Segment(c.size, codecs.RANS, no_block_byte)]))),
        fail("ransseg_payload_3_empty_plane", "an empty plane stored as rans-seg in 3 bytes, "
             "shorter than the segment count (within the bound: max_decoded_len(3) = 0)",
             RANS_SEG_RULES, "CodecError",
             write_file([TensorSpec("e", "uint8", (0,), empty, short)], {"e": TensorRef(0)},
                        policy="auto", minor=MINOR_1_3)),
    ]


def all_vectors_1_3() -> list[Vector]:
    return ransseg_vectors() + ransseg_read_vectors() + ransseg_bound_vectors()


# -- format 1.4 (v1.4/): masked tensors ---------------------------------------------------------
#
# A 1.4 reader passes v1/ to v1.4/; an older one refuses every masked tensor's record at open
# (rule T1: flag 0x02 is a reserved bit to it), and so every vector here but the base and
# masked_flag_cleared (flags 0, refused by T9 for its extra plane).

MASKED = 0x02
MINOR_1_4 = 4
MASKED_RULES = ["planes.md#masked-tensors-14", "format.md#41-tensorrecord"]


def force_masked(raw: np.ndarray, dtype: str, layout: Layout, mask_codec: int,
                 plane_codecs: list[int], *, mask: np.ndarray | None = None,
                 kept: np.ndarray | None = None) -> CodedTensor:
    """``raw``'s masked form, built from the spec (planes.md, "Masked tensors"): the mask of
    its non-zero words, least significant bit first, then the layout's planes of those words,
    each coded with the codec given. ``mask`` and ``kept`` (the kept words' bytes) replace
    what ``raw`` gives, for vectors that break a rule."""
    dt = dtypes.by_name(dtype)
    word = layout.word_size(dt.itemsize)
    rows = raw.reshape(-1, word)
    nonzero = rows.any(axis=1)
    mask = np.packbits(nonzero, bitorder="little") if mask is None else mask
    kept = rows[nonzero].reshape(-1) if kept is None else kept
    planes = [CodedPlane(layouts.KIND_MASK, 0, mask_codec, mask.size,
                         *_coded(codecs.get(mask_codec), mask))]
    if kept.size:
        inner = force(kept, dtype, layout, plane_codecs)
        planes += inner.planes
    else:
        planes += [CodedPlane(f.kind, f.index, codecs.RAW, 0, b"")
                   for f in layout.planes(dt.itemsize)]
    return CodedTensor(layout, tuple(planes), masked=True)


def _coded(codec: Any, plane: np.ndarray) -> tuple[bytes, bytes]:
    """A plane's stored bytes and params."""
    enc = codec.encode(plane)
    if enc is None:
        raise ValueError(f"codec {codec.name} declined a mask plane")
    payload = enc.payload if isinstance(enc.payload, bytes) else \
        np.asarray(enc.payload, np.uint8).tobytes()
    return payload, enc.params


def sparse_words(seed: int, words: np.ndarray, share: float) -> np.ndarray:
    """``words`` with all but about ``share`` of them zeroed (PCG64 picks which)."""
    keep = (bits(seed, words.size) >> np.uint64(11)).astype(np.float64) / (1 << 53) < share
    return np.where(keep, words, 0).astype(words.dtype)


def masked_vectors() -> list[Vector]:
    """Valid masked tensors of every layout and edge: the writer's masked deltas, and forced
    forms (not deltas, the raw layout, nothing kept, every word kept, a partial mask byte)."""
    w = weights_bf16(60, 8192)
    w2 = w.copy()
    w2[sparse_words(61, np.ones(8192, np.uint16), 0.2).astype(bool)] ^= np.uint16(3)
    f = weights_f32(62, 4096)
    f2 = f ^ sparse_words(63, bits(64, 4096).astype(np.uint32) & np.uint32(0x00FF_FFFF), 0.1)
    h = (weights_bf16(65, 4096) >> np.uint16(2)).astype(np.uint16)  # fp16 patterns
    h2 = h ^ sparse_words(66, np.full(4096, 0x0101, np.uint16), 0.3)
    q = bits(67, 2048).view(np.int64).copy()
    q2 = q ^ sparse_words(68, bits(69, 2048), 0.05).view(np.int64)
    base_t = [TensorSpec("w", "bfloat16", (8192,), w.view(np.uint8)),
              TensorSpec("f", "float32", (4096,), f.view(np.uint8)),
              TensorSpec("h", "float16", (4096,), h.view(np.uint8)),
              TensorSpec("q", "int64", (2048,), q.view(np.uint8))]
    base = valid("masked_delta_base", "a base checkpoint (parent of masked_delta)",
                 ["format.md#10"], base_t, policy="auto", minor=MINOR_1_4)
    news = [new.view(np.uint8) for new in (w2, f2, h2, q2)]
    # masked_delta: our writer's masked deltas as it made them when 1.4 came out, the kept
    # words under each dtype's own layout; masked_delta_bytes: as it makes them since
    # 2026-12-06, bf16's and fp16's kept words under the bytes layout.
    child_t = [TensorSpec(t.name, t.dtype, t.shape, new, parent=t.raw,
                          coded=_masked_delta(t, new))
               for t, new in zip(base_t, news)]
    child = valid("masked_delta", "masked XOR deltas against masked_delta_base: bf16, fp32, "
                  "fp16 and bytes layouts, a fifth to a twentieth of the words changed",
                  [*MASKED_RULES, "format.md#10", "validation.md#R4", "validation.md#R6"],
                  child_t, parent_id=checkpoint_id(base_t), policy="auto", minor=MINOR_1_4)
    child.parent = "masked_delta_base.s4w"
    as_bytes = valid("masked_delta_bytes", "masked_delta's tensors as our writer now stores "
                     "them: the kept words of bf16 and fp16 under the bytes layout (two byte "
                     "planes), of fp32 under fp32's",
                     [*MASKED_RULES, "planes.md#4--bytes-w--itemsize", "format.md#10",
                      "validation.md#R4", "validation.md#R6"],
                     [replace(t, coded=None) for t in child_t],
                     parent_id=checkpoint_id(base_t), policy="auto", minor=MINOR_1_4)
    as_bytes.parent = "masked_delta_base.s4w"
    for v, lays in ((child, [1, 3, 2, 4]), (as_bytes, [4, 3, 4, 4])):
        recs = craft.parse(v.data).tensors
        assert [(r["transform"], r["flags"], r["layout"]) for r in recs] == [
            (1, MASKED, lay) for lay in lays], recs

    sparse = sparse_words(70, weights_bf16(71, 3001), 0.25)  # 3001 words: a partial byte
    mixed = np.concatenate([np.zeros(64, np.uint16), weights_bf16(72, 37)])
    f32s = sparse_words(73, f32_specials(), 0.5)
    raw8 = sparse_words(74, rand_bytes(75, 1000), 0.1)
    full = weights_bf16(76, 1000)
    full[full == 0] = 1
    c128 = rand_bytes(77, 16 * 300).reshape(300, 16)
    c128[(bits(78, 300) & np.uint64(3)) != 0] = 0  # a quarter of the 16-byte words kept
    forced = [
        ("bf16", "bfloat16", sparse, layouts.BF16, codecs.ZSTD,
         [codecs.BITPACK, codecs.RANS, codecs.RAW]),
        ("bf16_zero_block", "bfloat16", mixed, layouts.BF16, codecs.RAW,
         [codecs.RAW, codecs.RAW, codecs.RAW]),
        ("f32_specials", "float32", f32s, layouts.FP32, codecs.RANS,
         [codecs.RAW, codecs.RANS, codecs.RAW, codecs.ZSTD, codecs.RAW]),
        ("raw_layout", "uint8", raw8, layouts.RAW, codecs.RANS, [codecs.ZSTD]),
        ("all_zero", "bfloat16", np.zeros(777, np.uint16), layouts.BF16, codecs.RANS, []),
        ("all_kept", "bfloat16", full, layouts.BF16, codecs.RAW,
         [codecs.BITPACK, codecs.RANS, codecs.BITPACK_W]),
        ("c128_words", "complex128", c128.reshape(-1).view("<c16"), layouts.BYTES,
         codecs.RAW, [codecs.ZSTD] + [codecs.RAW] * 15),
    ]
    tensors = [TensorSpec(name, dtype, (raw.size,), raw.view(np.uint8),
                          coded=force_masked(raw.view(np.uint8), dtype, layout, mc, pcs))
               for name, dtype, raw, layout, mc, pcs in forced]
    forms = valid("masked_forms", "masked tensors that are not deltas: bf16 words whose count "
                  "leaves a partial mask byte, a block of zero words, fp32 special values, "
                  "the raw layout (words of one byte), nothing kept (empty planes), every "
                  "word kept, complex128 under the bytes layout (words of 16 bytes)",
                  [*MASKED_RULES, "validation.md#P2", "validation.md#R4"], tensors,
                  policy="auto", minor=MINOR_1_4)
    return [base, child, as_bytes, forms]


def _masked_delta(t: TensorSpec, new: np.ndarray) -> CodedTensor:
    """Our writer's masked form of ``new`` against ``t.raw`` (policy auto), its kept words
    under the dtype's own layout."""
    dt = dtypes.by_name(t.dtype)
    form = masked_form(new, dt, "auto", parent=t.raw,
                       layout=layouts.preferred(dt.name, dt.itemsize))
    assert form is not None, t.name
    return code_masked(form, dt, "auto")


def masked_fail_vectors(forms: bytes, child: bytes) -> list[Vector]:
    """Masked tensors that break a rule: at open (T1, T9, P1, P2) or when merged (R4)."""
    at = 0  # tensor 0 of masked_forms: bf16, 3001 words (mask 376 bytes, the last 1 bit used)
    n = 3001

    def rec(**kw: Any) -> bytes:
        return edited(forms, lambda p: p.tensors[at].update(**kw))

    def plane(k: int, **kw: Any) -> bytes:
        return edited(forms, lambda p: p.tensors[at]["planes"][k].update(**kw))

    def mask_edit(change: Callable[[np.ndarray], None]) -> bytes:
        raw = sparse_words(70, weights_bf16(71, n), 0.25).view(np.uint8)
        mask = np.packbits(raw.reshape(-1, 2).any(axis=1), bitorder="little")
        change(mask)
        coded = force_masked(raw, "bfloat16", layouts.BF16, codecs.RAW,
                             [codecs.RAW, codecs.RAW, codecs.RAW], mask=mask)
        return write_file([TensorSpec("t", "bfloat16", (n,), raw, coded=coded)],
                          {"t": TensorRef(0)}, policy="auto", minor=MINOR_1_4)

    def kept_zero() -> bytes:
        raw = sparse_words(70, weights_bf16(71, n), 0.25).view(np.uint8)
        rows = raw.reshape(-1, 2)
        nonzero = rows.any(axis=1)
        nonzero[np.flatnonzero(~nonzero)[0]] = True  # a zero word kept, its bit set
        coded = force_masked(raw, "bfloat16", layouts.BF16, codecs.RAW,
                             [codecs.RAW, codecs.RAW, codecs.RAW],
                             mask=np.packbits(nonzero, bitorder="little"),
                             kept=rows[nonzero].reshape(-1))
        return write_file([TensorSpec("t", "bfloat16", (n,), raw, coded=coded)],
                          {"t": TensorRef(0)}, policy="auto", minor=MINOR_1_4)

    def bit_past_end(mask: np.ndarray) -> None:
        mask[-1] |= 0x80  # bit 3007: past word 3000, the last
        one_bit_less(mask)  # (a real bit cleared: the count still matches the kept words)

    def one_bit_less(mask: np.ndarray) -> None:
        first = int(np.flatnonzero(mask)[0])
        mask[first] &= mask[first] - 1

    def cleared_planes(p: craft.Parts) -> None:
        p.tensors[at]["planes"] = p.tensors[at]["planes"][1:]
    kept = craft.parse(forms).tensors[at]["planes"][1]["decoded_len"]
    return [
        fail("masked_flag_4", "tensor record flags = 0x06: masked and the reserved bit 0x04",
             ["validation.md#T1"], "UnsupportedFeatureError", rec(flags=0x06)),
        fail("masked_no_mask_plane", "a masked tensor with only its layout's planes",
             ["validation.md#T9"], "FormatError", edited(forms, cleared_planes)),
        fail("masked_flag_cleared", "a masked tensor's record without flag 0x02: one plane "
             "more than its layout has", ["validation.md#T9"], "FormatError", rec(flags=0)),
        fail("masked_mask_kind", "a masked tensor whose first plane is of kind raw, not mask",
             ["validation.md#P1"], "FormatError", plane(0, kind=0)),
        fail("masked_mask_len", "a mask plane declaring one byte more than ceil(n / 8)",
             ["validation.md#P2"], "FormatError", plane(0, decoded_len=(n + 7) // 8 + 1)),
        fail("masked_kept_lengths_differ", "a masked tensor's value planes of two lengths",
             ["validation.md#P2"], "FormatError", plane(3, decoded_len=kept - 1)),
        fail("masked_kept_over_n", "value planes declaring n + 1 kept words",
             ["validation.md#P2"], "FormatError",
             edited(forms, lambda p: [q.update(decoded_len=n + 1)
                                      for q in p.tensors[at]["planes"][1:]])),
        fail("masked_bit_past_end", "a mask bit set past the last word (3001 words), its "
             "count of set bits still that of the kept words (one real bit cleared)",
             [*MASKED_RULES, "validation.md#R4"], "FormatError", mask_edit(bit_past_end)),
        fail("masked_count_short", "a mask with one set bit fewer than the kept words",
             [*MASKED_RULES, "validation.md#R4"], "FormatError", mask_edit(one_bit_less)),
        fail("masked_zero_kept", "a kept word that is zero",
             [*MASKED_RULES, "validation.md#R4"], "FormatError", kept_zero()),
        fail("masked_delta_without_parent", "masked_delta read without its parent",
             ["validation.md#R5"], "ParentMismatchError", child, file="masked_delta.s4w"),
        fail("masked_delta_content_hash", "a masked delta with a wrong content hash",
             ["validation.md#R6"], "ContentHashError",
             edited(child, lambda p: p.tensors[0].update(content_hash=bytes(16))),
             parent="masked_delta_base.s4w"),
    ]


def all_vectors_1_4() -> list[Vector]:
    good = masked_vectors()
    return [*good, *masked_fail_vectors(good[3].data, good[1].data)]


# -- format 1.5 (v1.5/): codec 10, seg-lz --------------------------------------------------------
#
# A 1.5 reader passes v1/ to v1.5/; an older one refuses every file here at open but those
# without a codec-10 plane (UnsupportedCodecError, rule P3): the codec-9 planes of
# seglz_flat_moments are 1.3's.

MINOR_1_5 = 5
SEG_LZ_RULES = ["codecs.md#10--seg-lz", *RANS_SEG_RULES]


def zstd_segment(part: np.ndarray, *, content_size: bool = True) -> Segment:
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    return Segment(part.size, codecs.ZSTD, cctx.compress(part.tobytes()))


def seg_lz(cuts: list[int], coders: list[SegmentCoder]
           ) -> Callable[[np.ndarray], tuple[bytes, bytes, int]]:
    """:func:`rans_seg`'s plane as codec 10."""
    def code(plane: np.ndarray) -> tuple[bytes, bytes, int]:
        return rans_seg(cuts, coders)(plane)[0], b"", codecs.SEG_LZ
    return code


def repeating(seed: int, n: int) -> np.ndarray:
    """Bytes in runs of 64 copies of one of 16 random rows of 64 bytes: what zstd shrinks far
    below their order-0 bound."""
    rows = rand_bytes(seed, 16 * 64).reshape(16, 64)
    pick = (bits(seed + 1, -(-n // 4096)) % np.uint64(16)).astype(np.int64)
    return np.repeat(rows[pick], 64, axis=0).reshape(-1)[:n]


def moments_buffer() -> np.ndarray:
    """A flat fp32 buffer: N(0, 0.02) weights, then an embedding's Adam moments, 256 values a
    row, every other run of 8 rows zero (tokens a run never saw), 65,536 values of each."""
    rows = gaussian_f32(511, 2 * SEG_UNIT, 1e-3).reshape(-1, 256)
    rows[(np.arange(rows.shape[0]) // 8) % 2 == 1] = 0.0
    return np.concatenate([gaussian_f32(510, 2 * SEG_UNIT, 0.02), np.abs(rows.reshape(-1)),
                           gaussian_f32(512, 2 * SEG_UNIT, 0.5)])


def seglz_vectors() -> list[Vector]:
    n_last = 2001
    parts = [rand_bytes(701, SEG_UNIT), rand_bytes(702, SEG_UNIT) & np.uint8(1),
             repeating(703, SEG_UNIT), skewed(704, SEG_UNIT, 40),
             rand_bytes(705, SEG_UNIT) & np.uint8(7), repeating(706, n_last)]
    parts[4][0] = 7  # the width is exactly 3
    plane = np.concatenate(parts)
    coders = [raw_segment, bitpack_segment, zstd_segment, rans_segment(MODE_RANS),
              bitpackw_segment(3), zstd_segment]
    cuts = [SEG_UNIT * i for i in range(1, len(parts))]
    every_codec = valid(
        "seglz_every_codec", "seg-lz in 6 segments, 65,536 symbols each but the last: raw "
        "(uniform bytes), bitpack (0/1 bytes), zstd (runs of repeated 64-byte rows), rans in "
        "RANS mode, bitpack-w at width 3, then a partial last segment of 2001 symbols in zstd",
        SEG_LZ_RULES, [TensorSpec("flat", "uint8", (plane.size,), plane,
                                  force(plane, "uint8", layouts.RAW, [seg_lz(cuts, coders)]))],
        policy="auto", minor=MINOR_1_5)
    assert [c for _n, c in segment_codecs(every_codec.data, codecs.SEG_LZ)[("flat", 0)]] == [
        "raw", "bitpack", "zstd", "rans/RANS", "bitpack-w/3", "zstd"]
    flat = moments_buffer()
    moments = valid("seglz_flat_moments", "the writer's choice (policy auto) on a flat fp32 "
                    "buffer: N(0, 0.02) weights, an embedding's Adam moments with every other "
                    "run of 8 rows of 256 zero, N(0, 0.5), 131,072 values each: planes of "
                    "codec 10 whose segments over the moments are zstd",
                    [*SEG_LZ_RULES, "codecs.md#choosing-codecs-informative"],
                    [TensorSpec("f32", "float32", (flat.size,), flat.view(np.uint8))],
                    policy="auto", minor=MINOR_1_5)
    chosen = segment_codecs(moments.data, codecs.SEG_LZ)
    assert any("zstd" in {c for _n, c in segs} for segs in chosen.values()), chosen
    n = 65_791
    rle = b"\x28\xb5\x2f\xfd\x60" + struct.pack("<H", n - 256) + \
        (1 | 1 << 1 | n << 3).to_bytes(3, "little") + b"\x07"  # RFC 8878: one RLE block
    assert zstandard.ZstdDecompressor().decompress(rle) == b"\x07" * n
    sevens = np.full(n, 7, np.uint8)
    small = valid("seglz_rle_frame", "65,791 bytes 7 in one zstd segment, a frame of 11 bytes "
                  "(one RLE block, a 2-byte content size): a 39-byte plane, within codec 10's "
                  "max_decoded_len(39) = 32768 · 11 + 18 (codec 9's bound would be 88)",
                  [*SEG_LZ_RULES, "validation.md#P4"],
                  [TensorSpec("s", "uint8", (n,), sevens, force(
                      sevens, "uint8", layouts.RAW,
                      [seg_lz([], [lambda part: Segment(part.size, codecs.ZSTD, rle)])]))],
                  policy="auto", minor=MINOR_1_5)
    return [every_codec, moments, small]


def seglz_read_vectors() -> list[Vector]:
    """Codec 10's rules beyond codec 9's, one each, made from a valid plane of two segments:
    65,536 symbols in zstd, then 3001 in bitpack-w at width 3."""
    lz = repeating(720, SEG_UNIT)
    base, segs, _packed = two_segment_base(
        "seglz_base", "the valid file the seg-lz must-fail vectors are made from: a uint8 plane "
        "in two segments, 65,536 symbols in zstd and 3001 in bitpack-w at width 3",
        SEG_LZ_RULES, lz, zstd_segment, 721, seg_lz, MINOR_1_5)
    PLANE = (0, 0)
    windowed = zstd_windowed(28)(lz)[0]
    big = np.full(1 << 20, 7, np.uint8)
    lying = rans_seg_payload([Segment(big.size, codecs.ZSTD, b"\x28\xb5\x2f\xfd\xa0" + struct.pack(
        "<I", big.size) + (1 | 1 << 1 | SEG_UNIT << 3).to_bytes(3, "little") + b"\x07")])
    assert len(lying) == 41

    def rebuilt(*segments: Segment) -> bytes:
        return replaced(base.data, PLANE, rans_seg_payload(list(segments)))

    return [
        base,
        fail("seglz_params_1", "seg-lz with a parameter byte", SEG_LZ_RULES, "CodecError",
             edited(base.data, lambda p: p.tensors[0]["planes"][0].update(params=b"\x00"))),
        fail("seglz_codec_9", "segment 0's record names codec 9 (rans-seg), not one a segment "
             "may take", SEG_LZ_RULES, "CodecError",
             rebuilt(replace(segs[0], codec=codecs.RANS_SEG), segs[1])),
        fail("seglz_codec_10", "segment 0's record names codec 10 (seg-lz itself)",
             SEG_LZ_RULES, "CodecError",
             rebuilt(replace(segs[0], codec=codecs.SEG_LZ), segs[1])),
        fail("seglz_codec_5", "segment 0's record names codec 5 (gdeflate)", SEG_LZ_RULES,
             "CodecError", rebuilt(replace(segs[0], codec=codecs.GDEFLATE), segs[1])),
        fail("seglz_zstd_width", "segment 0, zstd, with w = 3 (a width belongs to bitpack-w "
             "only)", SEG_LZ_RULES, "CodecError", rebuilt(replace(segs[0], w=3), segs[1])),
        fail("seglz_zstd_content_size", "segment 0's zstd frame holds its first 65,535 bytes "
             "(declaring that content size) and its record says 65,536 symbols",
             SEG_LZ_RULES, "CodecError",
             rebuilt(replace(zstd_segment(lz[:-1]), symbols=SEG_UNIT), segs[1])),
        fail("seglz_zstd_no_content_size", "segment 0's zstd frame does not declare its "
             "content size", ["codecs.md#3--zstd", *SEG_LZ_RULES], "CodecError",
             rebuilt(zstd_segment(lz, content_size=False), segs[1])),
        fail("seglz_zstd_trailing_byte", "a zero byte after segment 0's zstd frame, counted in "
             "its stored length", ["codecs.md#3--zstd", *SEG_LZ_RULES], "CodecError",
             rebuilt(replace(segs[0], stored=segs[0].stored + b"\x00"), segs[1])),
        fail("seglz_zstd_truncated", "segment 0's zstd frame without its last byte",
             SEG_LZ_RULES, "CodecError",
             rebuilt(replace(segs[0], stored=segs[0].stored[:-1]), segs[1])),
        fail("seglz_zstd_over_bound", "one zstd segment of 2^20 symbols, its frame 13 bytes (one "
             "RLE block of 65,536, a 4-byte content size declaring 2^20): within the plane's "
             "bound, max_decoded_len(41) = 2^20, but over codec 3's bound on the segment's 13 "
             "bytes, 32768 · 13 + 18 (refused before decoding)", SEG_LZ_RULES, "CodecError",
             write_file([TensorSpec("p", "uint8", (big.size,), big, force(
                 big, "uint8", layouts.RAW, [lambda _p: (lying, b"", codecs.SEG_LZ)]))],
                 {"p": TensorRef(0)}, policy="auto", minor=MINOR_1_5)),
        fail("seglz_zstd_window_2p28", "segment 0's zstd frame declares a window of 2^28 bytes "
             "(its data coded with a 1 KiB window)", ["codecs.md#3--zstd", *SEG_LZ_RULES],
             "CodecError", rebuilt(Segment(SEG_UNIT, codecs.ZSTD, windowed), segs[1])),
    ]


def all_vectors_1_5() -> list[Vector]:
    return seglz_vectors() + seglz_read_vectors()


# -- writing the suite ------------------------------------------------------------------------

def all_vectors_1_2() -> list[Vector]:
    """Format 1.2's typed names of Python values (``gen_objects.py``, which uses the helpers
    here)."""
    from conformance import gen_objects
    return gen_objects.vectors()


# The writer's zstd level when the vectors were frozen (it codes at level 1 since 2026-12-02):
# every suite is built at it, so that the vectors come out byte for byte.
ZSTD_LEVEL = 3


@contextlib.contextmanager
def _zstd_level(level: int) -> Iterator[None]:
    codec = codecs.get(codecs.ZSTD)
    before, codec.level = codec.level, level
    try:
        yield
    finally:
        codec.level = before


def _frozen(build: Callable[[], list[Vector]]) -> Callable[[], list[Vector]]:
    @functools.wraps(build)
    def at_frozen_level() -> list[Vector]:
        with _zstd_level(ZSTD_LEVEL):
            return build()
    return at_frozen_level


# suite folder -> (the format version it tests, its vectors)
SUITES: dict[str, tuple[str, Callable[[], list[Vector]]]] = {
    "v1": ("1.0", _frozen(all_vectors)), "v1.1": ("1.1", _frozen(all_vectors_1_1)),
    "v1.2": ("1.2", _frozen(all_vectors_1_2)), "v1.3": ("1.3", _frozen(all_vectors_1_3)),
    "v1.4": ("1.4", _frozen(all_vectors_1_4)), "v1.5": ("1.5", _frozen(all_vectors_1_5))}


def render(vectors: list[Vector], suite: str = "v1") -> dict[str, bytes]:
    """File name -> bytes for every vector file and the manifest."""
    files: dict[str, bytes] = {}
    for v in vectors:
        name = v.file or f"{v.id}.s4w"
        if files.setdefault(name, v.data) != v.data:
            raise AssertionError(f"{v.id}: {name} already holds other bytes")
    ids = [v.id for v in vectors]
    if len(set(ids)) != len(ids):
        raise AssertionError("duplicate vector IDs")
    manifest = dict(format=".s4w", version=SUITES[suite][0], suite=suite,
                    protocol="conformance/README.md", vectors=[v.entry() for v in vectors])
    # One vector per line: readable, and a change to one vector is a one-line diff.
    head = json.dumps({k: v for k, v in manifest.items() if k != "vectors"}, ensure_ascii=False)
    lines = ",\n".join(json.dumps(e, ensure_ascii=False, sort_keys=True)
                       for e in manifest["vectors"])
    files["manifest.json"] = f'{head[:-1]}, "vectors": [\n{lines}\n]}}\n'.encode()
    return files


def write_suite(out: Path, *, force: bool = False, suite: str = "v1") -> dict[str, bytes]:
    files = render(SUITES[suite][1](), suite)
    total = sum(len(b) for b in files.values())
    if total > SIZE_BUDGET:
        raise SystemExit(f"the suite is {total} bytes, over its {SIZE_BUDGET}-byte budget")
    changed = [n for n, b in files.items() if (out / n).exists() and (out / n).read_bytes() != b]
    if changed and not force:
        raise SystemExit(f"refusing to overwrite frozen vectors with different bytes: "
                         f"{', '.join(sorted(changed))}. Released vectors never change "
                         "silently: add new vectors under new names, or pass --force and "
                         "say why in the commit (conformance/README.md)")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=list(SUITES), action="append",
                    help="the suite to write (repeatable; default: every suite)")
    ap.add_argument("--out", type=Path,
                    help=f"output folder, with one --suite (default: {ROOT}/SUITE)")
    ap.add_argument("--force", action="store_true",
                    help="overwrite existing vector files whose bytes changed")
    args = ap.parse_args(argv)
    names = args.suite or list(SUITES)
    if args.out and len(names) != 1:
        ap.error("--out needs exactly one --suite")
    for name in names:
        out = args.out or ROOT / name
        files = write_suite(out, force=args.force, suite=name)
        vectors = json.loads(files["manifest.json"])["vectors"]
        n_valid = sum(v["expect"] == "valid" for v in vectors)
        print(f"{out}: {len(vectors)} vectors ({n_valid} valid, {len(vectors) - n_valid} "
              f"must-fail) in {len(files) - 1} files, {sum(map(len, files.values()))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
