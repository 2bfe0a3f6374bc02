"""What a training job started by the runner uses: where to save, and when to checkpoint.

The runner starts the job with these environment variables:

- ``S4_REGISTRY_URL``: the registry (``s3://bucket/prefix``);
- ``S4_RUN_ID``: this run's id;
- ``S4_RUN_URL``: the run's store, ``$S4_REGISTRY_URL/$S4_RUN_ID``: save here, since
  ``/status`` reads this run's manifests;
- ``S4_CHECKPOINT_REQUEST``: a file that appears when the runner asks for a checkpoint
  (a spot interruption notice, or a stop). It holds JSON with a ``reason``.

On a stop (SIGTERM) the runner writes the request file, then forwards SIGTERM to the job and
waits its grace period before killing it. A typical loop::

    from s4weights import save_checkpoint
    from s4weights.runner import job

    job.watch_signals()  # SIGTERM/SIGINT set a flag instead of killing the process
    for step in range(start, steps):
        train_step()
        if step % 500 == 0 or job.checkpoint_requested():
            save_checkpoint(state, job.run_url(), step)
            job.checkpoint_done()
        if job.stop_requested():
            break
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

REGISTRY_ENV = "S4_REGISTRY_URL"
RUN_ID_ENV = "S4_RUN_ID"
RUN_URL_ENV = "S4_RUN_URL"
REQUEST_ENV = "S4_CHECKPOINT_REQUEST"

_stop = [False]  # a plain flag: a signal handler must not take locks (Event.set does)
_seen: list[tuple[int, int] | None] = [None]  # the request file last reported (inode, mtime)


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{name} is not set: the job was not started by the s4weights runner "
                           f"(set {name} yourself to run it by hand)")
    return value


def registry_url() -> str:
    return _env(REGISTRY_ENV)


def run_id() -> str:
    return _env(RUN_ID_ENV)


def run_url() -> str:
    return _env(RUN_URL_ENV)


def watch_signals() -> None:
    """Make SIGTERM and SIGINT set the stop flag (call from the main thread)."""
    def handler(signum: int, _frame: Any) -> None:
        _stop[0] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def stop_requested() -> bool:
    return _stop[0]


def checkpoint_requested() -> str | None:
    """Why a checkpoint is wanted now (``"stop"``, or the request file's reason), else None.
    Cheap enough to call every step: one ``stat`` while nothing is requested."""
    if _stop[0]:
        return "stop"
    path = os.environ.get(REQUEST_ENV)
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    if st is None:
        return None
    _seen[0] = (st.st_ino, st.st_mtime_ns)
    try:
        reason = json.loads(Path(path).read_text()).get("reason")
    except (OSError, ValueError, AttributeError, RecursionError):
        reason = None
    return reason if isinstance(reason, str) and reason else "requested"


def checkpoint_done() -> None:
    """Acknowledge the request that :func:`checkpoint_requested` returned: its file is
    removed. A request written since then is left for the next step to see."""
    path = os.environ.get(REQUEST_ENV)
    seen, _seen[0] = _seen[0], None
    if not path or seen is None:
        return
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if (st.st_ino, st.st_mtime_ns) == seen:
            os.unlink(path)


def write_request(path: str | os.PathLike[str], reason: str, **details: Any) -> None:
    """The runner's side: create the request file atomically (temp file, then rename)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"reason": reason, "requested_at": time.time(), **details}))
    os.replace(tmp, target)
