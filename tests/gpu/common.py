"""Test data shared by the GPU path's tests."""

from __future__ import annotations

import numpy as np


def histograms(rows: int, seed: int, scales: tuple[int, ...]) -> np.ndarray:
    """[rows, 256] symbol counts: random symbol sets of 1 to 256 symbols, counts below
    ``scales[k % len(scales)]``, every seventh row with all counts equal (every remainder of
    the normalisation ties)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, 256), np.int64)
    for k in range(rows):
        idx = rng.choice(256, int(rng.integers(1, 257)), replace=False)
        out[k, idx] = rng.integers(1, scales[k % len(scales)], idx.size)
        if k % 7 == 0:
            out[k, idx] = int(rng.integers(1, 50))
    return out
