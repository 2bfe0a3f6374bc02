"""Vectorised host tables of the GPU coder equal the CPU reference's per-plane functions (no
CUDA needed): normalisation, encoder and decoder tables, size estimates."""

from __future__ import annotations

import numpy as np

from s4format.codecs import rans
from s4weights.gpu import ranshost


def _histograms() -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = []
    for k in range(200):
        c = np.zeros(256, np.int64)
        idx = rng.choice(256, int(rng.integers(2, 257)), replace=False)
        c[idx] = rng.integers(1, [2, 10, 1000, 10**9][k % 4], idx.size)
        if k % 7 == 0:
            c[idx] = 5  # ties in the remainders
        rows.append(c)
    rows += [np.array([100, 3] + [0] * 254), np.array([1, 1] + [0] * 254),
             np.array([0] * 255 + [1 << 40]) + np.eye(256, dtype=np.int64)[3]]
    return np.stack(rows)


def test_vectorised_tables_equal_the_reference() -> None:
    counts = _histograms()
    freqs = ranshost.normalise_many(counts)
    enc = ranshost.encoder_tables(freqs)
    dec = ranshost.decoder_tables(freqs)
    est = ranshost.estimate_many(counts, freqs, 16)
    for c, f, e, d, s in zip(counts, freqs, enc, dec, est):
        assert (rans.normalise(c) == f).all()
        assert (ranshost.encoder_table(f) == e).all()
        assert (ranshost.decoder_table(f) == d).all()
        assert ranshost.estimate(c, 16) == s
