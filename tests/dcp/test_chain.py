"""Delta chains of sharded checkpoints (save_checkpoint/load_checkpoint with distributed=True):
twelve FSDP2 steps with keyframes and retention, every kept step loaded back bit-exactly on 2
ranks and whole in one process (and a shorter chain on SeaweedFS); list and verify on such a
run; sweep of a killed step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import s4weights  # noqa: E402
from s4weights import chain, sweep  # noqa: E402
from tests.dcp.conftest import new_bucket, weed_available  # noqa: E402
from tests.dcp.states import assert_same  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or os.name != "posix",
                                reason="needs torch.distributed and fork")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    work = tmp_path_factory.mktemp("dcp-chain")
    root, refs, report = work / "run", work / "refs", work / "report.json"
    refs.mkdir()
    s3_root, env = None, {}
    if weed_available():
        env = request.getfixturevalue("s3_env")
        s3_root = f"s3://{new_bucket(request.getfixturevalue('s3_server'))}/chain"
    args = json.dumps([str(work / "pg"), str(root), str(refs), str(report), s3_root])
    proc = subprocess.run([sys.executable, "-m", "tests.dcp.launch", "chains2", "2", args],
                          cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {"root": root, "refs": refs, "cases": json.loads(report.read_text())}


def test_every_kept_step_loaded_on_two_ranks(run: dict) -> None:
    kept = [i.step for i in s4weights.list_checkpoints(run["root"])]
    assert 100 in kept and len(kept) >= 3
    want = [f"chain step {s} on 2" for s in kept if s != 100] + ["budget base"]
    if weed_available():
        want.append("chain on s3")
    assert sorted(run["cases"]) == sorted(want)


def test_every_kept_step_loads_whole_in_one_process(run: dict) -> None:
    infos = s4weights.list_checkpoints(run["root"])
    assert any(not i.is_base for i in infos)
    for info in infos:
        if info.step == 100:
            continue
        whole = s4weights.load_checkpoint(run["root"], info.step)
        assert whole.pop("step") == info.step
        assert_same(whole, torch.load(run["refs"] / f"{info.step}.pt"))


def test_retention_left_only_what_kept_steps_need(run: dict) -> None:
    infos = chain.by_step(s4weights.list_checkpoints(run["root"]))
    needed = {f for i in infos.values() for f in [i.file]}
    folders = {f"steps/{p.name}/" for p in (run["root"] / "steps").iterdir()}
    assert folders == needed
    for info in infos.values():
        assert [f["rank"] for f in info.rank_files] == [0, 1]
        for f in info.rank_files:
            assert (run["root"] / f["name"]).is_file()
            if f["parent"] is not None:
                assert f["parent"] in {g["name"] for i in infos.values() for g in i.rank_files}


def test_list_and_verify_the_run(run: dict) -> None:
    out = subprocess.run([sys.executable, "-m", "s4weights", "list", str(run["root"])],
                         capture_output=True, text=True, check=True).stdout
    assert "read budget" in out
    ok = subprocess.run([sys.executable, "-m", "s4weights", "verify", str(run["root"])],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_damaged_rank_file_is_named(run: dict, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run["root"], copy)
    info = s4weights.list_checkpoints(copy)[-1]
    victim = copy / info.rank_files[1]["name"]
    data = bytearray(victim.read_bytes())
    data[200] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = subprocess.run([sys.executable, "-m", "s4weights", "verify", str(copy)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and info.rank_files[1]["name"] in bad.stdout + bad.stderr
    with pytest.raises(s4weights.S4Error, match=r"__1_.*tensor .*checksum"):
        s4weights.load_checkpoint(copy, info.step)


def test_sweep_removes_a_killed_step(run: dict, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run["root"], copy)
    dead = copy / "steps" / f"{500:012d}-deadbeef"
    dead.mkdir()
    (dead / "__0_0123456789ab.s4w").write_bytes(b"partial")
    old = 1_000_000_000
    os.utime(dead / "__0_0123456789ab.s4w", (old, old))
    got = sweep.sweep(copy, older_than_s=3600)
    assert got.orphans == [f"steps/{500:012d}-deadbeef/__0_0123456789ab.s4w"]
    assert not (dead / "__0_0123456789ab.s4w").exists()
