"""Codec 6 (nvcomp-ans) on the GPU: written only under the explicit policy, read bit-exactly on
the GPU path and through the registry, refused where it is not registered, and bad plane
parameters or lengths are CodecErrors. Skipped without CUDA, CuPy and nvCOMP."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
pytest.importorskip("nvidia.nvcomp")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format import codecs  # noqa: E402
from s4format.errors import CodecError  # noqa: E402
from s4weights.gpu import nvans  # noqa: E402

pytestmark = pytest.mark.gpu


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(9)
    bits32 = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), device="cuda", generator=g,
                           dtype=torch.int64).to(torch.int32)
    return {
        "bf16_all": torch.arange(-(1 << 15), 1 << 15, device="cuda", dtype=torch.int32)
        .to(torch.int16).view(torch.bfloat16),
        "fp16_all": torch.arange(-(1 << 15), 1 << 15, device="cuda", dtype=torch.int32)
        .to(torch.int16).view(torch.float16),
        "fp32_bits": bits32.view(torch.float32),
        "bf16_weights": (torch.randn(1 << 18, device="cuda", generator=g) * 0.02)
        .to(torch.bfloat16),
        "fp32_weights": torch.randn(1 << 18, device="cuda", generator=g) * 0.02,
        "ints": torch.arange(100_000, device="cuda") % 7,
        "small": torch.randn(5, device="cuda"),
        "host": torch.randn(1000),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())


def test_policy_writes_codec_6_and_it_reads_back_bit_exactly(tmp_path) -> None:
    state = _state()
    path = tmp_path / "x.s4w"
    s4weights.save(state, path, policy="nvcomp-ans", device="cuda")
    assert nvans.register()
    reader = s4format.Reader(path)
    by_name = {t.name: t for t in reader.tensors}
    for name in ("bf16_weights", "fp32_weights", "ints"):
        assert [p.codec for p in by_name[name].planes] == [codecs.NVCOMP_ANS], name
    assert by_name["bf16_weights"].planes[0].params == bytes([1])
    # every bf16 bit pattern once: nothing for nvCOMP to gain, stored raw (never grows)
    assert by_name["bf16_all"].planes[0].codec == codecs.RAW
    assert by_name["fp32_weights"].planes[0].params == bytes([2])
    assert by_name["small"].planes[0].codec == codecs.RAW
    assert by_name["host"].planes[0].codec != codecs.NVCOMP_ANS  # host tensors: default codecs
    for t in reader.tensors:  # never more than raw
        assert sum(p.stored_len for p in t.planes) <= t.raw_nbytes
    reader.close()
    on_gpu = s4weights.load(path, map_location="cuda", device="cuda")
    on_cpu = s4weights.load(path, map_location="cpu", device="auto")  # registry round trip
    for k, v in state.items():
        assert _same(on_gpu[k], v), k
        assert _same(on_cpu[k], v), k


def test_a_reader_without_the_codec_refuses_the_file(tmp_path) -> None:
    path = tmp_path / "x.s4w"
    s4weights.save({"w": torch.randn(1 << 16, device="cuda")}, path, policy="nvcomp-ans")
    code = ("import sys, s4format\n"
            "try:\n    s4format.Reader(sys.argv[1])\n"
            "except s4format.UnsupportedCodecError as e:\n    print('refused:', e); sys.exit(0)\n"
            "sys.exit(1)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nvcomp-ans" in r.stdout


def test_nvcomp_ans_needs_the_gpu_path() -> None:
    with pytest.raises(ValueError, match="nvcomp-ans"):
        s4weights.save({"w": torch.randn(10_000, device="cuda")}, io.BytesIO(),
                       policy="nvcomp-ans", device="cpu")


def test_bad_parameters_and_lengths_are_codec_errors() -> None:
    x = (torch.randn(1 << 16, device="cuda") * 0.02).to(torch.bfloat16)
    data = x.view(torch.uint8).reshape(-1)
    comp = nvans.encode(data, 1)
    out = torch.empty_like(data)
    nvans.decode_into(comp, data.numel(), bytes([1]), out, "t")
    assert torch.equal(out, data)
    with pytest.raises(CodecError, match="parameters"):
        nvans.decode_into(comp, data.numel(), bytes([7]), out, "t")
    with pytest.raises(CodecError, match="parameters"):
        nvans.decode_into(comp, data.numel(), b"", out, "t")
    with pytest.raises(CodecError, match="declared"):
        nvans.decode_into(comp, data.numel() + 2, bytes([1]), torch.empty(
            data.numel() + 2, dtype=torch.uint8, device="cuda"), "t")
    assert np.array_equal(nvans.NvcompAnsCodec().decode(comp.cpu().numpy(), data.numel(),
                                                        bytes([1])), data.cpu().numpy())


def test_checkpoint_chains_under_nvcomp_ans_keep_their_deltas(tmp_path) -> None:
    # a fresh process, where nothing has registered codec 6 yet: the second save must open
    # the first (an nvcomp-ans file) as its parent, not fall back to a new base. (nvCOMP's ANS
    # stores this delta at 0.91 of the tensor alone, on the H200 on 2026-12-04: under the
    # default bar, writer.DELTA_PAYS, the tensor would be coded alone; the bar is lifted here.)
    code = (
        "import sys, torch, s4weights\n"
        "import s4format.writer\n"
        "s4format.writer.DELTA_PAYS = 1.0\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(1 << 18, device='cuda') * 0.02\n"
        "s4weights.save_checkpoint({'w': w}, sys.argv[1], 0, policy='nvcomp-ans')\n"
        "w[:1000] += 1e-3\n"
        "info = s4weights.save_checkpoint({'w': w}, sys.argv[1], 1, policy='nvcomp-ans',\n"
        "                                 min_delta_gain=0.0)\n"
        "got = s4weights.load_checkpoint(sys.argv[1], 1, map_location='cuda')['w']\n"
        "assert torch.equal(got.view(torch.int32), w.view(torch.int32))\n"
        "print('parent', info.parent_step)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parent 0" in r.stdout, r.stdout + r.stderr
