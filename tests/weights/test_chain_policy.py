"""The default chain policy: a delta only while loading the newest step reads at most
``read_budget`` full saves, and every base says why it was started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import s4format
import s4weights
from s4weights import chain, chainpolicy, manifests
from tests.weights.common import assert_same

pytestmark = pytest.mark.read_budget

N = 1 << 18  # float32 elements per tensor


def _weights(seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(N, dtype=np.float32))


def _training(step: int) -> dict:
    """Every value moves a little at every step (AdamW): the XOR keeps most exponent bits,
    so a delta stores somewhat less than a full save, but not half."""
    w = _weights(0) * (1 + 1e-3 * _weights(step + 1))
    m = _weights(1000) * (1 + 1e-2 * _weights(step + 2000))
    return {"w": w, "m": m, "step": step}


def _fine_tuning(step: int) -> dict:
    """A small learning rate on bf16 weights: most values keep their bits between saves."""
    w = _weights(0).to(torch.bfloat16)
    rng = np.random.default_rng(step)
    moved = torch.from_numpy(rng.choice(N, N // 50, replace=False))
    w[moved] += 0.01 * step
    return {"w": w, "step": step}


def _read_bytes(root: Path, step: int) -> int:
    infos = chain.by_step(chain.list_checkpoints(root))
    return sum(i.file_bytes for i in chain.chain_of(step, infos))


def test_training_states_are_all_bases(tmp_path: Path) -> None:
    infos = [s4weights.save_checkpoint(_training(s), tmp_path, step=s) for s in range(4)]
    assert [i.is_base for i in infos] == [True] * 4
    assert infos[0].base_reason == "first checkpoint of the run"
    assert all(i.base_reason.startswith("read budget: ") for i in infos[1:]), infos
    assert_same(s4weights.load_checkpoint(tmp_path), _training(3))


def test_fine_tuning_chains_within_the_budget(tmp_path: Path) -> None:
    infos = [s4weights.save_checkpoint(_fine_tuning(s), tmp_path, step=s, keyframe_interval=50)
             for s in range(12)]
    full = infos[0].file_bytes
    assert sum(not i.is_base for i in infos) >= 8, [i.base_reason for i in infos]
    for i in infos:
        assert _read_bytes(tmp_path, i.step) <= 1.5 * full * 1.02, i
    # the chain stores well under what bases alone would
    assert sum(i.file_bytes for i in infos) <= 0.5 * sum(i.full_stored_bytes for i in infos)
    for s in (0, 5, 11):
        assert_same(s4weights.load_checkpoint(tmp_path, step=s), _fine_tuning(s))


def test_each_base_says_why(tmp_path: Path) -> None:
    save = s4weights.save_checkpoint
    assert save(_fine_tuning(0), tmp_path, 0).base_reason == "first checkpoint of the run"
    assert save(_fine_tuning(1), tmp_path, 1, delta=False).base_reason == \
        "saved with delta=False"
    assert save(_fine_tuning(2), tmp_path, 2, keyframe_interval=2).base_reason is None
    assert save(_fine_tuning(3), tmp_path, 3, keyframe_interval=2).base_reason == \
        "keyframe_interval=2 reached"
    assert save(_fine_tuning(9), tmp_path, 9).base_reason is None
    assert save(_fine_tuning(4), tmp_path, 4).base_reason == "not after the latest step 9"
    # a delta's manifest has no base_reason member; a base's is listed by the CLI
    manifest = json.loads((tmp_path / "manifests" / f"{9:012d}.json").read_text())
    assert "base_reason" not in manifest
    out = subprocess.run([sys.executable, "-m", "s4weights", "list", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "keyframe_interval=2 reached" in out and "saved with delta=False" in out


def test_read_budget_none_allows_any_chain(tmp_path: Path) -> None:
    infos = [s4weights.save_checkpoint(_training(s), tmp_path, step=s, read_budget=None)
             for s in range(3)]
    assert [i.is_base for i in infos] == [True, False, False]
    with pytest.raises(ValueError, match="read_budget must be a number >= 1"):
        s4weights.save_checkpoint(_training(3), tmp_path, step=3, read_budget=0.5)


def test_the_estimate_follows_the_coded_sizes() -> None:
    # the sampled share is close to what coding every tensor both ways gives
    state, parent = _fine_tuning(3), _fine_tuning(2)
    from s4weights.torchtree import flatten

    tensors = flatten(state).tensors
    parents = {n: t for n, t in flatten(parent).tensors}
    full, delta = chainpolicy.sample_sizes(tensors, parents, "auto")
    share = delta / full
    from s4format.writer import code_tensor

    (name, t), = tensors
    whole = code_tensor(t.data.reshape(-1).view(np.uint8), t.dtype).stored
    xor = code_tensor(t.data.reshape(-1).view(np.uint8)
                      ^ parents[name].data.reshape(-1).view(np.uint8), t.dtype).stored
    assert abs(share - min(xor, whole) / whole) < 0.05, (share, xor / whole)


def test_the_writer_takes_each_tensors_estimate_alone_from_the_sample(
        tmp_path: Path, monkeypatch) -> None:
    # the read-budget sample estimates the tensors whole: the CPU writer compares a delta
    # with that figure (the tensor's windows scaled) and does not sample the tensor again
    from s4format import writer
    from s4weights.torchtree import flatten

    state, parent = _fine_tuning(3), _fine_tuning(2)
    tensors = flatten(state).tensors
    s = chainpolicy.sample(tensors, {n: t for n, t in flatten(parent).tensors}, "auto")
    (_name, t), = tensors
    exact = writer.estimate_tensor(t.data.reshape(-1).view(np.uint8), t.dtype)[0]
    assert set(s.alone) == {"w"} and abs(s.alone["w"] / exact - 1) < 0.02, (s.alone, exact)
    rough = []
    real = writer.estimate_rough
    monkeypatch.setattr(writer, "estimate_rough", lambda *a: rough.append(a) or real(*a))
    s4weights.save_checkpoint(parent, tmp_path, step=2)
    info = s4weights.save_checkpoint(state, tmp_path, step=3)
    assert not info.is_base and rough == []
    assert abs(info.full_stored_bytes / s4weights.save(state, tmp_path / "alone.s4w")
               .stored_nbytes - 1) < 0.02
    assert_same(s4weights.load_checkpoint(tmp_path, 3), state)
    # without the read-budget sample, the writer's own sample of the tensor and its delta
    # gives the figure (estimate_pair, not estimate_rough)
    info = s4weights.save_checkpoint(state, tmp_path, step=4, read_budget=None)
    assert not info.is_base and rough == []
    assert abs(info.full_stored_bytes / s4weights.save(state, tmp_path / "alone.s4w")
               .stored_nbytes - 1) < 0.02


def test_a_delta_takes_each_tensors_figure_alone_from_its_parents_file(
        tmp_path: Path, monkeypatch) -> None:
    # a delta the budget does not sample (the first on a base is sampled, the next not) weighs
    # each tensor against what its parent's file stores it in, where that file stores it
    # whole: the tensor is not sampled alone, from the cached parent or one read back
    from s4format import writer

    given, sampled_alone = [], []
    real_code, real_pair = writer.Writer.code, writer.estimate_pair

    def code(self, name, tensor, *, parent=None, alone=None, parent_hash=None):
        given.append((name, alone))
        return real_code(self, name, tensor, parent=parent, alone=alone,
                         parent_hash=parent_hash)

    monkeypatch.setattr(writer.Writer, "code", code)
    monkeypatch.setattr(writer, "estimate_pair", lambda raw, parent, dtype: (
        sampled_alone.append(parent is None) or real_pair(raw, parent, dtype)))
    base = s4weights.save_checkpoint(_fine_tuning(0), tmp_path, step=0)
    with s4format.Reader(tmp_path / base.file) as r:
        whole = r.tensors[r.index_of("w")].stored_nbytes
    s4weights.save_checkpoint(_fine_tuning(1), tmp_path, step=1)
    for step, cached in ((2, True), (3, False)):
        if not cached:
            chain._PARENT_CACHE.clear()
        given.clear()
        sampled_alone.clear()
        info = s4weights.save_checkpoint(_fine_tuning(step), tmp_path, step=step)
        assert not info.is_base and info.parent_step == 0
        assert given == [("w", whole)] and True not in sampled_alone
        assert info.full_stored_bytes == whole
        assert_same(s4weights.load_checkpoint(tmp_path, step), _fine_tuning(step))


def test_manifests_with_members_of_a_later_version_are_read(tmp_path: Path) -> None:
    info = s4weights.save_checkpoint(_fine_tuning(0), tmp_path, 0)
    path = tmp_path / "manifests" / f"{0:012d}.json"
    d = json.loads(path.read_text())
    d["added_later"] = {"any": "thing"}
    path.write_text(json.dumps(d))
    manifests._MANIFESTS.clear()
    assert chain.list_checkpoints(tmp_path) == [info]


def test_small_tensors_do_not_take_the_larger_ones_share_of_the_sample() -> None:
    # a model's biases and norms (a few hundred bytes each) among its weight matrices: the
    # matrices' share is sampled in windows of 64 KiB in them, not spent a bias at a time
    from s4format import Tensor

    def t(nbytes: int, seed: int) -> Tensor:
        return Tensor.from_numpy(np.random.default_rng(seed).standard_normal(
            nbytes // 4, dtype=np.float32))

    tensors = []
    for i in range(20):
        tensors += [(f"w{i}", t(512 << 10, i)), (f"b{i}", t(512, 100 + i)),
                    (f"n{i}", t(1024, 200 + i))]
    windows = [(name, at, n) for name, _t, spans in chainpolicy._sample(tensors)
               for at, n in spans]
    large = [w for w in windows if w[0].startswith("w")]
    assert all(n == chainpolicy.WINDOW for _name, _at, n in large)
    # the sample is its minimum, 256 KiB: the matrices' share of it (255 KiB) in three whole
    # windows; the small tensors' own (under 1 KiB) in at most one
    assert len(large) == 3 and len(windows) - len(large) <= 1, windows


def test_a_delta_save_takes_each_parents_hash_from_the_chain(tmp_path: Path,
                                                             monkeypatch) -> None:
    # the CPU writer is given the parent's content hash (from the parent's file or the cached
    # snapshot's save) instead of hashing the parent again: it must be the parent's own
    from s4format import hashing, writer

    given = []
    real = writer.Writer.code

    def code(self, name, tensor, *, parent=None, alone=None, parent_hash=None):
        if parent is not None:
            given.append(parent_hash == hashing.content_hash(parent.data))
        return real(self, name, tensor, parent=parent, alone=alone, parent_hash=parent_hash)

    monkeypatch.setattr(writer.Writer, "code", code)
    s4weights.save_checkpoint(_fine_tuning(1), tmp_path, step=1)
    assert not s4weights.save_checkpoint(_fine_tuning(2), tmp_path, step=2).is_base
    chain._PARENT_CACHE.clear()  # the parent read back from its file
    assert not s4weights.save_checkpoint(_fine_tuning(3), tmp_path, step=3).is_base
    assert given == [True, True]
    assert_same(s4weights.load_checkpoint(tmp_path, 3), _fine_tuning(3))


def _sampled(monkeypatch) -> list:
    calls: list = []
    real = chainpolicy.sample
    monkeypatch.setattr(chainpolicy, "sample", lambda *a: calls.append(1) or real(*a))
    return calls


def test_a_delta_after_a_small_one_is_not_sampled(tmp_path: Path, monkeypatch) -> None:
    # the first delta on a base samples the budget; the next ones, with room left for twice
    # the latest delta, are checked as coded
    calls = _sampled(monkeypatch)
    infos = [s4weights.save_checkpoint(_fine_tuning(s), tmp_path, step=s) for s in range(5)]
    assert [i.is_base for i in infos] == [True] + [False] * 4
    assert len(calls) == 1
    for i in infos[1:]:
        assert chainpolicy.own_share(i) < 0.25, i
    assert_same(s4weights.load_checkpoint(tmp_path, step=4), _fine_tuning(4))


def test_a_delta_over_the_budget_as_coded_is_saved_again_as_a_base(tmp_path: Path,
                                                                   monkeypatch) -> None:
    calls = _sampled(monkeypatch)
    s4weights.save_checkpoint(_fine_tuning(0), tmp_path, step=0)
    assert not s4weights.save_checkpoint(_fine_tuning(1), tmp_path, step=1).is_base
    # every value moved by a tenth: the delta still codes smaller than the tensor alone (0.69
    # of it), but loading it would read its base and most of a full save again
    moved = {"w": (_weights(0) * (1 + 0.1 * _weights(7))).to(torch.bfloat16), "step": 2}
    info = s4weights.save_checkpoint(moved, tmp_path, step=2)
    assert len(calls) == 1
    assert info.is_base and info.base_reason.startswith("read budget: as a delta"), info
    # the delta's file was taken away: the data files are those the manifests name
    listed = {i.file for i in chain.list_checkpoints(tmp_path)}
    assert {f"data/{p.name}" for p in (tmp_path / "data").iterdir()} == listed
    assert_same(s4weights.load_checkpoint(tmp_path, step=2), moved)
    assert_same(s4weights.load_checkpoint(tmp_path, step=1), _fine_tuning(1))


@pytest.mark.delta_min_saved
def test_the_sample_counts_a_small_tensor_whole_as_the_writer_codes_it(monkeypatch) -> None:
    # a 2 KiB tensor, sampled whole, whose delta would store a fraction of it: the writer
    # stores it whole (writer.DELTA_MIN_SAVED), and so does the budget's estimate
    from s4format import writer
    from s4weights.torchtree import flatten

    def state(step: int) -> dict:
        return {"norm": _fine_tuning(step)["w"][:1024].clone()}

    tensors = flatten(state(2)).tensors
    parents = dict(flatten(state(1)).tensors)
    s = chainpolicy.sample(tensors, parents, "auto")
    assert s.delta == s.full
    monkeypatch.setattr(writer, "DELTA_MIN_SAVED", 0)
    s = chainpolicy.sample(tensors, parents, "auto")
    assert s.delta < 0.9 * s.full
