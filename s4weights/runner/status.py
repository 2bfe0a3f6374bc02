"""What the health endpoints report: the run's state, shared by the supervisor, the spot watch,
the registry poller and the HTTP handlers under one lock. Handlers only read snapshots; nothing
they do waits on the job, the registry or IMDS, so a slow store never stalls a health probe."""

from __future__ import annotations

import glob
import os
import threading
import time
from typing import Any

from s4weights.runner.config import Config
from s4weights.runner.logs import Log


class RunStatus:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self.entitled = False
        self.job: dict[str, Any] = {"state": "not started", "pid": None, "exit_code": None,
                                    "signal": None, "started_at": None, "ended_at": None}
        self.request: dict[str, Any] | None = None
        self.spot_notice: dict[str, Any] | None = None
        self.checkpoints: list[Any] | None = None  # CheckpointInfo, once listed
        self.registry_error: str | None = None
        self.listed_at: float | None = None  # monotonic time of the last good listing

    def update_job(self, **fields: Any) -> None:
        with self._lock:
            self.job.update(fields)

    def set(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self, k, v)

    def gpu_visible(self) -> bool:
        return any(os.access(p, os.R_OK | os.W_OK) for p in glob.glob(self.cfg.health.gpu_devices))

    def readiness(self) -> tuple[bool, list[str]]:
        reasons = []
        with self._lock:
            entitled, error, listed_at = self.entitled, self.registry_error, self.listed_at
        if not entitled:
            reasons.append("not entitled")
        if not self.gpu_visible():
            reasons.append(f"no GPU visible: no accessible device matches "
                           f"{self.cfg.health.gpu_devices}")
        stale = 3 * self.cfg.health.refresh_s + 10
        if error is not None:
            reasons.append(f"registry unreachable: {error}")
        elif listed_at is None:
            reasons.append("registry not reached yet")
        elif time.monotonic() - listed_at > stale:
            reasons.append(f"registry not reached for {time.monotonic() - listed_at:.0f} s")
        return not reasons, reasons

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            job, infos = dict(self.job), self.checkpoints
            out = {"run_id": self.cfg.run_id, "registry": self.cfg.registry,
                   "run_url": self.cfg.run_url, "entitled": self.entitled,
                   "checkpoint_request": self.request, "spot_notice": self.spot_notice,
                   "registry_error": self.registry_error}
        now = time.time()
        for k in ("started_at", "ended_at"):
            job[k] = round(job[k], 3) if job[k] is not None else None
        job["runtime_s"] = (round((job["ended_at"] or now) - job["started_at"], 1)
                            if job["started_at"] else None)
        out["job"] = job
        out["checkpoints"] = None if infos is None else len(infos)
        out["latest_checkpoint"] = _latest(infos, now) if infos else None
        return out


def _latest(infos: list[Any], now: float) -> dict[str, Any]:
    c = max(infos, key=lambda i: i.step)
    return {"step": c.step, "raw_bytes": c.raw_bytes, "stored_bytes": c.stored_bytes,
            "file_bytes": c.file_bytes,
            "ratio": round(c.stored_bytes / c.raw_bytes, 4) if c.raw_bytes else None,
            "age_s": round(max(0.0, now - c.created), 1), "created": c.created,
            "is_base": c.is_base, "depth": c.depth}


class RegistryPoller:
    """Lists the run's checkpoints every ``health.refresh_s`` through
    :func:`s4weights.chain.list_checkpoints` (imported here, in the background, since it brings
    torch)."""

    def __init__(self, cfg: Config, status: RunStatus, log: Log) -> None:
        self.cfg, self.status, self.log = cfg, status, log
        self._stop = threading.Event()
        self._seen: set[str] = set()  # damaged manifests already logged
        self._thread = threading.Thread(target=self._run, name="registry-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last_error = None
        while not self._stop.is_set():
            error = self.poll_once()
            if error != last_error:
                if error:
                    self.log.warning("registry.unreachable", f"cannot list the run's "
                                     f"checkpoints: {error}", run_url=self.cfg.run_url)
                elif last_error:
                    self.log.info("registry.reachable", "the run's checkpoints list again",
                                  run_url=self.cfg.run_url)
            last_error = error
            self._stop.wait(self.cfg.health.refresh_s)

    def poll_once(self) -> str | None:
        problems: list[str] = []
        try:
            from s4weights.manifests import list_checkpoints
            infos = list_checkpoints(self.cfg.run_url, problems=problems)
        except Exception as exc:  # any failure is reported by /readyz, never fatal here
            error = f"{type(exc).__name__}: {exc}"[:500]
            self.status.set(registry_error=error)
            return error
        self.status.set(checkpoints=infos, registry_error=None, listed_at=time.monotonic())
        for p in problems:
            if p not in self._seen:
                self.log.warning("registry.damaged_manifest", p[:500], run_url=self.cfg.run_url)
        self._seen = set(problems)
        return None
