"""The CUDA XXH3-64 header built as host code with nvcc, against python xxhash: every length
class and its edges, the warp-cooperative long form (emulated lane by lane), 64 KiB leaves.
Runs without a GPU; skipped when nvcc is absent."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import xxhash

KERNELS = Path(__file__).parents[2] / "s4weights" / "gpu" / "kernels"
HARNESS = Path(__file__).with_name("xxh3_host.cu")

LENGTHS = sorted({*range(0, 300), 383, 384, 385, 511, 512, 513, 1023, 1024, 1025, 1087, 1088,
                  1089, 2047, 2048, 2049, 4095, 4096, 4097, 65535, 65536, 65537, 100_003,
                  131_072})


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    exe = tmp_path_factory.mktemp("xxh3") / "xxh3_host"
    subprocess.run([nvcc, "-std=c++17", "-O2", f"-I{KERNELS}", "-x", "cu", str(HARNESS),
                    "-o", str(exe)], check=True, capture_output=True)
    return exe


def _run(exe: Path, inputs: list[bytes]) -> list[tuple[int, int, bytes, bytes]]:
    blob = struct.pack("<Q", len(inputs)) + b"".join(
        struct.pack("<Q", len(x)) + x for x in inputs)
    out = subprocess.run([str(exe)], input=blob, check=True, capture_output=True).stdout
    rows = [line.split() for line in out.decode().splitlines()]
    return [(int(a, 16), int(b, 16), bytes.fromhex(c), bytes.fromhex(d)) for a, b, c, d in rows]


@pytest.mark.parametrize("fill", ["random", "zeros", "ones"])
def test_every_length_class_matches_xxhash(harness: Path, fill: str) -> None:
    rng = np.random.default_rng(len(fill))
    inputs = []
    for n in LENGTHS:
        if fill == "random":
            inputs.append(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        else:
            inputs.append(bytes([0xFF if fill == "ones" else 0]) * n)
    got = _run(harness, inputs)
    for data, (scalar, warp, wide, wide_warp) in zip(inputs, got):
        want = xxhash.xxh3_64_intdigest(data)
        assert scalar == want, len(data)
        assert warp == want, len(data)
        want = xxhash.xxh3_128_digest(data)
        assert wide == want, len(data)
        assert wide_warp == want, len(data)


def test_leaf_digests_give_the_container_hashes(harness: Path) -> None:
    from s4format import hashing
    from s4weights.gpu.hash import content_hash_from_leaves, plane_checksum_from_leaves

    data = np.random.default_rng(7).integers(0, 256, 3 * hashing.LEAF_SIZE + 12345,
                                             dtype=np.uint8).tobytes()
    leaves = [data[i:i + hashing.LEAF_SIZE] for i in range(0, len(data), hashing.LEAF_SIZE)]
    digests = np.array([r[0] for r in _run(harness, leaves)], dtype=np.uint64)
    assert content_hash_from_leaves(len(data), digests) == hashing.content_hash(data)
    assert plane_checksum_from_leaves(len(data), digests) == hashing.plane_checksum(data)
