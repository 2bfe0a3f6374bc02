"""Sparse planes under ``auto`` (spec/codecs.md, "Choosing codecs"): a delta's sign and
exponent planes, mostly one byte, are tried with zstd, which wins where it stores no more than
rANS plus 1/64 of the plane; ``auto-1.0`` keeps format 1.0's choices. And the writer keeps a
tensor's delta by the estimates of both, coding only the one it keeps."""

from __future__ import annotations

import io

import numpy as np
import pytest

from s4format import Reader, Tensor, Writer, codecs, layouts, policy
from s4format.codecs.view import PlaneView
from s4format.dtypes import by_name
from s4format.writer import code_tensor, estimate_tensor

RANS, ZSTD = codecs.RANS, codecs.ZSTD
N = 1 << 18


def sparse_plane(share: float, values: int = 2, seed: int = 0, clustered: bool = True
                 ) -> np.ndarray:
    """``share`` of the bytes nonzero (1..values-1), in short runs where ``clustered``."""
    rng = np.random.default_rng(seed)
    plane = np.zeros(N, np.uint8)
    at = rng.choice(N // 8 if clustered else N, int(share * N / (8 if clustered else 1)),
                    replace=False)
    rows = (at[:, None] * 8 + np.arange(8)).reshape(-1) if clustered else at
    plane[rows] = rng.integers(1, values, rows.size)
    return plane


def test_a_sparse_sign_plane_is_tried_with_zstd_under_auto_only() -> None:
    plane = sparse_plane(0.002)
    view = PlaneView.of(plane)
    assert policy.sparse(view)
    cid, enc = policy.encode_view(view, layouts.KIND_SIGN, "auto")
    assert cid == ZSTD
    assert enc.nbytes < codecs.get(RANS).estimate(plane)
    assert policy.encode_view(PlaneView.of(plane), layouts.KIND_SIGN, "auto-1.0")[0] != ZSTD
    assert ZSTD not in policy._AUTO_1_0[layouts.KIND_SIGN]


def test_a_dense_sign_plane_skips_the_zstd_trial(monkeypatch) -> None:
    plane = np.random.default_rng(1).integers(0, 2, N, dtype=np.uint8)
    tried = []
    real = codecs.get(ZSTD).estimate_view
    monkeypatch.setattr(type(codecs.get(ZSTD)), "estimate_view",
                        lambda self, v: tried.append(v) or real(v))
    assert policy.encode_view(PlaneView.of(plane), layouts.KIND_SIGN, "auto")[0] == \
        codecs.BITPACK
    assert tried == []


@pytest.mark.parametrize(("ranked", "n", "want"), [
    # zstd within n/64 of rANS moves just before it
    ([(100, RANS), (100 + 16, ZSTD)], 1024, [(116, ZSTD), (100, RANS)]),
    # one byte more than the slack: the order stays
    ([(100, RANS), (100 + 17, ZSTD)], 1024, [(100, RANS), (117, ZSTD)]),
    # others ahead of rANS keep their place
    ([(90, codecs.BITPACK_W), (100, RANS), (103, ZSTD)], 1024,
     [(90, codecs.BITPACK_W), (103, ZSTD), (100, RANS)]),
    ([(100, ZSTD), (101, RANS)], 1024, [(100, ZSTD), (101, RANS)]),
    ([(100, RANS)], 1024, [(100, RANS)]),
])
def test_prefer_fast(ranked, n, want) -> None:
    assert policy.prefer_fast(ranked, n) == want


def test_zstd_is_preferred_on_a_sparse_exponent_plane_within_the_slack() -> None:
    # scattered changes: zstd stores a little more than rANS, within 1/64 of the plane
    plane = sparse_plane(0.006, values=4, seed=2, clustered=False)
    view = PlaneView.of(plane)
    z, r = codecs.get(ZSTD).estimate(plane), codecs.get(RANS).estimate(plane)
    assert r < z <= r + N * policy.SPARSE_SLACK
    assert policy.encode_view(view, layouts.KIND_EXPONENT, "auto")[0] == ZSTD
    assert policy.encode_view(PlaneView.of(plane), layouts.KIND_EXPONENT, "auto-1.0")[0] == RANS


def test_zstd_is_not_tried_on_a_sparse_exponent_plane_rans_codes_well_above_the_slack(
        monkeypatch) -> None:
    # scattered changes of up to 3 bits: rANS's estimate passes 2/64 of the plane, so zstd
    # could be preferred only by storing under 1.5 x it; it stores more, and is not tried
    plane = sparse_plane(0.05, values=9, seed=6, clustered=False)
    view = PlaneView.of(plane)
    assert policy.sparse(view) and not policy.lz_may_pay(view, layouts.KIND_EXPONENT)
    z, r = codecs.get(ZSTD).estimate(plane), codecs.get(RANS).estimate(plane)
    assert r > N * policy.SPARSE_HOPELESS and z > r + N * policy.SPARSE_SLACK, (z, r)
    tried = []
    real = codecs.get(ZSTD).estimate_view
    monkeypatch.setattr(type(codecs.get(ZSTD)), "estimate_view",
                        lambda self, v: tried.append(v) or real(v))
    assert policy.encode_view(PlaneView.of(plane), layouts.KIND_EXPONENT, "auto")[0] == RANS
    assert tried == []
    # a sign plane as sparse keeps its trial (zstd codes the runs of sign planes best)
    signs = (plane != 0).astype(np.uint8)
    policy.encode_view(PlaneView.of(signs), layouts.KIND_SIGN, "auto")
    assert len(tried) == 1


def test_the_zstd_trial_is_the_encoding() -> None:
    plane = sparse_plane(0.01, values=9, seed=3)[: 300_000 // 2]
    view = PlaneView.of(plane)
    size = codecs.get(ZSTD).estimate_view(view)
    kept = view.memo[ZSTD]
    enc = codecs.get(ZSTD).encode_view(view)
    assert enc is kept and enc.nbytes == size
    assert bytes(enc.payload) == bytes(codecs.get(ZSTD).encode(plane).payload)


def _fine_tuned(seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, 1 << 16).astype("<f4")
    bf = (w.view("<u4") >> 16).astype("<u2")
    child = bf.copy()
    at = rng.choice(bf.size, bf.size // 50, replace=False)
    child[at] ^= rng.integers(1, 4, at.size).astype("<u2")  # the low mantissa bits move
    child[at[::4]] ^= 0x80  # and some exponents, by one
    return bf.view(np.uint8), child.view(np.uint8)


def _parent_file(parent: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.add("w", Tensor(by_name("bfloat16"), (parent.size // 2,), parent))
        w.close()
    return buf.getvalue()


def test_a_delta_is_kept_by_the_estimates_and_they_match_the_coding() -> None:
    parent, child = _fine_tuned()
    bf16 = by_name("bfloat16")
    for raw in (child, child ^ parent):
        est, views = estimate_tensor(raw, bf16)
        coded = code_tensor(raw, bf16, "auto", views).stored
        # (the estimate counts a block's final states in full, which carry some 32 bytes of
        # what its words would: a little over, per block)
        assert abs(est - coded) <= 0.002 * coded + 96, (est, coded)
    buf = io.BytesIO()
    with Reader(_parent_file(parent)) as p:
        parent_id = p.checkpoint_id
    with Writer(buf, parent_id=parent_id) as w:
        w.add("w", Tensor(bf16, (child.size // 2,), child),
              parent=Tensor(bf16, (parent.size // 2,), parent))
        result = w.close()
    assert result.delta_count == 1
    assert result.stored_nbytes < 0.5 * result.full_stored_nbytes
    with Reader(buf.getvalue(), parent=_parent_file(parent)) as r:
        assert r.tensors[0].is_delta
        assert np.array_equal(r.read_raw(0), child)


@pytest.mark.parametrize("dtype", ["<u2", "<u1"])  # split as bf16, or raw bytes
def test_an_unrelated_tensor_is_coded_alone_once(monkeypatch, dtype) -> None:
    parent, child = _fine_tuned()
    other = np.random.default_rng(5).integers(0, 256, child.size, dtype=np.uint8)
    if dtype == "<u2":  # bf16 weights against a parent of random bits: the delta is noise
        other, parent = child, other
    calls = []
    import s4format.writer as writer

    real = writer.code_tensor
    monkeypatch.setattr(writer, "code_tensor",
                        lambda raw, *a: calls.append(raw) or real(raw, *a))
    dt = by_name("bfloat16" if dtype == "<u2" else "uint8")
    with Writer(io.BytesIO(), parent_id=b"\x01" * 16) as w:
        w.add("w", Tensor(dt, (other.size // dt.itemsize,), other),
              parent=Tensor(dt, (other.size // dt.itemsize,), parent))
        result = w.close()
    assert result.delta_count == 0 and len(calls) == 1 and np.array_equal(calls[0], other)
    assert result.full_stored_nbytes == result.stored_nbytes


def test_a_tensor_unlike_its_samples_is_judged_by_all_of_it() -> None:
    # zero where the planes are sampled, weights elsewhere: the delta against a parent that
    # differs in a few elements must still win (it codes far smaller than the tensor alone)
    from s4format.codecs.view import SAMPLE_CHUNK, SAMPLE_CHUNKS

    n = 1 << 20
    rng = np.random.default_rng(7)
    w = (rng.normal(0, 0.02, n).astype("<f4").view("<u4") >> 16).astype("<u2")
    for start in np.linspace(0, n - SAMPLE_CHUNK, SAMPLE_CHUNKS).astype(np.int64):
        w[start:start + SAMPLE_CHUNK] = 0
    parent = w.copy()
    at = rng.choice(n, n // 20, replace=False)
    parent[at] ^= rng.integers(1, 4, at.size).astype("<u2")
    bf16 = by_name("bfloat16")
    with Writer(io.BytesIO(), parent_id=b"\x01" * 16) as wr:
        wr.add("w", Tensor(bf16, (n,), w.view(np.uint8)),
               parent=Tensor(bf16, (n,), parent.view(np.uint8)))
        result = wr.close()
    alone = code_tensor(w.view(np.uint8), bf16).stored
    assert result.delta_count == 1
    assert result.stored_nbytes < 0.2 * alone
