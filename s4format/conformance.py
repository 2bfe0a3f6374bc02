"""The conformance runner: every vector of the suites (``conformance/v1``, format 1.0, and
``v1.1`` to ``v1.5``, what each later minor adds) against our reader in-process, or against an
external reader through the protocol of ``spec/conformance.md``; ``--device cuda`` adds GPU
round trips (the AMI-build gate).

A valid vector passes when it decodes to the manifest's tensors (in index order: name, dtype,
shape, SHA-256 of the raw bytes) and object tree; a must-fail vector passes only when rejected
with the manifest's error class, one of the names of ``spec/validation.md`` (or a reader's own
name that ``--error-map`` maps to it). A reader's ``UnsupportedCodecError`` for a vector that
uses an optional codec is a skip, unless ``--require`` names that codec or the vector's
``without`` says a reader lacking it owes another class. Importable without torch; the GPU
path is imported only for ``--device cuda`` and its absence is a failure.
"""

from __future__ import annotations

import argparse
import decimal
import hashlib
import json
import math
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from s4format.errors import FormatError, S4Error, StorageError
from s4format.objtree import TensorRef, Typed

DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "conformance" / "v1"
# What a reader of format 1.5 passes: format 1.0's frozen suite and those each minor added.
DEFAULT_SUITES = (DEFAULT_SUITE, *(DEFAULT_SUITE.parent / v
                                  for v in ("v1.1", "v1.2", "v1.3", "v1.4", "v1.5")))
DEFAULT_TIMEOUT = 60.0
# The error classes of spec/validation.md's table, the only names a rejection may give; the
# library may have more (for its torch layer), which no reader of files raises.
SPEC_ERROR_CLASSES = frozenset((
    "S4Error", "FormatError", "BadMagicError", "TruncatedError", "LimitError", "CodecError",
    "ChecksumError", "ContentHashError", "UnsupportedError", "UnsupportedVersionError",
    "UnsupportedFeatureError", "UnsupportedCodecError", "UnsupportedObjectError",
    "ParentMismatchError", "StorageError"))
# Codecs a reader may lack (spec/conformance.md): their bitstreams are specified outside spec/.
OPTIONAL_CODECS = ("gdeflate", "nvcomp-ans")
_UNSUPPORTED_CODEC = "UnsupportedCodecError"
_TRACEBACK = "Traceback (most recent call last):"
_CLASS_NAME = re.compile(r"([A-Za-z_][\w.]*)(?=$|[:\s])")


# -- the JSON form of object trees (spec/conformance.md, "Object trees in JSON") -------------

def tree_to_json(obj: Any) -> Any:
    """A decoded object tree as tagged JSON: JSON's own types stand for themselves where they
    are exact (None, bool, str, list); everything else is an object naming its tag."""
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

TensorDigest = tuple[str, str, list[int], str]  # name, dtype, shape, sha256 of the raw bytes


@dataclass(frozen=True)
class Outcome:
    """What a reader made of one vector: its tensors in index order and the tree, or the spec
    error class it rejected the file with, or ``problem``: how it broke the protocol (a crash,
    a traceback, a first line naming no spec class)."""
    ok: bool
    tensors: list[TensorDigest] | None = None
    tree: Any = None
    error_class: str | None = None
    detail: str = ""
    problem: str | None = None


_NOT_REPORTED = object()


def decode_in_process(file: Path, parent: Path | None) -> Outcome:
    """Our reader, CPU path: open (then the parent), read every tensor, and run ``verify``."""
    from s4format.reader import Reader
    from s4format.verify import verify

    try:
        with Reader(file, parent=file.parent / parent if parent else None) as r:
            tensors = []
            for i, t in enumerate(r.tensors):
                raw = r.read_raw(i)
                tensors.append((t.name, t.dtype.name, list(t.shape),
                                hashlib.sha256(raw).hexdigest()))
            problems = verify(r)
            if problems:
                return Outcome(False, detail=f"decoded, but verify reports: {problems[0]}",
                               problem="verify failed")
            return Outcome(True, tensors, tree_to_json(r.tree))
    except S4Error as exc:
        return Outcome(False, error_class=type(exc).__name__, detail=str(exc))
    except Exception as exc:
        return Outcome(False, detail=f"{type(exc).__name__}: {exc}", problem="crash")


@dataclass(frozen=True)
class ExternalReader:
    """A reader run as ``COMMAND decode FILE OUTDIR [--parent P]`` (spec/conformance.md), with
    the map from its own error names to the spec's."""
    command: str
    timeout: float = DEFAULT_TIMEOUT
    error_map: Mapping[str, str] = field(default_factory=dict)

    def decode(self, file: Path, parent: Path | None) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="s4conf-") as tmp:
            out = Path(tmp) / "out"
            out.mkdir()
            argv = [*shlex.split(self.command), "decode", str(file), str(out)]
            if parent:
                argv += ["--parent", str(file.parent / parent)]
            try:
                status, stderr = self._run(argv)
            except subprocess.TimeoutExpired:
                return Outcome(False, detail=f"timed out after {self.timeout:g} s",
                               problem="crash")
            except OSError as exc:
                return Outcome(False, detail=f"cannot run reader: {exc}", problem="crash")
            if status == 0:
                return _decoded(out)
            if status == 1:
                return self._rejection(stderr)
            return Outcome(False, detail=f"{_exit_status(status)}: {stderr.strip()[-300:]}",
                           problem="crash")

    def _run(self, argv: list[str]) -> tuple[int, str]:
        """Exit status and stderr; past the timeout the reader's whole process group is killed,
        so that a reader started through a shell cannot keep the pipe open."""
        with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True) as proc:
            try:
                _, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise
        return proc.returncode, err.decode("utf-8", "replace")

    def _rejection(self, stderr: str) -> Outcome:
        """Exit status 1: the first line of stderr must start with a spec error class, or a
        name the error map maps to one; a Python traceback is a crash, not a rejection."""
        first = stderr.splitlines()[0].strip() if stderr else ""
        if not first:
            return Outcome(False, detail="exit status 1 and the first line of stderr is empty",
                           problem="no error class")
        if first.startswith(_TRACEBACK):
            return Outcome(False, detail=stderr.strip().splitlines()[-1][:300],
                           problem="traceback")
        match = _CLASS_NAME.match(first)
        name = self.error_map.get(match[1], match[1]) if match else None
        if name not in SPEC_ERROR_CLASSES:
            return Outcome(False, detail=f"first line of stderr: {first[:200]!r} starts with no "
                                         "error class of spec/validation.md (map the reader's "
                                         "own names with --error-map)",
                           problem="unknown class")
        return Outcome(False, error_class=name, detail=first)


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _decoded(out: Path) -> Outcome:
    """Exit status 0: ``OUTDIR/index.json`` and the tensor files it names."""
    try:
        index = json.loads((out / "index.json").read_text(encoding="utf-8"))
        tensors = [_tensor_digest(out, t) for t in index["tensors"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Outcome(False, detail=f"exit 0 but unusable index.json: {exc}", problem="crash")
    return Outcome(True, tensors, index.get("tree", _NOT_REPORTED))


def _tensor_digest(out: Path, entry: dict[str, Any]) -> TensorDigest:
    name, dtype, shape, file = entry["name"], entry["dtype"], entry["shape"], entry["file"]
    if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(file, str)
            and isinstance(shape, list) and all(type(d) is int for d in shape)):
        raise TypeError(f"tensor entry {entry!r} has a field of the wrong type")
    path = (out / file).resolve()
    if path.parent != out.resolve():
        raise ValueError(f"tensor file {file!r} is not a file name inside OUTDIR")
    return name, dtype, shape, hashlib.sha256(path.read_bytes()).hexdigest()


def load_error_map(path: Path) -> dict[str, str]:
    """A reader's ``{"its name": "SpecClass", ...}`` JSON file, every value checked."""
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise StorageError(f"conformance: cannot read the error map {path}: "
                           f"{exc.strerror}") from None
    except ValueError as exc:
        raise FormatError(f"conformance: the error map {path} is not JSON: {exc}") from None
    if not isinstance(mapping, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise FormatError(f"conformance: the error map {path} must be a JSON object of "
                          "strings, the reader's names to spec/validation.md's")
    unknown = sorted({v for v in mapping.values() if v not in SPEC_ERROR_CLASSES})
    if unknown:
        raise FormatError(f"conformance: the error map {path} maps to {', '.join(unknown)}, "
                          "which spec/validation.md does not name; use one of "
                          f"{', '.join(sorted(SPEC_ERROR_CLASSES))}")
    return mapping


# -- judging ----------------------------------------------------------------------------------

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(frozen=True)
class Result:
    id: str
    expect: str
    status: str
    got: str
    detail: str = ""
    codec: str | None = None  # the optional codec a skip is for

    @property
    def passed(self) -> bool:
        return self.status == PASS


def judge(vector: dict[str, Any], got: Outcome, require: Iterable[str] = ()) -> Result:
    vid = vector["id"]
    expect = "valid" if vector["expect"] == "valid" else f"error {vector['error']}"
    if got.problem:
        return Result(vid, expect, FAIL, got.problem, got.detail)
    if got.error_class == _UNSUPPORTED_CODEC and expect != f"error {_UNSUPPORTED_CODEC}":
        optional = [c for c in OPTIONAL_CODECS if c in vector.get("codecs", ())]
        lacking = [c for c in optional if c not in require]
        # the manifest's "without" says what a reader lacking the codec owes (spec/conformance.md)
        owed = vector.get("without", {}).get(lacking[0], _UNSUPPORTED_CODEC) if lacking else None
        if owed == _UNSUPPORTED_CODEC:
            return Result(vid, expect, SKIP, f"rejected {_UNSUPPORTED_CODEC}",
                          f"uses {lacking[0]}, an optional codec the reader lacks", lacking[0])
        if owed:
            return Result(vid, expect, FAIL, f"rejected {_UNSUPPORTED_CODEC}",
                          f"a reader without {lacking[0]} still owes {owed}: the file breaks a "
                          f"rule checked before P3 reaches its {lacking[0]} plane")
        if optional:
            return Result(vid, expect, FAIL, f"rejected {_UNSUPPORTED_CODEC}",
                          f"uses {optional[0]}, which --require {optional[0]} asks the reader "
                          "to decode")
    if vector["expect"] == "valid":
        return _judge_valid(vid, vector, got)
    if got.ok:
        return Result(vid, expect, FAIL, "accepted", "the reader decoded a file it must reject")
    status = PASS if got.error_class == vector["error"] else FAIL
    return Result(vid, expect, status, f"rejected {got.error_class}",
                  "" if status == PASS else got.detail)


def _judge_valid(vid: str, vector: dict[str, Any], got: Outcome) -> Result:
    if not got.ok:
        return Result(vid, "valid", FAIL, f"rejected {got.error_class}", got.detail)
    want = [(t["name"], t["dtype"], t["shape"], t["sha256"]) for t in vector["tensors"]]
    if got.tensors != want:
        return Result(vid, "valid", FAIL, "wrong tensors", _tensor_diff(want, got.tensors or []))
    if got.tree is not _NOT_REPORTED and got.tree != vector["tree"]:
        return Result(vid, "valid", FAIL, "wrong tree", _tree_diff(vector["tree"], got.tree))
    return Result(vid, "valid", PASS, "valid")


def _tensor_diff(want: list[TensorDigest], got: list[TensorDigest]) -> str:
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            return f"tensor {i}: expected {w}, got {g}"
    return f"expected {len(want)} tensors, got {len(got)}"


def _tree_diff(want: Any, got: Any, path: str = "tree") -> str:
    """Where two JSON trees first differ, as a path a reader's author can follow."""
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got)):
            if w != g:
                return _tree_diff(w, g, f"{path}[{i}]")
    if isinstance(want, dict) and isinstance(got, dict) and want.keys() == got.keys():
        for k in want:
            if want[k] != got[k]:
                return _tree_diff(want[k], got[k], f"{path}.{k}")
    return f"{path}: expected {json.dumps(want)[:120]}, got {json.dumps(got)[:120]}"


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


def run_suite(suite: Path, reader: str | ExternalReader | None = None,
              timeout: float = DEFAULT_TIMEOUT, *, require: Iterable[str] = (),
              manifest: dict[str, Any] | None = None, jobs: int = 1) -> list[Result]:
    """Every vector of ``suite`` (or of ``manifest``, a subset of its vectors) against
    ``reader``: a command, or None for ours; an external reader runs ``jobs`` vectors at once."""
    if isinstance(reader, str):
        reader = ExternalReader(reader, timeout)
    vectors = (manifest or load_manifest(suite))["vectors"]
    decode = decode_in_process if reader is None else reader.decode

    def outcome(v: dict[str, Any]) -> Outcome:
        return decode(suite / v["file"], Path(v["parent"]) if v.get("parent") else None)

    if reader is None or jobs <= 1:
        outcomes = [outcome(v) for v in vectors]
    else:
        with ThreadPoolExecutor(jobs) as pool:
            outcomes = list(pool.map(outcome, vectors))
    require = frozenset(require)
    return [judge(v, got, require) for v, got in zip(vectors, outcomes)]


def counts(results: list[Result]) -> dict[str, Any]:
    """passed / failed / skipped, and how many skips each optional codec caused."""
    by_status = Counter(r.status for r in results)
    skipped = Counter(r.codec for r in results if r.status == SKIP)
    return {"passed": by_status[PASS], "failed": by_status[FAIL], "skipped": by_status[SKIP],
            "skipped_by_codec": dict(sorted(skipped.items()))}


def summary(results: list[Result]) -> str:
    c = counts(results)
    text = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
    why = [f"{codec}: {n}" for codec, n in c["skipped_by_codec"].items()]
    return text + (f" (optional codecs the reader lacks: {', '.join(why)})" if why else "")


def print_table(results: list[Result], title: str, out: TextIO = sys.stdout) -> None:
    width = max([len(r.id) for r in results] + [6])
    out.write(f"{title}\n{'vector':<{width}}  {'expected':<30} {'got':<34} result\n")
    for r in results:
        out.write(f"{r.id:<{width}}  {r.expect:<30} {r.got:<34} "
                  f"{'FAIL' if r.status == FAIL else r.status}\n")
        if r.status == FAIL and r.detail:
            out.write(f"{'':<{width}}    {r.detail[:300]}\n")
    out.write(f"{summary(results)}\n")


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
        return Result(name, expect, FAIL, f"raised {type(exc).__name__}", str(exc))
    return Result(name, expect, PASS if problem is None else FAIL,
                  "ok" if problem is None else "mismatch", problem or "")


def _gpu_decode(suite: Path, v: dict[str, Any], gdecode) -> str | None:
    from s4format.reader import Reader

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

    from s4format.reader import Reader
    from s4format.verify import verify
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
                        "(spec/conformance.md; default: this package's reader, in-process)")
    p.add_argument("--error-map", type=Path, metavar="FILE",
                   help="JSON object mapping the external reader's error names to those of "
                        "spec/validation.md, e.g. {\"BadChecksum\": \"ChecksumError\"}")
    p.add_argument("--require", action="append", choices=OPTIONAL_CODECS, default=[],
                   metavar="CODEC",
                   help="fail, instead of skipping, the vectors the reader refuses for lack of "
                        f"this optional codec ({', '.join(OPTIONAL_CODECS)}); repeatable")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: also decode every valid vector on the GPU and round-trip the "
                        "adversarial sets through the GPU encoder; fails if the GPU path "
                        "cannot run")
    p.add_argument("--suite", type=Path, action="append",
                   help="folder with manifest.json and the vectors; repeatable (default: "
                        f"{' and '.join(str(s) for s in DEFAULT_SUITES)})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds per vector for an external reader")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run an external reader on N vectors at once")
    p.add_argument("--json", action="store_true",
                   help="print one JSON report (per suite: passed, failed, skipped and every "
                        "vector's result) instead of the tables")


def main(args: argparse.Namespace) -> int:
    """Exit status 0 when nothing failed (skips allowed), 1 when something did."""
    if args.error_map and not args.reader:
        print("error: --error-map applies to an external reader; pass --reader CMD too",
              file=sys.stderr)
        return 2
    reader = None
    if args.reader:
        emap = load_error_map(args.error_map) if args.error_map else {}
        reader = ExternalReader(args.reader, args.timeout, emap)
    who = f"external reader {args.reader!r}" if args.reader else "s4format (CPU, in-process)"
    suites = [(s, load_manifest(s)) for s in (args.suite or DEFAULT_SUITES)]
    report: dict[str, Any] = {"reader": who, "require": sorted(set(args.require)),
                              "suites": []}
    for suite, manifest in suites:
        results = run_suite(suite, reader, require=args.require, manifest=manifest,
                            jobs=args.jobs)
        report["suites"].append({"suite": manifest.get("suite", suite.name),
                                 "path": str(suite), "version": manifest.get("version"),
                                 **counts(results), "results": results})
        if not args.json:
            print_table(results, f"conformance {suite} against {who}")
    if args.device == "cuda":
        report["gpu"] = _gpu_report(suites, args.json)
    every = [r for s in report["suites"] + [report.get("gpu", {})] for r in s.get("results", [])]
    failed = any(r.status == FAIL for r in every) or "error" in report.get("gpu", {})
    report.update(counts(every), ok=not failed)
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=vars)
        sys.stdout.write("\n")
    else:
        lines = [f"{s['suite']}: {summary(s['results'])}" for s in report["suites"]]
        print(f"\nconformance {'PASSED' if not failed else 'FAILED'}: " + "; ".join(lines))
    return 1 if failed else 0


def _gpu_report(suites: list[tuple[Path, dict[str, Any]]], quiet: bool) -> dict[str, Any]:
    try:
        results = [r for suite, _ in suites for r in run_gpu(suite)]
    except GpuUnavailable as exc:
        print(f"\nFAIL: --device cuda requested but the GPU path cannot run: {exc}",
              file=sys.stderr)
        return {"error": str(exc)}
    if not results:
        return {"error": "the suites hold no valid vector to decode on the GPU"}
    if not quiet:
        print()
        print_table(results, "GPU decode and round trips (s4weights.gpu)")
    return {**counts(results), "results": results}
