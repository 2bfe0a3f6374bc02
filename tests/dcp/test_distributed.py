"""Sharded checkpoints across process groups (gloo, CPU): FSDP2 and DTensor states saved by 4
ranks load bit-exactly on 4, 2 and 1 (``no_dist``) ranks and as other placements, saved
asynchronously in thread and process mode, in a local directory and on S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import (  # noqa: E402
    _load_state_dict_from_keys,
)

from s4weights.dcp import S4StorageReader  # noqa: E402
from s4weights.dcp.checkpoint import METADATA, RANK_FILE  # noqa: E402
from tests.dcp.conftest import new_bucket, weed_available  # noqa: E402
from tests.dcp.states import NO_DIST, assert_same, leaves  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or os.name != "posix",
                                reason="needs torch.distributed and fork")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    """Run the 4-rank job, then the 2-rank job; each asserts its loads itself."""
    work = tmp_path_factory.mktemp("dcp-dist")
    roots, env = [str(work / "local")], {}
    if weed_available():
        server = request.getfixturevalue("s3_server")
        env = request.getfixturevalue("s3_env")
        roots.append(f"s3://{new_bucket(server)}/run")
    ref, report = str(work / "ref.pt"), str(work / "report.json")
    for job, ranks in (("world4", 4), ("world2", 2)):
        args = json.dumps([str(work / f"pg{ranks}"), ref, roots, report])
        proc = subprocess.run([sys.executable, "-m", "tests.dcp.launch", job, str(ranks), args],
                              cwd=REPO, env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {"roots": roots, "ref": ref, "cases": json.loads(Path(report).read_text()),
            "env": env}


def test_every_distributed_case_ran(runs: dict) -> None:
    want = ["Shard(0) -> Shard(1)", "Shard(0) -> Replicate", "async_save thread"]
    for root in runs["roots"]:
        want += [f"fsdp2 4->4 {root}", f"fsdp2 4->2 {root}"]
    if hasattr(getattr(dcp, "AsyncCheckpointerType", None), "PROCESS"):
        want.append("async_save process")
    assert sorted(runs["cases"]) == sorted(want)


def test_s3_cases_ran(runs: dict, s3_server) -> None:
    assert any(r.startswith("s3://") for r in runs["roots"])


def test_each_rank_wrote_one_file(runs: dict) -> None:
    root = Path(runs["roots"][0])
    for name, ranks in (("fsdp4", 4), ("fsdp2", 2), ("dtensor4", 4)):
        files = sorted(os.listdir(root / name))
        assert files[0] == METADATA
        assert [RANK_FILE.fullmatch(f).group(1) for f in files[1:]] == \
            [str(r) for r in range(ranks)], files


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_ranks_to_one_without_dist(runs: dict, where: str, monkeypatch) -> None:
    """2 -> 1: the 2-rank checkpoint loads whole in one process, through the path
    format_utils.dcp_to_torch_save takes and through dcp.load into plain tensors."""
    roots = [r for r in runs["roots"] if r.startswith("s3://") == (where == "s3")]
    if not roots:
        pytest.skip("no S3 server")
    for k, v in runs["env"].items():
        monkeypatch.setenv(k, v)
    url = f"{roots[0]}/fsdp2"
    ref = torch.load(runs["ref"])
    whole = _load_state_dict_from_keys(storage_reader=S4StorageReader(url))
    assert whole.pop("step") == 1
    assert_same(whole, ref)
    dest = {"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()}}
    dcp.load(dest, storage_reader=S4StorageReader(url), **NO_DIST)
    assert_same(dest, {"model": ref["model"]})
    assert all(v.abs().sum() > 0 for v in leaves(dest).values())
