"""Reading a base -> delta chain on the GPU machine (``python3 bench/chain_load_gpu.py``):
bench/gpu.py's (b) transformer trained on, its state saved every ``S4_CKPT_INTERVAL`` steps
(default 10) with ``save_checkpoint`` as one base and ``S4_CHAIN_DEPTH`` deltas (default 5),
then every checkpoint of the chain loaded back onto the GPU (``load_checkpoint(...,
device="cuda")``, nothing cached, best of two), against torch.load(map_location="cuda") of
the same state from the same disk. Uses only the public API, so the same script times an
older tree (``PYTHONPATH=<tree>``) for an A/B. Per load: the chain depth, seconds, the GB/s
of the state's raw bytes and of every level's raw bytes decoded, and the peak extra GPU
memory; the last load is compared bit for bit. ``S4_CHAIN_PROFILE=N``: the N functions the
deepest load's host spends most time in (cProfile). JSON to ``$OUT/chain_load_gpu.json`` when
OUT is set."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # bench/gpu.py: the same model and state

import s4weights
from s4weights import chain

MIB = 1 << 20


def raw_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in gpu.flat_tensors(state).values())


def main() -> None:
    interval = int(os.environ.get("S4_CKPT_INTERVAL", "10"))
    depth = int(os.environ.get("S4_CHAIN_DEPTH", "5"))
    model, opt, step = gpu.training_run()
    for _ in range(50):
        step()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("S4_BENCH_DIR")) as tmp:
        root = Path(tmp) / "run"
        state = None
        depths = []
        for k in range(depth + 1):
            for _ in range(interval):
                step()
            del state
            state = gpu.state_of(model, opt)
            info = s4weights.save_checkpoint(state, root, k, device="cuda",
                                             keyframe_interval=depth + 1)
            depths.append(info.depth)
        raw = raw_bytes(state)
        torch.save(state, Path(tmp) / "x.pt")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for k in range(depth + 1):
            best = last = None
            for _ in range(2):
                last = None  # (the first try's state is not held through the second)
                chain._PARENT_CACHE.clear()  # (a load reads the store in any case)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                got = s4weights.load_checkpoint(root, k, device="cuda")
                torch.cuda.synchronize()
                took = time.perf_counter() - t0
                peak = torch.cuda.max_memory_allocated() - base - raw_bytes(got)
                best = took if best is None else min(best, took)
                last = got if k == depth else None
                del got
            rows.append(dict(step=k, depth=depths[k], load_s=round(best, 3),
                             state_GBps=round(raw / best / 1e9, 2),
                             decoded_GBps=round(raw * (depths[k] + 1) / best / 1e9, 2),
                             peak_extra_MiB=round(peak / MIB)))
            print(json.dumps(rows[-1]), flush=True)
        exact = gpu.same_state(last, state)
        del last
        if os.environ.get("S4_CHAIN_PROFILE"):  # where the deepest load's host time goes
            gpu.profile_call(lambda: s4weights.load_checkpoint(root, depth, device="cuda"),
                             int(os.environ["S4_CHAIN_PROFILE"]))
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            back = torch.load(Path(tmp) / "x.pt", map_location="cuda")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del back
        print(f"torch.load of the same state (map_location='cuda'): {min(times):.3f} s; "
              f"state {raw / 1e9:.3f} GB; last checkpoint bit-exact {exact}", flush=True)
    if out := os.environ.get("OUT"):
        Path(out, "chain_load_gpu.json").write_text(json.dumps(
            dict(loads=rows, torch_load_s=round(min(times), 3), raw_bytes=raw, exact=exact),
            indent=1))
    if not exact:
        sys.exit(1)


if __name__ == "__main__":
    main()
