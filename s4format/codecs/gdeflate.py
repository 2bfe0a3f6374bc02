"""Codec 5, ``gdeflate``: a plane cut into 64 KiB pages, each one raw GDeflate stream or stored
verbatim, behind a page table (``spec/gdeflate.md``).

This module owns the page-table layout and its validation, and the ctypes binding to nvCOMP's
CPU library (``libnvcomp_cpu.so`` from the ``nvidia-libnvcomp-cu12`` wheel, which needs no CUDA).
The library is found lazily on first use, so importing this module never fails: without it the
registered codec declines every plane (``encode`` returns ``None``) and ``decode`` raises
:class:`~s4format.errors.UnsupportedCodecError` naming the extra to install.

Invariants:

* the page table is checked in full before the library sees a byte;
* the library's decoder reads past the end of the stream it is given (measured: a truncated page
  segfaults against a guard page), so every page is decoded from a scratch buffer holding the
  page followed by ``_INPUT_PAD`` zero bytes, re-zeroed between pages;
* decoding goes through the C entry point ``libdeflate_gdeflate_decompress``, which returns a
  status, not the header's C++ ``decompressCPU``, which throws through ctypes and so aborts the
  process on the first corrupt page;
* the compressor is never handed an empty page (the library dies of SIGFPE on one).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from s4format.codecs.abc import Codec, Encoded
from s4format.codecs.registry import GDEFLATE, register
from s4format.codecs.view import PlaneView
from s4format.errors import CodecError, UnsupportedCodecError

PAGE_LOG2 = 16
PAGE_SIZE = 1 << PAGE_LOG2
# Payload header: page_log2 u8, reserved u8 (0), reserved u16 (0), page_count u32 -- 8 bytes, so
# the u32 page table after it stays 4-aligned for a GPU reader.
_HEADER = struct.Struct("<BBHI")
RAW_PAGE = 1 << 31
_SIZE_MASK = RAW_PAGE - 1
# Smallest bytes a page can cost: its table entry plus one stored byte (spec: max_decoded_len).
_MIN_PAGE_COST = 4 + 1

DEFAULT_LEVEL = 1  # measured: levels 1-6 give the same mantissa ratio; 1 is the fastest
MIN_LEVEL, MAX_LEVEL = 0, 12  # nvcomp/native/gdeflate_cpu.h
# Pages compressed per library call: bounds the workspace at about 16 MiB for any plane size.
_BATCH_PAGES = 256
# Zero bytes after each page in the decoder's input. Measured (spec/gdeflate.md, section 7):
# behind hostile 64 KiB pages 32 KiB of zeros was sometimes overrun, 64 KiB never was; twice
# that keeps the library's over-read inside our buffer with margin.
_INPUT_PAD = 2 * PAGE_SIZE
# Pages sampled by estimate() on planes larger than this many pages.
_ESTIMATE_PAGES = 8

ENV_LIBRARY = "S4_NVCOMP_CPU_LIB"
INSTALL_HINT = "pip install 's4weights[gdeflate]'"

# libdeflate_result (the GDeflate fork of libdeflate that nvCOMP's CPU library exports).
_LIBDEFLATE_STATUS = {0: "success", 1: "bad data", 2: "short output", 3: "insufficient space"}

# Itanium-ABI names of the functions in nvcomp/native/gdeflate_cpu.h (size_t is unsigned long
# on the LP64 Linux targets the wheel ships for).
_SYM_MAX_OUTPUT = "_ZN6nvcomp8gdeflate32compressCPUGetMaxOutputChunkSizeEmPm"
_SYM_COMPRESS = "_ZN6nvcomp8gdeflate11compressCPUEPKPKvPKmmmPKPvPmi"
_SYM_ALLOC_DEC = "libdeflate_alloc_gdeflate_decompressor"
_SYM_FREE_DEC = "libdeflate_free_gdeflate_decompressor"
_SYM_DECOMPRESS = "libdeflate_gdeflate_decompress"


class _InPage(ctypes.Structure):
    _fields_ = (("data", ctypes.c_void_p), ("nbytes", ctypes.c_size_t))


class NvcompCpu:
    """The few entry points of ``libnvcomp_cpu.so`` this codec calls, typed for ctypes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
        size_t, vp = ctypes.c_size_t, ctypes.c_void_p
        try:
            self._max_output = _typed(lib, _SYM_MAX_OUTPUT, None, size_t, ctypes.POINTER(size_t))
            self._compress = _typed(lib, _SYM_COMPRESS, None, vp, vp, size_t, size_t, vp, vp,
                                    ctypes.c_int)
            self._alloc = _typed(lib, _SYM_ALLOC_DEC, vp)
            self._free = _typed(lib, _SYM_FREE_DEC, None, vp)
            self._decompress = _typed(lib, _SYM_DECOMPRESS, ctypes.c_int, vp,
                                      ctypes.POINTER(_InPage), size_t, vp, size_t,
                                      ctypes.POINTER(size_t))
        except AttributeError as exc:
            raise OSError(f"{path} lacks a GDeflate entry point this codec needs ({exc}); "
                          "it is not a compatible nvCOMP CPU library") from None
        bound = ctypes.c_size_t()
        self._max_output(PAGE_SIZE, ctypes.byref(bound))
        # The library's own bound is too small: incompressible pages were measured at 65,724
        # bytes against a bound of 65,708, corrupting the heap. Deflate codes are at most 15
        # bits per 8-bit literal, so twice the page plus slack holds any stream.
        self.max_stream_len = max(bound.value, 2 * PAGE_SIZE + 4096)

    def compress_pages(self, plane: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
        """GDeflate every page of ``plane``: ``(streams, sizes)``, page i's stream at
        ``streams[i * max_stream_len:][:sizes[i]]``."""
        n = -(-plane.size // PAGE_SIZE)
        in_bytes = np.full(n, PAGE_SIZE, dtype=np.uint64)
        in_bytes[-1] = plane.size - (n - 1) * PAGE_SIZE
        in_ptrs = np.arange(n, dtype=np.uint64) * PAGE_SIZE + plane.ctypes.data
        streams = np.empty(n * self.max_stream_len, dtype=np.uint8)
        out_ptrs = np.arange(n, dtype=np.uint64) * self.max_stream_len + streams.ctypes.data
        sizes = np.zeros(n, dtype=np.uint64)
        self._compress(in_ptrs.ctypes.data, in_bytes.ctypes.data, PAGE_SIZE, n,
                       out_ptrs.ctypes.data, sizes.ctypes.data, level)
        if n and int(sizes.max()) > self.max_stream_len:
            raise RuntimeError(f"nvCOMP wrote a {int(sizes.max())}-byte page stream into a "
                               f"{self.max_stream_len}-byte slot: memory is corrupt")
        return streams, sizes

    def new_decompressor(self) -> int:
        handle = self._alloc()
        if not handle:
            raise MemoryError("nvCOMP could not allocate a GDeflate decompressor")
        return handle

    def free_decompressor(self, handle: int) -> None:
        self._free(handle)

    def decompress_page(self, handle: int, src: np.ndarray, src_len: int,
                        dst: np.ndarray) -> tuple[int, int]:
        """Decode ``src[:src_len]`` into ``dst``; returns ``(status, bytes written)``.

        ``src`` must hold ``_INPUT_PAD`` zero bytes after ``src_len`` (see module docstring)."""
        page = _InPage(src.ctypes.data, src_len)
        # The library adds to this count rather than setting it.
        written = ctypes.c_size_t(0)
        status = self._decompress(handle, ctypes.byref(page), 1, dst.ctypes.data, dst.size,
                                  ctypes.byref(written))
        return status, written.value


def _typed(lib: ctypes.CDLL, name: str, restype: object, *argtypes: object):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


def find_library() -> Path | None:
    """``$S4_NVCOMP_CPU_LIB`` if set, else ``libnvcomp_cpu.so*`` inside the installed
    ``nvidia.libnvcomp`` package; ``None`` when neither exists."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return Path(override)
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("lib64", "lib"):
            hits = sorted(Path(root, "libnvcomp", sub).glob("libnvcomp_cpu.so*"))
            if hits:
                return hits[-1]
    return None


def load_library() -> NvcompCpu:
    """Find and bind nvCOMP's CPU library, or raise :class:`UnsupportedCodecError` saying how
    to get it."""
    path = find_library()
    if path is None:
        raise UnsupportedCodecError(
            f"codec 'gdeflate' (ID {GDEFLATE}) needs nvCOMP's CPU library, which is not "
            f"installed; install it with {INSTALL_HINT} (or point ${ENV_LIBRARY} at "
            "libnvcomp_cpu.so)")
    try:
        return NvcompCpu(path)
    except OSError as exc:
        raise UnsupportedCodecError(
            f"codec 'gdeflate' (ID {GDEFLATE}) could not load nvCOMP's CPU library from "
            f"{path}: {exc}; reinstall it with {INSTALL_HINT}") from None


def page_count(decoded_len: int) -> int:
    return -(-decoded_len // PAGE_SIZE)


def parse_page_table(payload: np.ndarray, decoded_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Check the header and page table against ``decoded_len`` and the payload length;
    returns ``(entries, offsets)``: page i's stored bytes are
    ``payload[offsets[i]:offsets[i + 1]]``, raw when ``entries[i] & RAW_PAGE``."""
    if payload.size < _HEADER.size:
        raise CodecError(f"gdeflate payload is {payload.size} bytes, shorter than its "
                         f"{_HEADER.size}-byte header")
    log2, reserved8, reserved16, count = _HEADER.unpack_from(payload.tobytes()[:_HEADER.size])
    if log2 != PAGE_LOG2:
        raise CodecError(f"gdeflate page size 2**{log2} is not the 2**{PAGE_LOG2} of .s4w v1")
    if reserved8 or reserved16:
        raise CodecError("gdeflate header reserved fields are not zero")
    if count != page_count(decoded_len):
        raise CodecError(f"gdeflate payload has {count} pages; a {decoded_len}-byte plane "
                         f"needs {page_count(decoded_len)}")
    body = _HEADER.size + 4 * count
    if payload.size < body:
        raise CodecError(f"gdeflate page table of {count} pages needs {body} bytes, payload "
                         f"has {payload.size}")
    entries = payload[_HEADER.size:body].view("<u4").astype(np.int64)
    sizes = entries & _SIZE_MASK
    raw = (entries & RAW_PAGE) != 0
    page_lens = np.full(count, PAGE_SIZE, dtype=np.int64)
    if count:
        page_lens[-1] = decoded_len - (count - 1) * PAGE_SIZE
    bad_raw = raw & (sizes != page_lens)
    bad_coded = ~raw & ((sizes == 0) | (sizes >= page_lens))
    if bad_raw.any() or bad_coded.any():
        i = int(np.flatnonzero(bad_raw | bad_coded)[0])
        kind = "raw" if raw[i] else "GDeflate"
        rule = "equal" if raw[i] else "be at least 1 and shorter than"
        raise CodecError(f"gdeflate page {i}: {kind} size {int(sizes[i])} must {rule} its "
                         f"{int(page_lens[i])} decoded bytes")
    offsets = np.empty(count + 1, dtype=np.int64)
    offsets[0] = body
    np.cumsum(sizes, out=offsets[1:])
    offsets[1:] += body
    if offsets[-1] != payload.size:
        raise CodecError(f"gdeflate page sizes sum to {int(offsets[-1]) - body} bytes, payload "
                         f"holds {payload.size - body} after the page table")
    return entries, offsets


class GDeflateCodec(Codec):
    codec_id = GDEFLATE
    name = "gdeflate"

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        if not MIN_LEVEL <= level <= MAX_LEVEL:
            raise ValueError(f"GDeflate CPU level must be in [{MIN_LEVEL}, {MAX_LEVEL}], "
                             f"got {level}")
        self.level = level
        self._lib: NvcompCpu | None = None
        self._missing: UnsupportedCodecError | None = None

    def library(self) -> NvcompCpu:
        """The bound library, loaded on first use; raises UnsupportedCodecError without it."""
        if self._lib is None and self._missing is None:
            try:
                self._lib = load_library()
            except UnsupportedCodecError as exc:
                self._missing = exc
        if self._lib is None:
            raise UnsupportedCodecError(str(self._missing))
        return self._lib

    def available(self) -> bool:
        try:
            self.library()
        except UnsupportedCodecError:
            return False
        return True

    def encode(self, plane: np.ndarray) -> Encoded | None:
        if not self.available():
            return None
        lib = self.library()
        plane = np.ascontiguousarray(plane, dtype=np.uint8).reshape(-1)
        count = page_count(plane.size)
        entries = np.empty(count, dtype="<u4")
        parts: list[memoryview] = []
        for first in range(0, count, _BATCH_PAGES):
            batch = plane[first * PAGE_SIZE:(first + _BATCH_PAGES) * PAGE_SIZE]
            streams, sizes = lib.compress_pages(batch, self.level)
            stride = lib.max_stream_len
            for j, size in enumerate(sizes.tolist()):
                page = batch[j * PAGE_SIZE:(j + 1) * PAGE_SIZE]
                # A page that does not shrink is stored verbatim: never worse than raw.
                if size < page.size:
                    entries[first + j] = size
                    parts.append(streams[j * stride:j * stride + size].data)
                else:
                    entries[first + j] = RAW_PAGE | page.size
                    parts.append(page.data)
        header = _HEADER.pack(PAGE_LOG2, 0, 0, count)
        return Encoded(b"".join([header, entries.tobytes(), *parts]), bytes([self.level]))

    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        if len(params) > 1:
            raise CodecError(f"gdeflate parameters are at most 1 byte, got {len(params)}")
        lib = self.library()
        buf = np.frombuffer(payload, dtype=np.uint8) if isinstance(payload, bytes) else payload
        buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
        entries, offsets = parse_page_table(buf, decoded_len)
        out = np.empty(decoded_len, dtype=np.uint8)
        scratch = np.zeros(PAGE_SIZE + _INPUT_PAD, dtype=np.uint8)
        handle = lib.new_decompressor()
        try:
            used = 0
            for i, entry in enumerate(entries.tolist()):
                src = buf[offsets[i]:offsets[i + 1]]
                dst = out[i * PAGE_SIZE:i * PAGE_SIZE + PAGE_SIZE]
                if entry & RAW_PAGE:
                    dst[:] = src
                    continue
                scratch[:src.size] = src
                # Stale bytes of a longer previous page must not become this page's padding.
                if used > src.size:
                    scratch[src.size:used] = 0
                used = src.size
                status, written = lib.decompress_page(handle, scratch, src.size, dst)
                if status != 0 or written != dst.size:
                    raise CodecError(
                        f"gdeflate page {i} (stored bytes {int(offsets[i])}..."
                        f"{int(offsets[i + 1])}) is corrupt: the decoder reports "
                        f"{_LIBDEFLATE_STATUS.get(status, f'status {status}')} after "
                        f"{written} of {dst.size} bytes")
        finally:
            lib.free_decompressor(handle)
        return out

    def max_decoded_len(self, stored_len: int) -> int:
        return max(0, stored_len - _HEADER.size) // _MIN_PAGE_COST * PAGE_SIZE

    def estimate(self, plane: np.ndarray) -> int | None:
        """Exact for planes of up to 8 pages; above, the stored/decoded ratio of the full pages
        at the middles of 8 equal strips, scaled to the plane (deterministic, about 8 pages of
        work)."""
        if not self.available():
            return None
        plane = np.ascontiguousarray(plane, dtype=np.uint8).reshape(-1)
        if _sampled(plane.size):
            return self._sampled(plane.size, lambda lo, hi: plane[lo:hi])
        enc = self.encode(plane)
        return None if enc is None else enc.nbytes

    def estimate_view(self, view: PlaneView) -> int | None:
        # a large plane's sample is taken from its words: the plane is not extracted for it
        if not self.available() or not _sampled(view.size):
            return super().estimate_view(view)
        return self._sampled(view.size, view.bytes_at)

    def _sampled(self, n: int, part: Callable[[int, int], np.ndarray]) -> int:
        """:meth:`estimate` of an ``n``-byte plane sampled (:func:`_sampled`), whose bytes
        [lo, hi) ``part`` gives."""
        full = n // PAGE_SIZE
        # (the middles of equal strips, as zstd's samples: not the plane's ends)
        picks = (np.arange(_ESTIMATE_PAGES) * 2 + 1) * full // (2 * _ESTIMATE_PAGES)
        sample = np.concatenate([part(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in picks.tolist()])
        _streams, sizes = self.library().compress_pages(sample, self.level)
        stored = int(np.minimum(sizes, PAGE_SIZE).sum())
        return _HEADER.size + 4 * page_count(n) + n * stored // sample.size


def _sampled(n: int) -> bool:
    """Whether an ``n``-byte plane's estimate is from sampled pages, not its encoding."""
    return page_count(n) > _ESTIMATE_PAGES and n // PAGE_SIZE >= _ESTIMATE_PAGES


register(GDeflateCodec())
