"""What the racing-writer tests run in separate processes: two writers on one store, one saving
deltas and one saving bases with ``keep_last=1``, each checking at once that every step it was
told is saved loads (or was deleted since by the other's retention, as it may be)."""

from __future__ import annotations

import functools
import io
import random
import time
from typing import Any

import numpy as np
import torch

import s4weights
from s4format.errors import S4Error, StorageError

N = 1 << 20  # float32 elements: a 4 MiB tensor, so a save takes long enough to be raced


@functools.cache
def _base() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(N, dtype=np.float32)


def state(step: int) -> dict[str, Any]:
    """Mostly the same weights at every step (deltas pay), with a window moved by ``step``."""
    w = _base().copy()
    at = (step * 7919) % (N - 1024)
    w[at:at + 1024] += np.float32(step % 1000 + 1)
    return {"w": torch.from_numpy(w), "step": step}


def _check(root: str, step: int) -> str:
    """"ok" when ``step`` loads as saved, "gone" when the other writer's retention has deleted
    it since, else what went wrong."""
    try:
        got = s4weights.load_checkpoint(root, step=step)
    except StorageError as exc:
        if f"no checkpoint step {step} " in str(exc) or "was deleted from" in str(exc):
            return "gone"
        return f"step {step}: {type(exc).__name__}: {exc}"
    except S4Error as exc:
        return f"step {step}: {type(exc).__name__}: {exc}"
    if got["step"] != step or not torch.equal(got["w"], state(step)["w"]):
        return f"step {step}: loaded other values"
    return "ok"


def run(root: str, parity: int, count: int, seed: int, start: float, out: Any,
        ready: Any) -> None:
    """Save ``count`` checkpoints, their steps from the time since ``start`` (so both writers'
    steps interleave): parity 1 as deltas, parity 0 as bases that keep one checkpoint. Both
    begin once both are ready (``ready``, a barrier of two)."""
    rng = random.Random(seed)
    s4weights.save(state(0), io.BytesIO())  # compile the codecs before the race
    # (one process may take seconds longer to start and compile: without the barrier the other
    # once made all its saves before the first began, and no delta had the other's base)
    ready.wait(timeout=300)
    results = []
    for _ in range(count):
        time.sleep(rng.uniform(0, 0.03))
        step = int((time.monotonic() - start) * 1000) * 2 + parity
        if parity:
            info = s4weights.save_checkpoint(state(step), root, step, keyframe_interval=1000,
                                             min_delta_gain=0.0)
        else:
            info = s4weights.save_checkpoint(state(step), root, step, delta=False, keep_last=1)
        results.append((step, info.parent_step, _check(root, step)))
    out.put(results)
