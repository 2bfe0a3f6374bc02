"""Local stand-ins for the AWS endpoints the runner calls, as real HTTP servers on loopback:
AWS Marketplace Metering (JSON 1.1 protocol, ``X-Amz-Target: AWSMPMeteringService.*``) and the
EC2 instance metadata service (IMDSv2: a token from ``PUT /latest/api/token``)."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TARGET = "AWSMPMeteringService.RegisterUsage"
REFUSALS = ("CustomerNotEntitledException", "InvalidProductCodeException",
            "InvalidPublicKeyVersionException", "PlatformNotSupportedException",
            "DisabledApiException", "ThrottlingException", "InternalServiceErrorException")


def _b64(doc: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


def signature(nonce: str, product_code: str) -> str:
    """A JWT-shaped RegisterUsage signature (the runner checks its shape, AWS signs it)."""
    return ".".join([_b64({"alg": "PS256", "typ": "JWT"}),
                     _b64({"productCode": product_code, "nonce": nonce,
                           "issuedAt": int(time.time())}), "c2lnbmF0dXJl"])


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and left: what the slow mode is for

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.requests: list[dict[str, Any]] = []
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                         daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class MeteringServer(_Server):
    """``mode``: "entitled", an error code (REFUSALS, or any other ``...Exception``),
    "no-signature", "not-jwt" or "not-json"; every answer comes after ``delay_s``."""

    def __init__(self) -> None:
        super().__init__(_MeteringHandler)
        self.mode = "entitled"
        self.delay_s = 0.0


class _MeteringHandler(BaseHTTPRequestHandler):
    server: MeteringServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        srv = self.server
        srv.requests.append({"target": self.headers.get("X-Amz-Target"), "body": body,
                             "signed": "AWS4-HMAC-SHA256" in self.headers.get("Authorization",
                                                                              "")})
        if self.headers.get("X-Amz-Target") != TARGET:
            return self._send(400, {"__type": "UnknownOperationException"})
        if srv.delay_s:
            time.sleep(srv.delay_s)
        if srv.mode.endswith("Exception"):
            code = 500 if srv.mode == "InternalServiceErrorException" else 400
            return self._send(code, {"__type": srv.mode, "message": f"test: {srv.mode}"})
        answer: dict[str, Any] = {"PublicKeyRotationTimestamp": time.time()}
        if srv.mode == "not-json":
            return self._send(200, None, b"<html>not json</html>")
        if srv.mode == "not-jwt":
            answer["Signature"] = "just-a-string"
        elif srv.mode != "no-signature":
            answer["Signature"] = signature(body.get("Nonce", ""), body.get("ProductCode", ""))
        self._send(200, answer)

    def _send(self, code: int, doc: dict[str, Any] | None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        if doc and "__type" in doc:
            self.send_header("x-amzn-ErrorType", doc["__type"])
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class ImdsServer(_Server):
    """IMDSv2: ``notice`` None answers 404 for the instance action, else that document."""

    def __init__(self) -> None:
        super().__init__(_ImdsHandler)
        self.token = "imds-token-for-tests"
        self.notice: dict[str, str] | None = None


class _ImdsHandler(BaseHTTPRequestHandler):
    server: ImdsServer

    def do_PUT(self) -> None:
        self.server.requests.append({"method": "PUT", "path": self.path})
        if self.path != "/latest/api/token" or \
                not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._send(400, b"")
        self._send(200, self.server.token.encode())

    def do_GET(self) -> None:
        srv = self.server
        srv.requests.append({"method": "GET", "path": self.path})
        if self.headers.get("X-aws-ec2-metadata-token") != srv.token:
            return self._send(401, b"")
        if self.path != "/latest/meta-data/spot/instance-action" or srv.notice is None:
            return self._send(404, b"")
        self._send(200, json.dumps(srv.notice).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
