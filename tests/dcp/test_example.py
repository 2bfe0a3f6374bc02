"""examples/dcp_fsdp2.py runs: FSDP2 training on 2 CPU ranks saves S4 checkpoints with dcp.save,
and a run on 1 rank resumes from the newest one, model and AdamW state included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")
torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.state_dict_loader import (  # noqa: E402
    _load_state_dict_from_keys,
)

from s4weights.dcp import S4StorageReader  # noqa: E402
from tests.dcp.states import tensor_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "dcp_fsdp2.py"


def _run(checkpoints: Path, steps: int, ranks: int, *extra: str) -> str:
    args = [sys.executable, str(EXAMPLE), "--nproc", str(ranks), "--checkpoints", str(checkpoints),
            "--steps", str(steps), "--save-every", "1", "--dim", "32", "--timeout", "120", *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_example_saves_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _run(run, 2, ranks=2)
    assert "saved" in first and "resumed" not in first
    second = _run(run, 3, ranks=1)
    assert "resumed from step 2 with 1 ranks" in second
    assert "step 3 loss" in second and "step 2 loss" not in second
    assert sorted(os.listdir(run)) == ["step-000001", "step-000002", "step-000003"]
    two, three = (_load_state_dict_from_keys(storage_reader=S4StorageReader(str(run / s)))
                  for s in ("step-000002", "step-000003"))
    assert (two["step"], three["step"]) == (2, 3)
    # AdamW counted the steps before the resume: its state was loaded, not started afresh
    steps = {float(s["step"]) for s in three["optim"]["state"].values()}
    assert steps == {3.0}
    moved = [k for k, v in three["model"].items()
             if tensor_bytes(v) != tensor_bytes(two["model"][k])]
    assert len(moved) == len(three["model"])


def test_example_with_chains(tmp_path: Path) -> None:
    run = tmp_path / "chain"
    first = _run(run, 3, 2, "--chain", "--keep-last", "2")
    assert "saved step 3" in first
    second = _run(run, 4, 1, "--chain")
    assert "resumed from step 3 with 1 ranks" in second and "saved step 4 (base)" in second
    import s4weights

    infos = s4weights.list_checkpoints(run)
    assert [i.step for i in infos][-1] == 4 and all(i.rank_files for i in infos)
    whole = s4weights.load_checkpoint(run, 4)
    assert whole["step"] == 4 and {float(s["step"]) for s in whole["optim"]["state"].values()} \
        == {4.0}
