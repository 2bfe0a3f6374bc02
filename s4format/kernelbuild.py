"""Building the CPU kernels ahead of time (``python -m s4format kernels build``; see
:mod:`s4format.kernels`, which loads them).

What is built: every signature the kernels compile to while the build runs a workload of writes
and reads (:func:`exercise`: each dtype and policy, tensors in read-only memory, masked and
unmasked deltas, reads from bytes and from files, and the conformance vectors), compiled by
numba's ahead-of-time compiler into one extension module for this CPU. It is kept only if a
fresh process with it writes byte for byte the files numba's kernels write (:func:`samples`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from s4format import jit, kernels


def _type_key(t: Any) -> Any:
    """The table's name of the numba type ``t`` (None: a type that no argument key gives, not
    built): ["a", dtype, dimensions, flags] for an array, ["t", ...] for a tuple, the name of
    a scalar's type."""
    from numba.core import types
    from numba.np.numpy_support import as_dtype

    if isinstance(t, types.Array):
        return ["a", as_dtype(t.dtype).str, t.ndim, kernels.array_flags(t.layout, not t.mutable)] \
            if t.aligned else None
    if isinstance(t, types.BaseTuple):
        keys = [_type_key(e) for e in t.types]
        return None if None in keys else ["t", *keys]
    if isinstance(t, (types.Integer, types.Float, types.Boolean)) and \
            not isinstance(t, types.Literal):
        return str(t)
    return None


def _tensors(n: int, rng: np.random.Generator) -> dict[str, Any]:
    from s4format.tensor import Tensor

    f32 = (rng.standard_normal(n) * 0.02).astype("<f4")
    return {"f32": f32, "f16": f32.astype("<f2"), "f64": f32.astype("<f8"),
            "bf16": Tensor.from_numpy((f32.view("<u4") >> 16).astype("<u2"), "bfloat16"),
            "i64": rng.integers(-1000, 1000, n).astype("<i8"),
            "u8": rng.integers(0, 256, n, dtype=np.uint8)}


def _read_only(a: Any) -> Any:
    from s4format.tensor import Tensor

    if isinstance(a, Tensor):
        return Tensor(a.dtype, a.shape, np.frombuffer(a.data.tobytes(), np.uint8))
    return np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape)


def _changed(a: Any, rng: np.random.Generator, share: float) -> Any:
    """``a`` with about ``share`` of its elements' low bits changed, as a training step does."""
    from s4format.tensor import Tensor

    t = a if isinstance(a, Tensor) else Tensor.from_numpy(a)
    words = t.data.view(f"<u{t.dtype.itemsize}").copy()  # (every dtype of _tensors)
    hit = rng.random(words.size) < share
    words[hit] ^= np.asarray(rng.integers(1, 8, int(hit.sum())), words.dtype)
    return Tensor(t.dtype, t.shape, words.view(np.uint8))


# The shares of words a delta changes in the exercise and the samples: masked, masked, not.
_SHARES = (0.01, 0.6, 0.9)


def _written(tensors: dict[str, Any], policy: str = "auto", parent: Any = None,
             parents: dict[str, Any] | None = None) -> bytes:
    """A file of ``tensors``, as deltas of ``parents`` (the tensors of ``parent``'s file)."""
    from s4format.writer import Writer

    buf = io.BytesIO()
    with Writer(buf, policy=policy, parent_id=parent and parent.checkpoint_id) as w:
        for name, a in tensors.items():
            w.add(name, a, parent=parents[name] if parents else None)
    return buf.getvalue()


def _read_all(source: Any, parent: Any = None) -> None:
    """Every tensor of the file ``source`` decoded, and its content hash checked."""
    from s4format.reader import Reader

    with Reader(source) as r:
        if parent is not None and r.parent_id is not None:  # (no tensor may have paid as one)
            r.attach_parent(parent)
        for i in range(len(r.tensors)):
            r.read(i)


def exercise(sizes: tuple[int, ...] = (300, 20_000, 100_000, 600_000, 3_000_000)) -> None:
    """Writes and reads that reach every kernel with the argument types the library gives it:
    each dtype, every policy, masked and unmasked deltas, reads from bytes and from a file,
    and the conformance vectors. The sizes reach each way a plane is counted (100,000 words:
    one piece through the 16-bit window, whose other fields are summed from its histogram).
    (s4weights gives the kernels the same types from torch's tensors:
    tests/format/test_kernels_built.py checks that its save, load and chains run no kernel
    that was not built.)"""
    from s4format import policy
    from s4format.reader import Reader

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        for n in sizes:
            base = _tensors(n, rng)
            for pol in policy.POLICIES:
                blob = _written(base, pol)
                _written({k: _read_only(a) for k, a in base.items()}, pol)  # read-only memory
                path = Path(folder) / "base.s4w"
                path.write_bytes(blob)
                for source in (blob, path, bytearray(blob)):
                    _read_all(source)
            for share in _SHARES:
                child = {k: _changed(a, rng, share) for k, a in base.items()}
                with Reader(blob) as parent:
                    _read_all(_written(child, parent=parent, parents=base), parent)
    _exercise_conformance()


def samples() -> list[bytes]:
    """Files written from seeded data (every policy and dtype; masked and unmasked deltas),
    each read back whole, every content hash checked: the same bytes whichever kernels coded
    them, which :func:`build` checks of the kernels it built on this CPU."""
    from s4format import policy
    from s4format.reader import Reader

    rng = np.random.default_rng(1)
    files: list[bytes] = []
    for n in (20_000, 100_000, 600_000):
        base = _tensors(n, rng)
        for pol in policy.POLICIES:
            files.append(_written(base, pol))
            _read_all(files[-1])
        whole = files[-1]
        for share in _SHARES:
            child = {k: _changed(a, rng, share) for k, a in base.items()}
            with Reader(whole) as parent:
                files.append(_written(child, parent=parent, parents=base))
                _read_all(files[-1], parent)
    return files


_CHECK = """
import hashlib, json, sys
from s4format import jit, kernelbuild
digests = [hashlib.sha256(f).hexdigest() for f in kernelbuild.samples()]
print(json.dumps({"built": len(jit._built or {}), "digests": digests}))
"""


def _check(folder: Path) -> None:
    """Refuse the kernels in ``folder`` unless a fresh process with them writes the bytes that
    numba's kernels write here, and reads them back."""
    want = [hashlib.sha256(f).hexdigest() for f in samples()]
    env = {k: v for k, v in os.environ.items() if k != "S4_KERNELS"}
    out = subprocess.run([sys.executable, "-c", _CHECK], env={**env, "S4_KERNEL_DIR": str(folder)},
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the built kernels failed their check: {out.stderr.strip()[-2000:]}")
    got = json.loads(out.stdout.splitlines()[-1])
    if not got["built"]:
        raise RuntimeError("the built kernels did not load in a fresh process")
    if got["digests"] != want:
        raise RuntimeError("the built kernels wrote other bytes than numba's kernels: not kept")


def _exercise_conformance() -> None:
    from s4format import conformance

    for manifest in sorted((Path(kernels.__file__).parent / "vectors").glob("*/manifest.json")):
        conformance.run_suite(manifest.parent)


@contextlib.contextmanager
def _compiled_as_exports():
    """numba's ahead-of-time compiler, as :func:`build` needs it. Its ``CC`` compiles every
    export with one set of compile flags, which a compile changes: in a module of several
    exports, later ones were mistyped (numba 0.68). And its wrappers hold the GIL while a
    kernel runs unless the flags say otherwise, which ``CC`` does not let a caller set: the
    CPU path runs kernels on several threads at once. Each export gets its own flags here."""
    from numba.pycc import compiler

    original = compiler.compile_extra

    def compile_extra(typingctx, targetctx, func, args, return_type, flags, *rest, **kwargs):
        flags = flags.copy()
        flags.release_gil = True
        return original(typingctx, targetctx, func, args, return_type, flags, *rest, **kwargs)

    compiler.compile_extra = compile_extra
    try:
        yield
    finally:
        compiler.compile_extra = original


def build(folder: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Compile every kernel, for each argument types :func:`exercise` calls it with, into an
    extension module in ``folder`` (default :func:`root`) / :func:`identity`; returns that
    folder. Needs numba and a C compiler; takes a minute or two."""
    for name in kernels.KERNEL_MODULES:
        importlib.import_module(name)
    jit.compile_all()
    started = time.perf_counter()
    exercise()
    log(f"workload run in {time.perf_counter() - started:.1f} s")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from numba.pycc import CC
    ident = kernels.identity()
    final = (folder or kernels.root()) / ident
    final.parent.mkdir(parents=True, exist_ok=True)
    entries: list[tuple[str, Callable[..., Any], Any, Any]] = []
    for module, name, func, _options in jit._kernels:
        dispatcher = module[name]
        for sig in getattr(dispatcher, "signatures", ()):
            key = [_type_key(t) for t in sig]
            if None not in key:
                entries.append((jit._qualname(module, name), func, key,
                                dispatcher.overloads[sig].signature))
    staging = Path(tempfile.mkdtemp(prefix=f".{ident}-", dir=final.parent))
    try:
        table: dict[str, Any] = {"identity": ident, "module": f"_s4k_{ident[:12]}",
                                 "kernels": {}}
        cc = CC(table["module"])
        cc.output_dir = str(staging)
        cc.target_cpu = "host" if kernels.host_specific() else ""
        for i, (qualname, func, key, signature) in enumerate(entries):
            symbol = f"k{i}_{func.__name__}"
            cc.export(symbol, signature)(func)
            table["kernels"].setdefault(qualname, []).append([key, symbol])
        started = time.perf_counter()
        with _compiled_as_exports():
            cc.compile()
        log(f"{len(entries)} kernel signatures compiled in {time.perf_counter() - started:.1f} s")
        (staging / kernels.TABLE).write_text(json.dumps(table, indent=1), encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(staging, final)
        except OSError:
            if not kernels.load(folder):  # (unless a build of the same finished first)
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    started = time.perf_counter()
    try:
        _check(final.parent)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    log(f"checked: the same bytes as numba's kernels, in {time.perf_counter() - started:.1f} s")
    return final
