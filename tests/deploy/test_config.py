"""The runner's config file and its journal protocol, in-process: every key checked, unknown
keys refused, and events as native journal datagrams on a real Unix socket."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from s4weights.runner import Exit
from s4weights.runner.config import ConfigError, load, parse
from s4weights.runner.logs import Log

GOOD = {"run_id": "run-1", "registry": "s3://bucket/prefix", "user": "s4runner",
        "command": "python train.py --lr '3e-4 x'",
        "entitlement": {"product_code": "abc", "public_key_version": 1}}


def test_defaults_and_split_command() -> None:
    cfg = parse(GOOD)
    assert cfg.command == ("python", "train.py", "--lr", "3e-4 x")
    assert cfg.run_url == "s3://bucket/prefix/run-1"
    assert (cfg.health.address, cfg.health.port, cfg.grace_s) == ("0.0.0.0", 8080, 110.0)
    assert cfg.entitlement.attempts == 3 and cfg.spot.enabled


@pytest.mark.parametrize(("change", "message"), [
    ({"run_id": "../x"}, "run_id is empty or malformed"),
    ({"registry": "http://x"}, "registry must be an s3://bucket/prefix or file:// URL"),
    ({"command": []}, "command must be a non-empty string or list"),
    ({"command": "python 'unclosed"}, "command: cannot split"),
    ({"grace_s": -1}, "grace_s must be in"),
    ({"grace_s": True}, "grace_s has the wrong type (bool)"),
    ({"colour": "blue"}, "unknown key(s) colour"),
    ({"health": {"port": 70000}}, "health.port must be in [1, 65535]"),
    ({"health": {"prot": 1}}, "unknown key(s) health.prot"),
    ({"entitlement": {"product_code": "abc"}}, "entitlement.public_key_version is required"),
    ({"job": {"env": {"1BAD": "x"}}}, "job.env must be a table"),
    ({"spot": {"enabled": "yes"}}, "spot.enabled has the wrong type (str)"),
])
def test_invalid_config(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse({**GOOD, **change})
    assert message in str(e.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the runner config"):
        load(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("run_id = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load(bad)


def test_check_config_exit_status(tmp_path: Path) -> None:
    bad = tmp_path / "runner.toml"
    bad.write_text('run_id = "r"\n')
    p = subprocess.run([sys.executable, "-m", "s4weights.runner", "--check-config", "--config",
                        str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode == Exit.CONFIG
    assert '"event": "config.invalid"' in p.stderr and "registry is required" in p.stderr


def _fields(datagram: bytes) -> dict[str, str]:
    out, i = {}, 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        line = datagram[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            i = nl + 1
        else:  # NAME\n, 64-bit little-endian length, value, \n
            k = line
            (n,) = struct.unpack("<Q", datagram[nl + 1:nl + 9])
            v = datagram[nl + 9:nl + 9 + n]
            i = nl + 9 + n + 1
        out[k.decode()] = v.decode()
    return out


def test_journal_fields(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as journal:
        journal.bind(path)
        journal.settimeout(5)
        log = Log(journal_socket=path, run_id="run-1")
        log.error("entitlement.refused", "refused:\nline two", code="X", exit_status=80)
        got = _fields(journal.recv(65536))
    assert got == {"MESSAGE": "refused:\nline two", "PRIORITY": "3",
                   "SYSLOG_IDENTIFIER": "s4-runner", "S4_EVENT": "entitlement.refused",
                   "S4_RUN_ID": "run-1", "S4_CODE": "X", "S4_EXIT_STATUS": "80"}


def test_journal_gone_falls_back_to_stderr(tmp_path: Path, capsys) -> None:
    Log(journal_socket=str(tmp_path / "none.sock")).info("job.started", "started", pid=7)
    assert '"event": "job.started"' in capsys.readouterr().err
