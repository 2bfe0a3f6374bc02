"""Ranks killed with SIGKILL at random points of 2-rank saves, many times, locally and on S3:
a checkpoint is there whole or not at all, and the last committed one loads bit-exactly (the
trials run in ``tests.dcp.crash_driver``; this test checks its report and the paths again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.dcp import crash_driver
from tests.dcp.conftest import new_bucket, weed_available

pytestmark = [pytest.mark.skipif(os.name != "posix", reason="needs fork and SIGKILL"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

REPO = Path(__file__).resolve().parents[2]
TRIALS = 12


def test_killed_ranks_leave_whole_checkpoints_or_none(tmp_path: Path, request,
                                                      monkeypatch) -> None:
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "tests.dcp.crash_driver", str(tmp_path), str(TRIALS), "7"]
    server = None
    if weed_available():
        for k, v in request.getfixturevalue("s3_env").items():
            monkeypatch.setenv(k, v)
            env[k] = v
        server = request.getfixturevalue("s3_server")
        args.append(f"s3://{new_bucket(server)}/crash/ck")
    # (the driver's own deadlines fail a stuck trial long before this one, with its stacks)
    try:
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the crash driver ran past 900 s\n{_text(exc.stderr)[-20000:]}"
                    f"{_server_log(server)}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-20000:] + _server_log(server)
    report = json.loads((tmp_path / "report.json").read_text())
    trials = [t for t in report if "final" not in t]
    assert len([t for t in trials if t["where"] == "local"]) == TRIALS
    # some kills came before the commit: the path still held the previous checkpoint, or none
    assert any(t["holds"] != t["seed"] for t in trials)
    assert any(t["exit"].count(-9) for t in trials)
    # what the driver saw is what is there: every path holds what it reported, bit-exactly
    for t in trials:
        if t["path"] != next(f["final"] for f in report if f.get("where") == t["where"]
                             and "final" in f):
            assert crash_driver.holds(t["path"]) == t["holds"], t
    for f in (f for f in report if "final" in f):
        assert crash_driver.holds(f["final"]) == f["holds"]


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _server_log(server) -> str:
    return "" if server is None else f"\nSeaweedFS log (end):\n{server.log_tail(6000)}"
