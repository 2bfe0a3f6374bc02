"""Pure planning for the CUDA path (no CUDA needed, tested on CPU): which tensors the GPU codes,
how they are batched into groups under a workspace bound, the chunk tables of the split and
merge kernels, and the block and CTA tables of the rANS kernels.

Groups are runs of consecutive tensors: the writer must add tensors in the order of the
flattened tree (tensor references are positions), so batching never reorders. Inside a group,
one split launch per layout covers all its tensors through a chunk table. The encoder sizes
groups by ``group_need`` (exact, from a window's histograms) or, where that needs no
histograms, by ``encode_need`` (the worst case).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from s4format import layouts
from s4format.writer import SPLIT_MIN

CHUNK_ELEMS = 65536  # kernels/planes.cu: elements per CTA of split and merge
# kernels/copy.cu runs one CTA per op: longer ops are cut into pieces of this many bytes (a
# multiple of 16, so every piece keeps its op's source and destination alignment mod 16).
COPY_PIECE = 1 << 16
GIB = 1 << 30
SAVE_WORKSPACE_CAP = 2 * GIB
MIN_WORKSPACE = 4 << 20  # the smallest default: a few chunks of the chunked coders at their
# finest (2^16 elements), whatever the state's size

GPU_LAYOUTS = {layouts.BF16.layout_id: 2, layouts.FP16.layout_id: 2, layouts.FP32.layout_id: 4}
SPLIT_DTYPES = {"bfloat16": layouts.BF16, "float16": layouts.FP16, "float32": layouts.FP32}


def default_workspace(total_bytes: int) -> int:
    """min(1 GiB, 10% of the state), but at least ``MIN_WORKSPACE`` (states under 40 MiB)."""
    return min(GIB, max(MIN_WORKSPACE, total_bytes // 10))


def default_save_workspace(total_bytes: int, free_bytes: int) -> int:
    """A save's default: :func:`default_workspace`, raised to an eighth of ``free_bytes`` (the
    device memory free when the save starts), up to ``SAVE_WORKSPACE_CAP``. Each group costs
    the host a round trip: the 1.88 GB state of bench/checkpoints.py saved into memory in a
    median 0.358 s with 188 MiB groups and 0.277 s with 2 GiB (H200, bench/RESULTS.md,
    2026-12-02)."""
    return _raised_to_free(total_bytes, free_bytes, SAVE_WORKSPACE_CAP)


def default_load_workspace(total_bytes: int, free_bytes: int) -> int:
    """A load's default: :func:`default_workspace`, raised to an eighth of ``free_bytes`` (the
    device memory free besides the state's when the load starts using it), up to 1 GiB. A
    load's batches and chain levels each cost a fixed ~1-2 ms on the H200, so a small state
    decoded in 4-30 MiB batches took twice the time of 1 GiB ones (bench/RESULTS.md,
    2026-12-02); memory a training run holds later is not free yet when it resumes."""
    return _raised_to_free(total_bytes, free_bytes, GIB)


def whole_load_cap(free_bytes: int) -> int:
    """With a load's default workspace, the most a tensor may need to be decoded whole, in a
    batch of its own, rather than in chunks: an eighth of ``free_bytes`` (the device memory
    free besides the state's), without the workspace's 1 GiB cap. On the H200 bench/flat.py's
    flat state (its fp32 tensor 1.5 GB) loaded in 0.81-1.82 s with that tensor in chunks of a
    1 GiB workspace, 0.10-0.17 s with it whole (bench/RESULTS.md, 2026-12-03)."""
    return max(0, free_bytes) // 8


def _raised_to_free(total_bytes: int, free_bytes: int, cap: int) -> int:
    """:func:`default_workspace`, raised to an eighth of ``free_bytes``, up to ``cap``."""
    return max(default_workspace(total_bytes), min(cap, max(0, free_bytes) // 8))


def gpu_layout(dtype_name: str, nbytes: int) -> layouts.Layout | None:
    """The layout the GPU splits a tensor with, or None when the CPU coder handles it (other
    dtypes, and tensors below the writer's split threshold, which are stored as one plane)."""
    lay = SPLIT_DTYPES.get(dtype_name)
    if lay is None or nbytes < SPLIT_MIN:
        return None
    return lay


def _al(n: int) -> int:
    return (n + 255) // 256 * 256  # runtime.ALIGN: every device buffer is 256-byte aligned


BLOCK_META = 4 * 34 + 2 + 8 + 2 + 16  # device bytes per rANS block: word count, 32 final
# states and a spare word, first symbol and flag, its words' place in the scratch (the
# encoder's result buffer), its share of the launch's CTA table (9 bytes per 8 blocks), and
# its word count as i64 and the prefix sum of those (the assembly's rans_place)
TABLE_STRIDE = 544  # kernels/rans.cu: device bytes of a plane's frequency table (the largest)
PLANE_META = 2048 + TABLE_STRIDE + 41  # device bytes per split plane (rans_normalise's output):
# its normalised frequencies and cumulative sums (the encoder-table input), its frequency
# table's bytes, its figures for the host, its rANS words' bound and whether rans_jobs picks
# it
TENSOR_META = _al(8 * 1025) + 4096  # a split tensor's histograms; its launch-table rows


def encode_need(layout: layouts.Layout | None, nbytes: int, itemsize: int,
                gdeflate: bool = False, log2_block: int = 16, rans: bool = True) -> int:
    """Device bytes the encoder may hold for one tensor at once, at worst: its planes, rANS
    scratch (two bytes per symbol) and block figures for every plane, each plane's tables,
    GDeflate's pages where it runs, and the compacted payloads (at most the raw bytes). A
    tensor the GPU does not split holds only its copy. ``rans=False``: the least it can need,
    its planes (each packed to its field's width) and tables alone. The exact need,
    :func:`group_need`, lies between the two."""
    if layout is None or layout.layout_id == layouts.RAW.layout_id:
        return _al(nbytes)
    n = nbytes // layout.word_size(itemsize)
    planes = len(layout.fields) - 1  # byte planes besides the sign
    if rans:
        need = _al((n + 7) // 8) + planes * _al(n)          # split planes
    else:
        need = _al((n + 7) // 8) + sum(_al((n * f.bits + 7) // 8) for f in layout.fields[1:])
    need += (planes + 1) * PLANE_META + TENSOR_META
    if rans:
        nb = -(-n >> log2_block)
        need += (planes + 1) * (_al(2 * n) + _al(BLOCK_META * nb))  # scratch
    if gdeflate:
        need += planes * _al(-(-n // 65536) * (2 * 65536 + 4096))
    return need + _al(nbytes) if rans else need


# The encoder codes consecutive tensors in windows: one histogram pass per window, then groups
# sized by their exact need. A window's histograms and rANS tables (``window_meta``) stay on the
# device while its groups are coded, and take at most 1/WINDOW_SHARE of the workspace.
WINDOW_SHARE = 16
WINDOW_PLANE = PLANE_META  # per split plane: as in a group that histograms its own tensors
WINDOW_TENSOR = _al(8 * 1025) + 1024  # per split tensor: its histograms; its launch-table rows


def window_meta(layout: layouts.Layout | None) -> int:
    """Device bytes of a window's histogram pass for one tensor (none for tensors not split)."""
    if layout is None or layout.layout_id == layouts.RAW.layout_id:
        return 0
    return WINDOW_TENSOR + len(layout.fields) * WINDOW_PLANE


def packed_bytes(n: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Bytes of planes of ``n`` elements stored at ``width`` bits each."""
    return (np.asarray(n, np.int64) * np.asarray(width, np.int64) + 7) // 8


def split_plane_bytes(n: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Device bytes of split planes of ``n`` elements in a group's planes buffer, stored at
    ``width`` bits per element (8: a byte each; a sign plane's packed bits: 1; a narrow
    mantissa plane the split packs: its field's bits), each 256-byte aligned."""
    return (packed_bytes(n, width) + 255) // 256 * 256


GROUP_PLANE = 1024  # per plane of a group: its rows of the launch and copy tables, its host
# bytes (a stream header, or a whole CONST stream's) on the device


def group_need(item: np.ndarray, width: np.ndarray, split: np.ndarray, n: np.ndarray,
               runs_rans: np.ndarray, gdeflate: np.ndarray, nbytes: np.ndarray,
               log2_block: int, kept: np.ndarray | None = None,
               words: np.ndarray | None = None, payload: np.ndarray | None = None
               ) -> np.ndarray:
    """Exact device bytes the encoder holds for each tensor of a group at once, once its planes'
    candidates are known. Row q is plane q of tensor ``item[q]``: a split plane (``split``)
    stored at ``width`` bits per element, or a raw-layout tensor's bytes in place. Counted: the
    split planes; rANS scratch (two bytes per symbol, or per word of ``words``, each plane's
    bound) and block figures for the planes the rANS kernel codes; GDeflate's pages; tables and
    copy ops; the compacted payloads (each tensor's raw ``nbytes``, less the ``kept`` rows the
    result keeps where the split wrote them, or ``payload``, a caller's bound); the digests."""
    n = np.asarray(n, np.int64)
    row = np.where(split, split_plane_bytes(n, width), 0)
    nb = -(-n >> log2_block)
    scratch = 2 * (n if words is None else np.asarray(words, np.int64))
    row += np.where(runs_rans, (scratch + 255) // 256 * 256 + (BLOCK_META * nb + 255) // 256 * 256,
                    0)
    row += np.where(gdeflate, (-(-n // 65536) * (2 * 65536 + 4096) + 255) // 256 * 256, 0)
    # a copy op (24 bytes) or a bitpack-w pack op (25) per 64 KiB of payload, and its tables'
    # 16-byte padding
    row += GROUP_PLANE + 16 + 25 * (n // COPY_PIECE + 1) + 64
    nbytes = np.asarray(nbytes, np.int64)
    need = np.bincount(item, weights=row, minlength=nbytes.size).astype(np.int64)
    if payload is not None:
        need += np.asarray(payload, np.int64)
    else:
        need += (nbytes + 255) // 256 * 256
        if kept is not None:
            need -= np.bincount(item, weights=np.where(kept, packed_bytes(n, width), 0),
                                minlength=nbytes.size).astype(np.int64)
    rows = np.bincount(item, minlength=nbytes.size)
    # leaf digests of the raw bytes and of the payloads (with a slot per plane for its length:
    # runtime.plane_checksums) and the plane checksums, doubled for room
    digests = 2 * ((8 * (2 * (nbytes // 65536) + 3 * rows + 2) + 255) // 256 * 256)
    return need + digests + TENSOR_META


# Device bytes a prefix sum over one chunk's blocks may take as scratch (torch.cumsum over at
# most a few hundred thousand int32 counts; CUB's temporary storage is a few KiB)
CUMSUM_SCRATCH = 16 << 10


def large_align(log2_block: int) -> int:
    """Chunked encoder and decoder: chunk lengths are multiples of this many elements: whole
    rANS blocks (``log2_block``), whole split and merge CTAs (``CHUNK_ELEMS``), whole sign
    bytes and whole 64 KiB leaves (2^16 elements of any word size)."""
    return 1 << max(16, log2_block)


def large_staging(chunk: int, rans_planes: int, slot: int = 1) -> int:
    """Device bytes the chunked encoder gathers a chunk's rANS words in, before they go down to
    host memory: for each rANS-coded plane ``slot`` bytes per symbol (one: a stream kept is
    shorter than its plane; two: the most its blocks can write)."""
    return rans_planes * _al(slot * chunk)


def large_need(layout: layouts.Layout, itemsize: int, chunk: int, rans_planes: int,
               xor: bool, log2_block: int, packed: int = 0, slot: int = 1) -> int:
    """Device bytes the chunked encoder (``encode_large``) holds at once with chunks of
    ``chunk`` elements, apart from its launch tables: a delta's XOR buffer; for each of
    ``rans_planes`` rANS-coded planes the kernel's scratch and table input; the blocks' figures
    (``ransencode.rans_meta_bytes``) and their prefix sum; one buffer for the chunk's planes
    (and ``packed`` bitpack-w planes), later the staging of its words (``large_staging``); one
    chunk's leaf digests and the histograms."""
    word = layout.word_size(itemsize)
    planes = _al(chunk // 8) + (len(layout.fields) - 1) * _al(chunk)
    need = _al(chunk * word) if xor else 0
    if rans_planes:
        nb = rans_planes * -(-chunk >> log2_block)
        need += (rans_planes * _al(2 * chunk) + _al(2048 * rans_planes)
                 + _al(154 * nb + 16) + CUMSUM_SCRATCH)
    need += max(planes + packed * _al(chunk), large_staging(chunk, rans_planes, slot))
    return need + _al(8 * (chunk * word // 65536 + 1)) + 2 * _al(8 * 1025)


def large_chunk(layout: layouts.Layout, itemsize: int, workspace: int, n: int, rans_planes: int,
                xor: bool, log2_block: int, packed: int = 0, slot: int = 1) -> int:
    """Elements per chunk so that ``large_need`` stays under ``workspace``: a multiple of
    ``large_align`` (at least one, whatever the workspace), no longer than the tensor needs."""
    align = large_align(log2_block)
    per = large_need(layout, itemsize, align, rans_planes, xor, log2_block, packed, slot)
    # the whole tensor's content leaf digests stay on the device (and one copy of them)
    digests = 2 * _al(8 * (n * layout.word_size(itemsize) // 65536 + 1))
    k = max(1, (workspace - digests) // per)
    return min(k, max(1, -(-n // align))) * align


def groups_by_need(need: list[int], out: list[int], workspace: int,
                   pipelined: bool = False) -> list[range]:
    """Consecutive groups whose device bytes (``need`` per tensor) stay under ``workspace``;
    ``pipelined``: the previous group's compacted payloads (``out`` per tensor) are still on
    the device while the next group is coded, and count against it. A tensor that cannot fit
    forms a group of its own."""
    res: list[range] = []
    start, used, cur_out, prev_out = 0, 0, 0, 0
    for i, (nd, o) in enumerate(zip(need, out)):
        if i > start and prev_out + used + nd > workspace:
            res.append(range(start, i))
            start, used = i, 0
            prev_out, cur_out = (cur_out if pipelined else 0), 0
        used += nd
        cur_out += o
    if start < len(need):
        res.append(range(start, len(need)))
    return res


def chunk_table(nelems) -> tuple[np.ndarray, np.ndarray]:
    """(segment of each chunk, first element of each chunk) for split/merge launches."""
    counts = (np.asarray(nelems, dtype=np.int64).reshape(-1) + CHUNK_ELEMS - 1) // CHUNK_ELEMS
    seg = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    first = (np.arange(int(counts.sum()), dtype=np.int64)
             - np.repeat(np.cumsum(counts) - counts, counts)) * CHUNK_ELEMS
    return seg, first


RANS_WARPS = 8  # rans.cu: blocks (warps) per CTA


@dataclass(frozen=True)
class Blocks:
    """The blocks of a rANS launch over planes, without a row per block: plane q owns blocks
    ``first[q] .. first[q + 1] - 1`` of the launch."""
    first: np.ndarray  # int64[planes + 1]

    @property
    def size(self) -> int:
        return int(self.first[-1])


def blocks(lengths, log2_block: int) -> Blocks:
    counts = (np.asarray(lengths, dtype=np.int64).reshape(-1) + (1 << log2_block) - 1) \
        >> log2_block
    first = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    return Blocks(first)


def cta_planes(first: np.ndarray, warps: int = RANS_WARPS
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CTAs of a rANS launch: (plane, its first block inside the plane, number of blocks) of
    each, every CTA taking up to ``warps`` consecutive blocks of ONE plane (``first``: each
    plane's first block, plus the total), so the CTA loads that plane's table into shared
    memory once. Read-only arrays, shared by the launches over the same blocks: a training
    run codes the same shapes again and again, and the table of a 1 GiB plane took 0.1-0.25 ms
    of host time per launch."""
    return _cta_planes(np.asarray(first, dtype=np.int64).tobytes(), warps)


@functools.lru_cache(maxsize=64)
def _cta_planes(first_bytes: bytes, warps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first = np.frombuffer(first_bytes, np.int64)
    nb = np.diff(first)
    nc = (nb + warps - 1) // warps
    plane = np.repeat(np.arange(nb.size), nc)
    within = (np.arange(int(nc.sum()), dtype=np.int64) - np.repeat(np.cumsum(nc) - nc, nc)
              ) * warps
    count = np.minimum(warps, nb[plane] - within)
    out = plane.astype(np.uint32), within.astype(np.uint32), count.astype(np.uint8)
    for a in out:
        a.flags.writeable = False
    return out


def cta_table(first: np.ndarray, warps: int = RANS_WARPS) -> tuple[np.ndarray, np.ndarray]:
    """The CTAs of :func:`cta_planes` as (first block in the launch, number of blocks)."""
    plane, within, count = cta_planes(first, warps)
    first = np.asarray(first, dtype=np.int64)
    return (first[:-1][plane] + within).astype(np.uint32), count


def split_copies(src, dst, length, piece: int = COPY_PIECE
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copy ops (source address, destination address, bytes) with empty ops dropped and every op
    longer than ``piece`` cut into consecutive pieces of ``piece`` bytes (the last shorter), so
    one large op (a raw or bitpacked plane of 64 MB) spreads over many CTAs instead of one.
    ``piece`` must be a multiple of 16: a piece's addresses keep the op's alignment mod 16."""
    return split_ops(length, src, dst, piece=piece)


def split_ops(length, *addresses, piece: int = COPY_PIECE) -> tuple[np.ndarray, ...]:
    """:func:`split_copies` for ops over any number of byte ranges of one ``length`` each:
    (each of ``addresses`` per piece, ..., the pieces' lengths)."""
    if piece <= 0 or piece % 16:
        raise ValueError("piece must be a positive multiple of 16")
    length = np.asarray(length, dtype=np.uint64).reshape(-1)
    keep = length > 0
    addrs = [np.asarray(a, dtype=np.uint64).reshape(-1)[keep] for a in addresses]
    length = length[keep]
    if not (length > np.uint64(piece)).any():
        return (*addrs, length)
    op, off = cut(length, piece)
    off = off.astype(np.uint64)
    return (*(a[op] + off for a in addrs), np.minimum(length[op] - off, np.uint64(piece)))


def cut(length, piece: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces ops of ``length`` bytes are cut into, ``piece`` bytes each (the last of an op
    shorter; an empty op has none): (the op of each piece, its offset in the op), in order."""
    pieces = (np.asarray(length, np.int64).reshape(-1) + piece - 1) // piece
    op = np.repeat(np.arange(pieces.size), pieces)
    return op, (np.arange(op.size) - (np.cumsum(pieces) - pieces)[op]) * piece
