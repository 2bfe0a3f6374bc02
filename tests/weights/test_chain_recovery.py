"""save_checkpoint when the latest checkpoint, or a file of its chain, is listed but cannot be
read: the save still succeeds as a base with a warning naming the parent, whether this process
still caches the parent (warm) or must re-read it (cold), and nothing else in the store changes.
Loading the damaged step raises a clear error; list and retain take it in their stride."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import s4format
import s4weights
from s4weights import chain
from tests.weights.common import assert_same, save_on_latest

STEPS = (0, 1, 2)  # a base and two deltas on it


@pytest.fixture(autouse=True)
def _fresh_parent_cache():
    chain._PARENT_CACHE.clear()
    yield
    chain._PARENT_CACHE.clear()


def _data(root: Path, step: int) -> Path:
    """The data file of checkpoint ``step``, as its manifest names it."""
    return root / chain.by_step(chain.list_checkpoints(root))[step].file


def _state(step: int) -> dict[str, Any]:
    """Weights that move a little each step (deltas pay), and a counter."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    for _ in range(step):
        w += 1e-3 * torch.randn(256, 64, generator=g)
    return {"w": w, "b": torch.full((64,), float(step)), "step": step}


def _chain_of_three(root: Path) -> None:
    for step in STEPS:
        info = save_on_latest(_state(step), root, step)
        assert info.depth == step  # the premise: 2 is a delta of 1, a delta of 0


def _delete(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[:len(blob) // 2])


def _replace_by_base(path: Path) -> None:
    shutil.copyfile(_data(path.parent.parent, 0), path)


def _damage_index(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-41] ^= 0xFF  # the index's last byte, just before the 40-byte footer
    path.write_bytes(bytes(blob))


def _damage_payload(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[100] ^= 0xFF  # inside the first plane (the data section starts at 32)
    path.write_bytes(bytes(blob))


# damage -> (error class, message) load_checkpoint raises for the damaged step
DAMAGE: dict[str, tuple[Callable[[Path], None], type[Exception], str]] = {
    "deleted": (_delete, s4weights.StorageError,
                r"checkpoint step 2 is listed in file://.*, but its file cannot be read: cannot "
                r"open .*000000000002-[0-9a-f]{8}\.s4w: No such file.*restore "
                r"data/000000000002-[0-9a-f]{8}\.s4w, or "
                r"drop the step with retain\(\)"),
    "truncated": (_truncate, s4format.TruncatedError, r"000000000002-[0-9a-f]{8}\.s4w: no footer"),
    "replaced": (_replace_by_base, s4weights.ParentMismatchError,
                 r"000000000002-[0-9a-f]{8}\.s4w is checkpoint [0-9a-f]{32}, its manifest "
                 r"says"),
    "index damaged": (_damage_index, s4format.ChecksumError,
                      r"000000000002-[0-9a-f]{8}\.s4w: index checksum mismatch"),
}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _save_step_3_expecting_a_base(root: Path, caplog: pytest.LogCaptureFixture,
                                  *named: str) -> s4weights.CheckpointInfo:
    """Save step 3; check it is a loadable base and that one warning named ``named``."""
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        info = save_on_latest(_state(3), root, 3)
    assert (info.is_base, info.parent_id, info.depth, info.base_step) == (True, None, 0, 3)
    with s4format.Reader(_data(root, 3)) as r:
        assert r.parent_id is None and not any(t.is_delta for t in r.tensors)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "checkpoint step 3 is saved as a base" in warnings[0]
    for text in named:
        assert text in warnings[0], warnings[0]
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(root, 3), _state(3))
    return info


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_unreadable_latest_checkpoint_gives_a_new_base(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, cache: str) -> None:
    _chain_of_three(tmp_path)
    latest = s4weights.list_checkpoints(tmp_path)[-1]
    if cache == "warm":
        # What makes the warm case dangerous: the step's tensors are at hand without the file.
        assert chain._PARENT_CACHE[tmp_path.resolve().as_uri()][0] == latest.checkpoint_id
    else:
        chain._PARENT_CACHE.clear()  # a fresh process: the parent must come from the store
    damage_fn, error, message = DAMAGE[damage]
    damage_fn(_data(tmp_path, 2))
    before = _files(tmp_path)

    info = _save_step_3_expecting_a_base(tmp_path, caplog, "delta of step 2", latest.file)

    after = _files(tmp_path)  # nothing existing was touched, the damaged step included
    assert {k: v for k, v in after.items()
            if k not in (info.file, "manifests/000000000003.json")} == before
    assert [i.step for i in s4weights.list_checkpoints(tmp_path)] == [0, 1, 2, 3]
    for step in (0, 1):
        assert_same(s4weights.load_checkpoint(tmp_path, step), _state(step))
    with pytest.raises(error, match=message):
        s4weights.load_checkpoint(tmp_path, 2)
    # The chain goes on from the new base.
    assert save_on_latest(_state(4), tmp_path, 4).parent_step == 3


def test_damaged_payload_of_the_latest_gives_a_base_in_a_fresh_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A process that no longer holds the parent reads every plane, checksums first.
    _chain_of_three(tmp_path)
    chain._PARENT_CACHE.clear()
    _damage_payload(_data(tmp_path, 2))
    _save_step_3_expecting_a_base(tmp_path, caplog, "delta of step 2", "checksum")
    with pytest.raises(s4format.ChecksumError,
                       match=r"000000000002-[0-9a-f]{8}\.s4w: tensor .* plane"):
        s4weights.load_checkpoint(tmp_path, 2)


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("ancestor", [0, 1])
def test_unreadable_file_deeper_in_the_chain_gives_a_new_base(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, ancestor: int, cache: str) -> None:
    # The latest file is intact, but a delta on it could never be loaded either.
    _chain_of_three(tmp_path)
    if cache == "cold":
        chain._PARENT_CACHE.clear()
    _data(tmp_path, ancestor).unlink()
    _save_step_3_expecting_a_base(tmp_path, caplog, "delta of step 2",
                                  f"needs step {ancestor} of its chain")
    with pytest.raises(s4weights.ParentMismatchError, match=f"needs step {ancestor}"):
        s4weights.load_checkpoint(tmp_path, 2)


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_missing_manifest_deeper_in_the_chain_gives_a_new_base(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, cache: str) -> None:
    _chain_of_three(tmp_path)
    if cache == "cold":
        chain._PARENT_CACHE.clear()
    (tmp_path / "manifests" / f"{1:012d}.json").unlink()
    _save_step_3_expecting_a_base(tmp_path, caplog, "delta of step 2",
                                  "delta of step 1, which is missing from the store")


def test_list_and_retain_with_a_missing_file(tmp_path: Path) -> None:
    _chain_of_three(tmp_path)
    _data(tmp_path, 1).unlink()
    # Listing reads manifests only: the damaged step is still listed, as load_checkpoint's
    # error says, so that the user can see it and drop it.
    assert [i.step for i in s4weights.list_checkpoints(tmp_path)] == [0, 1, 2]
    # Retention keeps what kept steps depend on, readable or not, and deletes the rest.
    assert s4weights.retain(tmp_path, [2]) == []
    info = save_on_latest(_state(3), tmp_path, 3)
    assert s4weights.retain(tmp_path, [3]) == [0, 1, 2]
    assert re.fullmatch(r"data/000000000003-[0-9a-f]{8}\.s4w", info.file), info.file
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")) == \
        [info.file, "manifests/000000000003.json"]
    assert_same(s4weights.load_checkpoint(tmp_path), _state(3))


def test_keep_last_after_a_recovered_save_drops_the_damaged_chain(tmp_path: Path) -> None:
    _chain_of_three(tmp_path)
    _data(tmp_path, 2).unlink()
    info = save_on_latest(_state(3), tmp_path, 3, keep_last=1)
    assert info.is_base
    assert [i.step for i in s4weights.list_checkpoints(tmp_path)] == [3]
    assert re.fullmatch(r"data/000000000003-[0-9a-f]{8}\.s4w", info.file), info.file
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [Path(info.file).name]


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_deltas_against_the_base_need_only_the_base(tmp_path: Path, caplog, cold: bool) -> None:
    for step in STEPS:
        assert s4weights.save_checkpoint(_state(step), tmp_path, step).parent_step == \
            (None if step == 0 else 0)
    # the latest delta's file damaged: not read, the next delta is of the base all the same
    _truncate(_data(tmp_path, 2))
    if cold:
        chain._PARENT_CACHE.clear()
    info = s4weights.save_checkpoint(_state(3), tmp_path, 3)
    assert info.parent_step == 0
    if cold:
        chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path, 3), _state(3))
    # the base's file gone: a new base, said in a warning and in its manifest
    _delete(_data(tmp_path, 0))  # (warm: the base is still held, but checked to be there)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        info = s4weights.save_checkpoint(_state(4), tmp_path, 4)
    assert info.is_base and "step 0" in info.base_reason
    assert "saved as a base" in caplog.text
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path, 4), _state(4))
