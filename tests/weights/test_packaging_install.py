"""What a user of an installed package meets: s4weights without torch names the install command,
s4format works without torch or any extra, both CLIs answer --version, the namespace holds only
what ``__all__`` lists, and the wheel carries the conformance vectors and the console scripts."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import s4weights
from s4format.cli import PACKAGED_SUITES

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("torch", "boto3", "tqdm", "safetensors", "cupy", "lightning", "transformers",
            "accelerate")


def _python(code: str, hide: tuple[str, ...] = ("torch",)) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing any of ``hide`` fails as it does
    when the package is not installed."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hide)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def _cli(module: str, *args: str) -> str:
    return (f"import runpy\nsys.argv = [{module!r}, *{list(args)!r}]\n"
            f"runpy.run_module({module!r}, run_name='__main__')\n")


def test_s4weights_without_torch_names_the_install_command() -> None:
    res = _python("import s4weights, s4weights.store\n"
                  "try:\n    s4weights.save\nexcept ModuleNotFoundError as e:\n"
                  "    print(e.name, e)\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("torch s4weights.save needs PyTorch, which is not installed "
                                 "here: pip install 's4weights[torch]'")
    res = _python(_cli("s4weights", "convert", "a.pt", "a.s4w"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: s4weights convert needs PyTorch") and \
        "pip install 's4weights[torch]'" in res.stderr
    res = _python(_cli("s4weights", "--version"))
    assert (res.returncode, res.stdout) == (0, "s4weights 0.1.0 (writes .s4w format 1.5)\n")


def test_s4format_needs_no_torch_and_no_extra() -> None:
    res = _python("import numpy as np, s4format\n"
                  "blob = s4format.dumps({'w': s4format.Tensor.from_numpy(np.arange(6.0))})\n"
                  "with s4format.Reader(blob) as r:\n"
                  "    print(r.read('w').to_numpy().tolist())\n"
                  + _cli("s4format", "--version"), hide=OPTIONAL)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]\ns4format 0.1.0 (.s4w format 1.5)\n"


def test_the_namespace_is_what_all_lists() -> None:
    import types

    public = {n for n, v in vars(s4weights).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public <= set(s4weights.__all__), public - set(s4weights.__all__)
    assert dir(s4weights) == sorted(s4weights.__all__)
    for name in s4weights.__all__:
        assert getattr(s4weights, name) is not None
    assert s4weights.open.__module__ == "s4weights.lazy"


def test_the_vectors_are_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["s4format"]
    for suite in PACKAGED_SUITES:
        assert suite.resolve() == (ROOT / "conformance" / suite.name).resolve()
        files = [f"vectors/{suite.name}/{p.name}" for p in suite.iterdir()]
        assert "vectors/v1/manifest.json" in files or suite.name != "v1"
        assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)


def test_the_console_scripts() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"s4format": "s4format.cli:main", "s4weights": "s4weights.cli:main"}


def test_the_wheel_carries_vectors_kernels_and_scripts(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    [wheel] = tmp_path.glob("s4weights-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for suite in ("v1", "v1.1", "v1.2", "v1.3", "v1.4", "v1.5"):
        want = {f"s4format/vectors/{suite}/{p.name}" for p in (ROOT / "conformance" / suite)
                .iterdir()}
        assert want <= names, sorted(want - names)[:5]
    assert "s4weights/gpu/kernels/common.cuh" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "s4weights = s4weights.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
