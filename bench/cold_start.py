"""A fresh process's first save and load on the GPU machine (``python3 bench/cold_start.py``):
each case runs in a child process, with CuPy's kernel cache and numba's cache in new empty
folders ("cold": a bare machine or a fresh container), in the folders a cold run just filled
("warm": any later process there), or with only CuPy's cold ("cupy_cold"). Per case:
seconds to import, for the first ``s4weights.save`` of a 64 MiB state on the GPU, the first
load, and a second save and load; then, in cold children of their own, the kernel modules
compiled one after the other (each one's time) and as ``runtime._module`` compiles them (all
at the first request; the time until each is ready). ``S4_COLD_PROFILE=1``: the warm child's
first load profiled. JSON to ``$OUT/cold_start.json`` when OUT is set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import cProfile, io, json, pstats, sys, time
t0 = time.perf_counter()
import torch
import s4weights
t1 = time.perf_counter()
g = torch.Generator(device="cuda").manual_seed(0)
state = {f"w{i}": (torch.randn(1 << 20, device="cuda", generator=g) * .02).to(dt)
         for i, dt in enumerate([torch.bfloat16, torch.float16, torch.float32] * 8)}
state["step"] = torch.tensor(3, device="cuda")
torch.cuda.synchronize()
out = {"import_s": t1 - t0}
for k in ("first", "second"):
    t = time.perf_counter()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    torch.cuda.synchronize()
    out[k + "_save_s"] = time.perf_counter() - t
    prof = cProfile.Profile() if k == "first" and len(sys.argv) > 1 else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    got = s4weights.load(buf.getvalue(), map_location="cuda", device="cuda")
    torch.cuda.synchronize()
    out[k + "_load_s"] = time.perf_counter() - t
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    assert all(torch.equal(got[n].view(torch.uint8), v.view(torch.uint8))
               for n, v in state.items() if v.dim())
print(json.dumps(out))
"""

MODULES = r"""
import json, time
import torch
from s4weights.gpu import runtime
torch.zeros(1, device="cuda")
import cupy
import sys
out = {}
names = sorted(p.stem for p in runtime.KERNELS.glob("*.cu"))
t0 = time.perf_counter()
for name in names:
    t = time.perf_counter()
    if sys.argv[1] == "alone":
        runtime._compiled(name, 0)  # one after the other
    else:
        runtime._module(name, 0)  # the first call starts them all
    out[name] = time.perf_counter() - t
out["all"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def child(code: str, cache: Path, numba: Path | None = None, profile: bool = False,
          arg: str | None = None) -> dict:
    """The child's JSON line; ``profile``: its first load's cProfile (cumulative) printed."""
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache / "cupy"),
               NUMBA_CACHE_DIR=str((numba or cache) / "numba"))
    res = subprocess.run([sys.executable, "-c", code, *(["profile"] if profile else []),
                          *([arg] if arg else [])],
                         env=env, capture_output=True, text=True, check=False)
    if res.returncode:
        sys.exit(f"child failed:\n{res.stderr[-4000:]}")
    if profile:
        print(res.stderr[-6000:], flush=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "a"
        rows["cold"] = child(CHILD, cache)
        rows["warm"] = child(CHILD, cache, profile=bool(os.environ.get("S4_COLD_PROFILE")))
        rows["cupy_cold"] = child(CHILD, Path(tmp) / "c", numba=cache)  # numba's cache warm
        rows["modules_alone"] = child(MODULES, Path(tmp) / "b", arg="alone")
        rows["modules_at_once"] = child(MODULES, Path(tmp) / "d", arg="at_once")
    for k in ("cold", "cupy_cold", "warm"):
        r = rows[k]
        print(f"{k}: import {r['import_s']:.2f} s, first save {r['first_save_s']:.2f} s, first "
              f"load {r['first_load_s']:.2f} s, then save {r['second_save_s']:.3f} s, load "
              f"{r['second_load_s']:.3f} s", flush=True)
    for k in ("modules_alone", "modules_at_once"):
        print(f"kernel modules, cold, {k[8:]}, s: " + ", ".join(
            f"{n} {v:.2f}" for n, v in rows[k].items()), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cold_start.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
