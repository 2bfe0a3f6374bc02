"""Single-core speed and ratio of the GDeflate CPU codec (nvCOMP's CPU library) against zstd -3,
on synthetic bf16 mantissa and exponent planes.

Not a test: pins the process to one CPU and prints compress/decompress MB/s (plane bytes per
CPU-second of this process, best of --repeat) and the ratio (plane bytes / stored bytes) for each
codec and plane. CPU time rather than wall time keeps the figures stable on a shared machine;
both codecs run on one thread, so on an idle core the two agree. The planes come from bf16 values
(float32 from N(0, 0.02) truncated to their top 16 bits): mantissa ``u16 & 0x7F`` (the low 7
bits), exponent ``(u16 >> 7) & 0xFF``.

    python bench/gdeflate_speed.py [--mib 64] [--level 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

from s4format.codecs.abc import Codec
from s4format.codecs.gdeflate import DEFAULT_LEVEL, GDeflateCodec
from s4format.codecs.zstd import ZstdCodec


def bf16_planes(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    values = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    bf16 = values.view(np.uint32) >> 16
    return {"mantissa": (bf16 & 0x7F).astype(np.uint8),
            "exponent": ((bf16 >> 7) & 0xFF).astype(np.uint8)}


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def measure(codec: Codec, plane: np.ndarray, repeat: int) -> tuple[float, float, float]:
    """(compress MB/s, decompress MB/s, ratio); checks the round trip once."""
    enc = codec.encode(plane)
    payload = np.frombuffer(enc.payload, np.uint8) if isinstance(enc.payload, bytes) \
        else enc.payload
    if not np.array_equal(codec.decode(payload, plane.size, enc.params), plane):
        raise SystemExit(f"{codec.name}: round trip is not bit-exact")
    t_enc = best_of(repeat, lambda: codec.encode(plane))
    t_dec = best_of(repeat, lambda: codec.decode(payload, plane.size, enc.params))
    mb = plane.size / 1e6
    return mb / t_enc, mb / t_dec, plane.size / enc.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="plane size in MiB (default 64)")
    ap.add_argument("--level", type=int, default=DEFAULT_LEVEL, help="GDeflate CPU level")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = ap.parse_args()
    # One core: the figures are per core (nvCOMP's CPU compressor is single-threaded anyway).
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    gdeflate = GDeflateCodec(args.level)
    if not gdeflate.available():
        raise SystemExit("nvCOMP's CPU library is missing: pip install 's4weights[gdeflate]'")
    codecs: list[tuple[str, Codec]] = [(f"gdeflate-{args.level}", gdeflate),
                                       ("zstd-3", ZstdCodec(3))]
    print(f"{args.mib} MiB planes, one core, best of {args.repeat}")
    print(f"{'plane':<9} {'codec':<11} {'comp MB/s':>9} {'decomp MB/s':>11} {'ratio':>6}")
    for name, plane in bf16_planes(args.mib << 20).items():
        for label, codec in codecs:
            enc_speed, dec_speed, ratio = measure(codec, plane, args.repeat)
            print(f"{name:<9} {label:<11} {enc_speed:>9.0f} {dec_speed:>11.0f} {ratio:>6.3f}")


if __name__ == "__main__":
    main()
