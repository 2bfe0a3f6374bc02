"""Write the frozen S4 rANS conformance vectors in ``tests/codecs/golden/`` (run once).

The vectors pin the stream format: ``test_rans.py`` decodes every committed stream and checks
that today's encoder still produces the committed bytes. They are generated once; changing
them means a format change, so this script refuses to overwrite existing files unless given
``--force`` (and such a change needs a spec version bump, not a silent regeneration).

    python tests/codecs/make_golden_rans.py [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from s4format.codecs.rans import RansCodec, _rans_stream, normalise

GOLDEN = Path(__file__).parent / "golden"
INDEX = GOLDEN / "rans.json"


def exponent_like(n: int, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    return (((values.view(np.uint32) >> 16) >> 7) & 0xFF).astype(np.uint8)


def example() -> np.ndarray:
    """The worked example of spec/rans.md: 100 symbols over 0..15, one block of 4 rows."""
    return np.random.default_rng(4).integers(0, 16, 100).astype(np.uint8)


def vectors() -> dict[str, tuple[np.ndarray, int, bool]]:
    """name -> (plane, log2_block, forced_rans). Forced streams skip the RAW fallback."""
    rng = np.random.default_rng(4)
    block_const = np.repeat(np.array([3, 9, 3, 250], dtype=np.uint8), [64, 64, 64, 10])
    return {
        "example": (example(), 7, True),
        "exponent": (exponent_like(5000, seed=1), 8, False),
        "const": (np.full(1000, 0x7F, dtype=np.uint8), 16, False),
        "block_const": (block_const, 6, False),
        "uniform_raw": (rng.integers(0, 256, 300, dtype=np.uint8), 16, False),
        "empty": (np.zeros(0, dtype=np.uint8), 16, False),
    }


def encode(plane: np.ndarray, log2_block: int, forced_rans: bool) -> bytes:
    if forced_rans:
        freqs = normalise(np.bincount(plane, minlength=256))
        return _rans_stream(plane, log2_block, freqs).tobytes()
    return np.asarray(RansCodec(log2_block).encode(plane).payload).tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="overwrite existing vectors")
    args = ap.parse_args()
    if INDEX.exists() and not args.force:
        print(f"{INDEX} exists; golden vectors are frozen (use --force for a format change)")
        return 1
    GOLDEN.mkdir(exist_ok=True)
    index = {}
    for name, (plane, log2_block, forced) in vectors().items():
        stream = encode(plane, log2_block, forced)
        (GOLDEN / f"rans_{name}.in.bin").write_bytes(plane.tobytes())
        (GOLDEN / f"rans_{name}.stream.bin").write_bytes(stream)
        index[name] = {
            "input": f"rans_{name}.in.bin",
            "stream": f"rans_{name}.stream.bin",
            "log2_block": log2_block,
            "forced_rans": forced,
            "mode": stream[0] if stream else None,
            "input_sha256": hashlib.sha256(plane.tobytes()).hexdigest(),
            "stream_sha256": hashlib.sha256(stream).hexdigest(),
        }
        print(f"{name}: {plane.size} symbols -> {len(stream)} bytes, mode {stream[0]}")
    INDEX.write_text(json.dumps(index, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
