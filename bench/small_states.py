"""States below 640 MiB on the GPU machine (``python3 bench/small_states.py``): the default
workspace is 10% of the state (at least 4 MiB), so such states code more of their tensors in
chunks than at a 64 MiB floor (the default before). Prefixes of bench/gpu.py's (b) state
(trained ``S4_SMALL_STEPS`` steps, default 50), of about 40, 120, 300 and 600 MB, are saved
to and loaded from memory on the GPU (``s4weights.save``/``load``, ``device="cuda"``) at
the default workspace and at max(64 MiB, 10%), against torch.save / torch.load
(map_location="cuda") of the same tensors. Per row: seconds (best of ``S4_BENCH_REPS``),
peak extra GPU memory, ratio, bit-exact. ``S4_SMALL_PROFILE=1``: the ~40 and ~120 MB
states' saves and loads profiled; ``S4_SMALL_TIMELINE=1``: the saves and loads of the ~40 and
~120 MB states traced (bench/timeline.py: device busy and idle time, the host stages the
device waits for; its stage markers slow every call a little, so take the figures from a run
without it).
``S4_SMALL_LOG2=14,12``: also rows at the default workspace with files whose rANS blocks hold
2^14 or 2^12 symbols (S4's writers use 2^16), to see what shorter blocks do there.
``S4_SMALL_TARGETS=40,120``: those states only (MB, default 40,120,300,600). JSON
to ``$OUT/small_states.json`` when OUT is set."""

from __future__ import annotations

import functools
import io
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # bench/gpu.py: the same model and state
import timeline

import s4weights
from s4weights.gpu import plan
from s4weights.gpu.encode import Encoder

MIB = 1 << 20
REPS = int(os.environ.get("S4_BENCH_REPS", "5"))


def best(fn) -> tuple[float, int, object]:
    """(best seconds of REPS calls, peak extra device bytes of the last, its result)."""
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base
        if REPS > 1 and len(times) < REPS:
            del out
    return min(times), peak, out


def prefix(flat: dict[str, torch.Tensor], limit: int) -> dict[str, torch.Tensor]:
    out, total = {}, 0
    for k, v in flat.items():
        n = v.numel() * v.element_size()
        if total + n > limit and out:
            break
        out[k], total = v, total + n
    return out


def main() -> None:
    if os.environ.get("S4_SMALL_TIMELINE"):
        timeline.mark_stages()
    model, opt, step = gpu.training_run()
    for _ in range(int(os.environ.get("S4_SMALL_STEPS", "50"))):
        step()
    flat = gpu.flat_tensors(gpu.state_of(model, opt))
    del model, opt, step
    rows = []
    for target in map(int, os.environ.get("S4_SMALL_TARGETS", "40,120,300,600").split(",")):
        state = prefix(flat, target * 10**6)
        raw = sum(v.numel() * v.element_size() for v in state.values())
        t_save, _p, blob = best(functools.partial(_torch_save, state))
        t_load, _p, _out = best(functools.partial(_torch_load, blob))
        print(f"{raw / 1e6:7.1f} MB, {len(state)} tensors: torch.save {t_save * 1e3:7.1f} ms, "
              f"torch.load {t_load * 1e3:7.1f} ms", flush=True)
        row = {"raw": raw, "tensors": len(state), "torch_save_s": t_save, "torch_load_s": t_load}
        cases = [("default", None, None), ("floor64", max(64 * MIB, raw // 10), None)]
        cases += [(f"log2 {lg}", None, int(lg))
                  for lg in os.environ.get("S4_SMALL_LOG2", "").split(",") if lg]
        for name, ws, lg in cases:
            shown = ws or plan.default_workspace(raw)
            s, ps, data = best(functools.partial(_s4_save, state, ws, lg))
            d, pd, got = best(functools.partial(s4weights.load, data, map_location="cuda",
                                                device="cuda", workspace=ws))
            pd -= raw  # the loaded tensors themselves
            if os.environ.get("S4_SMALL_TIMELINE") and target in (40, 120):
                timeline.timeline(f"save {raw / 1e6:.0f} MB {name}",
                                  functools.partial(_s4_save, state, ws, lg), None)
                timeline.timeline(f"load {raw / 1e6:.0f} MB {name}",
                                  functools.partial(s4weights.load, data, map_location="cuda",
                                                    device="cuda", workspace=ws), None)
            if os.environ.get("S4_SMALL_PROFILE") and target in (40, 120):
                gpu.profile_call(functools.partial(_s4_save, state, ws, lg), 25)
                gpu.profile_call(functools.partial(s4weights.load, data, map_location="cuda",
                                                   device="cuda", workspace=ws), 25)
            exact = all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
                        for k, v in state.items())
            row[name] = {"workspace": shown, "save_s": s, "load_s": d, "peak_save": ps,
                         "peak_load": pd, "ratio": len(data) / raw, "exact": exact}
            print(f"    {name:8} workspace {shown / MIB:6.1f} MiB: save {s * 1e3:7.1f} ms "
                  f"(+{ps / MIB:.0f} MiB), load {d * 1e3:7.1f} ms (+{pd / MIB:.0f} MiB), ratio "
                  f"{len(data) / raw:.4f}, exact {exact}", flush=True)
        rows.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "small_states.json").write_text(json.dumps(rows, indent=1))
    if not all(v["exact"] for r in rows for v in r.values() if isinstance(v, dict)):
        sys.exit("not bit-exact")


def _torch_save(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _torch_load(blob: bytes):
    return torch.load(io.BytesIO(blob), map_location="cuda")


def _s4_save(state, ws, log2_block=None) -> bytes:
    buf = io.BytesIO()
    kw = Encoder.__init__.__kwdefaults__
    old = kw["log2_block"]
    kw["log2_block"] = log2_block or old  # (save has no such option: the writers' default)
    try:
        s4weights.save(state, buf, device="cuda", workspace=ws)
    finally:
        kw["log2_block"] = old
    return buf.getvalue()


if __name__ == "__main__":
    main()
