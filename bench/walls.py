"""Synchronised wall times of a GPU call, for the benches that time one call in a loop."""

from __future__ import annotations

import time

import torch


def walls(fn, reps: int, warm: int = 1) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warm`` untimed ones, the device
    synchronised before and after each call."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out
