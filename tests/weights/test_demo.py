"""The demo compares like with like: S4 and torch.save both written to disk and loaded back from
it, with both load times shown, and it removes its temporary folder or says where it left it."""

from __future__ import annotations

import re
from pathlib import Path

from s4format import jit
from s4weights import demo

SMALL = ["--steps", "2", "--every", "1", "--dim", "16", "--layers", "1"]


def test_both_sides_on_disk_with_load_times_and_cleaned_up(capsys) -> None:
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "both sides write to disk, fsync'd and renamed into place" in out
    assert re.search(r"save s +load s +MB +save s +load s +bit-exact", out)
    assert len(re.findall(r"^ +[12] (base|delta<-1) .* yes$", out, re.M)) == 2
    assert "every checkpoint bit-exact: yes" in out
    root = Path(re.search(r"^removed (.+)$", out, re.M).group(1))
    assert not root.exists()
    # with numba's kernels (as the suite runs), the demo says how to skip their start-up
    assert ("python -m s4format kernels build, once per machine" in out) == jit.numba_started()


def test_a_kept_folder_is_named(tmp_path: Path, capsys) -> None:
    assert demo.main([*SMALL, "--dir", str(tmp_path / "d")]) == 0
    assert f"checkpoints left in {tmp_path / 'd'}" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "d" / "torch").iterdir()) == ["step-1.pt",
                                                                           "step-2.pt"]
    assert (tmp_path / "d" / "s4" / "manifests").is_dir()
