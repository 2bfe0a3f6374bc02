"""What the crash tests run in processes they kill: checkpoint states that depend only on their
step (so the test can recompute what each listed step must hold), saved until SIGKILL."""

from __future__ import annotations

import functools
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import s4weights

N = 5 << 20  # float32 elements: a 20 MiB tensor, so a save takes a noticeable time
INTERVAL = 3
WARM_ON_IMPORT = "S4W_TEST_CRASH_WORKER_WARM"


@functools.cache
def _base() -> np.ndarray:
    w = np.random.default_rng(0).standard_normal(N, dtype=np.float32)
    w.flags.writeable = False
    return w


def state(step: int, n: int = N) -> dict[str, Any]:
    """A base tensor with a window of it nudged by ``step``: every step differs a little."""
    w = _base()[:n].copy()
    at = (step * 7919) % (n - 4096)
    w[at:at + 4096] += np.float32(step + 1)
    return {"w": torch.from_numpy(w), "bias": torch.full((256,), float(step)),
            "step": step, "name": f"step-{step}"}


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the codecs, a delta's too, and build the
    base, so a save timed by the parent is a save, not a JIT compile (with numba's cache
    empty, a kill would land in the compile of a delta's kernels, before any file)."""
    s4weights.save(state(0, 1 << 16), io.BytesIO())
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(2):
            s4weights.save_checkpoint(state(step, 1 << 16), tmp, step)


def save_checkpoints(root: str, first: int, count: int, ready: Any) -> None:
    warm_up()
    ready.set()
    for step in range(first, first + count):
        s4weights.save_checkpoint(state(step), root, step, keyframe_interval=INTERVAL)


def save_file(path: str, value: int, count: int, ready: Any) -> None:
    warm_up()
    obj = state(value)
    ready.set()
    for _ in range(count):
        s4weights.save(obj, Path(path))


if os.environ.get(WARM_ON_IMPORT) == "1":
    warm_up()  # in the crash tests' forkserver: every forked worker starts warm
