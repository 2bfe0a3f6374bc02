"""Validated views of the index: :class:`PlaneInfo`, :class:`TensorInfo` and the checks that
turn a parsed index into them (``spec/validation.md``). Every rule runs before any payload is
read or any buffer sized from the file is allocated; sizes are Python ints, so no arithmetic can
overflow."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

from s4format import codecs, dtypes, layouts, masked
from s4format.codecs import Codec
from s4format.dtypes import DType
from s4format.errors import FormatError, LimitError, S4Error, UnsupportedFeatureError
from s4format.layouts import Layout
from s4format.schema import HEADER_SIZE, TENSOR_FLAGS, TENSOR_MASKED, TRANSFORM_NONE, TRANSFORM_XOR

MAX_NDIM = 64
MAX_RAW_NBYTES = 1 << 62
# A masked tensor's first plane (spec/planes.md, "Masked tensors"): a byte of 8 bits per 8 words.
MASK_FIELD = layouts.Field(layouts.KIND_MASK, 0, 0, 8)


class PlaneInfo(NamedTuple):
    # (named tuples, not frozen dataclasses: built about 3x faster, and an index of thousands
    # of tensors builds one per plane when a file is opened)
    kind: int
    index: int
    codec: int
    params: bytes
    offset: int
    stored_len: int
    decoded_len: int
    checksum: int

    @property
    def label(self) -> str:
        return layouts.plane_label(self.kind, self.index)


class TensorInfo(NamedTuple):
    name: str
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout
    transform: int
    raw_nbytes: int
    content_hash: bytes
    parent_hash: bytes | None
    planes: tuple[PlaneInfo, ...]  # in record order: a masked tensor's mask plane first
    flags: int = 0

    @property
    def stored_nbytes(self) -> int:
        return sum(p.stored_len for p in self.planes)

    @property
    def is_delta(self) -> bool:
        return self.transform == TRANSFORM_XOR

    @property
    def masked(self) -> bool:
        return bool(self.flags & TENSOR_MASKED)

    @property
    def layout_planes(self) -> tuple[PlaneInfo, ...]:
        """The planes of the layout's fields (all but a masked tensor's mask plane)."""
        return self.planes[1:] if self.masked else self.planes


# (layout ID, itemsize) -> the layout, its word size and its planes' (kind, index), for the
# records that pass every rule at once (:func:`_plain_info`)
_LAYOUT_FIELDS: dict[tuple[int, int], tuple[Layout, int, tuple[tuple[int, int], ...]]] = {}


def tensor_info(rec, where: str | Callable[[], str], data_end: int, alignment: int,
                codec_of: Callable[[int], Codec] | None = None) -> TensorInfo:
    """Check one parsed tensor record against the spec's rules and the file's data section.
    (The record's fields are read as items: a construct Container's attribute access costs
    about 16 times as much, most of opening a file of many tensors.) ``codec_of``:
    :func:`decodable_codec`, or a cache of it for the records of one index. ``where``: the
    record's place in messages, or a function making it (called only for a message)."""
    codec_of = codec_of or decodable_codec
    info = _plain_info(rec, data_end, alignment, codec_of)
    if info is not None:
        return info
    return _checked_info(rec, where if isinstance(where, str) else where(), data_end,
                         alignment, codec_of)


def _plain_info(rec, data_end: int, alignment: int, codec_of: Callable[[int], Codec]
                ) -> TensorInfo | None:
    """:func:`plain_info` of a parsed record (construct's container or its dict)."""
    return plain_info(rec["name"], rec["dtype"], rec["layout"], rec["transform"], rec["flags"],
                      rec["ndim"], rec["shape"], rec["raw_nbytes"], rec["content_hash"],
                      rec["parent_hash"],
                      [(p["kind"], p["index"], p["codec"], p["params"], p["offset"],
                        p["stored_len"], p["decoded_len"], p["checksum"]) for p in rec["planes"]],
                      data_end, alignment, codec_of)


def plain_info(name: str, dtype_code: int, layout_id: int, transform: int, flags: int,
               ndim: int, shape, raw_nbytes: int, content_hash, parent_hash, planes: list[tuple],
               data_end: int, alignment: int, codec_of: Callable[[int], Codec]
               ) -> TensorInfo | None:
    """:func:`_checked_info` of a record, given as its fields (``planes``: each plane's fields
    in :class:`PlaneInfo`'s order), that passes every rule, in fewer steps (a file of
    thousands of tensors checks one per tensor when it is opened); None for any other record,
    which _checked_info then checks and refuses in the spec's order."""
    dtype = dtypes.BY_CODE.get(dtype_code)
    if (flags and flags != TENSOR_MASKED) or dtype is None or ndim > MAX_NDIM \
            or transform not in (TRANSFORM_NONE, TRANSFORM_XOR):
        return None
    shape = tuple(shape)
    if 0 in shape or raw_nbytes > MAX_RAW_NBYTES \
            or math.prod(shape) * dtype.itemsize != raw_nbytes:
        return None
    key = (layout_id, dtype.itemsize)
    got = _LAYOUT_FIELDS.get(key)
    if got is None:
        layout = layouts.BY_ID.get(layout_id)
        if layout is None:
            return None
        fields = tuple((f.kind, f.index) for f in layout.planes(dtype.itemsize))
        got = _LAYOUT_FIELDS[key] = (layout, layout.word_size(dtype.itemsize), fields)
    layout, word, fields = got
    want = raw_nbytes if layout is layouts.RAW else raw_nbytes // word
    wants = (want,) * len(fields)
    if flags:  # masked: the mask's bytes, then the kept words (at most all), rule P2
        if layout is layouts.RAW or len(planes) < 2:
            return None
        kept = planes[1][6]
        fields = ((MASK_FIELD.kind, MASK_FIELD.index), *fields)
        wants = (masked.mask_len(want), *(kept,) * len(wants))
        if kept > want:
            return None
    if raw_nbytes % word or len(planes) != len(fields):
        return None
    infos = []
    for (kind, index), want, p in zip(fields, wants, planes):
        p_kind, p_index, codec_id, params, offset, stored, decoded, checksum = p
        if p_kind != kind or p_index != index or decoded != want \
                or offset < HEADER_SIZE or offset % alignment or offset + stored > data_end:
            return None
        try:
            codec = codec_of(codec_id)
        except S4Error:
            return None
        if decoded > codec.max_decoded_len(stored):
            return None
        infos.append(PlaneInfo(kind, index, codec_id, bytes(params), offset, stored, decoded,
                               checksum))
    return TensorInfo(name, dtype, shape, layout, transform, raw_nbytes, bytes(content_hash),
                      bytes(parent_hash) if parent_hash is not None else None,
                      tuple(infos), flags)


def _checked_info(rec, where: str, data_end: int, alignment: int,
                  codec_of: Callable[[int], Codec]) -> TensorInfo:
    """:func:`tensor_info`, each rule in the spec's order with its message."""
    flags = rec["flags"]
    if flags & ~TENSOR_FLAGS:
        raise UnsupportedFeatureError(f"{where}: reserved tensor flags {flags & ~TENSOR_FLAGS:#x}"
                                      " are set")
    dtype = dtypes.BY_CODE.get(rec["dtype"]) or _located(where, dtypes.by_code, rec["dtype"])
    if rec["ndim"] > MAX_NDIM:
        raise LimitError(f"{where}: {rec['ndim']} dimensions, the limit is {MAX_NDIM}")
    shape = tuple(rec["shape"])
    raw_nbytes = rec["raw_nbytes"]
    expected = math.prod(shape) * dtype.itemsize
    if expected > MAX_RAW_NBYTES or raw_nbytes > MAX_RAW_NBYTES:
        raise LimitError(f"{where}: raw size {max(expected, raw_nbytes)} exceeds 2^62 bytes")
    # (without a zero dimension the extent is ``expected``, checked above)
    if 0 in shape and extent_nbytes(shape, dtype.itemsize) > MAX_RAW_NBYTES:
        raise LimitError(f"{where}: empty tensor of shape {list(shape)} of {dtype.name}: its "
                         "sizes, zeros counted as 1, multiply to over 2^62 bytes")
    if raw_nbytes != expected:
        raise FormatError(f"{where}: raw_nbytes {raw_nbytes} != {expected} for "
                          f"{dtype.name}{list(shape)}")
    transform = rec["transform"]
    if transform not in (TRANSFORM_NONE, TRANSFORM_XOR):
        raise UnsupportedFeatureError(f"{where}: unknown transform {transform}")
    layout = _located(where, layouts.by_id, rec["layout"])
    words = _located(where, lambda n: layout.check_applies(n, dtype.itemsize), raw_nbytes)
    fields = plane_fields(layout, dtype.itemsize, bool(flags & TENSOR_MASKED))
    recs = rec["planes"]
    if len(recs) != len(fields):
        raise FormatError(f"{where}: layout {layout.name}"
                          f"{' (masked)' if flags & TENSOR_MASKED else ''} has "
                          f"{len(fields)} planes, record lists {len(recs)}")
    wants = plane_lengths(layout, raw_nbytes, words, bool(flags & TENSOR_MASKED),
                          [p["decoded_len"] for p in recs])
    planes = []
    for field, p, want in zip(fields, recs, wants):
        info = PlaneInfo(p["kind"], p["index"], p["codec"], bytes(p["params"]), p["offset"],
                         p["stored_len"], p["decoded_len"], p["checksum"])
        if not plane_fits(field, info, want, codec_of) \
                or info.offset < HEADER_SIZE or info.offset % alignment \
                or info.offset + info.stored_len > data_end:
            _refuse_plane(where, layout, field, info, want, data_end, alignment, codec_of)
        planes.append(info)
    parent_hash = rec["parent_hash"]
    return TensorInfo(rec["name"], dtype, shape, layout, transform, raw_nbytes,
                      bytes(rec["content_hash"]),
                      bytes(parent_hash) if parent_hash is not None else None,
                      tuple(planes), flags)


def plane_fields(layout: Layout, itemsize: int, is_masked: bool) -> tuple[layouts.Field, ...]:
    """The fields a tensor's plane records follow, in order: a masked tensor's mask first."""
    fields = layout.planes(itemsize)
    return (MASK_FIELD, *fields) if is_masked else fields


def plane_lengths(layout: Layout, raw_nbytes: int, words: int, is_masked: bool,
                  declared: list[int]) -> list[int]:
    """The decoded length each plane must declare (rule P2): ``raw_nbytes`` for the raw layout,
    else the ``words``; for a masked tensor, its mask's bytes and then the kept words,
    which its first value plane declares (at most the words; ``declared``: the planes'
    declared lengths)."""
    n = raw_nbytes if layout is layouts.RAW else words
    if not is_masked:
        return [n] * len(declared)
    kept = declared[1] if len(declared) > 1 and declared[1] <= n else n
    return [masked.mask_len(n)] + [kept] * (len(declared) - 1)


def extent_nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Rule T4's measure: the bytes of ``shape`` with every 0 counted as 1. Bounding it bounds
    every size and contiguous stride of an empty tensor too, which torch keeps in int64."""
    return math.prod(max(n, 1) for n in shape) * itemsize


def plane_fits(field, p: PlaneInfo, want: int, lookup: Callable[[int], Codec] = codecs.get
               ) -> bool:
    """Rules P1-P4 for plane ``p`` in ``field``'s place of a tensor whose planes decode to
    ``want`` bytes: the writer checks them before writing (``lookup``: the registered codecs),
    the reader on opening (:func:`decodable_codec`)."""
    codec = _or_none(lookup, p.codec)
    return codec is not None and (p.kind, p.index) == (field.kind, field.index) \
        and p.decoded_len == want and p.decoded_len <= codec.max_decoded_len(p.stored_len)


def check_planes(where: str, layout: Layout, itemsize: int, raw_nbytes: int, planes,
                 is_masked: bool = False) -> None:
    """:func:`plane_fits` for every plane a writer is about to write (``planes``: objects with
    kind, index, codec, params, stored_len and decoded_len), raising the reader's error."""
    words = layout.check_applies(raw_nbytes, itemsize)
    wants = plane_lengths(layout, raw_nbytes, words, is_masked, [p.decoded_len for p in planes])
    for field, p, want in zip(plane_fields(layout, itemsize, is_masked), planes, wants):
        info = PlaneInfo(p.kind, p.index, p.codec, bytes(p.params), HEADER_SIZE, p.stored_len,
                         p.decoded_len, 0)
        # the optional GPU-only codec (codecs.md) is written where nvCOMP coded it, whether or
        # not this process registered a decoder for it; it defines no expansion bound
        if p.codec == codecs.NVCOMP_ANS and _or_none(codecs.get, p.codec) is None \
                and (p.kind, p.index) == (field.kind, field.index) and p.decoded_len == want:
            continue
        if not plane_fits(field, info, want):  # (placed where the offset rules hold)
            _refuse_plane(where, layout, field, info, want, HEADER_SIZE + p.stored_len, 1)


def _refuse_plane(where: str, layout: Layout, field, p: PlaneInfo, want: int, data_end: int,
                  alignment: int, lookup: Callable[[int], Codec] = codecs.get) -> None:
    """Raise the error of the first rule plane ``p`` breaks, in the spec's order (the checks of
    :func:`tensor_info`, spelled out with their messages; only called for a bad plane)."""
    at = f"{where} plane {p.label}"
    if (p.kind, p.index) != (field.kind, field.index):
        raise FormatError(f"{at}: layout {layout.name} expects plane {field.label} here")
    if p.decoded_len != want:
        raise FormatError(f"{at}: decoded length {p.decoded_len}, layout needs {want}")
    codec = _located(at, lookup, p.codec)
    if p.decoded_len > codec.max_decoded_len(p.stored_len):
        raise LimitError(f"{at}: declares {p.decoded_len} decoded bytes from {p.stored_len} "
                         f"stored, beyond what codec {codec.name} can produce")
    if p.offset < HEADER_SIZE or p.offset % alignment:
        raise FormatError(f"{at}: offset {p.offset} is not an aligned offset in the data "
                          f"section (alignment {alignment})")
    if p.offset + p.stored_len > data_end:
        raise FormatError(f"{at}: bytes {p.offset}..{p.offset + p.stored_len} run past the "
                          f"data section, which ends at {data_end}")
    raise AssertionError(f"{at}: refused, but breaks no rule")


def decodable_codec(codec_id: int) -> Codec:
    """The codec ``codec_id`` names if this process can decode it (rule P3), else
    UnsupportedCodecError: an unknown ID, or a registered codec whose optional library does not
    load here (gdeflate without nvCOMP's CPU library), so that a file using it is refused
    whole when it is opened, as codecs.md requires, not when that plane is decoded."""
    codec = codecs.get(codec_id)
    library = getattr(codec, "library", None)  # a codec with an optional library binds it here
    if library is not None:
        library()  # raises UnsupportedCodecError saying how to install the library
    return codec


def _or_none(lookup: Callable[[int], Codec], codec_id: int) -> Codec | None:
    try:
        return lookup(codec_id)
    except S4Error:
        return None


def _located(where: str, lookup, key: int):
    """``lookup(key)``, with its error saying which file, tensor and plane named the key."""
    try:
        return lookup(key)
    except S4Error as exc:
        raise type(exc)(f"{where}: {exc}") from None


def check_no_overlap(tensors: list[TensorInfo], where: str) -> None:
    """FormatError, naming ``where`` (the file) and both planes, if two non-empty planes share
    a byte (rule X2)."""
    # the check on the bytes alone; the planes are named only for the message
    ends = sorted((p.offset, p.offset + p.stored_len)
                  for t in tensors for p in t.planes if p.stored_len)
    if all(s1 >= e0 for (_s0, e0), (s1, _e1) in itertools.pairwise(ends)):
        return
    spans = sorted((p.offset, p.offset + p.stored_len, t.name, p.label)
                   for t in tensors for p in t.planes if p.stored_len)
    for (s0, e0, t0, l0), (s1, _e1, t1, l1) in itertools.pairwise(spans):
        if s1 < e0:
            raise FormatError(f"{where}: plane {t0}/{l0} (bytes {s0}..{e0}) overlaps plane "
                              f"{t1}/{l1} starting at {s1}")
