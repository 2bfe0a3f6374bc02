"""The EC2 spot interruption notice, polled through IMDSv2 (a token from
``PUT /latest/api/token``, then ``GET /latest/meta-data/spot/instance-action``: 404 while no
interruption is scheduled). The first notice calls ``on_notice`` once; IMDS errors are logged
once and polling goes on, since a missed notice costs a checkpoint, not correctness."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from s4weights.runner.config import Spot
from s4weights.runner.logs import Log

DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_S = 21600
TIMEOUT_S = 2.0
# IMDS is link-local: a proxy from the environment must never see these requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def endpoint(cfg: Spot) -> str:
    return (cfg.imds_endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
            or DEFAULT_ENDPOINT).rstrip("/")


class SpotWatch:
    def __init__(self, cfg: Spot, log: Log, on_notice: Callable[[dict[str, Any]], None]) -> None:
        self.cfg, self.log, self.on_notice = cfg, log, on_notice
        self.base = endpoint(cfg)
        self.notice: dict[str, Any] | None = None
        self._token: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="spot-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set() and self.notice is None:
            try:
                notice = self.poll()
            except (OSError, ValueError, RecursionError) as exc:
                if not self._failing:
                    self.log.warning("spot.imds_unreachable", f"cannot read the spot notice "
                                     f"from {self.base}: {exc}; retrying every "
                                     f"{self.cfg.poll_s:g} s")
                self._failing = True
                self._token = None
            else:
                self._failing = False
                if notice is not None:
                    self.notice = notice
                    self.log.warning("spot.interruption", "spot interruption notice: asking "
                                     "the job for a checkpoint", action=notice.get("action"),
                                     time=notice.get("time"))
                    self.on_notice(notice)
            self._stop.wait(self.cfg.poll_s)

    def poll(self) -> dict[str, Any] | None:
        """The instance-action document, or None while no interruption is scheduled."""
        req = urllib.request.Request(f"{self.base}/latest/meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": self._token_value()})
        try:
            with _OPENER.open(req, timeout=TIMEOUT_S) as resp:
                body = resp.read(65536)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            if exc.code == 401:
                self._token = None  # expired or rejected: a new one next time
            raise
        notice = json.loads(body)
        if not isinstance(notice, dict):
            raise ValueError("the instance-action document is not a JSON object")
        return {k: notice[k] for k in ("action", "time") if isinstance(notice.get(k), str)}

    def _token_value(self) -> str:
        now = time.monotonic()
        if self._token is None or now > self._token[1]:
            req = urllib.request.Request(
                f"{self.base}/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            with _OPENER.open(req, timeout=TIMEOUT_S) as resp:
                token = resp.read(4096).decode("ascii")
            self._token = (token, now + TOKEN_TTL_S / 2)
        return self._token[0]
