"""The torch-facing API, checkpoint chains and both CLIs over ``s3://`` URLs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import s4format  # noqa: E402
import s4format.cli  # noqa: E402
import s4weights  # noqa: E402
import s4weights.cli  # noqa: E402
import s4weights.sweep  # noqa: E402
from s4format.errors import StorageError  # noqa: E402
from s4format.schema import HEADER_SIZE  # noqa: E402
from s4weights.store.s3 import MIN_PART_SIZE, TAIL_CACHE, S3Store  # noqa: E402
from tests.s3 import seaweed  # noqa: E402
from tests.s3.proxy import FaultProxy  # noqa: E402
from tests.weights.common import save_on_latest  # noqa: E402


def _state(seed: int, n: int = 4, numel: int = 4096) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)},
            "step": seed, "lr": 1e-3}


def _evolved(step: int) -> dict:
    """The same base state with the first ``step + 1`` weights moved: deltas pay."""
    state = _state(1)
    state["model"]["layer0.weight"][: step + 1] += 1.0
    state["step"] = step
    return state


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8),
                                                                        b.view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_save_load_by_url(aws_env, bucket) -> None:
    state = _state(1)
    url = f"s3://{bucket}/models/m.s4w"
    s4weights.save(state, url)
    assert _equal(s4weights.load(url), state)
    with pytest.raises(StorageError, match=rf"s3://{bucket}/models/missing.s4w"):
        s4weights.load(f"s3://{bucket}/models/missing.s4w")


def test_checkpoint_chain_list_and_retain(aws_env, bucket) -> None:
    url = f"s3://{bucket}/runs/exp1"
    states = {}
    for step in range(0, 50, 10):
        states[step] = _evolved(step)
        save_on_latest(states[step], url, step, keyframe_interval=3)
    infos = s4weights.list_checkpoints(url)
    assert [i.step for i in infos] == [0, 10, 20, 30, 40]
    assert [i.parent_step for i in infos] == [None, 0, 10, None, 30]
    for step, state in states.items():
        assert _equal(s4weights.load_checkpoint(url, step), state)
    with pytest.raises(StorageError, match="already exists"):
        save_on_latest(states[40], url, 40)
    files = {i.step: i.file for i in infos}
    for step, name in files.items():
        assert re.fullmatch(rf"data/{step:012d}-[0-9a-f]{{8}}\.s4w", name), name
    deleted = s4weights.retain(url, [20, 40])
    assert deleted == []  # 20 needs 10 and 0, 40 needs 30
    assert s4weights.retain(url, [40]) == [0, 10, 20]
    assert [i.step for i in s4weights.list_checkpoints(url)] == [30, 40]
    store = S3Store.from_url(url)
    assert store.list() == [files[30], files[40],
                            "manifests/000000000030.json", "manifests/000000000040.json"]
    assert _equal(s4weights.load_checkpoint(url), states[40])


def test_chain_files_are_fetched_whole_by_loads_and_not_by_a_cached_parents_check(
        aws_env, bucket, opened_sources) -> None:
    # A load reads every tensor of every level: each small file comes in one GET (the base,
    # 0.9 MB, would otherwise take one per tensor; the deltas, a few KB, are within the tail
    # a source caches). A delta save whose parent this process holds only opens the chain's
    # files (headers and tails).
    url = f"s3://{bucket}/runs/whole"
    sources = opened_sources
    big = {"model": {f"w{i}": torch.randn(1 << 16, generator=torch.Generator().manual_seed(i))
                     for i in range(4)}}  # 1 MiB raw: a base past the tail cache
    states = []
    for step in range(3):
        state = {"model": {k: v.clone() for k, v in big["model"].items()}}
        state["model"]["w0"][:step + 1] += 1.0
        states.append(state)
        sources.clear()
        info = save_on_latest(state, url, step)
        assert info.depth == step
        # (the cached parent's chain: each file's header and tail)
        assert all(src.bytes_fetched <= HEADER_SIZE + TAIL_CACHE for src in sources), \
            [(src.key, src.bytes_fetched) for src in sources]
    sources.clear()
    assert _equal(s4weights.load_checkpoint(url, 2), states[2])
    assert len(sources) == 3 and all(src.requests == 1 for src in sources)


def test_a_chain_s_parents_open_together_and_fail_newest_first(aws_env, bucket, admin,
                                                               opened_sources) -> None:
    # On S3 a chain's parents are opened concurrently (each costs round trips); what they
    # load, and which failure is reported when several are damaged, is as one by one.
    url = f"s3://{bucket}/runs/parallel"
    states = {step: _evolved(step) for step in range(4)}
    infos = [save_on_latest(states[step], url, step, read_budget=None)
             for step in range(4)]
    assert [i.depth for i in infos] == [0, 1, 2, 3]
    for step in range(4):
        assert _equal(s4weights.load_checkpoint(url, step), states[step])
    key = f"runs/parallel/{infos[1].file}"
    admin.put_object(Bucket=bucket, Key=key, Body=b"not an s4w file" * 100)
    admin.delete_object(Bucket=bucket, Key=f"runs/parallel/{infos[2].file}")
    opened_sources.clear()
    with pytest.raises(s4weights.ParentMismatchError,
                       match="checkpoint step 3 needs step 2 of its chain, whose file cannot "
                             "be read"):
        s4weights.load_checkpoint(url, 3)
    # (every file opened on the way was closed: the base's whole object is let go)
    assert opened_sources and all(src._whole is None for src in opened_sources)
    with pytest.raises(s4format.BadMagicError):
        s4weights.load_checkpoint(url, 1)


def test_checkpoint_after_the_latest_object_vanished_is_a_base(aws_env, bucket, admin) -> None:
    # The same path as on a local store (chain.py), through S3Source's HEAD of a missing key;
    # tests/weights/test_chain_recovery.py covers the other kinds of damage.
    url = f"s3://{bucket}/runs/lost"
    saved = [save_on_latest(_evolved(step), url, step) for step in (0, 1)]
    assert saved[1].parent_step == 0  # a delta, and this process still caches it
    admin.delete_object(Bucket=bucket, Key=f"runs/lost/{saved[1].file}")
    info = save_on_latest(_evolved(2), url, 2)
    assert info.is_base
    assert _equal(s4weights.load_checkpoint(url), _evolved(2))
    with pytest.raises(StorageError, match=rf"checkpoint step 1 is listed in s3://{bucket}/runs/"
                                           r"lost, but its file cannot be read: head .*"
                                           r"000000000001-[0-9a-f]{8}\.s4w failed after 1 "
                                           r"attempt\(s\): 404"):
        s4weights.load_checkpoint(url, 1)


def test_a_resumed_run_saves_its_first_delta_from_its_copy(aws_env, bucket,
                                                          monkeypatch) -> None:
    # load_checkpoint(resume=True) over S3: the next save's parent is the copy it kept (no
    # plane of the chain is read back), and the chain still loads exactly
    from s4weights import chain

    url = f"s3://{bucket}/runs/resumed"
    for step in range(3):
        save_on_latest(_evolved(step), url, step)
    chain._PARENT_CACHE.clear()  # a restarted process
    state = s4weights.load_checkpoint(url, resume=True)
    assert _equal(state, _evolved(2))
    decoded = []
    real = s4format.Reader.read_raw
    monkeypatch.setattr(s4format.Reader, "read_raw",
                        lambda self, i: decoded.append(i) or real(self, i))
    info = save_on_latest(_evolved(3), url, 3)
    assert decoded == [] and not info.is_base and info.parent_step == 2
    monkeypatch.setattr(s4format.Reader, "read_raw", real)  # (undo() would drop aws_env too)
    chain._PARENT_CACHE.clear()
    assert _equal(s4weights.load_checkpoint(url), _evolved(3))


def test_s4format_cli_inspect_and_verify_s3_objects(aws_env, bucket, capsys,
                                                   opened_sources) -> None:
    url = f"s3://{bucket}/cli/m.s4w"
    s4weights.save(_state(2, numel=1 << 16), url)  # (1 MiB: past the tail a source caches)
    opened_sources.clear()
    assert s4format.cli.main(["inspect", "--json", url]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["file"] == url and d["totals"]["tensors"] == 4
    assert s4format.cli.main(["verify", url]) == 0
    assert "OK, 4 tensors" in capsys.readouterr().out
    # inspect reads the header and the tail; verify reads every byte, so one GET of it all
    inspect, verify = opened_sources
    assert inspect.requests == 2 and verify.requests == 1
    assert s4format.cli.main(["verify", f"s3://{bucket}/cli/nope.s4w"]) == 2
    assert f"s3://{bucket}/cli/nope.s4w" in capsys.readouterr().err


def _damage(admin, bucket: str, key: str, at: int) -> None:
    body = bytearray(admin.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[at] ^= 0xFF
    admin.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def test_registry_cli_list_and_verify_s3(aws_env, bucket, admin, capsys) -> None:
    for run in ("team/a", "team/b"):
        for step in (1, 2, 3):
            save_on_latest(_evolved(step), f"s3://{bucket}/{run}", step)
    prefix = f"s3://{bucket}/team"
    assert s4weights.cli.main(["list", prefix]) == 0
    out = capsys.readouterr().out
    assert f"run {prefix}/a: 3 checkpoint(s)" in out and f"run {prefix}/b:" in out
    assert s4weights.cli.main(["list", "--json", f"{prefix}/a"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in run["checkpoints"]] == [1, 2, 3]
    assert s4weights.cli.main(["verify", prefix]) == 0
    assert "6 checkpoint file(s) verified" in capsys.readouterr().out
    # Damage one plane byte of step 2 in run b: its verify (and 3's chain) must fail.
    info = s4weights.list_checkpoints(f"{prefix}/b")[1]
    _damage(admin, bucket, f"team/b/{info.file}", 100)
    assert s4weights.cli.main(["verify", f"{prefix}/b", "--step", "1"]) == 0
    capsys.readouterr()
    assert s4weights.cli.main(["verify", f"{prefix}/b", "--step", "3"]) == 1
    err = capsys.readouterr().err
    assert "step 2" in err and "problem(s)" in err
    assert s4weights.cli.main(["verify", prefix, "--step", "99"]) == 2


def test_registry_cli_on_local_directory(tmp_path: Path) -> None:
    for step in (5, 6):
        s4weights.save_checkpoint(_evolved(step), tmp_path / "runA", step)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-m", "s4weights", "list", str(tmp_path)],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert "runA: 2 checkpoint(s) in 1 chain(s)" in out
    assert "delta" in out
    r = subprocess.run([sys.executable, "-m", "s4weights", "verify", str(tmp_path)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "2 checkpoint file(s) verified" in r.stdout


def test_single_tensor_is_a_ranged_read(server, bucket) -> None:
    proxy = FaultProxy(server.http_port)
    try:
        store = S3Store(bucket, "r", client=seaweed.admin_client(proxy.endpoint))
        state = {f"t{i}": torch.randint(-2**31, 2**31 - 1, (128 * 1024,), dtype=torch.int32)
                 for i in range(16)}  # 16 x 512 KiB, incompressible
        info = s4weights.save_checkpoint(state, store, 0, policy="seed")
        size = store.source(info.file).size()
        proxy.reset_counts()
        src = store.source(info.file)
        tensor = s4format.Reader(src).read("t7")
        assert tensor.data.tobytes() == state["t7"].numpy().tobytes()
        fetched = proxy.stats.to_client
        print(f"\none tensor of {state['t7'].nbytes} bytes from a {size}-byte object: "
              f"{fetched} bytes over the wire ({src.requests} GETs)")
        assert fetched < state["t7"].nbytes + TAIL_CACHE + 64 * 1024
        assert fetched < size / 4
    finally:
        proxy.close()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def test_streaming_save_has_bounded_memory(aws_env, admin, bucket, monkeypatch) -> None:
    import s4format.writer

    part, conc, ahead = MIN_PART_SIZE, 2, 4 << 20
    monkeypatch.setattr(s4format.writer, "AHEAD", ahead)  # (the bytes coded ahead, at most)
    store = S3Store(bucket, "big", client=admin, part_size=part, max_concurrency=conc)
    state = {f"t{i}": torch.randint(-2**31, 2**31 - 1, (512 * 1024,), dtype=torch.int32)
             for i in range(26)}  # 26 x 2 MiB = 52 MiB raw, incompressible
    # the codecs' first use imports and compiles them: not what this test measures
    s4weights.save({k: v[:4096] for k, v in state.items()}, io.BytesIO(), policy="seed")
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    rss0 = _rss_kib("VmRSS:")
    tracemalloc.start()
    try:
        # save() into the store's writer: the streaming path save_checkpoint uses, without
        # save_checkpoint's parent cache (a deliberate full copy for the next delta).
        with store.writer("data/big.s4w") as sink:
            result = s4weights.save(state, sink, policy="seed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_peak = _rss_kib("VmHWM:") - rss0
    assert result.file_size >= 10 * part and sink.parts_uploaded >= 10
    print(f"\nstreamed {result.file_size / 2**20:.1f} MiB with {part / 2**20:.0f} MiB parts x "
          f"{conc} threads: tracemalloc peak {peak / 2**20:.1f} MiB, RSS growth "
          f"{rss_peak / 1024:.1f} MiB")
    # Part buffers (conc in flight + one filling), the tensors coded ahead, and one tensor's
    # coding temporaries.
    assert peak < part * (conc + 1) + ahead + 4 * state["t0"].nbytes + (4 << 20)
    assert peak < result.file_size / 2
    assert store.source("data/big.s4w").size() == result.file_size
    assert _equal(s4weights.load(f"s3://{bucket}/big/data/big.s4w"), state)


def test_sweep_removes_orphans_and_dead_uploads_on_s3(aws_env, bucket, admin) -> None:
    url = f"s3://{bucket}/runs/swept"
    saved = [s4weights.save_checkpoint(_evolved(step), url, step) for step in (0, 1)]
    admin.put_object(Bucket=bucket, Key="runs/swept/data/000000000002-deadbeef.s4w", Body=b"x")
    admin.create_multipart_upload(Bucket=bucket, Key="runs/swept/data/000000000003-dead.s4w")
    time.sleep(2.5)  # LastModified has whole seconds
    got = s4weights.sweep.sweep(url, older_than_s=1)
    assert got.orphans == ["data/000000000002-deadbeef.s4w"] and got.temporaries == 1
    store = S3Store.from_url(url)
    assert sorted(store.list("data/")) == sorted(i.file for i in saved)
    assert store.pending_uploads() == []
    assert _equal(s4weights.load_checkpoint(url), _evolved(1))
