"""Codec 6, ``nvcomp-ans`` (``spec/codecs.md``): nvCOMP's own ANS bitstream, written only under
the explicit policy ``"nvcomp-ans"``, for users who accept files that only a machine with an
NVIDIA GPU and nvCOMP can read.

A tensor is stored with the raw layout as one plane of nvCOMP's output (float mode for 2- and
4-byte floats, byte mode otherwise; ``params`` names the mode), or raw where that is not
smaller. :func:`register` makes the codec readable where nvCOMP runs; elsewhere such a file
raises ``UnsupportedCodecError``. nvCOMP's bitstream is undocumented: the plane checksum is
checked before nvCOMP sees a byte, but a hostile payload with a valid checksum is parsed by
nvCOMP itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs.abc import Codec, Encoded
from s4format.errors import CodecError
from s4format.writer import SPLIT_MIN, CodedPlane, CodedTensor
from s4weights.gpu import device
from s4weights.gpu.items import Coded

# params byte -> nvCOMP data_type, and the torch dtype its input is viewed as (same bits)
MODES = {0: ("|u1", torch.uint8), 1: ("<f2", torch.float16), 2: ("<f4", torch.float32)}
POLICY = "nvcomp-ans"


@functools.cache
def available() -> bool:
    """The GPU path is available and nvCOMP's Python package imports."""
    if not device.available():
        return False
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def mode_for(dtype_name: str, itemsize: int) -> int:
    """Float mode for 2- and 4-byte floating dtypes, byte mode otherwise."""
    if dtype_name in ("bfloat16", "float16") and itemsize == 2:
        return 1
    if dtype_name == "float32":
        return 2
    return 0


def _codec(mode: int):
    """nvCOMP's ANS codec for ``mode`` on torch's current stream (one per mode, stream and
    device: building one costs more than coding a small tensor)."""
    return _codec_on(mode, torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())


@functools.lru_cache(maxsize=32)
def _codec_on(mode: int, stream: int, device: int):
    from nvidia import nvcomp

    return nvcomp.Codec(algorithm="ANS", data_type=MODES[mode][0], cuda_stream=stream)


def _as_bytes(arr) -> torch.Tensor:
    """An nvCOMP array on the device as a flat uint8 torch tensor (no copy)."""
    t = torch.as_tensor(arr, device="cuda")
    return t.reshape(-1).view(torch.uint8)


def encode(data: torch.Tensor, mode: int) -> torch.Tensor:
    """nvCOMP ANS bitstream of flat uint8 device bytes ``data`` (a new device tensor)."""
    from nvidia import nvcomp

    word = MODES[mode][1]
    view = data.view(word) if data.numel() % torch.empty(0, dtype=word).element_size() == 0 \
        else data
    comp = _codec(mode).encode(nvcomp.as_array(view, torch.cuda.current_stream().cuda_stream))
    out = _as_bytes(comp)
    return out[:int(comp.buffer_size)]


def decode_into(payload: torch.Tensor, decoded_len: int, params: bytes,
                out: torch.Tensor, where: str) -> None:
    """Decode a codec-6 payload (flat uint8 device bytes) into ``out`` (``decoded_len`` flat
    uint8 device bytes)."""
    from nvidia import nvcomp

    if len(params) != 1 or params[0] not in MODES:
        raise CodecError(f"{where}: nvcomp-ans parameters must be one byte 0, 1 or 2")
    if payload.numel() == 0:
        raise CodecError(f"{where}: empty nvcomp-ans payload")
    try:
        got = _codec(params[0]).decode(
            nvcomp.as_array(payload.contiguous(), torch.cuda.current_stream().cuda_stream))
        b = _as_bytes(got)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CodecError(f"{where}: nvCOMP could not decode the nvcomp-ans payload: "
                         f"{exc}") from None
    if b.numel() != decoded_len:
        raise CodecError(f"{where}: nvcomp-ans payload decodes to {b.numel()} bytes, "
                         f"declared {decoded_len}")
    out.copy_(b)


class NvcompAnsCodec(Codec):
    """Codec 6 for ``s4format``'s registry: a round trip through the device."""

    codec_id = codecs.NVCOMP_ANS
    name = "nvcomp-ans"

    def encode(self, plane: np.ndarray) -> Encoded | None:
        data = torch.from_numpy(np.ascontiguousarray(plane, np.uint8)).cuda()
        comp = encode(data, 0)
        if comp.numel() >= plane.size:
            return None
        return Encoded(comp.cpu().numpy(), bytes([0]))

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        out = torch.empty(decoded_len, dtype=torch.uint8, device="cuda")
        decode_into(torch.from_numpy(np.ascontiguousarray(payload, np.uint8)).cuda(),
                    decoded_len, params, out, "nvcomp-ans plane")
        return out.cpu().numpy()

    def max_decoded_len(self, stored_len: int) -> int:
        # nvCOMP documents no expansion bound for ANS; spec/codecs.md defines none for codec 6,
        # so the reader's per-tensor allocation cap (rule R0) is what bounds it.
        return (1 << 63) - 1


def register() -> bool:
    """Add codec 6 to ``s4format``'s registry where it can run; True if it is there."""
    if not available():
        return False
    if codecs.NVCOMP_ANS not in codecs.available():
        codecs.register(NvcompAnsCodec())
    return True


def code(items) -> Iterator:
    """``Encoder.code`` for the ``nvcomp-ans`` policy: one ``Coded`` per item, in order."""
    from s4weights.gpu import runtime
    from s4weights.gpu.hash import content_hashes_from_leaves, plane_checksums_from_leaves

    for it in items:
        data = it.data.reshape(-1)
        n = it.nbytes
        stored, codec, params = data, codecs.RAW, b""
        if n >= SPLIT_MIN:
            mode = mode_for(it.dtype.name, it.dtype.itemsize)
            comp = encode(data, mode)
            if comp.numel() < n:
                stored, codec, params = comp, codecs.NVCOMP_ANS, bytes([mode])
        m = int(stored.numel())
        # content hash of the raw bytes and checksum of the stored ones, hashed on the device
        dig, first = runtime.leaf_digests([data.data_ptr(), stored.data_ptr()], [n, m])
        d = dig[:int(first[-1])].cpu().numpy().view(np.uint64)
        content = content_hashes_from_leaves([n], d[:int(first[1])], first[:2])[0]
        checksum = plane_checksums_from_leaves([m], d[int(first[1]):], first[1:] - first[1])[0]
        plane = CodedPlane(layouts.KIND_RAW, 0, codec, n, stored.cpu().numpy(), params, checksum)
        yield Coded(CodedTensor(layouts.RAW, (plane,)), content)


class Encoder:
    """The ``nvcomp-ans`` policy's coder, with ``s4weights.gpu.encode.Encoder``'s interface."""

    def code(self, items) -> Iterator:
        return code(items)
