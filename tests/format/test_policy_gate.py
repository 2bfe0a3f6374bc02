"""The LZ gate of the auto policy: zstd and GDeflate are tried on a float's planes only where
their statistics show runs or counters, and then the choice is the one an exhaustive trial
makes; other planes and small planes are always tried."""

from __future__ import annotations

import numpy as np
import pytest

from s4format import codecs, layouts, policy
from s4format.codecs.view import PlaneView, chance_runs

E, M, B = layouts.KIND_EXPONENT, layouts.KIND_MANTISSA, layouts.KIND_BYTE
N = 1 << 18


def fp32_fields(x: np.ndarray) -> list[PlaneView]:
    return layouts.FP32.views(x.astype("<f4").view(np.uint8), 4)


def weights(n: int = N) -> np.ndarray:
    return np.random.default_rng(3).standard_normal(n) * 0.02


def test_independent_float_planes_skip_the_trial() -> None:
    for v, f in zip(fp32_fields(weights()), layouts.FP32.fields):
        assert not policy.lz_may_pay(v, f.kind), f.label


def test_runs_open_the_trial_and_zstd_wins_there() -> None:
    x = weights()
    x[N // 4:N // 2] = 0.25  # a quarter of the values: one run
    m1 = fp32_fields(x)[3]
    assert policy.lz_may_pay(m1, M)
    cid, enc = policy.encode_view(m1, M, "auto-1.0")
    assert cid == codecs.ZSTD and enc.nbytes < 0.8 * m1.size
    # under auto, segments hold the run as a CONST one within 1/128 of zstd, and go first
    m1 = fp32_fields(x)[3]
    cid, seg = policy.encode_view(m1, M)
    assert cid == codecs.RANS_SEG and seg.nbytes <= enc.nbytes + m1.size // 128


def test_counters_open_the_trial() -> None:
    counter = np.tile(np.arange(128, dtype=np.uint8), N // 128)
    v = PlaneView.of(counter)
    assert policy.lz_may_pay(v, M)
    assert policy.encode_view(v, M)[0] == codecs.ZSTD


def test_a_mantissa_plane_needs_more_runs_than_others() -> None:
    # a delta's kept mantissa bits (a unit or two in the last place: runs of trailing ones),
    # a word in a hundred repeating the one before it
    rng = np.random.default_rng(5)
    ones = np.array([1, 3, 7, 15, 31, 63, 127], np.uint8)
    p = np.array([0.5, 0.25, 0.12, 0.06, 0.04, 0.02, 0.01])
    m = rng.choice(ones, N, p=p / p.sum())
    for i in np.flatnonzero(rng.random(N) < 0.01)[1:]:
        m[i] = m[i - 1]
    counts, n, runs = PlaneView.of(m).share()
    excess = runs - chance_runs(counts, n)
    assert policy.LZ_RUNS < excess < policy.LZ_RUNS_MANTISSA
    assert policy.lz_may_pay(PlaneView.of(m), B)  # (a byte plane is tried: LZ_RUNS)
    assert not policy.lz_may_pay(PlaneView.of(m), M)
    cid, enc = policy.encode_view(PlaneView.of(m), M)
    assert cid == codecs.RANS and enc.nbytes < codecs.get(codecs.ZSTD).encode(m).nbytes


@pytest.mark.parametrize(("kind", "size"), [(B, N), (layouts.KIND_RAW, N), (M, 4096)])
def test_byte_planes_and_small_planes_are_always_tried(kind: int, size: int) -> None:
    v = PlaneView.of(np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8))
    assert policy.lz_may_pay(v, kind)


def test_the_gate_changes_no_choice_where_it_opens(monkeypatch) -> None:
    x = weights()
    x[N // 3:N // 2] = np.round(x[N // 3:N // 2], 1)  # a stretch of coarse values
    views = fp32_fields(x)
    gated = [policy.encode_view(v, f.kind) for v, f in zip(views, layouts.FP32.fields)]
    monkeypatch.setattr(policy, "lz_may_pay", lambda view, kind: True)
    tried = [policy.encode_view(v, f.kind) for v, f in zip(fp32_fields(x), layouts.FP32.fields)]
    assert [(c, bytes(e.payload)) for c, e in gated] == [(c, bytes(e.payload)) for c, e in tried]
    assert {codecs.ZSTD, codecs.SEG_LZ} & {c for c, _ in gated}  # (zstd, or zstd segments)
