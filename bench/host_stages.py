"""The host's share of a warm device-to-device call, on the GPU machine (``python3
bench/host_stages.py``): bench/gpu.py's (a) and (b) encode and decode calls, timed with no
profiler, each host stage's exclusive time taken with ``time.perf_counter`` around the coder's
methods (bench/timeline.py's stages and the runtime's primitives), the host's waits for the
device apart. It prints, per call, the wall time, the waits, the host work that is not a wait,
and the stages by their exclusive time. Against the device time of the same call (bench/gpu.py's
kernel profile) this says how much of the wall the host adds: a call whose host work outlasts
its kernels cannot get faster from faster kernels. Informative only. ``S4_HOST_CASES=a``: the
(a) calls only (no training); ``S4_BENCH_STEPS``: training steps of (b)'s state (default 30)."""

from __future__ import annotations

import functools
import gc
import inspect
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import timeline
import torch

from s4weights.gpu import runtime

PRIMITIVES = (runtime, ["launch", "upload", "device_empty", "pinned", "copy_ops", "leaf_digests"])
WAITS = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
         (torch.Tensor, "cpu")]  # (a device-to-host .cpu() waits for the stream)
WAIT = "wait: "

_time: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_stack: list[float] = []  # per open stage: the time its inner stages took


def _timed(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its exclusive time to ``_time[label]``."""
    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        _stack.append(0.0)
        try:
            return f(*a, **k)
        finally:
            took = time.perf_counter() - t0
            inner = _stack.pop()
            _time[label] += took - inner
            _calls[label] += 1
            if _stack:
                _stack[-1] += took

    setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def instrument() -> None:
    done = set()
    for owner, names in [*timeline.STAGES, PRIMITIVES]:
        for name in names:
            if getattr(owner, name, None) is not None and (owner, name) not in done:
                done.add((owner, name))
                _timed(owner, name, f"{owner.__name__.rsplit('.', 1)[-1]}.{name}")
    for owner, name in WAITS:
        _timed(owner, name, f"{WAIT}{owner.__name__}.{name}")


def report(what: str, fn, n: int = 20) -> None:
    """``n`` warm calls of ``fn``, each after a garbage collection (as bench/gpu.py times them)."""
    walls = []
    _time.clear()
    _calls.clear()
    for _ in range(n):
        gc.collect()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        del out
    waits = sum(v for k, v in _time.items() if k.startswith(WAIT)) / n
    host = sum(v for k, v in _time.items() if not k.startswith(WAIT)) / n
    print(f"host {what}: wall median {1e3 * statistics.median(walls):.2f} ms (min "
          f"{1e3 * min(walls):.2f}); host work {1e3 * host:.2f} ms, waiting for the device "
          f"{1e3 * waits:.2f} ms, the rest (the final synchronisation, untimed code) "
          f"{1e3 * (statistics.median(walls) - host - waits):.2f} ms", flush=True)
    for k, v in sorted(_time.items(), key=lambda kv: -kv[1])[:16]:
        print(f"    {1e3 * v / n:7.3f} ms  {_calls[k] / n:6.1f} calls  {k}", flush=True)


def main() -> None:
    instrument()
    for name, enc, dec in timeline.warm_cases(os.environ.get("S4_HOST_CASES", "ab")):
        report(f"({name}) encode", enc)
        report(f"({name}) decode", dec)
        del enc, dec
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
