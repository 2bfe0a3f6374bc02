"""Train a small GPT-style model with FSDP2 and checkpoint it through torch.distributed.checkpoint
into S4 storage: one .s4w file per rank, resumable at any world size.

    torchrun --nproc-per-node 2 examples/dcp_fsdp2.py --checkpoints /tmp/run --steps 20
    python examples/dcp_fsdp2.py --nproc 2 --checkpoints s3://bucket/run --steps 20
    python examples/dcp_fsdp2.py --nproc 2 --checkpoints /tmp/chain --chain --keep-last 3

Runs on CUDA with NCCL (one GPU per rank) where there are GPUs, else on the CPU with gloo.
Every ``--save-every`` steps it saves ``<checkpoints>/step-<n>``; at start it resumes from the
newest committed step there (a step whose save did not finish has no ``.metadata`` and is
skipped), whatever world size wrote it. With ``--chain`` it saves through
``s4weights.save_checkpoint(..., distributed=True)`` instead: each rank's shards as deltas of
its previous save where that pays, with retention (``--keep-last``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import s4weights
from s4weights.dcp import S4StorageReader, S4StorageWriter
from s4weights.store import open_store

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

VOCAB = 256


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self, dim: int, layers: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def latest_step(checkpoints: str) -> int | None:
    """The newest step under ``checkpoints`` whose save was committed (has .metadata)."""
    steps = [int(m.group(1)) for name in open_store(checkpoints).list()
             if (m := re.fullmatch(r"step-(\d+)/\.metadata", name))]
    return max(steps, default=None)


def batch(step: int, rank: int, device: torch.device) -> torch.Tensor:
    """A deterministic batch of token sequences for this step and rank."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, VOCAB, (8, 64), generator=g).to(device)


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda \
        else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(args.dim, args.layers).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    start = resume(args, model, opt)
    if start and rank == 0:
        print(f"resumed from step {start} with {world} ranks", flush=True)

    for step in range(start + 1, args.steps + 1):
        tokens = batch(step, rank, device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save(args, model, opt, step)


def resume(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer
           ) -> int:
    """Load the newest checkpoint into the sharded model and optimizer; its step, or 0."""
    if args.chain:
        found = bool(s4weights.list_checkpoints(args.checkpoints))
    else:
        start = latest_step(args.checkpoints)
        found = start is not None
    if not found:  # (get_state_dict would step a fresh optimizer to make its state)
        return 0
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    if args.chain:
        s4weights.load_checkpoint(args.checkpoints, into=state, distributed=True)
    else:
        dcp.load(state, storage_reader=S4StorageReader(f"{args.checkpoints}/step-{start:06d}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["step"]


def save(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
         step: int) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": step}
    if args.chain:
        info = s4weights.save_checkpoint(state, args.checkpoints, step, distributed=True,
                                         keep_last=args.keep_last)
        what = f"step {step} ({'base' if info.is_base else 'delta'}) in {args.checkpoints}"
    else:
        what = f"{args.checkpoints}/step-{step:06d}"
        dcp.save(state, storage_writer=S4StorageWriter(what))
    if dist.get_rank() == 0:
        print(f"saved {what}", flush=True)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank, started by ``--nproc`` (torchrun sets these variables itself)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    main(args)


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    """A rank in a process of its own (``--nproc``), left with ``os._exit`` once it is done, as
    the script leaves at its end: a spawned child otherwise shuts its interpreter down, where
    the gloo threads FSDP2 keeps alive can abort it (exit status -6 after every save)."""
    worker(rank, world, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", required=True, help="directory or s3://bucket/prefix")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--chain", action="store_true",
                   help="save with s4weights.save_checkpoint(distributed=True): delta chains")
    p.add_argument("--keep-last", type=int, default=None, help="with --chain: retention")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--nproc", type=int, default=0,
                   help="start this many ranks here (instead of running under torchrun)")
    p.add_argument("--timeout", type=int, default=600, help="collective timeout, seconds")
    return p.parse_args()


def spawn(args: argparse.Namespace) -> None:
    """Run ``args.nproc`` ranks: rank 0 in this process, the others in new ones."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    ctx = mp.get_context("spawn")
    others = [ctx.Process(target=_spawned, args=(r, args.nproc, args), daemon=True)
              for r in range(1, args.nproc)]
    for p in others:
        p.start()
    worker(0, args.nproc, args)
    for r, p in enumerate(others, 1):
        p.join()
        if p.exitcode:
            raise SystemExit(f"rank {r} exited with {p.exitcode}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.nproc:
        spawn(arguments)
    else:
        main(arguments)
    # FSDP2's sharding caches keep the gloo group alive past destroy_process_group, and on
    # Python < 3.14 its threads can abort the interpreter's shutdown; all is saved and flushed
    # here, so leave without it (the spawned ranks too, _spawned).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
