"""The entitled runner with real processes: health endpoints while the job trains, /status
from the registry's manifests, a spot notice, SIGTERM forwarded to the job and its final
checkpoint; bad clients on the health port; the switch to the unprivileged user."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from s4weights.runner import Exit
from tests.deploy.conftest import SECRET_ARG
from tests.s3 import seaweed


def job_events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_entitled_run(launch, metering, imds, runner_user, registry_env) -> None:
    from s4weights import list_checkpoints, load_checkpoint

    metering.delay_s = 0.3  # slow, but within entitlement.timeout_s
    r = launch(gpu=True)
    r.wait_for("/healthz", lambda: r.get("/healthz")[0] == 200)
    assert r.get("/healthz") == (200, {"status": "alive"})
    r.wait_for("/readyz 200", lambda: r.get("/readyz")[0] == 200)
    assert r.get("/readyz") == (200, {"ready": True, "reasons": []})

    st = r.wait_for("two checkpoints in /status",
                    lambda: (d := r.get("/status")[1])["checkpoints"] and d["checkpoints"] >= 2
                    and d)
    started = json.loads((r.dir / "started.json").read_text())
    assert st["job"]["state"] == "running" and st["job"]["pid"] == started["pid"]
    assert st["job"]["exit_code"] is None and st["entitled"] is True
    assert st["run_url"] == r.run_url and st["registry_error"] is None
    assert started["env"]["S4_RUN_URL"] == r.run_url and started["env"]["S4_RUN_ID"] == "run-1"
    assert started["resuid"] == [runner_user.uid] * 3
    latest = st["latest_checkpoint"]
    listed = {i.step: i for i in list_checkpoints(r.run_url)}
    info = listed[latest["step"]]
    assert (latest["raw_bytes"], latest["stored_bytes"], latest["file_bytes"]) == \
        (info.raw_bytes, info.stored_bytes, info.file_bytes)
    assert latest["ratio"] == round(info.stored_bytes / info.raw_bytes, 4)
    assert 0 <= latest["age_s"] < 60 and latest["step"] % 4 == 0

    imds.notice = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}
    spot = r.wait_for("the spot checkpoint", lambda: [
        e for e in job_events(r.dir) if e["reason"] == "spot-interruption"])
    st = r.get("/status")[1]
    assert st["spot_notice"] == imds.notice
    assert st["checkpoint_request"]["reason"] == "spot-interruption"
    r.wait_for("the request acknowledged", lambda: not Path(
        json.loads((r.dir / "started.json").read_text())["env"]["S4_CHECKPOINT_REQUEST"]
    ).exists())
    assert spot[0]["step"] in {i.step for i in list_checkpoints(r.run_url)}

    r.proc.send_signal(signal.SIGTERM)
    assert r.wait(60) == Exit.OK
    final = json.loads((r.dir / "final.json").read_text())["step"]
    assert job_events(r.dir)[-1] == {"step": final, "reason": "stop"}
    assert max(i.step for i in list_checkpoints(r.run_url)) == final
    back = load_checkpoint(r.run_url, final)
    assert back["step"] == final and bool((back["w"] == float(final)).all())
    events = {e["event"]: e for e in r.events()}
    assert events["runner.stop_signal"]["grace_s"] == 30.0
    assert events["job.exited"]["exit_code"] == 0
    assert events["job.exited"]["latest_step"] == final
    text = r.log_text() + json.dumps(st)
    assert seaweed.SECRET_KEY not in text and SECRET_ARG not in text


def raw_request(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` as is and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_line(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


SLEEPER = ["/bin/sh", "-c", "exec sleep 60"]


def test_bad_requests_never_stop_the_runner(launch) -> None:
    r = launch(SLEEPER, health={"max_clients": 8})
    r.wait_for("/healthz", lambda: r.get("/healthz")[0] == 200)
    code, doc = r.get("/readyz")  # no GPU device here: not ready, and it says why
    assert code == 503 and doc["ready"] is False
    assert any(x.startswith("no GPU visible") for x in doc["reasons"])
    for path in ("/", "/metrics", "/healthz/", "/status/../status", "/%00", "/readyz%20"):
        assert r.get(path) == (404, {"error": "not found: use /healthz, /readyz or /status"})
    assert r.get("/status?verbose=1")[0] == 200  # a query string does not change the route
    p = r.port
    assert status_line(raw_request(p, b"POST /healthz HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc")
                       ) == 501
    assert status_line(raw_request(p, b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n")) == 414
    big = b"GET /healthz HTTP/1.0\r\nX-Big: " + b"b" * 100_000 + b"\r\n\r\n"
    assert status_line(raw_request(p, big)) == 431
    many = b"GET /healthz HTTP/1.0\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
    assert status_line(raw_request(p, many + b"\r\n")) == 431
    # a TLS hello: a one-word request line, answered as HTTP/0.9 (a body, no status line)
    assert b"Error code: 400" in raw_request(p, b"\x16\x03\x01\x02\x00\x01\xfc\x03\x03\r\n\r\n")
    assert raw_request(p, b"GET /healthz HTTP/1.0\r\n") == b""  # unfinished: timed out
    # slow clients, more than max_clients: each holds a connection open, sending nothing
    slow = [socket.create_connection(("127.0.0.1", p)) for _ in range(20)]
    for s in slow[:10]:
        s.sendall(b"GET /sta")
    time.sleep(0.3)
    with socket.create_connection(("127.0.0.1", p)) as s:
        s.close()  # connect and leave
    t0 = time.monotonic()
    r.wait_for("/healthz after the slow clients",
               lambda: r.get("/healthz", timeout=1.0)[0] == 200, timeout=30, every=0.3)
    assert time.monotonic() - t0 < 10  # client_timeout_s (1 s) frees the slots
    for s in slow:
        s.close()
    assert r.proc.poll() is None
    assert r.get("/status")[1]["job"]["state"] == "running"
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait(30) == Exit.JOB_FAILED  # sleep dies of the forwarded SIGTERM
    exited = [e for e in r.events() if e["event"] == "job.exited"]
    assert exited[0]["exit_code"] == -signal.SIGTERM


def _proc_status(pid: int) -> dict[str, str]:
    return _proc_status_text(Path(f"/proc/{pid}/status").read_text())


def test_privileges_dropped(launch, runner_user) -> None:
    if not runner_user.as_root:
        pytest.skip("the switch from root is tested as root (CI runs as root)")
    r = launch(["/bin/sh", "-c", 'cat /proc/self/status > job-status; exec sleep 60'])
    r.wait_for("/healthz", lambda: r.get("/healthz")[0] == 200)
    ids = f"{runner_user.uid}\t{runner_user.uid}\t{runner_user.uid}\t{runner_user.uid}"
    gids = f"{runner_user.gid}\t{runner_user.gid}\t{runner_user.gid}\t{runner_user.gid}"
    runner = _proc_status(r.proc.pid)
    assert runner["Uid"] == ids and runner["Gid"] == gids
    assert runner["Groups"].split() == [str(runner_user.gid)]
    assert runner["CapEff"] == runner["CapPrm"] == "0000000000000000"
    assert runner["NoNewPrivs"] == "1"
    dropped = next(e for e in r.events() if e["event"] == "privileges.dropped")
    assert dropped["uid"] == runner_user.uid and dropped["gid"] == runner_user.gid
    work = r.extra["base"] / "work"  # the job's working directory
    job = r.wait_for("the job's status", lambda: (work / "job-status").exists()
                     and _proc_status_text((work / "job-status").read_text()))
    assert job["Uid"] == ids and job["Gid"] == gids and job["CapEff"] == "0000000000000000"
    assert job["NoNewPrivs"] == "1"


def _proc_status_text(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


@pytest.mark.parametrize("user", ["root", "no-such-user-s4"])
def test_refuses_to_run_as_root_or_unknown_user(launch, metering, user: str) -> None:
    r = launch(SLEEPER, user=user)
    assert r.wait(60) == Exit.PRIVILEGES
    failed = [e for e in r.events() if e["event"] == "privileges.failed"]
    assert failed and failed[0]["exit_status"] == Exit.PRIVILEGES
    assert ("root" if user == "root" else "does not exist") in failed[0]["message"]
    assert metering.requests == []  # nothing else happened: not even the entitlement call


def test_busy_health_port(launch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = launch(SLEEPER, health={"port": taken.getsockname()[1]})
        assert r.wait(60) == Exit.HEALTH_PORT
    failed = next(e for e in r.events() if e["event"] == "health.bind_failed")
    assert failed["exit_status"] == Exit.HEALTH_PORT
    assert "job.started" not in [e["event"] for e in r.events()]
