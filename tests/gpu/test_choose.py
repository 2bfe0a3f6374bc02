"""The GPU encoder's codec choice, on the host (runs without a GPU): ``candidates`` and
``choose`` decide every plane of a group with numpy over all planes at once. Fed the
block word counts that the CPU reference encoder produces for the same planes (what the rANS
kernel produces: the kernel is byte-identical to it, tests/gpu/test_gpu_codec.py), they must
pick what ``policy.encode_plane`` picks among the codecs the GPU codes (bitpack, rANS,
bitpack-w), with the same stored size, and write the same stream heads (header and table, or
whole CONST streams)."""

from __future__ import annotations

import numpy as np
import pytest

from s4format import codecs, layouts, policy
from s4format.codecs import rans
from s4weights.gpu import plan, ranshost
from s4weights.gpu.choose import candidates, choose
from s4weights.gpu.planes import (
    FORM_BITPACK,
    FORM_BITPACK_W,
    FORM_CONST,
    FORM_RANS,
    FORM_RAW,
    Planes,
    params_of,
)

LG = rans.LOG2_BLOCK_DEFAULT
RNG = np.random.default_rng(11)
N = 3 * (1 << LG) + 1234


def _planes() -> list[tuple[int, np.ndarray]]:
    """(kind, plane bytes): every form the choice can take."""
    S, E, M = layouts.KIND_SIGN, layouts.KIND_EXPONENT, layouts.KIND_MANTISSA
    w = (RNG.standard_normal(N) * 0.02).astype(np.float32).view(np.uint32)
    expo = ((w >> 23) & 0xFF).astype(np.uint8)
    blocks = np.repeat(RNG.integers(0, 256, 4, dtype=np.uint8), 1 << LG)[:N]
    out = [
        (S, (w >> 31).astype(np.uint8)),                      # 50/50: bitpack
        (S, (RNG.random(N) < 0.002).astype(np.uint8)),        # skewed: rANS beats bitpack
        (S, np.zeros(N, np.uint8)),                            # one symbol: CONST stream
        (S, np.ones(N, np.uint8)),
        (S, (RNG.random(63) < 0.5).astype(np.uint8)),         # under MIN_CODED: raw
        (S, (RNG.random(64) < 0.5).astype(np.uint8)),
        (S, np.zeros(64, np.uint8)),     # one symbol, but bitpack's 8 bytes rank first
        (S, np.ones(200, np.uint8)),     # one symbol, CONST (13 bytes) ranks first
        (E, expo),                                             # rANS
        (E, np.full(N, 127, np.uint8)),                        # CONST, whole plane
        (E, blocks),                                           # CONST, per block
        (E, RNG.integers(0, 256, N, dtype=np.uint8)),          # uniform: raw
        (E, np.where(RNG.random(N) < 0.5, 120, 121).astype(np.uint8)),
        (E, expo[:100]),                                       # small, one block
        (E, expo[:64]),
        (M, ((w >> 16) & 0x7F).astype(np.uint8)),             # 7 bits: bitpack-w (rANS
        # saves ~0.2%: under the 1/65 preference)
        (M, RNG.integers(0, 4, N, dtype=np.uint8)),           # 2 uniform bits: bitpack-w
        (M, (RNG.geometric(0.3, N) % 128).astype(np.uint8)),  # skewed 7 bits: rANS
        (E, RNG.integers(0, 32, N, dtype=np.uint8)),          # 5 uniform bits: bitpack-w
        (E, RNG.integers(0, 32, 100, dtype=np.uint8)),        # small: bitpack-w
        (M, (w & 0xFF).astype(np.uint8)),                      # 8 uniform bits: raw
        (M, (RNG.geometric(0.3, N) % 256).astype(np.uint8)),  # skewed
        (M, np.zeros(N, np.uint8)),
    ]
    return out


def _reference(kind: int, plane: np.ndarray, pol: str, mantissa: str, monkeypatch
               ) -> tuple[int, bytes]:
    """``policy.encode_plane`` with only the codecs the GPU path codes (``mantissa="rans"``
    asks for rANS on mantissa planes: no bitpack-w there)."""
    every = codecs.available()
    gpu = {c: every[c] for c in (codecs.BITPACK, codecs.RANS, codecs.BITPACK_W)}
    if kind == layouts.KIND_MANTISSA and mantissa != "auto":
        del gpu[codecs.BITPACK_W]
    with monkeypatch.context() as m:
        m.setattr(policy.codecs, "available", lambda: gpu)
        cid, enc = policy.encode_plane(plane, kind, pol)
    return cid, bytes(enc.payload) if cid != codecs.RAW else plane.tobytes()


def _kernel_result(pl: Planes, planes: list[np.ndarray]) -> dict | None:
    """What ``ransencode.rans_encode`` returns after the kernel, from the CPU reference encoder."""
    jobs = np.flatnonzero(pl.runs_rans)
    if not jobs.size:
        return None
    words, varied, firsts = [], [], []
    for j in jobs.tolist():
        p = planes[j]
        stream = rans._rans_stream(p, LG, pl.freqs[j])
        nb = ranshost.n_blocks(p.size, LG)
        at = ranshost.HEADER_SIZE + len(rans.table_bytes(pl.freqs[j]))
        words.append(int(stream[at:at + 4 * nb].view("<u4").astype(np.int64).sum()))
        firsts.append(p[::1 << LG])
        varied.append(bool((p != np.repeat(p[::1 << LG], 1 << LG)[:p.size]).any()))
    return dict(bt=plan.blocks(pl.n[jobs], LG), plane_words=np.array(words),
                plane_varied=np.array(varied), firsts=np.concatenate(firsts))


@pytest.mark.parametrize("pol,mantissa", [("auto", "auto"), ("auto", "rans"),
                                          ("auto", "raw"), ("seed", "auto"),
                                          ("auto-1.0", "auto")])
def test_choice_equals_the_cpu_policy(pol: str, mantissa: str, monkeypatch) -> None:
    cases = _planes()
    planes = [p for _k, p in cases]
    counts = np.stack([np.bincount(p, minlength=256) for p in planes])
    pl = Planes(np.arange(len(cases)), [k for k, _ in cases], np.zeros(len(cases)),
                       [p.size for p in planes], np.zeros(len(cases)), counts)
    candidates(pl, pol, mantissa, False, LG)
    choose(pl, _kernel_result(pl, planes), None, LG)
    forms = set()
    for q, (kind, p) in enumerate(cases):
        if kind == layouts.KIND_MANTISSA and mantissa == "raw":
            want = (codecs.RAW, p.tobytes())
        else:
            want = _reference(kind, p, pol, mantissa, monkeypatch)
        assert (int(pl.codec[q]), int(pl.size[q])) == (want[0], len(want[1])), q
        head = pl.heads[pl.head_at[q]:pl.head_at[q] + pl.head[q]].tobytes()
        assert want[1].startswith(head), q
        if pl.form[q] == FORM_BITPACK_W:
            assert params_of(pl, q) == bytes([max(1, int(p.max()).bit_length())]), q
        if pl.form[q] == FORM_CONST:
            assert head == want[1], q  # a CONST stream is all host bytes
        forms.add(int(pl.form[q]))
    if (pol, mantissa) == ("auto", "auto"):
        assert forms == {FORM_RAW, FORM_BITPACK, FORM_CONST,
                         FORM_RANS, FORM_BITPACK_W}
    if pol != "auto":
        assert FORM_BITPACK_W not in forms


def test_device_frequencies_give_the_same_choice() -> None:
    """Planes whose frequencies were normalised elsewhere (the device) decide alike."""
    cases = _planes()
    counts = np.stack([np.bincount(p, minlength=256) for _k, p in cases])
    args = (np.arange(len(cases)), [k for k, _ in cases], np.zeros(len(cases)),
            [p.size for _k, p in cases], np.zeros(len(cases)), counts)
    a, b = Planes(*args), Planes(*args)
    nz = counts.any(axis=1)
    b.freqs = np.zeros_like(counts)
    b.freqs[nz] = ranshost.normalise_many(counts[nz])
    for pl in (a, b):
        candidates(pl, "auto", "auto", False, LG)
    for name in ("est_rans", "cand_rans", "cand_bp", "runs_rans", "width", "cand_bw"):
        assert (getattr(a, name) == getattr(b, name)).all(), name
    rows = a.runs_rans
    assert (a.freqs[rows] == b.freqs[rows]).all()


def test_stream_heads_and_table_bytes_equal_the_reference() -> None:
    freqs = ranshost.normalise_many(np.stack([np.bincount(p, minlength=256)
                                              for _k, p in _planes()[6:10]]))
    body, blen = ranshost.table_bodies(freqs)
    assert (ranshost.table_sizes(freqs) == blen).all()
    n = np.array([5, 1 << 40, 0, 77])
    heads, start, length = ranshost.stream_heads(rans.MODE_RANS, 12, n, body, blen)
    for r, f in enumerate(freqs):
        want = ranshost.rans_prefix(f, 12, int(n[r]))
        assert heads[start[r]:start[r] + length[r]].tobytes() == want
