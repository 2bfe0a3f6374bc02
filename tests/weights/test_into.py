"""``load(..., into=...)`` and ``load_checkpoint(..., into=...)`` on the CPU path: the caller's
tensors are filled in place (same objects, same memory, bit-exact), matched by key path; views
and shared storages are copied in; mismatches are refused by key path before anything is
written."""

from __future__ import annotations

import io

import pytest
import torch

import s4weights
from s4weights import chain
from s4weights.torchtree import IntoMismatchError
from tests.weights.common import save_on_latest, tensor_bytes


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    s4weights.save(obj, buf)
    return buf.getvalue()


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64),
                               torch.nn.Linear(64, 8))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _check_filled(got, dests: dict, want: dict) -> None:
    for k, d in dests.items():
        ptr = d.data_ptr()
        assert got[k] is d, k
        assert got[k].data_ptr() == ptr, k
        assert tensor_bytes(got[k]) == tensor_bytes(want[k]), k


def test_into_model_state_dict_fills_the_same_tensors() -> None:
    src = _net(0).state_dict()
    blob = _blob(src)
    dst = _net(1).state_dict()
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    got = s4weights.load(blob, into=dst)
    assert list(got) == list(src)
    for k in src:
        assert got[k] is dst[k] and got[k].data_ptr() == ptrs[k]
        assert tensor_bytes(got[k]) == tensor_bytes(src[k]), k


def test_into_model_and_optimizer_nested() -> None:
    model, opt = _trained(0)
    blob = _blob({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3})
    model2, opt2 = _trained(1)
    msd, osd = model2.state_dict(), opt2.state_dict()
    exp_avg = osd["state"][0]["exp_avg"]
    ptr = exp_avg.data_ptr()
    got = s4weights.load(blob, into={"model": msd, "optimizer": osd})
    assert got["epoch"] == 3
    _check_filled(got["model"], msd, model.state_dict())
    assert got["optimizer"]["state"][0]["exp_avg"] is exp_avg and exp_avg.data_ptr() == ptr
    for i, st in opt.state_dict()["state"].items():
        for name, t in st.items():
            assert got["optimizer"]["state"][i][name] is osd["state"][i][name]
            assert tensor_bytes(osd["state"][i][name]) == tensor_bytes(t), (i, name)
    # the loaded state is what the trained optimizer holds: it resumes identically
    opt2.load_state_dict(got["optimizer"])
    model2.load_state_dict(got["model"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_into_parameters_views_and_shared_storage() -> None:
    base = torch.arange(20, dtype=torch.float32)
    src = {"base": base, "part": base[3:9], "t": torch.randn(4, 5).t(),
           "w": torch.nn.Parameter(torch.randn(3, 3))}
    blob = _blob(src)
    dst = {"base": torch.zeros(20), "part": torch.zeros(6), "t": torch.zeros(5, 4),
           "w": torch.nn.Parameter(torch.zeros(3, 3))}
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    got = s4weights.load(blob, into=dst)
    for k in src:
        assert got[k] is dst[k] and got[k].data_ptr() == ptrs[k], k
        assert tensor_bytes(got[k]) == tensor_bytes(src[k]), k
    assert isinstance(got["w"], torch.nn.Parameter) and got["w"].requires_grad


def test_into_non_contiguous_destination() -> None:
    src = {"x": torch.randn(6, 7)}
    holder = torch.zeros(7, 6)
    dest = holder.t()
    got = s4weights.load(_blob(src), into={"x": dest})
    assert got["x"] is dest
    assert torch.equal(holder.t(), src["x"])


def test_into_partial_loads_the_rest_normally() -> None:
    src = {"a": torch.randn(10), "b": torch.randn(10), "n": 5}
    dest = torch.zeros(10)
    got = s4weights.load(_blob(src), into={"a": dest})
    assert got["a"] is dest and torch.equal(dest, src["a"])
    assert torch.equal(got["b"], src["b"]) and got["n"] == 5


@pytest.mark.parametrize("bad, text", [
    ({"w": torch.zeros(4, 4, dtype=torch.float64)}, "w is float64, the file stores float32"),
    ({"w": torch.zeros(4, 5)}, "w has shape (4, 5), the file stores (4, 4)"),
    ({"w": torch.zeros(4, 4, device="meta")}, "at w"),
    ({"missing": torch.zeros(4)}, "at missing, where the file stores no tensor"),
    ({"nested": {"v": torch.zeros(3, dtype=torch.int64)}}, "nested.v is int64"),
])
def test_into_mismatch_is_refused_by_key_path_before_writing(bad, text) -> None:
    src = {"a": torch.randn(8), "w": torch.randn(4, 4), "nested": {"v": torch.randn(3)}}
    first = torch.zeros(8)
    with pytest.raises(IntoMismatchError) as err:
        s4weights.load(_blob(src), into={"a": first, **bad})
    assert text in str(err.value)
    assert isinstance(err.value, s4weights.S4Error) and isinstance(err.value, ValueError)
    assert not first.any()  # checked before anything was decoded


def test_into_numpy_path_is_refused() -> None:
    import numpy as np

    with pytest.raises(IntoMismatchError, match="arr, where the file stores a numpy array"):
        s4weights.load(_blob({"arr": np.zeros(3)}), into={"arr": torch.zeros(3)})


def test_load_checkpoint_into_resolves_a_delta_chain(tmp_path) -> None:
    chain._PARENT_CACHE.clear()
    model, opt = _trained(0)
    for step in range(3):
        save_on_latest({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                  tmp_path, step)
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    chain._PARENT_CACHE.clear()
    infos = s4weights.list_checkpoints(tmp_path)
    assert infos[-1].parent_step == 1  # a delta chain
    want = s4weights.load_checkpoint(tmp_path, 2)
    model2, opt2 = _trained(1)
    msd, osd = model2.state_dict(), opt2.state_dict()
    got = s4weights.load_checkpoint(tmp_path, 2, into={"model": msd, "optimizer": osd})
    _check_filled(got["model"], msd, want["model"])
    for i, st in want["optimizer"]["state"].items():
        for name, t in st.items():
            assert got["optimizer"]["state"][i][name] is osd["state"][i][name]
            assert tensor_bytes(osd["state"][i][name]) == tensor_bytes(t)
