"""Where s4weights.save's time goes on (b), the training state of bench/gpu.py (run on the GPU
machine: ``python3 bench/save_profile.py``): the same save into sinks of different cost (a sink
that drops the bytes, an in-memory buffer, the local disk) and torch.save for scale, then a
cProfile of the caller's thread for the dropping sink. Informative only."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # bench/gpu.py: the same state
from walls import walls

import s4weights


class Drop(io.RawIOBase):
    """A sink that takes every byte and keeps none."""

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return memoryview(b).nbytes


def best(fn, reps: int = 3) -> float:
    return min(walls(fn, reps))


def main() -> None:
    state = gpu.trained_state(int(os.environ.get("S4_BENCH_STEPS", "50")))
    raw = sum(t.numel() * t.element_size() for t in gpu.flat_tensors(state).values())
    tmp = Path(tempfile.mkdtemp(prefix="s4prof"))
    cases = {
        "s4 -> drop": lambda: s4weights.save(state, Drop()),
        "s4 -> BytesIO": lambda: s4weights.save(state, io.BytesIO()),
        "s4 -> disk": lambda: s4weights.save(state, tmp / "x.s4w"),
        "torch -> BytesIO": lambda: torch.save(state, io.BytesIO()),
        "torch -> disk": lambda: torch.save(state, tmp / "x.pt"),
    }
    print(f"state {raw / 2**30:.2f} GiB", flush=True)
    for name, fn in cases.items():
        s = best(fn)
        print(f"{name:36} {s:7.3f} s  {raw / s / 1e9:6.2f} GB/s", flush=True)
    # what the disk's durability costs: write-back only at commit (the store before early
    # write-back), and no fsync at all (not crash-safe; for scale only)
    from s4weights.store import local

    every, fsync, fdatasync = local.SYNC_EVERY, os.fsync, os.fdatasync
    try:
        local.SYNC_EVERY = 1 << 62
        s = best(cases["s4 -> disk"])
        print(f"{'s4 -> disk, write-back at commit':36} {s:7.3f} s  {raw / s / 1e9:6.2f} GB/s")
        os.fsync = os.fdatasync = lambda fd: None
        s = best(cases["s4 -> disk"])
        print(f"{'s4 -> disk, no fsync (unsafe)':36} {s:7.3f} s  {raw / s / 1e9:6.2f} GB/s")
    finally:
        local.SYNC_EVERY, os.fsync, os.fdatasync = every, fsync, fdatasync
    gpu.profile_call(lambda: s4weights.save(state, Drop()), 30)

if __name__ == "__main__":
    main()
