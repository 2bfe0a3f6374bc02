"""Fail closed: every way RegisterUsage can fail ends the runner with that failure's own exit
status, one log line, no health port and no training command (the job's first act is to write
``started.json``, which must never appear)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from s4weights.runner import Exit
from tests.deploy.conftest import PRODUCT_CODE, SECRET_ARG
from tests.deploy.servers import TARGET, closed_port
from tests.s3 import seaweed

# mode of the Metering server -> (exit status, code logged, requests expected with attempts=2)
REFUSALS: dict[str, tuple[Exit, str, int]] = {
    "CustomerNotEntitledException": (Exit.NOT_ENTITLED, "CustomerNotEntitledException", 1),
    "InvalidProductCodeException": (Exit.INVALID_PRODUCT_CODE, "InvalidProductCodeException", 1),
    "InvalidPublicKeyVersionException": (Exit.INVALID_PUBLIC_KEY_VERSION,
                                         "InvalidPublicKeyVersionException", 1),
    "PlatformNotSupportedException": (Exit.PLATFORM_NOT_SUPPORTED,
                                      "PlatformNotSupportedException", 1),
    "DisabledApiException": (Exit.METERING_DISABLED, "DisabledApiException", 1),
    "ThrottlingException": (Exit.THROTTLED, "ThrottlingException", 2),
    "InternalServiceErrorException": (Exit.UNREACHABLE, "InternalServiceErrorException", 2),
    "AccessDeniedException": (Exit.REFUSED, "AccessDeniedException", 1),
    "no-signature": (Exit.MALFORMED_ANSWER, "MalformedAnswer", 1),
    "not-jwt": (Exit.MALFORMED_ANSWER, "MalformedAnswer", 1),
    "not-json": (Exit.MALFORMED_ANSWER, "MalformedAnswer", 1),
}


def assert_refused(r: Any, status: Exit, code: str) -> None:
    got = r.wait(60)
    assert got == status, f"exit {got}, want {int(status)}; log:\n{r.log_text()[-3000:]}"
    assert not (r.dir / "started.json").exists(), "the training command ran"
    names = [e["event"] for e in r.events()]
    assert "job.started" not in names and "health.listening" not in names
    refused = [e for e in r.events() if e["event"] == "entitlement.refused"]
    assert len(refused) == 1, names
    assert refused[0]["exit_status"] == status and refused[0]["code"] == code
    assert refused[0]["level"] == "error" and "will not run" in refused[0]["message"]
    with socket.socket() as s:  # nothing listens on the health port
        assert s.connect_ex(("127.0.0.1", r.port)) != 0
    text = r.log_text()
    assert seaweed.SECRET_KEY not in text and SECRET_ARG not in text


@pytest.mark.parametrize("mode", list(REFUSALS))
def test_refusal(launch, metering, mode: str) -> None:
    status, code, requests = REFUSALS[mode]
    metering.mode = mode
    r = launch()
    assert_refused(r, status, code)
    assert len(metering.requests) == requests  # retries are bounded by entitlement.attempts
    for req in metering.requests:
        assert req["target"] == TARGET and req["signed"]
        assert req["body"]["ProductCode"] == PRODUCT_CODE
        assert req["body"]["PublicKeyVersion"] == 1
    assert len({req["body"]["Nonce"] for req in metering.requests}) == 1  # one call, retried


def test_slow_service_times_out(launch, metering) -> None:
    metering.delay_s = 2.5  # longer than entitlement.timeout_s (1 s), on both attempts
    r = launch()
    assert_refused(r, Exit.UNREACHABLE, "ReadTimeoutError")
    assert len(metering.requests) == 2


def test_service_down(launch) -> None:
    r = launch(env={"AWS_ENDPOINT_URL_MARKETPLACE_METERING":
                    f"http://127.0.0.1:{closed_port()}"})
    assert_refused(r, Exit.UNREACHABLE, "EndpointConnectionError")


def test_no_credentials(launch, metering) -> None:
    r = launch(env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    assert_refused(r, Exit.REFUSED, "NoCredentialsError")
    assert metering.requests == []
