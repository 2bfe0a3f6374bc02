"""Where a CPU save's and load's time goes, next to torch.save / torch.load of the same state.

For each state of bench/cpu_speed.py, ``s4weights.save`` into memory and ``s4weights.load``
from memory (and torch's two calls, for reference) are called ``--reps`` times after a warm-up,
the state first checked to load back bit-exact.
Over those calls: the median wall time; each thread's CPU time, user and system, from /proc;
the process's minor page faults and voluntary context switches. Then the same calls once more
with every bound kernel of the CPU path wrapped in a timer: the time each thread spent inside
the kernels, by kernel (the wrapper adds about a microsecond a call). A thread's CPU time less
its kernels' is Python, numpy and the libraries' C; its wall time less its CPU time is waiting
(for the GIL, for work, for the other thread's result). A kernel releases the GIL while it runs
and takes it back to return: the time inside the kernels beyond their CPU time is mostly that
wait, while the other thread runs Python.

    python bench/breakdown.py [--states fp32,bf16,lora] [--reps 9]

Needs the ``bench`` extra; without MiniLM-L6's package the default states are "trained" and
"lora".

Linux only (/proc). ``S4_THREADS`` sets the threads, as for every call of the CPU path. JSON to
$OUT/breakdown.json when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoints
import cpu_speed
import timing
import torch

import s4weights
from s4format import jit, threads

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_times() -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of each thread of this process, by thread ID."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # (a thread that ended meanwhile)
            continue
        out[int(tid)] = (int(fields[11]) / _TICK, int(fields[12]) / _TICK)
    return out


def _switches() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split(":")[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches"))


def counters(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    """Median wall seconds of ``reps`` calls, and per call: each busy thread's CPU seconds
    (the caller's first), minor page faults and voluntary context switches."""
    main = threading.get_native_id()
    t0, r0, s0 = _thread_times(), resource.getrusage(resource.RUSAGE_SELF), _switches()
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    t1, r1, s1 = _thread_times(), resource.getrusage(resource.RUSAGE_SELF), _switches()
    cpu = {tid: tuple((b - a) / reps for a, b in zip(t0.get(tid, (0.0, 0.0)), t1[tid]))
           for tid in t1}
    busy = sorted((tid for tid in cpu if sum(cpu[tid]) > 0), key=lambda t: t != main)
    return {"wall": statistics.median(walls),
            "threads": [{"caller": tid == main, "user": cpu[tid][0], "system": cpu[tid][1]}
                        for tid in busy],
            "faults": (r1.ru_minflt - r0.ru_minflt) / reps,
            "switches": (s1 - s0) / reps}


def in_kernels(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    """Seconds a call spends inside the kernels, per thread (the caller's first) and per
    kernel (over all threads), and the CPU seconds of those calls (a kernel's wall time
    beyond its CPU time is mostly its return waiting for the GIL), averaged over ``reps``
    calls with every bound kernel timed."""
    spent: collections.Counter = collections.Counter()  # wall seconds, by (caller?, kernel)
    busy: collections.Counter = collections.Counter()  # the calling thread's CPU seconds
    calls: collections.Counter = collections.Counter()
    lock = threading.Lock()
    main = threading.get_native_id()

    def timed(kernel: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return kernel(*args)
            finally:
                took, used = time.perf_counter() - start, time.thread_time() - cpu
                with lock:
                    spent[(threading.get_native_id() == main, name)] += took
                    busy[name] += used
                    calls[name] += 1
        return call

    originals = [(module, name, module[name]) for module, name in jit.bound()]
    for module, name, kernel in originals:
        module[name] = timed(kernel, name)
    try:
        for _ in range(reps):
            fn()
    finally:
        for module, name, kernel in originals:
            module[name] = kernel
    by_kernel: collections.Counter = collections.Counter()
    for (_caller, name), s in spent.items():
        by_kernel[name] += s
    return {"caller": sum(s for (c, _n), s in spent.items() if c) / reps,
            "workers": sum(s for (c, _n), s in spent.items() if not c) / reps,
            "cpu": sum(busy.values()) / reps,
            "calls": sum(calls.values()) / reps,
            "by_kernel": {name: s / reps for name, s in by_kernel.most_common()}}


def run_state(name: str, reps: int) -> dict[str, Any]:
    state = cpu_speed.STATES[name]()
    buf = io.BytesIO()
    s4weights.save(state, buf)
    stored = buf.getvalue()
    if not checkpoints.same(state, s4weights.load(io.BytesIO(stored))):
        sys.exit(f"the {name} state did not load back bit-exact")
    buf = io.BytesIO()
    torch.save(state, buf)
    plain = buf.getvalue()
    ops = {"save": lambda: s4weights.save(state, io.BytesIO()),
           "load": lambda: s4weights.load(io.BytesIO(stored)),
           "torch.save": lambda: torch.save(state, io.BytesIO()),
           "torch.load": lambda: torch.load(io.BytesIO(plain), weights_only=False)}
    out: dict[str, Any] = {"raw_bytes": sum(t.numel() * t.element_size()
                                            for t in cpu_speed.tensors_of(state)),
                           "stored_bytes": len(stored)}
    for op, fn in ops.items():
        for _ in range(3):
            fn()
        out[op] = counters(fn, reps)
        if not op.startswith("torch"):
            out[op]["kernels"] = in_kernels(fn, reps)
    return out


def table(results: dict[str, Any]) -> list[str]:
    rows = []
    for state, r in results.items():
        for op in ("save", "load"):
            c, k = r[op], r[op]["kernels"]
            cpu = " + ".join(f"{t['user'] * 1e3:.0f}/{t['system'] * 1e3:.0f}"
                             for t in c["threads"])
            top = ", ".join(f"{n} {s * 1e3:.1f}" for n, s in list(k["by_kernel"].items())[:4])
            torch_wall = r["torch." + op]["wall"]
            rows.append([state, op, f"{c['wall'] * 1e3:.1f}", f"{torch_wall * 1e3:.1f}", cpu,
                         f"{k['caller'] * 1e3:.1f} + {k['workers'] * 1e3:.1f}",
                         f"{k['cpu'] * 1e3:.1f}", f"{k['calls']:.0f}", f"{c['faults']:.0f}",
                         f"{c['switches']:.0f}", top])
    return timing.markdown(
        ["state", "call", "S4 ms", "torch ms", "CPU ms user/system (caller + workers)",
         "in kernels ms (caller + workers)", "kernels' CPU ms", "kernel calls", "page faults",
         "switches", "kernels ms (all threads)"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", help="comma-separated, of " + ",".join(cpu_speed.STATES)
                    + " (default fp32,bf16,lora; trained,lora without MiniLM-L6's package)")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    if not Path("/proc/self/task").is_dir():
        sys.exit("bench/breakdown.py reads /proc (Linux)")
    states = args.states or ("fp32,bf16,lora" if "fp32" in cpu_speed.default_states()
                             else "trained,lora")
    results = {name: run_state(name, args.reps) for name in states.split(",")}
    timing.finish("breakdown", f"Where a CPU save and load spend their time ({threads.count()} "
                  "threads)", table(results), results)


if __name__ == "__main__":
    main()
