"""``python -m s4weights.runner``: config, privileges, entitlement, then the job, in that
order; any step that fails ends the runner with its own exit status before the next begins."""

from __future__ import annotations

import argparse
import logging

from s4weights.runner import Exit
from s4weights.runner.config import DEFAULT_PATH, ConfigError, load
from s4weights.runner.entitlement import register_usage
from s4weights.runner.logs import Forward, Log
from s4weights.runner.privileges import PrivilegeError, become, group_names
from s4weights.runner.status import RunStatus
from s4weights.runner.supervise import Supervisor


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m s4weights.runner",
        description="Check the AWS Marketplace entitlement, then run the training command as "
                    "an unprivileged user with health endpoints on the health port. Exit "
                    "statuses: " + ", ".join(f"{int(e)} {e.name.lower()}" for e in Exit))
    ap.add_argument("--config", default=str(DEFAULT_PATH),
                    help=f"the runner's TOML config (default {DEFAULT_PATH})")
    ap.add_argument("--check-config", action="store_true",
                    help="only parse the config and exit 0, or 78 naming what is wrong")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = Log.for_process()
    logging.getLogger().addHandler(Forward(log))
    logging.getLogger().setLevel(logging.WARNING)
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        log.error("config.invalid", str(exc), exit_status=int(Exit.CONFIG))
        return Exit.CONFIG
    if args.check_config:
        return Exit.OK
    log.context = {"run_id": cfg.run_id}
    try:
        who = become(cfg.user)
    except PrivilegeError as exc:
        log.error("privileges.failed", str(exc), exit_status=int(Exit.PRIVILEGES))
        return Exit.PRIVILEGES
    log.info("privileges.dropped", f"running as {who.user}", uid=who.uid, gid=who.gid,
             groups=",".join(group_names(who.groups)))
    verdict = register_usage(cfg.entitlement)
    if not verdict.entitled:
        log.error("entitlement.refused", f"{verdict.message}: the training command will not "
                  "run", code=verdict.code, exit_status=int(verdict.status),
                  product_code=cfg.entitlement.product_code)
        return verdict.status
    log.info("entitlement.granted", verdict.message, product_code=cfg.entitlement.product_code)
    status = RunStatus(cfg)
    status.set(entitled=True)
    return Supervisor(cfg, who, status, log).run()
