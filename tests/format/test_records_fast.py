"""A tensor record that passes every rule is checked in fewer steps when a file is opened
(``records._plain_info``); whatever it accepts, the rules spelled out one by one
(``records._checked_info``) accept too, as the same TensorInfo. On every record of the
conformance vectors and on records with one field changed."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format import objtree, records
from s4format.errors import S4Error
from s4format.indexread import read_index
from s4format.reader import _parse_index
from s4format.writer import Writer
from tests.format.common import index_of

SUITES = Path(__file__).parents[2] / "conformance"
FIELDS = ("flags", "dtype", "ndim", "transform", "layout", "raw_nbytes")
PLANE_FIELDS = ("kind", "index", "codec", "offset", "stored_len", "decoded_len")


def _both(rec, data_end: int, alignment: int):
    codec_of = functools.cache(records.decodable_codec)
    fast = records._plain_info(rec, data_end, alignment, codec_of)
    try:
        checked = records._checked_info(rec, "where", data_end, alignment, codec_of)
    except S4Error:
        checked = None
    return fast, checked


def _vectors():
    for path in sorted(SUITES.glob("v1*/*.s4w")):
        data = path.read_bytes()
        raw = index_of(data)
        idx = read_index(raw) if raw is not None else None
        if idx is not None:
            yield data, idx


def test_every_conformance_record_is_checked_alike() -> None:
    fast_ones = 0
    for data, idx in _vectors():
        for rec in idx.tensors:
            fast, checked = _both(rec, len(data), 1)
            if fast is not None:
                assert fast == checked
                fast_ones += 1
    assert fast_ones >= 300, fast_ones


def _masked_blob() -> bytes:
    """A delta file whose float tensors are stored masked (a few words changed)."""
    rng = np.random.default_rng(2)
    old = {"w": rng.normal(0, .02, 5000).astype(np.float32), "h": np.ones(3000, np.float16)}
    base = s4format.dumps(old)
    buf = io.BytesIO()
    with Writer(buf, parent_id=s4format.Reader(base).checkpoint_id) as w:
        for name, x in old.items():
            y = x.copy()
            y[rng.integers(0, y.size, 40)] += 1
            w.add(name, y, parent=x)
        w.set_tree({"w": objtree.TensorRef(0), "h": objtree.TensorRef(1)})
    return buf.getvalue()


_BLOBS = [s4format.dumps({"w": np.random.default_rng(1).normal(0, .02, 5000).astype(np.float32),
                          "b": np.arange(7, dtype=np.int64), "h": np.ones(300, np.float16)}),
          _masked_blob()]
_RECS = [(rec, s4format.Reader(b, verify=False).data_end)
         for b in _BLOBS for rec in read_index(index_of(b)).tensors]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(_RECS) - 1), field=st.sampled_from(FIELDS + PLANE_FIELDS),
       plane=st.integers(0, 3), value=st.one_of(st.integers(-2, 300), st.integers(0, 2**64)),
       shape=st.one_of(st.none(), st.lists(st.integers(0, 6000), max_size=3)),
       end=st.integers(-4096, 64), alignment=st.sampled_from([1, 64, 128]))
def test_a_changed_record_is_accepted_only_as_the_rules_accept_it(which, field, plane, value,
                                                                   shape, end, alignment) -> None:
    rec, data_end = _RECS[which]
    rec = dict(rec)
    rec["planes"] = [dict(p) for p in rec["planes"]]
    if field in FIELDS:
        rec[field] = value
    elif rec["planes"]:
        rec["planes"][plane % len(rec["planes"])][field] = value
    if shape is not None:
        rec["shape"], rec["ndim"] = shape, len(shape)
    fast, checked = _both(rec, data_end + end, alignment)
    assert fast is None or fast == checked


def test_a_file_opens_to_the_same_tensors_whether_its_records_are_checked_as_read() -> None:
    # the reader checks an index's records as they are read (plain_info from their fields);
    # where one is not plain it reads the index again as dicts: the same tensors either way
    checked_as_read = 0
    for path in sorted(SUITES.glob("v1*/*.s4w")):
        data = path.read_bytes()
        try:
            r = s4format.Reader(data, verify=False)
        except S4Error:
            continue
        codec_of = functools.cache(records.decodable_codec)
        idx = _parse_index(index_of(data), path.name)  # (construct's, where it has extensions)
        one_by_one = [records.tensor_info(rec, "where", r.data_end, r.alignment, codec_of)
                      for rec in idx.tensors]
        assert r.tensors == one_by_one, path.name
        checked_as_read += all(records._plain_info(rec, r.data_end, r.alignment, codec_of)
                               is not None for rec in idx.tensors)
    assert checked_as_read >= 20, checked_as_read
