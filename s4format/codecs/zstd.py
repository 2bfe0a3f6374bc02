"""Codec 3, ``zstd``: one Zstandard frame (RFC 8878) holding the whole plane.

The frame must declare its content size, equal to the plane's decoded length, and a window of
at most 2^27 bytes; the reader checks both before decompressing, so a hostile frame cannot make
it allocate more than declared.
Parameter bytes (optional, ignored by readers): one signed byte, the compression level used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import zstandard

from s4format.codecs.abc import Codec, Encoded
from s4format.codecs.registry import ZSTD, register
from s4format.codecs.view import PlaneView
from s4format.errors import CodecError

# RFC 8878: a block holds at most 128 KiB; the smallest block (an RLE block) takes 4 bytes.
_MAX_EXPANSION = (128 * 1024) // 4
_FRAME_SLACK = 18
_SAMPLES, _SAMPLE = 8, 64 * 1024
_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_WINDOW = 1 << 27  # Window_Size as the frame header gives it (spec/codecs.md §3)
# Planes under SMALL bytes are coded at SMALL_LEVEL at least: they cost little at any level, and
# level 1 undercuts rANS on tiny exponent planes (2 KiB of bf16 weights: 808 bytes against 836;
# level 3: 864), which would send them to a coder the GPU decoder does not read.
SMALL, SMALL_LEVEL = 64 << 10, 3


class ZstdCodec(Codec):
    codec_id = ZSTD
    name = "zstd"

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._local = threading.local()

    def _per_thread(self, name: str, make):
        # one per thread: zstandard's (de)compressors may not be used by two threads at once
        obj = getattr(self._local, name, None)
        if obj is None:
            obj = make()
            setattr(self._local, name, obj)
        return obj

    def level_for(self, nbytes: int) -> int:
        """The level a plane of ``nbytes`` is coded at."""
        return self.level if nbytes >= SMALL else max(self.level, SMALL_LEVEL)

    def _compressor(self, level: int) -> zstandard.ZstdCompressor:
        # (by level: the conformance generator writes its frozen vectors at the level they had)
        return self._per_thread(f"compressor_{level}", lambda: zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=False))

    def encode(self, plane: np.ndarray) -> Encoded:
        plane = np.ascontiguousarray(plane)
        level = self.level_for(plane.nbytes)
        return Encoded(self._compressor(level).compress(plane.data), bytes([level & 0xFF]))

    @property
    def _decompressor(self) -> zstandard.ZstdDecompressor:
        return self._per_thread("decompressor", zstandard.ZstdDecompressor)

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        if len(params) > 1:
            raise CodecError(f"zstd parameters are at most 1 byte, got {len(params)}")
        buf = np.ascontiguousarray(payload if isinstance(payload, np.ndarray)
                                   else np.frombuffer(payload, np.uint8), np.uint8)
        if bytes(buf[:4]) != _FRAME_MAGIC:
            raise CodecError("zstd plane does not start with a Zstandard frame")
        try:
            declared = zstandard.frame_content_size(buf)
            window = zstandard.get_frame_parameters(buf).window_size
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd frame header is invalid: {exc}") from None
        if declared != decoded_len:
            raise CodecError(f"zstd frame declares {declared} content bytes, plane declares "
                             f"{decoded_len} (-1 means the frame omits its size)")
        if window > MAX_WINDOW:
            raise CodecError(f"zstd frame declares a window of {window} bytes, over the "
                             f"format's {MAX_WINDOW}")
        if declared == 0:  # (decompress() returns at once for these, reading no block)
            if _stream(buf):
                raise CodecError("zstd frame declares 0 content bytes but its blocks hold more")
            return np.zeros(0, np.uint8)
        # One call into an output of the declared size (checked above), refusing bytes after
        # the frame; streaming it through decompressobj took 10-30x longer on sparse planes.
        try:
            out = self._decompressor.decompress(buf, allow_extra_data=False)
        except zstandard.ZstdError:
            _stream(buf)
            raise CodecError("zstd stream is corrupt") from None
        if len(out) != decoded_len:
            raise CodecError(f"zstd produced {len(out)} bytes, expected {decoded_len}")
        return np.frombuffer(out, dtype=np.uint8)

    def max_decoded_len(self, stored_len: int) -> int:
        return stored_len * _MAX_EXPANSION + _FRAME_SLACK

    def estimate_view(self, view: PlaneView) -> int:
        if view.size <= _SAMPLES * _SAMPLE:  # exact: the encoding itself, kept for the encode
            enc = view.memo.get(self.codec_id)  # (a view's bytes never change)
            if enc is None:
                enc = view.memo[self.codec_id] = self.encode(view.bytes())
            return enc.nbytes
        return self._sampled(view.size, view.bytes_at)

    def encode_view(self, view: PlaneView) -> Encoded:
        enc = view.memo.get(self.codec_id)
        return enc if enc is not None else self.encode(view.bytes())

    def estimate(self, plane: np.ndarray) -> int:
        """Exact up to 8 samples' worth; above, 64 KiB samples at the middles of 8 equal
        strips, compressed on their own and scaled (pessimistic: the whole plane can match
        across samples)."""
        n = plane.size
        if n <= _SAMPLES * _SAMPLE:
            return self.encode(plane).nbytes
        return self._sampled(n, lambda lo, hi: plane[lo:hi])

    def _sampled(self, n: int, part: Callable[[int, int], np.ndarray]) -> int:
        """:meth:`estimate` of an ``n``-byte plane above 8 samples, whose bytes [lo, hi)
        ``part`` gives."""
        # (not at the plane's ends: an embedding's first and last rows, special tokens, can
        # compress far better than the rest; MiniLM-L6's fp32 embedding sampled there was
        # estimated 10.17 MB for a low mantissa plane that one frame codes in 11.44 MB)
        starts = (np.arange(_SAMPLES) * 2 + 1) * (n // (2 * _SAMPLES)) - _SAMPLE // 2
        coder = self._compressor(self.level_for(n))
        stored = sum(len(coder.compress(np.ascontiguousarray(part(s, s + _SAMPLE)).data))
                     for s in starts.tolist())
        return n * stored // (_SAMPLES * _SAMPLE)


def _stream(buf: np.ndarray) -> bytes:
    """The frame decoded by streaming it, which tells a truncated frame and bytes after it
    apart from corruption (and reads the blocks of a frame that declares no content)."""
    dec = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = dec.decompress(buf)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd stream is corrupt: {exc}") from None
    if not dec.eof:
        raise CodecError("zstd frame is truncated")
    if dec.unused_data:
        raise CodecError(f"{len(dec.unused_data)} bytes follow the zstd frame")
    return out


register(ZstdCodec())
