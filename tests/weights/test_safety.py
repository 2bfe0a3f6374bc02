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
