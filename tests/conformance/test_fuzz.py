"""Mutation fuzzing of the reader over the conformance vectors (bounded for CI), and the
exhaustive single-byte corruption check.

Properties, for every input:

* the reader answers with a result or an :class:`~s4format.errors.S4Error`, never another
  exception;
* opening, reading every tensor and verifying takes under ``TIME_BOUND`` seconds;
* Python-level allocations (numpy buffers included; tracemalloc) peak under
  ``64 MiB + 16 × input size``. A valid file may legitimately need more (a rANS CONST plane
  decodes 2^20 bytes per stored byte), but the mutations here change one thing at a time, and
  the reader's rules make a single change unable to declare a larger *consistent* tensor: a
  peak above the bound means an allocation sized by an unchecked field.

Long runs: ``fuzz/fuzz_reader.py`` (atheris).
"""

from __future__ import annotations

import functools
import json
import time
import tracemalloc

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance import craft, generate
from s4format import Reader, S4Error, codecs, layouts, verify
from s4format.codecs.rans import RansCodec
from s4format.objtree import TensorRef

TIME_BOUND = 2.0
MEMORY_BASE = 64 << 20
# The valid vectors of every suite small enough to mutate quickly, as "suite/file".
SEEDS = sorted({f"{suite}/{v['file']}" for suite in generate.SUITES
                for v in json.loads((generate.ROOT / suite / "manifest.json").read_text())
                ["vectors"] if v["expect"] == "valid"
                and (generate.ROOT / suite / v["file"]).stat().st_size <= 48 << 10})
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def read_everything(blob: bytes) -> bool:
    """True if the file is valid, False if the reader rejected it (S4Error)."""
    try:
        with Reader(blob) as r:
            for i in range(len(r.tensors)):
                r.read_raw(i)
            return not verify(r)
    except S4Error:
        return False


@functools.cache
def warm_up() -> None:
    """Decode every seed once, so numba's compilation is not timed as the reader's."""
    for name in SEEDS:
        read_everything(seed_bytes(name))


def check_bounded(blob: bytes) -> None:
    warm_up()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        read_everything(blob)
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < TIME_BOUND, f"{elapsed:.2f} s on a {len(blob)}-byte input"
    assert peak < MEMORY_BASE + 16 * len(blob), f"peak {peak} bytes on {len(blob)} bytes"


def seed_bytes(name: str) -> bytes:
    return (generate.ROOT / name).read_bytes()


@st.composite
def byte_mutations(draw) -> bytes:
    blob = bytearray(seed_bytes(draw(st.sampled_from(SEEDS))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice"]))
        at = draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and blob:
            blob[at] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, 1]))
        elif op == "insert":
            blob[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del blob[at:at + draw(st.integers(1, 64))]
        elif op == "truncate":
            del blob[at:]
        elif op == "splice":
            other = seed_bytes(draw(st.sampled_from(SEEDS)))
            lo = draw(st.integers(0, len(other) - 1))
            blob[at:at + draw(st.integers(0, 256))] = other[lo:lo + draw(st.integers(1, 256))]
    if draw(st.booleans()):
        blob = bytearray(craft.reseal(bytes(blob)))
    return bytes(blob)


U64 = st.sampled_from([0, 1, 31, 32, 63, 64, 255, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 62,
                       2 ** 62 + 1, 2 ** 63, 2 ** 64 - 1]) | st.integers(0, 2 ** 64 - 1)


@st.composite
def field_mutations(draw) -> bytes:
    """One field of the index changed, everything derived from it re-sealed."""
    parts = craft.parse(seed_bytes(draw(st.sampled_from(SEEDS))))
    if not parts.tensors:
        parts.index["tree"] = draw(st.binary(max_size=64))
        return craft.build(parts)
    t = parts.tensors[draw(st.integers(0, len(parts.tensors) - 1))]
    what = draw(st.sampled_from(["dtype", "layout", "transform", "flags", "shape", "raw_nbytes",
                                 "content_hash", "plane", "payload", "tree", "metadata",
                                 "parent_id", "name"]))
    if what in ("dtype", "layout", "transform", "flags"):
        t[what] = draw(st.integers(0, 255))
    elif what == "shape" and t["shape"]:
        t["shape"][draw(st.integers(0, len(t["shape"]) - 1))] = draw(U64)
    elif what == "raw_nbytes":
        t["raw_nbytes"] = draw(U64)
    elif what == "content_hash":
        t["content_hash"] = draw(st.binary(min_size=16, max_size=16))
    elif what in ("plane", "payload") and t["planes"]:
        k = draw(st.integers(0, len(t["planes"]) - 1))
        p = t["planes"][k]
        if what == "plane":
            field = draw(st.sampled_from(["kind", "index", "codec", "params", "offset",
                                          "stored_len", "decoded_len", "checksum"]))
            p[field] = draw({"kind": st.integers(0, 255), "index": st.integers(0, 255),
                             "codec": st.integers(0, 8), "params": st.binary(max_size=3)}
                            .get(field, U64))
        elif p["stored_len"]:
            # The plane's stored bytes changed *with* a matching checksum: straight to the codec.
            payload = bytearray(craft.plane_bytes(parts, parts.tensors.index(t), k))
            for _ in range(draw(st.integers(1, 8))):
                payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 255))
            craft.set_plane_bytes(parts, parts.tensors.index(t), k, bytes(payload))
    elif what in ("tree", "metadata"):
        raw = bytearray(parts.index[what])
        if raw and draw(st.booleans()):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        else:
            raw = bytearray(draw(st.binary(max_size=32)))
        parts.index[what] = bytes(raw)
    elif what == "parent_id":
        parts.index["parent_id"] = draw(st.binary(min_size=16, max_size=16))
    elif what == "name":
        t["name"] = draw(st.text(max_size=8))
    try:
        return craft.build(parts)
    except Exception:  # a value the grammar cannot hold (e.g. ndim out of a u8): keep the seed
        return seed_bytes(SEEDS[0])


@SETTINGS
@given(byte_mutations())
def test_byte_mutations_are_answered_within_bounds(blob: bytes) -> None:
    check_bounded(blob)


@SETTINGS
@given(field_mutations())
def test_field_mutations_are_answered_within_bounds(blob: bytes) -> None:
    check_bounded(blob)


def small_multi_codec_file() -> bytes:
    """~2 KiB: bitpack, rANS (RANS and CONST), GDeflate, bitpack-w and raw planes, a tree,
    metadata (zstd is covered by the byte mutations; a frame small enough here would not pay)."""
    n = 600
    w = generate.weights_bf16(90, n).view(np.uint8).copy()
    g = np.zeros(400, np.uint8)
    g[::7] = 3
    tensors = [
        generate.TensorSpec("w", "bfloat16", (n,), w, generate.force(
            w, "bfloat16", layouts.BF16, [codecs.BITPACK, RansCodec(10), generate.bitpack_w(7)])),
        generate.TensorSpec("g", "uint8", (400,), g, generate.force(
            g, "uint8", layouts.RAW, [codecs.get(codecs.GDEFLATE)])),
        generate.TensorSpec("c", "int16", (40,), np.full(80, 9, np.uint8), generate.force(
            np.full(80, 9, np.uint8), "int16", layouts.BYTES, [RansCodec(5), codecs.RAW])),
    ]
    tree = {"w": TensorRef(0), "rest": [TensorRef(1), (TensorRef(2), 1.5, None)]}
    assert {p.codec for t in tensors for p in t.coded.planes} == {1, 2, 4, 5, 8}
    return generate.write_file(tensors, tree, metadata={"k": "v"}, policy=generate.POLICY_1_1)


def test_every_single_damaged_byte_is_detected() -> None:
    for blob in (seed_bytes("v1/appendix_a.s4w"), small_multi_codec_file()):
        assert read_everything(blob)
        missed = [(i, x) for i in range(len(blob)) for x in (0x01, 0xFF)
                  if read_everything(blob[:i] + bytes([blob[i] ^ x]) + blob[i + 1:])]
        assert missed == [], f"undetected damage at (offset, xor) {missed[:10]}"
