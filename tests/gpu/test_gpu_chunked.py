"""Tensors larger than the workspace are coded in chunks (``s4weights.gpu.encode_large``): the
stored planes equal the one-group path's byte for byte, the extra device memory stays under the
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
from s4weights.gpu import decode_large, encode_large  # noqa: E402
from s4weights.gpu.encode import Encoder, Item  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20
SLACK = 4 * MIB
BIG = 1 << 34  # a workspace that takes any tensor here in one group


def _peak(fn, *args, **kwargs):
    """(fn's result, the most device memory allocated during the call beyond what was
    allocated before it)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def _item(t: torch.Tensor) -> Item:
    return Item(dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape),
                t.reshape(-1).view(torch.uint8))


def _code1(enc: Encoder, t: torch.Tensor):
    (out,) = enc.code([_item(t)])
    return out


def _with_damage(planes: list, k: int, at: int) -> None:
    """Plane k's stored byte ``at`` (negative: from the end) flipped; its checksum is made for
    the damaged bytes (only decoding can find the damage)."""
    bad = np.array(planes[k].payload, copy=True)
    bad[at] ^= 0x5A
    planes[k] = type(planes[k])(planes[k].kind, planes[k].index, planes[k].codec,
                                planes[k].decoded_len, bad, planes[k].params, None)


def _one_tensor_file(t: torch.Tensor, coded, planes: list) -> bytes:
    """A file holding ``t`` as ``planes`` (``coded``'s layout and content hash)."""
    buf = io.BytesIO()
    w = s4format.Writer(buf)
    ref = w.add_coded("t", dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape),
                      type(coded.coded)(coded.coded.layout, tuple(planes)), coded.content_hash)
    w.set_tree({"t": ref})
    w.close()
    return buf.getvalue()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3)
    n = 5 * MIB + 12345  # not a whole number of chunks
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


@pytest.mark.parametrize("workspace", [10 * MIB, 2 * MIB])
@pytest.mark.parametrize("name", list(_tensors()))
def test_chunked_planes_equal_the_one_group_path(name: str, workspace: int) -> None:
    t = _tensors()[name]
    whole = _code1(Encoder(workspace=BIG), t)
    # 10 MiB: below what each needs as a group (by its exact need where not by its least; at
    # 12 MiB the one-symbol tensor was coded whole); 2 MiB: chunks of a few 2^16 elements
    enc = Encoder(workspace=workspace)
    assert isinstance(next(enc._plan([_item(t)], chunked=True)), Item)  # really chunked
    part = _code1(enc, t)
    assert part.content_hash == whole.content_hash
    _same(part.coded, whole.coded)


def test_a_chunk_that_outgrows_its_slot_is_coded_again_with_wider_slots(monkeypatch) -> None:
    # The first 2^20 exponents are spread over 256 values, the other ~10M take two: the whole
    # plane's table makes the spread ones rare (~13 bits each), so a chunk of them codes to
    # more than a byte per symbol (its slot in host memory; rans_place leaves out what would
    # not fit) while the plane codes to far less than its raw size. The pass runs again with
    # slots of two bytes per symbol and stores what the one-group path stores.
    from s4weights.gpu import segments

    monkeypatch.setattr(segments, "ENABLED", False)  # (two distributions: else cut in two)
    g = torch.Generator(device="cuda").manual_seed(12)
    n = 11 * MIB + 99
    e = torch.full((n,), 120, dtype=torch.int32, device="cuda")
    e += torch.randint(0, 2, (n,), generator=g, dtype=torch.int32, device="cuda")
    e[:MIB] = torch.randint(0, 256, (MIB,), generator=g, dtype=torch.int32, device="cuda")
    m = torch.randint(0, 128, (n,), generator=g, dtype=torch.int32, device="cuda")
    t = ((e << 7) | m).to(torch.int16).view(torch.bfloat16)
    whole = _code1(Encoder(workspace=BIG), t)
    passes = []
    spy = encode_large._code_chunks

    def counted(enc, ch, st, width, tables):
        ok = spy(enc, ch, st, width, tables)
        passes.append((st.slot, ch.chunk, ok))
        return ok

    monkeypatch.setattr(encode_large, "_code_chunks", counted)
    part = _code1(Encoder(workspace=4 * MIB), t)
    assert [(s, ok) for s, _c, ok in passes] == [(1, False), (2, True)], passes
    assert passes[0][1] <= MIB
    assert part.content_hash == whole.content_hash
    _same(part.coded, whole.coded)


def test_chunked_coding_stays_within_the_workspace_and_round_trips() -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {"emb": torch.randn(40 * MIB, device="cuda", generator=g) * 0.02,  # 160 MiB
             "head": (torch.randn(48 * MIB, device="cuda", generator=g) * 0.02).bfloat16(),
             "ids": torch.arange(12 * MIB, device="cuda"),                   # 96 MiB int64
             "norm": torch.ones(4096, device="cuda")}
    for workspace in (32 * MIB, 64 * MIB):
        buf = io.BytesIO()
        _, extra = _peak(s4weights.save, state, buf, device="cuda", workspace=workspace)
        assert extra <= workspace + SLACK, (workspace / MIB, extra / MIB)
        for dev in ("cpu", "cuda"):
            got = s4weights.load(buf.getvalue(), map_location="cuda", device=dev)
            for k, v in state.items():
                assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), (k, dev)


def test_a_stream_that_reaches_its_raw_size_is_stored_raw(monkeypatch) -> None:
    t = (torch.randn(3 * MIB, device="cuda") * 0.02).bfloat16()
    whole = _code1(Encoder(workspace=BIG), t).coded
    rans_sizes = {(p.kind, p.index): p.stored_len for p in whole.planes
                  if p.codec == codecs.RANS}
    assert rans_sizes
    # a stream must now stay under half the plane: the larger ones fall back to raw
    monkeypatch.setattr(encode_large, "_room", lambda n: n // 2)
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


def test_large_delta_is_xored_in_chunks(tmp_path) -> None:
    # (the parent, kept in host memory by the chain, is copied in chunk by chunk)
    g = torch.Generator(device="cuda").manual_seed(9)
    w0 = torch.randn(24 * MIB, device="cuda", generator=g) * 0.02      # 96 MiB
    w1 = w0 + torch.randn(24 * MIB, device="cuda", generator=g) * 1e-4
    root = str(tmp_path / "run")
    s4weights.save_checkpoint({"w": w0}, root, 0, device="cuda", workspace=48 * MIB)
    info, extra = _peak(s4weights.save_checkpoint, {"w": w1}, root, 1, device="cuda",
                        workspace=48 * MIB)
    assert extra <= 48 * MIB + SLACK, extra / MIB
    assert info.parent_step == 0 and info.stored_bytes < info.full_stored_bytes
    for dev in ("cpu", "cuda"):
        got = s4weights.load_checkpoint(root, map_location="cuda", device=dev)
        assert torch.equal(got["w"].view(torch.uint8), w1.view(torch.uint8)), dev


# -- load: tensors whose one-batch decode exceeds the workspace are decoded in chunks ----------

def _load_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(11)
    n = 10 * MIB + 4097  # a partial last chunk
    w = torch.randn(n, device="cuda", generator=g) * 0.02
    signs = torch.where(torch.rand(n, device="cuda", generator=g) < 0.02, -1.0, 1.0)
    blocks = torch.arange(n, device="cuda") // 65536
    return {
        "bf16": w.bfloat16(),
        "fp16": w.half(),
        "fp32": w,
        "skewed-sign": (w.abs() * signs).bfloat16(),     # sign plane coded with rANS
        "adam-v": (w * w) * 1e-3,                        # sign plane one symbol: CONST
        "per-block": (blocks.float() * 0.125).bfloat16(),
        "zeros": torch.zeros(n, device="cuda"),
        "u8": torch.randint(0, 4, (4 * n,), device="cuda", generator=g, dtype=torch.uint8),
        "small": torch.ones(100, device="cuda"),
    }


@pytest.mark.parametrize("workspace", [20 * MIB, 3 * MIB])
@pytest.mark.parametrize("writer", ["cuda", "cpu"])
def test_large_tensors_load_in_chunks_within_the_workspace(writer: str, workspace: int,
                                                           monkeypatch) -> None:
    state = _load_state()
    src = state if writer == "cuda" else {k: v.cpu() for k, v in state.items()}
    buf = io.BytesIO()
    s4weights.save(src, buf, device=writer)
    blob = buf.getvalue()
    r = s4format.Reader(blob)
    assert sum(decode_large.chunkable(r, i) for i in range(len(r.tensors))) >= 6
    # under every split tensor's one-batch need (bf16 with a bitpack-w mantissa read in place:
    # about 23 MiB); 3 MiB: chunks of a few 2^16 elements
    calls = []
    orig = decode_large.load_large

    def spy(reader, i, out, ws):
        calls.append(i)
        return orig(reader, i, out, ws)

    monkeypatch.setattr(decode_large, "load_large", spy)
    got, extra = _peak(s4weights.load, blob, map_location="cuda", device="cuda",
                       workspace=workspace)
    extra -= sum(v.numel() * v.element_size() for v in state.values())  # the result
    assert extra <= workspace + SLACK, extra / MIB
    assert len(calls) >= 6
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_large_delta_chain_loads_in_chunks(tmp_path) -> None:
    g = torch.Generator(device="cuda").manual_seed(13)
    w = torch.randn(12 * MIB, device="cuda", generator=g) * 0.02
    root = str(tmp_path / "run")
    states = []
    for step in range(3):  # base, delta, delta of the delta
        w = w + torch.randn(12 * MIB, device="cuda", generator=g) * 1e-4
        states.append({"w": w.clone(), "b": w[:1 << 20].bfloat16()})
        s4weights.save_checkpoint(states[-1], root, step, device="cuda")
    from s4weights import chain as c

    c._PARENT_CACHE.clear()
    got, extra = _peak(s4weights.load_checkpoint, root, map_location="cuda", device="cuda",
                       workspace=32 * MIB)
    extra -= 50 * MIB  # the result
    assert extra <= 32 * MIB + SLACK, extra / MIB
    for k, v in states[-1].items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_damaged_large_tensor_is_refused_before_decoding() -> None:
    state = {"w": torch.randn(8 * MIB, device="cuda") * 0.02}
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    blob = bytearray(buf.getvalue())
    r = s4format.Reader(bytes(blob))
    p = max(r.tensors[0].planes, key=lambda p: p.stored_len)
    blob[p.offset + p.stored_len // 2] ^= 0x40
    with pytest.raises(s4format.ChecksumError):
        s4weights.load(bytes(blob), map_location="cuda", device="cuda", workspace=16 * MIB)


def test_corrupt_stream_with_valid_checksums_is_named_on_the_chunked_load() -> None:
    # a flipped word inside an exponent stream, written with a checksum of the damaged bytes:
    # only decoding can find it; the chunked decoder names the plane and the block
    t = (torch.randn(12 * MIB, device="cuda") * 0.02).bfloat16()
    coded = _code1(Encoder(), t)
    planes = list(coded.coded.planes)
    k = next(i for i, p in enumerate(planes) if p.codec == codecs.RANS and p.kind == 2)
    _with_damage(planes, k, -(len(planes[k].payload) // 3))
    with pytest.raises(s4format.CodecError, match="rans block"):
        s4weights.load(_one_tensor_file(t, coded, planes), map_location="cuda", device="cuda",
                       workspace=16 * MIB)


def test_planes_read_one_by_one_decode_the_same(monkeypatch) -> None:
    # a tensor whose planes lie far apart is not read as one span (a hostile file could make
    # that span the whole file): its planes are read one by one and its rANS streams checked
    # in one copy of them; the bytes must come out the same
    state = _load_state()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    blob = buf.getvalue()
    spans = []
    # (the chunked loader reads a compact span its own way, in parallel pieces: its bounds)
    for way in ("compact_span", "compact_bounds"):
        monkeypatch.setattr(s4format.Reader, way, lambda self, t: spans.append(t.name) and None)
    got = s4weights.load(blob, map_location="cuda", device="cuda", workspace=24 * MIB)
    assert len(spans) >= 6
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_an_empty_tensor_loads_under_any_workspace() -> None:
    state = {"empty": torch.empty(0, device="cuda"), "w": torch.randn(4096, device="cuda"),
             "e16": torch.empty(0, 3, device="cuda", dtype=torch.bfloat16)}
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    for ws in (1, 4096, None):
        got = s4weights.load(buf.getvalue(), map_location="cuda", device="cuda", workspace=ws)
        for k, v in state.items():
            assert got[k].shape == v.shape and torch.equal(got[k], v), (k, ws)


def test_a_group_of_only_empty_tensors_saves() -> None:
    # such a group has no leaves to hash: its digests come back as an empty buffer (alone in
    # a state, or after a tensor coded alone in chunks)
    for state in ({"e": torch.empty(0, device="cuda")},
                  {"big": torch.randn(2 * MIB, device="cuda").bfloat16(),
                   "e": torch.empty(0, 5, device="cuda")}):
        buf = io.BytesIO()
        s4weights.save(state, buf, device="cuda", workspace=MIB)
        got = s4weights.load(buf.getvalue(), map_location="cuda")
        for k, v in state.items():
            assert got[k].shape == v.shape and torch.equal(got[k], v), k


def test_chunked_load_reports_errors_in_the_cpu_readers_order() -> None:
    # a merge error in the first chunk (a raw mantissa byte with bit 7 set) and a damaged rANS
    # word in the last chunk's exponent blocks: the CPU reader decodes every plane before it
    # merges, so it reports the exponent; the chunked loader must too, not the first chunk's
    from s4format import layouts

    t = (torch.randn(12 * MIB, device="cuda") * 0.02).bfloat16()
    coded = _code1(Encoder(), t)
    planes = list(coded.coded.planes)
    raw = t.view(torch.uint8).cpu().numpy()
    mant = layouts.BF16.split(raw, 2)[2].copy()
    mant[5] |= 0x80
    km = next(i for i, p in enumerate(planes) if p.kind == layouts.KIND_MANTISSA)
    ke = next(i for i, p in enumerate(planes) if p.kind == layouts.KIND_EXPONENT)
    assert planes[ke].codec == codecs.RANS
    planes[km] = type(planes[km])(planes[km].kind, planes[km].index, codecs.RAW, mant.size,
                                  mant, b"", None)
    _with_damage(planes, ke, -200)
    blob = _one_tensor_file(t, coded, planes)
    with pytest.raises(s4format.CodecError, match="plane exponent"):
        s4format.Reader(blob).read_raw(0)
    with pytest.raises(s4format.CodecError, match="plane exponent: rans block"):
        s4weights.load(blob, map_location="cuda", device="cuda", workspace=16 * MIB)
