"""One-process saves and loads do not import what only other paths need: importing
torch.distributed.checkpoint takes seconds, and numba is loaded only when a kernel runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                          "print('\\n'.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    return set(out.stdout.split())


def test_a_checkpoint_save_and_load_skip_the_distributed_modules(tmp_path: Path) -> None:
    modules = _modules_after(
        "import torch, s4weights\n"
        f"s4weights.save_checkpoint({{'w': torch.ones(8)}}, {str(tmp_path)!r}, 0)\n"
        f"s4weights.load_checkpoint({str(tmp_path)!r})\n"
        f"s4weights.list_checkpoints({str(tmp_path)!r})")
    assert "s4weights.checkpoints" in modules  # the code above ran the chain API
    assert not {m for m in modules if m.startswith(("torch.distributed.checkpoint",
                                                     "s4weights.dcp"))}


def test_inspecting_a_file_loads_no_numba(tmp_path: Path) -> None:
    path = tmp_path / "w.s4w"
    subprocess.run([sys.executable, "-c", "import torch, s4weights\n"
                    f"s4weights.save({{'w': torch.ones(8)}}, {str(path)!r})"],
                   cwd=ROOT, check=True, timeout=300)
    modules = _modules_after("import s4format\n"
                             f"with s4format.Reader({str(path)!r}) as r: r.tensors")
    assert "numba" not in modules


def test_the_first_kernel_does_not_import_scipy_linalg() -> None:
    # numba's array functions check for BLAS as they are imported, which imports
    # scipy.linalg (0.6-0.8 s) where SciPy is installed; s4format.jit holds it back
    pytest.importorskip("scipy")
    modules = _modules_after(
        "import numpy as np, s4format\n"
        "s4format.dumps({'w': np.random.default_rng(0).standard_normal(1 << 16)})")
    assert "numba.np.arraymath" in modules
    assert "scipy.linalg" not in modules
    # and SciPy's linear algebra still imports, and numba's still compiles, afterwards
    out = subprocess.run([sys.executable, "-c", (
        "import numpy as np, numba, s4format\n"
        "s4format.dumps({'w': np.ones(1 << 16)})\n"
        "import scipy.linalg\n"
        "f = numba.njit(lambda a: np.linalg.norm(a) + np.dot(a, a))\n"
        "print(f(np.ones(4)))")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["6.0"]
