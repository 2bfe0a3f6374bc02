"""States the DCP tests save and load, built the same way in every process: a small GPT-style
model trained one step under FSDP2 with AdamW, DTensor state dicts of several dtypes sharded
unevenly, and the bit-exact comparison of what was loaded with what was saved."""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from tests.dcp.compat import NO_DIST

__all__ = ["NO_DIST", "DTensor", "Replicate", "Shard"]

VOCAB, DIM = 96, 48


class TinyGPT(torch.nn.Module):
    """Embedding, two MLP blocks with layer norms and a head: a GPT's kinds of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 3 * DIM),
                                torch.nn.GELU(), torch.nn.Linear(3 * DIM, DIM))
            for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def init_group(rank: int, world: int, pg_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # TinyGPT's blocks return views (a Linear on 3-d input); nothing here works on them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def sharded_model(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyGPT initialised from ``seed``, every block and the whole fully_shard-ed over all
    ranks, with an AdamW whose state exists (as after a step)."""
    torch.manual_seed(seed)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=g)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1),
                                             tokens.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a training script hands ``dcp.save``: sharded model and optimizer state dicts."""
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 1}


def apply_state(model: torch.nn.Module, opt: torch.optim.Optimizer,
                state: dict[str, Any]) -> None:
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded model and optimizer state, on every rank."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


# -- DTensor state dicts ------------------------------------------------------------------


def plain_state(seed: int) -> dict[str, torch.Tensor]:
    """Full tensors of several dtypes whose dimensions do not divide evenly by 4 ranks."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(18, 26, generator=g),
            "e": (torch.randn(10, 30, generator=g) * 0.02).to(torch.bfloat16),
            "i": torch.randint(-1000, 1000, (7, 6), generator=g),
            "h": torch.randn(5, 9, generator=g).to(torch.float16)}


def distributed(state: dict[str, torch.Tensor], placements: list) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: distribute_tensor(v, mesh, placements) for k, v in state.items()}


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


# -- comparison -----------------------------------------------------------------------------


def leaves(obj: Any, path: str = "") -> dict[str, Any]:
    """Key path -> value of every leaf of nested dicts and lists; DTensors as full tensors."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(leaves(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(leaves(v, f"{path}[{i}]"))
        return out
    if isinstance(obj, DTensor):
        obj = obj.full_tensor()
    return {path: obj}


def tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same(got: Any, want: Any) -> None:
    """Same leaves; every tensor of the same dtype, shape and bytes."""
    g, w = leaves(got), leaves(want)
    assert sorted(g) == sorted(w), f"keys differ: {sorted(set(g) ^ set(w))}"
    for k, v in w.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(g[k], torch.Tensor), k
            assert (g[k].dtype, g[k].shape) == (v.dtype, v.shape), \
                f"{k}: {g[k].dtype}{tuple(g[k].shape)} != {v.dtype}{tuple(v.shape)}"
            assert tensor_bytes(g[k]) == tensor_bytes(v), f"{k}: bytes differ"
        else:
            assert g[k] == v, f"{k}: {g[k]!r} != {v!r}"
