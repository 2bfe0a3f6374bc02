"""``sweep``: removing what failed saves left in a checkpoint store and nothing reads."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from s4format.errors import S4Error
from s4weights import lease
from s4weights.manifests import list_checkpoints, saving
from s4weights.store import Store, open_store


@dataclass(frozen=True)
class Swept:
    """What :func:`sweep` found: checkpoint files no manifest names (deleted unless a dry run),
    how many temporary files, uploads, pins or retiring marks of dead writers went (or would
    go), and what stopped it removing something."""
    orphans: list[str]
    temporaries: int
    problems: list[str]


_CHECKPOINT_FILE = re.compile(r"data/\d{12}(-[0-9a-f]{8})?\.s4w")


_STEP_FOLDER = re.compile(r"steps/\d{12}-[0-9a-f]{8}/")


def _unnamed_steps(store: Store, named: set[str], cutoff: float) -> list[str]:
    """The objects of distributed steps' folders that no manifest names (saves killed before
    their manifest), where none was written after ``cutoff``."""
    folders: dict[str, list[tuple[str, float]]] = {}
    for n, t in store.modified("steps/").items():
        if (m := _STEP_FOLDER.match(n)) and m[0] not in named:
            folders.setdefault(m[0], []).append((n, t))
    return [n for objs in folders.values() if max(t for _n, t in objs) < cutoff
            for n, _t in objs]


def sweep(url_or_dir: Any, older_than_s: float = 3600.0, *, dry_run: bool = False) -> Swept:
    """Remove what failed saves left in a run and nothing reads: checkpoint files that no
    manifest names (a save killed between its file and its manifest, a file a failed save
    could not delete) and the temporary files, or S3 multipart uploads, of writers that died
    in the run's ``data/`` and ``manifests/``, all last written more than ``older_than_s``
    ago (a save in progress writes its manifest right after its file; on S3 an object's time
    may be when its upload began, so keep ``older_than_s`` above the longest save, or sweep
    while no save runs; and above any difference between this machine's clock and the
    store's). Only names a save writes are candidates (``data/<step>[-<token>].s4w``, right
    inside ``data/``: not another run's files under this one). Where a manifest does not
    parse, it could name any file, and where there is none, every file would go: then no
    checkpoint file is removed and ``problems`` says why. ``dry_run`` removes nothing."""
    if not (math.isfinite(older_than_s) and older_than_s > 0):
        raise ValueError(f"older_than_s must be a positive number of seconds, not "
                         f"{older_than_s!r}")
    store = open_store(url_or_dir)
    with saving(store.url):
        malformed: list[str] = []
        infos = list_checkpoints(store, problems=malformed)
        problems = [f"checkpoint files left alone: {p} (it may name any of them)"
                    for p in malformed]
        named = {i.file for i in infos}
        cutoff = time.time() - older_than_s
        found = [n for n, t in store.modified("data/").items()
                 if _CHECKPOINT_FILE.fullmatch(n) and n not in named and t < cutoff]
        found += _unnamed_steps(store, named, cutoff)
        if found and not infos and not problems:
            problems.append("checkpoint files left alone: no manifest names any of them, so "
                            "every one would go (delete them by hand if that is what is meant)")
        orphans = [] if problems else found
        removed = []
        for n in orphans:
            if not dry_run:
                try:
                    store.delete(n)
                except S4Error as exc:
                    problems.append(f"could not delete {n}: {exc}")
                    continue
            removed.append(n)
        try:
            temporaries = store.sweep(older_than_s, dirs=("data/", "manifests/"),
                                      dry_run=dry_run) if hasattr(store, "sweep") else 0
            leases = lease.stale(store, older_than_s)
            for n in leases if not dry_run else ():
                store.delete(n)
            temporaries += len(leases)
        except S4Error as exc:
            temporaries = 0
            problems.append(f"temporary files: {exc}")
    return Swept(removed, temporaries, problems)
