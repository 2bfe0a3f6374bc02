"""The GPU decoder's host side without a GPU: device buffers are CPU tensors and the kernels
are emulated by the reference code (tests/gpu/emulated.py).

The checks before any kernel runs (``decode_group.prepare``): every malformed stored form
``plane_form_error`` knows and the reader's index checks let through (lengths a codec cannot
produce are refused there) is refused with a message naming the tensor and the plane, and a
batch with several reports the first plane in file order, as the CPU reader meets them.
Whole decodes (``decode.read_tensors``: staging, checksums, validation, the rANS and merge
kernels' launch tables, copies, content hashes, errors found by the kernels) of files the
encoder wrote, under the same emulation. Damaged files fail as the CPU reader fails reading in
order (which tensor and plane is named), with one to three damaged planes (a property test:
checksums remade, so only decoding finds the damage, or kept, so R1 does), checksum failures
read after the decode kernels, empty planes, deltas whose parents are damaged (also through the
chunked loader), tensors over the size limit, and names that print with double quotes. The GPU tests
(test_gpu_small, test_gpu_codec) cover the same on the device for real."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format import codecs, dtypes, hashing, layouts, objtree
from s4format.codecs import rans
from s4format.errors import ChecksumError, CodecError, ContentHashError
from s4format.writer import CodedPlane, CodedTensor, Writer
from s4weights.gpu import decode, decode_group, encode, ranshost
from tests.gpu.emulated import emulate

N = 1001  # elements: the packed sign plane has 5 padding bits


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    emulate(monkeypatch)


def _good_bf16(seed: int) -> list[CodedPlane]:
    """A bf16 tensor's planes as the GPU writes them: packed sign bits, a rANS exponent plane,
    a raw mantissa plane."""
    x = (torch.randn(N, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()
    sign, exp, man = layouts.BF16.split(x.view(torch.uint8).numpy().copy(), 2)
    return [CodedPlane(layouts.KIND_SIGN, 0, codecs.BITPACK, N,
                       np.packbits(sign, bitorder="little")),
            CodedPlane(layouts.KIND_EXPONENT, 0, codecs.RANS, N,
                       np.frombuffer(bytes(rans.RansCodec().encode(exp).payload), np.uint8)),
            CodedPlane(layouts.KIND_MANTISSA, 0, codecs.RAW, N, man)]


def _damaged(planes: list[CodedPlane], j: int, how: str) -> list[CodedPlane]:
    p = planes[j]
    payload = np.array(p.payload, np.uint8, copy=True)
    params = p.params
    codec = p.codec
    if how == "params":
        params = b"\x01"
    elif how == "padding":
        payload[-1] |= 0x80  # a bit past the last element
    elif how == "bitpack-elsewhere":
        codec, payload = codecs.BITPACK, np.packbits(payload & 1, bitorder="little")
    out = list(planes)
    out[j] = CodedPlane(p.kind, p.index, codec, p.decoded_len, payload, params)
    return out


def _file(tensors: dict[str, list[CodedPlane]]) -> bytes:
    buf = io.BytesIO()
    with Writer(buf) as w:
        refs = {name: w.add_coded(name, dtypes.BY_NAME["bfloat16"], (N,),
                                  CodedTensor(layouts.BF16, tuple(planes)),
                                  hashing.content_hash(b"x"))
                for name, planes in tensors.items()}
        w.set_tree({k: objtree.TensorRef(r.index) if hasattr(r, "index") else r
                    for k, r in refs.items()})
    return buf.getvalue()


def _prepare(blob: bytes):
    r = s4format.Reader(blob)
    idx = list(range(len(r.tensors)))
    st = decode.stage(r, idx)
    outs = [torch.empty(r.tensors[i].raw_nbytes, dtype=torch.uint8) for i in idx]
    return decode_group.prepare(st, outs, st.device.data_ptr(), [])


@pytest.mark.parametrize("j,how,message", [
    (0, "padding", "plane sign: bitpack payload is malformed"),
    (0, "params", "plane sign: bitpack payload is malformed"),
    (2, "params", "plane mantissa0: raw plane with parameters, or storing 1001 bytes for 1001"),
    (1, "params", "plane exponent: rans takes no parameters"),
    (2, "bitpack-elsewhere", "plane mantissa0: bitpack on a plane other than the sign plane"),
])
def test_each_malformed_form_is_refused_naming_its_plane(j: int, how: str, message: str,
                                                         monkeypatch) -> None:
    # (bitpack off the sign plane never reaches the GPU path: decodable() sends such tensors
    # to the CPU decoder; the check stands behind it, so it is tested with that gate open)
    monkeypatch.setattr(decode, "decodable", lambda reader, i: True)
    blob = _file({"a": _good_bf16(1), "b": _damaged(_good_bf16(2), j, how),
                  "c": _good_bf16(3)})
    with pytest.raises(CodecError, match=f"tensor 'b' {message}$"):
        _prepare(blob)


def _bitpack_w(planes: list[CodedPlane], how: str = "") -> list[CodedPlane]:
    """The tensor with its mantissa plane as bitpack-w (7 bits; 1001 * 7 bits leave one
    padding bit), damaged as ``how`` says."""
    man = planes[2].payload
    enc = codecs.get(codecs.BITPACK_W).encode(man)
    payload, params = np.array(enc.payload, np.uint8, copy=True), enc.params
    if how == "none":
        params = b""
    elif how == "eight":
        params = b"\x08"
    elif how == "short":
        payload = payload[:-1]
    elif how == "padding":
        payload[-1] |= 0x80
    return [*planes[:2], CodedPlane(layouts.KIND_MANTISSA, 0, codecs.BITPACK_W, N, payload,
                                    params)]


@pytest.mark.parametrize("how,message", [
    ("none", "bitpack-w takes one parameter byte, the width 1..7; got none"),
    ("eight", "bitpack-w takes one parameter byte, the width 1..7; got 08"),
    ("short", "bitpack-w plane of 1001 bytes at 7 bits must store 876 bytes, stores 875"),
    ("padding", "bitpack-w padding bits in the last byte are not zero")])
def test_malformed_bitpack_w_is_refused_as_the_cpu_reader_refuses_it(how: str,
                                                                     message: str) -> None:
    blob = _file({"a": _bitpack_w(_good_bf16(1)), "b": _bitpack_w(_good_bf16(2), how)})
    with pytest.raises(CodecError, match=f"tensor 'b' plane mantissa0: {re.escape(message)}$"):
        _prepare(blob)
    with pytest.raises(CodecError, match=re.escape(message)):
        s4format.Reader(blob).read_raw(1)


def _bad_rans_mode(planes: list[CodedPlane]) -> list[CodedPlane]:
    p = planes[1]
    payload = np.array(p.payload, np.uint8, copy=True)
    payload[0] = 9  # no such rANS mode: the stream header fails, on the host
    return [planes[0], CodedPlane(p.kind, p.index, p.codec, p.decoded_len, payload), planes[2]]


def test_on_one_plane_its_form_outranks_its_stream_header() -> None:
    # the exponent plane carries a parameter byte and a bad stream header: the CPU reader
    # checks the parameters first (the GPU decoder validates the streams before the forms)
    planes = _bad_rans_mode(_good_bf16(2))
    p = planes[1]
    planes[1] = CodedPlane(p.kind, p.index, p.codec, p.decoded_len, p.payload, b"\x01")
    blob = _file({"a": _good_bf16(1), "b": planes})
    with pytest.raises(CodecError, match="rans takes no parameters"):
        s4format.Reader(blob, verify=False).read_raw(1)
    with pytest.raises(CodecError) as got:
        _prepare(blob)
    assert str(got.value).endswith("tensor 'b' plane exponent: rans takes no parameters")


@pytest.mark.parametrize("where", ["batch", "chunked"])
def test_an_earlier_rans_plane_outranks_a_later_bitpack_w_form(where: str) -> None:
    # the exponent stream's header is bad and the mantissa's bitpack-w padding too: the CPU
    # reader meets the exponent first, so both GPU paths must report it
    blob = _file({"a": _bitpack_w(_bad_rans_mode(_good_bf16(1)), "padding")})
    r = s4format.Reader(blob, verify=False)
    with pytest.raises(CodecError) as cpu:
        r.read_raw(0)
    assert "plane exponent: " in str(cpu.value)
    with pytest.raises(CodecError) as got:
        if where == "batch":
            decode.read_tensors(r, [0])
        else:
            from s4weights.gpu import decode_large
            decode_large.load_large(r, 0, torch.empty(2 * N, dtype=torch.uint8), 1 << 16)
    assert str(got.value) == str(cpu.value)


def test_bitpack_w_planes_are_merged_from_their_packed_bytes() -> None:
    good = [_good_bf16(1), _good_bf16(2)]
    blob = _file({"a": _bitpack_w(good[0]), "b": good[1]})
    _ptrs, packed, _copies, _rb, _scratch = _prepare(blob)
    assert packed.tolist() == [[1, 0, 7, 0, 0], [1, 0, 0, 0, 0]]
    r = s4format.Reader(blob, verify=False)  # (the test file's content hashes are dummies)
    outs = [torch.empty(r.tensors[i].raw_nbytes, dtype=torch.uint8) for i in range(2)]
    decode.read_tensors(r, [0, 1], outs)
    for i in range(2):
        assert np.array_equal(outs[i].numpy(), r.read_raw(i))


def test_the_first_bad_plane_in_file_order_is_reported() -> None:
    # c's sign plane is bad in a later check than b's mantissa; b comes first in the file
    blob = _file({"a": _good_bf16(1), "b": _damaged(_good_bf16(2), 2, "params"),
                  "c": _damaged(_good_bf16(3), 0, "padding")})
    with pytest.raises(CodecError, match="tensor 'b' plane mantissa0: raw plane"):
        _prepare(blob)
    blob = _file({"a": _damaged(_good_bf16(1), 1, "params"),
                  "b": _damaged(_good_bf16(2), 0, "padding")})
    with pytest.raises(CodecError, match="tensor 'a' plane exponent: rans takes no"):
        _prepare(blob)


def test_a_good_batch_yields_the_merge_inputs() -> None:
    blob = _file({"a": _good_bf16(1), "b": _good_bf16(2)})
    ptrs, packed, copies, rb, _scratch = _prepare(blob)
    r = s4format.Reader(blob)
    st = decode.stage(r, [0, 1])
    assert packed.tolist() == [[1, 0, 0, 0, 0]] * 2  # bitpacked signs, byte planes
    assert not copies                 # no raw-layout tensors
    assert rb.q.tolist() == [1, 4]    # the two exponent planes go to the rANS kernel
    # the mantissa planes are read in place: their offset in the staged buffer
    base = st.device.data_ptr()
    for k, q in ((0, 2), (1, 5)):
        assert int(ptrs[k, 2]) - int(ptrs[k, 0]) == int(st.at[q] - st.at[q - 2])
    del base


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dt).removeprefix("torch.")
        for n in (3, 2500, 70_000, 200_000):
            out[f"{name}.w{n}"] = (torch.randn(n, generator=g) * 0.02).to(dt)
        out[f"{name}.zeros"] = torch.zeros(70_000, dtype=dt)
        x = torch.randn(200_000, generator=g).to(dt)
        x[:131_072] = 1.5
        out[f"{name}.const_blocks"] = x
        out[f"{name}.empty"] = torch.empty(0, 7, dtype=dt)
        out[f"{name}.positive"] = torch.rand(90_000, generator=g).to(dt)
    out["bits16"] = torch.randint(0, 2**15, (90_000,), dtype=torch.int16,
                                  generator=g).view(torch.bfloat16)
    out["int64"] = torch.arange(50_000, dtype=torch.int64)
    out["step"] = torch.tensor(7)
    return out


def _gpu_file(tensors: dict[str, torch.Tensor]) -> bytes:
    """The file the GPU encoder writes (its kernels emulated too)."""
    return encode.file_of(encode.Encoder(), tensors)


@pytest.mark.parametrize("batch", [1, 5, 1000])
def test_whole_batches_decode_bit_exactly(batch: int) -> None:
    tensors = _state()
    r = s4format.Reader(_gpu_file(tensors))
    # the file holds what the GPU decodes: rANS (RANS and CONST modes), bitpack and raw planes,
    # raw-layout tensors; and what it hands to the CPU decoder
    on_gpu = [i for i in range(len(r.tensors)) if decode.decodable(r, i)]
    assert len(on_gpu) < len(r.tensors)
    modes = {int(r.source.read_at(p.offset, 1)[0]) for i in on_gpu for p in r.tensors[i].planes
             if p.codec == codecs.RANS}
    assert modes == {rans.MODE_CONST, rans.MODE_RANS}
    assert any(r.tensors[i].layout.layout_id == layouts.RAW.layout_id for i in on_gpu)
    want = list(tensors.values())
    for lo in range(0, len(want), batch):
        idx = list(range(lo, min(lo + batch, len(want))))
        got = decode.read_tensors(r, idx)
        for i, o in zip(idx, got):
            assert o.numpy().tobytes() == want[i].reshape(-1).view(torch.uint8).numpy().tobytes(), i


def _rewrite(blob: bytes, name: str, j: int, edit) -> bytes:
    """The file with plane j of tensor ``name`` replaced by ``edit(stored bytes)`` (same
    length) and its checksum made for the new bytes: only decoding can find the damage."""
    r = s4format.Reader(blob)
    t = r.tensors[r.index_of(name)]
    planes = []
    for k, p in enumerate(t.planes):
        stored = np.array(r.read_stored(t, k), np.uint8)
        if k == j:
            stored = edit(stored)
        planes.append(CodedPlane(p.kind, p.index, p.codec, p.decoded_len, stored, p.params))
    tensors = {tt.name: tt for tt in r.tensors}
    buf = io.BytesIO()
    with Writer(buf) as w:
        for tt in tensors.values():
            ps = planes if tt.name == name else [
                CodedPlane(p.kind, p.index, p.codec, p.decoded_len,
                           np.array(r.read_stored(tt, k), np.uint8), p.params)
                for k, p in enumerate(tt.planes)]
            w.add_coded(tt.name, tt.dtype, tt.shape, CodedTensor(tt.layout, tuple(ps)),
                        tt.content_hash)
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(tensors)})
    return buf.getvalue()


def flip_last_word(stored: np.ndarray) -> np.ndarray:
    """A stream's last word with every bit flipped."""
    stored[-2:] ^= 0xFF
    return stored


def test_a_corrupt_rans_word_is_reported_by_plane_and_block() -> None:
    tensors = {"a": _state()["float32.w200000"], "b": _state()["bfloat16.w200000"]}
    blob = _gpu_file(tensors)
    r = s4format.Reader(blob)
    t = r.tensors[1]
    j = next(k for k, p in enumerate(t.planes) if p.codec == codecs.RANS
             and int(r.source.read_at(p.offset, 1)[0]) == rans.MODE_RANS)

    bad = s4format.Reader(_rewrite(blob, "b", j, flip_last_word))
    with pytest.raises(CodecError, match=rf"tensor 'b' plane {t.planes[j].label}: rans block "
                                         r"\d+ of \d+ is corrupt"):
        decode.read_tensors(bad, [0, 1])
    with pytest.raises(CodecError):  # the CPU reader refuses it too
        bad.read_raw(1)


def _word_counts_at(stored: np.ndarray) -> int:
    """Where a RANS-mode stream's word counts start: after the header and frequency table."""
    k = int(np.unpackbits(stored[rans.HEADER_SIZE:rans.HEADER_SIZE + 32]).sum())
    return rans.HEADER_SIZE + 32 + 2 * k + 2 * (k % 2)


def _count_edit(delta: int):
    def edit(stored: np.ndarray) -> np.ndarray:
        at = _word_counts_at(stored)
        c = int(stored[at:at + 4].view("<u4")[0]) + delta
        stored[at:at + 4] = np.array([c], "<u4").view(np.uint8)
        return stored
    return edit


@pytest.mark.parametrize("delta,message", [
    (1 << 20, r"rans block \d+ stores \d+ words for \d+ symbols \(at most one word per symbol\)"),
    (-1, r"rans RANS stream must be \d+ bytes, is \d+")])
def test_word_count_checks_run_on_the_device_and_name_the_plane(delta: int,
                                                                message: str) -> None:
    # the host reads no word count: rans_blocks finds a block that stores more words than
    # symbols, or a stream whose length disagrees with its word counts; the error names the
    # plane with the CPU decoder's check and message, and an earlier plane's corrupt word
    # comes first
    tensors = {"a": _state()["float32.w200000"], "b": _state()["bfloat16.w200000"]}
    blob = _gpu_file(tensors)
    r = s4format.Reader(blob)

    def rans_plane(t) -> int:
        return next(k for k, p in enumerate(t.planes) if p.codec == codecs.RANS
                    and int(r.source.read_at(p.offset, 1)[0]) == rans.MODE_RANS)

    jb, ja = rans_plane(r.tensors[1]), rans_plane(r.tensors[0])
    bad = _rewrite(blob, "b", jb, _count_edit(delta))
    label = r.tensors[1].planes[jb].label
    with pytest.raises(CodecError, match=f"tensor 'b' plane {label}: {message}$") as gpu:
        decode.read_tensors(s4format.Reader(bad), [0, 1])
    with pytest.raises(CodecError) as cpu:  # the CPU reader refuses it, in the same words
        s4format.Reader(bad).read_raw(1)
    assert str(gpu.value).split(": ", 1)[1] == str(cpu.value).split(": ", 1)[1]

    both = s4format.Reader(_rewrite(bad, "a", ja, flip_last_word))
    with pytest.raises(CodecError, match=rf"tensor 'a' plane {r.tensors[0].planes[ja].label}: "
                                         r"rans block \d+ of \d+ is corrupt"):
        decode.read_tensors(both, [0, 1])
    worse = s4format.Reader(_rewrite(_rewrite(blob, "a", ja, _count_edit(delta)), "b", jb,
                                     flip_last_word))
    with pytest.raises(CodecError, match=f"tensor 'a' plane .*: {message}$"):
        decode.read_tensors(worse, [0, 1])


def test_a_lower_word_count_failure_comes_before_a_higher_header_failure() -> None:
    # the host checks headers first; a lower plane's word count (checked on the device) must
    # still be the one reported, as the CPU reader meets them
    tensors = {"a": _state()["float32.w200000"], "b": _state()["bfloat16.w200000"]}
    blob = _gpu_file(tensors)
    r = s4format.Reader(blob)
    ja, jb = (next(k for k, p in enumerate(t.planes) if p.codec == codecs.RANS
                   and int(r.source.read_at(p.offset, 1)[0]) == rans.MODE_RANS)
              for t in r.tensors)

    def reserved(stored: np.ndarray) -> np.ndarray:
        stored[2] = 1
        return stored

    bad = s4format.Reader(_rewrite(_rewrite(blob, "a", ja, _count_edit(1 << 20)), "b", jb,
                                   reserved))
    with pytest.raises(CodecError, match=f"tensor 'a' plane {r.tensors[0].planes[ja].label}: "
                                         r"rans block \d+ stores \d+ words for \d+ symbols"):
        decode.read_tensors(bad, [0, 1])


@pytest.mark.parametrize("with_blocks", [False, True])
def test_an_empty_rans_stream_with_extra_bytes_is_refused(with_blocks: bool) -> None:
    # n = 0: a RANS-mode stream is its header and table exactly (no block, no kernel reads it)
    table = np.zeros(32, np.uint8)
    table[0] = 1  # symbol 0, frequency 4096
    head = np.concatenate((np.frombuffer(ranshost.header(rans.MODE_RANS, 16, 0), np.uint8), table,
                           np.array([0, 16, 0, 0], np.uint8)))
    bad = np.concatenate((head, np.frombuffer(b"JUNKJUNK", np.uint8)))
    x = np.random.default_rng(1).integers(0, 4, 5000).astype(np.uint8)
    buf = io.BytesIO()
    with Writer(buf) as w:
        if with_blocks:  # a stream with blocks in the same batch: rans_blocks runs too
            w.add_coded("g", dtypes.BY_NAME["uint8"], (x.size,), CodedTensor(layouts.RAW, (
                CodedPlane(layouts.KIND_RAW, 0, codecs.RANS, x.size, np.frombuffer(
                    bytes(rans.RansCodec().encode(x).payload), np.uint8)),)),
                hashing.content_hash(x.tobytes()))
        w.add_coded("e", dtypes.BY_NAME["uint8"], (0,), CodedTensor(layouts.RAW, (
            CodedPlane(layouts.KIND_RAW, 0, codecs.RANS, 0, bad),)), hashing.content_hash(b""))
        w.set_tree([objtree.TensorRef(i) for i in range(1 + with_blocks)])
    r = s4format.Reader(buf.getvalue())
    with pytest.raises(CodecError) as cpu:  # the CPU reader refuses it
        r.read_raw(int(with_blocks))
    with pytest.raises(CodecError, match=r"tensor 'e' plane .*: rans RANS stream must be 48 "
                                         r"bytes, is 56$") as gpu:
        decode.read_tensors(r, list(range(1 + with_blocks)))
    assert str(gpu.value) == str(cpu.value)  # in the same words


def test_a_field_overflow_and_a_wrong_content_hash_are_found_after_decoding() -> None:
    tensors = {"a": _state()["bfloat16.w70000"], "b": _state()["bfloat16.zeros"]}
    blob = _gpu_file(tensors)
    r = s4format.Reader(blob)
    t = r.tensors[1]
    j = next(k for k, p in enumerate(t.planes) if p.kind == layouts.KIND_MANTISSA)
    assert int(r.source.read_at(t.planes[j].offset, 1)[0]) == rans.MODE_CONST

    def fill(value: int):
        def edit(stored: np.ndarray) -> np.ndarray:
            stored[rans.HEADER_SIZE] = value  # the first block's symbol
            return stored
        return edit

    bad = s4format.Reader(_rewrite(blob, "b", j, fill(0x80)))  # bf16's mantissa has 7 bits
    with pytest.raises(s4format.FormatError, match=r"tensor 'b': mantissa0 plane holds values "
                                                   r"wider than its 7 bits$"):  # (CPU's words)
        decode.read_tensors(bad, [0, 1])
    bad = s4format.Reader(_rewrite(blob, "b", j, fill(0x01)))  # valid, not the saved value
    with pytest.raises(ContentHashError, match="tensor 'b' content hash mismatch"):
        decode.read_tensors(bad, [0, 1])


def test_raw_mode_streams_are_read_in_place() -> None:
    # a rANS stream may be stored in RAW mode (the GPU encoder stores such planes raw, other
    # writers may not): a split tensor's plane and a raw-layout tensor's only plane
    x = (torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    sign, exp, man = layouts.BF16.split(x.view(torch.uint8).numpy().copy(), 2)
    small = np.arange(64, dtype=np.uint8)
    raw_mode = rans._raw_stream
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.add_coded("x", dtypes.BY_NAME["bfloat16"], (5000,), CodedTensor(layouts.BF16, (
            CodedPlane(layouts.KIND_SIGN, 0, codecs.BITPACK, 5000,
                       np.packbits(sign, bitorder="little")),
            CodedPlane(layouts.KIND_EXPONENT, 0, codecs.RANS, 5000,
                       np.frombuffer(bytes(rans.RansCodec().encode(exp).payload), np.uint8)),
            CodedPlane(layouts.KIND_MANTISSA, 0, codecs.RANS, 5000, raw_mode(man, 12)))),
            hashing.content_hash(x.view(torch.uint8).numpy().tobytes()))
        w.add_coded("s", dtypes.BY_NAME["uint8"], (64,), CodedTensor(layouts.RAW, (
            CodedPlane(layouts.KIND_RAW, 0, codecs.RANS, 64, raw_mode(small, 16)),)),
            hashing.content_hash(small.tobytes()))
        w.set_tree({"x": objtree.TensorRef(0), "s": objtree.TensorRef(1)})
    r = s4format.Reader(buf.getvalue())
    assert decode.decodable(r, 0) and decode.decodable(r, 1)
    got = decode.read_tensors(r, [0, 1])
    assert got[0].numpy().tobytes() == x.view(torch.uint8).numpy().tobytes()
    assert got[1].numpy().tobytes() == small.tobytes()


_WHO = re.compile(r"tensor '([^']*)'(?: plane (\w+))?")


def _who(exc: Exception) -> tuple[str, str | None]:
    """(tensor, plane or None) an error names."""
    m = _WHO.search(str(exc))
    assert m, str(exc)
    return m.group(1), m.group(2)


_FUZZ_TENSORS = None


def _fuzz_file() -> tuple[bytes, list[tuple[str, int, int]]]:
    """A GPU-written file of a few tensors (RANS and CONST streams, bitpack, raw planes) and its
    planes as (tensor, plane, stored bytes); made once."""
    global _FUZZ_TENSORS
    if _FUZZ_TENSORS is None:
        s = _state()
        blob = _gpu_file({k: s[k] for k in ("float32.w70000", "bfloat16.const_blocks",
                                            "bfloat16.w2500", "float16.zeros")})
        r = s4format.Reader(blob)
        planes = [(t.name, j, p.stored_len) for t in r.tensors for j, p in enumerate(t.planes)
                  if p.stored_len]
        _FUZZ_TENSORS = blob, planes
    return _FUZZ_TENSORS


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_planes_are_named_as_the_cpu_reader_names_them(data) -> None:
    # any byte of one to three planes changed, each plane's checksum made for the new bytes
    # (only decoding can find the damage) or left as it was (R1 fails), content hashes
    # verified or not: the GPU decoder (header and table checks on the host,
    # word counts and the bitstream on the device, content hashes after) refuses the file iff
    # the CPU reader does, naming the same tensor (the first the CPU reader fails on, reading
    # in order) and, where both name one, the same plane, with the same error and message
    blob, planes = _fuzz_file()
    picks = data.draw(st.lists(st.sampled_from(planes), min_size=1, max_size=3, unique=True))
    in_place = []  # damage that keeps the old checksum (R1 fails), made after the rewrites
    for name, j, size in picks:
        at = data.draw(st.integers(0, size - 1))
        flip = data.draw(st.integers(1, 255))

        def damage(stored: np.ndarray, at=at, flip=flip) -> np.ndarray:
            stored[at] ^= flip
            return stored

        if data.draw(st.booleans()):
            in_place.append((name, j, at, flip))
        else:
            blob = _rewrite(blob, name, j, damage)
    for name, j, at, flip in in_place:
        p = s4format.Reader(blob).tensors[s4format.Reader(blob).index_of(name)].planes[j]
        b = bytearray(blob)
        b[p.offset + at] ^= flip
        blob = bytes(b)
    r = s4format.Reader(blob, verify=data.draw(st.booleans()))
    cpu = _first_cpu_failure(r)
    try:
        decode.read_tensors(r, list(range(len(r.tensors))))
        gpu = None
    except s4format.S4Error as e:
        gpu = e
    assert (cpu is None) == (gpu is None), (cpu, gpu)
    if cpu is not None:
        (ct, cp), (gt, gp) = _who(cpu), _who(gpu)
        assert ct == gt and ct in {name for name, _j, _s in picks}, (cpu, gpu)
        assert cp is None or gp is None or cp == gp, (cpu, gpu)
        assert type(gpu) is type(cpu) and str(gpu) == str(cpu)  # in the same words


def _rans_plane(r: s4format.Reader, name: str, last: bool = False) -> int:
    t = r.tensors[r.index_of(name)]
    js = [k for k, p in enumerate(t.planes) if p.codec == codecs.RANS
          and int(r.source.read_at(p.offset, 1)[0]) == rans.MODE_RANS]
    return js[-1] if last else js[0]


def _first_cpu_failure(r: s4format.Reader) -> Exception | None:
    for i in range(len(r.tensors)):
        try:
            r.read_raw(i)
        except s4format.S4Error as e:
            return e
    return None


@pytest.mark.parametrize("name", ["ab", "a'b"])
def test_a_tensor_whose_name_holds_a_quote_fails_in_plane_order(name: str) -> None:
    # a corrupt bitstream in an early plane (found after decoding) and a bad header in a later
    # plane (found before): the CPU reader names the early plane, and so does the GPU path,
    # whatever the name's quoting in messages
    blob = _gpu_file({name: _state()["float32.w200000"]})
    r = s4format.Reader(blob)

    def reserved(stored: np.ndarray) -> np.ndarray:
        stored[2] = 1
        return stored

    bad = _rewrite(_rewrite(blob, name, _rans_plane(r, name), flip_last_word), name,
                   _rans_plane(r, name, last=True), reserved)
    cpu = _first_cpu_failure(s4format.Reader(bad))
    with pytest.raises(CodecError) as gpu:
        decode.read_tensors(s4format.Reader(bad), [0])
    assert str(gpu.value) == str(cpu)


@pytest.mark.parametrize("case", ["own hash before the other parent", "parents in child order"])
def test_a_delta_batch_fails_as_the_cpu_reader_reads_it(case: str) -> None:
    # deltas read their parents after the whole batch has decoded: a failure in a parent is
    # put back in the order the CPU reader meets it (each delta: its planes, its parent, its
    # content hash)
    g = torch.Generator().manual_seed(3)
    parents = {f"p{k}": (torch.randn(70_000, generator=g) * 0.02).bfloat16() for k in (0, 1)}
    pblob = _gpu_file(parents)
    pr = s4format.Reader(pblob)
    order = [("c0", "p0"), ("c1", "p1")] if case.startswith("own") else \
        [("c0", "p1"), ("c1", "p0")]
    buf = io.BytesIO()
    with Writer(buf, parent_id=pr.checkpoint_id) as w:
        for cname, pname in order:
            base = parents[pname].view(torch.uint8).numpy().copy()
            x = base.copy()
            x[::1000] ^= 1
            d = torch.from_numpy(np.bitwise_xor(x, base))
            it = encode.Item(dtypes.BY_NAME["bfloat16"], (70_000,), d)
            c = next(iter(encode.Encoder().code([it])))
            wrong = case.startswith("own") and cname == "c0"
            w.add_coded(cname, it.dtype, (70_000,), c.coded,
                        hashing.content_hash(b"wrong" if wrong else x.tobytes()),
                        parent_hash=hashing.content_hash(base.tobytes()))
        w.set_tree([objtree.TensorRef(i) for i in range(2)])
    bad_parent = _rewrite(pblob, "p1", _rans_plane(pr, "p1"), flip_last_word)
    if not case.startswith("own"):
        bad_parent = _rewrite(bad_parent, "p0", _rans_plane(pr, "p0"), flip_last_word)

    def child() -> s4format.Reader:
        r = s4format.Reader(buf.getvalue())
        r.attach_parent(s4format.Reader(bad_parent))
        return r

    cpu = _first_cpu_failure(child())
    assert cpu is not None
    with pytest.raises(s4format.S4Error) as gpu:
        decode.read_tensors(child(), [0, 1])
    assert str(gpu.value) == str(cpu)
    assert ("c0" if case.startswith("own") else "p1") in str(cpu)


def _damage_in_place(blob: bytes, name: str, j: int) -> bytes:
    """The file with one stored byte of plane j of tensor ``name`` changed and its checksum
    left as it was: the plane fails R1."""
    r = s4format.Reader(blob)
    p = r.tensors[r.index_of(name)].planes[j]
    out = bytearray(blob)
    out[p.offset + p.stored_len // 2] ^= 0x5A
    return bytes(out)


@pytest.mark.parametrize("case", ["same tensor", "later tensor"])
def test_checksums_outrank_decode_failures_as_in_the_cpu_reader(case: str) -> None:
    # The rANS planes decode before the host has read the checksums (one synchronisation per
    # group); a checksum failure still outranks every decode failure of its tensor (R1 before
    # R2), and a decode failure of an earlier tensor outranks it.
    s = _state()
    blob = _gpu_file({"a": s["bfloat16.w200000"], "b": s["float32.w200000"]})
    r = s4format.Reader(blob)
    corrupt = _rans_plane(r, "a")
    blob = _rewrite(blob, "a", corrupt, flip_last_word)  # checksum made: R2 fails
    other = "a" if case == "same tensor" else "b"
    j = next(k for k, p in enumerate(r.tensors[r.index_of(other)].planes)
             if p.stored_len and (other, k) != ("a", corrupt))
    bad = s4format.Reader(_damage_in_place(blob, other, j))
    cpu = _first_cpu_failure(bad)
    want = ChecksumError if case == "same tensor" else CodecError
    assert type(cpu) is want, cpu
    # the group's own decode (no CPU re-read) and the reading API name the same failure
    outs = [torch.empty(t.nbytes, dtype=torch.uint8) for t in (s["bfloat16.w200000"],
                                                                 s["float32.w200000"])]
    with pytest.raises(s4format.S4Error) as staged:
        decode.decode_staged(decode.stage(bad, [0, 1]), outs)
    with pytest.raises(s4format.S4Error) as got:
        decode.read_tensors(bad, [0, 1])
    for e in (staged.value, got.value):
        assert type(e) is want and _who(e) == _who(cpu), (cpu, e)


@pytest.mark.parametrize("corrupt", [True, False])
def test_a_tensor_over_the_size_limit_fails_after_the_tensors_before_it(corrupt: bool) -> None:
    # R0 is checked for the whole batch before anything is allocated; a tensor over the limit
    # is still reported only after the tensors before it are read, as the CPU reader reads them
    s = _state()
    blob = _gpu_file({"a": s["bfloat16.w200000"], "b": s["float32.w200000"]})
    if corrupt:
        blob = _rewrite(blob, "a", _rans_plane(s4format.Reader(blob), "a"), flip_last_word)
    r = s4format.Reader(blob, max_tensor_bytes=500_000)  # a: 400,000 raw bytes; b: 800,000
    cpu = _first_cpu_failure(r)
    with pytest.raises(s4format.S4Error) as got:
        decode.read_tensors(r, [0, 1])
    want = CodecError if corrupt else s4format.LimitError
    assert type(cpu) is want and type(got.value) is want, (cpu, got.value)
    assert _who(got.value)[0] == _who(cpu)[0] == ("a" if corrupt else "b")


def _delta_pair(corrupt_child: bool = False) -> tuple[bytes, bytes]:
    """(parent file, delta file) of one 300,000-element bf16 tensor, "p" and its delta "c",
    both written by the GPU encoder; ``corrupt_child``: one word of the delta's rANS stream
    flipped, its checksum made for it (only decoding finds it)."""
    g = torch.Generator().manual_seed(4)
    n = 300_000
    base = (torch.randn(n, generator=g) * 0.02).bfloat16()
    pblob = _gpu_file({"p": base})
    b = base.view(torch.uint8).numpy().copy()
    x = b.copy()
    x[::777] ^= 3
    it = encode.Item(dtypes.BY_NAME["bfloat16"], (n,), torch.from_numpy(np.bitwise_xor(x, b)))
    planes = list(next(iter(encode.Encoder().code([it]))).coded.planes)
    if corrupt_child:
        j = next(k for k, p in enumerate(planes) if p.codec == codecs.RANS
                 and int(np.asarray(p.payload)[0]) == rans.MODE_RANS)
        planes[j] = CodedPlane(planes[j].kind, planes[j].index, planes[j].codec,
                               planes[j].decoded_len,
                               flip_last_word(np.array(planes[j].payload, np.uint8)))
    buf = io.BytesIO()
    with Writer(buf, parent_id=s4format.Reader(pblob).checkpoint_id) as w:
        w.add_coded("c", it.dtype, (n,), CodedTensor(layouts.BF16, tuple(planes)),
                    hashing.content_hash(x.tobytes()),
                    parent_hash=hashing.content_hash(b.tobytes()))
        w.set_tree([objtree.TensorRef(0)])
    return pblob, buf.getvalue()


@pytest.mark.parametrize("child_corrupt", [True, False])
def test_a_chunked_delta_fails_as_the_cpu_reader_reads_it(child_corrupt: bool) -> None:
    # the chunked loader (tensors larger than the workspace) checks a parent's planes before
    # decoding anything; a delta's own corrupt bitstream is still reported first, as the CPU
    # reader meets it (the delta's planes, then its parent)
    from s4weights.gpu import decode_large

    pblob, blob = _delta_pair(child_corrupt)
    n = 300_000
    bad_parent = _damage_in_place(pblob, "p", 1)

    def child() -> s4format.Reader:
        return s4format.Reader(blob, parent=s4format.Reader(bad_parent))

    cpu = _first_cpu_failure(child())
    assert type(cpu) is (CodecError if child_corrupt else ChecksumError), cpu
    with pytest.raises(s4format.S4Error) as got:
        decode_large.load_large(child(), 0, torch.empty(2 * n, dtype=torch.uint8), 1 << 16)
    assert type(got.value) is type(cpu) and _who(got.value) == _who(cpu), (cpu, got.value)


@pytest.mark.parametrize("layout", ["raw", "bf16"])
def test_an_empty_plane_with_a_wrong_checksum_is_refused(layout: str) -> None:
    # an empty plane's checksum is the hash of its length alone; a group of nothing else has
    # no leaves to hash, and is checked all the same
    if layout == "raw":
        lay, planes = layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, codecs.RAW, 0,
                                               np.zeros(0, np.uint8), checksum=12345),)
    else:
        lay = layouts.BF16
        planes = (CodedPlane(layouts.KIND_SIGN, 0, codecs.RAW, 0, np.zeros(0, np.uint8),
                             checksum=12345),
                  CodedPlane(layouts.KIND_EXPONENT, 0, codecs.RAW, 0, np.zeros(0, np.uint8)),
                  CodedPlane(layouts.KIND_MANTISSA, 0, codecs.RAW, 0, np.zeros(0, np.uint8)))
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.add_coded("e", dtypes.BY_NAME["bfloat16"], (0,), CodedTensor(lay, planes),
                    hashing.content_hash(b""))
        w.set_tree([objtree.TensorRef(0)])
    r = s4format.Reader(buf.getvalue())
    with pytest.raises(ChecksumError):
        r.read_raw(0)
    assert decode.decodable(r, 0)
    with pytest.raises(ChecksumError, match="tensor 'e' plane"):
        decode.read_tensors(r, [0])


def test_a_header_failure_outranks_a_later_tensors_checksum_failure() -> None:
    # a bad stream header (found on the host before any kernel) in tensor a, a damaged plane
    # (checksum kept) in tensor b: the group's own decode names a, as the CPU reader does
    s = _state()
    blob = _gpu_file({"a": s["float32.w200000"], "b": s["bfloat16.w200000"]})
    r = s4format.Reader(blob)

    def reserved(stored: np.ndarray) -> np.ndarray:
        stored[2] = 1
        return stored

    blob = _rewrite(blob, "a", _rans_plane(r, "a"), reserved)
    bad = s4format.Reader(_damage_in_place(blob, "b", 1))
    cpu = _first_cpu_failure(bad)
    assert type(cpu) is CodecError and _who(cpu)[0] == "a", cpu
    outs = [torch.empty(t.nbytes, dtype=torch.uint8) for t in (s["float32.w200000"],
                                                                 s["bfloat16.w200000"])]
    with pytest.raises(CodecError) as staged:
        decode.decode_staged(decode.stage(bad, [0, 1]), outs)
    assert _who(staged.value) == _who(cpu), (staged.value, cpu)


def test_a_chunked_delta_names_a_parent_with_a_wrong_content_hash() -> None:
    # a parent whose planes decode (checksums made) to bytes that miss its content hash: the
    # CPU reader names the parent (read, and checked, before the delta's own hash); so must
    # the chunked loader, which builds each chunk from the parent up
    from s4weights.gpu import decode_large

    pblob, blob = _delta_pair()
    n = 300_000
    pr = s4format.Reader(pblob)
    j = next(k for k, p in enumerate(pr.tensors[0].planes)
             if p.codec in (codecs.RAW, codecs.BITPACK))

    def flip_bit(stored: np.ndarray) -> np.ndarray:
        stored[5] ^= 1
        return stored

    bad_parent = _rewrite(pblob, "p", j, flip_bit)

    def child() -> s4format.Reader:
        return s4format.Reader(blob, parent=s4format.Reader(bad_parent))

    cpu = _first_cpu_failure(child())
    assert type(cpu) is ContentHashError and _who(cpu)[0] == "p", cpu
    for workspace in (1 << 16, 1 << 30):  # many chunks, one
        with pytest.raises(ContentHashError) as got:
            decode_large.load_large(child(), 0, torch.empty(2 * n, dtype=torch.uint8), workspace)
        assert _who(got.value)[0] == "p", got.value


def test_content_roots_digest_what_no_merge_did_and_root_it_all() -> None:
    # a merged tensor's full leaves are digested by the merge kernel (into the slots after its
    # length's); content_roots digests the rest (every leaf of a tensor nothing merged, a
    # merged tensor's last partial leaf) into their slots and roots every tensor (XXH3-128)
    from s4format import hashing
    from s4format.hashing import LEAF_SIZE

    rng = np.random.default_rng(5)
    sizes = [0, 100, LEAF_SIZE, LEAF_SIZE + 1, 3 * LEAF_SIZE + 5, 200_000, 2 * LEAF_SIZE]
    merged = np.array([True, True, True, True, False, True, False])
    data = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    nbytes = np.array(sizes, np.int64)
    first = np.concatenate(([0], np.cumsum(-(-nbytes // LEAF_SIZE))))
    for wrong in (None, 5):  # a merge's digest the roots must take as it is, not redo
        cd = torch.full((int(first[-1]) + len(sizes),), 0x5A5A, dtype=torch.int64)
        slots = cd.numpy().view(np.uint64)
        for k, d in enumerate(data):
            b = d.numpy().tobytes()
            if merged[k]:
                for j in range(sizes[k] // LEAF_SIZE):
                    slots[first[k] + k + 1 + j] = xxhash.xxh3_64_intdigest(
                        b[j * LEAF_SIZE:(j + 1) * LEAF_SIZE]) ^ int(k == wrong)
        roots = decode_group.content_roots([d.data_ptr() for d in data], nbytes, first, merged, cd)
        got = roots.numpy().view(np.uint8)[:16 * len(sizes)].tobytes()
        for k, d in enumerate(data):
            ok = got[16 * k:16 * (k + 1)] == hashing.content_hash(d.numpy().tobytes())
            assert ok == (k != wrong), k


@pytest.mark.parametrize("path", ["batch", "chunks"])
def test_a_field_overflow_is_named_by_field_on_both_gpu_paths(path: str) -> None:
    # the merge flags the tensor, not the field: the CPU reader, reading it on this error path
    # only, words the failure (which field, how many bits), in the batch and the chunked loader
    from s4weights.gpu import decode_large

    blob = _gpu_file({"b": _state()["bfloat16.zeros"]})
    t = s4format.Reader(blob).tensors[0]
    j = next(k for k, p in enumerate(t.planes) if p.kind == layouts.KIND_MANTISSA)

    def wide(stored: np.ndarray) -> np.ndarray:
        stored[rans.HEADER_SIZE] = 0x80  # a CONST block of 0x80: bf16's mantissa has 7 bits
        return stored

    bad = _rewrite(blob, "b", j, wide)
    with pytest.raises(s4format.FormatError) as cpu:
        s4format.Reader(bad).read_raw(0)
    r = s4format.Reader(bad)
    with pytest.raises(s4format.FormatError, match=r"mantissa0 plane holds values wider than "
                                                   r"its 7 bits$") as gpu:
        if path == "batch":
            decode.read_tensors(r, [0])
        else:
            decode_large.load_large(r, 0, torch.empty(r.tensors[0].raw_nbytes, dtype=torch.uint8),
                               1 << 16)
    assert str(gpu.value) == str(cpu.value)


def test_a_delta_decodes_on_the_gpu_once_its_parent_is_attached() -> None:
    # what a record says is kept per reader, from its first answer on; whether a delta's
    # parent is attached is asked at each call
    blobs, parent_id = [], None
    for level in range(2):
        buf = io.BytesIO()
        with Writer(buf, parent_id=parent_id) as w:
            w.add_coded("w", dtypes.BY_NAME["bfloat16"], (64,), CodedTensor(layouts.RAW, (
                CodedPlane(layouts.KIND_RAW, 0, codecs.RAW, 128, np.zeros(128, np.uint8)),)),
                hashing.content_hash(bytes(128)),
                parent_hash=None if level == 0 else hashing.content_hash(bytes(128)))
            w.set_tree({"w": objtree.TensorRef(0)})
        blobs.append(buf.getvalue())
        parent_id = s4format.Reader(blobs[-1]).checkpoint_id
    r = s4format.Reader(blobs[1])
    assert r.tensors[0].is_delta and not decode.decodable(r, 0)
    r.attach_parent(blobs[0])
    assert decode.decodable(r, 0)
