"""ranshost.WORD_COST bounds the words the rANS encoder writes (the GPU encoder sizes its scratch
by it, per plane and per block): checked against the CPU reference encoder, which the GPU's is
byte-identical to, on distributions built to come near it. Runs without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from s4format.codecs import rans
from s4weights.gpu import ranshost

LOG2_BLOCK = 12  # small blocks: many per case, each near its own bound


def _words_and_bound(counts: np.ndarray, plane: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                     int, int]:
    """(words per block, bound per block, words of the plane, the plane's bound), the
    frequencies normalised from ``counts``."""
    f = rans.normalise(counts)
    nb = -(-plane.size >> LOG2_BLOCK)
    scratch = np.empty(plane.size + 1, np.uint16)
    got = np.empty(nb, np.int64)
    states = np.empty(rans.LANES * nb, np.int64)
    rans._encode_blocks(plane, LOG2_BLOCK, rans._encoder_table(f), scratch, got, states)
    cost = ranshost.WORD_COST[f][plane].astype(np.int64)
    per_block = np.add.reduceat(cost, np.arange(0, plane.size, 1 << LOG2_BLOCK))
    plane_sum = int((counts * ranshost.WORD_COST[f].astype(np.int64)).sum())
    return got, ranshost.word_bound(per_block), int(got.sum()), int(ranshost.word_bound(
        plane_sum))


@pytest.mark.parametrize("case", ["rare", "uniform", "two", "skewed", "mixed", "exponents"])
def test_the_encoders_words_never_pass_the_bound(case: str) -> None:
    rng = np.random.default_rng(len(case))
    n = 40 << LOG2_BLOCK
    if case == "rare":  # one block of the rarest symbols (frequency 1-2: ~12 bits each)
        plane = np.zeros(n, np.uint8)
        plane[7 << LOG2_BLOCK:8 << LOG2_BLOCK] = np.arange(1 << LOG2_BLOCK) % 255 + 1
    elif case == "uniform":
        plane = rng.integers(0, 256, n, dtype=np.uint8)
    elif case == "two":
        plane = (rng.random(n) < 0.001).astype(np.uint8)
    elif case == "skewed":
        plane = np.minimum(rng.geometric(0.3, n), 255).astype(np.uint8)
    elif case == "mixed":  # blocks of rare symbols among common ones
        plane = np.minimum(rng.geometric(0.5, n), 200).astype(np.uint8)
        plane[3 << LOG2_BLOCK:4 << LOG2_BLOCK] = rng.integers(201, 256, 1 << LOG2_BLOCK)
    else:  # fp32 exponent bytes of N(0, 0.02)
        x = (rng.standard_normal(n) * 0.02).astype(np.float32)
        plane = ((x.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    counts = np.bincount(plane, minlength=256)
    got, bound, total, plane_bound = _words_and_bound(counts, plane)
    assert (got <= bound).all(), np.flatnonzero(got > bound)
    assert bound.sum() <= plane_bound  # the blocks' shares fit the plane's scratch
    assert total <= plane_bound
    # and the bound is tight: within a few percent of what the encoder wrote, beyond the
    # log2(9/8) bits per symbol it allows for the states' growth and up to a word per lane
    # for their final sizes
    assert plane_bound <= 1.03 * total + 0.17 * plane.size / 16 + 33 * got.size


def test_word_cost_is_the_rounded_up_cost() -> None:
    # against log2(4096 / f * 9 / 8) at 40 digits (not the doubles WORD_COST comes from)
    from decimal import Decimal, getcontext

    getcontext().prec = 40
    ln2 = Decimal(2).ln()
    for f in range(1, rans.PROB_SCALE + 1):
        exact = (Decimal(4608) / f).ln() / ln2 * 65536
        w = int(ranshost.WORD_COST[f])
        assert w >= exact, f
        assert w <= exact + 2, f
    assert ranshost.WORD_COST[0] == 0
