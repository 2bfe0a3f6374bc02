"""Property tests of the container: random trees round-trip exactly; incompressible tensors
never store more than their raw bytes and cost at most a record plus alignment padding; random
damage to a valid index (checksums recomputed) and random tree bytes raise only S4Error."""

from __future__ import annotations

import io
import math
from collections import OrderedDict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from conformance import craft
from s4format import Reader, S4Error, Tensor, Typed, Writer, dtypes, objtree
from s4format.schema import FOOTER_SIZE, HEADER_SIZE, Index, TensorRecord
from tests.format.common import POLICIES, assert_same_tree, small_file

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

NUMPY_DTYPES = ["|b1", "|u1", "|i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4",
                "<f8", "<c8", "<c16", ">i2", ">i4", ">f4", ">f8", ">c8", ">u8"]
BITS_ONLY = [d.name for d in dtypes.BY_NAME.values()
             if d.name in ("bfloat16", "complex32") or d.name.startswith("float8")
             or d.name.startswith("float4")]

shapes = st.one_of(
    st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    st.integers(1024, 3000).map(lambda n: (n,)),  # crosses the split threshold for >= 2 bytes
)


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(shapes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = np.frombuffer(rng.bytes(math.prod(shape) * dtype.itemsize), np.uint8)
    if dtype.kind == "b":
        raw = raw & 1
    a = raw.view(dtype).reshape(shape)
    if draw(st.booleans()) and a.ndim >= 1 and a.shape[0] > 1:
        a = a[::-1]  # not C-contiguous
    return a


@st.composite
def bit_tensors(draw) -> Tensor:
    d = dtypes.by_name(draw(st.sampled_from(BITS_ONLY)))
    shape = draw(shapes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = np.frombuffer(rng.bytes(math.prod(shape) * d.itemsize), np.uint8)
    return Tensor.from_numpy(raw.view(np.dtype(d.numpy)).reshape(shape), dtype=d.name)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**300), 2**300),
    st.floats(allow_nan=True, allow_infinity=True), st.just(-0.0), st.just(float("nan")),
    st.text(max_size=20), st.binary(max_size=20),
)
keys = st.one_of(st.text(max_size=6), st.integers(-3, 3), st.binary(max_size=3),
                 st.tuples(st.integers(0, 2), st.text(max_size=2)))
trees = st.recursive(
    st.one_of(scalars, arrays(), bit_tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(lambda d: OrderedDict(d)),
        st.builds(Typed, st.just("x.y"), children),  # an unregistered name: any value
        st.builds(Typed, st.just("torch.Size"),  # a registered one: its form (objects.md O12)
                  st.lists(st.integers(0, 2**63 - 1), max_size=4).map(tuple)),
    ),
    max_leaves=12,
)


@settings(max_examples=200, **SETTINGS)
@given(tree=trees, policy=st.sampled_from(POLICIES))
def test_random_trees_round_trip(tree, policy: str) -> None:
    blob = s4format.dumps(tree, policy=policy)
    with Reader(blob) as r:
        assert_same_tree(r.load(), tree)
        assert s4format.verify(r) == []


@st.composite
def incompressible(draw) -> list[Tensor]:
    out = []
    for _ in range(draw(st.integers(1, 5))):
        d = dtypes.BY_CODE[draw(st.sampled_from(sorted(dtypes.BY_CODE)))]
        n = draw(st.one_of(st.integers(0, 40), st.integers(1000, 5000)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        raw = np.frombuffer(rng.bytes(n * d.itemsize), np.uint8).copy()
        if d.name == "bool":
            raw &= 1
        out.append(Tensor(d, (n,), raw))
    return out


@settings(max_examples=150, **SETTINGS)
@given(tensors=incompressible(), policy=st.sampled_from(POLICIES),
       align_log2=st.sampled_from([0, 3, 6, 12]))
def test_incompressible_data_costs_at_most_record_and_padding(tensors, policy: str,
                                                              align_log2: int) -> None:
    buf = io.BytesIO()
    with Writer(buf, policy=policy, align_log2=align_log2) as w:
        for i, t in enumerate(tensors):
            w.add(f"t{i}", t)
    blob = buf.getvalue()
    parts = craft.parse(blob)
    bare_index = len(Index.build({**parts.index, "tensors": []}))
    allowance = 0
    with Reader(blob) as r:
        for t, rec in zip(r.tensors, parts.tensors):
            assert t.stored_nbytes <= t.raw_nbytes, t.name
            allowance += len(TensorRecord.build(rec)) + ((1 << align_log2) - 1) * len(t.planes)
        stored = sum(t.stored_nbytes for t in r.tensors)
        for t, want in zip(r.tensors, tensors):
            assert r.read(t.name).data.tobytes() == want.data.tobytes()
    overhead = len(blob) - HEADER_SIZE - FOOTER_SIZE - bare_index - stored
    assert 0 <= overhead <= allowance
    # The bound of spec/format.md §14, from the fields alone.
    records = sum(32 + len(rec["name"].encode()) + 8 * rec["ndim"]
                  + 16 * (rec["parent_hash"] is not None)
                  + sum(38 + len(p["params"]) for p in rec["planes"]) for rec in parts.tensors)
    planes = sum(len(rec["planes"]) for rec in parts.tensors)
    assert len(blob) <= sum(t.nbytes for t in tensors) + 32 + 40 + 34 \
        + len(parts.index["tree"]) + len(parts.index["metadata"]) + records \
        + planes * ((1 << align_log2) - 1)


BLOB = small_file()
PARTS = craft.parse(BLOB)
INDEX = craft.index_bytes(PARTS.index)


def _outcome(blob: bytes) -> None:
    """Open, read everything and verify; any S4Error is an acceptable refusal."""
    try:
        with Reader(blob) as r:
            for i in range(len(r.tensors)):
                r.read(i)
            s4format.verify(r)
            r.load()
    except S4Error:
        pass


def _edited(edits) -> bytes:
    """INDEX with byte ``at`` set to ``value`` for each edit."""
    index = bytearray(INDEX)
    for at, value in edits:
        index[at] = value
    return bytes(index)


INDEX_EDITS = st.tuples(st.integers(0, len(INDEX) - 1), st.integers(0, 255))


@settings(max_examples=800, **SETTINGS)
@given(edits=st.lists(INDEX_EDITS, min_size=1, max_size=4))
def test_damaged_index_with_valid_checksums_raises_only_s4error(edits) -> None:
    _outcome(craft.build(PARTS, index=_edited(edits)))


@settings(max_examples=100, **SETTINGS)
@given(cut=st.integers(0, len(INDEX)), tail=st.binary(max_size=16))
def test_cut_or_extended_index_raises_only_s4error(cut: int, tail: bytes) -> None:
    _outcome(craft.build(PARTS, index=INDEX[:cut] + tail))


@settings(max_examples=300, **SETTINGS)
@given(data=st.binary(max_size=64), count=st.integers(0, 4))
def test_random_tree_bytes_decode_or_raise_format_error(data: bytes, count: int) -> None:
    try:
        value = objtree.decode(data, count)
    except s4format.FormatError:
        return
    assert objtree.encode(value) == data  # whatever decodes has exactly one encoding


@settings(max_examples=400, **SETTINGS)
@given(edits=st.lists(INDEX_EDITS, min_size=0, max_size=4))
def test_compiled_index_parser_agrees_with_the_interpreted_one(edits) -> None:
    # the reader parses with construct's compiled parser and falls back to the interpreted one
    # on failure: both must accept the same indexes, with the same records
    _same_parse(_edited(edits))


@settings(max_examples=100, **SETTINGS)
@given(cut=st.integers(0, len(INDEX)), tail=st.binary(max_size=16))
def test_compiled_index_parser_agrees_on_cut_or_extended_indexes(cut: int, tail: bytes) -> None:
    _same_parse(INDEX[:cut] + tail)


def _same_parse(index: bytes) -> None:
    from construct import ConstructError

    from s4format.schema import Index, compiled_index

    try:
        want = Index.parse(index)
    except ConstructError:
        want = None
    try:
        got = compiled_index().parse(index)
    except Exception:  # the compiled code raises bare struct/codec/index errors
        got = None
    assert (got is None) == (want is None)
    if want is not None:
        assert got == want
