"""DCP save and load of a sharded GPT-style training state with S4StorageWriter against torch's
FileSystemWriter, plain and with its ZStandard extension where this torch has it.

One question: what does S4 store and cost as DCP's storage layer? Bytes stored per kind of
tensor, and the save and load wall times of the slowest rank (bench/timing.py on each rank).

    python bench/dcp.py                                  # 2 CPU ranks, ~580 MB of state
    python bench/dcp.py --device cuda --ranks 1          # one GPU
    torchrun --nproc-per-node 8 bench/dcp.py --device cuda

The state is ``--params`` million GPT parameters sharded Shard(0) over the ranks as DTensors,
AdamW's exp_avg and exp_avg_sq after ``--steps`` steps on synthetic gradients, saved once with
fp32 weights and once with bf16 weights (the AdamW state fp32 in both). Every load is checked
bit-exact. Loads read what the save just wrote, mostly from the page cache, for every writer.
The table is printed last (rank 0); JSON to $OUT/dcp.json when OUT is set.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import timing
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import s4format
from s4weights.dcp import S4StorageReader, S4StorageWriter

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor, Shard

VOCAB = 32768


def gpt_shapes(params_m: float, layers: int = 12) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT of about ``params_m`` million parameters (rows a multiple of
    64, so they shard evenly over up to 64 ranks)."""
    dim = 64
    while 12 * layers * (dim + 64) ** 2 + 2 * VOCAB * (dim + 64) <= params_m * 1e6:
        dim += 64
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, dim)}
    for i in range(layers):
        p = f"blocks.{i}."
        shapes.update({p + "ln1.weight": (dim,), p + "attn.qkv.weight": (3 * dim, dim),
                       p + "attn.proj.weight": (dim, dim), p + "ln2.weight": (dim,),
                       p + "mlp.fc1.weight": (4 * dim, dim), p + "mlp.fc2.weight": (dim, 4 * dim)})
    shapes["head.weight"] = (VOCAB, dim)
    return shapes


def _local(name: str, shape: tuple[int, ...], rank: int, ranks: int) -> torch.Tensor:
    """This rank's Shard(0) rows of parameter ``name``: N(0, 0.02), or about 1 for a norm."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
    rows = shape[0] // ranks
    t = torch.randn((rows, *shape[1:]), generator=g)
    return 1 + 0.02 * t if name.endswith("ln1.weight") or name.endswith("ln2.weight") \
        else 0.02 * t


def training_state(shapes: dict[str, tuple[int, ...]], steps: int, mesh: Any,
                   device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Local weight shards and AdamW's state after ``steps`` steps of synthetic gradients
    whose scale differs per tensor, as gradients of real layers do."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    weights = {n: _local(n, s, rank, ranks).requires_grad_() for n, s in shapes.items()}
    opt = torch.optim.AdamW(weights.values(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        for i, w in enumerate(weights.values()):
            w.grad = torch.randn(w.shape, generator=g) * (1e-3 * (1 + i % 7))
        opt.step()

    def dt(t: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
        return DTensor.from_local(t.detach().to(device), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model = {n: dt(w, shapes[n]) for n, w in weights.items()}
    optim = {n: {"exp_avg": dt(opt.state[w]["exp_avg"], shapes[n]),
                 "exp_avg_sq": dt(opt.state[w]["exp_avg_sq"], shapes[n]),
                 "step": opt.state[w]["step"].clone()} for n, w in weights.items()}
    return model, optim


def kind_of(fqn: str) -> str:
    return "AdamW" if fqn.startswith("optim.") else "weights"


def _s4_sizes(path: str, md: Any) -> dict[str, int]:
    """Stored payload bytes per kind of tensor in an S4 checkpoint."""
    out: dict[str, int] = defaultdict(int)
    by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for index, info in md.storage_data.items():
        by_file[info.relative_path].append((kind_of(index.fqn), info.name))
    for name, items in by_file.items():
        with s4format.Reader(os.path.join(path, name)) as r:
            for kind, tensor in items:
                out[kind] += r.tensors[r.index_of(tensor)].stored_nbytes
    return out


def _fs_sizes(md: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for index, info in md.storage_data.items():
        out[kind_of(index.fqn)] += info.length
    return out


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall seconds of one collective call on the slowest rank, the ranks started together."""
    t = timing.measure(fn, 1, warmup=0, device=device.type, before=dist.barrier)
    took = torch.tensor([t.wall], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def writers(path: str) -> list[tuple[str, Any, Any]]:
    """(label, writer, reader) for each storage compared."""
    out = [("S4StorageWriter", S4StorageWriter(path), S4StorageReader(path)),
           ("FileSystemWriter", dcp.FileSystemWriter(path), dcp.FileSystemReader(path))]
    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        return out
    if ZStandard.is_available():
        out.append(("FileSystemWriter+ZStandard",
                    dcp.FileSystemWriter(path, _extensions=[ZStandard()]),
                    dcp.FileSystemReader(path)))
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if isinstance(a, dict):
        return all(_same(a[k], b[k]) for k in a)
    if isinstance(a, DTensor):
        a, b = a.to_local(), b.to_local()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v)
            for k, v in state.items()}


def run_case(case: str, state: dict[str, Any], root: str, raw: dict[str, int],
             device: torch.device) -> list[dict]:
    rows = []
    path = os.path.join(root, case)
    for label, writer, reader in writers(path):
        save_s = timed(lambda w=writer: dcp.save(state, storage_writer=w), device)
        dest = _zeros(state)
        load_s = timed(lambda r=reader, d=dest: dcp.load(d, storage_reader=r), device)
        if not _same(state, dest):
            raise SystemExit(f"{case} {label}: the load is not bit-exact")
        dist.barrier()
        if dist.get_rank() == 0:
            # The metadata as committed: what dcp.save returns lacks storage_data in some
            # torch versions (2.11).
            md = reader.read_metadata()
            sizes = _s4_sizes(path, md) if label == "S4StorageWriter" else _fs_sizes(md)
            rows.append({"case": case, "writer": label, "total": _dir_bytes(path),
                         **sizes, "save": save_s, "load": load_s, "raw": raw})
            shutil.rmtree(path)
        dist.barrier()
    return rows


def _raw(state: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    out["weights"] = sum(t.numel() * t.element_size() for t in state["model"].values())
    out["AdamW"] = sum(s[k].numel() * s[k].element_size() for s in state["optim"].values()
                       for k in ("exp_avg", "exp_avg_sq"))
    return out


def report(rows: list[dict], args: argparse.Namespace, load: tuple[float, ...]) -> None:
    print(f"load average before/after: {load[0]:.1f} / {os.getloadavg()[0]:.1f}")
    base = {r["case"]: r for r in rows if r["writer"] == "FileSystemWriter"}
    table = [[f"{r['case']} ({sum(r['raw'].values()) / 1e6:.0f} MB raw)", r["writer"],
              f"{r['total'] / 1e6:.1f}", f"{r['weights'] / base[r['case']]['weights']:.3f}",
              f"{r['AdamW'] / base[r['case']]['AdamW']:.3f}",
              f"{r['total'] / base[r['case']]['total']:.3f}", f"{r['save']:.2f}",
              f"{r['load']:.2f}"] for r in rows]
    timing.finish("dcp", f"DCP storage writers, {args.params:g}M parameters, {args.ranks} "
                  f"rank(s) on {args.device}",
                  timing.markdown(["state", "writer", "stored MB", "x FS weights", "x FS AdamW",
                                   "x FS total", "save s", "load s"], table),
                  {"ranks": args.ranks, "device": args.device, "params_m": args.params,
                   "rows": rows})


def bench(args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore")
    load_before = os.getloadavg()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) \
        if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model, optim = training_state(gpt_shapes(args.params), args.steps, mesh, device)
    w = next(iter(model.values()))
    small = {"w": w, "w_bf16": w.to(torch.bfloat16)}
    # compiles and caches the kernels of both cases' dtypes outside the timed cases
    run_case("warm-up", small, args.dir, _raw({"model": small, "optim": {}}), device)
    rows = []
    for case in ("fp32 weights + AdamW", "bf16 weights + AdamW"):
        if case.startswith("bf16"):
            model = {n: t.to(torch.bfloat16) for n, t in model.items()}
        state = {"model": model, "optim": optim}
        rows += run_case(case.split()[0], state, args.dir, _raw(state), device)
    if dist.get_rank() == 0:
        report(rows, args, load_before)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks))
    main(args)


def main(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=1800))
    try:
        bench(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=48, help="million parameters (default 48)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps before saving")
    p.add_argument("--ranks", type=int, default=2, help="ranks to start (not under torchrun)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dir", default="/tmp/s4w-bench-dcp", help="where checkpoints are written")
    arguments = p.parse_args()
    if "RANK" in os.environ:
        arguments.ranks = int(os.environ["WORLD_SIZE"])
        main(arguments)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
        mp.spawn(worker, args=(arguments,), nprocs=arguments.ranks)
