"""The reader's fast index reader (s4format.indexread) reads exactly the indexes construct's
schema reads, field for field, and gives up on every other: on all conformance vectors and
on cut, extended and altered indexes of a delta file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from construct import ConstructError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format.indexread import read_index
from s4format.schema import Index
from tests.format.common import index_of

SUITES = Path(__file__).parents[2] / "conformance"
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _plain(value):
    """construct's containers as plain dicts and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _agree(raw: bytes) -> bool:
    """Whether read_index and the schema agree on ``raw``; True if construct read it."""
    try:
        want = Index.parse(raw)
    except ConstructError:
        want = None
    got = read_index(raw)
    if want is None or want.extensions:
        assert got is None
        return want is not None
    assert got is not None
    assert [dict(t) for t in got.tensors] == _plain(list(want.tensors))
    assert (got.parent_id, got.tree, got.metadata) == (want.parent_id, want.tree, want.metadata)
    return True


def test_every_conformance_vector() -> None:
    read = 0
    for path in sorted(SUITES.glob("v1*/*.s4w")):
        raw = index_of(path.read_bytes())
        if raw is not None:
            read += _agree(raw)
    assert read >= 150, read


def _deltaindex_of() -> bytes:
    rng = np.random.default_rng(3)
    a = rng.normal(0, 0.02, 4096).astype(np.float32)
    b = a.copy()
    b[::7] += 1e-3
    delta = io.BytesIO()
    with s4format.Reader(s4format.dumps({"w": a, "n": np.arange(40)})) as parent:
        w = s4format.Writer(delta, parent_id=parent.checkpoint_id)
        w.set_tree({"w": w.add("w", b, parent=parent.read("w")),
                    "n": w.add("n", np.arange(40))})
        w.close()
    raw = index_of(delta.getvalue())
    assert raw is not None and _agree(raw)
    assert read_index(raw).tensors[0]["parent_hash"] is not None
    return raw


INDEX = _deltaindex_of()


@settings(max_examples=400, **SETTINGS)
@given(edits=st.lists(st.tuples(st.integers(0, len(INDEX) - 1), st.integers(0, 255)),
                      min_size=1, max_size=4))
def test_altered_indexes(edits) -> None:
    raw = bytearray(INDEX)
    for at, value in edits:
        raw[at] = value
    _agree(bytes(raw))


@settings(max_examples=200, **SETTINGS)
@given(cut=st.integers(0, len(INDEX)), tail=st.binary(max_size=24))
def test_cut_or_extended_indexes(cut: int, tail: bytes) -> None:
    _agree(INDEX[:cut] + tail)
