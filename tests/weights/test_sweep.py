"""``chain.sweep`` and ``python -m s4weights sweep``: what failed saves leave (checkpoint files
no manifest names, dead writers' temporary files) goes; what a checkpoint uses, or a save in
progress may still name, stays."""

from __future__ import annotations

import os
import shutil
import time

import torch

import s4weights
from s4weights import chain, cli
from s4weights.store.local import TMP_PREFIX


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
    assert "would remove data/000000000004-deadbeef.s4w" in capsys.readouterr().out
    assert old.exists() and temp.exists()

    got = chain.sweep(tmp_path)
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
