"""Vectorised host tables of the GPU coder equal the CPU reference's per-plane functions (no
CUDA needed): normalisation, encoder and decoder tables, size estimates."""

from __future__ import annotations

import numpy as np

from s4format.codecs import rans
from s4weights.gpu import ranshost
from tests.gpu.common import histograms


def _histograms() -> np.ndarray:
    rows = [np.array([100, 3] + [0] * 254), np.array([1, 1] + [0] * 254),
            np.array([0] * 255 + [1 << 40]) + np.eye(256, dtype=np.int64)[3]]
    # (rows of two or more symbols: the per-plane reference takes no other)
    many = histograms(200, 7, (2, 10, 1000, 10**9))
    return np.concatenate((many[np.count_nonzero(many, axis=1) > 1], np.stack(rows)))


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
