"""``python -m s4format`` as a user runs it: a subprocess on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import s4format
from conformance import craft
from s4format import Reader, Writer
from tests.format.common import small_file

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "s4format", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    blob = small_file()
    good = d / "good.s4w"
    good.write_bytes(blob)
    exponent = craft.parse(blob).tensors[3]["planes"][1]
    damaged = bytearray(blob)
    damaged[exponent["offset"] + 7] ^= 0x04
    corrupt = d / "corrupt.s4w"
    corrupt.write_bytes(bytes(damaged))
    notes = d / "notes.s4w"
    notes.write_bytes(b"just some text\n" * 10)
    cut = d / "cut.s4w"
    cut.write_bytes(blob[:1000])
    rng = np.random.default_rng(0)
    w = rng.standard_normal(5000).astype("<f4")
    base = d / "base.s4w"
    s4format.write(base, {"w": w, "empty": np.zeros((0, 3), "<f4")})
    child = w.copy()
    child[:3] = 0
    delta = d / "delta.s4w"
    with Writer(delta, parent_id=Reader(base).checkpoint_id) as wr:
        wr.add("w", child, parent=w)
    return dict(good=good, corrupt=corrupt, notes=notes, cut=cut, base=base, delta=delta,
                missing=d / "missing.s4w")


def test_inspect(files) -> None:
    res = run("inspect", files["good"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"{files['good']}: .s4w 1.5, flags required=0x0 optional=0x0, alignment 64"
    assert lines[1].endswith(", full (no parent)")
    assert "  framework: test" in lines
    assert any(line.startswith("emb  bfloat16[2048]  bf16  raw 4096  stored ") for line in lines)
    assert [line.split()[0] for line in lines if line.startswith("    ")] == \
        ["raw", "raw", "raw", "sign", "exponent", "mantissa0"]
    assert lines[-1].startswith("total: 4 tensors, raw 4645 bytes, stored ")
    assert res.stderr == ""


def test_inspect_json(files) -> None:
    res = run("inspect", "--json", files["good"])
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    with Reader(files["good"]) as r:
        assert d["checkpoint_id"] == r.checkpoint_id.hex()
        assert d["file_bytes"] == files["good"].stat().st_size
        assert [t["name"] for t in d["tensors"]] == [t.name for t in r.tensors]
        assert [t["shape"] for t in d["tensors"]] == [list(t.shape) for t in r.tensors]
        for got, t in zip(d["tensors"], r.tensors):
            assert got["stored_bytes"] == t.stored_nbytes == \
                sum(p["stored_bytes"] for p in got["planes"])
            assert [p["offset"] for p in got["planes"]] == [p.offset for p in t.planes]
    assert d["version"] == "1.5" and d["metadata"] == {"framework": "test"}
    assert d["totals"]["tensors"] == 4 and d["totals"]["raw_bytes"] == 4645


def test_inspect_empty_tensor_and_delta(files) -> None:
    d = json.loads(run("inspect", "--json", files["base"]).stdout)
    empty = next(t for t in d["tensors"] if t["name"] == "empty")
    assert empty["raw_bytes"] == 0 and empty["ratio"] is None
    assert "stored 0  ratio -" in run("inspect", files["base"]).stdout
    res = run("inspect", "--json", files["delta"])
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["delta_parent"] == Reader(files["base"]).checkpoint_id.hex()
    assert d["tensors"][0]["delta_parent"] is not None
    # three of its 5000 words changed: a masked delta (format 1.4), its mask plane first
    assert d["tensors"][0]["masked"] is True and not empty["masked"]
    assert [p["plane"] for p in d["tensors"][0]["planes"]][:2] == ["mask", "sign"]
    text = run("inspect", files["delta"]).stdout.splitlines()
    assert text[2].startswith("w  float32[5000]  fp32 masked  raw 20000  stored ")
    mask_line = text[3].split()
    assert (mask_line[0], mask_line[2]) == ("mask", "625")  # one bit for each of 5000 words


def test_verify_valid(files) -> None:
    res = run("verify", files["good"])
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout == f"{files['good']}: OK, 4 tensors, every checksum and content hash " \
                         "verified\n"


def test_verify_corrupt_names_tensor_and_plane(files) -> None:
    res = run("verify", files["corrupt"])
    assert res.returncode == 1
    lines = res.stderr.splitlines()
    assert len(lines) == 2
    assert f"{files['corrupt']}: tensor 'emb' plane exponent: checksum of the" in lines[0]
    assert lines[1] == f"{files['corrupt']}: INVALID, 1 problem(s)"
    assert res.stdout == ""


def test_verify_delta_needs_its_parent(files) -> None:
    res = run("verify", files["delta"])  # said once, with what to run; not INVALID
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "INVALID" not in res.stderr
    assert "its 1 delta tensors can only be checked with the parent: python -m s4format " \
           f"verify {files['delta']} --parent PARENT.s4w" in res.stderr
    res = run("verify", files["delta"], "--parent", files["base"])
    assert res.returncode == 0, res.stderr
    res = run("verify", files["delta"], "--parent", files["good"])
    assert res.returncode == 2
    assert "error: ParentMismatchError:" in res.stderr


@pytest.mark.parametrize(("name", "error"), [
    ("notes", "BadMagicError: {path}: not a .s4w file"),
    ("cut", "TruncatedError: {path}: no footer at the end of the file"),
    ("missing", "StorageError: cannot open {path}: No such file or directory"),
])
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_unopenable_files_exit_2(files, command: str, name: str, error: str) -> None:
    res = run(command, files[name])
    assert res.returncode == 2
    assert res.stderr.startswith(f"error: {error.format(path=files[name])}")
    assert res.stderr.count("\n") == 1, res.stderr  # one line, no traceback
    assert res.stdout == ""


@pytest.mark.parametrize(("args", "text"), [
    ((), "Inspect and verify .s4w checkpoint files."),
    (("inspect",), "Print the structure of a .s4w file without decoding it."),
    (("verify",), "Exit status 0 when valid, 1 when a problem is found"),
])
def test_help(args: tuple[str, ...], text: str) -> None:
    res = run(*args, "--help")
    assert res.returncode == 0
    assert res.stdout.startswith("usage: python -m s4format")
    assert text in " ".join(res.stdout.split())


def test_no_command_is_a_usage_error() -> None:
    res = run()
    assert res.returncode == 2
    assert "the following arguments are required: command" in res.stderr


def test_verify_a_delta_of_a_delta_with_its_whole_chain(tmp_path: Path, files) -> None:
    # --parent repeats: the file's parent first, down to the base
    w = np.random.default_rng(0).standard_normal(5000).astype("<f4")  # base.s4w's "w"
    mid = w.copy()
    mid[:3] = 0  # delta.s4w's "w"
    top = mid.copy()
    top[10:20] = 1
    second = tmp_path / "second.s4w"
    with Writer(second, parent_id=Reader(files["delta"], parent=Reader(files["base"]))
                .checkpoint_id) as wr:
        wr.add("w", top, parent=mid)
    res = run("verify", second, "--parent", files["delta"], "--parent", files["base"])
    assert res.returncode == 0, res.stderr
    res = run("verify", second, "--parent", files["delta"])  # the chain cut short
    assert res.returncode == 1 and "is a delta" in res.stderr
