"""Where a warm device-to-device call spends its wall time, on the GPU machine
(``python3 bench/timeline.py``): one profiled call each of (a) encode and decode (1 GiB bf16) and
(b) encode and decode (the training state of bench/gpu.py), with the host stages marked
(``torch.profiler.record_function`` around the coder's methods) and every device activity. It
prints, per call, the wall time, the device's busy time, and the device's idle gaps with the
host stages that ran during each: what the device waits for. Informative only; bench/gpu.py
holds the figures the issue's targets are read from. ``S4_TRACE_DIR``: also write each call's
Chrome trace there. ``S4_TIMELINE_CASES=a``: the (a) calls only (no training)."""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import torch

import s4format
from s4weights.gpu import decode, encode, runtime
from s4weights.gpu import decode_large as chunked
from s4weights.gpu.encode import Encoder

# host stages marked in the trace: (module or class, function names)
STAGES = [
    (Encoder, ["_plan", "_histograms", "_encode_group", "_prepare", "_split", "_encode",
               "_rans_launch", "_rans_collect", "_assemble", "finish", "candidates"]),
    (encode, ["choose"]),
    (decode, ["read_tensors", "stage", "decode_staged", "_prepare", "read_into", "copy_into",
              "_apply_parents", "_check_hashes"]),
    (chunked, ["load_large", "_load_chunk", "_tables", "_windows", "_check", "code_large",
               "_code_chunks"]),
    (chunked._Chunks, ["split", "queue_split"]),
    (chunked._Streams, ["__init__", "copy_plain", "copy_plane", "collect", "coded"]),
    (chunked._Level, ["__init__", "pieces", "need"]),
    (chunked._Run, ["__init__", "addresses", "tables", "launch"]),
    (runtime, ["leaf_digests", "plane_checksums", "content_hashes", "upload", "copy_ops"]),
]
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def mark_stages() -> None:
    for owner, names in STAGES:
        for name in names:
            f = getattr(owner, name, None)
            if f is None:
                continue
            label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

            def wrapped(*a, _f=f, _n=label, **k):
                with torch.profiler.record_function(_n):
                    return _f(*a, **k)

            w = functools.wraps(f)(wrapped)
            static = isinstance(inspect.getattr_static(owner, name), staticmethod)
            setattr(owner, name, staticmethod(w) if static else w)


def timeline(what: str, fn, trace_dir: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
          torch.profiler.record_function("CALL")):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    stem = "".join(c for c in what if c.isalnum() or c == " ").replace(" ", "_")
    folder = Path(trace_dir or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.json"
    prof.export_chrome_trace(str(path))
    ev = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    if not trace_dir:
        path.unlink()
    summarise(what, ev, wall)


def summarise(what: str, ev: list[dict], wall: float) -> None:
    """Print the summary of one call's trace events (Chrome trace "X" events)."""
    call = [e for e in ev if e.get("name") == "CALL" and e.get("cat") == "user_annotation"]
    if not call:
        print(f"timeline {what}: no CALL range in the trace", flush=True)
        return
    t0, t1 = call[0]["ts"], call[0]["ts"] + call[0]["dur"]
    dev = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
                 if e.get("cat") in DEVICE_CATS and t0 <= e["ts"] <= t1)
    host = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
            if e.get("cat") == "user_annotation" and e["name"] != "CALL"]
    syncs = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
             if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]]
    busy, gaps, end = 0.0, [], t0
    for s, e, _n in dev:
        if s > end:
            gaps.append((end, s))
        busy += e - s
        end = max(end, e)
    if t1 > end:
        gaps.append((end, t1))
    print(f"timeline {what}: wall {wall * 1e3:.2f} ms (traced {(t1 - t0) / 1e3:.2f}), device busy "
          f"{busy / 1e3:.2f} ms, {len(dev)} device activities, {len(syncs)} host syncs "
          f"({sum(e - s for s, e, _ in syncs if t0 <= s <= t1) / 1e3:.2f} ms waiting)",
          flush=True)
    api = [(e["ts"], e["ts"] + e["dur"], "cuda: " + e["name"]) for e in ev
           if e.get("cat") == "cuda_runtime" and e["dur"] > 20]
    idle: dict[str, float] = {}
    for gs, ge in gaps:
        # the host stages (and slow CUDA runtime calls) running in the gap, by overlap
        for s, e, n in host + api:
            ov = min(e, ge) - max(s, gs)
            if ov > 0:
                idle[n] = idle.get(n, 0.0) + ov
    total_gap = sum(ge - gs for gs, ge in gaps)
    per: dict[str, list[float]] = {}
    for s, e, n in dev:
        per.setdefault(n, []).append(e - s)
    print("  device time by activity (ms, count):", "; ".join(
        f"{n[:40]} {sum(v) / 1e3:.2f} ({len(v)})"
        for n, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:8]), flush=True)
    print(f"  device idle {total_gap / 1e3:.2f} ms; host stages running while it idles "
          "(overlapping, ms):", flush=True)
    for n, v in sorted(idle.items(), key=lambda kv: -kv[1])[:20]:
        print(f"    {v / 1e3:7.2f}  {n}", flush=True)
    big = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    print("  largest idle gaps (start ms, length ms, innermost host stage at its start):")
    for gs, ge in sorted(big):
        inner = [(e - s, n) for s, e, n in host if s <= gs < e]
        print(f"    {(gs - t0) / 1e3:7.2f} {(ge - gs) / 1e3:6.2f}  "
              f"{min(inner)[1] if inner else '-'}", flush=True)


def d2d_calls(tensors: dict[str, torch.Tensor], workspace: int | None):
    """(encode, decode) as bench/gpu.py's device-to-device rows time them."""
    enc = Encoder("auto", workspace=workspace)
    items = gpu.s4_items(tensors)
    reader = s4format.Reader(encode.file_of(enc, tensors))
    outs = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
            for t in tensors.values()]
    gpu_rows = [i for i in range(len(outs)) if decode.decodable(reader, i)]
    groups, used, cur = [], 0, []
    for i in gpu_rows:
        need = decode.device_extra(reader, i)
        if cur and used + need > (workspace or 1 << 30):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += need
    groups.append(cur)
    staged = [decode.stage(reader, g) for g in groups if g]

    def dec() -> None:
        for g, st in zip([g for g in groups if g], staged):
            decode.decode_staged(st, [outs[i] for i in g])

    return (lambda: enc.encode_device(items)), dec


def reps(what: str, fn, collect: bool, n: int = 5) -> None:
    """Wall ms of ``n`` calls, as bench/gpu.py times them (``collect``: with its garbage
    collection before each call), to compare with the traced call."""
    import gc
    times, out = [], None
    for _ in range(n):
        out = None
        if collect:
            gc.collect()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    del out
    print(f"reps {what} ({'gc.collect() before each' if collect else 'no collection'}), ms: "
          + " ".join(f"{t:.2f}" for t in times), flush=True)


def warm_cases(which: str):
    """(name, encode call, decode call) of (a) and, if "b" is in ``which``, (b) (its state
    trained for ``S4_BENCH_STEPS`` steps, default 30), each run three times first."""
    g = torch.Generator(device="cuda").manual_seed(0)
    one = {"x": (torch.randn(1 << 29, device="cuda", generator=g) * 0.02).to(torch.bfloat16)}
    cases = [("a", one, None)]
    if "b" in which:
        state = gpu.trained_state(int(os.environ.get("S4_BENCH_STEPS", "30")))
        cases.append(("b", gpu.flat_tensors(state), 1 << 30))
    for name, tensors, workspace in cases:
        enc, dec = d2d_calls(tensors, workspace)
        for _ in range(3):
            r = enc()
            del r
            dec()
        torch.cuda.synchronize()
        yield name, enc, dec


def main() -> None:
    trace_dir = os.environ.get("S4_TRACE_DIR")
    mark_stages()
    for name, enc, dec in warm_cases(os.environ.get("S4_TIMELINE_CASES", "ab")):
        for collect in (False, True):
            reps(f"({name}) encode", enc, collect)
            reps(f"({name}) decode", dec, collect)
        timeline(f"({name}) encode", enc, trace_dir)
        timeline(f"({name}) decode", dec, trace_dir)


if __name__ == "__main__":
    main()
