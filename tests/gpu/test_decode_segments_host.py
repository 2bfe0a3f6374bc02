"""Codec-9 (``rans-seg``) planes on the GPU decoder, its host side without a GPU (device
buffers are CPU tensors, kernels emulated by tests/gpu/emulated.py): each segment is decoded
by the kernel of its codec into its range of the plane (rANS in RANS, CONST and RAW mode,
raw, bitpack, bitpack-w), for split and raw-layout tensors, bit-exact against the CPU reader;
damaged tables and segments fail as the CPU reader fails, naming the same tensor, plane and
segment; a hostile table of tiny CONST blocks is sent to the CPU decoder, not built for. The
GPU tests (test_gpu_segments) decode such files on the device for real."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format import codecs, dtypes, hashing, layouts, objtree
from s4format.codecs import rans, ransseg
from s4format.errors import CodecError
from s4format.writer import CodedPlane, CodedTensor, Writer
from s4weights.gpu import decode, decode_chunks, decode_large, segdecode
from tests.gpu.emulated import emulate
from tests.gpu.test_decode_host import _first_cpu_failure, _rewrite

UNIT = ransseg.SEGMENT_UNIT
N = 3 * UNIT + 1001  # three whole segments and a short last one


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    emulate(monkeypatch)


def _rans(plane: np.ndarray, mode: int = rans.MODE_RANS) -> np.ndarray:
    if mode == rans.MODE_RAW:
        return rans._raw_stream(plane, rans.LOG2_BLOCK_DEFAULT)
    if mode == rans.MODE_CONST:
        return rans._const_stream(plane, rans.LOG2_BLOCK_DEFAULT)
    return np.frombuffer(bytes(rans.RansCodec().encode(plane).payload), np.uint8)


def _segmented(plane: np.ndarray, forms: list[str], units: list[int] | None = None
               ) -> np.ndarray:
    """``plane`` cut into segments of ``units[i]`` UNITs (one each by default; the last
    takes the rest), segment i stored as ``forms[i]`` says."""
    parts = []
    cuts = np.cumsum([0] + [UNIT * u for u in (units or [1] * len(forms))])
    for i, form in enumerate(forms):
        seg = plane[cuts[i]:cuts[i + 1] if i < len(forms) - 1 else plane.size]
        if form == "raw":
            parts.append((seg.size, codecs.RAW, 0, seg.copy()))
        elif form == "bitpack":
            parts.append((seg.size, codecs.BITPACK, 0, np.packbits(seg, bitorder="little")))
        elif form.startswith("bitpack-w"):
            enc = codecs.get(codecs.BITPACK_W).encode(seg)
            parts.append((seg.size, codecs.BITPACK_W, enc.params[0], enc.payload))
        else:
            mode = {"rans": rans.MODE_RANS, "rans-const": rans.MODE_CONST,
                    "rans-raw": rans.MODE_RAW}[form]
            parts.append((seg.size, codecs.RANS, 0, _rans(seg, mode)))
    return ransseg.assemble(parts)


def _bf16(seed: int) -> np.ndarray:
    """A flat bf16 buffer: four parameters of different scales end to end, the third's
    mantissas 7-bit, the last constant."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(UNIT, generator=g) * 0.02, torch.randn(UNIT, generator=g) * 3,
                   torch.randn(UNIT, generator=g), torch.full((1001,), 0.5)]).bfloat16()
    return x.view(torch.uint8).numpy().copy()


def _split_planes(raw: np.ndarray, sign: list[str], exp: list[str], man: list[str]
                  ) -> list[CodedPlane]:
    s, e, m = layouts.BF16.split(raw, 2)
    return [CodedPlane(layouts.KIND_SIGN, 0, codecs.RANS_SEG, N, _segmented(s, sign)),
            CodedPlane(layouts.KIND_EXPONENT, 0, codecs.RANS_SEG, N, _segmented(e, exp)),
            CodedPlane(layouts.KIND_MANTISSA, 0, codecs.RANS_SEG, N, _segmented(m, man))]


SIGN = ["bitpack", "raw", "bitpack", "rans-const"]
EXP = ["rans", "rans-raw", "rans", "rans-const"]
MAN = ["bitpack-w", "raw", "rans", "rans-const"]


def _file(tensors: dict[str, tuple]) -> bytes:
    buf = io.BytesIO()
    with Writer(buf) as w:
        refs = {}
        for name, (dtype, shape, lay, planes, raw) in tensors.items():
            refs[name] = w.add_coded(name, dtypes.BY_NAME[dtype], shape,
                                     CodedTensor(lay, tuple(planes)),
                                     hashing.content_hash(raw))
        w.set_tree({k: objtree.TensorRef(r.index) for k, r in refs.items()})
    return buf.getvalue()


def _flat(seed: int, sign=SIGN, exp=EXP, man=MAN) -> tuple:
    raw = _bf16(seed)
    return ("bfloat16", (N,), layouts.BF16, _split_planes(raw, sign, exp, man), raw)


def _bytes_tensor(seed: int) -> tuple:
    """A uint8 tensor of one raw-layout plane, stored as segments decoded in place."""
    g = np.random.default_rng(seed)
    raw = np.concatenate([g.geometric(0.3, UNIT) % 256, g.integers(0, 256, UNIT),
                          np.full(UNIT, 7), g.integers(0, 2, 1001)]).astype(np.uint8)
    plane = _segmented(raw, ["rans", "rans-raw", "rans-const", "bitpack"])
    return ("uint8", (N,), layouts.RAW,
            [CodedPlane(layouts.KIND_RAW, 0, codecs.RANS_SEG, N, plane)], raw)


def _gpu(blob: bytes, idx: list[int] | None = None) -> list[np.ndarray]:
    r = s4format.Reader(blob)
    idx = list(range(len(r.tensors))) if idx is None else idx
    return [o.numpy() for o in decode.read_tensors(r, idx)]


def test_every_segment_codec_decodes_on_the_gpu_bit_exact() -> None:
    blob = _file({"a": _flat(1), "b": _bytes_tensor(2),
                  "c": _flat(3, ["raw", "bitpack", "rans", "raw"],
                             ["rans-raw", "rans", "rans", "rans-const"],
                             ["rans", "bitpack-w", "raw", "bitpack-w"])})
    r = s4format.Reader(blob)
    assert all(decode.decodable(r, i) for i in range(3))
    for i, got in enumerate(_gpu(blob)):
        assert np.array_equal(got, r.read_raw(i))


def test_segments_are_decoded_by_the_kernel_of_their_codec(monkeypatch) -> None:
    from s4weights.gpu import runtime
    launched = []
    real = runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda m, name, *a: (launched.append(name),
                                                                real(m, name, *a))[1])
    from s4weights.gpu.ransdecode import RansBatch
    sources = []
    add = RansBatch.add_many
    monkeypatch.setattr(RansBatch, "add_many", lambda self, q, a, stored, n, src, *rest, **k: (
        sources.append(np.asarray(src, np.uint64)), add(self, q, a, stored, n, src, *rest,
                                                        **k))[1])
    blob = _file({"a": _flat(1)})
    (got,) = _gpu(blob)
    assert np.array_equal(got, s4format.Reader(blob).read_raw(0))
    # rANS segments in the batch's decode, raw ones copied, packed ones unpacked
    assert {"rans_blocks", "copy_ops", "pack_ops", "merge_bf16"} <= set(launched)
    # the streams the kernels read start on 16-byte boundaries (the device reads their states
    # as words), wherever the segments lie in their plane; row 2, the exponent's RAW-mode
    # segment, is only copied from after its header
    (src,) = sources
    assert src.size == 7 and not (np.delete(src, 2) % 16).any()


def test_the_segment_rows_name_their_plane_and_segment() -> None:
    r = s4format.Reader(_file({"a": _flat(1)}))
    sg = segdecode.of(decode.stage(r, [0]))
    assert not sg.bad
    assert sg.q.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert sg.lo.tolist() == [0, UNIT, 2 * UNIT, 3 * UNIT] * 3
    assert sg.label(5) == "rans-seg segment 1 of 4 (rans)"


def _damage(blob: bytes, plane: tuple[int, int], how: str) -> bytes:
    """``blob`` with plane ``plane`` (tensor, plane index) of tensor ``a`` re-stored damaged,
    its checksum remade (so only the codec's checks find it)."""
    r = s4format.Reader(blob)
    tensors = {}
    for i, t in enumerate(r.tensors):
        raw = r.read_raw(i)
        planes = [CodedPlane(p.kind, p.index, p.codec, p.decoded_len,
                             np.array(r.read_stored(t, j), np.uint8), p.params)
                  for j, p in enumerate(t.planes)]
        if i == plane[0]:
            p = planes[plane[1]]
            payload = p.payload.copy()
            table = ransseg.read_table(payload, p.decoded_len)
            _n, at, _lo, _c, _sp, size = table[0 if plane[0] == 2 else 2]
            if how == "count":
                payload[:4] = np.frombuffer(struct.pack("<I", 0), np.uint8)
            elif how == "symbols":  # segment 1 one unit longer: the sum no longer matches
                o = 4 + 24 * 1
                payload[o:o + 8] = np.frombuffer(struct.pack("<Q", 2 * UNIT), np.uint8)
            elif how == "codec":
                o = 4 + 24 * 2 + 16
                payload[o:o + 2] = np.frombuffer(struct.pack("<H", 3), np.uint8)
            elif how == "padding":  # segment 3's last byte (a bitpack or bitpack-w segment)
                _n, at, _lo, _c, _sp, size = table[3]
                payload[at + size - 1] |= 0x80
            elif how == "rans-mode":  # a rANS segment's stream header (2, or c's 0)
                payload[at] = 9
            elif how == "rans-block":  # a word in that segment's first block
                payload[at + size // 2] ^= 0x5A
            elif how == "params":
                planes[plane[1]] = CodedPlane(p.kind, p.index, p.codec, p.decoded_len,
                                              payload, b"\x00")
                payload = None
            if payload is not None:
                planes[plane[1]] = CodedPlane(p.kind, p.index, p.codec, p.decoded_len, payload,
                                              p.params)
        tensors[t.name] = (t.dtype.name, t.shape, t.layout, planes, raw)
    return _file(tensors)


@pytest.mark.parametrize("plane,how", [
    ((1, 1), "count"), ((1, 1), "symbols"), ((1, 2), "codec"), ((1, 1), "params"),
    ((1, 0), "padding"), ((1, 2), "padding"), ((1, 1), "rans-mode"), ((1, 1), "rans-block"),
    ((2, 0), "rans-mode"), ((2, 0), "padding"), ((2, 0), "rans-block"),
])
@pytest.mark.parametrize("path", ["batch", "chunks", "one chunk"])
def test_a_damaged_segment_fails_as_the_cpu_reader_fails(plane, how, path) -> None:
    man = ["bitpack-w", "raw", "rans", "bitpack-w"]
    sign = ["bitpack", "raw", "rans", "bitpack"]
    good = _file({"a": _flat(1), "b": _flat(2, sign, EXP, man), "c": _bytes_tensor(3)})
    blob = _damage(good, plane, how)
    r = s4format.Reader(blob)
    with pytest.raises(CodecError) as cpu:
        for i in range(3):
            r.read_raw(i)
    assert f"tensor '{'abc'[plane[0]]}'" in str(cpu.value)
    with pytest.raises(CodecError) as got:
        _read(blob, path)
    assert str(got.value) == str(cpu.value)


def _read(blob: bytes, path: str, workspace: int = 1 << 16, on_host: bool = False
          ) -> list[np.ndarray]:
    """Every tensor of ``blob`` decoded on the GPU path: in one batch, or each tensor in
    chunks (``decode_large.load_large``) within ``workspace`` ("one chunk": a workspace
    that holds it)."""
    r = s4format.Reader(blob)
    if path == "batch":
        return [o.numpy() for o in decode.read_tensors(r, list(range(len(r.tensors))))]
    workspace = 1 << 30 if path == "one chunk" else workspace
    outs = []
    for i, t in enumerate(r.tensors):
        assert decode_large.chunkable(r, i)
        out = torch.empty(t.raw_nbytes, dtype=torch.uint8)
        decode_large.load_large(r, i, out, workspace, on_host=on_host)
        outs.append(out.numpy())
    return outs


def _chunks(blob: bytes, i: int, workspace: int) -> int:
    """How many chunks tensor i of ``blob`` decodes in within ``workspace``."""
    r = s4format.Reader(blob)
    n = r.tensors[i].raw_nbytes
    return -(-n // decode_large._load_chunk([decode_chunks.Level(r, i)], n, workspace))


LONG = 7 * UNIT + 999  # segments of 3, 1 and 2 units and the rest: chunks of one unit cut them


def _long(seed: int, forms: list[str]) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(3 * UNIT, generator=g) * 0.02, torch.randn(UNIT, generator=g),
                   torch.full((2 * UNIT,), -2.5), torch.randn(UNIT + 999, generator=g) * 7]
                  ).bfloat16()
    raw = x.view(torch.uint8).numpy().copy()
    s, e, m = layouts.BF16.split(raw, 2)
    units = [3, 1, 2]
    planes = [CodedPlane(layouts.KIND_SIGN, 0, codecs.RANS_SEG, LONG,
                         _segmented(s, ["bitpack", "rans-raw", "rans-const", "raw"], units)),
              CodedPlane(layouts.KIND_EXPONENT, 0, codecs.RANS_SEG, LONG,
                         _segmented(e, forms, units)),
              CodedPlane(layouts.KIND_MANTISSA, 0, codecs.RANS_SEG, LONG,
                         _segmented(m, ["rans", "bitpack-w", "rans-const", "raw"], units))]
    return ("bfloat16", (LONG,), layouts.BF16, planes, raw)


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("workspace", [1 << 16, 3 << 20, 1 << 30])
def test_every_segment_codec_decodes_in_chunks_bit_exact(monkeypatch, on_host: bool,
                                                         workspace: int) -> None:
    # tensors larger than the workspace: chunks of 2^16 elements, which cut segments of
    # several units, or larger ones (one, for the largest workspace) that hold several
    # segments of every codec; each chunk's segments decoded by the kernel of their codec into
    # its range of the plane, then merged (or in place, for bytes)
    from s4weights.gpu import runtime
    launched = []
    real = runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda m, name, *a: (launched.append(name),
                                                                real(m, name, *a))[1])
    blob = _file({"a": _flat(1), "b": _bytes_tensor(2),
                  "c": _long(3, ["rans", "raw", "rans-const", "rans"]),
                  "d": _long(4, ["bitpack-w", "rans", "rans-raw", "rans"])})
    r = s4format.Reader(blob)
    chunks = [_chunks(blob, i, workspace) for i in range(4)]
    assert min(chunks) > 3 if workspace == 1 << 16 else max(chunks) < 4
    for i, got in enumerate(_read(blob, "chunks", workspace, on_host)):
        assert np.array_equal(got, r.read_raw(i)), r.tensors[i].name
    assert {"copy_ops", "pack_ops", "merge_bf16"} <= set(launched), launched
    assert any(name.startswith("rans_decode") for name in launched)


def test_a_chain_of_segmented_levels_decodes_in_chunks() -> None:
    # a delta whose XOR bytes and whose parent are both stored in segments, decoded chunk by
    # chunk from the parent up (each chunk's parent bytes XORed into it, both levels' content
    # hashes checked)
    parent = _long(5, ["rans", "raw", "rans-const", "rans"])
    raw = parent[4].copy()
    g = np.random.default_rng(6)
    raw[2 * g.integers(0, LONG, 20_000)] ^= np.uint8(1)  # (low mantissa bits only)
    xor = np.bitwise_xor(raw, parent[4])
    s, e, m = layouts.BF16.split(xor, 2)
    planes = [CodedPlane(layouts.KIND_SIGN, 0, codecs.RANS_SEG, LONG,
                         _segmented(s, ["rans-const", "raw", "bitpack", "rans-const"],
                                    [3, 1, 2])),
              CodedPlane(layouts.KIND_EXPONENT, 0, codecs.RANS_SEG, LONG,
                         _segmented(e, ["rans-const", "rans", "rans-raw", "rans-const"],
                                    [3, 1, 2])),
              CodedPlane(layouts.KIND_MANTISSA, 0, codecs.RANS_SEG, LONG,
                         _segmented(m, ["rans", "rans", "raw", "rans-raw"], [3, 1, 2]))]
    first = _file({"w": parent})
    buf = io.BytesIO()
    with Writer(buf, parent_id=s4format.Reader(first).checkpoint_id) as w:
        ref = w.add_coded("w", dtypes.BY_NAME["bfloat16"], (LONG,),
                          CodedTensor(layouts.BF16, tuple(planes)), hashing.content_hash(raw),
                          parent_hash=hashing.content_hash(parent[4]))
        w.set_tree({"w": objtree.TensorRef(ref.index)})
    r = s4format.Reader(buf.getvalue(), parent=s4format.Reader(first))
    assert r.tensors[0].is_delta and decode_large.chunkable(r, 0)
    for on_host in (False, True):
        for workspace in (1 << 16, 1 << 30):  # chunks of one unit, one chunk
            out = torch.empty(raw.size, dtype=torch.uint8)
            decode_large.load_large(r, 0, out, workspace, on_host=on_host)
            assert np.array_equal(out.numpy(), raw)


def test_a_segment_whose_blocks_cross_the_chunks_goes_to_the_cpu_decoder() -> None:
    # a rANS segment of 2^18-symbol blocks starting one unit into its plane: a chunk boundary
    # on a multiple of 2^18 symbols would cut one of its blocks, so the chunked decoder leaves
    # the tensor to the CPU decoder (no writer of ours makes such blocks)
    from s4weights.gpu import ransparse
    g = np.random.default_rng(7)
    raw = (g.geometric(0.3, 9 * UNIT) % 256).astype(np.uint8)
    big = np.frombuffer(bytes(rans.RansCodec(18).encode(raw[UNIT:]).payload), np.uint8)
    plane = ransseg.assemble([(UNIT, codecs.RAW, 0, raw[:UNIT]),
                              (raw.size - UNIT, codecs.RANS, 0, big)])
    blob = _file({"z": ("uint8", (raw.size,), layouts.RAW,
                        [CodedPlane(layouts.KIND_RAW, 0, codecs.RANS_SEG, raw.size, plane)],
                        raw)})
    r = s4format.Reader(blob)
    assert np.array_equal(r.read_raw(0), raw)
    with pytest.raises(ransparse.HostDecodes, match="blocks cross the chunks"):
        decode_large.load_large(r, 0, torch.empty(raw.size, dtype=torch.uint8), 1 << 16)


def test_tiny_const_blocks_in_segments_go_to_the_cpu_decoder(monkeypatch) -> None:
    # each segment a CONST stream of 32-symbol blocks: 2,048 blocks per stored 12 bytes, so
    # the batch would build block tables far beyond its stored bytes; the CPU decodes it
    raw = np.full(64 * UNIT, 3, np.uint8)
    head = rans.HEADER.pack(rans.MODE_CONST, rans.LOG2_BLOCK_MIN, 0, UNIT)
    seg = np.frombuffer(head + bytes([3]) * (UNIT >> rans.LOG2_BLOCK_MIN), np.uint8)
    plane = ransseg.assemble([(UNIT, codecs.RANS, 0, seg)] * 64)
    blob = _file({"z": ("uint8", (raw.size,), layouts.RAW,
                        [CodedPlane(layouts.KIND_RAW, 0, codecs.RANS_SEG, raw.size, plane)],
                        raw)})
    from s4weights.gpu import ransparse
    monkeypatch.setattr(ransparse, "TABLE_CAP", 0)  # (its floor, which a small test is under)
    on_cpu = []
    real = decode.read_on_cpu
    monkeypatch.setattr(decode, "read_on_cpu",
                        lambda reader, i, out: (on_cpu.append(i), real(reader, i, out)))
    (got,) = _gpu(blob)
    assert np.array_equal(got, raw)
    assert on_cpu == [0]


def test_device_extra_counts_the_decoded_plane_and_its_tables() -> None:
    blob = _file({"a": _flat(1), "b": _bytes_tensor(2)})
    r = s4format.Reader(blob)
    a, b = decode.device_extra(r, 0), decode.device_extra(r, 1)
    stored_a = sum(p.stored_len for p in r.tensors[0].planes)
    assert a > stored_a + 3 * N  # each split plane's decoded bytes wait for the merge
    assert b < sum(p.stored_len for p in r.tensors[1].planes) + N  # decoded in place


@pytest.mark.parametrize("first", ["rans-mode", "rans-block"])
def test_in_one_plane_the_first_failing_segment_is_reported(first) -> None:
    # segment 0's rANS stream is bad (its header, or a block only decoding finds) and segment
    # 1, raw, is a byte short: the GPU path checks forms first, yet reports segment 0 as the
    # CPU reader does
    g = np.random.default_rng(4)
    raw = (g.geometric(0.3, 2 * UNIT) % 256).astype(np.uint8)
    stream = _rans(raw[:UNIT]).copy()
    if first == "rans-mode":
        stream[0] = 9
    else:
        stream[stream.size // 2] ^= 0x5A
    plane = ransseg.assemble([(UNIT, codecs.RANS, 0, stream),
                              (UNIT, codecs.RAW, 0, raw[UNIT:2 * UNIT - 1])])
    blob = _file({"z": ("uint8", (raw.size,), layouts.RAW,
                        [CodedPlane(layouts.KIND_RAW, 0, codecs.RANS_SEG, raw.size, plane)],
                        raw)})
    with pytest.raises(CodecError) as cpu:
        s4format.Reader(blob).read_raw(0)
    assert "segment 0 of 2 (rans)" in str(cpu.value)
    with pytest.raises(CodecError) as got:
        decode.read_tensors(s4format.Reader(blob), [0])
    assert str(got.value) == str(cpu.value)


_FUZZ = None


def _fuzz_file() -> tuple[bytes, list[tuple[str, int, int]]]:
    """A file of codec-9 planes of every segment codec, and its planes (tensor, plane, stored
    bytes); made once."""
    global _FUZZ
    if _FUZZ is None:
        blob = _file({"a": _flat(1), "b": _bytes_tensor(2),
                      "c": _flat(3, ["raw", "bitpack", "rans", "bitpack"],
                                 ["rans-raw", "rans", "rans", "rans-const"],
                                 ["rans", "bitpack-w", "raw", "bitpack-w"])})
        r = s4format.Reader(blob)
        _FUZZ = blob, [(t.name, j, p.stored_len) for t in r.tensors
                       for j, p in enumerate(t.planes)]
    return _FUZZ


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), path=st.sampled_from(["batch", "chunks", "one chunk"]))
def test_damaged_segments_fail_on_the_gpu_as_on_the_cpu(data, path) -> None:
    # any byte of one to three codec-9 planes changed (segment tables, stream headers and
    # tables, words, packed bytes), each plane's checksum remade for the new bytes so that only
    # decoding finds the damage: the GPU path refuses the file iff the CPU reader does, with
    # the same error in the same words, or decodes the same bytes; in one batch or each
    # tensor in chunks
    blob, planes = _fuzz_file()
    picks = data.draw(st.lists(st.sampled_from(planes), min_size=1, max_size=3, unique=True))
    for name, j, size in picks:
        at = data.draw(st.one_of(st.integers(0, min(size, 4 + 24 * 4) - 1),
                                 st.integers(0, size - 1)))  # (the table, or anywhere)
        flip = data.draw(st.integers(1, 255))

        def damage(stored: np.ndarray, at=at, flip=flip) -> np.ndarray:
            stored[at] ^= flip
            return stored

        blob = _rewrite(blob, name, j, damage)
    r = s4format.Reader(blob)
    cpu = _first_cpu_failure(r)
    try:
        got = _read(blob, path)
        gpu = None
    except s4format.S4Error as e:
        gpu = e
    assert (cpu is None) == (gpu is None), (cpu, gpu)
    if cpu is None:
        for i, o in enumerate(got):
            assert np.array_equal(o, r.read_raw(i))
    else:
        assert type(gpu) is type(cpu) and str(gpu) == str(cpu), (cpu, gpu)
