"""The CUDA path on a GPU: rANS streams byte-identical to the CPU coder, leaf digests equal to
xxhash, every bf16/fp16/fp32 bit pattern and adversarial float sets round-trip bit-exactly,
files cross between the GPU and CPU paths in both directions, poisoned outputs are fully
overwritten, corrupt planes are refused. Skipped without CUDA and CuPy."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format import codecs, hashing  # noqa: E402
from s4format.codecs.rans import RansCodec  # noqa: E402
from s4weights.gpu import decode, runtime  # noqa: E402
from s4weights.gpu.ransencode import rans_stream  # noqa: E402

pytestmark = pytest.mark.gpu
RNG = np.random.default_rng(2024)


def _planes() -> dict[str, np.ndarray]:
    x = torch.randn(3_000_001) * 0.02
    exponent = ((x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int32) >> 7) & 0xFF)
    block_const = np.repeat(RNG.integers(0, 256, 5, dtype=np.uint8), 1 << 16)
    out = {
        "uniform": RNG.integers(0, 256, 1 << 20, dtype=np.uint8),
        "skewed": exponent.astype(np.uint8),
        "const": np.full(200_000, 7, np.uint8),
        "block_const": block_const,
        "two_symbols": (RNG.random(100_000) < 0.01).astype(np.uint8),
        "uniform_split": RNG.integers(0, 256, 50_000, dtype=np.uint8),  # RAW, blocks of 2^14
        "empty": np.zeros(0, np.uint8),
    }
    for n in (1, 2, 31, 32, 33, 63, 64, 65, 65535, 65536, 65537, (1 << 20) + 3):
        out[f"len{n}"] = RNG.geometric(0.3, n).clip(0, 255).astype(np.uint8)
    return out


@pytest.mark.parametrize("log2_block", [16, 5, 8, 20])
def test_gpu_rans_bytes_equal_cpu_rans_bytes(log2_block: int) -> None:
    cpu = RansCodec(log2_block)
    for name, plane in _planes().items():
        want = np.frombuffer(cpu.encode(plane).payload, np.uint8)
        # (at the block size the CPU coder takes for the plane: 14 or 15 for some at 16)
        got = rans_stream(torch.from_numpy(plane).cuda(), cpu.block_log2(plane.size))
        assert got.tobytes() == want.tobytes(), (name, log2_block)


def test_leaf_digests_equal_xxhash() -> None:
    for n in (0, 1, 240, 241, 65536, 65537, 5 * 65536 + 77):
        data = RNG.integers(0, 256, n, dtype=np.uint8)
        dev = torch.from_numpy(data).cuda()
        digests, first = runtime.leaf_digests([dev.data_ptr(), dev.data_ptr() + 1],
                                              [n, max(n - 1, 0)])
        got = digests.cpu().numpy().view(np.uint64)
        for k, (off, m) in enumerate([(0, n), (1, max(n - 1, 0))]):
            part = data[off:off + m].tobytes()
            want = [hashing.xxhash.xxh3_64_intdigest(part[i:i + 65536])
                    for i in range(0, m, 65536)]
            assert got[first[k]:first[k + 1]].tolist() == want, (n, k)


def test_plane_checksums_and_content_hashes_equal_the_cpu_hashes() -> None:
    # root inputs of 8 (an empty plane) to 240 bytes (29 leaves: every short form of XXH3-64
    # and XXH3-128) and longer (the warp's long form), at aligned and odd addresses; the
    # launches queued in a batch while other buffers come and go before it runs (the batch
    # holds the digests' buffers)
    L = hashing.LEAF_SIZE
    sizes = [0, 1, 240, L - 1, L, L + 1, 5 * L + 3, 15 * L, 15 * L + 9, 29 * L, 29 * L + 1,
             30 * L + 5, 300 * L + 3]
    data = [RNG.integers(0, 256, n + 1, dtype=np.uint8) for n in sizes]
    devs = [torch.from_numpy(d).cuda() for d in data]
    ptrs = [d.data_ptr() + (k % 2) for k, d in enumerate(devs)]
    batch = runtime.Batch()
    sums = runtime.plane_checksums(ptrs, sizes, batch)
    roots = runtime.content_hashes(ptrs, sizes, batch)
    junk = [torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda")
            for n in [*[512 * k for k in range(1, 65)], *[1 << 20] * 8]]  # (small: freed blocks)
    keep = batch.run()
    got = sums.cpu().numpy().view(np.uint64).tolist()
    wide = roots.cpu().numpy().view(np.uint8)
    assert all(bool((j == 0xAB).all()) for j in junk)  # nothing wrote into a freed buffer
    del junk, keep
    parts = [d[k % 2:k % 2 + n].tobytes() for k, (d, n) in enumerate(zip(data, sizes))]
    assert got == [hashing.plane_checksum(p) for p in parts]
    assert [wide[16 * k:16 * (k + 1)].tobytes() for k in range(len(sizes))] == [
        hashing.content_hash(p) for p in parts]


def test_roots_of_long_digest_runs_equal_xxhash() -> None:
    # roots over up to 20,000 digests (160 KB: the CTA's long form over more than one round of
    # 128 blocks), fabricated digests: the root is XXH3 of u64 length || the digests
    counts = [20_000, 16_383, 0, 1, 29, 30, 128 * 128 + 7, 3]
    first = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    lengths = np.array([c * hashing.LEAF_SIZE - 5 * (c > 0) for c in counts], np.int64)
    dig = RNG.integers(0, 1 << 63, int(first[-1]) + len(counts), dtype=np.int64)
    for wide in (False, True):
        buf = torch.from_numpy(dig).cuda()
        batch = runtime.Batch()
        roots = runtime.roots_over(buf, lengths, first, batch, wide)
        keep = batch.run()
        got = roots.cpu().numpy().view(np.uint8).tobytes()
        del keep
        d = dig.view(np.uint64)
        for s in range(len(counts)):
            root = struct.pack("<Q", int(lengths[s])) + d[first[s] + s + 1:first[s + 1] + s + 1
                                                           ].astype("<u8").tobytes()
            if wide:
                assert got[16 * s:16 * (s + 1)] == hashing.xxhash.xxh3_128_digest(root), s
            else:
                assert np.frombuffer(got, np.uint64)[s] == hashing.xxhash.xxh3_64_intdigest(
                    root), s


def _roundtrip_gpu(state: dict, **save_kw) -> tuple[bytes, dict]:
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda", **save_kw)
    blob = buf.getvalue()
    return blob, s4weights.load(blob, map_location="cuda", device="cuda")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_round_trips(dtype: torch.dtype) -> None:
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).cuda()
    blob, got = _roundtrip_gpu({"x": x})
    assert _same(got["x"], x)
    on_cpu = s4weights.load(blob, device="cpu", map_location="cpu")["x"]
    assert _same(on_cpu.cuda(), x)


def test_every_fp32_pattern_round_trips() -> None:
    step = 1 << 30
    for start in range(0, 1 << 32, step):
        x = torch.arange(start, start + step, dtype=torch.int64, device="cuda")
        x = x.to(torch.int32) if start < (1 << 31) else (x - (1 << 32)).to(torch.int32)
        x = x.view(torch.float32)
        _blob, got = _roundtrip_gpu({"x": x})
        assert torch.equal(got["x"].view(torch.int32), x.view(torch.int32)), start
        del got, x, _blob
        torch.cuda.empty_cache()


def _adversarial(dtype: torch.dtype, n: int = 300_000) -> torch.Tensor:
    finfo_bits = {torch.float32: (32, torch.int32), torch.bfloat16: (16, torch.int16),
                  torch.float16: (16, torch.int16)}[dtype]
    bits, itype = finfo_bits
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    tiny = torch.finfo(dtype).tiny
    sub = torch.tensor([tiny / 2, -tiny / 4, tiny / 1024], dtype=torch.float64).to(dtype)
    raw = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n,), dtype=torch.int64)
    payload_nans = raw.to(itype).view(dtype)
    parts = [specials.repeat(1000), sub.repeat(1000), payload_nans, torch.randn(n).to(dtype)]
    return torch.cat(parts)[torch.randperm(sum(p.numel() for p in parts))].cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adversarial_floats_round_trip_both_ways(dtype: torch.dtype) -> None:
    state = {"a": _adversarial(dtype), "b": torch.randn(4097, device="cuda").to(dtype),
             "small": torch.randn(7, device="cuda").to(dtype),
             "ints": torch.arange(100_000, device="cuda"),
             "pos": torch.rand(200_000, device="cuda").to(dtype)}
    blob, got = _roundtrip_gpu(state)
    for k in state:
        assert _same(got[k], state[k]), k
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cpu")
    from_cpu = s4weights.load(buf.getvalue(), map_location="cuda", device="cuda")
    on_cpu = s4weights.load(blob, map_location="cpu", device="cpu")
    for k in state:
        assert _same(from_cpu[k], state[k]), k
        assert _same(on_cpu[k].cuda(), state[k]), k


def test_gpu_file_planes_equal_cpu_planes_for_the_same_codec() -> None:
    x = torch.randn(1 << 22, device="cuda") * 0.02
    state = {"bf16": x.to(torch.bfloat16), "fp32": x.clone(), "fp16": x.to(torch.float16),
             "pos": x.abs(), "const": torch.ones(1 << 16, device="cuda")}
    g, c = io.BytesIO(), io.BytesIO()
    s4weights.save(state, g, device="cuda")
    s4weights.save(state, c, device="cpu")
    rg, rc = s4format.Reader(g.getvalue()), s4format.Reader(c.getvalue())
    compared = 0
    for tg, tc in zip(rg.tensors, rc.tensors):
        assert tg.content_hash == tc.content_hash
        assert tg.layout.layout_id == tc.layout.layout_id, tg.name
        for k, (pg, pc) in enumerate(zip(tg.planes, tc.planes)):
            if pg.codec == pc.codec and pg.codec != codecs.GDEFLATE:
                assert rg.read_stored(tg, k).tobytes() == rc.read_stored(tc, k).tobytes()
                compared += 1
            if pg.kind in (1, 2):  # sign and exponent: the GPU makes the CPU's choice
                assert pg.codec == pc.codec, (tg.name, pg.label)
    assert compared >= 8


def test_planes_coded_in_scratch_sized_by_their_bound_equal_the_cpus() -> None:
    # groups sized by their exact need take each rANS plane's scratch from its words' bound
    # (ranshost.WORD_COST) and each block its own share: blocks of symbols rare in the plane
    # (every exponent, 12 bits each) next to blocks of common ones, skewed sign planes (read
    # as packed bits); the streams are the CPU's
    from s4weights.gpu import encode

    n = 1_500_000
    state = {}
    for k, dt in enumerate((torch.bfloat16, torch.float32)):
        x = (torch.randn(n, device="cuda") * 0.02).to(dt)
        bits = x.view(torch.int16 if dt == torch.bfloat16 else torch.int32)
        shift = 7 if dt == torch.bfloat16 else 23
        every = torch.arange(1 << 16, device="cuda") % 256  # all 256 exponents, in turn
        rare = slice((3 + k) << 16, (4 + k) << 16)
        bits[rare] = ((bits[rare] & ~(0xFF << shift)) | (every << shift)).to(bits.dtype)
        state[f"w{k}"] = x
        state[f"z{k}"] = torch.zeros(n, device="cuda", dtype=dt)  # a plane of one symbol
        state[f"z{k}"][-70_000:] = x[:70_000]  # ... but for its last blocks
        # 2% negative: a rANS-coded sign plane, which the kernel reads as packed bits
        neg = torch.rand(n, device="cuda") < 0.02
        state[f"s{k}"] = torch.where(neg, -x.abs(), x.abs())
    items = [encode.Item.of(t) for t in state.values()]
    enc = encode.Encoder("auto", workspace=16 << 20)
    assert any(pl is not None for _its, pl, _n, _f in enc._plan(items))  # groups were sized
    rg = s4format.Reader(encode.file_of(enc, state))
    coded = signs = 0
    for i, (tg, x) in enumerate(zip(rg.tensors, state.values())):
        raw = x.reshape(-1).view(torch.uint8).cpu().numpy()
        assert rg.read_raw(i).tobytes() == raw.tobytes()  # (the CPU reader checks every hash)
        assert decode.read_tensors(rg, [i])[0].cpu().numpy().tobytes() == raw.tobytes()
        planes = tg.layout.split(raw, tg.dtype.itemsize)
        for k, p in enumerate(tg.planes):
            if p.codec == codecs.RANS:  # the CPU coder's stream of the same plane
                want = RansCodec().encode(planes[k]).payload
                assert rg.read_stored(tg, k).tobytes() == bytes(want), (tg.name, p.label)
                coded += 1
                signs += p.kind == 1
    assert coded >= 6 and signs >= 2


@pytest.mark.parametrize("policy,mantissa", [("auto", "auto"), ("auto", "rans"),
                                             ("seed", "auto")])
def test_rans_jobs_picks_the_planes_the_host_rule_picks(policy: str, mantissa: str) -> None:
    """The rANS launch queued before the host reads the figures (``rans_jobs``' picks) codes
    the planes the host's rule picks: the same planes as the encoder that launches after
    (byte for byte but for GDeflate's, which nvCOMP's compressor does not make the same from
    one run to the next on the H200)."""
    from s4weights.gpu import encode
    from tests.gpu.test_rans_jobs import tensors

    ts = {k: t.cuda() for k, t in tensors().items()}
    early = encode.Encoder(policy, mantissa=mantissa)
    late = encode.Encoder(policy, mantissa=mantissa)
    late.early_rans = False
    blob = encode.file_of(early, ts)
    assert early.mispredicted == 0
    reader, other = s4format.Reader(blob), s4format.Reader(encode.file_of(late, ts))
    for t, u in zip(reader.tensors, other.tensors):
        assert [p.codec for p in t.planes] == [p.codec for p in u.planes], t.name
        for k, p in enumerate(t.planes):
            if p.codec != codecs.GDEFLATE:
                assert reader.read_stored(t, k).tobytes() == other.read_stored(u, k).tobytes()
    for i, t in enumerate(ts.values()):
        assert reader.read_raw(i).tobytes() == t.reshape(-1).view(torch.uint8).cpu().numpy(
            ).tobytes()


def test_decode_overwrites_every_byte_of_a_poisoned_destination() -> None:
    state = {"w": _adversarial(torch.bfloat16), "m": torch.randn(123_457, device="cuda")}
    blob, _ = _roundtrip_gpu(state)
    reader = s4format.Reader(blob)
    for i, t in enumerate(reader.tensors):
        out = torch.full((t.raw_nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
        decode.read_tensor(reader, i, out=out)
        want = state[t.name].reshape(-1).view(torch.uint8)
        assert torch.equal(out, want), t.name


def test_corrupt_stored_plane_is_refused_on_the_gpu() -> None:
    blob, _ = _roundtrip_gpu({"w": torch.randn(1 << 18, device="cuda")})
    reader = s4format.Reader(blob)
    p = reader.tensors[0].planes[1]
    bad = bytearray(blob)
    bad[p.offset + p.stored_len // 2] ^= 0x10
    with pytest.raises(s4format.ChecksumError):
        s4weights.load(bytes(bad), map_location="cuda", device="cuda")


def test_results_held_across_many_groups_stay_valid() -> None:
    from s4format import dtypes
    from s4format.objtree import TensorRef
    from s4format.writer import Writer
    from s4weights.gpu.encode import Encoder, Item

    xs = [torch.randn(300_000, device="cuda").to(torch.bfloat16) for _ in range(6)]
    items = [Item(dtypes.BY_NAME["bfloat16"], tuple(x.shape), x.view(torch.uint8)) for x in xs]
    coded = list(Encoder(workspace=4 << 20).code(items))  # one tensor per group
    buf = io.BytesIO()
    with Writer(buf) as w:
        for k, (it, c) in enumerate(zip(items, coded)):
            w.add_coded(f"x{k}", it.dtype, it.shape, c.coded, c.content_hash)
        w.set_tree([TensorRef(k) for k in range(len(xs))])
    got = s4format.Reader(buf.getvalue()).load()
    for x, t in zip(xs, got):
        assert t.data.tobytes() == x.view(torch.uint8).cpu().numpy().tobytes()


def test_a_misaligned_destination_is_filled_through_an_aligned_buffer() -> None:
    # the merge kernels store whole words (16-byte vectors where aligned): a destination at an
    # odd address (a slice of a larger buffer) must not reach them, or the device faults
    x = (torch.randn(1 << 16, device="cuda") * 0.02)
    state = {"bf16": x.bfloat16(), "fp32": x}
    blob, _ = _roundtrip_gpu(state)
    r = s4format.Reader(blob)
    for i, t in enumerate(r.tensors):
        for off in (1, 2, 3, 8):
            big = torch.full((t.raw_nbytes + 16,), 0xAB, dtype=torch.uint8, device="cuda")
            out = big[off:off + t.raw_nbytes]
            got = decode.read_tensors(r, [i], [out])[0]
            assert got.data_ptr() == out.data_ptr()
            want = state[t.name].reshape(-1).view(torch.uint8)
            assert torch.equal(out, want), (t.name, off)
            assert (big[:off] == 0xAB).all() and (big[off + t.raw_nbytes:] == 0xAB).all()


@pytest.mark.parametrize("workspace", [None, 1 << 18])  # batch, chunked
def test_streams_of_tiny_blocks_decode_on_the_cpu_without_huge_tables(workspace) -> None:
    # a CONST stream of 2^19 blocks in 512 KiB: the batch and chunked GPU loaders would build
    # ~80 MiB of block tables; the tensor goes to the CPU decoder instead
    from tests.gpu.test_parse_streams import _const_file

    blob = _const_file(1 << 24, 5)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = s4weights.load(blob, map_location="cuda", device="cuda", workspace=workspace)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - (1 << 24)
    assert got["z"].device.type == "cuda" and not got["z"].any()
    assert extra < 8 << 20, extra


def test_a_batch_reports_the_first_tensors_error_as_the_cpu_reader_does() -> None:
    # tensor "a" has a mantissa byte wider than its field (a merge error), the later "b" a
    # damaged exponent word (a rANS error); decoded in one batch, the error raised must be
    # a's, as reading in order on the CPU gives
    from s4format import dtypes, layouts
    from s4weights.gpu.encode import Encoder, Item

    ts = {k: (torch.randn(1 << 18, device="cuda") * 0.02).bfloat16() for k in ("a", "b")}
    coded = list(Encoder().code([Item(dtypes.BY_NAME["bfloat16"], tuple(t.shape),
                                      t.view(torch.uint8)) for t in ts.values()]))
    planes = {k: list(c.coded.planes) for k, c in zip(ts, coded)}
    pa = planes["a"]
    km = next(i for i, p in enumerate(pa) if p.kind == layouts.KIND_MANTISSA)
    mant = layouts.BF16.split(ts["a"].view(torch.uint8).cpu().numpy(), 2)[2].copy()
    mant[7] |= 0x80
    pa[km] = type(pa[km])(pa[km].kind, pa[km].index, codecs.RAW, mant.size, mant, b"", None)
    pb = planes["b"]
    ke = next(i for i, p in enumerate(pb) if p.kind == layouts.KIND_EXPONENT)
    bad = np.array(pb[ke].payload, copy=True)
    bad[bad.size - 100] ^= 0x5A
    pb[ke] = type(pb[ke])(pb[ke].kind, pb[ke].index, pb[ke].codec, pb[ke].decoded_len, bad,
                          pb[ke].params, None)
    buf = io.BytesIO()
    with s4format.Writer(buf) as w:
        refs = {k: w.add_coded(k, dtypes.BY_NAME["bfloat16"], tuple(ts[k].shape),
                               type(c.coded)(c.coded.layout, tuple(planes[k])), c.content_hash)
                for k, c in zip(ts, coded)}
        w.set_tree(refs)
    blob = buf.getvalue()
    with pytest.raises(s4format.FormatError, match="tensor 'a'"):
        s4weights.load(blob, map_location="cpu", device="cpu")
    r = s4format.Reader(blob)
    with pytest.raises(s4format.FormatError, match=r"tensor 'a': \w+ plane holds values wider "
                                                   r"than its \d+ bits$") as gpu:
        decode.read_tensors(r, [0, 1])
    with pytest.raises(s4format.FormatError) as cpu:
        s4format.Reader(blob).read_raw(r.index_of("a"))
    assert str(gpu.value) == str(cpu.value)  # the CPU reader's words


def _damaged_exponent_file(t: torch.Tensor, at: int) -> bytes:
    """A file of ``t`` (bf16) whose exponent stream has word ``at`` (from its end) changed under
    a checksum made for the damaged bytes: only the rANS decoder can find it."""
    from s4format import dtypes, layouts
    from s4weights.gpu.encode import Encoder, Item

    (c,) = Encoder().code([Item(dtypes.BY_NAME["bfloat16"], tuple(t.shape), t.view(torch.uint8))])
    planes = list(c.coded.planes)
    k = next(i for i, p in enumerate(planes) if p.kind == layouts.KIND_EXPONENT)
    assert planes[k].codec == codecs.RANS
    bad = np.array(planes[k].payload, copy=True)
    bad[bad.size - 2 * at:bad.size - 2 * at + 2] ^= np.uint8(0x5A)
    p = planes[k]
    planes[k] = type(p)(p.kind, p.index, p.codec, p.decoded_len, bad, p.params, None)
    buf = io.BytesIO()
    with s4format.Writer(buf) as w:
        w.set_tree({"w": w.add_coded("w", dtypes.BY_NAME["bfloat16"], tuple(t.shape),
                                     type(c.coded)(c.coded.layout, tuple(planes)),
                                     c.content_hash)})
    return buf.getvalue()


@pytest.mark.parametrize("warps", [0, 1 << 30], ids=["rans_decode", "rans_decode_ahead"])
def test_both_rans_decode_kernels_decode_exactly_and_find_damage(monkeypatch, warps) -> None:
    # kernels/rans.cu builds the decoder twice (each word loaded after its row's ballot, or 32
    # candidates loaded before the row decodes and taken by a shuffle); runtime.rans_decode_kernel
    # picks one by the launch's size: each must decode every block exactly (partial rows,
    # blocks of one word or none, many planes in one launch) and report a damaged stream
    monkeypatch.setattr(runtime, "RANS_AHEAD_WARPS_PER_SM", warps)
    want = "rans_decode_ahead" if warps else "rans_decode"
    assert runtime.rans_decode_kernel(1) == want
    g = torch.Generator(device="cuda").manual_seed(11)
    state = {f"n{n}": (torch.randn(n, device="cuda", generator=g) * 0.02).bfloat16()
             for n in (4097, 32769, 65537, 1 << 20, 3_000_001)}
    state["adv"] = _adversarial(torch.bfloat16)
    state["fp32"] = torch.randn(1 << 20, device="cuda", generator=g)
    state["narrow"] = torch.randint(0, 3, (1 << 19,), device="cuda", generator=g).bfloat16()
    _blob, got = _roundtrip_gpu(state)
    for k in state:
        assert _same(got[k], state[k]), k
    t = (torch.randn(1 << 18, device="cuda", generator=g) * 0.02).bfloat16()
    for at in (1, 40, 3000):
        blob = _damaged_exponent_file(t, at)
        with pytest.raises(s4format.FormatError, match="rans block"):
            s4weights.load(blob, map_location="cuda", device="cuda")
