"""What the device holds at a load's peak, on the GPU machine (``python3 bench/peak_probe.py``):
bench/small_states.py's ~``S4_PEAK_MB`` MB state (default 300) saved to memory and loaded back
at its default workspace with torch's allocator history recorded; the history is replayed to
find the moment of the most bytes allocated, and the blocks live then are listed by size with
the innermost s4weights frame that allocated them (the loaded tensors themselves apart); and
the peak in whole allocated blocks (``max_memory_allocated``) against the peak in requested
bytes (the caching allocator's ``requested_bytes``).
Informative: where a load's extra memory over its workspace comes from."""

from __future__ import annotations

import collections
import io
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import small_states

import s4weights
from s4weights.gpu import plan

MIB = 1 << 20


def frame_of(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "s4weights" in name or "s4format" in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(outside s4weights)"


def main() -> None:
    model, opt, step = gpu.training_run()
    for _ in range(int(os.environ.get("S4_SMALL_STEPS", "50"))):
        step()
    flat = gpu.flat_tensors(gpu.state_of(model, opt))
    del model, opt, step
    state = small_states.prefix(flat, int(os.environ.get("S4_PEAK_MB", "300")) * 10**6)
    del flat
    raw = sum(v.numel() * v.element_size() for v in state.values())
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    data = buf.getvalue()
    ws = plan.default_workspace(raw)
    for _ in range(2):
        s4weights.load(data, map_location="cuda", device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    base_req = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    got = s4weights.load(data, map_location="cuda", device="cuda")
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    req = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base_req
    print(f"{raw / 1e6:.1f} MB, {len(state)} tensors, workspace {ws / MIB:.1f} MiB: peak extra "
          f"{(peak - raw) / MIB:.1f} MiB over the loaded tensors in allocated blocks, "
          f"{(req - raw) / MIB:.1f} MiB in requested bytes", flush=True)
    actions = collections.Counter(ev["action"] for ev in
                                  snap["device_traces"][torch.cuda.current_device()])
    print("trace actions:", dict(actions), flush=True)
    live: dict[int, tuple[int, str]] = {}
    used = top = 0
    at_top: dict[int, tuple[int, str]] = {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], frame_of(ev.get("frames", [])))
            used += ev["size"]
            if used > top:
                top, at_top = used, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            used -= live.pop(ev["addr"])[0]
    outs = {t.data_ptr() for t in got.values()}
    by = collections.Counter()
    count = collections.Counter()
    for addr, (size, where) in at_top.items():
        key = "a loaded tensor" if addr in outs else where
        by[key] += size
        count[key] += 1
    print(f"at the replayed peak ({top / MIB:.1f} MiB above the call's start):", flush=True)
    for key, size in by.most_common(20):
        print(f"  {size / MIB:9.2f} MiB  {count[key]:5d} blocks  {key}", flush=True)


if __name__ == "__main__":
    main()
