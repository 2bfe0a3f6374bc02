"""Bitpack-w (codec 8) on a GPU: the pack kernel's bytes equal the CPU codec's for every width
and length, from byte planes and from planes packed at another width; the split's packed narrow
mantissa planes give the files of the byte-plane split; files whose byte planes are bitpack-w
of every width decode on the GPU exactly as on the CPU (whole and in chunks); the GPU writer's
bitpack-w planes decode on the CPU. Skipped without CUDA and CuPy."""

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
from s4format import codecs, dtypes, hashing, layouts  # noqa: E402
from s4format.writer import CodedPlane, CodedTensor, Writer  # noqa: E402
from s4weights.gpu import decode, decode_large, encode, runtime  # noqa: E402
from tests.gpu import test_packed_split  # noqa: E402
from tests.gpu.emulated import pack_bits  # noqa: E402

pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(808)
BW = codecs.get(codecs.BITPACK_W)


def test_pack_kernel_bytes_equal_the_cpu_codec() -> None:
    lengths = (1, 7, 8, 9, 63, 64, 65, 65535, 65536, 65537, 3 * 65536 + 5)
    for w in range(1, 8):
        planes = [RNG.integers(0, 1 << w, n, dtype=np.uint8) for n in lengths]
        src = [torch.from_numpy(p).cuda() for p in planes]
        dst = [torch.full(((n * w + 7) // 8 + 16,), 0xAB, dtype=torch.uint8, device="cuda")
               for n in lengths]
        runtime.pack_ops([s.data_ptr() for s in src], [d.data_ptr() for d in dst],
                         list(lengths), [w] * len(lengths))
        for p, d, n in zip(planes, dst, lengths):
            got = d.cpu().numpy()
            want = np.asarray(BW.encode(p).payload)
            assert got[:want.size].tobytes() == want.tobytes(), (w, n)
            assert (got[want.size:] == 0xAB).all(), (w, n)  # nothing written past the end


def test_pack_kernel_repacks_packed_planes() -> None:
    # a plane the split stored at ws bits, stored at wd (narrower, or 8: its bytes as they are)
    lengths = (1, 9, 255, 256, 257, 65536 + 77, 3 * 65536)
    for ws in (1, 2, 7):
        for wd in (*range(1, ws), 8):
            planes = [RNG.integers(0, 1 << min(ws, wd), n, dtype=np.uint8) for n in lengths]
            src = [torch.from_numpy(pack_bits(p, ws)).cuda() for p in planes]
            dst = [torch.full(((n * wd + 7) // 8 + 16,), 0xAB, dtype=torch.uint8, device="cuda")
                   for n in lengths]
            runtime.pack_ops([s.data_ptr() for s in src], [d.data_ptr() for d in dst],
                             list(lengths), [wd] * len(lengths), [ws] * len(lengths))
            for p, d in zip(planes, dst):
                got = d.cpu().numpy()
                want = pack_bits(p, wd)
                assert got[:want.size].tobytes() == want.tobytes(), (ws, wd, p.size)
                assert (got[want.size:] == 0xAB).all(), (ws, wd, p.size)


@pytest.mark.parametrize("workspace", [1 << 30, 3 << 20])
def test_packed_split_files_equal_the_byte_split(workspace: int) -> None:
    # the split packing narrow mantissa planes (copied, repacked, rANS-coded from the packed
    # bits, or CONST) writes the file the byte-plane split writes, and it reads back exactly
    tensors = {k: v.cuda() for k, v in test_packed_split._tensors().items()}
    plain = encode.Encoder("auto", workspace=workspace)
    plain.packs = False
    blob = encode.file_of(encode.Encoder("auto", workspace=workspace), tensors)
    assert blob == encode.file_of(plain, tensors)
    reader = s4format.Reader(blob)
    for i, t in enumerate(tensors.values()):
        assert reader.read_raw(i).tobytes() == \
            t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes(), i


def _file(n: int) -> tuple[bytes, list[np.ndarray]]:
    """bf16, fp16 and fp32 tensors of n elements whose every byte plane is stored bitpack-w
    at the plane's own width (fields of 1..7 bits, drawn below their width)."""
    buf = io.BytesIO()
    raws = []
    with Writer(buf) as wr:
        refs = {}
        for name, lay, word in (("bfloat16", layouts.BF16, 2), ("float16", layouts.FP16, 2),
                                ("float32", layouts.FP32, 4)):
            for w in range(1, 8):
                fields = lay.fields
                planes = [RNG.integers(0, 2, n, dtype=np.uint8)]
                for f in fields[1:]:
                    planes.append(RNG.integers(0, 1 << min(w, f.bits), n, dtype=np.uint8))
                raw = lay.merge(planes, n * word, word)
                coded = [CodedPlane(fields[0].kind, 0, codecs.BITPACK, n,
                                    np.packbits(planes[0], bitorder="little"))]
                for f, p in zip(fields[1:], planes[1:]):
                    enc = BW.encode(p)
                    coded.append(CodedPlane(f.kind, f.index, codecs.BITPACK_W, n,
                                            np.asarray(enc.payload), enc.params))
                key = f"{name}.w{w}"
                refs[key] = wr.add_coded(key, dtypes.BY_NAME[name], (n,),
                                         CodedTensor(lay, tuple(coded)),
                                         hashing.content_hash(raw))
                raws.append(raw)
        wr.set_tree(refs)
    return buf.getvalue(), raws


@pytest.mark.parametrize("n", [1001, 3 * (1 << 20) + 5])
def test_bitpack_w_files_decode_on_the_gpu_as_on_the_cpu(n: int) -> None:
    blob, raws = _file(n)
    r = s4format.Reader(blob)
    idx = list(range(len(r.tensors)))
    assert all(decode.decodable(r, i) for i in idx)
    outs = [torch.empty(x.size, dtype=torch.uint8, device="cuda") for x in raws]
    decode.read_tensors(r, idx, outs)
    for i, (o, x) in enumerate(zip(outs, raws)):
        assert np.array_equal(o.cpu().numpy(), x), r.tensors[i].name
        assert np.array_equal(r.read_raw(i), x)
    if n > 1 << 20:  # in chunks: each chunk reads its packed bytes in place
        for i, x in enumerate(raws):
            assert decode_large.chunkable(r, i)
            out = torch.full((x.size,), 0xAB, dtype=torch.uint8, device="cuda")
            decode_large.load_large(r, i, out, 6 << 20)
            assert np.array_equal(out.cpu().numpy(), x), r.tensors[i].name


def test_gpu_writer_bitpack_w_planes_decode_on_the_cpu() -> None:
    g = torch.Generator().manual_seed(5)
    state = {"bf16": (torch.randn(1 << 20, generator=g) * 0.02).bfloat16().cuda(),
             "fp32": (torch.randn(1 << 20, generator=g) * 0.02).cuda(),
             "fp16": (torch.randn(1 << 20, generator=g) * 0.02).half().cuda()}
    for workspace in (None, 1 << 20):  # one group; chunked (each tensor over the workspace)
        buf = io.BytesIO()
        s4weights.save(state, buf, device="cuda", workspace=workspace)
        r = s4format.Reader(buf.getvalue())
        used = {p.codec for t in r.tensors for p in t.planes}
        assert codecs.BITPACK_W in used, workspace
        for i, t in enumerate(r.tensors):
            assert np.array_equal(r.read_raw(i), state[t.name].cpu().view(torch.uint8)
                                  .numpy().reshape(-1)), (t.name, workspace)
        back = s4weights.load(io.BytesIO(buf.getvalue()), map_location="cuda")
        for k, v in state.items():
            assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
