"""Load side of the CUDA path: a stored tensor's planes go to the device once, are checked
there (plane checksums from leaf digests), decoded by the rANS kernel, nvCOMP (GDeflate) or
used in place (raw, bitpack, rANS RAW mode), and merged straight into the destination tensor.

Every stream is validated on the host before a kernel reads it, as the CPU decoders do
(``s4format.codecs.rans``, ``s4format.codecs.gdeflate``): the kernels only see lengths, counts
and offsets proven in range; what only decoding can reveal (a bad final state, a word underflow)
comes back as a per-block error code and raises ``CodecError`` naming the plane.
"""

from __future__ import annotations

import numpy as np
import torch

from s4format import codecs, layouts
from s4format.codecs import gdeflate as cpu_gdeflate
from s4format.codecs import rans
from s4format.errors import ChecksumError, CodecError, ContentHashError, FormatError
from s4format.reader import Reader
from s4weights.gpu import gdeflate, runtime
from s4weights.gpu.hash import content_hash_from_leaves, plane_checksum_from_leaves
from s4weights.gpu.plan import GPU_LAYOUTS, chunk_table

MERGE_KERNEL = {layouts.BF16.layout_id: "merge_bf16", layouts.FP16.layout_id: "merge_fp16",
                layouts.FP32.layout_id: "merge_fp32"}
GPU_CODECS = {codecs.RAW, codecs.BITPACK, codecs.RANS, codecs.GDEFLATE}


def decodable(reader: Reader, i: int) -> bool:
    """Whether the GPU decodes tensor i (else the CPU does and the bytes are copied up)."""
    t = reader.tensors[i]
    return (t.layout.layout_id in GPU_LAYOUTS and not t.is_delta
            and all(p.codec in GPU_CODECS for p in t.planes)
            and (gdeflate.available() or all(p.codec != codecs.GDEFLATE for p in t.planes)))


def read_tensor(reader: Reader, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Tensor i's raw bytes as a flat uint8 CUDA tensor (``out`` if given: written in place)."""
    t = reader.tensors[i]
    if out is None:
        out = runtime.device_empty(t.raw_nbytes)[:t.raw_nbytes]
    if out.numel() != t.raw_nbytes or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"destination for {t.name!r} must be {t.raw_nbytes} contiguous bytes")
    if not decodable(reader, i):
        raw = reader.read_raw(i)
        if raw.size:
            out.copy_(torch.from_numpy(raw))
        return out
    prof = runtime.Profile("decode")
    stored, at, host = _upload(reader, t)
    prof.mark("read+h2d")
    _check_planes(reader, t, stored, at)
    prof.mark("checksums")
    keep: list[object] = [host]
    ptrs, packed = _planes(reader, t, stored, at, host, keep)
    prof.mark("planes")
    word = t.layout.word_size(t.dtype.itemsize)
    n = t.raw_nbytes // word
    if n:
        cs, c0 = chunk_table([n])
        table = np.zeros(5, dtype=np.uint64)
        table[:len(ptrs)] = ptrs
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        d = [runtime.to_device(a) for a in (cs, c0, np.array([out.data_ptr()], np.uint64),
                                            np.array([n], np.int64), table,
                                            np.array([packed], np.uint8))]
        runtime.launch("planes", MERGE_KERNEL[t.layout.layout_id], cs.size, 256,
                       *(runtime.ptr(x) for x in d), runtime.ptr(err))
        if int(err.item()):
            raise FormatError(f"{reader.name}: tensor {t.name!r}: a plane holds values wider "
                              "than its field")
    del keep
    prof.mark("merge")
    if reader.verify_hashes:
        digests, _first = runtime.leaf_digests([out.data_ptr()], [t.raw_nbytes])
        d = digests.cpu().numpy().view(np.uint64)[:(t.raw_nbytes + 65535) // 65536]
        if content_hash_from_leaves(t.raw_nbytes, d) != t.content_hash:
            raise ContentHashError(f"{reader.name}: tensor {t.name!r} content hash mismatch "
                                   "after decoding on the GPU")
        prof.mark("content hash")
    prof.report()
    return out


def _upload(reader: Reader, t) -> tuple[torch.Tensor, list[int], np.ndarray]:
    at, total = [], 0
    for p in t.planes:
        at.append(total)
        total += runtime.align(p.stored_len, 16)
    host = runtime.pinned(total)
    h = host.numpy()
    for p, a in zip(t.planes, at):
        h[a:a + p.stored_len] = reader.source.read_at(p.offset, p.stored_len)
    dev = runtime.device_empty(total)
    dev[:total].copy_(host[:total], non_blocking=True)
    return dev, at, h


def _check_planes(reader: Reader, t, stored: torch.Tensor, at: list[int]) -> None:
    base = stored.data_ptr()
    digests, first = runtime.leaf_digests([base + a for a in at], [p.stored_len for p in t.planes])
    d = digests.cpu().numpy().view(np.uint64)
    for k, p in enumerate(t.planes):
        if plane_checksum_from_leaves(p.stored_len, d[first[k]:first[k + 1]]) != p.checksum:
            raise ChecksumError(f"{reader.name}: tensor {t.name!r} plane {p.label}: checksum of "
                                f"the {p.stored_len} stored bytes at offset {p.offset} mismatch")


def _planes(reader: Reader, t, stored: torch.Tensor, at: list[int], host: np.ndarray,
            keep: list[object]) -> tuple[list[int], int]:
    """Device address of each decoded plane (sign: packed bits or bytes) and the packed flag."""
    base = stored.data_ptr()
    ptrs, packed = [], 1
    for k, p in enumerate(t.planes):
        where = f"{reader.name}: tensor {t.name!r} plane {p.label}"
        src = base + at[k]
        n = p.decoded_len
        if p.codec == codecs.RAW:
            if p.stored_len != n:
                raise CodecError(f"{where}: raw plane stores {p.stored_len} bytes, declares {n}")
            ptrs.append(src)
        elif p.codec == codecs.BITPACK:
            payload = host[at[k]:at[k] + p.stored_len]
            if p.params or len(payload) != (n + 7) // 8 or \
                    (n % 8 and int(payload[-1]) >> (n % 8)):
                raise CodecError(f"{where}: bitpack payload is malformed")
            if k != 0:
                raise CodecError(f"{where}: bitpack on a plane other than the sign plane")
            ptrs.append(src)
        elif p.codec == codecs.RANS:
            ptrs.append(_rans_plane(host[at[k]:at[k] + p.stored_len], p, src, keep, where))
            if k == 0:
                packed = 0
        elif p.codec == codecs.GDEFLATE:
            payload = host[at[k]:at[k] + p.stored_len]
            if len(p.params) > 1:
                raise CodecError(f"{where}: gdeflate parameters are at most 1 byte")
            entries, offsets = cpu_gdeflate.parse_page_table(payload, n)
            dst = runtime.device_empty(n)
            keep.append(dst)
            gdeflate.decompress(stored[at[k]:], entries, offsets, dst.data_ptr(), n)
            ptrs.append(dst.data_ptr())
            if k == 0:
                packed = 0
        if k == 0 and p.codec == codecs.RAW:
            packed = 0
    return ptrs, packed


def _rans_plane(payload: np.ndarray, p, src: int, keep: list[object], where: str) -> int:
    n = p.decoded_len
    if p.params:
        raise CodecError(f"{where}: rans takes no parameters")
    if payload.size < rans.HEADER_SIZE:
        raise CodecError(f"{where}: rans stream shorter than its header")
    mode, lg, reserved, count = rans.HEADER.unpack_from(payload[:rans.HEADER_SIZE].tobytes())
    if reserved or not rans.LOG2_BLOCK_MIN <= lg <= rans.LOG2_BLOCK_MAX or count != n:
        raise CodecError(f"{where}: bad rans header")
    nb = (n + (1 << lg) - 1) >> lg
    if mode == rans.MODE_RAW:
        if payload.size != rans.HEADER_SIZE + n:
            raise CodecError(f"{where}: rans RAW stream has the wrong length")
        return src + rans.HEADER_SIZE
    dst = runtime.device_empty(n)
    keep.append(dst)
    starts = np.arange(nb, dtype=np.int64) << lg
    lens = np.minimum(n - starts, 1 << lg).astype(np.uint32)
    zeros = np.zeros(nb, dtype=np.uint64)
    if mode == rans.MODE_CONST:
        if payload.size != rans.HEADER_SIZE + nb:
            raise CodecError(f"{where}: rans CONST stream has the wrong length")
        cols = (np.ones(nb, np.uint8), payload[rans.HEADER_SIZE:].copy(), zeros,
                np.zeros(nb, np.uint32), zeros, zeros)
    elif mode == rans.MODE_RANS:
        freqs, pos = rans._parse_table(payload, rans.HEADER_SIZE)
        words_at = pos + rans.BLOCK_OVERHEAD * nb
        if payload.size < words_at:
            raise CodecError(f"{where}: rans stream ends before its word area")
        counts = payload[pos:pos + 4 * nb].view("<u4").astype(np.int64)
        if (counts > lens).any():
            raise CodecError(f"{where}: a rans block stores more words than symbols")
        offs = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(counts, out=offs[1:])
        if payload.size != words_at + 2 * int(offs[-1]):
            raise CodecError(f"{where}: rans stream length does not match its word counts")
        dtab = runtime.to_device(rans._decoder_table(freqs))
        keep.append(dtab)
        cols = (np.zeros(nb, np.uint8), np.zeros(nb, np.uint8),
                (src + words_at + 2 * offs[:-1]).astype(np.uint64), counts.astype(np.uint32),
                (src + pos + 4 * nb + 128 * np.arange(nb)).astype(np.uint64),
                np.full(nb, dtab.data_ptr(), np.uint64))
    else:
        raise CodecError(f"{where}: rans mode {mode} is not RAW, CONST or RANS")
    out_ptrs = (dst.data_ptr() + starts).astype(np.uint64)
    d = [runtime.to_device(a) for a in (*cols, out_ptrs, lens)]
    keep.append(d)
    err = torch.zeros(nb, dtype=torch.int32, device="cuda")
    warps = 4
    runtime.launch("rans", "rans_decode", (nb + warps - 1) // warps, 32 * warps, np.int32(nb),
                   *(runtime.ptr(x) for x in d), runtime.ptr(err))
    e = err.cpu().numpy()
    bad = np.flatnonzero(e)
    if bad.size:
        b = int(bad[0])
        raise CodecError(f"{where}: rans block {b} of {nb} is corrupt: "
                         f"{rans._ERR_TEXT.get(int(e[b]), 'error')}")
    return dst.data_ptr()
