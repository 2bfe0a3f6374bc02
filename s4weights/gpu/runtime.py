"""Kernel modules, launches and buffers for the CUDA path.

Kernels are the ``kernels/*.cu`` sources compiled once per process and device with NVRTC through
CuPy (``-std=c++17``; CuPy targets the current device's architecture). Every launch goes on
torch's current stream, and every buffer is a torch tensor from torch's caching allocator, so
the path composes with the caller's stream and memory accounting.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

KERNELS = Path(__file__).with_name("kernels")
ALIGN = 256  # plane and payload offsets inside group buffers


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@functools.cache
def _module(name: str, device: int):
    import cupy as cp

    with cp.cuda.Device(device):
        src = (KERNELS / f"{name}.cu").read_text()
        return cp.RawModule(code=src, options=("-std=c++17", f"-I{KERNELS}"))


def kernel(module: str, name: str):
    return _module(module, torch.cuda.current_device()).get_function(name)


def stream():
    import cupy as cp

    return cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream,
                                  torch.cuda.current_device())


def launch(module: str, name: str, grid: int, block: int, *args: object) -> None:
    """Launch ``name`` from ``kernels/<module>.cu`` on torch's current stream."""
    if grid <= 0:
        return
    kernel(module, name)((grid,), (block,), args, stream=stream())


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def i64(x: int) -> np.int64:
    return np.int64(x)


def device_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")


def to_device(a: np.ndarray) -> torch.Tensor:
    """A small host table on the device (the copy is ordered on the current stream)."""
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    host = torch.from_numpy(a.reshape(-1).view(np.uint8))
    return host.to("cuda", non_blocking=False)


def to_host(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    return t.cpu().numpy().view(dtype)


def pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)


def copy_ops(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    """Batched device copies: ``length[i]`` bytes from ``src[i]`` to ``dst[i]`` (addresses)."""
    keep = length > 0
    if not keep.any():
        return
    table = np.stack([src[keep], dst[keep], length[keep]]).astype(np.uint64)
    dev = to_device(table)
    n = int(keep.sum())
    base = dev.data_ptr()
    launch("copy", "copy_ops", n, 256, np.uint64(base), np.uint64(base + 8 * n),
           np.uint64(base + 16 * n))


def leaf_digests(ptrs: list[int], lengths: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """XXH3-64 digests of the 64 KiB leaves of each segment: (device digests, first index)."""
    from s4weights.gpu.hash import leaf_count

    first = np.zeros(len(ptrs) + 1, dtype=np.int64)
    np.cumsum([leaf_count(n) for n in lengths], out=first[1:])
    total = int(first[-1])
    out = torch.empty(max(total, 1), dtype=torch.int64, device="cuda")
    if total:
        p = to_device(np.asarray(ptrs, dtype=np.uint64))
        n = to_device(np.asarray(lengths, dtype=np.uint64))
        f = to_device(first)
        warps_per_cta = 8
        launch("hash", "leaf_digests", (total + warps_per_cta - 1) // warps_per_cta,
               32 * warps_per_cta, np.int32(len(ptrs)), ptr(p), ptr(n), ptr(f), ptr(out))
    return out, first


class Profile:
    """Stage timings (device synchronised) printed to stderr when $S4_GPU_PROFILE is set."""

    def __init__(self, what: str) -> None:
        self.on = bool(os.environ.get("S4_GPU_PROFILE"))
        self.what = what
        self.marks: list[tuple[str, float]] = []
        self.t = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self.on:
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.marks.append((stage, now - self.t))
            self.t = now

    def report(self) -> None:
        if self.on:
            print(f"[s4 gpu {self.what}] " + ", ".join(f"{s} {1e3 * t:.1f} ms"
                                                      for s, t in self.marks), file=sys.stderr)
