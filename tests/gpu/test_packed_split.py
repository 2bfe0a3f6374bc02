"""The split storing narrow mantissa planes packed (bitpack-w at the field's width: 7 bits in
bf16 and fp32, 2 in fp16), on the host with the kernels emulated (tests/gpu/emulated.py): every
form such a plane can end in comes out byte for byte as the encoder without packing writes it,
and reads back exactly on the CPU reader. A group split before its codecs are known packs
every narrow plane and then copies it (bitpack-w at full width), repacks it (narrower, or to
bytes), lets the rANS kernel read it packed (a skewed plane) or drops it (CONST); a group
split after a histogram pass packs only the planes sure to be stored at full width. The GPU
tests (test_gpu_codec.py and the rest) run the same paths on the H200."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import s4format
from s4format import codecs, hashing, layouts
from s4weights.gpu import encode, histograms
from s4weights.gpu.planes import (
    FORM_BITPACK_W,
    FORM_RAW,
    kept_as_split,
    narrow,
    pack_widths,
    stays_raw,
)
from tests.gpu.emulated import Device, emulate

N = 150_000
RNG = np.random.default_rng(2026)


@pytest.fixture
def emulated(monkeypatch):
    emulate(monkeypatch)


def _with_mantissa(dt: torch.dtype, mant: np.ndarray) -> torch.Tensor:
    """Normal-ish values of ``dt`` whose narrow mantissa field is ``mant``."""
    x = torch.from_numpy((RNG.standard_normal(mant.size) * 0.02).astype(np.float32)).to(dt)
    if dt == torch.float32:
        w = x.view(torch.int32).numpy().astype(np.uint32)
        w = (w & ~np.uint32(0x7F << 16)) | (mant.astype(np.uint32) << 16)
        return torch.from_numpy(w.view(np.int32)).view(torch.float32)
    w = x.view(torch.int16).numpy().view(np.uint16)
    if dt == torch.bfloat16:
        w = (w & ~np.uint16(0x7F)) | mant.astype(np.uint16)
    else:
        w = (w & ~np.uint16(0x3 << 8)) | (mant.astype(np.uint16) << 8)
    return torch.from_numpy(w.view(np.int16)).view(dt)


def _tensors() -> dict[str, torch.Tensor]:
    out = {}
    for dt, bits in ((torch.bfloat16, 7), (torch.float32, 7), (torch.float16, 2)):
        name = str(dt).removeprefix("torch.")
        top = 1 << bits
        out[f"{name}.full"] = _with_mantissa(dt, RNG.integers(0, top, N))
        out[f"{name}.narrower"] = _with_mantissa(dt, RNG.integers(0, top // 2, N))
        out[f"{name}.skewed"] = _with_mantissa(dt, RNG.geometric(0.35, N) % top)
        out[f"{name}.const"] = _with_mantissa(dt, np.full(N, top - 1))
        out[f"{name}.odd"] = _with_mantissa(dt, RNG.integers(0, top, 8 * 1037 + 5))  # a partial
        # last group and warp
    return out


def _items(tensors) -> list[encode.Item]:
    return [encode.Item.of(t) for t in tensors]


def _narrow_plane(reader: s4format.Reader, i: int):
    return next(p for p in reader.tensors[i].planes if p.kind == layouts.KIND_MANTISSA
                and p.index == 0)


@pytest.mark.parametrize("workspace", [1 << 30, 3 << 20])
def test_packed_planes_give_the_bytes_of_the_unpacked_split(emulated, workspace) -> None:
    tensors = _tensors()
    packed = encode.Encoder("auto", workspace=workspace)
    plain = encode.Encoder("auto", workspace=workspace)
    plain.packs = False
    assert packed.packs
    blob = encode.file_of(packed, tensors)
    assert blob == encode.file_of(plain, tensors)
    reader = s4format.Reader(blob)
    for i, t in enumerate(tensors.values()):
        assert reader.read_raw(i).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    # every form a packed plane can end in is there
    got = {name: (_narrow_plane(reader, i).codec, bytes(_narrow_plane(reader, i).params))
           for i, name in enumerate(tensors)}
    for name, bits in (("bfloat16", 7), ("float32", 7), ("float16", 2)):
        assert got[f"{name}.full"] == (codecs.BITPACK_W, bytes([bits]))
        assert got[f"{name}.narrower"] == (codecs.BITPACK_W, bytes([bits - 1]))
        assert got[f"{name}.const"][0] == codecs.RANS
        if bits == 7:  # (two bits: rANS never saves 1/65 of bitpack-w there)
            assert got[f"{name}.skewed"][0] == codecs.RANS


def test_a_group_split_before_its_codecs_packs_every_narrow_plane(emulated) -> None:
    tensors = _tensors()
    items = _items(tensors.values())
    enc = encode.Encoder("auto", workspace=1 << 30)
    (g,) = enc.encode_device(items)
    pl = g.planes
    rows = narrow(pl)
    assert rows.sum() == len(items)
    assert (pl.pw[rows] == pl.bits[rows]).all()
    assert (pl.pw[pl.kind == layouts.KIND_SIGN] == 1).all()
    # the copies: narrow planes stored at full width; the rest repacked, rANS-coded or CONST
    full = rows & (pl.form == FORM_BITPACK_W) & (pl.width == pl.bits)
    assert full.sum() == 6
    assert (rows & (pl.form == FORM_BITPACK_W) & (pl.width < pl.bits)).sum() == 3
    # the full-width planes stay where the split put them: the image's second part
    # (runs of kept planes: the planes between them took other forms)
    assert g.fixed is not None and 0 < g.head < g.total
    assert [at for at, _ in g.parts] == sorted(at for at, _ in g.parts)
    assert (pl.offset[full] >= g.head).all()
    assert (pl.offset[pl.offset >= 0][~full[pl.offset >= 0]] < g.head).all()
    # the image holds no plane that took another form: only the kept planes' bytes and
    # alignment padding follow the buffer's
    kept = int(sum(p.numel() for _at, p in g.parts))
    assert kept < int(pl.size[full].sum()) + 256 * len(items)
    for q in np.flatnonzero(full).tolist():
        part = g.payload(int(pl.offset[q]), int(pl.size[q]))
        assert part.numel() == int(pl.size[q])


def test_planes_that_took_other_forms_stay_out_of_the_image(emulated) -> None:
    # one plane kept where the split put it, seven repacked narrower: the image is the size of
    # the unpacked split's, not that plus seven dead packed planes
    tensors = {"full": _with_mantissa(torch.bfloat16, RNG.integers(0, 128, 1 << 18))}
    for i in range(7):
        tensors[f"narrow{i}"] = _with_mantissa(torch.bfloat16, RNG.integers(0, 64, 1 << 18))
    items = _items(tensors.values())
    plain = encode.Encoder("auto", workspace=1 << 30)
    plain.packs = False
    (g,) = encode.Encoder("auto", workspace=1 << 30).encode_device(items)
    (h,) = plain.encode_device(items)
    assert len(g.parts) == 1 and g.head > 0
    assert h.total <= g.total <= h.total + 2 * 256
    assert g.device_bytes > g.total  # (the dead planes stay allocated until the copy is done)
    for q in range(len(g.planes)):
        if g.planes.offset[q] >= 0:
            got = g.payload(int(g.planes.offset[q]), int(g.planes.size[q]))
            want = h.payload(int(h.planes.offset[q]), int(h.planes.size[q]))
            assert torch.equal(got, want), q


def test_a_group_whose_packed_planes_all_take_other_forms_has_one_part(emulated) -> None:
    tensors = {k: v for k, v in _tensors().items() if not k.endswith((".full", ".odd"))}
    (g,) = encode.Encoder("auto", workspace=1 << 30).encode_device(
        _items(tensors.values()))
    assert g.fixed is None and g.head == -1 and not g.parts and g.planes.fixed is None
    assert g.total == g.buffer.numel()


def test_a_sized_group_packs_only_the_planes_stored_at_full_width(emulated) -> None:
    tensors = _tensors()
    items = _items(tensors.values())
    enc = encode.Encoder("auto", workspace=3 << 20)
    groups = enc.encode_device(items)
    assert len(groups) > 1
    raw_kept = 0
    for g in groups:
        pl = g.planes
        packed = narrow(pl) & (pl.pw < 8)
        assert (pl.form[packed] == FORM_BITPACK_W).all()
        assert (pl.width[packed] == pl.bits[packed]).all()
        # planes with no candidate codec are written there too, stored raw as they are
        stays = stays_raw(pl)
        assert not (packed & stays).any()
        assert (pl.form[stays] == FORM_RAW).all() and (pl.pw[stays] == 8).all()
        kept = packed | stays
        assert ((pl.fixed_off >= 0) == kept).all()
        assert (g.fixed is None) == (not kept.any())
        assert (pl.offset[kept] >= g.head).all()
        assert len(g.parts) == (1 if kept.any() else 0)  # nothing but kept planes there
        raw_kept += int(stays.sum())
    assert sum(int((narrow(g.planes) & (g.planes.pw < 8)).sum()) for g in groups) == 6
    assert raw_kept  # the fp32 tensors' low mantissa bytes (uniform: no candidate)
    reader = s4format.Reader(encode.file_of(enc, tensors))
    for i, t in enumerate(tensors.values()):
        assert reader.read_raw(i).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_planes_stored_as_split_shrink_a_groups_need(emulated) -> None:
    """A sized group's planes with no candidate are stored where the split wrote them, so its
    need counts their bytes once: more tensors fit a group, within the workspace."""
    def low_uniform() -> torch.Tensor:  # fp32 whose two low bytes have no candidate codec
        w = (RNG.standard_normal(N) * 0.02).astype(np.float32).view(np.uint32)
        w = (w & np.uint32(0xFFFF0000)) | RNG.integers(0, 1 << 16, N).astype(np.uint32)
        return torch.from_numpy(w.view(np.float32))

    t = {f"w{k}": low_uniform() for k in range(12)}
    items = _items(t.values())
    workspace = 6 << 20
    counts = {}
    for keep in (True, False):
        enc = encode.Encoder("auto", workspace=workspace)
        enc.keep_raw = keep
        Device.live = Device.peak = 0
        groups = enc.encode_device(items)
        counts[keep] = len(groups)
        assert Device.peak <= workspace + sum(g.total for g in groups[:-1])
        if keep:
            for g in groups:  # the compacted buffer holds the other planes' payloads only
                assert g.buffer.numel() <= sum(it.nbytes for it in g.items) // 2
                assert int(stays_raw(g.planes).sum()) == 2 * len(g.items)
    assert counts[True] < counts[False], counts
    pl, _tables, _buf = histograms.window_planes(enc, items)
    width = pack_widths(pl)
    nbytes = np.array([it.nbytes for it in items], np.int64)
    args = (pl.item, width, pl.kind != layouts.KIND_RAW, pl.n, pl.runs_rans, pl.cand_gd,
            nbytes, enc.log2_block)
    from s4weights.gpu import plan
    assert (plan.group_need(*args) - plan.group_need(*args, stays_raw(pl))
            == 2 * N).all()


@pytest.mark.parametrize("case", ["fp16, mantissa raw", "fp32 random bits"])
def test_kept_planes_of_a_tensor_the_cpu_codes_stay_within_the_workspace(emulated, case) -> None:
    """A tensor whose planes would store more than its raw bytes is copied raw for the CPU
    coder while its kept planes stay where the split wrote them: its group's need counts
    both (found by a review: 4.9 and 13.4 MB over a 24 MiB workspace before)."""
    g = torch.Generator().manual_seed(0)
    if case.startswith("fp16"):
        tensors = [(torch.randn(600_000, generator=g) * 0.02).half() for _ in range(8)]
        enc = encode.Encoder("auto", mantissa="raw", workspace=24 << 20)
    else:  # n % 8 != 0: the packed sign plane's last byte tips the planes over the raw bytes
        tensors = [torch.randint(-2**31, 2**31, (600_001,), dtype=torch.int64, generator=g)
                   .to(torch.int32).view(torch.float32) for _ in range(8)]
        enc = encode.Encoder("auto", workspace=24 << 20)
    Device.live = Device.peak = 0
    coded = list(enc.code(_items(tensors)))
    assert Device.peak <= 24 << 20, Device.peak
    groups = enc.encode_device(_items(tensors))
    assert sum(len(gr.cpu) for gr in groups) == len(tensors)  # every one coded by the CPU
    assert any(kept_as_split(gr.planes, pack_widths(gr.planes)).any()
               for gr in groups)
    for c, t in zip(coded, tensors):
        assert c.content_hash == hashing.content_hash(t.reshape(-1).view(torch.uint8)
                                                      .numpy().tobytes())


@pytest.mark.parametrize("pol,mantissa", [("auto-1.0", "auto"), ("auto", "rans"),
                                          ("seed", "auto")])
def test_other_policies_split_to_bytes(emulated, pol, mantissa) -> None:
    enc = encode.Encoder(pol, mantissa=mantissa, workspace=1 << 30)
    assert not enc.packs
    tensors = _tensors()
    (g,) = enc.encode_device(_items(tensors.values()))
    assert (g.planes.pw[g.planes.kind != layouts.KIND_SIGN] == 8).all()
    reader = s4format.Reader(encode.file_of(enc, tensors))
    for i, t in enumerate(tensors.values()):
        assert reader.read_raw(i).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()
