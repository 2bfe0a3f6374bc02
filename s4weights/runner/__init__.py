"""The train runner of the machine image: ``python -m s4weights.runner [--config FILE]``.

It reads one TOML file, drops to the configured unprivileged user, checks the AWS Marketplace
entitlement (``RegisterUsage``) and only then runs the customer's training command, forwarding
stop signals, asking the job for a checkpoint on a spot interruption notice, and serving
``/healthz``, ``/readyz`` and ``/status`` on the health port. Invariant: the training command
never starts unless the entitlement check succeeded; every refusal has an exit status of its
own (:class:`Exit`), which ``deploy/s4-runner.service`` uses to decide about restarts.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """The runner's exit statuses. Statuses from 77 up mean the job never ran."""

    OK = 0  # the job exited 0
    JOB_FAILED = 1  # the job exited non-zero or was killed
    USAGE = 2
    PRIVILEGES = 77  # cannot run as the configured unprivileged user
    CONFIG = 78  # the config file is missing or invalid
    NOT_ENTITLED = 80  # CustomerNotEntitledException
    INVALID_PRODUCT_CODE = 81  # InvalidProductCodeException
    INVALID_PUBLIC_KEY_VERSION = 82  # InvalidPublicKeyVersionException
    PLATFORM_NOT_SUPPORTED = 83  # PlatformNotSupportedException
    METERING_DISABLED = 84  # DisabledApiException
    THROTTLED = 85  # ThrottlingException after the bounded retries
    UNREACHABLE = 86  # no answer: network down, timeouts, the service's 5xx, after retries
    MALFORMED_ANSWER = 87  # an answer that is not a signed RegisterUsage result
    REFUSED = 88  # any other error: credentials, permissions, an unknown error code
    HEALTH_PORT = 89  # the health port cannot be bound


# Statuses worth no restart: the same config and the same answer would refuse again.
NO_RESTART = (Exit.USAGE, Exit.PRIVILEGES, Exit.CONFIG, Exit.NOT_ENTITLED,
              Exit.INVALID_PRODUCT_CODE, Exit.INVALID_PUBLIC_KEY_VERSION,
              Exit.PLATFORM_NOT_SUPPORTED, Exit.METERING_DISABLED, Exit.MALFORMED_ANSWER,
              Exit.REFUSED)

__all__ = ["NO_RESTART", "Exit"]
