"""Shared helpers for the s4weights tests: bit-exact comparison of loaded trees, a small
training setup whose full state (model, AdamW, scheduler, scaler, RNGs) can be checkpointed."""

from __future__ import annotations

import functools
import io
import random
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

import s4weights

# save_checkpoint making each delta against the latest checkpoint: a chain one file longer per
# save, for the tests of what reads and recovers multi-file chains.
save_on_latest = functools.partial(s4weights.save_checkpoint, delta_against="latest")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The elements' raw bytes in C order, whatever the strides, device or dtype."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def roundtrip(obj: Any, **load_kwargs: Any) -> Any:
    buf = io.BytesIO()
    s4weights.save(obj, buf)
    return s4weights.load(io.BytesIO(buf.getvalue()), **load_kwargs)


def assert_same(got: Any, want: Any, path: str = "<root>") -> None:
    """``got`` is ``want`` loaded back: same types (Parameter vs Tensor, OrderedDict vs dict,
    tuple vs list, numpy scalar types), same attributes of OrderedDicts, every tensor with the
    same dtype, shape, strides, requires_grad and bytes, every float with the same bits."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.stride() == want.stride(), f"{path}: stride {got.stride()} != {want.stride()}"
        assert got.requires_grad == want.requires_grad, f"{path}: requires_grad"
        assert tensor_bytes(got) == tensor_bytes(want), f"{path}: bytes differ"
    elif isinstance(want, np.ndarray | np.generic):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
        if isinstance(want, OrderedDict):
            assert_same(dict(vars(got)), dict(vars(want)), f"{path}.__dict__")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


class TinyNet(torch.nn.Module):
    """Linear + BatchNorm + dropout: parameters, buffers (an int64 counter), versioned
    ``_metadata``, and a forward pass that consumes the torch RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class Trainer:
    """A model, AdamW, an LR schedule and a GradScaler, trained on batches drawn from the torch,
    numpy and Python ``random`` generators, so a resume is exact only if all state comes back."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = TinyNet()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=2e-2, total_steps=100)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        self.step_no = 0

    def step(self) -> None:
        x = torch.randn(16, 8) + float(np.random.standard_normal()) + random.random()
        loss = self.model(x).pow(2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step_no += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                "step": self.step_no,
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step_no = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])

    def fingerprint(self) -> dict[str, bytes]:
        """Raw bytes of every parameter, buffer and optimizer state tensor."""
        out = {f"model.{k}": tensor_bytes(v) for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"opt.{pid}.{k}"] = tensor_bytes(v) if isinstance(v, torch.Tensor) \
                    else struct.pack("<d", float(v))
        return out


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def clone_tree(obj: Any) -> Any:
    """A deep copy whose tensors no longer alias the live training state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)((k, clone_tree(v)) for k, v in obj.items())
        for k, v in getattr(obj, "__dict__", {}).items():
            setattr(out, k, clone_tree(v))
        return out
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(x) for x in obj)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return obj
