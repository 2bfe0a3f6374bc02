"""Running the job once entitled: health port, registry poller and spot watch up first, then the
training command in a process group of its own, as this (already unprivileged) process's user.

A stop signal (SIGTERM/SIGINT) writes the checkpoint request, forwards the signal to the job's
main process and waits ``grace_s`` for it to exit before killing its whole process group; a spot
notice only writes the request. Whatever the job leaves running in its group is killed when it
exits, so the unit stops cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from s4weights.runner import Exit
from s4weights.runner.config import Config
from s4weights.runner.health import HealthServer
from s4weights.runner.job import (
    REGISTRY_ENV,
    REQUEST_ENV,
    RUN_ID_ENV,
    RUN_URL_ENV,
    write_request,
)
from s4weights.runner.logs import Log
from s4weights.runner.privileges import Identity
from s4weights.runner.spot import SpotWatch
from s4weights.runner.status import RegistryPoller, RunStatus

KILL_WAIT_S = 10.0


class Supervisor:
    def __init__(self, cfg: Config, who: Identity, status: RunStatus, log: Log) -> None:
        self.cfg, self.who, self.status, self.log = cfg, who, status, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.poller = RegistryPoller(cfg, status, log)
        self.stop_signal: int | None = None
        self._request_lock = threading.Lock()

    def run(self) -> Exit:
        try:
            health = HealthServer(self.cfg.health, self.status, self.log)
        except OSError as exc:
            self.log.error("health.bind_failed", f"cannot listen on {self.cfg.health.address}:"
                           f"{self.cfg.health.port}: {exc}", exit_status=int(Exit.HEALTH_PORT))
            return Exit.HEALTH_PORT
        spot = SpotWatch(self.cfg.spot, self.log, self._on_spot_notice)
        health.start()
        self.log.info("health.listening", "health endpoints up",
                      address=self.cfg.health.address, port=health.server_address[1])
        self.poller.start()
        if self.cfg.spot.enabled:
            spot.start()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run_job()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            spot.stop()
            self.poller.stop()
            health.stop()

    def _run_job(self) -> Exit:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.cfg.request_file)  # a previous run's request is not this run's
        if self.stop_signal is not None:
            return self._finish(None)
        try:
            self.proc = subprocess.Popen(self.cfg.command, env=self._job_env(),
                                         cwd=self.cfg.workdir, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as exc:
            self.log.error("job.start_failed", f"cannot start the training command "
                           f"{Path(self.cfg.command[0]).name!r}: {exc.strerror or exc}",
                           exit_status=int(Exit.JOB_FAILED))
            self.status.update_job(state="failed to start")
            return Exit.JOB_FAILED
        self.status.update_job(state="running", pid=self.proc.pid, started_at=time.time())
        self.log.info("job.started", "training command started", pid=self.proc.pid,
                      program=Path(self.cfg.command[0]).name, user=self.who.user,
                      run_url=self.cfg.run_url)
        while self.proc.poll() is None:
            if self.stop_signal is not None:
                self._forward_stop()
                self._stop_job()
                break
            time.sleep(0.1)
        return self._finish(self.proc.wait())

    def _stop_job(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.cfg.grace_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.proc.poll() is None:
            self.log.warning("job.killed", f"the job did not exit within the grace period "
                             f"({self.cfg.grace_s:g} s): killing its process group",
                             pid=self.proc.pid)
            self._kill_group(signal.SIGKILL)

    def _finish(self, code: int | None) -> Exit:
        if self.proc is not None:
            self._kill_group(signal.SIGTERM, leftovers=True)
        if code is None:
            self.status.update_job(state="not started")
            self.log.info("runner.stopped", "stopped before the job started")
            return Exit.OK
        sig = -code if code < 0 else None
        self.status.update_job(state="exited", exit_code=code, signal=sig, ended_at=time.time())
        status = Exit.OK if code == 0 else Exit.JOB_FAILED
        self.poller.poll_once()  # the job's final checkpoint, for the log line below
        latest = self.status.snapshot()["latest_checkpoint"]
        self.log.event("info" if status is Exit.OK else "error", "job.exited",
                       f"the training command exited with {code}" if sig is None else
                       f"the training command was killed by signal {sig}",
                       exit_code=code, exit_status=int(status),
                       latest_step=latest["step"] if latest else None)
        return status

    def _kill_group(self, sig: int, leftovers: bool = False) -> None:
        """Signal the job's process group; after the job exited, end what it left behind."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if leftovers:
            self.log.warning("job.leftovers", "the job left processes running: stopping them",
                             pid=self.proc.pid)
            deadline = time.monotonic() + KILL_WAIT_S
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _job_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # systemd's socket is the runner's, not the job's
        env.update(HOME=self.who.home if os.path.isdir(self.who.home) else self.cfg.workdir,
                   USER=self.who.user, LOGNAME=self.who.user)
        env.update(self.cfg.env)
        env.update({REGISTRY_ENV: self.cfg.registry, RUN_ID_ENV: self.cfg.run_id,
                    RUN_URL_ENV: self.cfg.run_url, REQUEST_ENV: self.cfg.request_file})
        return env

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # Only a flag: the main loop acts on it (a handler that took a lock could deadlock
        # against the code it interrupted).
        if self.stop_signal is None:
            self.stop_signal = signum

    def _forward_stop(self) -> None:
        assert self.stop_signal is not None
        name = signal.Signals(self.stop_signal).name
        self.log.info("runner.stop_signal", f"{name}: asking the job for a final checkpoint "
                      f"and forwarding {name}", grace_s=self.cfg.grace_s)
        self._request("stop", signal=name)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, self.stop_signal)
            self.status.update_job(state="stopping")

    def _on_spot_notice(self, notice: dict[str, Any]) -> None:
        self.status.set(spot_notice=notice)
        self._request("spot-interruption", **notice)

    def _request(self, reason: str, **details: Any) -> None:
        with self._request_lock:
            try:
                write_request(self.cfg.request_file, reason, **details)
            except OSError as exc:
                self.log.error("job.request_failed", f"cannot write the checkpoint request "
                               f"{self.cfg.request_file}: {exc.strerror or exc}")
                return
            self.status.set(request={"reason": reason, "requested_at": round(time.time(), 3),
                                     **details})


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
