"""``sweep.sweep`` and ``python -m s4weights sweep``: what failed saves leave (checkpoint files
no manifest names, dead writers' temporary files) goes; what a checkpoint uses, or a save in
progress may still name, stays."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import s4weights
from s4format.errors import StorageError
from s4weights import cli, sweep
from s4weights.store.local import TMP_PREFIX, LocalStore


def _run(root, steps=(1, 2, 3)) -> dict[int, str]:
    return {s: s4weights.save_checkpoint({"w": torch.full((256,), float(s))}, root, s).file
            for s in steps}


def _aged(path, seconds: float = 7200) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_sweep_removes_old_orphans_and_temporaries_only(tmp_path, capsys) -> None:
    files = _run(tmp_path)
    old = tmp_path / "data" / "000000000004-deadbeef.s4w"  # a save killed before its manifest
    young = tmp_path / "data" / "000000000005-feedface.s4w"  # a save in progress
    temp = tmp_path / "data" / f"{TMP_PREFIX}0123-000000000006-cafe.s4w"
    for p in (old, young, temp):
        shutil.copyfile(tmp_path / files[3], p)
    _aged(old)
    _aged(temp)
    _aged(tmp_path / files[1])  # old, but its manifest names it

    assert cli.main(["sweep", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove data/000000000004-deadbeef.s4w" in out
    assert "would remove 1 temporary" in out
    assert old.exists() and temp.exists()

    got = sweep.sweep(tmp_path)
    assert got.orphans == ["data/000000000004-deadbeef.s4w"] and got.temporaries == 1
    assert not old.exists() and not temp.exists() and young.exists()
    for s in (1, 2, 3):
        assert torch.equal(s4weights.load_checkpoint(tmp_path, s)["w"],
                           torch.full((256,), float(s)))
    assert cli.main(["sweep", str(tmp_path)]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_a_manifest_that_does_not_parse_keeps_every_file(tmp_path, capsys) -> None:
    files = _run(tmp_path / "a", (1, 2))
    (tmp_path / "a" / "manifests" / f"{2:012d}.json").write_text("{broken")
    _aged(tmp_path / "a" / files[2])
    _run(tmp_path / "b", (1,))
    orphan = tmp_path / "b" / "data" / "000000000007-00000000.s4w"
    orphan.write_bytes(b"x")
    _aged(orphan)
    assert cli.main(["sweep", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert (tmp_path / "a" / files[2]).exists()  # the broken manifest may name it
    assert "checkpoint files left alone" in out.err and not orphan.exists()


def test_a_run_nested_in_another_keeps_its_files(tmp_path, capsys) -> None:
    outer = _run(tmp_path, (1,))
    inner = _run(tmp_path / "data" / "exp2", (7,))
    child_temp = tmp_path / "data" / "exp2" / "data" / f"{TMP_PREFIX}1-x.s4w"
    other_temp = tmp_path / f"{TMP_PREFIX}someone-else"
    for p in (child_temp, other_temp):
        p.write_bytes(b"x")
    for p in (tmp_path / outer[1], tmp_path / "data" / "exp2" / inner[7], child_temp,
              other_temp):
        _aged(p)
    got = sweep.sweep(tmp_path)  # the outer run alone
    assert got == sweep.Swept([], 0, [])
    assert child_temp.exists() and other_temp.exists()
    assert cli.main(["sweep", str(tmp_path)]) == 0  # every run: each sweeps its own
    assert not child_temp.exists() and other_temp.exists()
    assert s4weights.load_checkpoint(tmp_path / "data" / "exp2")["w"][0] == 7


def test_a_listing_that_fails_removes_nothing(tmp_path, monkeypatch) -> None:
    files = _run(tmp_path, (1, 2))
    for f in files.values():
        _aged(tmp_path / f)
    real = os.walk

    def walk(top, *a, onerror=None, **kw):
        if str(top).endswith("manifests"):
            onerror(PermissionError(13, "Permission denied", str(top)))
        return real(top, *a, onerror=onerror, **kw)
    monkeypatch.setattr(os, "walk", walk)
    with pytest.raises(StorageError, match=r"cannot list .*manifests: Permission denied"):
        sweep.sweep(tmp_path)
    monkeypatch.undo()
    assert all((tmp_path / f).exists() for f in files.values())


def test_no_manifest_at_all_removes_nothing(tmp_path) -> None:
    files = _run(tmp_path, (1,))
    _aged(tmp_path / files[1])
    (tmp_path / "manifests" / f"{1:012d}.json").unlink()
    got = sweep.sweep(tmp_path)
    assert got.orphans == [] and "no manifest names any" in got.problems[0]
    assert (tmp_path / files[1]).exists()


@pytest.mark.parametrize("age", [0, -1, float("nan"), float("inf")])
def test_ages_that_would_remove_live_files_or_nothing_are_refused(tmp_path, age) -> None:
    _run(tmp_path, (1,))
    with pytest.raises(ValueError, match="older_than_s must be a positive"):
        sweep.sweep(tmp_path, age)
    with pytest.raises(SystemExit):
        cli.main(["sweep", str(tmp_path), "--older-than", str(age)])
    with pytest.raises(SystemExit):
        cli.main(["sweep", str(tmp_path), "--older-than", "60"])  # under the 900 s floor


def test_a_delete_that_fails_is_said_and_the_other_runs_go_on(tmp_path, monkeypatch,
                                                              capsys) -> None:
    for run in ("a", "b"):
        _run(tmp_path / run, (1,))
        orphan = tmp_path / run / "data" / "000000000009-abcdef01.s4w"
        orphan.write_bytes(b"x")
        _aged(orphan)
    real = LocalStore.delete

    def delete(self, name):
        if self.root.name == "a":
            raise StorageError(f"cannot delete {name}: Operation not permitted")
        return real(self, name)
    monkeypatch.setattr(LocalStore, "delete", delete)
    assert cli.main(["sweep", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "could not delete data/000000000009-abcdef01.s4w" in out.err
    assert "removed data/000000000009-abcdef01.s4w" in out.out
    assert not (tmp_path / "b" / "data" / "000000000009-abcdef01.s4w").exists()
