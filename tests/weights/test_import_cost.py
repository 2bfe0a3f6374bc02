"""One-process saves and loads do not import what only other paths need: importing
torch.distributed.checkpoint takes seconds, and numba is loaded only when a kernel runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
