"""A loopback TCP proxy that counts bytes and injects faults between a client and the server.

It never parses the traffic it relays, so it works for HTTP and HTTPS alike. Clients keep
connections alive, so faults cannot be chosen per request; instead, with ``mean_drop_after`` set,
every connection is reset (RST) after an exponentially distributed number of relayed bytes —
a constant fault rate per byte, mid-request or mid-response — and the churn this causes gives
fresh connections, ``slowdown_rate`` of which (plain HTTP only) get their first request answered
with ``503 SlowDown`` and are closed, as S3 does when it throttles.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
from dataclasses import dataclass, field

SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s")
SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class ProxyStats:
    to_server: int = 0
    to_client: int = 0
    connections: int = 0
    drops: int = 0
    slowdowns: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, attr: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, attr, getattr(self, attr) + n)


def _reset(sock: socket.socket) -> None:
    # SO_LINGER 0: close sends RST, the way a dying load balancer does.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class FaultProxy:
    def __init__(self, target_port: int, *, mean_drop_after: int | None = None,
                 slowdown_rate: float = 0.0, seed: int = 0) -> None:
        self.target = ("127.0.0.1", target_port)
        self.mean_drop_after = mean_drop_after
        self.slowdown_rate = slowdown_rate
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_faults(self, mean_drop_after: int | None, slowdown_rate: float) -> None:
        self.mean_drop_after, self.slowdown_rate = mean_drop_after, slowdown_rate

    def reset_counts(self) -> None:
        with self.stats.lock:
            self.stats.to_server = self.stats.to_client = 0

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.stats.add("connections")
            mean = self.mean_drop_after
            with self._rng_lock:
                slowdown = self._rng.random() < self.slowdown_rate
                drop_after = 1 + int(self._rng.expovariate(1 / mean)) if mean else None
            if slowdown:
                threading.Thread(target=self._slowdown, args=(client,), daemon=True).start()
            else:
                threading.Thread(target=self._relay, args=(client, drop_after),
                                 daemon=True).start()

    def _slowdown(self, client: socket.socket) -> None:
        client.settimeout(5)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = client.recv(65536)
                if not chunk:
                    break
                head += chunk
            client.sendall(SLOWDOWN % (len(SLOWDOWN_BODY), SLOWDOWN_BODY))
            self.stats.add("slowdowns")
            client.shutdown(socket.SHUT_WR)
            client.settimeout(0.5)
            while client.recv(65536):
                pass
        except OSError:
            pass
        finally:
            client.close()

    def _relay(self, client: socket.socket, drop_after: int | None) -> None:
        try:
            server = socket.create_connection(self.target, timeout=10)
        except OSError:
            _reset(client)
            return
        server.settimeout(None)
        state = {"left": drop_after, "dead": False}
        lock = threading.Lock()

        def kill() -> None:
            with lock:
                if state["dead"]:
                    return
                state["dead"] = True
            _reset(client)
            _reset(server)

        def pump(src: socket.socket, dst: socket.socket, counter: str) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        dst.shutdown(socket.SHUT_WR)  # orderly end: pass the FIN on
                        return
                    with lock:
                        left = state["left"]
                        if left is not None:
                            state["left"] = left - len(data)
                    if left is not None and left <= len(data):
                        self.stats.add("drops")
                        dst.sendall(data[:left // 2])
                        break
                    dst.sendall(data)
                    self.stats.add(counter, len(data))
            except OSError:
                pass
            kill()

        t = threading.Thread(target=pump, args=(server, client, "to_client"), daemon=True)
        t.start()
        pump(client, server, "to_server")
        t.join()
        with lock:
            if not state["dead"]:
                client.close()
                server.close()
