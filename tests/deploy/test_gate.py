"""The image build's GPU gate fails where there is no GPU (the bit-exact runs themselves need
the build GPU: see deploy/README.md for the run on one), and its test switch is not shipped."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    torch = pytest.importorskip("torch")
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="an NVIDIA driver is here")
def test_gate_script_fails_without_gpu() -> None:
    p = subprocess.run(["bash", str(ROOT / "packer" / "gate.sh")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 3
    assert "gate: FAIL: no usable GPU: nvidia-smi not found" in p.stderr


def test_gate_module_fails_without_gpu(tmp_path: Path) -> None:
    if _cuda():
        pytest.skip("a GPU is here")
    report = tmp_path / "report.json"
    p = subprocess.run([sys.executable, str(ROOT / "packer" / "gate.py"), "--report",
                        str(report)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3
    assert "gate: FAIL: no usable GPU: torch sees no CUDA device" in p.stderr
    assert not report.exists()  # no verdict is written for a gate that could not run


def test_the_image_build_never_breaks_the_merge() -> None:
    build = "\n".join(p.read_text() for p in (ROOT / "packer").glob("*.pkr.hcl"))
    assert "packer/gate.sh" in build or "gate.sh" in build
    assert "--break-plane-merge" not in build
    shipped = "\n".join(p.read_text() for p in (ROOT / "packer" / "scripts").glob("*.sh"))
    assert "--break-plane-merge" not in shipped
