"""Flat buffers on the GPU path: a large tensor whose values change distribution along it (many
parameters end to end: FSDP1's FlatParameter, a flat optimizer partition) is coded as segments
and stored with codec 9, ``rans-seg`` (a rANS table per segment, format 1.3).

Where to cut is decided as the CPU writer decides it (``s4format.codecs.ransseg``): from each
field's histogram per 65,536 elements, counted on the device, a unit starts a segment where a
table of its own pays. The segments are then coded as tensors of their own by the encoder's
usual groups, and their planes are stitched back: planes that every segment stored alike (raw,
bitpack, bitpack-w of one width) by concatenation, which segments of whole 65,536 elements
keep exact; others into one codec-9 plane whose segments keep their codecs. A plane with a
segment in another codec (the CPU coder's zstd) is recoded on the host.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

from s4format import codecs, layouts, policy, threads
from s4format.codecs import rans, ransseg
from s4format.codecs.view import UNIT
from s4format.pieces import Pieces
from s4format.writer import CodedPlane, CodedTensor
from s4weights.gpu import plan, runtime
from s4weights.gpu.hash import pieces_checksum
from s4weights.gpu.items import Coded, Item

# On unless S4_GPU_SEGMENTS=0 (then the GPU coder keeps one form per plane).
ENABLED = os.environ.get("S4_GPU_SEGMENTS", "1") != "0"
# Tensors of at least this many bytes are examined (a layer's weight rarely needs two tables;
# flat buffers are hundreds of megabytes).
MIN_BYTES = 16 << 20
# Segments are coded only where their estimate saves this share of the tensor's raw bytes.
MIN_GAIN = 1 / 256
# The coarse look (``cuts_of``): blocks per tensor, and the share of its bytes they must save
# (before their tables' cost) for the tensor to be examined unit by unit.
COARSE_BLOCKS = 16
COARSE_MIN = MIN_GAIN / 4

_WORDS = {2: torch.int16, 4: torch.int32}


def eligible(it: Item, policy_name: str) -> bool:
    """Whether ``it`` may be cut: ``auto``'s codecs include codec 9, and it is a large tensor
    the GPU splits, coded alone (no parent XORed chunk by chunk). The GPU decoder decodes
    codec 9 in chunks too, so a tensor of any size may be cut."""
    if not ENABLED or policy_name != "auto" or it.parent is not None or it.nbytes < MIN_BYTES:
        return False
    lay = plan.gpu_layout(it.dtype.name, it.nbytes)
    return lay is not None and lay.word_size(it.dtype.itemsize) in _WORDS


def cuts(it: Item) -> np.ndarray | None:
    """Element offsets where segments start (0 first), or None where one segment is best."""
    lay = plan.gpu_layout(it.dtype.name, it.nbytes)
    w = lay.word_size(it.dtype.itemsize)
    fields = lay.planes(it.dtype.itemsize)
    n = it.nbytes // w
    if n < 4 * UNIT:
        return None
    units = unit_histograms(it, lay)
    # (the fields' cuts in parallel: the kernels release the GIL)
    starts = np.unique(np.concatenate(threads.pool().map(
        lambda f: ransseg._cut(np.ascontiguousarray(units[:, f])), range(len(fields)))))
    if starts.size < 2 or _gain(units, starts) < MIN_GAIN * it.nbytes:
        return None
    return starts * UNIT


def unit_histograms(it: Item, lay: layouts.Layout) -> np.ndarray:
    """Per UNIT elements of ``it`` and per field of its layout (sign first), the field's
    histogram (units x fields x 256, int64)."""
    return _histograms(lay, len(lay.planes(it.dtype.itemsize)), *_rows(it, lay, 1),
                       it.data.device)


def _rows(it: Item, lay: layouts.Layout, units: int) -> tuple[np.ndarray, np.ndarray]:
    """``it`` cut into rows of ``units`` UNITs (the last shorter): their addresses and
    element counts."""
    w = lay.word_size(it.dtype.itemsize)
    n = it.nbytes // w
    first = np.arange(0, n, units * UNIT, dtype=np.int64)
    return (np.uint64(it.data.data_ptr()) + (first * w).astype(np.uint64),
            np.minimum(units * UNIT, n - first))


def _histograms(lay: layouts.Layout, nf: int, src: np.ndarray, nel: np.ndarray,
                device) -> np.ndarray:
    """The histograms of each field (sign first) of rows of ``nel`` elements at ``src``, all of
    layout ``lay`` (rows x fields x 256, int64): one launch of the split's histogram kernel,
    a row each, as a window's histogram pass counts a row per tensor."""
    from s4weights.gpu.planes import launch_split

    m = nel.size
    with torch.cuda.device(device):  # (the launch goes to the device that holds the rows)
        hist = torch.zeros(m * 1025, dtype=torch.int64, device=device)
        hp = hist.data_ptr()
        launch_split(lay.layout_id, src, nel, None, hp, hp + 8 * 1024 * m, kind="hist")
        h = hist.cpu().numpy()
    out = np.zeros((m, nf, 256), np.int64)
    ones = h[1024 * m:]
    out[:, 0, 0], out[:, 0, 1] = nel - ones, ones  # the sign plane: its set bits
    out[:, 1:] = h[:1024 * m].reshape(m, 4, 256)[:, :nf - 1]
    return out


def cuts_of(items: list[Item], policy_name: str) -> list[np.ndarray | None]:
    """:func:`cuts` of each item :func:`eligible` admits and a coarse look finds promising:
    cut into ``COARSE_BLOCKS`` blocks (histograms of all such items of a layout in one
    launch), an item whose blocks save under ``COARSE_MIN`` of its bytes holds one
    distribution, as a model's weight does, and is not examined unit by unit (whose
    histograms are 8 KiB per 65,536 elements to the host)."""
    out: list[np.ndarray | None] = [None] * len(items)
    by_layout: dict[tuple, list[int]] = {}  # (layout, device) -> items
    for k, it in enumerate(items):
        if eligible(it, policy_name):
            lay = plan.gpu_layout(it.dtype.name, it.nbytes)
            by_layout.setdefault((lay.layout_id, str(it.data.device)), []).append(k)
    for ks in by_layout.values():
        for k in _promising([items[k] for k in ks], ks):
            out[k] = cuts(items[k])
    return out


def _promising(its: list[Item], ks: list[int]) -> list[int]:
    """Of items ``its`` (positions ``ks``, one layout), those whose coarse blocks show a gain."""
    lay = plan.gpu_layout(its[0].dtype.name, its[0].nbytes)
    src, nel, rows = [], [], []
    for it in its:
        units = -(-(it.nbytes // lay.word_size(it.dtype.itemsize)) // UNIT)
        a, m = _rows(it, lay, -(-units // COARSE_BLOCKS))  # (whole units per block)
        src.append(a)
        nel.append(m)
        rows.append(m.size)
    hists = _histograms(lay, len(lay.planes(its[0].dtype.itemsize)), np.concatenate(src),
                        np.concatenate(nel), its[0].data.device)
    keep, at = [], 0
    for it, k, r in zip(its, ks, rows):
        saved, _present = ransseg.cut_bits(hists[at:at + r], np.arange(r, dtype=np.int64))
        if saved / 8 >= COARSE_MIN * it.nbytes:
            keep.append(k)
        at += r
    return keep


def _gain(units: np.ndarray, starts: np.ndarray) -> float:
    """Bytes the segments starting at ``starts`` (unit indices) are estimated to save over
    one table per field, their tables and segment entries paid."""
    saved, present = ransseg.cut_bits(units, np.asarray(starts, np.int64))
    return saved / 8 - starts.size * (ransseg.SEGMENT.size + rans.HEADER_SIZE + 36) \
        - 2 * present


def split(it: Item, starts: np.ndarray) -> list[Item]:
    """The segments of ``it`` as items of their own (views of its bytes)."""
    w = plan.gpu_layout(it.dtype.name, it.nbytes).word_size(it.dtype.itemsize)
    bounds = np.append(starts, it.nbytes // w).tolist()
    return [Item(it.dtype, (b - a,), it.data[a * w:b * w])
            for a, b in itertools.pairwise(bounds)]


def content_hashes(items: list[Item]) -> list[bytes]:
    return runtime.content_hashes_now([i.data.data_ptr() for i in items],
                                      [i.nbytes for i in items])


def stitch(it: Item, parts: list[Coded], content_hash: bytes, policy_name: str) -> Coded:
    """One coded tensor of ``it`` from its segments' coded tensors."""
    lay = parts[0].coded.layout
    shapes = {tuple((p.kind, p.index) for p in c.coded.planes) for c in parts}
    if lay is layouts.RAW or len(shapes) != 1 or \
            any(c.coded.layout is not lay for c in parts):
        return Coded(_host_code(it, policy_name), content_hash)
    planes = tuple(_stitch_plane([c.coded.planes[q] for c in parts], policy_name)
                   for q in range(len(parts[0].coded.planes)))
    coded = CodedTensor(lay, planes)
    if coded.stored > it.nbytes:
        return Coded(_host_code(it, policy_name), content_hash)
    return Coded(coded, content_hash)


def _stitch_plane(parts: list[CodedPlane], policy_name: str) -> CodedPlane:
    first = parts[0]
    n = sum(p.decoded_len for p in parts)
    used = {p.codec for p in parts}
    if len(used) == 1 and len({p.params for p in parts}) == 1 and \
            first.codec in (codecs.RAW, codecs.BITPACK, codecs.BITPACK_W):
        # the whole plane's own stored form: the GPU decodes it
        payload = Pieces([p.payload for p in parts])
        return CodedPlane(first.kind, first.index, first.codec, n, payload, first.params,
                          pieces_checksum(payload))
    if used <= set(ransseg.SEGMENT_CODECS):
        # the segments' payloads stay where they are (pinned views), written after the table
        segs = [(p.decoded_len, p.codec, p.params[0] if p.codec == codecs.BITPACK_W else 0,
                 p.payload) for p in parts]
        payload = Pieces([ransseg.head(segs), *(p.payload for p in parts)])
        return CodedPlane(first.kind, first.index, codecs.RANS_SEG, n, payload,
                          checksum=pieces_checksum(payload))
    plane = np.concatenate([_decoded(p) for p in parts])
    cid, enc = policy.encode_plane(plane, first.kind, policy_name)
    return CodedPlane(first.kind, first.index, cid, n, enc.payload, enc.params)


def _decoded(p: CodedPlane) -> np.ndarray:
    return codecs.get(p.codec).decode(ransseg.as_bytes(p.payload), p.decoded_len, p.params)


def _host_code(it: Item, policy_name: str) -> CodedTensor:
    """The CPU coder's coding of ``it`` (segments that did not stitch: a rare case)."""
    from s4format.writer import code_tensor

    return code_tensor(it.data.cpu().numpy(), it.dtype, policy_name)
