"""Structured logs: one event per call, as journal fields when stderr is the journal (the
native protocol on journald's socket), else as one JSON object per line on stderr.

Events carry a name (``S4_EVENT``), a message and flat fields; callers pass only values that
may be shown to anyone who reads the logs: never credentials, tokens, signatures or the
training command's arguments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, TextIO

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "s4-runner"
PRIORITY = {"debug": 7, "info": 6, "notice": 5, "warning": 4, "error": 3}
MAX_VALUE = 4096  # longer values are cut: one event must fit in one datagram


def journal_stderr() -> bool:
    """True when systemd connected stderr to the journal (``JOURNAL_STREAM`` names it)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def journal_field(name: str, value: str) -> bytes:
    """One field in journald's native format: ``NAME=value\\n``, or length-prefixed when the
    value holds a newline."""
    data = value.encode("utf-8", "replace")[:MAX_VALUE]
    key = name.encode("ascii")
    if b"\n" in data:
        return key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key + b"=" + data + b"\n"


def _field_name(key: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in key.upper())
    return name if name.startswith("S4_") else f"S4_{name}"


class Log:
    """Where the runner's events go. Thread-safe; a failed write never raises."""

    def __init__(self, stream: TextIO | None = None, journal_socket: str | None = None,
                 level: str = "info", **context: Any) -> None:
        self.stream = stream or sys.stderr
        self.journal = journal_socket
        self.level = PRIORITY[level]
        self.context = context
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @classmethod
    def for_process(cls, level: str = "info") -> Log:
        return cls(journal_socket=JOURNAL_SOCKET if journal_stderr() else None, level=level)

    def event(self, level: str, name: str, message: str, **fields: Any) -> None:
        if PRIORITY[level] > self.level:
            return
        fields = {**self.context, **fields}
        with self._lock:
            if self.journal is None or not self._to_journal(level, name, message, fields):
                self._to_stream(level, name, message, fields)

    def info(self, name: str, message: str, **fields: Any) -> None:
        self.event("info", name, message, **fields)

    def warning(self, name: str, message: str, **fields: Any) -> None:
        self.event("warning", name, message, **fields)

    def error(self, name: str, message: str, **fields: Any) -> None:
        self.event("error", name, message, **fields)

    def _to_journal(self, level: str, name: str, message: str, fields: dict[str, Any]) -> bool:
        parts = [journal_field("MESSAGE", message),
                 journal_field("PRIORITY", str(PRIORITY[level])),
                 journal_field("SYSLOG_IDENTIFIER", IDENTIFIER),
                 journal_field("S4_EVENT", name)]
        parts += [journal_field(_field_name(k), _text(v)) for k, v in fields.items()
                  if v is not None]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto(b"".join(parts), self.journal)
            return True
        except OSError:
            return False  # journald gone or restarting: the line goes to stderr instead

    def _to_stream(self, level: str, name: str, message: str, fields: dict[str, Any]) -> None:
        record = {"ts": round(time.time(), 3), "level": level, "event": name,
                  "message": message, **{k: v for k, v in fields.items() if v is not None}}
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(json.dumps(record, default=str) + "\n")
            self.stream.flush()


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


class Forward(logging.Handler):
    """Library warnings (``s4weights``, ``botocore``) as runner events, so they are structured
    too and never printed with a traceback's locals."""

    def __init__(self, log: Log) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        level = "error" if record.levelno >= logging.ERROR else "warning"
        self.log.event(level, f"library.{record.name}", record.getMessage()[:MAX_VALUE])
