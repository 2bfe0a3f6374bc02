"""The fused rANS decode + merge kernel (kernels/fused.cu) on a GPU: it decodes what the
separate rans_decode + merge kernels decode, bit for bit, for files from the GPU and the CPU
coders, every layout and block size; it is what runs for the usual tensors; damaged streams
and out-of-field plane bytes are refused naming the plane. Skipped without CUDA and CuPy."""

from __future__ import annotations

import io

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
from s4format import codecs, dtypes, hashing, layouts, objtree  # noqa: E402
from s4format.codecs.rans import RansCodec  # noqa: E402
from s4format.writer import CodedPlane, CodedTensor, code_tensor  # noqa: E402
from s4weights.gpu import decode  # noqa: E402
from s4weights.gpu.encode import Encoder, Item  # noqa: E402

pytestmark = pytest.mark.gpu


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(3 * 65536 + 1234, device="cuda", generator=g) * 0.02
    out = {
        "bf16": w.bfloat16(),
        "fp16": w.half(),
        "fp32": w.clone(),
        "fp32_pos": w.abs(),                         # CONST sign stream
        "bf16_odd": w[:100_003].bfloat16(),          # a partial last row and block
        "bf16_small": w[:4096].bfloat16(),
        "bf16_patterns": torch.arange(65536, dtype=torch.int32, device="cuda")
        .to(torch.int16).view(torch.bfloat16),       # every bit pattern
    }
    return out


def _file_gpu(state) -> bytes:
    enc = Encoder()
    items = [Item(dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape),
                  t.reshape(-1).view(torch.uint8)) for t in state.values()]
    buf = io.BytesIO()
    with s4format.Writer(buf) as w:
        for name, it, c in zip(state, items, enc.code(items)):
            w.add_coded(name, it.dtype, it.shape, c.coded, c.content_hash)
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(state)})
    return buf.getvalue()


def _file_cpu(state, log2_block: int) -> bytes:
    """The CPU coder's file with every byte plane rANS-coded at ``log2_block`` (its sign plane
    as the CPU coder chose: bitpack, or a CONST stream)."""
    buf = io.BytesIO()
    with s4format.Writer(buf) as w:
        for name, t in state.items():
            raw = t.reshape(-1).view(torch.uint8).cpu().numpy()
            dt = dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")]
            coded = code_tensor(raw, dt)
            split = coded.layout.split(raw, dt.itemsize)
            planes = tuple(p if i == 0 else _rans_or_raw(p, split[i], log2_block)
                           for i, p in enumerate(coded.planes))
            if sum(p.stored_len for p in planes) <= raw.size:  # else as the CPU coded it
                coded = CodedTensor(coded.layout, planes)
            w.add_coded(name, dt, tuple(t.shape), coded, hashing.content_hash(raw))
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(state)})
    return buf.getvalue()


def _rans_or_raw(p, plane: np.ndarray, log2_block: int) -> CodedPlane:
    stream = np.frombuffer(RansCodec(log2_block).encode(plane).payload, np.uint8)
    if stream.size > plane.size:  # a RAW-mode stream: the plane raw (stored <= raw bytes)
        return CodedPlane(p.kind, p.index, codecs.RAW, plane.size, plane)
    return CodedPlane(p.kind, p.index, codecs.RANS, plane.size, stream)


def _read_all(blob: bytes, fused: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    calls = []
    real = decode._launch_fused
    monkeypatch.setattr(decode, "FUSED", fused)
    monkeypatch.setattr(decode, "_launch_fused",
                        lambda fp, keep: calls.append(fp) or real(fp, keep))
    r = s4format.Reader(blob)
    outs = [torch.full((t.raw_nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
            for t in r.tensors]
    decode.read_tensors(r, list(range(len(r.tensors))), outs)
    return outs, sum(len(fp.tensors) for fp in calls)


@pytest.mark.parametrize("source", ["gpu", "cpu16", "cpu10", "cpu20"])
def test_fused_equals_separate_kernels_and_the_original(source, monkeypatch) -> None:
    state = _state()
    blob = _file_gpu(state) if source == "gpu" else _file_cpu(state, int(source[3:]))
    fused_out, nfused = _read_all(blob, True, monkeypatch)
    sep_out, nsep = _read_all(blob, False, monkeypatch)
    assert nsep == 0 and nfused >= 3, nfused  # the usual tensors take the fused kernel
    for (name, t), a, b in zip(state.items(), fused_out, sep_out):
        want = t.reshape(-1).view(torch.uint8)
        assert torch.equal(a, want), (source, name)
        assert torch.equal(b, want), (source, name)


def _one(t: torch.Tensor, edit) -> bytes:
    """A one-tensor file whose planes ``edit(planes)`` changed (checksums of the new bytes)."""
    (c,) = Encoder().code([Item(dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")],
                                tuple(t.shape), t.reshape(-1).view(torch.uint8))])
    planes = [CodedPlane(p.kind, p.index, p.codec, p.decoded_len,
                         np.array(p.payload, copy=True), p.params, None) for p in c.coded.planes]
    edit(planes)
    buf = io.BytesIO()
    with s4format.Writer(buf) as w:
        ref = w.add_coded("t", dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")],
                          tuple(t.shape), CodedTensor(c.coded.layout, tuple(planes)),
                          c.content_hash)
        w.set_tree({"t": ref})
    return buf.getvalue()


def test_damaged_word_is_named_by_plane_and_block(monkeypatch) -> None:
    t = (torch.randn(1 << 20, device="cuda") * 0.02).bfloat16()

    def flip(planes):
        k = next(i for i, p in enumerate(planes) if p.codec == codecs.RANS and p.kind == 2)
        planes[k].payload[planes[k].payload.size - 1000] ^= 0x5A

    blob = _one(t, flip)
    for fused in (True, False):
        with pytest.raises(s4format.CodecError, match=r"plane exponent.*rans block 15 of 16"):
            _read_all(blob, fused, monkeypatch)


def test_plane_bytes_wider_than_their_field_are_refused(monkeypatch) -> None:
    t = (torch.randn(1 << 16, device="cuda") * 0.02).bfloat16()
    raw = t.view(torch.uint8).cpu().numpy()
    mant = layouts.BF16.split(raw, 2)[2].copy()
    assert mant.max() < 0x80
    mant[123] |= 0x80  # bit 7 of a 7-bit field

    def widen(planes):
        k = next(i for i, p in enumerate(planes) if p.kind == layouts.KIND_MANTISSA)
        planes[k] = CodedPlane(planes[k].kind, planes[k].index, codecs.RANS, mant.size,
                               RansCodec().encode(mant).payload)

    blob = _one(t, widen)
    for fused in (True, False):
        with pytest.raises(s4format.FormatError, match="wider than its field"):
            _read_all(blob, fused, monkeypatch)
