"""Crash safety: saves killed with SIGKILL at random points never leave a half checkpoint
visible nor damage an earlier one; a killed save() keeps the old file; readers running during
saves only ever see committed checkpoints."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import xxhash

import s4weights
from s4weights import chain
from s4weights.store import LocalStore
from tests.weights import crash_worker
from tests.weights.common import assert_same

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs fork and SIGKILL")


@pytest.fixture(scope="module")
def ctx() -> multiprocessing.context.BaseContext:
    # A forkserver that imported torch and s4weights and ran one save: each killed process is
    # forked from it in milliseconds, with the codecs compiled, instead of paying seconds of
    # imports and JIT loading per trial. numba's workqueue threading layer is fork-safe
    # (GNU OpenMP, the default here, is not).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.weights.crash_worker"])
    env = {crash_worker.WARM_ON_IMPORT: "1", "NUMBA_THREADING_LAYER": "workqueue"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    return ctx


def _kill_after(ctx, target, args: tuple, delay: float) -> bool:
    """Run ``target`` in a process, SIGKILL it ``delay`` s after it is ready; True if it was
    still running when killed."""
    ready = ctx.Event()
    p = ctx.Process(target=target, args=(*args, ready))
    p.start()
    assert ready.wait(60), "worker did not start"
    time.sleep(delay)
    if p.is_alive():
        # Process.kill tolerates a worker that exits just now: under forkserver the server,
        # not this process, reaps it, so its pid may already be gone (ProcessLookupError)
        p.kill()
    p.join(30)
    assert p.exitcode in (0, -signal.SIGKILL)
    return p.exitcode == -signal.SIGKILL


def _digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def _identity(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


def test_killed_checkpoint_saves_leave_only_whole_checkpoints(tmp_path: Path, ctx) -> None:
    rnd = random.Random(20240611)
    root = tmp_path / "store"
    verified: dict[int, dict[str, str]] = {}  # step -> digest of its data file and manifest
    identities: dict[int, dict[str, tuple[int, int, int]]] = {}
    killed_mid_save = 0
    # 30 trials, and up to 30 more while fewer than 3 kills have landed inside a save: where a
    # kill lands depends on how long the saves take on the machine at hand
    for trial in range(60):
        if trial >= 30 and killed_mid_save >= 3:
            break
        infos = s4weights.list_checkpoints(root)
        first = infos[-1].step + 1 if infos else 0
        if _kill_after(ctx, crash_worker.save_checkpoints, (str(root), first, 3),
                       rnd.uniform(0.0, 0.9)):
            killed_mid_save += bool(_tmp_files(root))
        infos = s4weights.list_checkpoints(root)
        steps = [i.step for i in infos]
        assert steps == list(range(len(steps))), "a step is missing or half there"
        for info in infos:
            names = (info.file, f"manifests/{info.step:012d}.json")
            if info.step in verified:
                # Not rewritten, replaced or touched since it was loaded and hashed.
                assert {n: _identity(root / n) for n in names} == identities[info.step], \
                    f"step {info.step} changed"
                continue
            assert info.depth < crash_worker.INTERVAL
            chain._PARENT_CACHE.clear()
            assert_same(s4weights.load_checkpoint(root, info.step),
                        crash_worker.state(info.step))
            verified[info.step] = {n: _digest(root / n) for n in names}
            identities[info.step] = {n: _identity(root / n) for n in names}
    assert len(verified) >= 5, "too few saves finished: the test proved little"
    assert killed_mid_save >= 3, "too few kills landed inside a save"
    # The dead writers' temporary files are never listed and are swept.
    tmp = _tmp_files(root)
    assert LocalStore(root).sweep(older_than_s=0) == len(tmp)
    assert _tmp_files(root) == []
    assert [i.step for i in s4weights.list_checkpoints(root)] == sorted(verified)
    for files in verified.values():
        assert {n: _digest(root / n) for n in files} == files


def test_killed_save_to_a_path_keeps_the_previous_file(tmp_path: Path, ctx) -> None:
    rnd = random.Random(7)
    path = tmp_path / "model.s4w"
    s4weights.save(crash_worker.state(0), path)
    old = path.read_bytes()
    outcomes = set()
    # Ten kills, then up to twenty more while one outcome alone was seen, each later one
    # allowed longer: on a busy machine a save can outlast the first kills' 0.4 s.
    for trial in range(30):
        if trial >= 10 and len(outcomes) >= 2:
            break
        late = max(0, trial - 9) * 0.2
        _kill_after(ctx, crash_worker.save_file, (str(path), trial % 2 + 1, 2),
                    rnd.uniform(0.0, 0.4 + late))
        got = s4weights.load(path)
        assert got["step"] in (0, 1, 2)
        assert_same(got, crash_worker.state(got["step"]))
        outcomes.add(got["step"])
    assert len(outcomes) >= 2, "no save was ever committed or none ever interrupted"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".tmp-")) \
        == ["model.s4w"]
    LocalStore(tmp_path).sweep(older_than_s=0)
    assert os.listdir(tmp_path) == ["model.s4w"]
    s4weights.save(crash_worker.state(0), path)
    assert path.read_bytes() == old


def test_concurrent_readers_only_see_committed_checkpoints(tmp_path: Path) -> None:
    n = 1 << 20
    # A delta saved and loaded first: from an empty numba cache, readers compiling the masked
    # deltas' kernels would otherwise see only the first steps go by.
    warm = tmp_path / "warm"
    for step in range(2):
        s4weights.save_checkpoint(crash_worker.state(step, n), warm, step)
    s4weights.load_checkpoint(warm)
    store = tmp_path / "store"
    store.mkdir()
    done = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        while not done.is_set():
            try:
                listed = {i.step for i in s4weights.list_checkpoints(store)}
                if not listed:
                    continue
                got = s4weights.load_checkpoint(store)
                assert got["step"] >= max(listed)
                assert_same(got, crash_worker.state(got["step"], n))
                seen.append(got["step"])
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for step in range(12):
            s4weights.save_checkpoint(crash_worker.state(step, n), store, step,
                                      keyframe_interval=4)
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert errors == []
    assert len(seen) >= 5 and len(set(seen)) >= 3
