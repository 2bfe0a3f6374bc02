"""A group split before its codecs are known queues its rANS launch before the host has read
the planes' figures, the planes picked on the device by ``rans_jobs`` (kernels/rans.cu), the
host's rule (``candidates``' ``runs_rans``) written again in CUDA. Here, with the kernels
emulated (tests/gpu/emulated.py, which follows the kernel's code): the device picks what the host
picks on every kind of plane and policy, the files are byte for byte those of the encoder
that launches after reading the figures, and a launch that picked other planes is not used
(the host's rule codes again). test_gpu_codec.py checks the real kernel's picks on the H200."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import s4format
from s4weights.gpu import encode, encode_group, ransencode, runtime
from tests.gpu import emulated as em

RNG = np.random.default_rng(77)


@pytest.fixture
def emulated(monkeypatch):
    em.emulate(monkeypatch)


def _bits(dt: torch.dtype, words: np.ndarray) -> torch.Tensor:
    it = {torch.float32: np.int32}.get(dt, np.int16)
    return torch.from_numpy(words.astype(it.__name__.replace("int", "uint")).view(it)).view(dt)


def tensors() -> dict[str, torch.Tensor]:
    """Planes that land on every branch of the rule: rANS, bitpack-first signs, bitpack-w
    first (flat mantissas), CONST planes (one symbol), 0/1 planes, incompressible bytes,
    skewed signs, planes under policy.MIN_CODED bytes."""
    n = 40_000
    out = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dt).removeprefix("torch.")
        w = torch.from_numpy((RNG.standard_normal(n) * 0.02).astype(np.float32)).to(dt)
        out[f"{name}.weights"] = w
        out[f"{name}.positive"] = w.abs()                       # sign plane of one symbol
        out[f"{name}.mostly_positive"] = torch.where(            # skewed signs: rANS
            torch.from_numpy(RNG.random(n) < 0.97), w.abs(), -w.abs())
        out[f"{name}.ones"] = torch.ones(n, dtype=dt)            # every plane CONST
        top = 1 << (8 * w.element_size())
        out[f"{name}.random"] = _bits(dt, RNG.integers(0, top, n))  # incompressible
        out[f"{name}.two"] = _bits(dt, RNG.integers(0, 2, n) * (top // 2 + 1))  # 0/1 planes
        out[f"{name}.tiny"] = w[:20].clone()
        out[f"{name}.skewed"] = (torch.from_numpy(RNG.geometric(0.6, n).astype(np.float32))
                                 * 2.0 ** -10).to(dt)           # exponents of few symbols
    return out


WS = 64 << 20  # tensors() in one group, whose worst case fits: its rANS launch queued early


def _queued(monkeypatch) -> list[bool]:
    """Whether each group's rANS launch was the one queued early (appended per group)."""
    seen: list[bool] = []
    real = encode_group._encode

    def spy(enc, pl, *a, **k):
        seen.append(pl.rans_queued is not None)
        return real(enc, pl, *a, **k)

    monkeypatch.setattr(encode_group, "_encode", spy)
    return seen


@pytest.mark.parametrize("policy,mantissa", [("auto", "auto"), ("auto", "rans"),
                                             ("auto", "raw"), ("auto-1.0", "auto"),
                                             ("seed", "auto")])
def test_the_device_picks_the_planes_the_host_picks(emulated, monkeypatch, policy,
                                                    mantissa) -> None:
    ts = tensors()
    seen = _queued(monkeypatch)
    early = encode.Encoder(policy, mantissa=mantissa, workspace=WS)
    blob = encode.file_of(early, ts)
    assert early.mispredicted == 0
    assert seen and all(seen)  # one group, split and histogrammed in one pass
    late = encode.Encoder(policy, mantissa=mantissa, workspace=WS)
    late.early_rans = False
    assert encode.file_of(late, ts) == blob
    reader = s4format.Reader(blob)
    for i, t in enumerate(ts.values()):
        assert reader.read_raw(i).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_launch_that_picked_other_planes_is_not_used(emulated, monkeypatch) -> None:
    ts = tensors()
    late = encode.Encoder("auto", workspace=WS)
    late.early_rans = False
    want = encode.file_of(late, ts)
    real = em.launch

    def wrong(module, name, grid, block, *a):
        real(module, name, grid, block, *a)
        if name == "rans_jobs":  # the device picks every plane
            em.at(a[6], np.uint8, int(a[3]))[:] = 1

    monkeypatch.setattr(runtime, "launch", wrong)
    seen = _queued(monkeypatch)
    early = encode.Encoder("auto", workspace=WS)
    assert encode.file_of(early, ts) == want
    assert early.mispredicted == 1
    assert seen == [False]


@pytest.mark.parametrize("workspace", [1 << 18, 1 << 20, 64 << 20])
def test_only_a_group_whose_worst_case_fits_queues_rans_early(emulated, monkeypatch,
                                                             workspace) -> None:
    # the early launch holds rANS scratch for every split plane: only a group whose worst case
    # fits takes it (64 MiB); a tensor alone over the workspace (256 KiB: encode_device codes
    # it whole) and one sized after a histogram pass (1 MiB) code the planes the host picks
    scratch: list[int] = []
    real = ransencode.rans_launch

    def spy(width, n, *a, **k):
        scratch.append(2 * int(np.asarray(n).sum()))
        return real(width, n, *a, **k)

    monkeypatch.setattr(ransencode, "rans_launch", spy)
    x = (torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    enc = encode.Encoder("auto", workspace=workspace)
    enc.encode_device([encode.Item.of(x)])
    fits = workspace >= 64 << 20
    # the exponent plane alone, or (fits) all three split planes
    assert scratch == ([2 * 3 * 200_000] if fits else [2 * 200_000])
