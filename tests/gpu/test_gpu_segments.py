"""Flat buffers saved from CUDA tensors (segments on, the default): cut where the distribution
changes, coded as segments on the GPU and stored with codec 9, within 1% of the CPU path's
file, bit-exact on both decoders; a tensor of one distribution stays codec 4. Skipped without
CUDA."""

from __future__ import annotations

import io

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format import codecs  # noqa: E402
from s4weights.gpu import segments  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _segments_on(monkeypatch):
    monkeypatch.setattr(segments, "ENABLED", True)


def _flat(dtype: torch.dtype, n: int) -> torch.Tensor:
    """Parameters of different scales end to end, their lengths not multiples of 65,536."""
    g = torch.Generator(device="cuda").manual_seed(1)
    parts = [torch.randn(n // 3 + 1234, device="cuda", generator=g) * 0.02,
             torch.ones(n // 7, device="cuda"),
             torch.randn(n // 5 + 77, device="cuda", generator=g) * 1e-4,
             torch.zeros(n // 9, device="cuda")]
    rest = n - sum(p.numel() for p in parts)
    parts.append(torch.randn(rest, device="cuda", generator=g))
    return torch.cat(parts).to(dtype)


def _codecs(blob: bytes) -> dict[str, int]:
    with s4format.Reader(blob) as r:
        return {p.label: p.codec for p in r.tensors[0].planes}


def _saved(state, device: str) -> bytes:
    buf = io.BytesIO()
    s4weights.save(state, buf, device=device)
    return buf.getvalue()


@pytest.mark.parametrize(("dtype", "n"), [(torch.bfloat16, 12 << 20), (torch.float32, 6 << 20)])
def test_a_flat_buffer_codes_as_segments_on_the_gpu(dtype, n) -> None:
    t = _flat(dtype, n)
    blob = _saved({"flat": t}, "cuda")
    assert _codecs(blob)["exponent"] == codecs.RANS_SEG
    host = _saved({"flat": t.cpu()}, "cpu")
    assert len(blob) <= 1.01 * len(host)
    on_gpu = s4weights.load(blob, map_location="cuda")["flat"]
    on_cpu = s4weights.load(blob, map_location="cpu", device="cpu")["flat"]
    raw = t.view(torch.int32 if dtype == torch.float32 else torch.int16)
    assert torch.equal(on_gpu.view(raw.dtype), raw)
    assert torch.equal(on_cpu.view(raw.dtype), raw.cpu())


def test_segments_store_less_than_one_table(monkeypatch) -> None:
    t = _flat(torch.bfloat16, 12 << 20)
    segmented = _saved({"flat": t}, "cuda")
    monkeypatch.setattr(segments, "ENABLED", False)
    one_table = _saved({"flat": t}, "cuda")
    assert codecs.RANS_SEG not in _codecs(one_table).values()
    assert len(segmented) < 0.97 * len(one_table)


def test_one_distribution_keeps_one_table() -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    t = (torch.randn(12 << 20, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    assert codecs.RANS_SEG not in _codecs(_saved({"w": t}, "cuda")).values()


def test_a_delta_of_a_flat_buffer_round_trips(tmp_path) -> None:
    t = _flat(torch.bfloat16, 12 << 20)
    s4weights.save_checkpoint({"flat": t}, tmp_path, 0)
    t2 = t.clone()
    t2[: 1 << 20] += 0.001
    s4weights.save_checkpoint({"flat": t2}, tmp_path, 1)
    got = s4weights.load_checkpoint(tmp_path, 1, map_location="cuda")["flat"]
    assert torch.equal(got.view(torch.int16), t2.view(torch.int16))


def _no_cpu_decode(monkeypatch) -> None:
    from s4weights.gpu import decode

    def refuse(reader, i, out):
        raise AssertionError(f"tensor {reader.tensors[i].name!r} decoded on the CPU")
    monkeypatch.setattr(decode, "read_on_cpu", refuse)


def test_codec_9_planes_decode_on_the_device(monkeypatch) -> None:
    # every segment codec, in split and raw-layout tensors, by the device's own kernels
    from s4weights.gpu import decode
    from tests.gpu.test_decode_segments_host import _bytes_tensor, _file
    from tests.gpu.test_decode_segments_host import _flat as _segmented_bf16

    blob = _file({"a": _segmented_bf16(1), "b": _bytes_tensor(2),
                  "c": _segmented_bf16(3, ["raw", "bitpack", "rans", "raw"],
                                       ["rans-raw", "rans", "rans", "rans-const"],
                                       ["rans", "bitpack-w", "raw", "bitpack-w"])})
    _no_cpu_decode(monkeypatch)
    r = s4format.Reader(blob)
    outs = decode.read_tensors(r, [0, 1, 2])
    for i, o in enumerate(outs):
        assert (o.cpu().numpy() == r.read_raw(i)).all()


@pytest.mark.parametrize("plane,how", [((1, 1), "symbols"), ((1, 0), "padding"),
                                       ((1, 1), "rans-mode"), ((1, 1), "rans-block"),
                                       ((2, 0), "rans-block")])
def test_a_damaged_segment_fails_on_the_device_as_on_the_cpu(plane, how) -> None:
    from s4format.errors import CodecError
    from s4weights.gpu import decode
    from tests.gpu.test_decode_segments_host import EXP, _bytes_tensor, _damage, _file
    from tests.gpu.test_decode_segments_host import _flat as _segmented_bf16

    good = _file({"a": _segmented_bf16(1),
                  "b": _segmented_bf16(2, ["bitpack", "raw", "rans", "bitpack"], EXP,
                                       ["bitpack-w", "raw", "rans", "bitpack-w"]),
                  "c": _bytes_tensor(3)})
    blob = _damage(good, plane, how)
    with pytest.raises(CodecError) as cpu:
        r = s4format.Reader(blob)
        for i in range(3):
            r.read_raw(i)
    with pytest.raises(CodecError) as got:
        decode.read_tensors(s4format.Reader(blob), [0, 1, 2])
    assert str(got.value) == str(cpu.value)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_flat_buffer_loads_on_the_device_whoever_coded_it(device, monkeypatch) -> None:
    t = _flat(torch.float32, 6 << 20)
    blob = _saved({"flat": t if device == "cuda" else t.cpu()}, device)
    assert codecs.RANS_SEG in _codecs(blob).values()
    with s4format.Reader(blob) as r:
        from s4weights.gpu import decode
        on_device = decode.decodable(r, 0)
    # (the CPU coder may store a plane with zstd, which the device does not decode)
    assert on_device or device == "cpu"
    if on_device:
        _no_cpu_decode(monkeypatch)
    got = s4weights.load(blob, map_location="cuda")["flat"]
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))


def test_a_stitched_planes_checksum_is_made_on_the_device_as_on_the_host() -> None:
    # page-locked parts read in place by the device, pageable ones and the leaves across
    # parts hashed on the host: the checksum is the host's of the joined bytes
    import itertools

    import numpy as np

    from s4format import hashing
    from s4format.pieces import Pieces
    from s4weights.gpu import hash as gpu_hash
    from s4weights.gpu import runtime

    rng = np.random.default_rng(5)
    pinned = runtime.pinned(9 << 20).numpy()
    pinned[:] = rng.integers(0, 256, pinned.size, dtype=np.uint8)
    assert gpu_hash._page_locked(pinned.ctypes.data)
    assert not gpu_hash._page_locked(np.zeros(1 << 20, np.uint8).ctypes.data)
    for cut in ([0, 100, 3 << 20, (3 << 20) + 65536, 9 << 20], [0, 65536 * 7, (9 << 20) - 5]):
        parts = [b"head" * 7] + [pinned[a:b] for a, b in itertools.pairwise(cut)] + \
            [rng.integers(0, 256, 70001, dtype=np.uint8)]
        payload = Pieces(parts)
        assert gpu_hash.pieces_checksum(payload) == hashing.plane_checksum(
            np.concatenate([np.frombuffer(p, np.uint8) for p in payload.parts]))


def test_codec_9_planes_decode_on_the_device_in_chunks(monkeypatch) -> None:
    # tensors larger than the workspace: chunks of 2^16 elements cut segments of several
    # units and cover several short ones, every segment codec, into device and host memory
    from s4weights.gpu import decode_large
    from tests.gpu.test_decode_segments_host import _bytes_tensor, _file, _long
    from tests.gpu.test_decode_segments_host import _flat as _segmented_bf16

    blob = _file({"a": _segmented_bf16(1), "b": _bytes_tensor(2),
                  "c": _long(3, ["rans", "raw", "rans-const", "rans"]),
                  "d": _long(4, ["bitpack-w", "rans", "rans-raw", "rans"])})
    _no_cpu_decode(monkeypatch)
    r = s4format.Reader(blob)
    for i, t in enumerate(r.tensors):
        want = r.read_raw(i)
        assert decode_large.chunkable(r, i)
        out = torch.empty(t.raw_nbytes, dtype=torch.uint8, device="cuda")
        decode_large.load_large(r, i, out, 1 << 16)
        assert (out.cpu().numpy() == want).all(), t.name
        host = torch.empty(t.raw_nbytes, dtype=torch.uint8).pin_memory()
        decode_large.load_large(r, i, host, 1 << 16, on_host=True)
        torch.cuda.synchronize()
        assert (host.numpy() == want).all(), t.name


def test_a_flat_buffer_loads_in_chunks_within_a_small_workspace(monkeypatch, tmp_path) -> None:
    # a flat buffer coded as segments by the device, loaded with a workspace far below its
    # size: decoded in chunks on the device, whole; a delta of it too (from the chain)
    from s4weights.gpu import decode_large

    t = _flat(torch.bfloat16, 12 << 20)
    blob = _saved({"flat": t}, "cuda")
    assert _codecs(blob)["exponent"] == codecs.RANS_SEG
    _no_cpu_decode(monkeypatch)
    chunked = []
    real = decode_large.load_large
    monkeypatch.setattr(decode_large, "load_large", lambda *a, **k: (chunked.append(1),
                                                                     real(*a, **k))[1])
    got = s4weights.load(blob, map_location="cuda", workspace=4 << 20)["flat"]
    assert chunked and torch.equal(got.view(torch.int16), t.view(torch.int16))
    s4weights.save_checkpoint({"flat": t}, tmp_path, 0)
    t2 = t.clone()
    t2[: 1 << 20] += 0.001
    s4weights.save_checkpoint({"flat": t2}, tmp_path, 1)
    chunked.clear()
    got = s4weights.load_checkpoint(tmp_path, 1, map_location="cuda", workspace=4 << 20)["flat"]
    assert chunked and torch.equal(got.view(torch.int16), t2.view(torch.int16))
