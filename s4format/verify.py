"""Full-file verification: every checksum, every content hash, and every byte accounted for.

Beyond what a normal read checks, ``verify`` reads the whole data section and requires each gap
between planes (alignment padding) to be zero and shorter than the alignment, so that any
single damaged byte anywhere in a valid file is reported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from s4format.errors import S4Error
from s4format.schema import HEADER_SIZE

if TYPE_CHECKING:  # (report and say serve the CLIs, which start without numpy)
    from s4format.reader import Reader
    from s4format.records import TensorInfo


@dataclass(frozen=True)
class Problem:
    tensor: str | None
    plane: str | None
    message: str

    def __str__(self) -> str:
        # Reader errors already name the file, tensor and plane.
        return self.message


def verify(reader: Reader) -> list[Problem]:
    """Decode every tensor and check the padding; returns the problems found (empty: valid)."""
    from s4format.hashing import content_hash

    problems: list[Problem] = []
    for i, t in enumerate(reader.tensors):
        if t.is_delta and reader.parent is None:
            problems.extend(_check_planes(reader, t) or [Problem(
                t.name, None, f"{reader.name}: tensor {t.name!r} is a delta and was not "
                "checked: give its parent (--parent)")])
            continue
        try:
            raw = reader.read_raw(i)
        except S4Error as exc:
            # Decode plane by plane only for a tensor that failed, to name the damaged plane:
            # a valid file is decoded once.
            problems.extend(_check_planes(reader, t) or [Problem(t.name, None, str(exc))])
            continue
        # verify always checks content hashes, also on a reader opened with verify=False.
        if not reader.verify_hashes and content_hash(raw) != t.content_hash:
            problems.append(Problem(t.name, None, f"{reader.name}: tensor {t.name!r} content "
                                    "hash mismatch after decoding: the file is corrupt"))
    problems.extend(_check_gaps(reader))
    return problems


def report(problems: Sequence[object], ok: str, bad: str) -> int:
    """A verify command's output and exit status: each problem and then ``bad`` on stderr and 1,
    or ``ok`` on stdout and 0 when there are none."""
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(bad, file=sys.stderr)
        return 1
    say(ok)
    return 0


def say(line: str) -> None:
    """Print a line of a command's progress on stdout. When the reader of a pipe has gone
    (``| head``), the rest is dropped and the command goes on: its exit status, not its
    output, is what a verify must still get right."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        os.close(devnull)


def _check_planes(reader: Reader, t: TensorInfo) -> list[Problem]:
    problems = []
    for k, p in enumerate(t.planes):
        try:
            reader.read_plane(t, k)
        except S4Error as exc:
            problems.append(Problem(t.name, p.label, str(exc)))
    return problems


def _check_gaps(reader: Reader) -> list[Problem]:
    spans = sorted((p.offset, p.offset + p.stored_len) for t in reader.tensors for p in t.planes)
    problems = []
    pos = HEADER_SIZE
    for start, end in [*spans, (reader.data_end, reader.data_end)]:
        if start > pos:
            if start - pos >= reader.alignment:
                problems.append(Problem(None, None, f"{reader.name}: {start - pos} unaccounted "
                                        f"bytes at offset {pos} (more than alignment padding)"))
            elif reader.source.read_at(pos, start - pos).any():
                problems.append(Problem(None, None, f"{reader.name}: padding at {pos}..{start} "
                                        "is not zero"))
        pos = max(pos, end)
    return problems
