"""A tiny training job for the runner tests: ``train_job.py OUT_DIR [EVERY] [STEP_S] [ARGS...]``.

It first records who it runs as (``started.json``: the proof that it ran at all), then trains a
counter, saving a checkpoint with ``save_checkpoint`` to the run's store every EVERY steps and
whenever the runner asks (``events.jsonl`` says which step and why); on SIGTERM it saves a final
checkpoint and writes ``final.json``. Extra ARGS are ignored (the tests pass a fake secret).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

LIMIT_S = 120.0  # never outlive a broken test


def main(out: Path, every: int, step_s: float) -> int:
    env = {k: os.environ.get(k) for k in ("S4_REGISTRY_URL", "S4_RUN_ID", "S4_RUN_URL",
                                          "S4_CHECKPOINT_REQUEST", "HOME", "USER")}
    (out / "started.json").write_text(json.dumps({
        "pid": os.getpid(), "resuid": os.getresuid(), "resgid": os.getresgid(),
        "groups": os.getgroups(), "cwd": os.getcwd(), "env": env}))
    from s4weights.runner import job
    job.watch_signals()
    import torch

    from s4weights import save_checkpoint
    state = {"w": torch.zeros(64, dtype=torch.float32), "step": 0}
    deadline = time.monotonic() + LIMIT_S
    step = 0
    with open(out / "events.jsonl", "a") as events:
        while time.monotonic() < deadline:
            step += 1
            state["w"] += 1.0
            state["step"] = step
            stopping = job.stop_requested()  # read once: a signal may land mid-step
            reason = "stop" if stopping else job.checkpoint_requested()
            if reason or step % every == 0:
                save_checkpoint(state, job.run_url(), step)
                events.write(json.dumps({"step": step, "reason": reason}) + "\n")
                events.flush()
                job.checkpoint_done()
            if stopping:
                (out / "final.json").write_text(json.dumps({"step": step}))
                return 0
            time.sleep(step_s)
    return 3


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5,
                  float(sys.argv[3]) if len(sys.argv) > 3 else 0.05))
