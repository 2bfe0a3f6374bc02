"""The fuzzing target (fuzz/fuzz_reader.py) still runs: a short session over conformance
vectors, every input answered by an S4Error or read. Kept in the suite because the target
breaks silently when a module gains numba kernels (instrumenting one breaks its compilation)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

ROOT = Path(__file__).resolve().parents[2]


def test_the_reader_fuzz_target_runs_a_short_session(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for version in ("v1.3", "v1.4", "v1.5"):
        for f in sorted((ROOT / "conformance" / version).glob("*.s4w"))[:12]:
            shutil.copy(f, corpus / f"{version}-{f.name}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / "fuzz_reader.py"), str(corpus), "-runs=3000",
         "-seed=1", "-rss_limit_mb=2048", "-timeout=60", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Done 3000 runs" in out, out[-4000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
