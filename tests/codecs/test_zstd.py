"""Codec 3 (zstd): what one-call decoding returns and how it names a bad frame."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard

from s4format import codecs
from s4format.errors import CodecError

ZSTD = codecs.get(3)


def frame(plane: np.ndarray) -> np.ndarray:
    out = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(plane.data)
    return np.frombuffer(out, np.uint8)


def planes() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    sparse = np.zeros(3 << 20, np.uint8)
    sparse[rng.integers(0, sparse.size, 5000)] = rng.integers(1, 256, 5000)
    return [sparse, rng.integers(0, 256, 1 << 20, dtype=np.uint8),
            np.full(300_000, 9, np.uint8), np.arange(1, dtype=np.uint8)]


@pytest.mark.parametrize("plane", planes(), ids=["sparse", "random", "constant", "one"])
def test_round_trip(plane: np.ndarray) -> None:
    assert np.array_equal(ZSTD.decode(frame(plane), plane.size, b"\x03"), plane)


def test_empty_plane() -> None:
    assert ZSTD.decode(frame(np.zeros(0, np.uint8)), 0, b"").size == 0


def test_threads_share_the_codec() -> None:
    ps = planes()
    frames = [frame(p) for p in ps]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: ZSTD.decode(frames[i % 4], ps[i % 4].size, b""),
                           range(64)))
    assert all(np.array_equal(o, ps[i % 4]) for i, o in enumerate(outs))


@pytest.mark.parametrize("damage, message", [
    (lambda f: np.concatenate([f, np.zeros(3, np.uint8)]), "3 bytes follow the zstd frame"),
    (lambda f: f[:-5], "zstd frame is truncated"),
    (lambda f: np.concatenate([f[:12], np.full(64, 0xFF, np.uint8), f[76:]]),
     "zstd stream is corrupt"),
    (lambda f: np.concatenate([np.frombuffer(b"\x50\x2a\x4d\x18", np.uint8), f]),
     "does not start with a Zstandard frame"),
])
def test_bad_frames_are_named(damage, message: str) -> None:
    plane = planes()[0]
    with pytest.raises(CodecError, match=message):
        ZSTD.decode(damage(frame(plane)), plane.size, b"")


def test_declared_size_must_match() -> None:
    plane = planes()[2]
    with pytest.raises(CodecError, match="declares 300000 content bytes, plane declares 5"):
        ZSTD.decode(frame(plane), 5, b"")


def test_a_frame_declaring_no_content_but_holding_a_block() -> None:
    # frame header: magic, descriptor 0x20 (single segment, 1-byte content size), size 0; then
    # one last RLE block of one byte (block header: last=1, type=RLE, size=1)
    frame = np.frombuffer(b"\x28\xb5\x2f\xfd\x20\x00" + bytes([0x0B, 0x00, 0x00]) + b"\x07",
                          np.uint8)
    with pytest.raises(CodecError, match="zstd"):
        ZSTD.decode(frame, 0, b"")


def test_a_strided_payload_decodes() -> None:
    plane = planes()[0]
    spread = np.zeros(2 * frame(plane).size, np.uint8)
    spread[::2] = frame(plane)
    assert np.array_equal(ZSTD.decode(spread[::2], plane.size, b""), plane)


def test_large_planes_are_coded_at_level_1_small_ones_at_level_3() -> None:
    from s4format.codecs.zstd import SMALL

    rng = np.random.default_rng(8)
    for n, level in ((SMALL, 1), (SMALL - 1, 3), (100, 3)):
        plane = rng.integers(0, 4, n, dtype=np.uint8)
        enc = ZSTD.encode(plane)
        assert enc.params == bytes([level]), n
        assert enc.nbytes == len(zstandard.ZstdCompressor(
            level=level, write_content_size=True).compress(plane.data))
        back = ZSTD.decode(np.frombuffer(enc.payload, np.uint8), n, enc.params)
        assert back.tobytes() == plane.tobytes()


def test_a_tiny_exponent_plane_stays_with_rans() -> None:
    # at level 1 zstd would store 2 KiB of bf16 exponents in less than rANS does, and the
    # GPU decoder reads rANS, not zstd
    from s4format import layouts, policy

    w = (np.random.default_rng(0).normal(0, 0.02, 2048).astype("<f4").view("<u4") >> 16)
    view = layouts.BF16.views(w.astype("<u2").view(np.uint8), 2)[1]
    assert policy.encode_view(view, layouts.KIND_EXPONENT)[0] == codecs.RANS


def test_a_sample_does_not_take_the_planes_ends_for_the_whole() -> None:
    # an embedding's first and last rows (special tokens) can compress far better than the
    # rest: a sample that takes them for the plane sends the whole of it to one zstd frame,
    # which codes and decodes on one core, where segments store as little
    from s4format import layouts, policy

    rng = np.random.default_rng(9)
    plane = rng.integers(0, 256, 12 << 20, dtype=np.uint8)
    plane[:384 << 10] = 0
    plane[-(128 << 10):] = 0
    alone = len(frame(plane))
    assert abs(ZSTD.estimate(plane) - plane.size) < 0.01 * plane.size
    cid, enc = policy.encode_plane(plane, layouts.KIND_MANTISSA)
    assert cid in (codecs.RANS_SEG, codecs.SEG_LZ)
    assert enc.nbytes <= alone * 1.001
