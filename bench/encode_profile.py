"""Where the save side's time goes on (b), the training state of bench/gpu.py (run on the GPU
machine: ``python3 bench/encode_profile.py``): device-to-device encode at a few workspaces
(group counts), per-group stage times, and a cProfile of one warm call by own and cumulative
time. Informative only; bench/gpu.py holds the figures the issue's targets are read from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu

from s4weights.gpu.encode import Encoder


def main() -> None:
    state = gpu.trained_state(int(os.environ.get("S4_BENCH_STEPS", "50")))
    tensors = gpu.flat_tensors(state)
    items = gpu.s4_items(tensors)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"{len(items)} tensors, {raw / 2**30:.2f} GiB", flush=True)
    for ws in (1 << 30, 2 << 30, 4 << 30):
        enc = Encoder("auto", workspace=ws)
        s, groups = gpu.timed(lambda enc=enc: enc.encode_device(items))
        print(f"workspace {ws >> 20} MiB: {len(groups)} groups, "
              f"{sum(len(g.planes) for g in groups)} planes, {raw / s / 1e9:.1f} GB/s", flush=True)
        del groups
    enc = Encoder("auto", workspace=1 << 30)
    os.environ["S4_GPU_PROFILE"] = "1"
    enc.encode_device(items)
    del os.environ["S4_GPU_PROFILE"]
    gpu.profile_call(lambda: enc.encode_device(items), 45)

if __name__ == "__main__":
    main()
