"""The installed package carries every file the GPU path reads at run time: the CUDA sources
and the headers they include (``runtime._module`` compiles ``kernels/*.cu`` with ``-I`` on that
folder). A header left out of ``package-data`` makes every kernel fail to compile on a machine
that installed the wheel, while the source checkout works."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "s4weights" / "gpu" / "kernels"


def test_package_data_covers_every_kernel_file() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["*"]
    files = sorted(p.name for p in KERNELS.iterdir() if p.is_file())
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"not in package-data: {missing}"


def test_every_include_is_a_kernel_file() -> None:
    names = {p.name for p in KERNELS.iterdir()}
    for src in KERNELS.iterdir():
        for inc in re.findall(r'#include\s+"([^"]+)"', src.read_text()):
            assert inc in names, f"{src.name} includes {inc}, not in kernels/"
