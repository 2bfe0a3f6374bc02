"""Tensors larger than the workspace are coded in chunks (``s4weights.gpu.chunked``): the stored
planes equal the one-group path's byte for byte, the extra device memory stays under the
workspace, deltas are XORed chunk by chunk, and a rANS stream that reaches its raw size falls
back to raw. Skipped without CUDA and CuPy."""

from __future__ import annotations

import io

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format import codecs, dtypes, hashing  # noqa: E402
from s4weights import chain  # noqa: E402
from s4weights.gpu import chunked, plan  # noqa: E402
from s4weights.gpu.encode import Encoder, Item  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20
SLACK = 4 * MIB
BIG = 1 << 34  # a workspace that takes any tensor here in one group


def _item(t: torch.Tensor) -> Item:
    return Item(dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape),
                t.reshape(-1).view(torch.uint8))


def _code1(enc: Encoder, t: torch.Tensor):
    (out,) = enc.code([_item(t)])
    return out


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3)
    n = 5 * MIB + 12345  # 5 chunks and a partial one at the smallest chunk length
    w = torch.randn(n, device="cuda", generator=g) * 0.02
    bits = torch.randint(-(1 << 31), 1 << 31, (n,), device="cuda", generator=g,
                         dtype=torch.int64).to(torch.int32)
    blocks = torch.arange(n, device="cuda") // 65536  # one value per rANS block
    return {
        "bf16": w.bfloat16(),
        "fp16": w.half(),
        "fp32": w,
        "fp32-adam-v": (w * w).abs() * 1e-3,
        "random-bits": bits.view(torch.float32),          # every plane raw: the CPU codes it
        "zeros": torch.zeros(n, device="cuda", dtype=torch.bfloat16),  # one symbol
        "per-block": (blocks.float() * 0.125).bfloat16(),  # every block one symbol: CONST
        "specials": torch.tensor([float("nan"), float("inf"), -0.0, 1e-40] * (n // 4),
                                 device="cuda"),
    }


def _same(a, b) -> None:
    """Two CodedTensors store the same bytes (the chunked coder leaves checksums to the
    writer: compare them by the payload's checksum)."""
    assert a.layout.layout_id == b.layout.layout_id
    assert len(a.planes) == len(b.planes)
    for p, q in zip(a.planes, b.planes):
        assert (p.kind, p.index, p.codec, p.decoded_len) == (q.kind, q.index, q.codec,
                                                              q.decoded_len)
        assert bytes(p.payload) == bytes(q.payload), (p.kind, p.index, p.codec)
        for c in (p, q):
            if c.checksum is not None:
                assert c.checksum == hashing.plane_checksum(np.asarray(c.payload))


@pytest.mark.parametrize("name", list(_tensors()))
def test_chunked_planes_equal_the_one_group_path(name: str) -> None:
    t = _tensors()[name]
    whole = _code1(Encoder(workspace=BIG), t)
    small = 24 * MIB
    enc = Encoder(workspace=small)
    assert isinstance(enc._groups([_item(t)], chunked=True)[0], Item)  # really chunked
    part = _code1(enc, t)
    assert part.content_hash == whole.content_hash
    _same(part.coded, whole.coded)


def test_chunked_coding_stays_within_the_workspace_and_round_trips() -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {"emb": torch.randn(40 * MIB, device="cuda", generator=g) * 0.02,  # 160 MiB
             "head": (torch.randn(48 * MIB, device="cuda", generator=g) * 0.02).bfloat16(),
             "ids": torch.arange(12 * MIB, device="cuda"),                   # 96 MiB int64
             "norm": torch.ones(4096, device="cuda")}
    for workspace in (32 * MIB, 64 * MIB):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        buf = io.BytesIO()
        s4weights.save(state, buf, device="cuda", workspace=workspace)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= workspace + SLACK, (workspace / MIB, extra / MIB)
        for dev in ("cpu", "cuda"):
            got = s4weights.load(buf.getvalue(), map_location="cuda", device=dev)
            for k, v in state.items():
                assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), (k, dev)


def test_chunk_lengths_follow_the_workspace() -> None:
    from s4format import layouts

    for lay, size in ((layouts.BF16, 2), (layouts.FP16, 2), (layouts.FP32, 4)):
        for ws in (32 * MIB, 188 * MIB, 1 << 30):
            c = plan.large_chunk(lay, size, ws, 1 << 34, 4, True, True, 16)
            assert c % plan.LARGE_ALIGN == 0
            assert plan.large_need(lay, size, c, 4, True, True, 16) <= ws


def test_a_stream_that_reaches_its_raw_size_is_stored_raw(monkeypatch) -> None:
    t = (torch.randn(3 * MIB, device="cuda") * 0.02).bfloat16()
    whole = _code1(Encoder(workspace=BIG), t).coded
    rans_sizes = {(p.kind, p.index): p.stored_len for p in whole.planes
                  if p.codec == codecs.RANS}
    assert rans_sizes
    # a stream must now stay under half the plane: the larger ones fall back to raw
    monkeypatch.setattr(chunked, "_room", lambda n: n // 2)
    part = _code1(Encoder(workspace=16 * MIB), t).coded
    for p in part.planes:
        if rans_sizes.get((p.kind, p.index), 0) >= p.decoded_len // 2:
            assert p.codec == codecs.RAW
    buf = io.BytesIO()
    w = s4format.Writer(buf)
    ref = w.add_coded("t", dtypes.BY_NAME["bfloat16"], tuple(t.shape), part,
                      hashing.content_hash(t.view(torch.uint8).cpu().numpy()))
    w.set_tree({"t": ref})
    w.close()
    got = s4format.Reader(buf.getvalue()).read_raw(0)
    assert bytes(got) == t.view(torch.uint8).cpu().numpy().tobytes()


def test_large_delta_is_xored_in_chunks(tmp_path, monkeypatch) -> None:
    # the chain keeps a device copy of the state it saved (the next delta's parent): not the
    # encoder's workspace, so this test keeps a reference instead of the copy
    monkeypatch.setattr(chain, "_copy", lambda t: t)
    g = torch.Generator(device="cuda").manual_seed(9)
    w0 = torch.randn(24 * MIB, device="cuda", generator=g) * 0.02      # 96 MiB
    w1 = w0 + torch.randn(24 * MIB, device="cuda", generator=g) * 1e-4
    root = str(tmp_path / "run")
    chain.save_checkpoint({"w": w0}, root, 0, device="cuda", workspace=48 * MIB)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    info = chain.save_checkpoint({"w": w1}, root, 1, device="cuda", workspace=48 * MIB)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 48 * MIB + SLACK, extra / MIB
    assert info.parent_step == 0 and info.stored_bytes < info.full_stored_bytes
    for dev in ("cpu", "cuda"):
        got = chain.load_checkpoint(root, map_location="cuda", device=dev)
        assert torch.equal(got["w"].view(torch.uint8), w1.view(torch.uint8)), dev
