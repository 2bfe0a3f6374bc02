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

from s4weights.gpu import runtime
from s4weights.gpu.encode import Encoder


def call_costs(reps: int = 2000) -> None:
    """Host microseconds per call of what a group does a few dozen times: uploads of small
    tables, kernel launches, device and pinned allocations, a round trip (sync) with a small
    copy back. (Device idle, so these are host costs plus, for the round trip, latency.)"""
    import time

    import numpy as np
    import torch

    a, b, c = (np.arange(100, dtype=np.uint64) for _ in range(3))
    dst = runtime.device_empty(4096)
    small = torch.zeros(16, dtype=torch.int64, device="cuda")
    ops = np.array([dst.data_ptr()], np.uint64)
    _table, (sp, dp, lp) = runtime.upload(ops, ops + np.uint64(2048), np.array([1024], np.uint64))
    cases = {
        "runtime.upload (3 tables of 800 B)": lambda: runtime.upload(a, b, c),
        "runtime.launch (copy_ops, 1 op)": lambda: runtime.launch(
            "copy", "copy_ops", 1, 256, np.uint64(sp), np.uint64(dp), np.uint64(lp)),
        "runtime.copy_ops (1 op: table upload + launch)": lambda: runtime.copy_ops(
            ops, ops + np.uint64(2048), np.array([1024], np.uint64)),
        "torch.empty on the device (1 MiB)": lambda: runtime.device_empty(1 << 20),
        "runtime.pinned (4 KiB)": lambda: runtime.pinned(4096),
        "round trip: small.cpu()": lambda: small.cpu(),
    }
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        print(f"{name:48} {1e6 * (time.perf_counter() - t0) / reps:7.1f} us", flush=True)


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
    call_costs()
    out = os.environ.get("OUT")
    if out:  # one warm call's host and device timeline (chrome trace), for gaps
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=True) as prof:
            enc.encode_device(items)
        prof.export_chrome_trace(str(Path(out) / "encode_trace.json"))

if __name__ == "__main__":
    main()
