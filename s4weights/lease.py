"""Leases between saves and retention on one checkpoint store, across processes and hosts.

A save that builds a delta on a parent pins it: ``pins/<step>-<id>-<token>.json``, kept fresh
until the save's manifest is committed. Retention first marks the steps it means to delete
(``retiring/<token>.json``), then lists pins and manifests again and deletes only what no fresh
pin and no new checkpoint needs. Each side writes its object before it reads the other's, so of
two that race at least one sees the other: the save falls back to a base, or retention keeps the
parent. Freshness is the object's time of writing against this host's clock (see
spec/checkpoints.md for the bound this puts on clock skew).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from s4format.errors import S4Error, StorageError
from s4weights.store import Store

log = logging.getLogger("s4weights")

# A pin or mark older than this is a dead writer's and is ignored. Holders rewrite theirs every
# REFRESH_S, so only a process stopped for LEASE_S - REFRESH_S loses its lease.
LEASE_S = 600.0
REFRESH_S = 60.0

PINS = "pins/"
RETIRING = "retiring/"
_PIN = re.compile(r"pins/(\d{12})-([0-9a-f]{32})-([0-9a-f]{16})\.json")
_MARK = re.compile(r"retiring/([0-9a-f]{16})\.json")


@dataclass(frozen=True)
class Pinned:
    step: int
    checkpoint_id: str


def _fresh(store: Store, prefix: str) -> Iterator[str]:
    cutoff = time.time() - LEASE_S
    for name, written in store.modified(prefix).items():
        if written >= cutoff:
            yield name


def pinned(store: Store) -> set[Pinned]:
    """The checkpoints that saves in progress build on (fresh pins only)."""
    out = set()
    for name in _fresh(store, PINS):
        if m := _PIN.fullmatch(name):
            out.add(Pinned(int(m[1]), m[2]))
    return out


def retiring(store: Store) -> set[int]:
    """The steps that a retention in progress may be deleting (fresh marks only). A mark that
    cannot be read counts as marking nothing: its retention has just removed it."""
    steps: set[int] = set()
    for name in _fresh(store, RETIRING):
        if not _MARK.fullmatch(name):
            continue
        try:
            steps.update(json.loads(store.get(name))["steps"])
        except StorageError:
            continue
        except (ValueError, KeyError, TypeError) as exc:
            raise StorageError(f"{store.url}: retiring mark {name} is malformed ({exc}); "
                               "delete it if no retention is running") from None
    return steps


def _holder() -> dict[str, object]:
    return {"host": socket.gethostname(), "since": time.time()}


class _Refresher:
    """Rewrites one object every REFRESH_S on a daemon thread until stopped."""

    def __init__(self, store: Store, name: str, body: bytes) -> None:
        self.store, self.name, self.body = store, name, body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s4w-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.store.put_atomic(self.name, self.body)
            except (S4Error, OSError) as exc:  # the next try may work; the lease is long
                log.warning("%s: could not refresh %s: %s", self.store.url, self.name, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def pin(store: Store, step: int, checkpoint_id: str) -> Iterator[None]:
    """Hold a pin on checkpoint ``step`` for the duration of the block."""
    name = f"{PINS}{step:012d}-{checkpoint_id}-{secrets.token_hex(8)}.json"
    with _held(store, name, {"step": step, "checkpoint_id": checkpoint_id}):
        yield


@contextlib.contextmanager
def marking(store: Store, steps: Iterable[int]) -> Iterator[None]:
    """Mark ``steps`` as being retired for the duration of the block."""
    with _held(store, f"{RETIRING}{secrets.token_hex(8)}.json", {"steps": sorted(steps)}):
        yield


@contextlib.contextmanager
def _held(store: Store, name: str, what: dict[str, Any]) -> Iterator[None]:
    """Write the lease file ``name`` (``what`` and its holder), refresh it while the block runs,
    then delete it."""
    body = json.dumps({**what, **_holder()}).encode()
    store.put_atomic(name, body)
    refresher = _Refresher(store, name, body)
    try:
        yield
    finally:
        refresher.stop()
        _delete_quietly(store, name)


def _delete_quietly(store: Store, name: str) -> None:
    """A pin or mark left behind only delays retention until it goes stale."""
    try:
        store.delete(name)
    except (S4Error, OSError) as exc:
        log.warning("%s: could not delete %s (it lapses in %.0f s): %s", store.url, name,
                    LEASE_S, exc)


def stale(store: Store, older_than_s: float) -> list[str]:
    """Pins and marks last written more than ``older_than_s`` ago (their holders are dead)."""
    cutoff = time.time() - max(older_than_s, LEASE_S)
    return [n for prefix, pattern in ((PINS, _PIN), (RETIRING, _MARK))
            for n, t in store.modified(prefix).items()
            if pattern.fullmatch(n) and t < cutoff]
