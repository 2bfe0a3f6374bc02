"""The host side of flat buffers on the GPU path (``s4weights.gpu.segments``), without CUDA:
where it cuts, and how segments' coded planes stitch into one plane that decodes to their
concatenation (codec 9 from rANS and raw segments, bitpack-w repacked at the widest width, a
host recoding otherwise)."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import s4format  # noqa: E402
from s4format import codecs, dtypes, hashing, layouts, policy  # noqa: E402
from s4format.codecs import ransseg  # noqa: E402
from s4format.codecs.view import UNIT  # noqa: E402
from s4format.writer import CodedPlane, CodedTensor, Writer, code_tensor  # noqa: E402
from s4weights.gpu import segments  # noqa: E402
from s4weights.gpu.items import Coded, Item  # noqa: E402
from tests.gpu.emulated import emulate  # noqa: E402

BF16 = dtypes.by_name("bfloat16")


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    emulate(monkeypatch)  # (the unit histograms are the split kernel's, emulated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unit_histograms_count_each_field_per_unit(dtype) -> None:
    from s4weights.gpu import plan

    n = 3 * UNIT + 1001  # a short last unit
    x = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    it = Item.of(x)
    lay = plan.gpu_layout(it.dtype.name, it.nbytes)
    got = segments.unit_histograms(it, lay)
    w = x.element_size()
    planes = lay.split(x.view(torch.uint8).numpy().copy(), w)
    assert got.shape == (4, len(planes), 256)
    for u in range(4):
        for f, p in enumerate(planes):
            want = np.bincount(p[u * UNIT:(u + 1) * UNIT], minlength=256)
            assert np.array_equal(got[u, f], want), (u, f)


def _flat() -> torch.Tensor:
    """Runs of whole units (a run that straddles a cut takes zstd on the CPU coder, which the
    GPU coder never makes; aligned, the CPU's segments code as the GPU's would)."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(5 * UNIT, generator=g) * 0.02, torch.ones(2 * UNIT),
             torch.randn(4 * UNIT, generator=g) * 1e-4, torch.randn(3 * UNIT + 123, generator=g)]
    return torch.cat(parts).to(torch.bfloat16)


def _round_trip(coded: CodedTensor, raw: np.ndarray, shape: tuple[int, ...]) -> None:
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.set_tree({"x": w.add_coded("x", BF16, shape, coded, hashing.content_hash(raw))})
    with s4format.Reader(buf.getvalue()) as r:
        assert r.read_raw(0).tobytes() == raw.tobytes()


def test_off_unless_asked(monkeypatch) -> None:
    it = Item.of(_flat())
    monkeypatch.setattr(segments, "MIN_BYTES", 0)
    monkeypatch.setattr(segments, "ENABLED", False)
    assert not segments.eligible(it, "auto")
    monkeypatch.setattr(segments, "ENABLED", True)
    assert segments.eligible(it, "auto")
    assert not segments.eligible(it, "auto-1.0") and not segments.eligible(it, "seed")


def test_cut_segments_stitch_to_the_cpu_coders_file(monkeypatch) -> None:
    t = _flat()
    it = Item.of(t)
    starts = segments.cuts(it)
    assert starts is not None and starts[0] == 0 and (starts % UNIT == 0).all()
    assert 3 <= starts.size <= 12
    raw = it.data.numpy()
    parts = [Coded(code_tensor(p.data.numpy(), p.dtype), b"") for p in segments.split(it, starts)]
    got = segments.stitch(it, parts, hashing.content_hash(raw), "auto")
    whole = code_tensor(raw, BF16)
    assert got.coded.planes[1].codec == whole.planes[1].codec == codecs.RANS_SEG  # exponents
    assert got.coded.stored <= 1.01 * whole.stored
    _round_trip(got.coded, raw, tuple(t.shape))


def test_one_distribution_is_not_cut() -> None:
    t = (torch.randn(900_000, generator=torch.Generator().manual_seed(4)) * 0.02)
    assert segments.cuts(Item.of(t.to(torch.bfloat16))) is None


def _plane(codec: int, plane: np.ndarray, kind: int = layouts.KIND_MANTISSA) -> CodedPlane:
    enc = codecs.get(codec).encode(plane)
    return CodedPlane(kind, 0, codec, plane.size, np.asarray(enc.payload, np.uint8)
                      if not isinstance(enc.payload, bytes) else enc.payload, enc.params)


def _stitched(parts: list[CodedPlane]) -> tuple[CodedPlane, np.ndarray]:
    got = segments._stitch_plane(parts, "auto")
    out = codecs.get(got.codec).decode(ransseg.as_bytes(got.payload), got.decoded_len,
                                       got.params)
    return got, out


def test_segments_of_different_codecs_make_codec_9_keeping_theirs() -> None:
    rng = np.random.default_rng(5)
    a = rng.integers(100, 104, UNIT, dtype=np.uint8)
    b = rng.integers(0, 256, 2 * UNIT, dtype=np.uint8)
    c = rng.integers(0, 128, UNIT, dtype=np.uint8)
    d = np.full(1000, 5, np.uint8)
    parts = [_plane(codecs.RANS, a), _plane(codecs.RAW, b), _plane(codecs.BITPACK_W, c),
             _plane(codecs.RANS, d)]
    got, out = _stitched(parts)
    assert got.codec == codecs.RANS_SEG
    assert got.stored_len == 4 + 24 * 4 + sum(p.stored_len for p in parts)
    assert out.tobytes() == a.tobytes() + b.tobytes() + c.tobytes() + d.tobytes()


@pytest.mark.parametrize("codec", [codecs.RAW, codecs.BITPACK_W])
def test_segments_alike_concatenate_into_the_planes_own_codec(codec: int) -> None:
    rng = np.random.default_rng(6)
    a = rng.integers(0, 128, 2 * UNIT, dtype=np.uint8)
    b = rng.integers(0, 128, 777, dtype=np.uint8)
    got, out = _stitched([_plane(codec, a), _plane(codec, b)])
    whole = np.concatenate([a, b])
    assert (got.codec, got.params) == (codec, codecs.get(codec).encode(whole).params)
    assert ransseg.as_bytes(got.payload).tobytes() == \
        as_bytes(codecs.get(codec).encode(whole).payload)
    assert out.tobytes() == whole.tobytes()


def test_bitpack_w_of_two_widths_stays_in_segments() -> None:
    rng = np.random.default_rng(7)
    a = rng.integers(0, 128, UNIT, dtype=np.uint8)
    b = rng.integers(0, 32, 900, dtype=np.uint8)
    got, out = _stitched([_plane(codecs.BITPACK_W, a), _plane(codecs.BITPACK_W, b)])
    assert got.codec == codecs.RANS_SEG
    assert out.tobytes() == a.tobytes() + b.tobytes()


def test_a_segment_in_another_codec_is_recoded_on_the_host() -> None:
    rng = np.random.default_rng(8)
    a = rng.integers(0, 128, UNIT, dtype=np.uint8)
    b = np.tile(np.arange(200, dtype=np.uint8), 500)
    got, out = _stitched([_plane(codecs.BITPACK_W, a), _plane(codecs.ZSTD, b)])
    whole = np.concatenate([a, b])
    assert got.codec == policy.encode_plane(whole, layouts.KIND_MANTISSA)[0]
    assert out.tobytes() == a.tobytes() + b.tobytes()


def as_bytes(payload) -> bytes:
    return ransseg.as_bytes(payload).tobytes()


def test_segments_of_other_layouts_are_coded_on_the_host() -> None:
    t = _flat()
    it = Item.of(t)
    raw = it.data.numpy()
    half = 6 * UNIT * 2  # bytes: six units of bf16
    split = code_tensor(raw[:half], BF16)
    one = CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, codecs.RAW, raw.size - half,
                                               raw[half:].copy()),))
    got = segments.stitch(it, [Coded(split, b""), Coded(one, b"")], b"h" * 16, "auto")
    assert got.coded.stored == code_tensor(raw, BF16).stored
    _round_trip(got.coded, raw, tuple(t.shape))


def test_only_tensors_whose_coarse_blocks_differ_are_examined_unit_by_unit(monkeypatch) -> None:
    monkeypatch.setattr(segments, "MIN_BYTES", 0)
    monkeypatch.setattr(segments, "ENABLED", True)
    examined = []
    real = segments.cuts
    monkeypatch.setattr(segments, "cuts", lambda it: (examined.append(it), real(it))[1])
    g = torch.Generator().manual_seed(9)
    one = (torch.randn(40 * UNIT, generator=g) * 0.02).to(torch.bfloat16)
    flat = _flat()
    small = torch.ones(1000, dtype=torch.bfloat16)  # (below the split: not eligible)
    items = [Item.of(one), Item.of(flat), Item.of(small), Item.of(one.float())]
    got = segments.cuts_of(items, "auto")
    assert [e is items[1] for e in examined] == [True]
    assert got[0] is None and got[2] is None and got[3] is None
    assert np.array_equal(got[1], segments.cuts(items[1]))
    assert segments.cuts_of(items, "seed") == [None] * 4


def test_a_tensor_of_any_size_may_be_cut(monkeypatch) -> None:
    # the GPU decoder decodes codec 9 in chunks: a tensor larger than the device's memory
    # would allow to decode whole is cut as any other
    from s4weights.gpu import segments as seg

    monkeypatch.setattr(seg, "MIN_BYTES", 0)
    monkeypatch.setattr(seg, "ENABLED", True)
    it = Item.of(_flat())
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *_a: type("P", (), {"total_memory": it.nbytes})())
    assert seg.eligible(it, "auto")
