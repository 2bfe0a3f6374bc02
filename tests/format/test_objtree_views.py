"""The object tree decoder reads a view (``s4.view``) in the form writers give it in one go
(``objtree._Decoder._view``); that must be exactly what reading it node by node gives: the
same values and reference counts for every view, and for damaged bytes the same value or the
same error."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s4format import objtree
from s4format.errors import FormatError, UnsupportedObjectError
from s4format.objtree import VIEW, TensorRef, Typed

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
_I64 = st.integers(-(1 << 63), (1 << 63) - 1)


def _decode(raw: bytes, n: int, fast: bool) -> tuple:
    """(value or the error's type and message, the reference counts)."""
    with pytest.MonkeyPatch.context() as m:
        if not fast:
            m.setattr(objtree._Decoder, "_view", lambda self: None)
        uses = [0] * n
        try:
            return objtree.decode(raw, n, uses=uses), uses
        except FormatError as exc:
            return (type(exc), str(exc)), uses


def _view(draw, n: int) -> Typed:
    dims = draw(st.integers(0, 70))  # (over 64 dimensions: read node by node)
    value = {"storage": TensorRef(draw(st.integers(0, n - 1))),
             "dtype": draw(st.sampled_from(["bfloat16", "float32", "int64", "ünïcode", ""])),
             "offset": draw(_I64),
             "shape": tuple(draw(st.lists(_I64, min_size=dims, max_size=dims))),
             "stride": tuple(draw(st.lists(_I64, min_size=dims, max_size=dims))),
             "device": draw(st.sampled_from(["cuda:0", "cpu", "cuda:7", "µ"])),
             "requires_grad": draw(st.booleans()), "parameter": draw(st.booleans())}
    return Typed(VIEW, value)


@st.composite
def _tree(draw):
    n = draw(st.integers(1, 6))
    views = [_view(draw, n) for _ in range(draw(st.integers(1, 4)))]
    return n, {"state": views, "step": draw(st.integers(0, 9)), "v": views[0]}


@settings(max_examples=300, **SETTINGS)
@given(tree=_tree())
def test_a_view_reads_as_node_by_node(tree) -> None:
    n, obj = tree
    raw = objtree.encode(obj, n)
    fast = _decode(raw, n, True)
    assert fast == _decode(raw, n, False)
    assert fast[0] == obj


@settings(max_examples=600, **SETTINGS)
@given(tree=_tree(), edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                    min_size=1, max_size=3), cut=st.integers(0, 40))
def test_damaged_views_read_as_node_by_node(tree, edits, cut) -> None:
    n, obj = tree
    raw = bytearray(objtree.encode(obj, n))
    for at, byte in edits:
        raw[at % len(raw)] = byte
    raw = bytes(raw[:len(raw) - cut % 3 * (cut // 3)])
    assert _decode(raw, n, True) == _decode(raw, n, False)


@pytest.mark.parametrize("change", [
    lambda v: {**v, "extra": 1}, lambda v: dict(reversed(list(v.items()))),
    lambda v: {**v, "shape": list(v["shape"])}, lambda v: {**v, "offset": 1 << 70},
    lambda v: {**v, "requires_grad": 1}, lambda v: {**v, "device": None},
])
def test_other_forms_of_a_view_are_read_node_by_node(change, monkeypatch) -> None:
    view = {"storage": TensorRef(0), "dtype": "float32", "offset": 0, "shape": (2, 3),
            "stride": (3, 1), "device": "cpu", "requires_grad": False, "parameter": True}
    raw = objtree.encode([Typed(VIEW, change(view))], 1)
    calls = []
    real = objtree._Decoder._view
    monkeypatch.setattr(objtree._Decoder, "_view",
                        lambda self: calls.append(got := real(self)) or got)
    assert objtree.decode(raw, 1) == [Typed(VIEW, change(view))]
    assert calls == [None]


def test_a_view_too_deep_for_the_fast_read_is_read_node_by_node() -> None:
    view = Typed(VIEW, {"storage": TensorRef(0), "dtype": "float32", "offset": 0,
                        "shape": (2,), "stride": (1,), "device": "cpu",
                        "requires_grad": False, "parameter": False})
    for depth in (objtree.MAX_DEPTH - 4, objtree.MAX_DEPTH - 3, objtree.MAX_DEPTH - 2):
        obj = view
        for _ in range(depth):
            obj = [obj]
        raw = objtree.encode(obj, 1) if depth + 3 <= objtree.MAX_DEPTH else None
        if raw is None:  # (the encoder refuses what the decoder would)
            continue
        assert _decode(raw, 1, True) == _decode(raw, 1, False)


def test_a_view_as_writers_give_it_is_read_in_one_go(monkeypatch) -> None:
    view = {"storage": TensorRef(1), "dtype": "bfloat16", "offset": 5, "shape": (2, 3),
            "stride": (3, 1), "device": "cuda:0", "requires_grad": True, "parameter": False}
    raw = objtree.encode({"w": Typed(VIEW, view), "b": [Typed(VIEW, view)]}, 2)
    got = []
    real = objtree._Decoder._view
    monkeypatch.setattr(objtree._Decoder, "_view",
                        lambda self: got.append(v := real(self)) or v)
    uses = [0, 0]
    assert objtree.decode(raw, 2, uses=uses) == {"w": Typed(VIEW, view), "b": [Typed(VIEW, view)]}
    assert got == [view, view] and uses == [0, 2]


class _Key(str):
    pass


_ODD = st.one_of(st.integers(-(1 << 70), 1 << 70), st.booleans(), st.none(), st.text(max_size=3),
                 st.just(TensorRef(9)), st.just(TensorRef(-1)), st.floats(allow_nan=False),
                 st.just("\ud800"), st.just((1, True)), st.just(list(range(3))),
                 st.just(tuple(range(65))), st.just(_Key("storage")))


def _encoded(obj, n: int, fast: bool):
    with pytest.MonkeyPatch.context() as m:
        if not fast:
            m.setattr(objtree, "_view_into", lambda *a: False)
        try:
            return objtree.encode(obj, n)
        except UnsupportedObjectError as exc:
            return str(exc)


@settings(max_examples=500, **SETTINGS)
@given(tree=_tree(), key=st.sampled_from(objtree.VIEW_KEYS), odd=_ODD, rename=st.booleans())
def test_a_view_encodes_as_node_by_node(tree, key, odd, rename) -> None:
    # the writer's form in one go, anything else node by node: the same bytes or error
    n, obj = tree
    assert _encoded(obj, n, True) == _encoded(obj, n, False)
    value = dict(obj["v"].value)
    if rename:
        value = {(_Key(k) if k == key else k): v for k, v in value.items()}
    else:
        value[key] = odd
    odd_tree = [Typed(VIEW, value), obj]
    assert _encoded(odd_tree, n, True) == _encoded(odd_tree, n, False)


def test_a_view_as_writers_give_it_is_encoded_in_one_go() -> None:
    view = {"storage": TensorRef(1), "dtype": "bfloat16", "offset": 5, "shape": (2, 3),
            "stride": (3, 1), "device": "cuda:0", "requires_grad": True, "parameter": False}
    out = bytearray()
    assert objtree._view_into(view, out, 2)
    assert objtree.encode(Typed(VIEW, view), 2).endswith(bytes(out))
    assert not objtree._view_into(view, bytearray(), 1)  # (its reference out of range)


class _RaisingEq:
    def __hash__(self) -> int:
        return 1

    def __eq__(self, other) -> bool:
        raise RuntimeError("compared")


def test_a_view_with_a_key_that_cannot_be_compared_is_refused_with_its_path() -> None:
    view = {"storage": TensorRef(0), "dtype": "f", "offset": 0, "shape": (2,), "stride": (1,),
            "device": "cpu", "requires_grad": False, "parameter": True}
    odd = {(_RaisingEq() if k == "dtype" else k): x for k, x in view.items()}
    with pytest.raises(UnsupportedObjectError, match="dict key of type _RaisingEq at <root>"):
        objtree.encode(Typed(VIEW, odd), 1)
