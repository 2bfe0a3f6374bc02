"""Speed of the bitpack-w CPU codec (codec 8) on a 7-bit plane: pack and unpack MB/s, best of
``--repeat``, with numba's threads (``--threads``, default all).

Not a test: prints one line.

    python bench/bitpackw_speed.py [--bytes 64M] [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from s4format import codecs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    n = int(a.bytes.rstrip("M")) << 20 if a.bytes.endswith("M") else int(a.bytes)
    if a.threads:
        numba.set_num_threads(a.threads)
    bw = codecs.get(codecs.BITPACK_W)
    plane = np.random.default_rng(0).integers(0, 128, n, dtype=np.uint8)
    enc = bw.encode(plane)  # (also compiles)
    assert np.array_equal(bw.decode(enc.payload, n, enc.params), plane)

    def best(fn) -> float:
        out = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    tp = best(lambda: bw.encode(plane))
    tu = best(lambda: bw.decode(enc.payload, n, enc.params))
    print(f"bitpack-w, w = 7, {n >> 20} MiB, {numba.get_num_threads()} threads: "
          f"pack {n / tp / 1e6:.0f} MB/s, unpack {n / tu / 1e6:.0f} MB/s")


if __name__ == "__main__":
    main()
