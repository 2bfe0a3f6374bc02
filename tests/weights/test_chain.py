"""Checkpoint chains: bases and XOR deltas, retention, keyframes, and every way a parent can be
missing or wrong."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import s4format
import s4weights
from s4weights import chain
from s4weights.store import open_store
from tests.weights.common import assert_same, clone_tree, save_on_latest, seed_all


@pytest.fixture(autouse=True)
def _fresh_parent_cache():
    chain._PARENT_CACHE.clear()
    yield
    chain._PARENT_CACHE.clear()


def _data_file(root: Path, step: int) -> Path:
    """The data file of checkpoint ``step`` under ``root``, as its manifest names it."""
    return root / chain.by_step(chain.list_checkpoints(root))[step].file


class _Run:
    """A small model that keeps training; ``state()`` is what a training loop checkpoints."""

    def __init__(self, seed: int = 0) -> None:
        seed_all(seed)
        # Weights of 64x64 are split into planes, where XOR deltas of small updates pay.
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64),
                                         torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.model(torch.randn(16, 64)).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "step": step, "rng": torch.get_rng_state()}


def _check_chain_invariants(root: Path, interval: int) -> dict[int, s4weights.CheckpointInfo]:
    infos = {i.step: i for i in s4weights.list_checkpoints(root)}
    assert list(infos) == sorted(infos)
    for info in infos.values():
        assert info.depth < interval
        assert re.fullmatch(rf"data/{info.step:012d}-[0-9a-f]{{8}}\.s4w", info.file), info.file
        assert (root / info.file).is_file()
        if info.is_base:
            assert (info.parent_id, info.depth, info.base_step) == (None, 0, info.step)
        else:
            parent = infos[info.parent_step]  # a kept delta's parent is never deleted
            assert parent.checkpoint_id == info.parent_id
            assert info.depth == parent.depth + 1 and info.base_step == parent.base_step
    return infos


@pytest.mark.parametrize("against", ["base", "latest"])
def test_long_chain_with_random_retention_reloads_every_kept_step_exactly(tmp_path: Path,
                                                                          against: str) -> None:
    rnd = random.Random(1234)
    run = _Run()
    interval = 4
    saved: dict[int, Any] = {}
    kinds = []
    for step in range(20):
        run.train(rnd.randint(1, 2))
        if rnd.random() < 0.25:
            chain._PARENT_CACHE.clear()  # another process: the parent is re-read from the store
        state = run.state(step)
        info = s4weights.save_checkpoint(state, tmp_path, step, keyframe_interval=interval,
                                         delta_against=against)
        saved[step] = clone_tree(state)
        kinds.append("base" if info.is_base else "delta")
        assert against == "latest" or info.depth <= 1
        assert info.raw_bytes > 0 and info.file_bytes == (tmp_path / info.file).stat().st_size
        if step % 5 == 4:
            listed = sorted(saved)
            keep = rnd.sample(listed, k=rnd.randint(1, 3))
            deleted = s4weights.retain(tmp_path, keep)
            assert set(keep).isdisjoint(deleted)
            for s in deleted:
                del saved[s]
        infos = _check_chain_invariants(tmp_path, interval)
        assert set(infos) == set(saved)
    assert kinds.count("delta") >= 10  # training states do chain
    assert kinds.count("base") >= 20 // interval
    for step in saved:
        assert_same(s4weights.load_checkpoint(tmp_path, step), saved[step])
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path), saved[max(saved)])


@pytest.mark.parametrize("against", ["base", "latest"])
def test_keep_last_keeps_the_newest_and_the_bases_they_need(tmp_path: Path, against: str
                                                            ) -> None:
    run = _Run(1)
    saved = {}
    for step in range(0, 30, 3):
        run.train()
        state = run.state(step)
        s4weights.save_checkpoint(state, tmp_path, step, keyframe_interval=3, keep_last=2,
                                  delta_against=against)
        saved[step] = clone_tree(state)
        infos = _check_chain_invariants(tmp_path, 3)
        newest = sorted(saved)[-2:]
        assert set(newest) <= set(infos)
        needed = set()
        for s in newest:
            while s is not None:
                needed.add(s)
                s = infos[s].parent_step
        assert set(infos) == needed
    for step, info in _check_chain_invariants(tmp_path, 3).items():
        assert_same(s4weights.load_checkpoint(tmp_path, step), saved[step])
        assert info.step in saved


def test_keep_last_below_one_is_refused_before_saving(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        s4weights.save_checkpoint({"x": torch.ones(2)}, tmp_path, 0, keep_last=0)
    assert s4weights.list_checkpoints(tmp_path) == []


def test_keyframe_interval_bounds_the_depth(tmp_path: Path) -> None:
    run = _Run(2)
    depths = []
    for step in range(9):
        run.train()
        depths.append(save_on_latest(run.state(step), tmp_path, step, keyframe_interval=3).depth)
    assert depths == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    one = tmp_path / "one"
    assert [save_on_latest(run.state(s), one, s, keyframe_interval=1).depth
            for s in range(3)] == [0, 0, 0]


def _trained_saves(run: _Run, root: Path, steps: range, **kw: Any
                   ) -> list[s4weights.CheckpointInfo]:
    """``run`` trained a step before each of ``steps``, each saved to ``root``: their infos."""
    infos = []
    for step in steps:
        run.train()
        infos.append(s4weights.save_checkpoint(run.state(step), root, step, **kw))
    return infos


def test_keyframe_interval_bounds_the_saves_on_a_base(tmp_path: Path) -> None:
    run = _Run(2)
    infos = _trained_saves(run, tmp_path, range(9), keyframe_interval=3)
    assert [i.parent_step for i in infos] == [None, 0, 0, None, 3, 3, None, 6, 6]
    assert [i.depth for i in infos] == [0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert infos[3].base_reason == "keyframe_interval=3 reached"
    assert [i.saves_on_base for i in infos] == [1, 2, 3] * 3
    assert {i.delta_against for i in infos} == {"base"}
    # the count is the manifests' own: saves that retention dropped still count
    s4weights.retain(tmp_path, [6, 8])
    run.train()
    info = s4weights.save_checkpoint(run.state(9), tmp_path, 9, keyframe_interval=3)
    assert info.is_base and info.base_reason == "keyframe_interval=3 reached"
    run.train()
    assert s4weights.save_checkpoint(run.state(10), tmp_path, 10, keyframe_interval=3
                                     ).parent_step == 9
    with pytest.raises(ValueError, match="delta_against must be one of"):
        s4weights.save_checkpoint(run.state(11), tmp_path, 11, delta_against="previous")


def test_manifests_without_a_count_count_the_saves_listed(tmp_path: Path) -> None:
    # manifests written before the count was recorded: the saves listed on the base count
    run = _Run(2)
    _trained_saves(run, tmp_path, range(3), keyframe_interval=10)
    for path in (tmp_path / "manifests").iterdir():
        d = json.loads(path.read_bytes())
        del d["saves_on_base"], d["delta_against"]
        path.write_text(json.dumps(d))
    assert [i.saves_on_base for i in s4weights.list_checkpoints(tmp_path)] == [None] * 3
    s4weights.retain(tmp_path, [2])  # steps 0 and 2 listed on base 0
    run.train()
    assert s4weights.save_checkpoint(run.state(3), tmp_path, 3, keyframe_interval=3
                                     ).parent_step == 0
    run.train()
    info = s4weights.save_checkpoint(run.state(4), tmp_path, 4, keyframe_interval=3)
    assert info.is_base and info.saves_on_base == 1


@pytest.mark.parametrize("member, value, said", [
    ("saves_on_base", 0, "saves_on_base must be a positive integer"),
    ("saves_on_base", "2", "saves_on_base must be a positive integer"),
    ("delta_against", 1, "delta_against must be a string")])
def test_a_manifest_with_a_count_or_mode_of_another_type_is_malformed(
        tmp_path: Path, member: str, value: Any, said: str) -> None:
    _trained_saves(_Run(2), tmp_path, range(2))
    path = tmp_path / "manifests" / f"{1:012d}.json"
    d = json.loads(path.read_bytes())
    d[member] = value
    path.write_text(json.dumps(d))
    problems: list[str] = []
    assert [i.step for i in chain.list_checkpoints(tmp_path, problems=problems)] == [0]
    assert len(problems) == 1 and said in problems[0]


def test_a_delta_that_did_not_pay_min_delta_gain_is_followed_by_a_base(tmp_path: Path) -> None:
    infos = _trained_saves(_Run(9), tmp_path, range(4), min_delta_gain=0.5)
    assert infos[1].stored_bytes > 0.5 * infos[1].full_stored_bytes
    assert [i.depth for i in infos] == [0, 1, 0, 1]


def test_delta_false_saves_a_base(tmp_path: Path) -> None:
    run = _Run(3)
    s4weights.save_checkpoint(run.state(0), tmp_path, 0)
    run.train()
    assert s4weights.save_checkpoint(run.state(1), tmp_path, 1, delta=False).is_base


def test_deltas_are_smaller_than_full_saves(tmp_path: Path) -> None:
    run = _Run(4)
    s4weights.save_checkpoint(run.state(0), tmp_path, 0)
    run.train()
    info = s4weights.save_checkpoint(run.state(1), tmp_path, 1)
    assert not info.is_base
    assert info.stored_bytes < info.full_stored_bytes


def test_rerandomised_state_is_never_bigger_than_a_full_save(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        state = {"w": torch.randn(256, 256, generator=gen), "b": torch.randn(300, generator=gen),
                 "h": torch.randn(128, 64, generator=gen).to(torch.bfloat16), "step": step}
        info = s4weights.save_checkpoint(state, tmp_path, step)
        full = s4weights.save(state, io.BytesIO()).file_size
        assert info.file_bytes <= full + 64
        assert info.is_base  # no tensor gained from the delta: the file depends on nothing
        assert_same(s4weights.load_checkpoint(tmp_path, step), state)


def test_partly_changed_state_deltas_only_the_tensors_that_gain(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    fixed = torch.randn(128, 128, generator=gen)
    s4weights.save_checkpoint({"fixed": fixed, "noise": torch.randn(4096, generator=gen)},
                              tmp_path, 0)
    state = {"fixed": fixed.clone(), "noise": torch.randn(4096, generator=gen)}
    info = s4weights.save_checkpoint(state, tmp_path, 1)
    with s4format.Reader(tmp_path / info.file) as r:
        assert [t.is_delta for t in r.tensors] == [True, False]
    assert info.file_bytes <= s4weights.save(state, io.BytesIO()).file_size
    assert_same(s4weights.load_checkpoint(tmp_path, 1), state)


@pytest.mark.parametrize("against", ["base", "latest"])
def test_parent_cache_and_store_reads_give_identical_files(tmp_path: Path, against: str
                                                           ) -> None:
    run = _Run(5)
    for step in range(4):
        run.train()
        state = run.state(step)
        s4weights.save_checkpoint(state, tmp_path / "cached", step, delta_against=against)
        url = open_store(tmp_path / "cached").url
        cached = chain._PARENT_CACHE.pop(url, None)
        s4weights.save_checkpoint(state, tmp_path / "reread", step, delta_against=against)
        chain._PARENT_CACHE.clear()
        if cached is not None:  # (the parent held for the next save: the base, or this one)
            chain._PARENT_CACHE[url] = cached
        assert cached[0] == s4weights.list_checkpoints(tmp_path / "cached")[
            0 if against == "base" else -1].checkpoint_id
    for step in range(4):
        assert _data_file(tmp_path / "cached", step).read_bytes() == \
            _data_file(tmp_path / "reread", step).read_bytes()


def test_list_checkpoints_and_file_urls(tmp_path: Path) -> None:
    assert s4weights.list_checkpoints(tmp_path / "nothing") == []
    run = _Run(6)
    url = (tmp_path / "store").as_uri()
    for step in (5, 10, 20):
        run.train()
        s4weights.save_checkpoint(run.state(step), url, step)
    infos = s4weights.list_checkpoints(tmp_path / "store")
    assert [i.step for i in infos] == [5, 10, 20]
    assert [i.parent_step for i in infos] == [None, 5, 5]
    assert s4weights.load_checkpoint(url)["step"] == 20


def test_missing_steps_and_existing_steps_raise_storage_errors(tmp_path: Path) -> None:
    with pytest.raises(s4weights.StorageError, match="no checkpoints in file://"):
        s4weights.load_checkpoint(tmp_path)
    with pytest.raises(s4weights.StorageError, match="missing does not exist: there is no "
                       "checkpoint directory there"):
        s4weights.load_checkpoint(tmp_path / "missing")
    s4weights.save_checkpoint({"x": torch.ones(3)}, tmp_path, 1)
    s4weights.save_checkpoint({"x": torch.ones(3)}, tmp_path, 2)
    with pytest.raises(s4weights.StorageError,
                       match=r"no checkpoint step 7 .*steps there: \[1, 2\]"):
        s4weights.load_checkpoint(tmp_path, 7)
    with pytest.raises(s4weights.StorageError, match="checkpoint step 2 already exists"):
        s4weights.save_checkpoint({"x": torch.zeros(3)}, tmp_path, 2)
    with pytest.raises(ValueError, match="step must be >= 0"):
        s4weights.save_checkpoint({"x": torch.zeros(3)}, tmp_path, -1)


def test_a_step_older_than_the_latest_is_saved_as_a_base(tmp_path: Path) -> None:
    s4weights.save_checkpoint({"x": torch.arange(1000.0)}, tmp_path, 10)
    info = s4weights.save_checkpoint({"x": torch.arange(1000.0) + 1}, tmp_path, 5)
    assert info.is_base
    assert s4weights.load_checkpoint(tmp_path)["x"][0].item() == 0.0


def test_retain_keeps_the_chain_of_a_kept_delta(tmp_path: Path) -> None:
    run = _Run(7)
    for step in range(5):
        run.train()
        save_on_latest(run.state(step), tmp_path, step, keyframe_interval=10)
    files = {s: _data_file(tmp_path, s).name for s in range(5)}
    assert s4weights.retain(tmp_path, [3]) == [4]
    assert [i.step for i in s4weights.list_checkpoints(tmp_path)] == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "data")) == [files[s] for s in range(4)]
    for s in range(4):
        assert re.fullmatch(rf"{s:012d}-[0-9a-f]{{8}}\.s4w", files[s]), files[s]
    assert s4weights.retain(tmp_path, [99]) == [0, 1, 2, 3]
    assert s4weights.list_checkpoints(tmp_path) == []


# -- wrong or missing parents --------------------------------------------------------------

@pytest.fixture(scope="module")
def _template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("template")
    run = _Run(8)
    saved = {}
    for step in range(3):
        run.train()
        info = save_on_latest(run.state(step), root, step)
        assert info.depth == step
        saved[step] = clone_tree(run.state(step))
    chain._PARENT_CACHE.clear()
    return root, saved


@pytest.fixture
def two_deltas(tmp_path: Path, _template: tuple[Path, dict[int, Any]]
               ) -> tuple[_Run, dict[int, Any]]:
    """A base and two deltas on it in ``tmp_path``; the run that made them, to go on."""
    shutil.copytree(_template[0], tmp_path, dirs_exist_ok=True)
    run = _Run(8)
    run.train(3)
    return run, _template[1]


@pytest.mark.parametrize("remove", ["manifest", "data", "both"])
def test_deleted_parent_raises_parent_mismatch(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]], remove: str) -> None:
    data = _data_file(tmp_path, 1)  # (named by the manifest, which may go first)
    if remove in ("manifest", "both"):
        (tmp_path / "manifests" / f"{1:012d}.json").unlink()
    if remove in ("data", "both"):
        data.unlink()
    with pytest.raises(s4weights.ParentMismatchError, match=r"step 2 .*step 1") as info:
        s4weights.load_checkpoint(tmp_path, 2)
    assert "missing" in str(info.value) or "cannot" in str(info.value)
    # The base is untouched and still loads.
    assert s4weights.load_checkpoint(tmp_path, 0)["step"] == 0


def test_parent_data_replaced_by_another_checkpoint_raises_parent_mismatch(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]]) -> None:
    _, saved = two_deltas
    shutil.copyfile(_data_file(tmp_path, 0), _data_file(tmp_path, 1))
    with pytest.raises(s4weights.ParentMismatchError, match="its manifest says"):
        s4weights.load_checkpoint(tmp_path, 2)
    assert_same(s4weights.load_checkpoint(tmp_path, 0), saved[0])


def test_parent_replaced_with_its_manifest_raises_parent_mismatch(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]]) -> None:
    other = tmp_path / "other"
    replacement = s4weights.save_checkpoint({"x": torch.ones(5)}, other, 1)
    _data_file(tmp_path, 1).unlink()  # step 1 replaced whole: its file and its manifest
    for name in (replacement.file, f"manifests/{1:012d}.json"):
        shutil.copyfile(other / name, tmp_path / name)
    with pytest.raises(s4weights.ParentMismatchError, match="checkpoint step 2 expects parent"):
        s4weights.load_checkpoint(tmp_path, 2)


def test_load_of_a_delta_file_needs_its_parent(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]]) -> None:
    _, saved = two_deltas
    data = {s: _data_file(tmp_path, s) for s in range(3)}
    with pytest.raises(s4weights.ParentMismatchError, match="is a delta; open the file with"):
        s4weights.load(data[1])
    assert_same(s4weights.load(data[1], parent=data[0]), saved[1])
    with pytest.raises(s4weights.ParentMismatchError, match="is a delta against checkpoint"):
        s4weights.load(data[2], parent=data[0])
    with pytest.raises(s4weights.ParentMismatchError, match="is not a delta"):
        s4weights.load(data[0], parent=data[1])


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_delta_file_raises_truncated_error(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]], keep: float) -> None:
    path = _data_file(tmp_path, 2)
    blob = path.read_bytes()
    path.write_bytes(blob[:int(len(blob) * keep)])
    with pytest.raises(s4format.TruncatedError, match="truncated") as info:
        s4weights.load_checkpoint(tmp_path, 2)
    assert isinstance(info.value, s4weights.S4Error)


def test_corrupted_parent_bytes_are_caught(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]]) -> None:
    path = _data_file(tmp_path, 0)
    blob = bytearray(path.read_bytes())
    blob[200] ^= 0xFF  # a payload byte of the base
    path.write_bytes(bytes(blob))
    with pytest.raises(s4format.ChecksumError):
        s4weights.load_checkpoint(tmp_path, 2)


@pytest.mark.parametrize("against", ["base", "latest"])
def test_a_fresh_process_chains_onto_an_existing_store(
        tmp_path: Path, two_deltas: tuple[_Run, dict[int, Any]], against: str) -> None:
    run, saved = two_deltas
    run.train()
    state = run.state(3)
    # the cache is empty: reads step 0 (the base), or 0..2
    info = s4weights.save_checkpoint(state, tmp_path, 3, delta_against=against)
    assert (info.parent_step, info.depth) == ((0, 1) if against == "base" else (2, 3))
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path, 3), clone_tree(state))
    assert np.array_equal(s4weights.load_checkpoint(tmp_path, 1)["rng"].numpy(),
                          saved[1]["rng"].numpy())


def test_a_delta_against_the_base_that_ends_a_base_is_not_held_as_the_callers_tensors(
        tmp_path: Path) -> None:
    # A save whose deltas go against the base codes the caller's host tensors without a copy
    # (nobody's parent). Where it ends a base after all (no tensor smaller as a delta), the
    # next save must not take the caller's tensors, changed since, for its parent.
    g = torch.Generator().manual_seed(5)
    a = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(4096, generator=g)}
    s4weights.save_checkpoint(a, tmp_path, 0, read_budget=None)
    b = {k: torch.randn(v.shape, generator=g) for k, v in a.items()}  # nothing like a
    info = s4weights.save_checkpoint(b, tmp_path, 1, read_budget=None)
    assert info.is_base and info.base_reason == "no tensor coded smaller as a delta"
    kept = clone_tree(b)
    for v in b.values():  # the caller's next step changes its tensors in place
        v.mul_(1 + 1e-3)
    c = clone_tree(b)
    info = s4weights.save_checkpoint(b, tmp_path, 2, read_budget=None)
    assert info.parent_step == 1
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path, 1), kept)
    assert_same(s4weights.load_checkpoint(tmp_path, 2), c)


def test_a_snapshot_that_leaves_host_tensors_uncopied_is_partial_whatever_follows() -> None:
    # A CUDA tensor flattened after an uncopied host tensor must not clear the mark: else a
    # save that ends a base after all caches the caller's live tensors as the next parent.
    from s4weights.torchtree import DeviceTensor, flatten

    (na, ta), (nb, tb) = flatten({"a": torch.zeros(4), "b": torch.zeros(4)}).tensors
    dev = DeviceTensor(tb.dtype, tb.shape, torch.zeros(tb.nbytes, dtype=torch.uint8))
    for tensors in ([(na, ta), (nb, dev)], [(nb, dev), (na, ta)]):
        snap = chain._Snapshot(tensors, {}, devices=True, hosts=False)
        try:
            assert snap.partial
            assert snap.tensors[na] is ta  # (the caller's own, not a copy)
        finally:
            snap.abandon()
