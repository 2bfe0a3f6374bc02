"""The entitlement check: AWS Marketplace Metering ``RegisterUsage``, once per start.

Fail closed: only a well-formed signed answer entitles; every error maps to one exit status
(:class:`~s4weights.runner.Exit`) and one log line. The client honours the standard AWS
configuration (credentials chain, ``AWS_ENDPOINT_URL_MARKETPLACE_METERING``, ``AWS_CA_BUNDLE``);
retries are botocore's standard mode, bounded by ``attempts``, with connect and read timeouts,
so the check ends within roughly ``attempts * 2 * timeout_s`` plus backoff.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Any

from s4weights.runner import Exit
from s4weights.runner.config import Entitlement

# RegisterUsage's documented errors, by the status each refusal exits with.
ERROR_STATUS = {
    "CustomerNotEntitledException": Exit.NOT_ENTITLED,
    "InvalidProductCodeException": Exit.INVALID_PRODUCT_CODE,
    "InvalidPublicKeyVersionException": Exit.INVALID_PUBLIC_KEY_VERSION,
    "PlatformNotSupportedException": Exit.PLATFORM_NOT_SUPPORTED,
    "DisabledApiException": Exit.METERING_DISABLED,
    "ThrottlingException": Exit.THROTTLED,
    "InternalServiceErrorException": Exit.UNREACHABLE,
}
UNAVAILABLE_CODES = frozenset({"ServiceUnavailable", "ServiceUnavailableException",
                               "InternalFailure", "InternalError", "RequestTimeout",
                               "500", "502", "503", "504"})


@dataclass(frozen=True)
class Verdict:
    status: Exit
    code: str  # the service's error code, or what went wrong locally
    message: str

    @property
    def entitled(self) -> bool:
        return self.status is Exit.OK


def register_usage(cfg: Entitlement) -> Verdict:
    """Call RegisterUsage with a fresh nonce and judge the answer."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client = boto3.session.Session().client(
            "meteringmarketplace", region_name=cfg.region,
            config=Config(retries={"mode": "standard", "total_max_attempts": cfg.attempts},
                          connect_timeout=cfg.timeout_s, read_timeout=cfg.timeout_s,
                          user_agent_extra="s4-runner"))
        answer = client.register_usage(ProductCode=cfg.product_code,
                                       PublicKeyVersion=cfg.public_key_version,
                                       Nonce=str(uuid.uuid4()))
    except ClientError as exc:
        return _client_error(exc)
    except BotoCoreError as exc:
        return _local_error(exc)
    except Exception as exc:  # fail closed on what botocore did not foresee either
        return Verdict(Exit.REFUSED, type(exc).__name__,
                       f"RegisterUsage failed unexpectedly: {type(exc).__name__}")
    problem = malformed(answer)
    if problem:
        return Verdict(Exit.MALFORMED_ANSWER, "MalformedAnswer",
                       f"RegisterUsage answered without a valid signature: {problem}")
    return Verdict(Exit.OK, "OK", "entitled: RegisterUsage returned a signed answer")


def _client_error(exc: Any) -> Verdict:
    err = exc.response.get("Error", {})
    code = str(err.get("Code") or exc.response.get("ResponseMetadata", {})
               .get("HTTPStatusCode", "unknown"))
    text = str(err.get("Message") or "")[:300]
    status = ERROR_STATUS.get(code)
    if status is None:
        status = Exit.UNREACHABLE if code in UNAVAILABLE_CODES else Exit.REFUSED
    what = {Exit.THROTTLED: "still throttled after the bounded retries",
            Exit.UNREACHABLE: "the service failed after the bounded retries"}.get(status,
                                                                                  "refused")
    return Verdict(status, code, f"RegisterUsage {what}: {code}: {text}".rstrip(": "))


def _local_error(exc: Exception) -> Verdict:
    from botocore import exceptions as e
    from botocore.parsers import ResponseParserError

    name = type(exc).__name__
    if isinstance(exc, (e.EndpointConnectionError, e.ConnectTimeoutError, e.ReadTimeoutError,
                        e.ConnectionClosedError)):
        return Verdict(Exit.UNREACHABLE, name, f"the Metering service cannot be reached "
                       f"(after the bounded retries): {exc}")
    if isinstance(exc, ResponseParserError):
        return Verdict(Exit.MALFORMED_ANSWER, name, "RegisterUsage's answer does not parse")
    if isinstance(exc, e.NoRegionError):
        return Verdict(Exit.REFUSED, name, "no AWS region: set entitlement.region in the "
                       "config or AWS_REGION")
    if isinstance(exc, (e.NoCredentialsError, e.PartialCredentialsError)):
        return Verdict(Exit.REFUSED, name, "no AWS credentials: the instance needs its role "
                       "(instance profile) with aws-marketplace:RegisterUsage")
    return Verdict(Exit.REFUSED, name, f"RegisterUsage failed: {name}: {exc}"[:400])


def malformed(answer: Any) -> str | None:
    """Why ``answer`` is not a RegisterUsage result (a JWT in ``Signature``), or None. The
    signature is AWS's to verify; a JWT's shape and header are checked here."""
    sig = answer.get("Signature") if isinstance(answer, dict) else None
    if not isinstance(sig, str) or not sig:
        return "no Signature in the answer"
    parts = sig.split(".")
    if len(parts) != 3 or not all(parts):
        return "the Signature is not a JWT (three dot-separated parts)"
    try:
        header = json.loads(base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)))
    except (ValueError, binascii.Error, RecursionError):
        return "the Signature's header does not decode"
    if not isinstance(header, dict) or not isinstance(header.get("alg"), str):
        return "the Signature's header names no algorithm"
    return None
