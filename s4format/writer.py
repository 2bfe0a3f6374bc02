"""Writing .s4w files as a stream: header first, planes as they are coded, the index and footer
last, so the output can be a pipe or an S3 multipart upload and sizes need not be known ahead.

Per tensor the writer tries the dtype's plane layout and keeps it only if the coded planes are
no larger than the raw bytes; otherwise it stores one raw plane. So a tensor's stored payload
never exceeds its raw size; the fixed overhead per tensor is its index record plus alignment
padding (``spec/format.md``, "Size guarantee"). Given a parent, a tensor is stored as the XOR
delta against the parent's bytes only when that is estimated to store less than
:data:`DELTA_PAYS` of the tensor alone and at least :data:`DELTA_MIN_SAVED` bytes less (the
two are compared by the codecs' estimates, from samples where they decide, and only the one
kept is coded; a tensor under :data:`SPLIT_MIN` bytes is coded both ways and compared exactly,
one under :data:`DELTA_MIN_SAVED` never as a delta).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from s4format import codecs, hashing, layouts, masked, objtree, policy, threads
from s4format.codecs.view import PlaneView, counted, run_pieces, sample_words
from s4format.dtypes import DType
from s4format.errors import FormatError, LimitError, StorageError, UnsupportedObjectError
from s4format.indexwrite import build_index
from s4format.layouts import Layout
from s4format.pieces import Pieces
from s4format.policy import CODECS_OF_MINOR, MASKED_MINOR, format_minor
from s4format.policy import check_policy as policy_check
from s4format.reader import MAX_INDEX_SIZE, MAX_TENSORS, checkpoint_id
from s4format.records import MAX_NDIM, MAX_RAW_NBYTES, check_planes, extent_nbytes
from s4format.schema import (
    MAGIC,
    MAJOR,
    NO_PARENT,
    TENSOR_MASKED,
    TRANSFORM_NONE,
    TRANSFORM_XOR,
    Footer,
    Header,
    Index,
)
from s4format.tensor import Tensor

DEFAULT_ALIGN_LOG2 = 6
# Tensors smaller than this are stored as one plane: per-plane padding and records would cost
# more than splitting can save.
SPLIT_MIN = 4096
MAX_NAME_BYTES = 0xFFFF
# Raw bytes of tensors Writer.code_ahead codes ahead of the one being written.
AHEAD = 64 << 20
# A tensor is stored as a delta only where that stores less than this share of the tensor
# alone (delta_pays): every load of a later step decodes a delta tensor once per level of its
# chain, which a few percent fewer bytes do not pay for. (bench/checkpoints.py's AdamW state,
# two steps apart: fp32 weights' deltas store 0.74-0.79 of them, bf16 weights' 0.06-0.46,
# second moments' 0.93-0.96 and first moments' 0.99-1.00.)
DELTA_PAYS = 0.9
# ... and saves at least this many bytes: the delta's parent tensor is read besides it at every
# load, a fixed cost per tensor (on the CPU 0.02-0.05 ms of work) that the few hundred bytes a
# bias's or a norm's delta saves do not pay for. (bench/checkpoints.py's CPU fine-tuning
# chain, 2026-12-06: its 33 tensors under 4 KiB stored whole, 0.2% more stored, steps 8% faster.)
DELTA_MIN_SAVED = 4096
# A delta estimated at most this share of the tensor alone, as a sample of it estimates that
# (estimate_rough), is kept without estimating the tensor alone exactly: counting a tensor's
# planes cost as much as coding its delta. (The sample's figure came within 2% of the exact
# one on bench/checkpoints.py's weights and AdamW states: DELTA_PAYS less a margin for that.)
CLEAR_DELTA = 0.85
# A delta in which at most this share of the words changed is stored masked (s4format.masked):
# it stores and decodes only those. Up to it the mask's bit per word costs less than the zero
# words it spares each plane. (Words of a fine-tuning state changed at random, 2026-12-06: with
# 50-75% changed, the masked form of a 2M-word bf16 tensor stored 0.3-1.5% less than its XOR
# delta and decoded in 2.3-3.5 against 3.8 ms; of a 256K-word one 3.7-3.9% less, in 0.31-0.43
# against 0.36-0.39 ms. At 80% the two came out even.)
MASKED_MAX = 0.75
# estimate_pair's sample: this many evenly spaced runs of this many words. (On
# bench/checkpoints.py's AdamW state its share of delta over alone came within 0.02 of the
# exact one.)
PAIR_CHUNKS, PAIR_CHUNK = 16, 1024
# A tensor in which a glance (changed_glance: this many words, evenly spaced) shows more than
# this share of the words changed is not looked at for a masked form (MASKED_MAX, with room for
# changes that cluster where the glance does not look).
GLANCE = 4096
MASK_LOOK = 0.9
# A masked bf16 or fp16 delta's kept words are stored under the bytes layout: two planes, where
# sign, exponent and mantissa planes are three (four for fp16). In a fine-tuning delta (small
# changes) the high byte is nearly all zero and the low one holds what changed: on
# bench/checkpoints.py's bf16 fine-tuning chain (2026-12-06, 2 cores) the chain stored 0.3%
# more and its steps loaded 6-8% faster (head.weight's delta, 1.04M words kept: its planes
# decoded in 0.93 against 1.11 ms). fp32's kept words stay under fp32's layout, which stored as
# much and decoded faster on changes of that size.
KEPT_AS_BYTES = frozenset(("bf16", "fp16"))


@dataclass(frozen=True)
class WriteResult:
    checkpoint_id: bytes
    file_size: int
    raw_nbytes: int
    stored_nbytes: int
    tensor_count: int
    parent_id: bytes | None  # None when no tensor ended up as a delta
    delta_count: int
    # What the payload would have been with every tensor coded alone (equal to stored_nbytes
    # when no parent was given): the measure of what deltas saved. A delta's tensor counts
    # as estimated alone, from a sample of it where the delta is under CLEAR_DELTA of that.
    full_stored_nbytes: int
    # Each tensor's content hash (XXH3-128 of its raw bytes), by name, in the file's order.
    content_hashes: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class CodedPlane:
    """One plane ready to write. ``checksum`` may come from whoever coded it (the GPU path);
    the writer computes it when it is None."""
    kind: int
    index: int
    codec: int
    decoded_len: int
    payload: np.ndarray | bytes | Pieces
    params: bytes = b""
    checksum: int | None = None

    @property
    def stored_len(self) -> int:
        return len(self.payload) if isinstance(self.payload, bytes) else self.payload.nbytes


@dataclass(frozen=True)
class CodedTensor:
    layout: Layout
    planes: tuple[CodedPlane, ...]  # a masked tensor's mask plane first
    masked: bool = False

    @property
    def stored(self) -> int:
        return sum(p.stored_len for p in self.planes)


def code_tensor(raw: np.ndarray, dtype: DType, policy_name: str = "auto",
                views: list | None = None) -> CodedTensor:
    """The CPU coder: split ``raw`` by the dtype's preferred layout and code each plane; one
    coded raw plane instead when splitting would store more than the raw bytes. ``views``:
    the plane views of ``raw`` where :func:`estimate_tensor` made them already."""
    layout = layouts.preferred(dtype.name, dtype.itemsize)
    split = _splits(raw, dtype, layout)
    if not split and views is not None:  # (the tensor's one raw plane, estimated)
        cid, enc = policy.encode_view(views[0], layouts.KIND_RAW, policy_name)
        return CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, cid, raw.size,
                                                    enc.payload, enc.params),))
    if split:
        fields = layout.planes(dtype.itemsize)
        if views is None:
            views = layout.views(raw, dtype.itemsize)

        def code(k: int) -> CodedPlane:
            cid, enc = policy.encode_view(views[k], fields[k].kind, policy_name)
            return CodedPlane(fields[k].kind, fields[k].index, cid, views[k].size, enc.payload,
                              enc.params)

        planes = threads.map_sized(code, range(len(fields)), raw.size)
        coded = CodedTensor(layout, tuple(planes))
        if coded.stored <= raw.size:
            return coded
    cid, enc = policy.encode_plane(raw, layouts.KIND_RAW, policy_name)
    return CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, cid, raw.size, enc.payload,
                                                enc.params),))


def _splits(raw: np.ndarray, dtype: DType, layout: Layout) -> bool:
    return raw.size >= SPLIT_MIN and raw.size % layout.word_size(dtype.itemsize) == 0 \
        and layout is not layouts.RAW


def estimate_tensor(raw: np.ndarray, dtype: DType, policy_name: str = "auto"
                    ) -> tuple[int, list]:
    """What :func:`code_tensor` would store for ``raw``, from the planes' statistics (the
    codecs' estimates, as the policy ranks them) without coding it, and the plane views it
    counted (one raw plane where the tensor is not split), for :func:`code_tensor` to reuse
    (a small plane's estimate is its zstd encoding, kept with the view)."""
    layout = layouts.preferred(dtype.name, dtype.itemsize)
    if not _splits(raw, dtype, layout):
        view = PlaneView.of(raw)
        return policy.estimate_view(view, layouts.KIND_RAW, policy_name), [view]
    fields = layout.planes(dtype.itemsize)
    views = layout.views(raw, dtype.itemsize)
    total = sum(policy.estimate_view(v, f.kind, policy_name) for v, f in zip(views, fields))
    return min(total, raw.size), views


def estimate_rough(raw: np.ndarray, dtype: DType) -> int | None:
    """A quick estimate of what :func:`code_tensor` would store for ``raw``, its planes judged
    from samples (:func:`policy.rough_estimate`); None where that cannot tell (a tensor stored
    whole, a plane the LZ coders may shrink)."""
    layout = layouts.preferred(dtype.name, dtype.itemsize)
    if not _splits(raw, dtype, layout):
        return None
    fields = layout.planes(dtype.itemsize)
    views = layout.views(raw, dtype.itemsize, count=False)
    planes = [policy.rough_estimate(v, f.kind) for v, f in zip(views, fields)]
    return None if None in planes else min(raw.size, sum(planes))


def delta_pays(delta: int, alone: int) -> bool:
    """Whether a tensor whose delta stores ``delta`` bytes and which stores ``alone`` bytes
    coded alone is stored as the delta (:data:`DELTA_PAYS`, :data:`DELTA_MIN_SAVED`)."""
    return delta_share_pays(delta, alone) and alone - delta >= DELTA_MIN_SAVED


def delta_can_pay(nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` raw bytes can pay as a delta at all: it stores at most
    its bytes, so one under :data:`DELTA_MIN_SAVED` never saves that many."""
    return nbytes >= DELTA_MIN_SAVED


def delta_share_pays(delta: int, alone: int) -> bool:
    """:func:`delta_pays` by the share alone: for figures of a part of a tensor (a window of
    it), whose saving in bytes says nothing about the whole's."""
    return delta < DELTA_PAYS * alone


@dataclass(frozen=True)
class Pair:
    """:func:`estimate_pair`'s figures, scaled to the whole tensor."""
    alone: int  # what the tensor stores coded alone, by the order-0 coders
    delta: int  # ... its XOR delta
    changed: float  # the share of its words that differ from the parent's
    lz: bool  # whether an LZ coder may shrink a plane of the tensor alone below ``alone``


def estimate_pair(raw: np.ndarray, parent: np.ndarray | None, dtype: DType) -> Pair | None:
    """The tensor ``raw`` alone and its XOR delta against ``parent`` estimated on the same
    sample of both (the words at :func:`s4format.codecs.view.sample_starts`, each plane
    counted there by the order-0 coders), to choose between them without counting either
    whole; None for a tensor the sample would cover whole or that is not split (judged
    exactly instead). With ``parent`` None, the tensor alone (``delta`` and ``changed``
    0)."""
    layout = layouts.preferred(dtype.name, dtype.itemsize)
    word = layout.word_size(dtype.itemsize)
    if not _splits(raw, dtype, layout) or not masked.supported(word):
        return None
    words = raw.view(masked.word_dtype(word))
    if words.size <= PAIR_CHUNKS * PAIR_CHUNK:
        return None
    mine = sample_words(words, PAIR_CHUNKS, PAIR_CHUNK)
    fields = layout.planes(dtype.itemsize)
    n = words.size
    # (every field of a sample counted in one pass: the sample is small, so the calls are
    # what costs)
    shifts, masks = layout.shifts_masks(dtype.itemsize)
    alone = counted(mine, shifts, masks)
    delta, changed = 0, 0.0
    if parent is not None:
        xor = mine ^ sample_words(parent.view(words.dtype), PAIR_CHUNKS, PAIR_CHUNK)
        delta = sum(policy.order0_estimate(v, n) for v in counted(xor, shifts, masks))
        changed = np.count_nonzero(xor) / xor.size
    return Pair(sum(policy.order0_estimate(v, n) for v in alone), delta, changed,
                any(policy.lz_may_pay(v, f.kind, n) for v, f in zip(alone, fields)))


def changed_glance(raw: np.ndarray, parent: np.ndarray, dtype: DType) -> float:
    """The share of ``raw``'s words (under the dtype's split layout) that differ from
    ``parent``'s, judged from :data:`GLANCE` words evenly spaced (1.0 where the words are not
    ones :mod:`s4format.masked` takes): whether a masked form is worth looking for."""
    word = layouts.preferred(dtype.name, dtype.itemsize).word_size(dtype.itemsize)
    if not masked.supported(word) or raw.size % word:
        return 1.0
    words = raw.view(masked.word_dtype(word))
    step = max(1, words.size // GLANCE)
    seen = words[::step]
    return np.count_nonzero(seen != parent.view(words.dtype)[::step]) / max(1, seen.size)


@dataclass(frozen=True)
class MaskedForm:
    """A tensor's masked form (:func:`masked_form`), estimated and ready to code."""
    layout: Layout
    mask: PlaneView
    kept: list[PlaneView]  # the layout's planes of the kept words (none when none is kept)
    estimate: int


def kept_layout(dtype: DType) -> Layout:
    """The layout our writer stores a masked tensor's kept words under (:data:`KEPT_AS_BYTES`);
    its words are the dtype's split layout's, so the mask is the same either way."""
    layout = layouts.preferred(dtype.name, dtype.itemsize)
    return layouts.BYTES if layout.name in KEPT_AS_BYTES else layout


def masked_form(raw: np.ndarray, dtype: DType, policy_name: str = "auto",
                parent: np.ndarray | None = None, layout: Layout | None = None
                ) -> MaskedForm | None:
    """The masked form of ``raw`` (a delta's XOR bytes; or given ``parent``, of ``raw ^
    parent``, found without making the XOR) where at most :data:`MASKED_MAX` of its words
    are non-zero under the dtype's split layout, with what it is estimated to store; else
    None. Its kept words take ``layout`` (default :func:`kept_layout`), whose words must be
    the split layout's. Only ``auto`` masks (format 1.4), and only words of 1, 2, 4 or 8 bytes
    (complex128's 16-byte words stay unmasked)."""
    split = layouts.preferred(dtype.name, dtype.itemsize)
    word = split.word_size(dtype.itemsize)
    if policy_name != "auto" or not _splits(raw, dtype, split) or not masked.supported(word):
        return None
    layout = kept_layout(dtype) if layout is None else layout
    if layout.word_size(dtype.itemsize) != word:
        raise ValueError(f"layout {layout.name} has words of another size than {split.name}'s")
    words = raw.view(masked.word_dtype(word))
    other = None if parent is None else parent.view(masked.word_dtype(word))
    mask, starts = masked.mask_of(words, other)
    if starts[-1] > MASKED_MAX * words.size:
        return None
    kept = masked.kept_words(words, mask, starts, other)
    mask_view = PlaneView.of(mask)
    fields = layout.planes(dtype.itemsize)
    views = layout.views(kept.view(np.uint8), dtype.itemsize) if kept.size else []
    estimate = policy.estimate_view(mask_view, layouts.KIND_MASK, policy_name) + sum(
        policy.estimate_view(v, _kept_kind(layout, split, f), policy_name)
        for v, f in zip(views, fields))
    return MaskedForm(layout, mask_view, views, estimate)


def _kept_kind(layout: Layout, split: Layout, f: layouts.Field) -> int:
    """The plane kind whose codec rules choose for kept plane ``f``: a float's kept words
    under the bytes layout take its planes' rules, the top byte (sign and exponent bits) an
    exponent's and the others a mantissa's (the rules for integers' bytes try zstd on every
    plane, which such noise never pays for); else the field's own kind."""
    if layout is not layouts.BYTES or split is layouts.BYTES:
        return f.kind
    top = f.index == split.word - 1
    return layouts.KIND_EXPONENT if top else layouts.KIND_MANTISSA


def code_masked(form: MaskedForm, dtype: DType, policy_name: str = "auto") -> CodedTensor:
    """Code a tensor's masked form: its mask plane, then the layout's planes of its kept
    words."""
    fields = form.layout.planes(dtype.itemsize)
    split = layouts.preferred(dtype.name, dtype.itemsize)
    items = [(form.mask, layouts.KIND_MASK, 0, layouts.KIND_MASK)] + [
        (v, f.kind, f.index, _kept_kind(form.layout, split, f))
        for v, f in zip(form.kept, fields)]

    def code(item: tuple[PlaneView, int, int, int]) -> CodedPlane:
        view, kind, index, choose_as = item
        cid, enc = policy.encode_view(view, choose_as, policy_name)
        return CodedPlane(kind, index, cid, view.size, enc.payload, enc.params)

    planes = threads.map_sized(code, items, sum(item[0].size for item in items))
    if not form.kept:  # no word kept: the layout's planes are empty
        planes += [CodedPlane(f.kind, f.index, codecs.RAW, 0, b"") for f in fields]
    return CodedTensor(form.layout, tuple(planes), masked=True)


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    run_pieces(lambda lo, hi: np.bitwise_xor(a[lo:hi], b[lo:hi], out=out[lo:hi]), a.size,
               threads.SHARE_MIN)
    return out


class Writer:
    """Stream a .s4w file to ``sink`` (a path or a binary file object opened for writing).

    Call sequence: ``add(name, tensor[, parent=...])`` for each tensor (returns the
    :class:`~s4format.objtree.TensorRef` to put in the tree), optionally ``set_tree(obj)`` and
    ``set_metadata({...})``, then ``close()`` which writes the index and footer.
    """

    def __init__(self, sink: str | os.PathLike[str] | BinaryIO, *, policy: str = "auto",
                 align_log2: int = DEFAULT_ALIGN_LOG2, parent_id: bytes | None = None) -> None:
        self.policy = policy_check(policy)
        self.minor = format_minor(self.policy)
        if not 0 <= align_log2 <= 16:
            raise ValueError("align_log2 must be in 0..16")
        self._own = isinstance(sink, (str, os.PathLike))
        self._f: BinaryIO = open(sink, "wb") if self._own else sink  # noqa: SIM115
        self._pos = 0
        self._align = 1 << align_log2
        self._records: list[dict[str, Any]] = []
        self._names: set[str] = set()
        self._tree: Any = None
        self._metadata: dict[str, str] = {}
        if parent_id is not None and len(parent_id) != 16:
            raise ValueError(f"parent_id must be 16 bytes, not {len(parent_id)}")
        if parent_id is not None and parent_id == bytes(16):
            raise ValueError("parent_id of all zero bytes means no parent (spec X3): pass None")
        self._parent_id = parent_id
        self._raw_total = 0
        self._stored_total = 0
        self._full_total = 0
        self._deltas = 0
        self._closed = False
        self._write(_sealed(Header, dict(magic=MAGIC, major=MAJOR, minor=self.minor,
                                         required_flags=0, optional_flags=0,
                                         align_log2=align_log2, reserved=bytes(3))))

    def _write(self, data: bytes | np.ndarray | memoryview) -> None:
        mv = memoryview(data)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        n, done = mv.nbytes, 0
        try:
            while done < n:
                # a raw (unbuffered) file or socket may take part of the bytes: write the rest
                got = self._f.write(mv[done:] if done else mv)
                if got is None:
                    if isinstance(self._f, io.RawIOBase):  # non-blocking: nothing taken
                        raise StorageError(f"the sink would block at offset {self._pos + done}"
                                           "; give save() a blocking or buffered file")
                    break  # other file objects that do not report counts take everything
                if got <= 0:
                    raise StorageError(f"write made no progress at offset {self._pos + done}")
                done += got
        except OSError as exc:
            raise StorageError(f"write failed at offset {self._pos + done}: {exc}") from exc
        self._pos += n

    def _pad(self) -> None:
        gap = -self._pos % self._align
        if gap:
            self._write(bytes(gap))

    def add(self, name: str, tensor: Tensor | np.ndarray, *,
            parent: Tensor | np.ndarray | None = None) -> objtree.TensorRef:
        """Code and write one tensor. With ``parent`` (same dtype and byte length, from the
        checkpoint named by ``parent_id``), store the XOR delta if that is smaller."""
        if self._closed:
            raise ValueError("writer is closed")
        if name in self._names:
            raise FormatError(f"tensor name {name!r} is used twice")
        return self.add_coded(**self.code(name, tensor, parent=parent))

    def code(self, name: str, tensor: Tensor | np.ndarray, *,
             parent: Tensor | np.ndarray | None = None, alone: int | None = None,
             parent_hash: bytes | None = None) -> dict[str, Any]:
        """Code one tensor as :meth:`add` does, without writing it: the arguments of
        :meth:`add_coded`. Touches no state the writing changes, so one thread can code the
        next tensor while another writes this one. ``alone``: an estimate of what the tensor
        stores coded alone made already (from samples), in place of :func:`estimate_rough`.
        ``parent_hash``: the parent's content hash where the caller knows it (its file's
        index says it), else computed."""
        t = tensor if isinstance(tensor, Tensor) else Tensor.from_numpy(tensor)
        delta_of = None  # the parent's content hash, where the delta is kept
        if parent is not None:
            if self._parent_id is None:
                raise ValueError("a parent tensor needs the writer's parent_id")
            p = parent if isinstance(parent, Tensor) else Tensor.from_numpy(parent)
            if p.nbytes != t.nbytes:
                raise ValueError(f"parent of {name!r} has {p.nbytes} bytes, tensor {t.nbytes}")
        if parent is None or not delta_can_pay(t.nbytes):
            coded = code_tensor(t.data, t.dtype, self.policy)
            full = coded.stored
        else:
            if t.nbytes < SPLIT_MIN:
                # One plane either way (a bias, a norm): coding it both ways takes less than
                # sampling and estimating them (0.2 against 0.3 ms a tensor), and chooses
                # exactly.
                coded = code_tensor(t.data, t.dtype, self.policy)
                delta = code_tensor(_xor(t.data, p.data), t.dtype, self.policy)
                if not delta_pays(delta.stored, coded.stored):
                    return self._coded(name, t, coded, coded.stored)
                return self._coded(name, t, delta, coded.stored,
                                   parent_hash or hashing.content_hash(p.data))
            # A larger tensor: only the one kept is coded. The tensor alone and its delta are
            # compared by their estimates, not by coding both. Where few enough words changed
            # (a glance at the two says so), the masked form is found, its estimate exact.
            # Else a sample of both decides when the delta does not pay (delta_pays): the
            # tensor is coded alone, as a full save codes it, and its delta is never made;
            # otherwise the XOR delta is estimated exactly. The tensor alone is estimated by
            # a sample (exactly where the delta is not clearly smaller, or where an LZ coder
            # may shrink the tensor below what the sample says).
            xor = form = pair = None
            if self.policy == "auto" and changed_glance(t.data, p.data, t.dtype) <= MASK_LOOK:
                # (from the two tensors: the XOR is never made)
                form = masked_form(t.data, t.dtype, self.policy, parent=p.data)
            if form is None and self.policy == "auto":
                pair = estimate_pair(t.data, p.data, t.dtype)
                if pair is not None and not delta_pays(pair.delta, pair.alone):
                    coded = code_tensor(t.data, t.dtype, self.policy)
                    return self._coded(name, t, coded, coded.stored)
            if form is not None:
                est, delta_views = form.estimate, None
            else:
                xor = _xor(t.data, p.data)
                est, delta_views = estimate_tensor(xor, t.dtype, self.policy)
            full_views = None
            if alone is None and form is not None:  # (the tensor alone: the sample's half)
                pair = estimate_pair(t.data, None, t.dtype)
            if alone is not None:
                full = alone
            elif pair is not None:
                full = None if pair.lz else pair.alone
            else:
                full = estimate_rough(t.data, t.dtype)
            # (estimate_pair's figure is taken as it is, estimate_rough's with a margin)
            clear = DELTA_PAYS if pair is not None else CLEAR_DELTA
            if full is None or est > clear * full:
                full, full_views = estimate_tensor(t.data, t.dtype, self.policy)
            if delta_pays(est, full):
                coded = code_masked(form, t.dtype, self.policy) if form is not None else None
                if coded is None or coded.stored > t.nbytes:
                    if xor is None:
                        xor = _xor(t.data, p.data)
                    coded = code_tensor(xor, t.dtype, self.policy, delta_views)
                delta_of = parent_hash or hashing.content_hash(p.data)
            else:
                coded = code_tensor(t.data, t.dtype, self.policy, full_views)
                full = coded.stored
        return self._coded(name, t, coded, full, delta_of)

    @staticmethod
    def _coded(name: str, t: Tensor, coded: CodedTensor, full: int,
               delta_of: bytes | None = None) -> dict[str, Any]:
        """The arguments of :meth:`add_coded` for tensor ``t`` coded as ``coded``."""
        return dict(name=name, dtype=t.dtype, shape=t.shape, coded=coded,
                    content_hash=hashing.content_hash(t.data), parent_hash=delta_of,
                    full_stored=full)

    def code_ahead(self, items: Iterable[tuple[str, Tensor, Tensor | None, int | None,
                                               bytes | None]]) -> Iterator[dict[str, Any]]:
        """:meth:`code` of each ``(name, tensor, parent, alone, parent_hash)``, in order, coded
        ahead on the worker threads while the caller writes: at most :data:`AHEAD` bytes of
        tensors (and at least one) are coded and not yet taken. Tensors under
        :data:`SPLIT_MIN` bytes are coded on the caller's thread: their coding is all Python,
        which two threads only pass the GIL back and forth for (1,000 tensors of 256 bytes,
        2 cores: 93-126 ms a save on the workers, 72-79 on the caller's thread)."""
        return threads.ordered(
            threads.pool(), lambda item: self.code(item[0], item[1], parent=item[2],
                                                   alone=item[3], parent_hash=item[4]),
            ((item, item[1].nbytes) for item in items), AHEAD, SPLIT_MIN)

    def add_coded(self, name: str, dtype: DType, shape: tuple[int, ...], coded: CodedTensor,
                  content_hash: bytes, *, parent_hash: bytes | None = None,
                  full_stored: int | None = None) -> objtree.TensorRef:
        """Write a tensor someone else coded (the GPU path). ``parent_hash`` marks it as an XOR
        delta against the parent tensor with that content hash; ``full_stored`` is what it
        would have stored coded alone (for the delta statistics)."""
        if self._closed:
            raise ValueError("writer is closed")
        if name in self._names:
            raise FormatError(f"tensor name {name!r} is used twice")
        if len(self._names) >= MAX_TENSORS:
            raise LimitError(f"more than {MAX_TENSORS} tensors in one file: readers refuse it "
                             "(spec/validation.md, I0)")
        if parent_hash is not None and self._parent_id is None:
            raise ValueError("a delta tensor needs the writer's parent_id")
        if len(content_hash) != 16 or (parent_hash is not None and len(parent_hash) != 16):
            raise ValueError("content and parent hashes are 16 bytes")
        _check_limits(name, shape, dtype, coded)
        newer = {p.codec for p in coded.planes} - CODECS_OF_MINOR[self.minor]
        if newer:
            raise ValueError(f"tensor {name!r} uses codec IDs {sorted(newer)}, which format "
                             f"{MAJOR}.{self.minor} (policy {self.policy!r}) does not define")
        if coded.masked and self.minor < MASKED_MINOR:
            raise ValueError(f"tensor {name!r} is masked, which format {MAJOR}.{self.minor} "
                             f"(policy {self.policy!r}) does not define")
        planes = []
        for p in coded.planes:
            self._pad()
            offset = self._pos
            buf = p.payload if isinstance(p.payload, bytes | Pieces) else \
                np.ascontiguousarray(p.payload)
            for part in buf.parts if isinstance(buf, Pieces) else (buf,):
                self._write(part)
            checksum = hashing.plane_checksum(buf) if p.checksum is None else p.checksum
            planes.append(dict(kind=p.kind, index=p.index, codec=p.codec, params=p.params,
                               offset=offset, stored_len=p.stored_len,
                               decoded_len=p.decoded_len, checksum=checksum))
        raw_nbytes = math.prod(shape) * dtype.itemsize
        self._records.append(dict(
            name=name, dtype=dtype.code, layout=coded.layout.layout_id,
            transform=TRANSFORM_NONE if parent_hash is None else TRANSFORM_XOR,
            flags=TENSOR_MASKED if coded.masked else 0,
            ndim=len(shape), shape=list(shape), raw_nbytes=raw_nbytes,
            content_hash=content_hash, parent_hash=parent_hash, planes=planes))
        self._names.add(name)
        self._raw_total += raw_nbytes
        self._stored_total += coded.stored
        self._full_total += coded.stored if full_stored is None else full_stored
        self._deltas += parent_hash is not None
        return objtree.TensorRef(len(self._records) - 1)

    def set_tree(self, tree: Any) -> None:
        self._tree = tree

    def set_metadata(self, metadata: dict[str, str]) -> None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must map str to str")
        self._metadata = dict(metadata)

    def close(self) -> WriteResult:
        if self._closed:
            raise ValueError("writer is closed")
        tree = objtree.encode(self._tree, len(self._records))
        if len(tree) > MAX_INDEX_SIZE:
            raise LimitError(f"object tree of {len(tree)} bytes exceeds the index limit")
        # A file in which no tensor chose the delta depends on nothing: it is a base.
        parent_id = self._parent_id if self._deltas else None
        metadata = objtree.encode(self._metadata)
        index = build_index(self._records, parent_id or NO_PARENT, tree, metadata)
        if index is None:  # (construct's interpreted schema raises what is wrong with a
            # field; its compiled builder would not check the hashes' lengths)
            index = Index.build(dict(
                tensors=self._records, parent_id=parent_id or NO_PARENT, tree=tree,
                metadata=metadata, extensions=[]))
        if len(index) > MAX_INDEX_SIZE:
            raise LimitError(f"index of {len(index)} bytes exceeds {MAX_INDEX_SIZE}")
        index_offset = self._pos
        self._write(index)
        self._write(_sealed(Footer, dict(index_offset=index_offset, index_length=len(index),
                                         index_checksum=hashing.bytes_checksum(index))))
        self._closed = True
        if self._own:
            self._f.close()
        return WriteResult(checkpoint_id([r["content_hash"] for r in self._records]), self._pos,
                           self._raw_total, self._stored_total, len(self._records), parent_id,
                           self._deltas, self._full_total,
                           {r["name"]: r["content_hash"] for r in self._records})

    def abort(self) -> None:
        """Stop without an index: a file this writer created itself is removed (it would
        not be a valid .s4w file); a caller's file object is left to the caller."""
        self._closed = True
        if self._own:
            self._f.close()
            with contextlib.suppress(OSError):
                os.unlink(self._f.name)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _check_limits(name: str, shape: tuple[int, ...], dtype: DType, coded: CodedTensor) -> None:
    """Refuse what a reader would refuse (spec/validation.md), before writing a byte of it."""
    raw_nbytes = math.prod(shape) * dtype.itemsize
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedObjectError(f"tensor name {name!r} is not storable text (it holds a "
                                     "lone surrogate); use str keys that are valid Unicode"
                                     ) from None
    if len(encoded) > MAX_NAME_BYTES:
        raise LimitError(f"tensor name of {len(encoded)} bytes exceeds {MAX_NAME_BYTES}")
    if len(shape) > MAX_NDIM or any(s < 0 for s in shape) \
            or extent_nbytes(shape, dtype.itemsize) > MAX_RAW_NBYTES:
        raise LimitError(f"tensor {name!r}: shape {list(shape)} is beyond the format's limits")
    if coded.stored > raw_nbytes and coded.layout is not layouts.RAW:
        raise LimitError(f"tensor {name!r}: coded planes store {coded.stored} bytes, more than "
                         f"its {raw_nbytes} raw bytes; store it with the raw layout")
    coded.layout.check_applies(raw_nbytes, dtype.itemsize)
    want = len(coded.layout.planes(dtype.itemsize)) + (1 if coded.masked else 0)
    if len(coded.planes) != want:
        raise FormatError(f"tensor {name!r}: layout {coded.layout.name} needs {want} planes, "
                          f"got {len(coded.planes)}")
    # P1-P4, as a reader checks them: a plane in the wrong place, of the wrong length, of an
    # unknown codec, or declaring more than its codec can produce is refused before writing
    check_planes(f"tensor {name!r}", coded.layout, dtype.itemsize, raw_nbytes, coded.planes,
                 coded.masked)


def _sealed(struct_, fields: dict[str, Any]) -> bytes:
    """Build a fixed struct whose ``checksum`` field is the XXH3-64 of its first 24 bytes."""
    draft = struct_.build({**fields, "checksum": 0})
    return struct_.build({**fields, "checksum": hashing.bytes_checksum(draft[:24])})


def write(sink: str | os.PathLike[str] | BinaryIO, tree: Any, *, policy: str = "auto",
          metadata: dict[str, str] | None = None) -> WriteResult:
    """Write a tree whose leaves may be numpy arrays or :class:`Tensor`s (named by key path)."""
    with Writer(sink, policy=policy) as w:
        w.set_tree(_attach(tree, w, "", {}))
        if metadata:
            w.set_metadata(metadata)
        return w.close()


def dumps(tree: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    write(buf, tree, **kwargs)
    return buf.getvalue()


def _attach(obj: Any, w: Writer, path: str, seen: dict[int, objtree.TensorRef]) -> Any:
    if isinstance(obj, (Tensor, np.ndarray)):
        if id(obj) not in seen:
            seen[id(obj)] = w.add(_unique_name(path or "<root>", w), obj)
        return seen[id(obj)]
    t = type(obj)
    if t is list or t is tuple:
        return t(_attach(x, w, objtree.key_path(path, i), seen) for i, x in enumerate(obj))
    if t is dict or t.__name__ == "OrderedDict":
        return t((k, _attach(v, w, objtree.key_path(path, k), seen))
                 for k, v in obj.items())
    if t is objtree.Typed:
        return objtree.Typed(obj.name, _attach(obj.value, w, path, seen))
    return obj


def _unique_name(name: str, w: Writer) -> str:
    # Key paths can collide ("a.b" as one key and as a nested path, 1 and "1") while tensor
    # names must be unique: a later tensor on a taken path gets a "#n" suffix.
    candidate, n = name, 1
    while candidate in w._names:
        n += 1
        candidate = f"{name}#{n}"
    return candidate
