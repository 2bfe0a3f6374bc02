"""Kills ranks of 2-rank DCP saves with SIGKILL, many times, and says what each save left.

Run as ``python -m tests.dcp.crash_driver WORK TRIALS SEED [S3_URL]`` by the crash test. This
process imports torch and s4weights and runs one save (numba's codecs loaded) and then forks
both ranks of every trial, so a trial costs no imports; it never joins a process group
itself. Each trial saves the state of its own seed with 2 gloo ranks and kills one rank,
either when it reaches a chosen store operation (a write of its rank file, its commit, the
coordinator's put of ``.metadata``, its removal of replaced files) or after a random delay,
then the other one. Saves go into one path again and again (a retry into a committed
checkpoint), or into a fresh one. After each trial this process loads what the path holds
and records whether it is the previous checkpoint, the new one or nothing (``report.json``).

Nothing here waits without a deadline: a rank still running :data:`TRIAL_S` seconds into its
trial has its threads' stacks written to stderr (``SIGUSR1``, faulthandler) and is killed,
and the trial fails naming it; this process dumps its own stacks and fails if one trial and
its load take longer than :data:`STEP_S`.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import io
import itertools
import json
import os
import random
import select
import signal
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import s4weights
from s4format.errors import StorageError
from s4weights.dcp import S4StorageReader, S4StorageWriter
from s4weights.store.base import ObjectWriter, Store
from tests.dcp.compat import NO_DIST

WORLD = 2
# A trial's save takes well under a second, a survivor's collective gives up after 60 s.
TRIAL_S = 150.0
STEP_S = 300
POINTS = {"write": (0, 1), "commit": (0, 1), "committed": (0, 1), "put": (0,),
          "put-done": (0,), "delete": (0,)}


def full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(384, 1024, generator=g),
            "e": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16),
            "n": torch.arange(seed, seed + 1000)}


class _Hooked(ObjectWriter):
    def __init__(self, inner: ObjectWriter, hit: Any) -> None:
        self._inner, self._hit = inner, hit

    def write(self, data: bytes | memoryview) -> int:
        self._hit("write")
        return self._inner.write(data)

    def commit(self) -> None:
        self._hit("commit")
        self._inner.commit()
        self._hit("committed")

    def abort(self) -> None:
        self._inner.abort()


def _kill_at(store: Store, point: str, nth: int) -> None:
    """Make this process SIGKILL itself at the ``nth`` time it reaches ``point``."""
    seen = itertools.count(1)

    def hit(p: str) -> None:
        if p == point and next(seen) == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    writer, put, delete = store.writer, store.put_atomic, store.delete
    store.writer = lambda name: _Hooked(writer(name), hit)  # type: ignore[method-assign]

    def put_atomic(name: str, data: bytes, **kw: Any) -> None:
        hit("put")
        put(name, data, **kw)
        hit("put-done")

    def delete_(name: str) -> None:
        hit("delete")
        delete(name)

    store.put_atomic, store.delete = put_atomic, delete_  # type: ignore[method-assign]


def _rank(rank: int, trial: dict, pg_file: str, ready: int) -> None:
    """A forked rank: join the group, say so, save the trial's state, exit."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import Shard, distribute_tensor
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)])
             for k, v in full_state(trial["seed"]).items()}
    writer = S4StorageWriter(trial["path"])
    if trial.get("point") and trial["victim"] == rank:
        _kill_at(writer.store(), trial["point"], trial["nth"])
    os.write(ready, b"r")
    dcp.save(state, storage_writer=writer)


def _fork_rank(rank: int, trial: dict, pg_file: str, ready: int) -> int:
    pid = os.fork()
    if pid == 0:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        code = 1
        try:
            _rank(rank, trial, pg_file, ready)
            code = 0
        except BaseException as exc:  # a survivor of a killed peer fails: one line says how
            print(f"rank {rank} of seed {trial['seed']}: {type(exc).__name__}: "
                  f"{str(exc)[:160]}", file=sys.stderr)
        finally:
            os._exit(code)
    return pid


def run_trial(trial: dict, pg_file: str) -> dict:
    """Both ranks of one save; kill as the trial says. Returns the trial with each rank's
    exit status and how long the save ran."""
    deadline = time.monotonic() + TRIAL_S
    r, w = os.pipe()
    pids = [_fork_rank(rank, trial, pg_file, w) for rank in range(WORLD)]
    os.close(w)
    got = b""
    try:
        while len(got) < WORLD and select.select([r], [], [], _left(deadline))[0]:
            if not (chunk := os.read(r, WORLD)):
                break
            got += chunk
    finally:
        os.close(r)
    start = time.monotonic()
    codes: dict[int, int] = {}
    if len(got) == WORLD and "victim" in trial:
        victim = pids[trial["victim"]]
        if trial.get("delay") is not None:
            time.sleep(trial["delay"])
            _kill(victim)
        codes[victim] = _wait(victim, deadline, trial, pids)
        time.sleep(random.uniform(0, 0.05))
        for pid in pids:
            _kill(pid)
    elif len(got) < WORLD and time.monotonic() >= deadline:
        _hung(trial, pids, "not ready to save")
    for pid in pids:
        if pid not in codes:
            codes[pid] = _wait(pid, deadline, trial, pids)
    if len(got) < WORLD:
        raise RuntimeError(f"a rank failed before saving: exits {list(codes.values())}")
    return {**trial, "exit": [codes[p] for p in pids],
            "seconds": round(time.monotonic() - start, 3)}


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _wait(pid: int, deadline: float, trial: dict, pids: list[int]) -> int:
    """``pid``'s exit code, once it has exited; a rank running past ``deadline`` fails the
    trial (``_hung``)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            _hung(trial, pids, "still saving")
        time.sleep(0.005)


def _hung(trial: dict, pids: list[int], when: str) -> None:
    """Have each rank still running write its stacks to stderr, kill it, and fail."""
    live = [rank for rank, pid in enumerate(pids) if not os.waitpid(pid, os.WNOHANG)[0]]
    for rank in live:
        os.kill(pids[rank], signal.SIGUSR1)
    time.sleep(1.0)
    for rank in live:
        _kill(pids[rank])
        os.waitpid(pids[rank], 0)
    raise RuntimeError(f"seed {trial['seed']}: rank(s) {live} {when} after {TRIAL_S:.0f} s, "
                       "killed (their stacks are above)")


def _kill(pid: int | None) -> None:
    try:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def holds(path: str) -> int | None:
    """The seed of the state ``path`` holds bit-exactly, or None when it holds no checkpoint;
    anything else (a load that fails, other bytes) raises."""
    reader = S4StorageReader(path)
    try:
        reader.read_metadata()
    except StorageError as exc:
        if "holds no committed checkpoint" in str(exc):
            return None
        raise
    probe = full_state(0)
    dest = {k: torch.zeros_like(v) for k, v in probe.items()}
    dcp.load(dest, storage_reader=reader, **NO_DIST)
    seed = int(dest["n"][0])
    want = full_state(seed)
    for k, v in want.items():
        if not torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8)):
            raise AssertionError(f"{path}: {k} is not the state of seed {seed}")
    return seed


def _trials(work: str, count: int, rng: random.Random, save_s: float, url: str) -> list[dict]:
    out = []
    for k in range(count):
        trial: dict[str, Any] = {"seed": 100 + k}
        trial["path"] = url if k % 3 else f"{url}-fresh-{k}"
        if k % 2:
            trial["victim"] = rng.randrange(WORLD)
            trial["delay"] = round(rng.uniform(0, 1.3 * save_s), 4)
        else:
            point = rng.choice(sorted(POINTS))
            trial.update(point=point, victim=rng.choice(POINTS[point]),
                         nth=rng.randint(1, 12) if point == "write" else 1)
        out.append(trial)
    return out


def _step_too_long(signum: int, frame: Any) -> None:
    raise TimeoutError(f"a trial and its load ran past {STEP_S} s (stacks above)")


def main(work: str, count: int, seed: int, s3_url: str | None) -> None:
    warnings.simplefilter("ignore")
    # (an alarm, not a watchdog thread: this process forks, and forks best without threads;
    # faulthandler dumps the stacks even if the main thread is stuck in C, then chains)
    signal.signal(signal.SIGALRM, _step_too_long)
    faulthandler.register(signal.SIGALRM, all_threads=True, chain=True)
    # forked ranks must not inherit a thread pool: torch's stays unused (one thread) and
    # numba's is the fork-safe workqueue (set by the test); one save loads the codecs
    torch.set_num_threads(1)
    s4weights.save(full_state(0), io.BytesIO())
    importlib.import_module("torch._dynamo")  # distribute_tensor's first call imports it: seconds
    os.makedirs(work, exist_ok=True)
    rng = random.Random(seed)
    report = []
    for label, url in (("local", os.path.join(work, "ck")), ("s3", s3_url)):
        if url is None:
            continue
        signal.alarm(STEP_S)
        first = run_trial({"seed": 1, "path": url}, os.path.join(work, f"pg-{label}-first"))
        assert first["exit"] == [0] * WORLD and holds(url) == 1, first
        current = 1
        n = count if label == "local" else max(2, count // 4)
        for k, trial in enumerate(_trials(work, n, rng, first["seconds"], url)):
            signal.alarm(STEP_S)
            done = run_trial(trial, os.path.join(work, f"pg-{label}-{k}"))
            got = holds(trial["path"])
            allowed = {current, trial["seed"]} if trial["path"] == url else {None, trial["seed"]}
            assert got in allowed, (done, got)
            if trial["path"] == url:
                current = got
            report.append({**done, "where": label, "holds": got})
        report.append({"where": label, "final": url, "holds": current})
    signal.alarm(0)
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
         sys.argv[4] if len(sys.argv) > 4 else None)
