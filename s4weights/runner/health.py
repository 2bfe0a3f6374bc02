"""The health port: ``GET``/``HEAD`` on ``/healthz``, ``/readyz`` and ``/status``, nothing else.

Hostile or broken clients cost at most one bounded thread each: a connection limit (new ones
past it are closed at once), a per-read timeout for slow clients, and http.server's limits on
request line and header sizes (414 and 431). A handler's failure answers 500 and is logged; it
never reaches the runner's main thread.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from s4weights.runner.config import Health
from s4weights.runner.logs import Log
from s4weights.runner.status import RunStatus


class HealthServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, cfg: Health, status: RunStatus, log: Log) -> None:
        self.address_family = socket.AF_INET6 if ":" in cfg.address else socket.AF_INET
        self.status, self.log = status, log
        self.client_timeout = cfg.client_timeout_s
        self._slots = threading.BoundedSemaphore(cfg.max_clients)
        super().__init__((cfg.address, cfg.port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the limit: refuse rather than queue threads
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.log.warning("health.client_error", "a health request failed",
                         client=str(client_address[0]))


class _Handler(BaseHTTPRequestHandler):
    server: HealthServer
    server_version = "s4-runner"
    sys_version = ""
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        self.timeout = self.server.client_timeout
        super().setup()

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = urlsplit(self.path).path
        st = self.server.status
        try:
            if path == "/healthz":
                code, doc = 200, {"status": "alive"}
            elif path == "/readyz":
                ready, reasons = st.readiness()
                code, doc = (200 if ready else 503), {"ready": ready, "reasons": reasons}
            elif path == "/status":
                code, doc = 200, st.snapshot()
            else:
                code, doc = 404, {"error": "not found: use /healthz, /readyz or /status"}
        except Exception as exc:  # a bug here must cost one answer, not the server
            self.server.log.error("health.handler_failed", f"{path}: {type(exc).__name__}: "
                                  f"{exc}"[:500])
            code, doc = 500, {"error": "internal error"}
        data = (json.dumps(doc, default=str) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            with contextlib.suppress(OSError):
                self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would flood the journal: requests are not logged."""
