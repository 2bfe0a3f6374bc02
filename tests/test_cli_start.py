"""The CLIs start without numpy, torch or numba where a command needs none (issue targets: under
0.5 s to ``--help``): ``-X importtime`` lists every module a fresh interpreter imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numpy", "torch", "numba", "zstandard")


def _imported(*args: str) -> tuple[set[str], str]:
    run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                         text=True, timeout=120, check=True)
    names = {line.split("|")[-1].strip() for line in run.stderr.splitlines()
             if line.startswith("import time:")}
    return names, run.stdout


@pytest.mark.parametrize("package", ["s4format", "s4weights"])
def test_help_imports_nothing_heavy(package: str) -> None:
    names, out = _imported("-m", package, "--help")
    assert "usage:" in out
    assert f"{package}.cli" in names  # (the listing works: the CLI itself is in it)
    assert not [n for n in names if n.split(".")[0] in HEAVY]


def test_package_import_is_light_and_names_resolve_on_use() -> None:
    names, out = _imported("-c", "import s4format, sys; print('numpy' in sys.modules); "
                                 "print(s4format.Reader.__name__, s4format.verify.__name__, "
                                 "'numpy' in sys.modules)")
    assert out.split() == ["False", "Reader", "verify", "True"]
    assert "numpy" in names  # imported by the reader, once it was asked for
