"""``python -m s4format``: inspect, verify and conformance on .s4w files."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from s4format import __version__, conformance
from s4format.errors import S4Error, StorageError
from s4format.schema import MAJOR, MINOR
from s4format.verify import report, verify

if TYPE_CHECKING:  # the reader (numpy and the codecs) is imported by the commands that open files
    from s4format.reader import Reader


def _ratio(stored: int, raw: int) -> float | None:
    return stored / raw if raw else None


def describe(reader: Reader) -> dict[str, Any]:
    from s4format import codecs

    tensors = []
    for t in reader.tensors:
        tensors.append(dict(
            name=t.name, dtype=t.dtype.name, shape=list(t.shape), layout=t.layout.name,
            masked=t.masked, raw_bytes=t.raw_nbytes, stored_bytes=t.stored_nbytes,
            ratio=_ratio(t.stored_nbytes, t.raw_nbytes),
            delta_parent=t.parent_hash.hex() if t.parent_hash else None,
            content_hash=t.content_hash.hex(),
            planes=[dict(plane=p.label, codec=codecs.name_of(p.codec), offset=p.offset,
                         stored_bytes=p.stored_len, decoded_bytes=p.decoded_len)
                    for p in t.planes]))
    raw = sum(t.raw_nbytes for t in reader.tensors)
    stored = sum(t.stored_nbytes for t in reader.tensors)
    h = reader.header
    return dict(
        file=reader.name, version=f"{h.major}.{h.minor}", required_flags=h.required_flags,
        optional_flags=h.optional_flags, alignment=reader.alignment,
        file_bytes=reader.source.size(), checkpoint_id=reader.checkpoint_id.hex(),
        delta_parent=reader.parent_id.hex() if reader.parent_id else None,
        metadata=reader.metadata, tensors=tensors,
        totals=dict(tensors=len(tensors), raw_bytes=raw, stored_bytes=stored,
                    ratio=_ratio(stored, raw), file_ratio=_ratio(reader.source.size(), raw)))


def _printable(text: str) -> str:
    """Names come from the file: control characters must not be able to rewrite the terminal."""
    return text if text.isprintable() else repr(text)


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.4f}"


def print_inspect(d: dict[str, Any], out=sys.stdout) -> None:
    w = out.write
    w(f"{d['file']}: .s4w {d['version']}, flags required={d['required_flags']:#x} "
      f"optional={d['optional_flags']:#x}, alignment {d['alignment']}\n")
    w(f"checkpoint {d['checkpoint_id']}"
      + (f", delta against {d['delta_parent']}" if d["delta_parent"] else ", full (no parent)")
      + "\n")
    for k, v in d["metadata"].items():
        w(f"  {_printable(k)}: {_printable(v)}\n")
    for t in d["tensors"]:
        delta = f"  delta of {t['delta_parent'][:16]}" if t["delta_parent"] else ""
        layout = t["layout"] + (" masked" if t["masked"] else "")
        w(f"{_printable(t['name'])}  {t['dtype']}{t['shape']}  {layout}  "
          f"raw {t['raw_bytes']}  stored {t['stored_bytes']}  "
          f"ratio {_fmt_ratio(t['ratio'])}{delta}\n")
        for p in t["planes"]:
            w(f"    {p['plane']:<10} {p['codec']:<9} {p['decoded_bytes']:>14} -> "
              f"{p['stored_bytes']:>14}  @{p['offset']}\n")
    tot = d["totals"]
    w(f"total: {tot['tensors']} tensors, raw {tot['raw_bytes']} bytes, stored "
      f"{tot['stored_bytes']} bytes, ratio {_fmt_ratio(tot['ratio'])}, file {d['file_bytes']} "
      f"bytes (file/raw {_fmt_ratio(tot['file_ratio'])})\n")


def _source(path: str, whole: bool = False) -> Any:
    """A local path as is; an ``s3://bucket/key`` URL through s4weights' S3 store (lazily
    imported: it needs boto3, and s4format itself does not). ``whole``: every byte will be
    read (verify), so a small object is fetched whole."""
    if not path.startswith("s3://"):
        return path
    try:
        from s4weights.store.s3 import open_object
        store, name = open_object(path)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {path}: {exc}") from exc
    src = store.source(name)
    if whole:
        src.read_whole()
    return src


def cmd_inspect(args: argparse.Namespace) -> int:
    from s4format.reader import Reader

    with Reader(_source(args.file), verify=False) as r:
        d = describe(r)
    if args.json:
        json.dump(d, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_inspect(d)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from s4format.reader import Reader

    with contextlib.ExitStack() as opened:
        # --parent P1 [--parent P2 ...]: the file's parent, then that one's parent, ...; each
        # opened after the file that names it (validation.md, rules A), closed with it
        r = opened.enter_context(Reader(_source(args.file, whole=True)))
        child = r
        for path in args.parent or []:
            child.attach_parent(_source(path, whole=True))
            child = child.parent
        problems = verify(r)
        if r.parent is None and r.parent_id is not None:
            return _report_without_parent(args.file, r, problems)
        return report(problems,
                      ok=f"{args.file}: OK, {len(r.tensors)} tensors, every checksum and "
                         "content hash verified",
                      bad=f"{args.file}: INVALID, {len(problems)} problem(s)")


# The vectors ship inside the package (in a checkout, links to conformance/v1 ... v1.5).
PACKAGED_SUITES = tuple(Path(__file__).resolve().parent / "vectors" / v
                        for v in ("v1", "v1.1", "v1.2", "v1.3", "v1.4", "v1.5"))


def cmd_conformance(args: argparse.Namespace) -> int:
    if not args.suite:
        args.suite = list(PACKAGED_SUITES)
    return conformance.main(args)


def cmd_kernels(args: argparse.Namespace) -> int:
    from s4format import kernelbuild, kernels

    if args.action == "build":
        try:
            folder = kernelbuild.build(log=lambda line: print(line, file=sys.stderr))
        except Exception as exc:  # numba, setuptools or a C compiler missing, or a failed compile
            print(f"error: the kernels could not be built ({type(exc).__name__}: {exc}); "
                  "numba compiles them in each process instead", file=sys.stderr)
            return 1
        print(f"built: {folder}", file=sys.stderr)
    state = kernels.status()
    if args.json:
        json.dump(state, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif state["built"]:
        print(f"{state['signatures']} signatures of {state['kernels']} kernels built ahead of "
              f"time for this machine: {state['folder']}")
    else:
        print(f"not built for this machine and these sources ({state['folder']}): "
              "python -m s4format kernels build")
    return 0 if state["built"] or args.action == "status" else 1


def _report_without_parent(file: str, r: Reader, problems: list) -> int:
    """A delta verified without its parent: the problems found in what could be checked, or
    else one line that says what was checked and how to check the rest (exit status 2)."""
    deltas = {t.name for t in r.tensors if t.is_delta}
    found = [p for p in problems if not (p.plane is None and p.tensor in deltas)]
    if found:
        return report(found, ok="", bad=f"{file}: INVALID, {len(found)} problem(s)")
    print(f"{file}: a delta against checkpoint {r.parent_id.hex()}: every stored plane's "
          f"checksum and the content hashes of its {len(r.tensors) - len(deltas)} full "
          f"tensors are valid; its {len(deltas)} delta tensors can only be checked with the "
          f"parent: python -m s4format verify {file} --parent PARENT.s4w (and a --parent for "
          "each further parent, down to the base)", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m s4format",
                                 description="Inspect and verify .s4w checkpoint files.")
    ap.add_argument("--version", action="version",
                    version=f"s4format {__version__} (.s4w format {MAJOR}.{MINOR})")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="list version, flags, tensors, planes, codecs and ratios",
                       description="Print the structure of a .s4w file without decoding it.")
    p.add_argument("file", help="path or s3://bucket/key URL of the .s4w file")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="decode everything and check every checksum and hash",
                       description="Decode every tensor, check every plane checksum, content "
                                   "hash and padding byte. Exit status 0 when valid, 1 when a "
                                   "problem is found (each named by tensor and plane), 2 when "
                                   "the file cannot be opened at all, or is a delta given "
                                   "without its parent.")
    p.add_argument("file", help="path or s3://bucket/key URL of the .s4w file")
    p.add_argument("--parent", action="append",
                   help="the delta's parent .s4w file (to check delta tensors); repeat it for a "
                        "longer chain: the parent first, then its parent, down to the base")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("conformance", help="run the conformance vectors against a reader",
                       description="Run every vector of the conformance suites (v1, "
                                   "v1.1 to v1.5) against this reader (default) or an "
                                   "external one (protocol: spec/conformance.md); prints "
                                   "passed / failed / skipped per suite (or --json), exit "
                                   "status 1 on any failure, 2 when a suite or the error map "
                                   "is unusable.")
    conformance.add_arguments(p)
    p.set_defaults(func=cmd_conformance)
    p = sub.add_parser("kernels", help="build the CPU kernels ahead of time, or say whether "
                                       "they are built",
                       description="The CPU codecs' kernels, compiled ahead of time for this "
                                   "machine so that a fresh process's first save or load does "
                                   "not wait for numba to start (about half a second). "
                                   "'build' compiles them (a minute or so; needs numba, "
                                   "setuptools and a C compiler) into S4_KERNEL_DIR or the "
                                   "user's cache folder; 'status' (default) says whether this "
                                   "machine has them for the installed sources.")
    p.add_argument("action", nargs="?", choices=("status", "build"), default="status")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.set_defaults(func=cmd_kernels)
    return ap


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Run the chosen subcommand: exit 2 with a one-line message on an S4Error (a file or
    store that cannot be read at all), quietly 0 when the output pipe closes."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except S4Error as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # inspect/list output cut by the pipe's reader (| head)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
