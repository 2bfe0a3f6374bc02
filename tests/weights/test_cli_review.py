"""The CLIs as a review drove them: a verify whose output pipe closes still reports failure;
a damaged manifest is a problem of its run, not the end of the command; bad URLs and missing
directories are one-line errors (exit 2); the conformance runner's missing or malformed suite
too; the demo refuses arguments that would divide by zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import s4weights
import s4weights.cli
from s4weights import chain

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, timeout=300)


def _run_with_steps(root: Path, steps=(1, 2, 3)) -> None:
    for s in steps:
        s4weights.save_checkpoint({"w": torch.full((64,), float(s))}, root, s)


def test_verify_into_a_closed_pipe_still_exits_1_on_problems(tmp_path: Path) -> None:
    _run_with_steps(tmp_path / "r")
    m = tmp_path / "r" / "manifests" / f"{3:012d}.json"
    d = json.loads(m.read_text())
    d["file_bytes"] += 1
    m.write_text(json.dumps(d))
    # a pipe whose reader has gone: the first progress line breaks it
    r, w = os.pipe()
    os.close(r)
    try:
        out = _run("-m", "s4weights", "verify", str(tmp_path / "r"), stdout=w)
    finally:
        os.close(w)
    assert out.returncode == 1, out.stderr
    assert "1 problem(s)" in out.stderr


def test_a_damaged_manifest_is_a_problem_of_its_run(tmp_path: Path) -> None:
    _run_with_steps(tmp_path / "a")
    _run_with_steps(tmp_path / "b")
    m = tmp_path / "b" / "manifests" / f"{2:012d}.json"
    d = json.loads(m.read_text())
    d["step"] = "2"  # a wrong type, not just bad JSON
    m.write_text(json.dumps(d))
    # skipped where checkpoints are saved and loaded, with what is wrong said...
    problems: list[str] = []
    assert [i.step for i in chain.list_checkpoints(tmp_path / "b", problems=problems)] == [1, 3]
    assert len(problems) == 1 and "step must be a non-negative integer" in problems[0]
    # ...and a problem of its run where runs are checked, the others checked still
    out = _run("-m", "s4weights", "verify", str(tmp_path))
    assert out.returncode == 1, out.stderr
    assert "a: step 3: OK" in out.stdout and "b: INVALID" in out.stdout
    assert "b: step 1: OK" in out.stdout and "step must be a non-negative integer" in out.stderr
    assert "Traceback" not in out.stderr
    out = _run("-m", "s4weights", "list", str(tmp_path))
    assert out.returncode == 1 and "run " in out.stdout and "malformed" in out.stderr


@pytest.mark.parametrize("url", ["ftp://x/y", "s3:///", "/nonexistent/dir"])
def test_bad_urls_and_missing_directories_are_one_line_errors(url: str) -> None:
    for cmd in ("list", "verify"):
        assert s4weights.cli.main([cmd, url]) == 2


def test_conformance_with_a_missing_or_malformed_suite_exits_2(tmp_path: Path) -> None:
    from s4format.cli import main

    assert main(["conformance", "--suite", str(tmp_path / "none")]) == 2
    (tmp_path / "manifest.json").write_text("{not json")
    assert main(["conformance", "--suite", str(tmp_path)]) == 2
    (tmp_path / "manifest.json").write_text("{}")
    assert main(["conformance", "--suite", str(tmp_path)]) == 2


@pytest.mark.parametrize("args", [["--every", "0"], ["--every", "-5"], ["--steps", "5"]])
def test_the_demo_refuses_arguments_that_save_nothing(args) -> None:
    from s4weights import demo

    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2
