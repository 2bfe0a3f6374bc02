"""``s4weights`` (also ``python -m s4weights``): convert checkpoints to and from .s4w, and the
checkpoint registry — list, verify and sweep runs under a store URL.

A *run* is any directory (or S3 prefix) holding ``manifests/``; ``URL`` may be a run or any
prefix above runs (``s3://bucket/team``, ``./checkpoints``). Only committed checkpoints (those
with a manifest) are shown; ``.s4w`` files without one are counted as uncommitted leftovers.

    s4weights convert SRC DST [--no-verify] [--policy P]
    s4weights list URL [--json]
    s4weights verify URL [--step N]
    s4weights sweep URL [--older-than SECONDS] [--dry-run]

``verify`` exits 0 when every checked file is valid, 1 when a problem is found, 2 when the
store cannot be read. ``sweep`` removes what failed saves left and nothing reads (see
:func:`s4weights.chain.sweep`); it exits 1 when a run's manifests could not all be read (its
files are then left alone). ``convert`` exits 1 when a written file does not read back bit
for bit, 2 when a source cannot be read or converted. The commands import torch only when
they run, so ``--help`` and ``--version`` work without it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import s4weights
from s4format.cli import run as run_cli
from s4format.errors import ContentHashError, S4Error, StorageError
from s4format.schema import MAJOR, MINOR
from s4format.verify import report, say
from s4weights.store import LocalStore, Store, open_store

if TYPE_CHECKING:
    from s4weights.convert import Converted
    from s4weights.manifests import CheckpointInfo

MANIFESTS = "manifests/"
MIN_SWEEP_AGE = 900.0  # S3 refuses requests from clocks more than 15 minutes apart from its own


def _run_names(store: Store) -> tuple[list[str], set[str]]:
    """Runs (relative prefixes, ``""`` for the root) and every object name under the store."""
    names = store.list()
    runs = set()
    for n in names:
        head, sep, _ = n.rpartition(MANIFESTS)
        if sep and n.endswith(".json") and (not head or head.endswith("/")):
            runs.add(head.rstrip("/"))
    return sorted(runs), set(names)


def _sub(store: Store, run: str) -> Store:
    if not run:
        return store
    if isinstance(store, LocalStore):
        return LocalStore(store.root / run)
    from s4weights.store.s3 import S3Store
    assert isinstance(store, S3Store)
    return store.child(run)


def _ratio(num: int, den: int) -> str:
    return f"{num / den:.4f}" if den else "-"


def _run_summary(store: Store, run: str, names: set[str]) -> dict[str, Any]:
    from s4weights.manifests import list_checkpoints

    malformed: list[str] = []
    infos = list_checkpoints(_sub(store, run), problems=malformed)
    pre = f"{run}/" if run else ""
    committed = {pre + i.file for i in infos}
    leftovers = sorted(n for n in names if n.startswith(pre + "data/") and n.endswith(".s4w")
                       and n not in committed)
    return dict(run=f"{store.url}/{run}".rstrip("/") if run else store.url,
                checkpoints=[asdict(i) for i in infos],
                chains=sum(i.is_base for i in infos),
                raw_bytes=sum(i.raw_bytes for i in infos),
                file_bytes=sum(i.file_bytes for i in infos),
                uncommitted=leftovers, malformed=malformed)


def _print_run(d: dict[str, Any]) -> None:
    w = sys.stdout.write
    n = len(d["checkpoints"])
    w(f"run {d['run']}: {n} checkpoint(s) in {d['chains']} chain(s), {d['file_bytes']} bytes "
      f"stored for {d['raw_bytes']} raw (ratio {_ratio(d['file_bytes'], d['raw_bytes'])})\n")
    w(f"  {'step':>10}  {'kind':<6} {'parent':>10} {'base':>10} {'depth':>5} {'raw':>14} "
      f"{'file':>14}  {'ratio':<7} {'checkpoint':<16}  why a base\n")
    for c in d["checkpoints"]:
        kind = "base" if c["parent_step"] is None else "delta"
        parent = "-" if c["parent_step"] is None else str(c["parent_step"])
        w(f"  {c['step']:>10}  {kind:<6} {parent:>10} {c['base_step']:>10} {c['depth']:>5} "
          f"{c['raw_bytes']:>14} {c['file_bytes']:>14}  "
          f"{_ratio(c['file_bytes'], c['raw_bytes']):<7} {c['checkpoint_id'][:16]}"
          f"{'  ' + c['base_reason'] if c.get('base_reason') else ''}\n")
    if d["uncommitted"]:
        w(f"  {len(d['uncommitted'])} uncommitted file(s) (no manifest): "
          f"{', '.join(d['uncommitted'])}\n")


def _open(url: str) -> Store:
    """The store at ``url``; a URL of no known kind, or a local path that is not a
    directory, is a StorageError (exit 2), not a traceback or an empty listing."""
    try:
        store = open_store(url)
    except ValueError as exc:
        raise StorageError(f"{url}: {exc}") from None
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise StorageError(f"{url}: no such directory")
    return store


def cmd_list(args: argparse.Namespace) -> int:
    store = _open(args.url)
    runs, names = _run_names(store)
    summaries, failed = [], 0
    for r in runs:
        try:
            summaries.append(_run_summary(store, r, names))
        except S4Error as exc:  # one unreadable run does not hide the others
            failed += 1
            print(f"error: {_sub(store, r).url}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        for problem in summaries[-1]["malformed"]:  # listed without them, and said
            failed += 1
            print(f"error: {_sub(store, r).url}: {problem}", file=sys.stderr)
    if args.json:
        json.dump(summaries, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    elif not summaries and not failed:
        print(f"no checkpoints under {store.url}")
    else:
        for d in summaries:
            _print_run(d)
    return 1 if failed else 0


def _verify_one(store: Store, info: CheckpointInfo, infos: dict[int, CheckpointInfo]
                ) -> list[str]:
    from s4format.verify import verify
    from s4weights.chain import close_chain, open_chain
    from s4weights.manifests import chain_of

    where = f"{store.url}: step {info.step} ({info.file})"
    if info.rank_files is not None:
        from s4weights.dcp.chain import verify_step

        return [f"{where}: {p}" for p in verify_step(store, info, infos)]
    try:
        reader = open_chain(store, chain_of(info.step, infos), verify=True, whole=True)
        try:
            problems = [str(p) for p in verify(reader)]
            if reader.source.size() != info.file_bytes:
                problems.append(f"{info.file} is {reader.source.size()} bytes, its manifest "
                                f"says {info.file_bytes}")
        finally:
            close_chain(reader)
    except S4Error as exc:
        problems = [f"{type(exc).__name__}: {exc}"]
    return [f"{where}: {p}" for p in problems]


def cmd_verify(args: argparse.Namespace) -> int:
    from s4weights.manifests import by_step, chain_of, list_checkpoints

    store = _open(args.url)
    runs, _ = _run_names(store)
    if not runs:
        raise StorageError(f"no checkpoints under {store.url}")
    problems: list[str] = []
    checked = 0
    for run in runs:
        sub = _sub(store, run)
        malformed: list[str] = []
        try:
            infos = by_step(list_checkpoints(sub, problems=malformed))
            if args.step is not None:
                if args.step not in infos:
                    continue
                # The step's whole chain, each file checked against its own parent.
                todo = [i.step for i in chain_of(args.step, infos)]
            else:
                todo = sorted(infos)
        except S4Error as exc:  # an unreadable run is a problem found, not the end
            problems.append(f"{sub.url}: {type(exc).__name__}: {exc}")
            say(f"{sub.url}: INVALID")
            continue
        for problem in malformed:  # a damaged manifest too; the others are still checked
            problems.append(f"{sub.url}: FormatError: {problem}")
            say(f"{sub.url}: INVALID")
        for step in todo:
            found = _verify_one(sub, infos[step], infos)
            problems.extend(found)
            checked += 1
            say(f"{sub.url}: step {step}: {'INVALID' if found else 'OK'}")
    if args.step is not None and not checked:
        raise StorageError(f"no checkpoint step {args.step} under {store.url}")
    return report(problems,
                  ok=f"{checked} checkpoint file(s) verified: every checksum, content hash "
                     "and parent link is valid",
                  bad=f"{len(problems)} problem(s) in {checked} checkpoint file(s)")


def cmd_sweep(args: argparse.Namespace) -> int:
    from s4weights.sweep import sweep

    store = _open(args.url)
    runs, _ = _run_names(store)
    if not runs:
        print(f"no checkpoints under {store.url}")
        return 0
    failed = 0
    verb = "would remove" if args.dry_run else "removed"
    for run in runs:
        sub = _sub(store, run)
        try:
            got = sweep(sub, args.older_than, dry_run=args.dry_run)
        except S4Error as exc:  # one run that cannot be swept does not stop the others
            failed += 1
            print(f"error: {sub.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        for name in got.orphans:
            print(f"{sub.url}: {verb} {name} (no manifest names it)")
        if got.temporaries:
            print(f"{sub.url}: {verb} {got.temporaries} temporary file(s) or upload(s) of "
                  "writers that died")
        for problem in got.problems:
            failed += 1
            print(f"error: {sub.url}: {problem}", file=sys.stderr)
        if not (got.orphans or got.temporaries or got.problems):
            print(f"{sub.url}: nothing to remove")
    return 1 if failed else 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _print_converted(c: Converted) -> None:
    check = "verified bit-exact" if c.verified else "not verified (--no-verify)"
    say(f"{c.src} -> {c.dst}: {c.tensors} tensors, {_mb(c.src_bytes)} -> {_mb(c.dst_bytes)} "
        f"(ratio {_ratio(c.dst_bytes, c.src_bytes)}; raw {_mb(c.raw_bytes)}), "
        f"{c.seconds:.2f} s, {check}")


def cmd_convert(args: argparse.Namespace) -> int:
    from s4weights.convert import convert

    try:
        done = convert(args.src, args.dst, verify=args.verify, policy=args.policy,
                       progress=args.progress, on_file=_print_converted)
    except ContentHashError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if len(done) > 1:
        src = sum(c.src_bytes for c in done)
        dst = sum(c.dst_bytes for c in done)
        say(f"{len(done)} files: {_mb(src)} -> {_mb(dst)} (ratio {_ratio(dst, src)}) in "
            f"{sum(c.seconds for c in done):.2f} s")
    return 0


def _age(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= MIN_SWEEP_AGE):
        raise argparse.ArgumentTypeError(f"must be at least {MIN_SWEEP_AGE:g} seconds, got "
                                         f"{text}")
    return value


def version() -> str:
    return f"s4weights {s4weights.__version__} (writes .s4w format {MAJOR}.{MINOR})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="s4weights",
                                 description="Convert checkpoints to and from .s4w; list, "
                                             "verify and sweep checkpoint runs in a store "
                                             "(a directory, file:// or s3://bucket/prefix).")
    ap.add_argument("--version", action="version", version=version())
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="convert .pt/.bin/.safetensors or a model folder to "
                                       ".s4w, or .s4w to .safetensors",
                       description="Convert SRC to DST, then read DST back and check every "
                                   "tensor bit for bit. SRC: a torch.save file (.pt, .pth, "
                                   ".bin, .ckpt; read with torch.load(weights_only=True), "
                                   "which runs no code from the file), a .safetensors file, "
                                   "a Hugging Face model folder (weight shards and their "
                                   "*.index.json) or a .s4w file or folder. A folder "
                                   "converts to a folder (one file per shard, the index "
                                   "rewritten, other files copied) or to one DST.s4w. "
                                   "Local paths or s3://bucket/key URLs. Exit status 0 when "
                                   "done, 1 when a written file does not read back bit for "
                                   "bit, 2 when a source cannot be read or converted.")
    p.add_argument("src", help="file or folder to convert (path or s3:// URL)")
    p.add_argument("dst", help="*.s4w or *.safetensors file, or a folder")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not read the written files back to compare them")
    p.add_argument("--policy", default="auto", choices=("auto", "auto-1.0", "seed"),
                   help="codec choice for .s4w files (default auto; auto-1.0 writes files "
                        "that format-1.0 readers open)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("list", help="runs, checkpoints and chains under URL",
                       description="For every run under URL: each committed checkpoint's step, "
                                   "base/delta, parent, chain depth, sizes and ratio.")
    p.add_argument("url", help="directory, file:// or s3://bucket/prefix URL")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("verify", help="decode and check every checkpoint's chain",
                       description="Decode every tensor of every checkpoint (or of the chain of "
                                   "--step) and check every checksum, content hash and parent "
                                   "link. Exit status 0 when valid, 1 when a problem is found, "
                                   "2 when the store cannot be read.")
    p.add_argument("url", help="directory, file:// or s3://bucket/prefix URL")
    p.add_argument("--step", type=int, help="verify only this checkpoint and its chain")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("sweep", help="remove what failed saves left behind",
                       description="In every run under URL, remove checkpoint files that no "
                                   "manifest names and temporary files or S3 multipart "
                                   "uploads of writers that died, all older than "
                                   "--older-than seconds. Nothing a checkpoint uses is "
                                   "touched; a run whose manifests cannot all be read keeps "
                                   "its files (exit status 1).")
    p.add_argument("url", help="directory, file:// or s3://bucket/prefix URL")
    p.add_argument("--older-than", type=_age, default=3600.0, metavar="SECONDS",
                   help=f"only what was last written this long ago (default 3600, at least "
                        f"{MIN_SWEEP_AGE:g}: a save in progress, or a clock of the store's "
                        "that runs apart, must not look dead)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the checkpoint files it would remove, remove nothing")
    p.set_defaults(func=cmd_sweep)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        return run_cli(build_parser(), argv)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        command = (argv if argv is not None else sys.argv[1:])[:1] or ["this command"]
        print(f"error: {s4weights._TORCH_MISSING.format(what=f's4weights {command[0]}')}",
              file=sys.stderr)
        return 2
