"""Loading never runs code from the file: pickle payloads come back as inert bytes or are
refused, and s4weights never calls torch.load or any unpickler."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

import s4format
import s4weights
from conformance import craft
from s4format import objtree
from tests.weights.common import assert_same


class _Evil:
    """Unpickling this creates the marker file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _payload(marker: Path) -> bytes:
    data = pickle.dumps(_Evil(marker))
    assert not marker.exists()
    return data


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("s4weights must never unpickle or call torch.load")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


def test_pickle_bytes_in_the_tree_come_back_as_inert_bytes(tmp_path: Path, no_unpickling
                                                           ) -> None:
    marker = tmp_path / "pwned"
    obj = {"blob": _payload(marker), "w": torch.arange(4.0)}
    s4weights.save(obj, tmp_path / "x.s4w")
    got = s4weights.load(tmp_path / "x.s4w", weights_only=False)
    assert_same(got, obj)
    assert not marker.exists()


def _rebuild_with_tree(blob: bytes, tree: bytes) -> bytes:
    parts = craft.parse(blob)
    parts.index["tree"] = tree
    return craft.build(parts)


def test_tree_replaced_by_a_raw_pickle_stream_is_refused(tmp_path: Path, no_unpickling
                                                         ) -> None:
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    s4weights.save({"w": torch.arange(4.0)}, buf)
    evil = _rebuild_with_tree(buf.getvalue(), _payload(marker))
    # craft.build recomputes every checksum: a FormatError (not a ChecksumError) shows the
    # object tree decoder itself refused the stream.
    with pytest.raises(s4format.FormatError) as info:
        s4weights.load(evil, weights_only=False)
    assert "tree" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["torch._utils._rebuild_tensor_v2", "builtins.eval",
                                  "pickle.loads", "__reduce__"])
def test_typed_values_naming_code_are_refused_or_opaque(tmp_path: Path, no_unpickling,
                                                        name: str) -> None:
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    s4weights.save({"w": torch.arange(4.0)}, buf)
    tree = objtree.encode({"x": objtree.Typed(name, _payload(marker))})
    evil = _rebuild_with_tree(buf.getvalue(), tree)
    with pytest.raises(s4weights.UnsupportedObjectError, match="is not known here"):
        s4weights.load(evil)
    got = s4weights.load(evil, strict=False)
    assert got == {"x": s4format.Typed(name, _payload(marker))}
    assert not marker.exists()


def test_a_view_reaching_past_its_storage_is_refused(no_unpickling) -> None:
    buf = io.BytesIO()
    base = torch.arange(10.0)
    s4weights.save({"v": base[2:5], "b": base}, buf)
    parts = craft.parse(buf.getvalue())
    tree = objtree.decode(parts.index["tree"], len(parts.tensors))
    view = dict(tree["v"].value)
    view["shape"] = (1000,)
    tree["v"] = objtree.Typed("s4.view", view)
    parts.index["tree"] = objtree.encode(tree)
    with pytest.raises(s4format.FormatError, match="beyond its storage"):
        s4weights.load(craft.build(parts))


def test_save_load_and_chains_work_with_unpickling_disabled(tmp_path: Path, no_unpickling
                                                            ) -> None:
    state = {"model": torch.nn.Linear(3, 3).state_dict(), "step": 1}
    s4weights.save(state, tmp_path / "a.s4w")
    assert_same(s4weights.load(tmp_path / "a.s4w"), state)
    s4weights.save_checkpoint(state, tmp_path / "store", 0)
    s4weights.save_checkpoint(state, tmp_path / "store", 1)
    assert_same(s4weights.load_checkpoint(tmp_path / "store", 1), state)


def _view_tree(**change) -> bytes:
    """A file whose view of a stored tensor has the fields ``change`` gives."""
    buf = io.BytesIO()
    s4weights.save({"w": torch.arange(8, dtype=torch.float32)[2:]}, buf)
    parts = craft.parse(buf.getvalue())
    tree = objtree.decode(parts.index["tree"], len(parts.tensors))
    view = dict(tree["w"].value)
    view.update(change)
    tree["w"] = objtree.Typed("s4.view", view)
    parts.index["tree"] = objtree.encode(tree)
    return craft.build(parts)


@pytest.mark.parametrize("change", [
    {"dtype": "qint8"}, {"dtype": "bits8"}, {"dtype": "uint4"}, {"dtype": "float"},
    {"dtype": "long"},
    {"shape": (0,), "stride": (1,), "offset": 2**63},
    {"shape": (0,), "stride": (1,), "offset": 2**62},
    {"shape": (2**64,), "stride": (0,)},
    {"shape": (1,), "stride": (2**63,)},
    {"requires_grad": True, "dtype": "int32", "shape": (1,), "stride": (1,)},
    {"parameter": True, "requires_grad": True, "dtype": "int64", "shape": (1,), "stride": (1,)},
])
def test_hostile_view_fields_are_format_errors(change, no_unpickling) -> None:
    # torch's own errors (internal asserts, NotImplementedError, overflow) must not reach the
    # caller for a file's values: each is refused as a FormatError
    with pytest.raises(s4format.FormatError, match=r"s4\.view"):
        s4weights.load(_view_tree(**change))


@pytest.mark.parametrize("typed", [
    objtree.Typed("torch.device", "zzz"), objtree.Typed("torch.Size", ("a",)),
    objtree.Typed("s4.attrs", (__import__("collections").OrderedDict(), {1: 2})),
    objtree.Typed("s4.attrs", (__import__("collections").OrderedDict(), {"__class__": 2})),
])
def test_hostile_typed_values_are_format_errors(typed, no_unpickling) -> None:
    buf = io.BytesIO()
    s4weights.save({"w": torch.arange(4.0)}, buf)
    evil = _rebuild_with_tree(buf.getvalue(), objtree.encode({"x": typed}))
    with pytest.raises(s4format.FormatError, match="x: "):
        s4weights.load(evil)


def test_a_cuda_saved_tensor_on_a_machine_without_cuda_says_map_location() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    blob = _view_tree(device="cuda:0")
    with pytest.raises(RuntimeError, match="map_location"):
        s4weights.load(blob)
    assert torch.equal(s4weights.load(blob, map_location="cpu")["w"], torch.arange(2.0, 8.0))


def test_a_huge_int_key_loads() -> None:
    # an int key of more than 4300 digits is a valid key (spec/objects.md); its key path
    # cannot be str()'d, which must not stop the load or the save
    key = 10**5000
    buf = io.BytesIO()
    s4weights.save({key: torch.ones(3), "w": torch.arange(4.0)}, buf)
    got = s4weights.load(buf.getvalue())
    assert torch.equal(got[key], torch.ones(3)) and torch.equal(got["w"], torch.arange(4.0))
