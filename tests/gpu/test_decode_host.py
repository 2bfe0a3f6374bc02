"""The GPU decoder's host checks before any kernel runs (``decode._prepare``), without a GPU:
device buffers are CPU tensors and nothing is launched (a check that fails raises before the
launches; a batch that passes builds the merge inputs). Every malformed stored form
``plane_form_error`` knows and the reader's index checks let through (lengths a codec cannot
produce are refused there) is refused with a message naming the tensor and the plane, and a
batch with several reports the first plane in file order, as the CPU reader meets them.
The GPU tests (test_gpu_small, test_gpu_codec) cover the same on the device for real."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import s4format
from s4format import codecs, dtypes, hashing, layouts, objtree
from s4format.codecs import rans
from s4format.errors import CodecError
from s4format.writer import CodedPlane, CodedTensor, Writer
from s4weights.gpu import decode, runtime

N = 1001  # elements: the packed sign plane has 5 padding bits


class _Torch:
    """torch, with device tensors made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*a, device=None, pin_memory=False, **k):
        return torch.empty(*a, **k)


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(decode, "torch", _Torch())
    monkeypatch.setattr(runtime, "torch", _Torch())
    monkeypatch.setattr(runtime, "pinned", lambda n: torch.empty(max(n, 1), dtype=torch.uint8))


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
    return decode._prepare(st, outs, st.device.data_ptr(), [])


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
    assert packed.tolist() == [1, 1]  # bitpacked signs
    assert not copies                 # no raw-layout tensors
    assert rb.q.tolist() == [1, 4]    # the two exponent planes go to the rANS kernel
    # the mantissa planes are read in place: their offset in the staged buffer
    base = st.device.data_ptr()
    for k, q in ((0, 2), (1, 5)):
        assert int(ptrs[k, 2]) - int(ptrs[k, 0]) == int(st.at[q] - st.at[q - 2])
    del base
