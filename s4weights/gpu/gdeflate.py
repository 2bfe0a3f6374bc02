"""GDeflate (codec 5) on the device through nvCOMP's batched API (``nvidia-nvcomp`` Python
package): 64 KiB pages compressed as raw GDeflate streams in one batch, and decompressed
straight into the destination plane. The page table and the raw-page rule are ``spec/gdeflate.md``'s
(``s4format.codecs.gdeflate`` builds and checks the same table on the CPU); page bytes may differ
from the CPU compressor's, and each decodes on the other side.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from s4format.codecs.gdeflate import PAGE_SIZE, RAW_PAGE, page_count
from s4format.errors import CodecError
from s4weights.gpu import runtime

# nvCOMP's GDeflate algorithm_type: 0 entropy-only ... 5 best ratio. 1 is its default.
DEFAULT_ALGORITHM = 1
HEADER = 8


@functools.cache
def available() -> bool:
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def _codec(algorithm_type: int = DEFAULT_ALGORITHM):
    from nvidia import nvcomp

    return nvcomp.Codec(algorithm="GDeflate", bitstream_kind=nvcomp.BitstreamKind.RAW,
                        cuda_stream=torch.cuda.current_stream().cuda_stream,
                        algorithm_type=algorithm_type)


def page_lengths(n: int) -> np.ndarray:
    count = page_count(n)
    lens = np.full(count, PAGE_SIZE, dtype=np.int64)
    if count:
        lens[-1] = n - (count - 1) * PAGE_SIZE
    return lens


class Compressed:
    """Pages of several planes compressed in one batch; sizes are read back on demand."""

    def __init__(self, plane_ptrs: list[int], plane_lens: list[int], algorithm_type: int) -> None:
        from nvidia import nvcomp

        self.lens = [page_lengths(n) for n in plane_lens]
        self.first = np.zeros(len(plane_lens) + 1, dtype=np.int64)
        np.cumsum([x.size for x in self.lens], out=self.first[1:])
        total = int(self.first[-1])
        # nvCOMP asks for 131 360 bytes of output room per 64 KiB page (measured on 6.0).
        self.stride = runtime.align(2 * PAGE_SIZE + 4096)
        self.out = runtime.device_empty(total * self.stride)
        self._sizes: np.ndarray | None = None
        if not total:
            self._sizes = np.zeros(0, dtype=np.int64)
            return
        base = min(plane_ptrs)
        span = max(p + n for p, n in zip(plane_ptrs, plane_lens)) - base
        # A view of the planes' span: nvCOMP carves the pages out of it by offset.
        src_view = _DeviceSpan(base, span)
        offsets = np.concatenate([p - base + np.arange(x.size, dtype=np.int64) * PAGE_SIZE
                                  for p, x in zip(plane_ptrs, self.lens)])
        sizes = np.concatenate(self.lens)
        stream = torch.cuda.current_stream().cuda_stream
        srcs = nvcomp.as_arrays(src_view, offsets.tolist(), sizes.tolist(), stream)
        outs = nvcomp.as_arrays(self.out, (np.arange(total) * self.stride).tolist(),
                                [self.stride] * total, stream)
        self._result = _codec(algorithm_type).encode(srcs, out=outs)

    def sizes(self) -> np.ndarray:
        """Compressed size of every page (waits for the compression)."""
        if self._sizes is None:
            self._sizes = np.asarray(self._result.buffer_sizes, dtype=np.int64)
        return self._sizes

    def _coded(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Plane j's page lengths, compressed sizes, and which pages are stored compressed
        (the others raw): one rule for the size and the pieces, so they always agree."""
        lens, sizes = self.lens[j], self.sizes()[self.first[j]:self.first[j + 1]]
        return lens, sizes, (sizes > 0) & (sizes < lens)

    def payload_size(self, j: int) -> int:
        lens, sizes, coded = self._coded(j)
        return HEADER + 4 * lens.size + int(np.where(coded, sizes, lens).sum())

    def pieces(self, j: int, plane_ptr: int) -> tuple[bytes, list[tuple[int, int]]]:
        """Plane j's page table and its body pieces as (device address, length)."""
        lens, sizes, coded = self._coded(j)
        entries = np.where(coded, sizes, lens | RAW_PAGE).astype("<u4")
        head = np.array([16, 0, 0, 0], np.uint8).tobytes() + np.uint32(lens.size).tobytes()
        out_base = self.out.data_ptr() + int(self.first[j]) * self.stride
        pieces = [(out_base + i * self.stride, int(sizes[i])) if coded[i]
                  else (plane_ptr + i * PAGE_SIZE, int(lens[i])) for i in range(lens.size)]
        return head + entries.tobytes(), pieces


class _DeviceSpan:
    """A raw device address range as a __cuda_array_interface__ uint8 array."""

    def __init__(self, address: int, nbytes: int) -> None:
        # No "stream" key: the work is ordered on the codec's stream, which is torch's.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3,
            "strides": None}


def decompress(stored: torch.Tensor, entries: np.ndarray, offsets: np.ndarray, out_ptr: int,
               decoded_len: int) -> None:
    """Decode a checked page table's GDeflate pages from ``stored`` (device copy of the
    payload) into the plane at ``out_ptr``; raw pages are copied."""
    from nvidia import nvcomp

    lens = page_lengths(decoded_len)
    raw = (entries & RAW_PAGE) != 0
    base = stored.data_ptr()
    dst = out_ptr + np.arange(lens.size, dtype=np.int64) * PAGE_SIZE
    if raw.any():
        runtime.copy_ops(base + offsets[:-1][raw], dst[raw], lens[raw])
    coded = np.flatnonzero(~raw)
    if not coded.size:
        return
    src_off = offsets[:-1][coded]
    sizes = (offsets[1:] - offsets[:-1])[coded]
    align = _codec().get_required_decompression_alignment()
    stream = torch.cuda.current_stream().cuda_stream
    src_buf: object = stored
    if (src_off % align).any() or base % align:
        stride_off = np.zeros(coded.size + 1, dtype=np.int64)
        np.cumsum((sizes + align - 1) // align * align, out=stride_off[1:])
        staging = runtime.device_empty(int(stride_off[-1]))
        runtime.copy_ops(base + src_off, staging.data_ptr() + stride_off[:-1], sizes)
        src_buf, src_off = staging, stride_off[:-1]
    srcs = nvcomp.as_arrays(src_buf, src_off.tolist(), sizes.tolist(), stream)
    outs = nvcomp.as_arrays(_DeviceSpan(out_ptr, decoded_len),
                            (coded * PAGE_SIZE).tolist(), lens[coded].tolist(), stream)
    try:
        res = _codec().decode(srcs, out=outs)
        got = np.asarray(res.buffer_sizes, dtype=np.int64)
    except (RuntimeError, ValueError) as exc:
        raise CodecError(f"gdeflate pages failed to decode on the GPU: {exc}") from None
    bad = np.flatnonzero(got != lens[coded])
    if bad.size:
        i = int(coded[bad[0]])
        raise CodecError(f"gdeflate page {i} decoded to {int(got[bad[0]])} bytes on the GPU, "
                         f"expected {int(lens[i])}")
