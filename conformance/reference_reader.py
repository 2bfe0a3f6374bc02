"""Reference adapter for the external-reader protocol (``spec/conformance.md``), on s4format.

    python conformance/reference_reader.py decode FILE OUTDIR [--parent PARENTFILE]

Writes ``OUTDIR/index.json`` and one raw-bytes file per tensor into the existing ``OUTDIR`` and
exits 0; exits 1 with ``ErrorClass: message`` as the first line of stderr when it rejects the
file; any other exit status is a crash. A reader in another language implements the same three
outcomes.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from s4format import Reader, S4Error
from s4format.conformance import tree_to_json


def decode(file: Path, outdir: Path, parent: Path | None) -> None:
    # The parent is opened after the file itself has passed its own rules (validation.md, A).
    with Reader(file, parent=parent) as r:
        tensors = []
        for i, t in enumerate(r.tensors):
            name = f"{i}.bin"
            (outdir / name).write_bytes(r.read_raw(i).tobytes())
            tensors.append(dict(name=t.name, dtype=t.dtype.name, shape=list(t.shape),
                                file=name))
        index = dict(tensors=tensors, tree=tree_to_json(r.tree))
    (outdir / "index.json").write_text(json.dumps(index, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="s4format behind the conformance protocol")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode", help="decode FILE into OUTDIR")
    p.add_argument("file", type=Path)
    p.add_argument("outdir", type=Path)
    p.add_argument("--parent", type=Path)
    args = ap.parse_args(argv)
    try:
        decode(args.file, args.outdir, args.parent)
    except S4Error as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
