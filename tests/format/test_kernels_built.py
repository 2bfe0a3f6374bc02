"""The CPU kernels built ahead of time (s4format.kernels): a fresh process with them saves and
loads without numba, bit for bit as numba's kernels do; a call with argument types they were
not built for runs numba's; the built code releases the GIL; a stale or broken build is not
used. The build (``python -m s4format kernels build``) takes about a minute on two cores."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from s4format import jit, kernelbuild, kernels

ROOT = Path(__file__).resolve().parents[2]


def _env(folder: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("S4_KERNELS", "S4_KERNEL_DIR")}
    if folder is None:
        env["S4_KERNELS"] = "jit"
    else:
        env["S4_KERNEL_DIR"] = str(folder)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("kernels")
    out = subprocess.run([sys.executable, "-m", "s4format", "kernels", "build", "--json"],
                         cwd=ROOT, env=_env(folder), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout)
    assert state["built"] and state["signatures"] >= state["kernels"] > 10, state
    return folder


def test_every_module_with_kernels_is_listed() -> None:
    for name in kernels.KERNEL_MODULES:
        importlib.import_module(name)
    marked = {module["__name__"] for module, *_ in jit._kernels}
    assert marked == set(kernels.KERNEL_MODULES)
    package = Path(kernels.__file__).parent
    with_kernels = {str(p.relative_to(package)) for p in package.rglob("*.py")
                    if re.search(r"^@kernel\(", p.read_text(encoding="utf-8"), re.M)}
    assert with_kernels <= set(kernels._SOURCES)  # a change to any of them changes identity()


def _values() -> list[object]:
    a = np.arange(24, dtype=np.uint16)
    unaligned = np.frombuffer(bytes(9), np.uint8)[1:].view(np.uint16)
    read_only = np.frombuffer(bytes(16), np.uint32)
    return [a, a.reshape(4, 6), a.reshape(4, 6).T, a[::2], a.reshape(4, 6)[:, 1:],
            np.zeros(0, np.int64), np.zeros((1, 5), np.float32), np.array(3.0),
            unaligned, read_only, a.astype(">u2"), np.zeros(3, bool),
            0, -5, 2**62, 2**63, 2**64 - 1, True, 1.5, np.uint8(3), np.float32(2),
            np.bool_(True), np.int64(-1), np.uint64(2**64 - 1),
            (a, a), (a, read_only), (1, 2), (np.uint8(1), np.uint8(2)), (a, 3)]


def test_argument_keys_are_the_keys_of_numba_types() -> None:
    # The built code checks no types: a key that matched a type numba gives another value
    # would run it on the wrong data. Every key must be the one of numba's own type.
    numba = pytest.importorskip("numba")
    for v in _values():
        got = jit.arguments_key((v,))[0]
        try:
            t = numba.typeof(v)
        except Exception:  # a value numba does not type (a non-native byte order)
            assert got is None or got[0].isnative is False, v
            continue
        want = kernelbuild._type_key(t)
        if got is None or want is None:
            assert got is None and (want is None or isinstance(v, int)), (v, got, want)
            continue
        assert got == kernels._runtime_item(want), (v, t)


def test_every_array_flag_pattern_has_its_name() -> None:
    for c, f, aligned, writeable in np.ndindex(2, 2, 2, 2):
        bits = c * 0x1 | f * 0x2 | aligned * 0x100 | writeable * 0x400
        name = jit._FLAGS[bits & jit._FLAG_BITS]
        assert name == ("C" if c else "F" if f else "A") + ("" if writeable else "r")


_SAVE_AND_LOAD = r"""
import io, json, sys, tempfile
import numpy as np, torch, s4weights
from s4format import jit
g = torch.Generator().manual_seed(1)
state = {f"{dt}.{n}": (torch.randn(n, generator=g) * 0.02).to(dt)
         for dt in (torch.float32, torch.bfloat16, torch.float16) for n in (10, 50_000, 400_000)}
state["ids"] = torch.arange(1000)
state["mask"] = torch.rand(999, generator=g) > 0.5
buf = io.BytesIO()
s4weights.save(state, buf)
back = s4weights.load(buf.getvalue())
ok = all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
run = tempfile.mkdtemp()
steps = []
for step in range(4):
    steps.append({k: v.clone() for k, v in state.items()})
    s4weights.save_checkpoint(state, run, step, read_budget=None, delta_against="latest")
    for k, v in state.items():
        if v.is_floating_point():  # a few elements change (masked deltas), or all of them
            flat = v.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // (50 if step % 2 else 1)),),
                                generator=g)
            flat[idx] += 1e-3
for step, want in enumerate(steps):
    got = s4weights.load_checkpoint(run, step=step)
    ok = ok and all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
                    for k, v in want.items())
with open(sys.argv[1], "wb") as f:
    f.write(buf.getvalue())
print(json.dumps({"ok": ok, "numba": "numba" in sys.modules, "built": len(jit._built or {}),
                  "fallbacks": sorted(jit.fallbacks),
                  "deltas": [i.depth for i in s4weights.list_checkpoints(run)]}))
"""


def test_a_fresh_process_saves_and_loads_without_numba(built: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _SAVE_AND_LOAD, str(tmp_path / "w.s4w")],
                         cwd=ROOT, env=_env(built), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["ok"] and got["built"] > 0
    assert got["fallbacks"] == [] and not got["numba"]
    assert max(got["deltas"]) >= 2  # the chain's deltas were written and read by them
    # and what they wrote reads back, every checksum and hash checked, with numba's kernels
    check = subprocess.run([sys.executable, "-m", "s4format", "verify", str(tmp_path / "w.s4w")],
                           cwd=ROOT, env=_env(None), capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stderr


_CONFORMANCE = r"""
import contextlib, io, json, sys
from s4format import cli, jit
with contextlib.redirect_stdout(io.StringIO()):
    rc = cli.main(["conformance"])
print(json.dumps({"rc": rc, "numba": "numba" in sys.modules, "fallbacks": sorted(jit.fallbacks)}))
"""


def test_the_conformance_vectors_decode_with_them(built: Path) -> None:
    # every codec, layout, masked and segmented plane of the suites, each tensor checked
    # against the digest its vector states
    out = subprocess.run([sys.executable, "-c", _CONFORMANCE], cwd=ROOT, env=_env(built),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"rc": 0, "numba": False,
                                                        "fallbacks": []}


_FALLBACK = r"""
import json, sys
import numpy as np
from s4format.codecs import view
from s4format import jit
rng = np.random.default_rng(3)
words = rng.integers(0, 2**16, 20_001, dtype=np.uint16)
def counts(w):
    c = np.zeros((2, 4, 256), np.int64)
    view._count_fields(w, 0, w.size, np.array([0, 8], np.int64), np.array([255, 255], np.int64),
                       c, np.zeros(2, np.int64))
    return c
plain = counts(words[::2].copy())
built_only = "numba" not in sys.modules
strided = counts(words[::2])  # a layout no kernel was built for
print(json.dumps({"same": bool((plain == strided).all()), "built_only": built_only,
                  "numba": "numba" in sys.modules, "fallbacks": sorted(jit.fallbacks)}))
"""


def test_argument_types_not_built_run_numbas_kernel(built: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _FALLBACK], cwd=ROOT, env=_env(built),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"same": True, "built_only": True, "numba": True,
                   "fallbacks": ["s4format.codecs.view._count_fields"]}


def test_built_kernels_release_the_gil(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S4_KERNEL_DIR", str(built))
    by_key = kernels.load()["s4format.codecs.view._count_fields"]
    words = np.random.default_rng(0).integers(0, 2**32, 30_000_000, dtype=np.uint32)
    args = (words, 0, words.size, np.array([0, 8, 16, 24], np.int64),
            np.full(4, 255, np.int64), np.zeros((4, 4, 256), np.int64), np.zeros(4, np.int64))
    count = by_key[jit.arguments_key(args)]
    done = threading.Event()
    spins = 0

    def run() -> None:
        count(*args)
        done.set()

    worker = threading.Thread(target=run)
    started = time.perf_counter()
    worker.start()
    while not done.is_set():
        spins += 1
    worker.join()
    # this thread kept running Python while the kernel counted 120 MB on the other
    assert spins > 1000, (spins, time.perf_counter() - started)
    assert args[5].sum() == 4 * words.size


def test_a_stale_or_broken_build_is_not_used(built: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ident = kernels.identity()
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    monkeypatch.setenv("S4_KERNEL_DIR", str(copy))
    assert kernels.load()
    table = copy / ident / kernels.TABLE
    original = table.read_text()
    table.write_text(original.replace(ident, "0" * len(ident)))  # built from other sources
    assert kernels.load() == {}
    table.write_text(original[:len(original) // 2])  # a torn write
    assert kernels.load() == {}
    table.write_text(original)
    broken = tmp_path / "broken"  # (a copy not loaded yet: Python keeps a loaded library)
    shutil.copytree(built, broken)
    monkeypatch.setenv("S4_KERNEL_DIR", str(broken))
    for lib in (broken / ident).iterdir():
        if lib.name != kernels.TABLE:
            lib.write_bytes(b"not a library")
    assert kernels.load() == {}
    monkeypatch.setattr(kernels, "_cpu", lambda: "another CPU")
    assert kernels.identity() != ident


def test_a_build_that_writes_other_bytes_is_refused(built: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # the build's own check: a fresh process with the kernels must write what numba's write
    monkeypatch.setattr(kernelbuild, "samples", lambda: [b"what numba's kernels wrote"])
    with pytest.raises(RuntimeError, match="other bytes than numba's"):
        kernelbuild._check(built)


def test_the_cli_says_whether_kernels_are_built(built: Path, tmp_path: Path) -> None:
    for folder, want in ((built, True), (tmp_path, False)):
        out = subprocess.run([sys.executable, "-m", "s4format", "kernels"], cwd=ROOT,
                             env=_env(folder), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("not built") != want, out.stdout
        assert str(folder) in out.stdout
