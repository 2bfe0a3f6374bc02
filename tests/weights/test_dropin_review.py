"""save/load against torch.save/torch.load where a review found them apart: objects met at
several places (cycles, shared containers), tensors' Python attributes, the depth a view adds,
torch.load's keywords, map_location errors, and paths that are not regular files."""

from __future__ import annotations

import io
import os
import stat
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch

import s4format
import s4weights
from s4format.objtree import Typed


def _rt(obj, **load_kw):
    buf = io.BytesIO()
    s4weights.save(obj, buf)
    return s4weights.load(buf.getvalue(), **load_kw)


def test_a_cycle_through_two_children_is_refused_at_once() -> None:
    # each child points back at the root: walked as a tree, 2^256 paths
    root: dict = {"children": []}
    root["children"] += [{"parent": root}, {"parent": root}]
    t0 = time.perf_counter()
    with pytest.raises(s4format.UnsupportedObjectError,
                       match=r"contains itself: dict at children\.0\.parent is the one at <root>"):
        s4weights.save(root, io.BytesIO())
    assert time.perf_counter() - t0 < 5


def test_containers_shared_many_times_over_are_refused_before_writing() -> None:
    x: dict = {"v": 1}
    for _ in range(40):  # 2^40 places
        x = {"l": x, "r": x}
    buf = io.BytesIO()
    with pytest.raises(s4format.UnsupportedObjectError, match="same containers at too many"):
        s4weights.save(x, buf)
    assert buf.tell() == 0


def test_a_shared_container_is_copied_and_its_tensor_stored_once() -> None:
    w = torch.randn(4096)
    shared = {"w": w, "betas": (0.9, 0.999)}
    buf = io.BytesIO()
    s4weights.save({"a": shared, "b": shared, "c": [shared] * 3}, buf)
    assert len(buf.getvalue()) < w.numel() * 4 + 4096  # the tensor's bytes once
    got = s4weights.load(buf.getvalue())
    for k in ("b", "c"):
        other = got[k] if k == "b" else got[k][2]
        assert torch.equal(other["w"], w) and other["betas"] == (0.9, 0.999)
        assert other["w"].data_ptr() == got["a"]["w"].data_ptr()


def test_tensors_and_parameters_keep_their_python_attributes() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    p.tensor_model_parallel, p.partition_dim = True, 0
    t = torch.randn(5)
    t.scale, t.extra = 0.5, torch.arange(3)
    v = t[1:]
    v.tag = "view"
    got = _rt({"p": p, "t": t, "v": v})
    assert type(got["p"]) is torch.nn.Parameter
    assert got["p"].tensor_model_parallel is True and got["p"].partition_dim == 0
    assert got["t"].scale == 0.5 and torch.equal(got["t"].extra, torch.arange(3))
    assert got["v"].tag == "view" and not hasattr(got["t"], "tag")
    assert got["v"].data_ptr() == got["t"].data_ptr() + 4  # still a view of t's storage
    assert torch.equal(got["p"], p)
    plain = _rt({"w": torch.ones(2)})["w"]
    assert vars(plain) == {}


@pytest.mark.parametrize("name", ["shape", "data", "__x"])
def test_an_attribute_that_is_not_plain_is_refused_with_its_path(name) -> None:
    t = torch.ones(2)
    vars(t)[name] = 1
    with pytest.raises(s4format.UnsupportedObjectError, match="at w has the attribute"):
        s4weights.save({"w": t}, io.BytesIO())


@pytest.mark.parametrize("inner, name", [("tensor", "data"), ("tensor", "grad"),
                                         ("odict", "keys"), ("odict", "__class__")])
def test_a_file_cannot_set_what_the_class_defines(inner, name) -> None:
    buf = io.BytesIO()
    w = s4format.Writer(buf)
    ref = w.add("w", np.arange(4, dtype=np.float32))
    obj = ref if inner == "tensor" else OrderedDict(w=ref)
    w.set_tree({"x": Typed("s4.attrs", (obj, {name: 1}))})
    w.close()
    with pytest.raises(s4format.FormatError, match=f"attribute name '{name}'"):
        s4weights.load(buf.getvalue())


def test_a_parameter_at_the_depth_limit_is_refused_before_anything_is_written() -> None:
    # a Parameter is stored as an s4.view: its geometry's tuples sit three levels below it
    deep: object = torch.nn.Parameter(torch.ones(2))
    for _ in range(254):
        deep = [deep]
    buf = io.BytesIO()
    with pytest.raises(s4format.UnsupportedObjectError, match="more than 256 levels"):
        s4weights.save(deep, buf)
    assert buf.tell() == 0
    ok: object = torch.nn.Parameter(torch.ones(2))
    for _ in range(253):
        ok = [ok]
    got = _rt(ok)
    for _ in range(253):
        got = got[0]
    assert type(got) is torch.nn.Parameter


def test_an_ordered_dict_with_metadata_at_the_depth_limit() -> None:
    def nest(obj, n):
        for _ in range(n):
            obj = [obj]
        return obj
    od = OrderedDict(w=1)
    od._metadata = {"": {"version": 1}}
    # s4.attrs at depth n, its pair at n + 1, the dict at n + 2, the attribute at n + 3 and
    # the 1 inside it at n + 5
    got = _rt(nest(od, 251))
    for _ in range(251):
        got = got[0]
    assert got._metadata == {"": {"version": 1}}
    with pytest.raises(s4format.UnsupportedObjectError, match="more than 256 levels"):
        s4weights.save(nest(od, 252), io.BytesIO())


def test_torch_load_keywords() -> None:
    import pickle
    buf = io.BytesIO()
    s4weights.save({"w": torch.ones(2)}, buf)
    data = buf.getvalue()
    for kw in ({"mmap": True}, {"encoding": "latin1"}, {"weights_only": False},
               {"pickle_module": pickle}):
        assert torch.equal(s4weights.load(data, **kw)["w"], torch.ones(2))
    assert torch.equal(s4weights.load(data, "cpu", pickle)["w"], torch.ones(2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'map_locaton'"):
        s4weights.load(data, map_locaton="cpu")


def test_map_location_errors_say_what_is_wrong() -> None:
    buf = io.BytesIO()
    s4weights.save({"w": torch.ones(2), "v": torch.ones(4)[1:]}, buf)
    with pytest.raises(TypeError, match=r"map_location must be .* not int"):
        s4weights.load(buf.getvalue(), map_location=123)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available here"):
            s4weights.load(buf.getvalue(), map_location="cuda")


def test_a_nested_tensor_is_refused_by_name() -> None:
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(s4format.UnsupportedObjectError, match="at n is a nested tensor"):
        s4weights.save({"n": nt}, io.BytesIO())


def test_a_fifo_is_written_into_not_replaced(tmp_path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    s4weights.save({"w": torch.arange(5.0)}, fifo)
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert torch.equal(s4weights.load(got[0])["w"], torch.arange(5.0))


def test_devnull_stays_a_device() -> None:
    s4weights.save({"w": torch.ones(3)}, os.devnull)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_bytes_after_a_file_are_named_in_the_error() -> None:
    buf = io.BytesIO()
    s4weights.save({"w": torch.ones(2)}, buf)
    with pytest.raises(s4format.TruncatedError, match="other bytes follow it"):
        s4weights.load(buf.getvalue() + b"trailing")


def test_a_long_list_held_twice_is_written_twice(monkeypatch) -> None:
    from s4weights import torchtree
    monkeypatch.setattr(torchtree, "MAX_REPEATED", 1000)
    order = list(range(5000))  # e.g. a sampler's permutation, referenced from two places
    got = _rt({"sampler": {"order": order}, "loader": {"order": order}})
    assert got["sampler"]["order"] == order and got["loader"]["order"] == order
    x: dict = {"v": 1}
    for _ in range(20):
        x = {"l": x, "r": x}
    with pytest.raises(s4format.UnsupportedObjectError, match="same containers at too many"):
        s4weights.save(x, io.BytesIO())


class _Graph(dict):
    """A dict subclass whose converter leaves out its back reference."""


def test_a_converter_decides_what_a_container_subclass_holds() -> None:
    s4weights.register_type("test.graph", _Graph, lambda g: {"w": g["w"]},
                            lambda v: _Graph(v))
    g = _Graph(w=torch.ones(3))
    g["self"] = g
    got = _rt({"g": g})
    assert type(got["g"]) is _Graph and torch.equal(got["g"]["w"], torch.ones(3))


class _Scaled(torch.Tensor):
    pass


def test_a_tensor_subclass_with_a_converter_is_stored_by_it() -> None:
    s4weights.register_type("test.scaled", _Scaled, lambda t: {"data": t.as_subclass(
        torch.Tensor)}, lambda v: v["data"].as_subclass(_Scaled))
    got = _rt({"s": torch.arange(4.0).as_subclass(_Scaled)})
    assert type(got["s"]) is _Scaled and torch.equal(got["s"].as_subclass(torch.Tensor),
                                                     torch.arange(4.0))


def test_a_0d_view_at_the_depth_limit() -> None:
    base = torch.arange(3.0)
    deep: object = base[1]  # a 0-d view: its shape and stride tuples are empty
    for _ in range(253):
        deep = [deep]
    got = _rt([base, deep])  # the view at depth 254, its dict's values at 256
    view = got[1]
    for _ in range(253):
        view = view[0]
    assert view.item() == 1.0 and view.dim() == 0
    assert view.data_ptr() == got[0].data_ptr() + 4


@pytest.mark.parametrize("value, room", [
    (torch.Size([2, 3]), 2), (torch.Size([]), 1), (torch.float16, 1), (torch.device("cpu"), 1),
    (np.arange(3), 1), (np.float32(1.5), 1)])
def test_typed_values_at_the_depth_limit_are_refused_before_writing(value, room) -> None:
    def nest(n):
        obj = value
        for _ in range(n):
            obj = [obj]
        return obj
    ok = _rt(nest(256 - room))
    for _ in range(256 - room):
        ok = ok[0]
    assert type(ok) is type(value)
    buf = io.BytesIO()
    with pytest.raises(s4format.UnsupportedObjectError, match="more than 256 levels"):
        s4weights.save(nest(257 - room), buf)
    assert buf.tell() == 0
