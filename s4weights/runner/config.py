"""The runner's one config file (TOML, written by the stack's user data), parsed into frozen
dataclasses. Every key is checked for type and range here, and unknown keys are refused, so a
typo fails at start with the key's name instead of being silently ignored."""

from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from s4format.errors import S4Error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Ubuntu 22.04's Python; the runner extra installs tomli there
    import tomli as tomllib

DEFAULT_PATH = Path("/etc/s4weights/runner.toml")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ConfigError(S4Error):
    """The runner's config file is missing, unreadable or invalid."""


@dataclass(frozen=True)
class Entitlement:
    product_code: str
    public_key_version: int
    region: str | None = None
    attempts: int = 3
    timeout_s: float = 10.0


@dataclass(frozen=True)
class Health:
    address: str = "0.0.0.0"
    port: int = 8080
    refresh_s: float = 15.0
    gpu_devices: str = "/dev/nvidia[0-9]*"
    max_clients: int = 32
    client_timeout_s: float = 5.0


@dataclass(frozen=True)
class Spot:
    enabled: bool = True
    poll_s: float = 5.0
    imds_endpoint: str | None = None  # None: AWS_EC2_METADATA_SERVICE_ENDPOINT or the default


@dataclass(frozen=True)
class Config:
    run_id: str
    registry: str
    command: tuple[str, ...]
    user: str
    entitlement: Entitlement
    workdir: str = "/var/lib/s4-runner"
    request_file: str = "/run/s4-runner/checkpoint-request"
    grace_s: float = 110.0
    env: dict[str, str] = field(default_factory=dict)
    health: Health = field(default_factory=Health)
    spot: Spot = field(default_factory=Spot)

    @property
    def run_url(self) -> str:
        """The run's store: where the job saves and ``/status`` reads the manifests."""
        return f"{self.registry.rstrip('/')}/{self.run_id}"


def load(path: str | Path = DEFAULT_PATH) -> Config:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the runner config {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return parse(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse(data: dict[str, Any]) -> Config:
    top = _Table(data, "")
    job = _Table(top.table("job"), "job.")
    env = _env(job.take("env", dict, {}))
    job.done()
    cfg = Config(
        run_id=top.text("run_id", pattern=RUN_ID),
        registry=_registry(top.text("registry")),
        command=_command(top.take("command", (str, list))),
        user=top.text("user"),
        workdir=top.text("workdir", Config.workdir),
        request_file=top.text("request_file", Config.request_file),
        grace_s=top.number("grace_s", Config.grace_s, low=0.0),
        env=env,
        entitlement=_entitlement(top.table("entitlement")),
        health=_health(top.table("health")),
        spot=_spot(top.table("spot")),
    )
    top.done()
    return cfg


def _entitlement(d: dict[str, Any]) -> Entitlement:
    t = _Table(d, "entitlement.")
    e = Entitlement(product_code=t.text("product_code"),
                    public_key_version=t.integer("public_key_version", low=1),
                    region=t.text("region", None), attempts=t.integer("attempts", 3, low=1,
                                                                     high=10),
                    timeout_s=t.number("timeout_s", 10.0, low=0.1, high=120.0))
    t.done()
    return e


def _health(d: dict[str, Any]) -> Health:
    t = _Table(d, "health.")
    h = Health(address=t.text("address", Health.address),
               port=t.integer("port", Health.port, low=1, high=65535),
               refresh_s=t.number("refresh_s", Health.refresh_s, low=0.1),
               gpu_devices=t.text("gpu_devices", Health.gpu_devices),
               max_clients=t.integer("max_clients", Health.max_clients, low=1, high=1024),
               client_timeout_s=t.number("client_timeout_s", Health.client_timeout_s,
                                         low=0.1, high=60.0))
    t.done()
    return h


def _spot(d: dict[str, Any]) -> Spot:
    t = _Table(d, "spot.")
    s = Spot(enabled=t.take("enabled", bool, True), poll_s=t.number("poll_s", 5.0, low=0.1),
             imds_endpoint=t.text("imds_endpoint", None))
    t.done()
    return s


def _registry(url: str) -> str:
    if not re.match(r"(s3|file)://.", url):
        raise ConfigError(f"registry must be an s3://bucket/prefix or file:// URL, not {url!r}")
    return url


def _command(value: str | list[Any]) -> tuple[str, ...]:
    """A list is the argv; a string is split as a shell would split words (no shell runs)."""
    try:
        argv = shlex.split(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise ConfigError(f"command: cannot split {value!r}: {exc}") from None
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise ConfigError("command must be a non-empty string or list of non-empty strings")
    return tuple(argv)


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
            and isinstance(v, str) for k, v in value.items()):
        raise ConfigError("job.env must be a table of NAME = \"string\" entries")
    return dict(value)


class _Table:
    """One TOML table: typed reads that remember which keys were used."""

    def __init__(self, data: Any, prefix: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{prefix.rstrip('.')} must be a table")
        self.data, self.prefix, self.used = data, prefix, set()

    def take(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise ConfigError(f"{self.prefix}{key} is required")
            return default
        value = self.data[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{self.prefix}{key} has the wrong type ({type(value).__name__})")
        return value

    def text(self, key: str, default: Any = ..., pattern: re.Pattern[str] | None = None) -> Any:
        value = self.take(key, str, default)
        if isinstance(value, str) and (not value or (pattern and not pattern.fullmatch(value))):
            raise ConfigError(f"{self.prefix}{key} is empty or malformed: {value!r}")
        return value

    def integer(self, key: str, default: Any = ..., low: int = 0, high: int = 2**31) -> int:
        value = self.take(key, int, default)
        if not low <= value <= high:
            raise ConfigError(f"{self.prefix}{key} must be in [{low}, {high}], not {value}")
        return value

    def number(self, key: str, default: Any = ..., low: float = 0.0,
               high: float = 1e9) -> float:
        value = float(self.take(key, (int, float), default))
        if not (math.isfinite(value) and low <= value <= high):
            raise ConfigError(f"{self.prefix}{key} must be in [{low}, {high}], not {value}")
        return value

    def table(self, key: str) -> dict[str, Any]:
        return self.take(key, dict, {})

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(self.prefix + k for k in unknown)}")
