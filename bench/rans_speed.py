"""Single-core speed and ratio of the S4 rANS CPU codec on a synthetic bf16 exponent plane.

Not a test: prints encode/decode MB/s (on one thread unless ``--threads``, which sets both
numba's threads and S4's pool) and the stored size against the plane's order-0 entropy. The
plane is the exponent byte of bf16 values (float32 from N(0, 0.02) truncated to their top 16
bits): ``((u32 >> 16) >> 7) & 0xFF``.

    python bench/rans_speed.py [--symbols 64M] [--log2-block 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

from s4format import threads
from s4format.codecs.rans import LOG2_BLOCK_DEFAULT, RansCodec


def exponent_plane(n: int, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    bf16 = values.view(np.uint32) >> 16
    return ((bf16 >> 7) & 0xFF).astype(np.uint8)


def entropy_bytes(plane: np.ndarray) -> float:
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum()) * plane.size / 8


def best_of(repeat: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def parse_count(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--symbols", type=parse_count, default=64 << 20)
    ap.add_argument("--log2-block", type=int, default=LOG2_BLOCK_DEFAULT)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    # (the codec cuts a plane of over a million symbols into pieces that S4's own pool codes,
    # whose size S4_THREADS sets: without it, "one thread" ran on every core)
    os.environ["S4_THREADS"] = str(args.threads)

    plane = exponent_plane(args.symbols)
    codec = RansCodec(args.log2_block)
    codec.decode(codec.encode(plane[:4096]).payload, 4096, b"")   # compile / load the cache
    t_enc, enc = best_of(args.repeat, lambda: codec.encode(plane))
    payload = np.asarray(enc.payload)
    t_dec, out = best_of(args.repeat, lambda: codec.decode(payload, plane.size, b""))
    assert np.array_equal(out, plane), "round trip is not bit-exact"
    t_est, est = best_of(args.repeat, lambda: codec.estimate(plane))

    mb = plane.size / 1e6
    h = entropy_bytes(plane)
    print(f"plane: {plane.size:,} symbols, log2_block {args.log2_block}, "
          f"{threads.count()} thread(s)")
    print(f"encode   {mb / t_enc:8.1f} MB/s")
    print(f"decode   {mb / t_dec:8.1f} MB/s")
    print(f"estimate {mb / t_est:8.1f} MB/s  ({est:,} bytes, "
          f"{est / payload.size - 1:+.3%} vs real)")
    print(f"order-0 entropy {8 * h / plane.size:.4f} bits/symbol = {h:,.0f} bytes")
    print(f"stored          {8 * payload.size / plane.size:.4f} bits/symbol = {payload.size:,} "
          f"bytes ({payload.size / h - 1:+.3%} vs entropy)")


if __name__ == "__main__":
    main()
