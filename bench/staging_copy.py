"""What staging a load's stored bytes costs on the GPU machine (``python3 bench/staging_copy.py``):
copies from an in-memory file (a ``bytes``, as ``s4weights.load(data)`` gets it) of 0.5-64 MB,
as the GPU loads stage them:
- into a page-locked buffer (reused) by one thread (numpy), and in pieces by a few threads
  (``decode.read_into``'s pool; pieces of ``S4_PIECE`` bytes, default 1 MiB);
- then host-to-device from that page-locked buffer;
- against a host-to-device copy straight from the pageable bytes (the driver stages it).
GB/s, median of ``S4_COPY_REPS`` (default 20) warm copies."""

from __future__ import annotations

import os
import statistics
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch
from walls import walls

REPS = int(os.environ.get("S4_COPY_REPS", "20"))
PIECE = int(os.environ.get("S4_PIECE", str(1 << 20)))
POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))


def gbps(n: int, fn) -> float:
    return n / statistics.median(walls(fn, REPS)) / 1e9


def pieces(dst: np.ndarray, src: np.ndarray) -> None:
    def one(a: int) -> None:
        dst[a:a + PIECE] = src[a:a + PIECE]
    wait([POOL.submit(one, a) for a in range(0, src.size, PIECE)])


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'MB':>6} {'1 thread':>9} {'pieces':>9} {'pinned H2D':>11} {'pageable H2D':>13}"
          "   (GB/s)", flush=True)
    for mb in (0.5, 1.5, 4, 16, 32, 64):
        n = int(mb * 1e6)
        data = rng.integers(0, 256, n + 4096, np.uint8).tobytes()  # a file image in memory
        src = np.frombuffer(data, np.uint8)[4096:]  # (a view, as BufferSource gives)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host = pinned.numpy()
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        writable = src.copy()  # (torch.from_numpy wants a writable array; same pageable pages)
        one = gbps(n, lambda h=host, s=src: h.__setitem__(slice(None), s))
        many = gbps(n, lambda h=host, s=src: pieces(h, s))
        h2d = gbps(n, lambda d=dev, p=pinned: d.copy_(p, non_blocking=True))
        pageable = gbps(n, lambda d=dev, w=writable: d.copy_(torch.from_numpy(w),
                                                             non_blocking=True))
        print(f"{mb:6.1f} {one:9.1f} {many:9.1f} {h2d:11.1f} {pageable:13.1f}", flush=True)


if __name__ == "__main__":
    main()
