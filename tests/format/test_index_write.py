"""The writer's fast index writer (s4format.indexwrite) writes byte for byte what construct's
schema builds, and gives up on every record construct would refuse: on all conformance
vectors' indexes, on generated records, and on records with a field out of its range."""

from __future__ import annotations

from pathlib import Path

import pytest
from construct import ConstructError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s4format.indexwrite import build_index
from s4format.schema import NO_PARENT, TRANSFORM_NONE, TRANSFORM_XOR, Index
from tests.format.common import index_of

SUITES = Path(__file__).parents[2] / "conformance"


def _schema(tensors, parent_id, tree, metadata) -> bytes | None:
    try:
        return Index.build(dict(tensors=tensors, parent_id=parent_id, tree=tree,
                                metadata=metadata, extensions=[]))
    except (ConstructError, TypeError, ValueError, UnicodeEncodeError, AttributeError,
            KeyError):
        return None


def _records(parsed) -> list[dict]:
    """construct's parsed records as the writer's dicts."""
    out = []
    for t in parsed.tensors:
        rec = {k: v for k, v in t.items() if not k.startswith("_")}
        rec["shape"] = list(rec["shape"])
        rec["planes"] = [{k: v for k, v in p.items() if not k.startswith("_")}
                         for p in t.planes]
        out.append(rec)
    return out


def test_every_conformance_vector_is_rebuilt_byte_for_byte() -> None:
    rebuilt = 0
    for path in sorted(SUITES.glob("v1*/*.s4w")):
        raw = index_of(path.read_bytes())
        try:
            parsed = Index.parse(raw) if raw is not None else None
        except ConstructError:
            continue
        if parsed is None or parsed.extensions:
            continue
        got = build_index(_records(parsed), parsed.parent_id, parsed.tree, parsed.metadata)
        assert got == raw, path.name
        rebuilt += 1
    assert rebuilt >= 150, rebuilt


_planes = st.lists(st.fixed_dictionaries({
    "kind": st.integers(0, 255), "index": st.integers(0, 255), "codec": st.integers(0, 65535),
    "params": st.binary(max_size=20), "offset": st.integers(0, 2**64 - 1),
    "stored_len": st.integers(0, 2**64 - 1), "decoded_len": st.integers(0, 2**64 - 1),
    "checksum": st.integers(0, 2**64 - 1)}), max_size=5)


@st.composite
def _record(draw) -> dict:
    shape = draw(st.lists(st.integers(0, 2**64 - 1), max_size=6))
    transform = draw(st.sampled_from([TRANSFORM_NONE, TRANSFORM_XOR, 7]))
    return {"name": draw(st.text(max_size=12)), "dtype": draw(st.integers(0, 255)),
            "layout": draw(st.integers(0, 255)), "transform": transform,
            "flags": draw(st.integers(0, 255)), "ndim": len(shape), "shape": shape,
            "raw_nbytes": draw(st.integers(0, 2**64 - 1)),
            "content_hash": draw(st.binary(min_size=16, max_size=16)),
            "parent_hash": draw(st.binary(min_size=16, max_size=16))
            if transform == TRANSFORM_XOR else None, "planes": draw(_planes)}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=st.lists(_record(), max_size=4), parent=st.binary(min_size=16, max_size=16),
       tree=st.binary(max_size=40), metadata=st.binary(max_size=40))
def test_generated_records_build_as_the_schema_builds_them(tensors, parent, tree,
                                                           metadata) -> None:
    want = _schema(tensors, parent, tree, metadata)
    assert want is not None
    assert build_index(tensors, parent, tree, metadata) == want


def _one(**changes) -> list[dict]:
    rec = {"name": "w", "dtype": 1, "layout": 0, "transform": TRANSFORM_NONE, "flags": 0,
           "ndim": 2, "shape": [3, 4], "raw_nbytes": 48, "content_hash": bytes(16),
           "parent_hash": None, "planes": [{"kind": 0, "index": 0, "codec": 0, "params": b"",
                                             "offset": 64, "stored_len": 48,
                                             "decoded_len": 48, "checksum": 5}]}
    plane = changes.pop("plane", {})
    rec.update(changes)
    rec["planes"] = [{**rec["planes"][0], **plane}]
    return [rec]


@pytest.mark.parametrize("tensors", [
    _one(ndim=3), _one(content_hash=bytes(15)), _one(content_hash=bytes(17)),
    _one(transform=TRANSFORM_XOR), _one(transform=TRANSFORM_XOR, parent_hash=bytes(8)),
    _one(dtype=256), _one(shape=[-1, 4]), _one(name="x" * 70_000), _one(name="\ud800"),
    _one(plane={"params": b"p" * 70_000}), _one(plane={"checksum": 2**64}),
    _one(plane={"codec": -1}), [*_one(), {}],
])
def test_a_field_the_schema_refuses_gives_up(tensors) -> None:
    assert _schema(tensors, NO_PARENT, b"", b"") is None
    assert build_index(tensors, NO_PARENT, b"", b"") is None


def test_a_record_without_its_parent_hash_field_gives_up() -> None:
    rec = _one()
    del rec[0]["parent_hash"]
    assert _schema(rec, NO_PARENT, b"", b"") is None
    assert build_index(rec, NO_PARENT, b"", b"") is None


def test_the_writer_refuses_what_the_schema_refuses(monkeypatch) -> None:
    # where the fast builder gives up, the interpreted schema raises (the compiled builder
    # would write a 15-byte hash into a malformed index)
    import io

    import numpy as np

    import s4format
    from s4format import writer

    w = s4format.Writer(io.BytesIO())
    w.set_tree({"x": w.add("x", np.arange(4, dtype=np.int64))})
    w._records[0]["content_hash"] = bytes(15)
    with pytest.raises(ConstructError):
        w.close()
    assert writer.build_index(w._records, NO_PARENT, b"", b"") is None


def test_a_parent_id_not_of_16_bytes_gives_up() -> None:
    for pid in (bytes(15), bytes(17), None):
        assert _schema(_one(), pid, b"", b"") is None
        assert build_index(_one(), pid, b"", b"") is None
