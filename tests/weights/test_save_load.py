"""save/load as drop-ins for torch.save/torch.load: exact training resume, paths and file
objects, map_location in all its forms, atomic replacement of a path."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

import s4format
import s4weights
from tests.weights.common import Trainer, assert_same, roundtrip, seed_all, tensor_bytes


def _run(trainer: Trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.step()


@pytest.mark.parametrize("k", [1, 5])
def test_resume_from_step_k_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path,
                                                                      k: int) -> None:
    seed_all(11)
    straight = Trainer(seed=3)
    _run(straight, k + 4)
    want = straight.fingerprint()

    seed_all(11)
    first = Trainer(seed=3)
    _run(first, k)
    s4weights.save(first.state(), tmp_path / "ckpt.s4w")
    # Keep drawing from every generator, as the interrupted process would have.
    _run(first, 2)
    del first

    seed_all(999)  # a fresh process: different RNG states, fresh model and optimizer
    resumed = Trainer(seed=42)
    resumed.restore(s4weights.load(tmp_path / "ckpt.s4w"))
    assert resumed.step_no == k
    _run(resumed, 4)
    got = resumed.fingerprint()
    assert list(got) == list(want)
    diff = [name for name in want if got[name] != want[name]]
    assert diff == []
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    assert resumed.sched.state_dict() == straight.sched.state_dict()


def test_training_state_round_trips_exactly() -> None:
    seed_all(5)
    t = Trainer()
    _run(t, 3)
    state = t.state()
    assert_same(roundtrip(state), state)


def _state() -> dict:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": 7,
            "view": torch.arange(10.0)[2:8:2]}


@pytest.mark.parametrize("kind", ["str", "pathlib"])
def test_save_and_load_by_path(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "sub" / "x.s4w"
    path.parent.mkdir()
    target = str(path) if kind == "str" else path
    result = s4weights.save(_state(), target)
    assert path.stat().st_size == result.file_size
    assert result.tensor_count == 2
    assert_same(s4weights.load(target), _state())
    assert os.listdir(path.parent) == ["x.s4w"]


def test_save_to_bytesio_and_load_from_bytesio_and_bytes() -> None:
    buf = io.BytesIO()
    result = s4weights.save(_state(), buf)
    data = buf.getvalue()
    assert len(data) == result.file_size
    buf.seek(0)
    assert_same(s4weights.load(buf), _state())
    assert_same(s4weights.load(data), _state())
    # The BytesIO is still usable afterwards (no lingering buffer export).
    buf.seek(0, io.SEEK_END)
    buf.write(b"more")
    assert buf.getvalue() == data + b"more"


def test_save_and_load_through_real_open_files(tmp_path: Path) -> None:
    path = tmp_path / "f.s4w"
    with open(path, "wb") as f:
        f.write(b"PREFIX")
        s4weights.save(_state(), f)
    with open(path, "rb") as f:
        assert f.read(6) == b"PREFIX"
        assert_same(s4weights.load(f), _state())
    with open(path, "rb") as f:
        f.seek(6)
        assert s4weights.load(f)["n"] == 7


def test_path_save_and_file_object_save_give_the_same_bytes(tmp_path: Path) -> None:
    s4weights.save(_state(), tmp_path / "a.s4w")
    buf = io.BytesIO()
    s4weights.save(_state(), buf)
    assert (tmp_path / "a.s4w").read_bytes() == buf.getvalue()


def test_metadata_is_stored_with_the_producer(tmp_path: Path) -> None:
    s4weights.save(_state(), tmp_path / "m.s4w", metadata={"run": "r1"})
    with s4format.Reader(tmp_path / "m.s4w") as r:
        assert r.metadata["run"] == "r1"
        assert r.metadata["producer"].startswith("s4weights ")
        assert r.metadata["torch"] == str(torch.__version__)


@pytest.mark.parametrize("policy", ["auto", "seed", "auto-1.0"])
def test_every_policy_round_trips(policy: str) -> None:
    state = {"w": torch.randn(64, 64), "h": torch.randn(4096).to(torch.bfloat16)}
    buf = io.BytesIO()
    s4weights.save(state, buf, policy=policy)
    assert_same(s4weights.load(buf.getvalue()), state)
    r = s4format.Reader(buf.getvalue())
    packed = any(p.codec == s4format.codecs.BITPACK_W for t in r.tensors for p in t.planes)
    # auto bit-packs the 7-bit mantissa planes (format 1.1) and declares 1.5 (masked deltas,
    # codec 10); auto-1.0 writes a 1.0 file
    assert (r.version, packed) == {"auto": ((1, 5), True), "seed": ((1, 1), False),
                                   "auto-1.0": ((1, 0), False)}[policy]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'best'"):
        s4weights.save({"w": torch.ones(3)}, io.BytesIO(), policy="best")


# -- map_location --------------------------------------------------------------------------

def _with_views() -> dict:
    base = torch.arange(24, dtype=torch.float32)
    return {"plain": torch.arange(5, dtype=torch.int64), "t": base.view(4, 6).t(),
            "s": base[3:9], "p": torch.nn.Parameter(torch.ones(2, 2))}


@pytest.mark.parametrize("loc", ["cpu", torch.device("cpu"), {"cpu": "cpu"},
                                 lambda storage, location: storage])
def test_map_location_to_cpu_keeps_everything(loc) -> None:
    state = _with_views()
    assert_same(roundtrip(state, map_location=loc), state)


@pytest.mark.parametrize("loc", ["meta", torch.device("meta"), {"cpu": "meta"},
                                 lambda storage, location: "meta"],
                         ids=["str", "device", "dict", "callable"])
def test_map_location_moves_plain_tensors_and_views(loc) -> None:
    got = roundtrip(_with_views(), map_location=loc)
    for name in ("plain", "t", "s", "p"):
        assert got[name].device.type == "meta", name
    assert got["t"].shape == (6, 4) and got["t"].stride() == (1, 6)
    assert got["s"].storage_offset() == 3
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad


def test_map_location_callable_gets_the_saved_location() -> None:
    seen = []

    def loc(storage: torch.Tensor, location: str) -> None:
        seen.append(location)

    got = roundtrip(_with_views(), map_location=loc)
    assert seen and set(seen) == {"cpu"}
    assert tensor_bytes(got["t"]) == tensor_bytes(_with_views()["t"])


@pytest.mark.parametrize("loc", [None, "meta", {"cpu": "meta"}, "callable"])
def test_each_device_is_resolved_once_per_load(monkeypatch, loc) -> None:
    """A tree of thousands of views on one device asks torch whether the device is usable
    once per load; a callable map_location is still asked for every view and bare tensor,
    as torch.load asks it for every storage."""
    from s4weights import torchtree

    state = {f"p{i}": torch.nn.Parameter(torch.full((3,), float(i))) for i in range(20)}
    state["plain"] = torch.arange(4)
    asked, seen = [], []
    real = torchtree._usable
    monkeypatch.setattr(torchtree, "_usable", lambda d, p=None: asked.append(d) or real(d, p))
    if loc == "callable":
        def loc(storage: torch.UntypedStorage, location: str) -> None:
            seen.append(location)
    got = roundtrip(state, map_location=loc)
    want = "meta" if loc in ("meta", {"cpu": "meta"}) else "cpu"
    assert {v.device.type for v in got.values()} == {want}
    if seen:
        assert len(asked) == len(seen) == 21
    else:
        assert len(asked) == 1
    if want == "cpu":
        assert_same(got, state)


def test_map_location_dict_leaves_unlisted_locations_alone() -> None:
    got = roundtrip(_with_views(), map_location={"cuda:0": "meta"})
    assert {v.device.type for v in got.values()} == {"cpu"}


def test_weights_only_false_still_loads_safely() -> None:
    buf = io.BytesIO()
    s4weights.save(_state(), buf)
    assert_same(s4weights.load(buf.getvalue(), weights_only=False), _state())
    assert_same(s4weights.load(buf.getvalue(), weights_only=True, mmap=None), _state())


# -- atomic replacement of a path ----------------------------------------------------------

def test_failed_save_to_a_path_leaves_the_previous_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "keep.s4w"
    s4weights.save(_state(), path)
    before = path.read_bytes()
    # A frozenset key is refused only when the tree is encoded, after every tensor was
    # written: the half-written temporary file must vanish and the old file stay.
    bad = {"w": torch.randn(1000), "d": {frozenset({1}): 1}}
    with pytest.raises(s4weights.UnsupportedObjectError, match="dict key of type frozenset"):
        s4weights.save(bad, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.s4w"]


def test_save_over_an_existing_path_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "x.s4w"
    s4weights.save({"v": 1}, path)
    s4weights.save({"v": 2}, path)
    assert s4weights.load(path) == {"v": 2}
    assert os.listdir(tmp_path) == ["x.s4w"]
