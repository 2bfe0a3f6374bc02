"""The conformance runner: every vector of the suites (``conformance/v1/manifest.json``, format
1.0, and ``conformance/v1.1/manifest.json``, what 1.1 adds) against our reader in-process, or
against an external reader through the protocol of ``conformance/README.md``; ``--device cuda``
adds GPU round trips (the AMI-build gate).

Valid vectors must decode to the manifest's tensors (name, dtype, shape, SHA-256 of the raw
bytes) and object tree; must-fail vectors must be rejected with the manifest's error class
(``spec/validation.md``). Importable without torch; the GPU path is imported only for
``--device cuda`` and its absence is a failure, never a skip.
"""

from __future__ import annotations

import argparse
import decimal
import hashlib
import json
import math
import shlex
import struct
import subprocess
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s4format import errors
from s4format.errors import FormatError, S4Error, StorageError
from s4format.objtree import TensorRef, Typed
from s4format.reader import Reader
from s4format.verify import verify

DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "conformance" / "v1"
# What a reader of format 1.1 passes: format 1.0's frozen suite and the one 1.1 added.
DEFAULT_SUITES = (DEFAULT_SUITE, DEFAULT_SUITE.parent / "v1.1")
DEFAULT_TIMEOUT = 60.0
ERROR_CLASSES = frozenset(n for n in dir(errors) if n.endswith("Error"))


# -- the JSON form of object trees (conformance/README.md, "Object trees in JSON") -----------

def tree_to_json(obj: Any) -> Any:
    """A decoded object tree as tagged JSON: JSON's own types stand for themselves where they
    are exact (None, bool, str, list); everything else is a one-key object naming its tag."""
    t = type(obj)
    if obj is None or t is bool or t is str:
        return obj
    if t is int:
        # Decimal, not str(): str() refuses ints of more than 4300 digits (ValueError), which
        # are valid in a tree and must come out as "decimal string, any size".
        return {"int": str(decimal.Decimal(obj))}
    if t is float:
        return {"float": f"{struct.unpack('<Q', struct.pack('<d', obj))[0]:016x}"}
    if t is bytes:
        return {"bytes": obj.hex()}
    if t is list:
        return [tree_to_json(x) for x in obj]
    if t is tuple:
        return {"tuple": [tree_to_json(x) for x in obj]}
    if t is dict or t is OrderedDict:
        pairs = [[tree_to_json(k), tree_to_json(v)] for k, v in obj.items()]
        return {"dict" if t is dict else "odict": pairs}
    if t is TensorRef:
        return {"tensor": obj.index}
    if t is Typed:
        return {"typed": obj.name, "value": tree_to_json(obj.value)}
    raise TypeError(f"not an object-tree value: {t.__name__}")


# -- decoding a vector -----------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What a reader made of one vector: tensors (name -> (dtype, shape, sha256)) and the tree,
    or the error it rejected the file with (``error_class`` None when it did not say)."""
    ok: bool
    tensors: dict[str, tuple[str, list[int], str]] | None = None
    tree: Any = None
    error_class: str | None = None
    detail: str = ""
    crashed: bool = False


def decode_in_process(file: Path, parent: Path | None) -> Outcome:
    """Our reader, CPU path: open (with the parent), read every tensor, and run ``verify``."""
    try:
        par = Reader(file.parent / parent) if parent else None
        with Reader(file, parent=par) as r:
            tensors = {}
            for i, t in enumerate(r.tensors):
                raw = r.read_raw(i)
                tensors[t.name] = (t.dtype.name, list(t.shape), hashlib.sha256(raw).hexdigest())
            problems = verify(r)
            if problems:
                return Outcome(False, detail=f"decoded, but verify reports: {problems[0]}")
            return Outcome(True, tensors, tree_to_json(r.tree))
    except S4Error as exc:
        return Outcome(False, error_class=type(exc).__name__, detail=str(exc))
    except Exception as exc:
        return Outcome(False, detail=f"{type(exc).__name__}: {exc}", crashed=True)


def decode_external(cmd: str, file: Path, parent: Path | None, timeout: float) -> Outcome:
    """An external reader through the protocol: ``CMD decode FILE OUTDIR [--parent P]``."""
    with tempfile.TemporaryDirectory(prefix="s4conf-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        argv = [*shlex.split(cmd), "decode", str(file), str(out)]
        if parent:
            argv += ["--parent", str(file.parent / parent)]
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return Outcome(False, detail=f"timed out after {timeout:g} s", crashed=True)
        except OSError as exc:
            return Outcome(False, detail=f"cannot run reader: {exc}", crashed=True)
        stderr = proc.stderr.decode("utf-8", "replace").strip()
        if proc.returncode == 1:
            first = stderr.splitlines()[0] if stderr else ""
            name = first.split(":", 1)[0].strip()
            return Outcome(False, error_class=name if name in ERROR_CLASSES else None,
                           detail=first)
        if proc.returncode != 0:
            return Outcome(False, detail=f"exit status {proc.returncode}: {stderr[-300:]}",
                           crashed=True)
        try:
            index = json.loads((out / "index.json").read_text())
            tensors = {}
            for t in index["tensors"]:
                data = (out / t["file"]).read_bytes()
                tensors[t["name"]] = (t["dtype"], list(t["shape"]),
                                      hashlib.sha256(data).hexdigest())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return Outcome(False, detail=f"exit 0 but unusable index.json: {exc}", crashed=True)
        return Outcome(True, tensors, index.get("tree", _NOT_REPORTED))


_NOT_REPORTED = object()


# -- judging ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Result:
    id: str
    expect: str
    passed: bool
    got: str
    detail: str = ""


def judge(vector: dict[str, Any], got: Outcome, *, strict_class: bool) -> Result:
    vid, expect = vector["id"], vector["expect"]
    if got.crashed:
        return Result(vid, expect, False, "CRASH", got.detail)
    if expect == "valid":
        if not got.ok:
            return Result(vid, expect, False, f"rejected {got.error_class or '?'}", got.detail)
        want = {t["name"]: (t["dtype"], t["shape"], t["sha256"]) for t in vector["tensors"]}
        if got.tensors != want:
            return Result(vid, expect, False, "wrong tensors", _diff(want, got.tensors or {}))
        if got.tree is not _NOT_REPORTED and got.tree != vector["tree"]:
            return Result(vid, expect, False, "wrong tree",
                          f"got {json.dumps(got.tree)[:200]}")
        return Result(vid, expect, True, "valid")
    want_class = vector["error"]
    if got.ok:
        return Result(vid, f"error {want_class}", False, "accepted",
                      "the reader decoded a file it must reject")
    if got.error_class is None:
        if strict_class:
            return Result(vid, f"error {want_class}", False, "rejected ?", got.detail)
        return Result(vid, f"error {want_class}", True, "rejected", got.detail)
    if got.error_class != want_class:
        return Result(vid, f"error {want_class}", False, f"rejected {got.error_class}",
                      got.detail)
    return Result(vid, f"error {want_class}", True, f"rejected {got.error_class}")


def _diff(want: dict, got: dict) -> str:
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            return f"tensor {name!r}: expected {want.get(name)}, got {got.get(name)}"
    return ""


# -- running a suite --------------------------------------------------------------------------

def load_manifest(suite: Path) -> dict[str, Any]:
    path = suite / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError as exc:
        raise StorageError(f"conformance: cannot read {path}: {exc.strerror}; pass --suite "
                           "DIR (the folder holding manifest.json)") from None
    except ValueError as exc:
        raise FormatError(f"conformance: {path} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("vectors"), list):
        raise FormatError(f"conformance: {path} has no list of vectors")
    return manifest


def run_suite(suite: Path, reader: str | None = None,
              timeout: float = DEFAULT_TIMEOUT) -> list[Result]:
    manifest = load_manifest(suite)
    results = []
    for v in manifest["vectors"]:
        file, parent = suite / v["file"], v.get("parent")
        if reader is None:
            got = decode_in_process(file, Path(parent) if parent else None)
        else:
            got = decode_external(reader, file, Path(parent) if parent else None, timeout)
        results.append(judge(v, got, strict_class=reader is None))
    return results


def print_table(results: list[Result], title: str, out=sys.stdout) -> None:
    width = max([len(r.id) for r in results] + [6])
    out.write(f"{title}\n{'vector':<{width}}  {'expected':<30} {'got':<34} result\n")
    for r in results:
        out.write(f"{r.id:<{width}}  {r.expect:<30} {r.got:<34} "
                  f"{'pass' if r.passed else 'FAIL'}\n")
        if not r.passed and r.detail:
            out.write(f"{'':<{width}}    {r.detail[:300]}\n")
    failed = sum(not r.passed for r in results)
    out.write(f"{len(results) - failed}/{len(results)} passed, {failed} failed\n")


# -- the GPU gate -----------------------------------------------------------------------------

class GpuUnavailable(Exception):
    """The GPU path cannot run here; for the AMI gate this is a failure, never a skip."""


def run_gpu(suite: Path) -> list[Result]:
    """GPU decode of every valid vector's tensors, and GPU encode -> GPU and CPU decode round
    trips of the adversarial bit-pattern sets (the ``adversarial`` vectors)."""
    try:
        import torch

        import s4weights.gpu as gpu
        from s4weights.gpu import decode as gdecode
        from s4weights.gpu import encode as gencode
    except ImportError as exc:
        raise GpuUnavailable(f"the GPU path cannot be imported ({exc}); install s4weights with "
                             "its [gpu] extra (torch, CuPy, nvCOMP)") from None
    if not gpu.available():
        raise GpuUnavailable("s4weights.gpu.available() is False: torch sees no CUDA device or "
                             "CuPy is missing")
    manifest = load_manifest(suite)
    results = []
    for v in manifest["vectors"]:
        if v["expect"] != "valid":
            continue
        results.append(_gpu_check(f"gpu-decode {v['id']}", "valid",
                                  lambda v=v: _gpu_decode(suite, v, gdecode)))
        if "adversarial" in v.get("tags", []):
            results.append(_gpu_check(f"gpu-roundtrip {v['id']}", "bit-exact",
                                      lambda v=v: _gpu_roundtrip(suite, v, torch, gencode,
                                                                 gdecode)))
    return results


def _gpu_check(name: str, expect: str, fn) -> Result:
    try:
        problem = fn()
    except Exception as exc:
        return Result(name, expect, False, f"raised {type(exc).__name__}", str(exc))
    return Result(name, expect, problem is None, "ok" if problem is None else "mismatch",
                  problem or "")


def _gpu_decode(suite: Path, v: dict[str, Any], gdecode) -> str | None:
    want = {t["name"]: t["sha256"] for t in v["tensors"]}
    parent = Reader(suite / v["parent"]) if v.get("parent") else None
    with Reader(suite / v["file"], parent=parent) as r:
        for i, t in enumerate(r.tensors):
            raw = gdecode.read_tensor(r, i).cpu().numpy().tobytes()
            if hashlib.sha256(raw).hexdigest() != want[t.name]:
                return f"tensor {t.name!r} decoded on the GPU differs from the expected bytes"
    return None


def _gpu_roundtrip(suite: Path, v: dict[str, Any], torch, gencode, gdecode) -> str | None:
    import io

    from s4format.writer import Writer

    with Reader(suite / v["file"]) as r:
        tensors = [(t, r.read_raw(i)) for i, t in enumerate(r.tensors)]
    for mantissa in gencode.MANTISSA_MODES:
        items = [gencode.Item(t.dtype, t.shape, torch.from_numpy(raw.copy()).cuda())
                 for t, raw in tensors]
        buf = io.BytesIO()
        with Writer(buf) as w:
            for (t, _raw), coded in zip(tensors, gencode.Encoder(mantissa=mantissa).code(items)):
                w.add_coded(t.name, t.dtype, t.shape, coded.coded, coded.content_hash)
        blob = buf.getvalue()
        with Reader(blob) as back:
            if verify(back):
                return f"mantissa={mantissa}: the GPU-written file fails verify on the CPU"
            for i, (t, raw) in enumerate(tensors):
                on_gpu = gdecode.read_tensor(back, i).cpu().numpy()
                if not (math.prod(on_gpu.shape) == raw.size and (on_gpu == raw).all()):
                    return f"mantissa={mantissa}: tensor {t.name!r} differs after GPU decode"
                if not (back.read_raw(i) == raw).all():
                    return f"mantissa={mantissa}: tensor {t.name!r} differs after CPU decode"
    return None


# -- command line -----------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reader", metavar="CMD",
                   help="external reader command, run as 'CMD decode FILE OUTDIR [--parent P]' "
                        "(default: this package's reader, in-process)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: also decode every valid vector on the GPU and round-trip the "
                        "adversarial sets through the GPU encoder; fails if the GPU path "
                        "cannot run")
    p.add_argument("--suite", type=Path, action="append",
                   help="folder with manifest.json and the vectors; repeatable (default: "
                        f"{' and '.join(str(s) for s in DEFAULT_SUITES)})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds per vector for an external reader")


def main(args: argparse.Namespace) -> int:
    who = f"external reader {args.reader!r}" if args.reader else "s4format (CPU, in-process)"
    suites = args.suite or DEFAULT_SUITES
    failed = False
    for suite in suites:
        results = run_suite(suite, args.reader, args.timeout)
        print_table(results, f"conformance {suite} against {who}")
        failed = failed or any(not r.passed for r in results)
    if args.device == "cuda":
        try:
            gpu_results = [r for suite in suites for r in run_gpu(suite)]
        except GpuUnavailable as exc:
            print(f"\nFAIL: --device cuda requested but the GPU path cannot run: {exc}",
                  file=sys.stderr)
            return 1
        print()
        print_table(gpu_results, "GPU decode and round trips (s4weights.gpu)")
        failed = failed or any(not r.passed for r in gpu_results) or not gpu_results
    return 1 if failed else 0
