"""The one timing helper of bench/, and the record every benchmark run leaves.

``measure`` calls a function a few times after warm-up and keeps the medians of wall seconds
and of process CPU seconds (all threads). With ``device="cuda"`` the device is synchronised
around each call, so a call's figure includes the work it queued. ``finish`` prints a run's
table last, under a header with the date, machine and command, and writes the same figures
with that context to ``$OUT/<name>.json`` when OUT is set (bench/figure.py reads them).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Timing:
    """Medians of the timed calls, every call's figures in order, and the last call's result."""

    wall: float
    cpu: float
    walls: tuple[float, ...]
    cpus: tuple[float, ...]
    result: Any = field(default=None, repr=False, compare=False)


def measure(fn: Callable[[], Any], reps: int = 5, *, warmup: int = 1,
            device: str | None = None, events: bool = False, collect: bool = False,
            before: Callable[[], None] | None = None) -> Timing:
    """Time ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    ``device="cuda"`` synchronises the device before and after each call; ``events`` takes the
    wall time from CUDA events recorded on the current stream around the call instead.
    ``collect`` collects garbage once, before the warm-up. ``before`` runs ahead of every call,
    off the clock (a barrier, a cache cleared). The previous call's result is dropped before
    the next call starts, so no call runs under twice the memory that one call needs.
    """
    if collect:
        gc.collect()
    sync = _synchroniser(device or ("cuda" if events else None))
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    walls: list[float] = []
    cpus: list[float] = []
    out = None
    for _ in range(reps):
        out = None
        if before is not None:
            before()
        sync()
        start, end = _events() if events else (None, None)
        c0, w0 = time.process_time(), time.perf_counter()
        if start is not None:
            start.record()
        out = fn()
        if end is not None:
            end.record()
        sync()
        wall = time.perf_counter() - w0
        cpus.append(time.process_time() - c0)
        walls.append(start.elapsed_time(end) / 1e3 if start is not None else wall)
    return Timing(statistics.median(walls), statistics.median(cpus), tuple(walls), tuple(cpus),
                  out)


def alternated(fns: dict[Any, Callable[[], Any]], rounds: int = 9, *, warmup: int = 1,
               device: str | None = None, before: Callable[[], None] | None = None
               ) -> dict[Any, Timing]:
    """:func:`measure` of several functions called in turn, one call of each a round, so that
    the machine's drift over the run (clocks, caches, other tenants) falls on all of them
    alike and their medians compare. ``warmup`` untimed rounds first; ``before`` and
    ``device`` as :func:`measure` takes them. Results are dropped as they come (no Timing
    holds one): a caller that checks them makes a call of its own."""
    sync = _synchroniser(device)
    for _ in range(warmup):
        for fn in fns.values():
            if before is not None:
                before()
            fn()
    walls: dict[Any, list[float]] = {k: [] for k in fns}
    cpus: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            if before is not None:
                before()
            sync()
            c0, w0 = time.process_time(), time.perf_counter()
            out = fn()
            sync()
            walls[k].append(time.perf_counter() - w0)
            cpus[k].append(time.process_time() - c0)
            del out  # (freed off the clock, as measure frees it)
    return {k: Timing(statistics.median(walls[k]), statistics.median(cpus[k]), tuple(walls[k]),
                      tuple(cpus[k])) for k in fns}


def _synchroniser(device: str | None) -> Callable[[], None]:
    if device is None or not str(device).startswith("cuda"):
        return lambda: None
    import torch

    return torch.cuda.synchronize


def _events() -> tuple[Any, Any]:
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def machine() -> str:
    """The CPU (model, cores this process may use), the GPU if torch sees one, and torch's
    version: what a figure depends on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [f"{model}, {cores} cores"]
    try:
        import torch
    except ImportError:
        return parts[0]
    if torch.cuda.is_available():
        parts.insert(0, torch.cuda.get_device_name())
    parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)


def command() -> str:
    """This run's command line, as a reader would type it from the repository root."""
    script = Path(sys.argv[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(Path.cwd())
    return " ".join(["python", str(script), *sys.argv[1:]])


def finish(name: str, title: str, table: list[str], results: Any) -> None:
    """Print ``title`` with the date, machine and command, then ``table`` (its last lines);
    write ``results`` with the same context to ``$OUT/<name>.json`` when OUT is set."""
    date = datetime.date.today().isoformat()
    where = machine()
    print(f"\n## {title} — {date}, {where}\n\nCommand: `{command()}`\n", flush=True)
    print("\n".join(table), flush=True)
    out = os.environ.get("OUT")
    if out:
        path = Path(out, f"{name}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"benchmark": name, "title": title, "date": date, "machine": where,
                  "command": command(), "results": results}
        path.write_text(json.dumps(record, indent=1))


def markdown(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
