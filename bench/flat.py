"""Flat buffers against the same parameters stored separately: ratio and save/load speed.

Large runs often hold state as one huge tensor mixing many parameters (FSDP1's FlatParameter,
DeepSpeed's and Megatron's flat optimizer partitions). This builds bench/checkpoints.py's
training state (bf16 weights, fp32 master weights, AdamW state), then the same state with its
tensors concatenated per dtype (one bf16 and one fp32 tensor; the step counters kept as they
are), and saves and loads both with ``s4weights.save``/``load`` to a local file, beside
``torch.save``/``load`` of the flat state. Ratio = stored / raw. Every load is checked
bit-exact.

    python bench/flat.py [--device cpu|cuda] [--dim N] [--layers N] [--steps N] [--reps N]
                         [--no-gpu-segments] [--load-workspace BYTES]

``--no-gpu-segments`` keeps one form per plane on the GPU path (S4_GPU_SEGMENTS=0), for the
comparison: by default the GPU coder cuts flat buffers into segments (codec 9), as the CPU
coder does. ``--load-workspace`` loads on the GPU within that workspace (``load``'s
``workspace=``): tensors larger than it are decoded in chunks.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
from pathlib import Path

import checkpoints as ckpt
import timing
import torch

import s4format
import s4weights

ROWS: list[dict] = []


def flatten_state(state: dict) -> dict:
    """The state's tensors of more than one element concatenated per dtype, in order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
    rest = {}

    def walk(obj, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.numel() > 1:
                groups[obj.dtype].append(obj.reshape(-1))
            else:
                rest[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}.{i}")

    walk(state, "state")
    flat = {f"flat_{str(dt).removeprefix('torch.')}": torch.cat(ts) for dt, ts in groups.items()}
    return {**flat, "scalars": rest}


def planes_of(path: Path) -> str:
    """Codec of each plane of the largest tensor of the file, for the table."""
    with s4format.Reader(path) as r:
        t = max(r.tensors, key=lambda t: t.raw_nbytes)
        return " ".join(f"{s4format.codecs.name_of(p.codec)}" for p in t.planes)


def one(name: str, state: dict, device: str, tmp: Path, reps: int,
        workspace: int | None = None) -> None:
    path = tmp / f"{name}.s4w"
    save = timing.measure(lambda: s4weights.save(state, path), reps, device=device)
    load = timing.measure(lambda: s4weights.load(path, map_location=device,
                                                 workspace=workspace), reps, device=device)
    pt = tmp / f"{name}.pt"
    pt_save = timing.measure(lambda: torch.save(state, pt), reps, device=device)
    pt_load = timing.measure(lambda: torch.load(pt, map_location=device), reps, device=device)
    raw = ckpt.raw_bytes(state)
    stored = save.result.stored_nbytes
    ROWS.append(dict(what=name, raw_bytes=raw, stored_bytes=stored, ratio=round(stored / raw, 4),
                     save_s=round(save.wall, 3), load_s=round(load.wall, 3),
                     torch_save_s=round(pt_save.wall, 3), torch_load_s=round(pt_load.wall, 3),
                     largest_tensor_codecs=planes_of(path),
                     bit_exact=ckpt.same(state, load.result)))
    print(ROWS[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, help="model width (default 768 on CUDA, 256 on the CPU)")
    ap.add_argument("--layers", type=int, help="layers (default 12 on CUDA, 4 on the CPU)")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per figure (default 3)")
    ap.add_argument("--no-gpu-segments", action="store_true",
                    help="one form per plane on the GPU path (S4_GPU_SEGMENTS=0)")
    ap.add_argument("--load-workspace", type=int,
                    help="GPU load workspace in bytes (default: load's own)")
    args = ap.parse_args()
    if args.no_gpu_segments:
        from s4weights.gpu import segments

        segments.ENABLED = False
    dev = args.device
    dim = args.dim or (768 if dev == "cuda" else 256)
    layers = args.layers or (12 if dev == "cuda" else 4)
    model, opt, step = ckpt.training(dev, dim, layers)
    for _ in range(args.steps):
        step()
    state = ckpt.state_of(model, opt)
    del model, opt
    tmp = Path(tempfile.mkdtemp(prefix="s4flat"))
    try:
        one("separate tensors", state, dev, tmp, args.reps, args.load_workspace)
        flat = flatten_state(state)
        del state
        one("flat per dtype", flat, dev, tmp, args.reps, args.load_workspace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sep, fl = ROWS
    summary = dict(what="flat / separate", ratio=round(fl["ratio"] / sep["ratio"], 4),
                   save_s=round(fl["save_s"] / sep["save_s"], 3),
                   load_s=round(fl["load_s"] / sep["load_s"], 3))
    ROWS.append(summary)
    keys = ["what", "ratio", "save_s", "load_s", "torch_save_s", "torch_load_s",
            "largest_tensor_codecs", "bit_exact"]
    table = timing.markdown(keys, [[r.get(k, "") for k in keys] for r in ROWS])
    seg = ", GPU segments off" if args.no_gpu_segments else ""
    if args.load_workspace:
        seg += f", load workspace {args.load_workspace >> 20} MiB"
    timing.finish("flat", f"Flat buffers against separate tensors ({dev}, width {dim}, "
                  f"{layers} layers{seg})", table, ROWS)
    if not all(r.get("bit_exact", True) for r in ROWS):
        raise SystemExit("a load differs from the state saved")


if __name__ == "__main__":
    main()
