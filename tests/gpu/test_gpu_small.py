"""Raw-layout tensors on the CUDA path: the GPU stores tensors under the split threshold as one
raw plane copied on the device (no host coding), and decodes raw-layout tensors whose plane is
raw or rANS straight into the destination (no merge). Skipped without CUDA and CuPy."""

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
from s4format import codecs, layouts  # noqa: E402
from s4format.objtree import TensorRef  # noqa: E402
from s4format.writer import SPLIT_MIN, Writer  # noqa: E402
from s4weights.gpu import decode  # noqa: E402

pytestmark = pytest.mark.gpu


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def _small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8,
               torch.bool):
        isz = torch.empty(0, dtype=dt).element_size()
        for nb in (0, isz, 7 * isz, SPLIT_MIN - isz):
            n = nb // isz
            x = torch.randint(-(1 << 15), 1 << 15, (n,), device="cuda", generator=g)
            if dt == torch.bool:
                t = x > 0
            elif dt.is_floating_point:
                t = (x.to(torch.int16) if isz == 2 else x.to(torch.int32) * 65537).view(dt)
            else:
                t = x.to(dt)
            state[f"{dt}-{nb}"] = t
    nan = torch.tensor([0x7FA12345, 0xFFC00000, 0x80000000, 1], dtype=torch.int64)
    state["nan-payloads"] = nan.to(torch.int32).view(torch.float32).cuda()
    state["big"] = torch.randn(1 << 16, device="cuda")  # split as usual, next to the small
    return state


def test_small_tensors_are_raw_planes_and_round_trip_on_both_paths() -> None:
    state = _small_state()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    blob = buf.getvalue()
    reader = s4format.Reader(blob)
    for t in reader.tensors:
        if t.raw_nbytes < SPLIT_MIN:
            assert t.layout.layout_id == layouts.RAW.layout_id, t.name
            assert [p.codec for p in t.planes] == [codecs.RAW], t.name
            assert decode.decodable(reader, reader.tensors.index(t))
    on_gpu = s4weights.load(blob, map_location="cuda", device="cuda")
    on_cpu = s4weights.load(blob, map_location="cpu", device="cpu")
    for k, v in state.items():
        for got in (on_gpu[k], on_cpu[k]):
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert _bytes(got) == _bytes(v), k


def test_raw_layout_rans_planes_decode_on_the_gpu_into_the_destination() -> None:
    rng = np.random.default_rng(3)
    arrays = {"u8_small": rng.geometric(0.4, 3000).clip(0, 255).astype(np.uint8),
              "u8_big": rng.geometric(0.2, (1 << 18) + 5).clip(0, 255).astype(np.uint8),
              "u8_one_value": np.full(70_000, 9, np.uint8),
              "u8_noise": rng.integers(0, 256, 5000, dtype=np.uint8)}
    buf = io.BytesIO()
    with Writer(buf) as w:
        for name, a in arrays.items():
            w.add(name, a)
        w.set_tree({k: TensorRef(i) for i, k in enumerate(arrays)})
    reader = s4format.Reader(buf.getvalue())
    got_codecs = {t.name: t.planes[0].codec for t in reader.tensors}
    assert got_codecs["u8_big"] == codecs.RANS and got_codecs["u8_small"] == codecs.RANS
    idx = list(range(len(arrays)))
    assert all(decode.decodable(reader, i) == (got_codecs[reader.tensors[i].name]
                                                in (codecs.RAW, codecs.RANS)) for i in idx)
    gpu = [i for i in idx if decode.decodable(reader, i)]
    outs = [torch.full((reader.tensors[i].raw_nbytes,), 0xAB, dtype=torch.uint8,
                       device="cuda") for i in gpu]
    decode.read_tensors(reader, gpu, outs)
    for i, o in zip(gpu, outs):
        assert o.cpu().numpy().tobytes() == arrays[reader.tensors[i].name].tobytes()


def test_corrupt_raw_layout_rans_stream_is_refused_on_the_gpu() -> None:
    rng = np.random.default_rng(4)
    a = rng.geometric(0.3, 200_000).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.add("a", a)
        w.set_tree([TensorRef(0)])
    blob = bytearray(buf.getvalue())
    reader = s4format.Reader(bytes(blob))
    p = reader.tensors[0].planes[0]
    assert p.codec == codecs.RANS
    blob[p.offset + p.stored_len - 3] ^= 0x5A  # inside the word area
    bad = s4format.Reader(bytes(blob))
    with pytest.raises(s4format.S4Error):
        decode.read_tensors(bad, [0])


def test_raw_plane_with_parameters_is_refused_on_the_gpu_as_on_the_cpu() -> None:
    from s4format import dtypes, hashing
    from s4format.writer import CodedPlane, CodedTensor

    a = np.arange(5000, dtype=np.uint8)
    buf = io.BytesIO()
    with Writer(buf) as w:
        ct = CodedTensor(layouts.RAW, (CodedPlane(0, 0, codecs.RAW, a.size, a, b"\x00"),))
        w.add_coded("a", dtypes.BY_NAME["uint8"], (a.size,), ct, hashing.content_hash(a))
        w.set_tree([TensorRef(0)])
    reader = s4format.Reader(buf.getvalue())
    with pytest.raises(s4format.CodecError, match="raw"):
        reader.read_raw(0)
    with pytest.raises(s4format.CodecError, match="raw plane with parameters"):
        decode.read_tensors(reader, [0])


def test_max_tensor_bytes_is_enforced_before_the_gpu_allocates() -> None:
    buf = io.BytesIO()
    s4weights.save({"w": torch.randn(1 << 16, device="cuda")}, buf, device="cuda")
    reader = s4format.Reader(buf.getvalue(), max_tensor_bytes=1 << 10)
    with pytest.raises(s4format.LimitError, match="max_tensor_bytes"):
        decode.read_tensors(reader, [0])


@pytest.mark.parametrize("delta,message", [
    (1 << 20, r"rans block \d+ stores \d+ words for \d+ symbols \(at most one word per symbol\)"),
    (-1, r"rans RANS stream must be \d+ bytes, is \d+")])
def test_word_count_checks_run_in_rans_blocks_on_the_gpu(delta: int, message: str) -> None:
    # the checks the host no longer makes (rans_blocks makes them on the device), on a file the
    # GPU wrote; an earlier plane's corrupt word is still reported first
    from tests.gpu.test_decode_host import _count_edit, _rewrite, flip_last_word

    g = torch.Generator(device="cuda").manual_seed(5)
    state = {"a": torch.randn(200_000, device="cuda", generator=g) * 0.02,
             "b": (torch.randn(200_000, device="cuda", generator=g) * 0.02).bfloat16()}
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    blob = buf.getvalue()
    r = s4format.Reader(blob)
    ia, ib = r.index_of("a"), r.index_of("b")

    def rans_plane(t) -> int:
        return next(k for k, p in enumerate(t.planes) if p.codec == codecs.RANS
                    and int(r.source.read_at(p.offset, 1)[0]) == 2)

    ja, jb = rans_plane(r.tensors[ia]), rans_plane(r.tensors[ib])
    bad = _rewrite(blob, "b", jb, _count_edit(delta))
    with pytest.raises(s4format.CodecError,
                       match=f"tensor 'b' plane {r.tensors[ib].planes[jb].label}: {message}$"):
        decode.read_tensors(s4format.Reader(bad), [ia, ib])

    both = s4format.Reader(_rewrite(bad, "a", ja, flip_last_word))
    with pytest.raises(s4format.CodecError, match=r"tensor 'a' plane .*: rans block \d+ of \d+ "
                                                  "is corrupt"):
        decode.read_tensors(both, [ia, ib])


def test_the_loader_reads_the_tensors_before_one_over_the_size_limit_first() -> None:
    # load(into=...) for some tensors: a batch stops before a tensor over the limit (R0), so a
    # damaged tensor before it is reported first, as the CPU reader reads them
    from s4weights.gpu import loader_for
    from tests.gpu.test_decode_host import _rans_plane, _rewrite, flip_last_word

    g = torch.Generator(device="cuda").manual_seed(6)
    state = {"a": (torch.randn(200_000, device="cuda", generator=g) * 0.02).bfloat16(),
             "b": torch.randn(200_000, device="cuda", generator=g)}
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    blob = buf.getvalue()
    blob = _rewrite(blob, "a", _rans_plane(s4format.Reader(blob), "a"), flip_last_word)
    reader = s4format.Reader(blob, max_tensor_bytes=500_000)  # a: 400,000 bytes; b: 800,000
    ia, ib = reader.index_of("a"), reader.index_of("b")
    assert ia < ib
    load = loader_for(reader, "cuda",
                      direct={ia: torch.empty(400_000, dtype=torch.uint8, device="cuda")})
    with pytest.raises(s4format.CodecError, match="tensor 'a'"):
        load(ia, "cuda")
    with pytest.raises(s4format.LimitError, match="tensor 'b'"):
        load(ib, "cuda")


def test_a_damaged_plane_fails_its_checksum_after_the_decode_kernels() -> None:
    # without nvCOMP planes the checksums are read after the rANS and merge kernels have run
    # on the damaged bytes: still a ChecksumError naming the plane, for the group's own decode
    # and through read_tensors, and the CPU reader agrees
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {"a": (torch.randn(200_000, device="cuda", generator=g) * 0.02).bfloat16(),
             "b": torch.randn(200_000, device="cuda", generator=g) * 0.02}
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    blob = bytearray(buf.getvalue())
    r = s4format.Reader(bytes(blob))
    assert all(p.codec not in (codecs.GDEFLATE, codecs.NVCOMP_ANS)
               for t in r.tensors for p in t.planes)
    t = r.tensors[r.index_of("b")]
    p = max(t.planes, key=lambda p: p.stored_len)
    blob[p.offset + p.stored_len // 2] ^= 0x10
    bad = s4format.Reader(bytes(blob))
    with pytest.raises(s4format.ChecksumError, match=f"tensor 'b' plane {p.label}"):
        bad.read_raw(bad.index_of("b"))
    idx = [bad.index_of("a"), bad.index_of("b")]
    outs = [torch.empty(bad.tensors[i].raw_nbytes, dtype=torch.uint8, device="cuda")
            for i in idx]
    with pytest.raises(s4format.ChecksumError, match=f"tensor 'b' plane {p.label}"):
        decode.decode_staged(decode.stage(bad, idx), outs)
    with pytest.raises(s4format.ChecksumError, match=f"tensor 'b' plane {p.label}"):
        decode.read_tensors(bad, idx)
