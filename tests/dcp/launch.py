"""Runs a job of ``tests.dcp.jobs`` on ranks forked from this process, which imported torch and
the jobs once (a spawned rank would import them again, for seconds each):

    python -m tests.dcp.launch JOB RANKS ARGS_JSON

Each rank calls ``JOB(rank, *ARGS)``. Exits non-zero when a rank fails, after killing the
others, which would otherwise wait in a collective until its timeout.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback

from s4format import writer
from tests.dcp import jobs

importlib.import_module("torch._dynamo")  # FSDP2 and DTensor import it on first use
# The jobs' model is tiny and sharded, its deltas save fewer bytes than the writer's bar for
# keeping one; their chains are what is tested, so the bar is lowered, as tests/conftest.py
# lowers it in the suite's own process.
writer.DELTA_MIN_SAVED = 0


def _rank(job, rank: int, args: list) -> None:
    # (a rank that dies of a signal says where: a CI run on 2026-12-06 saw a rank end with
    # SIGSEGV and nothing on its stderr)
    faulthandler.enable(all_threads=True)
    code = 1
    try:
        job(rank, *args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    job, ranks, args = getattr(jobs, sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    pids = {}
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            _rank(job, rank, args)
        pids[pid] = rank
    failed = None
    while pids:
        pid, status = os.wait()
        rank, code = pids.pop(pid), os.waitstatus_to_exitcode(status)
        if code and failed is None:
            failed = f"rank {rank} of {sys.argv[1]} exited with {code}"
            for other in pids:
                os.kill(other, signal.SIGKILL)
    sys.exit(failed)


if __name__ == "__main__":
    main()
