"""Codec 10 (seg-lz) on the GPU path: a flat buffer the CPU coder stores with zstd segments loads
onto CUDA bit-exact (its tensor decoded on the host), beside tensors the GPU decodes itself, and
the GPU coder never writes codec 10 for the float tensors it codes on the device. Skipped without
CUDA."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
import s4weights  # noqa: E402
from conformance.generate import moments_buffer  # noqa: E402
from s4format import codecs  # noqa: E402

pytestmark = pytest.mark.gpu


def _state() -> dict[str, torch.Tensor]:
    flat = torch.from_numpy(moments_buffer().copy())
    g = torch.Generator().manual_seed(3)
    return {"flat": flat, "w": torch.randn(512, 512, generator=g).to(torch.bfloat16)}


def _plane_codecs(blob: bytes) -> dict[str, set[int]]:
    with s4format.Reader(blob) as r:
        return {t.name: {p.codec for p in t.planes} for t in r.tensors}


def test_a_codec_10_file_written_on_the_cpu_loads_onto_cuda_bit_exact() -> None:
    state = _state()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cpu")
    blob = buf.getvalue()
    assert codecs.SEG_LZ in _plane_codecs(blob)["flat"]
    got = s4weights.load(io.BytesIO(blob), map_location="cuda")
    for name, t in state.items():
        assert got[name].device.type == "cuda"
        assert np.array_equal(got[name].cpu().view(torch.uint8).numpy(),
                              t.view(torch.uint8).numpy()), name


def test_the_gpu_coder_never_writes_codec_10() -> None:
    state = {k: v.cuda() for k, v in _state().items()}
    buf = io.BytesIO()
    s4weights.save(state, buf)
    used = set().union(*_plane_codecs(buf.getvalue()).values())
    assert codecs.SEG_LZ not in used
    got = s4weights.load(io.BytesIO(buf.getvalue()), map_location="cpu")
    for name, t in state.items():
        assert torch.equal(got[name].view(torch.uint8), t.cpu().view(torch.uint8)), name
