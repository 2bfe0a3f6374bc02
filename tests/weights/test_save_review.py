"""save -> load for objects a review found mishandled: lazily conjugated and negated views,
storage shared through OrderedDict attributes, two storages at one address, empty views with
an offset; and objects that must be refused with UnsupportedObjectError naming them (tensor
subclasses, meta tensors, cyclic or too deep trees, attribute names the reader refuses, keys
that are not valid Unicode)."""

from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np
import pytest
import torch

import s4format
import s4weights


def _rt(obj):
    buf = io.BytesIO()
    s4weights.save(obj, buf)
    return s4weights.load(buf.getvalue())


def test_conjugated_and_negated_views_keep_their_values() -> None:
    x = torch.tensor([1 + 2j, 3 - 4j])
    got = _rt({"x": x, "c": x.conj(), "n": x.clone().conj().imag, "p": x.clone().conj()})
    assert got["x"].tolist() == x.tolist()
    assert got["c"].tolist() == [1 - 2j, 3 + 4j]
    assert got["n"].tolist() == [-2.0, 4.0]
    assert got["p"].tolist() == [1 - 2j, 3 + 4j]


def test_storage_shared_through_an_ordered_dict_attribute_stays_shared() -> None:
    t = torch.arange(4.0)
    od = OrderedDict(w=t)
    od.extra = t
    got = _rt(od)
    got["w"][0] = 9
    assert got.extra[0] == 9


def test_two_storages_at_one_address_both_load() -> None:
    a = np.arange(10, dtype=np.float32)
    got = _rt({"s": torch.from_numpy(a[:2]), "b": torch.from_numpy(a)})
    assert got["s"].tolist() == [0.0, 1.0] and got["b"].tolist() == list(range(10))


def test_an_empty_view_with_an_offset_loads() -> None:
    e = torch.empty(0).as_strided((0,), (1,), 5)
    assert _rt({"e": e})["e"].shape == (0,)


class _Sub(torch.Tensor):
    pass


def _cycle() -> list:
    c: list = []
    c.append(c)
    return c


def _deep(n: int) -> list:
    x: list = []
    for _ in range(n):
        x = [x]
    return x


def _od_attr(name) -> OrderedDict:
    od = OrderedDict(w=torch.zeros(1))
    vars(od)[name] = 1
    return od


@pytest.mark.parametrize("obj, match", [
    ({"s": torch.ones(2).as_subclass(_Sub)}, "subclass"),
    ({"m": torch.empty(3, device="meta")}, "meta device"),
    ({"c": _cycle()}, "contains itself: list at c.0 is the one at c"),
    ({"d": _deep(600)}, "levels deep"),
    (_od_attr(5), "not a plain attribute name"),
    (_od_attr("__x"), "not a plain attribute name"),
    ({"\udcff": torch.zeros(1)}, "lone surrogate"),
])
def test_objects_the_format_cannot_hold_are_refused_by_name(obj, match) -> None:
    with pytest.raises(s4format.UnsupportedObjectError, match=match):
        s4weights.save(obj, io.BytesIO())


def test_more_tensors_than_a_reader_takes_are_refused_before_writing(monkeypatch) -> None:
    from s4weights import api

    monkeypatch.setattr(api, "MAX_TENSORS", 10)
    buf = io.BytesIO()
    with pytest.raises(s4format.LimitError, match="at most 10"):
        s4weights.save({str(i): torch.zeros(1) for i in range(11)}, buf)
    assert buf.getvalue() == b""
