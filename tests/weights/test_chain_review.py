"""Checkpoint chains and the S3 writer under the conditions a review found mishandled: a save of
an older step with keep_last, a retention interrupted half way, manifests deleted while they
are listed, the caller's tensors changing during a save, and an S3 upload aborted from another
thread while a write is running."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

import pytest
import torch

import s4weights
from s4format.errors import StorageError
from s4weights import api, chain
from s4weights.store import LocalStore
from tests.weights.common import assert_same, clone_tree, save_on_latest


def _state(k: float) -> dict:
    g = torch.Generator().manual_seed(int(k))
    return {"w": torch.randn(64, 64, generator=g) * 0.02 + k, "b": torch.full((64,), float(k))}


def test_keep_last_never_deletes_the_step_just_saved(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        s4weights.save_checkpoint(_state(step), tmp_path, step)
    # a rollback: step 150 is older than the two newest, but it is what was just saved
    s4weights.save_checkpoint(_state(150), tmp_path, 150, keep_last=2)
    steps = [i.step for i in chain.list_checkpoints(tmp_path)]
    assert 150 in steps and 300 in steps
    assert_same(s4weights.load_checkpoint(tmp_path, 150), _state(150))


def test_an_interrupted_retention_leaves_no_delta_without_its_parent(
        tmp_path: Path, monkeypatch) -> None:
    for step in range(1, 6):  # a base and four deltas
        save_on_latest(_state(1) | {"x": torch.full((8,), step)}, tmp_path, step)
    infos = chain.by_step(chain.list_checkpoints(tmp_path))
    assert infos[5].parent_step == 4
    real = LocalStore.delete
    calls = []

    def dies_after_two(self, name):
        calls.append(name)
        if len(calls) > 2:
            raise KeyboardInterrupt  # the process is interrupted mid-retention
        return real(self, name)

    monkeypatch.setattr(LocalStore, "delete", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        s4weights.save_checkpoint(_state(9), tmp_path, 6, delta=False, keep_last=1)
    monkeypatch.setattr(LocalStore, "delete", real)
    left = chain.by_step(chain.list_checkpoints(tmp_path))
    for s in left:  # every listed checkpoint still loads: its whole chain is there
        s4weights.load_checkpoint(tmp_path, s)


def test_manifests_deleted_while_listing_are_skipped(tmp_path: Path, monkeypatch) -> None:
    s4weights.save_checkpoint(_state(1), tmp_path, 1)
    real = LocalStore.list
    monkeypatch.setattr(LocalStore, "list", lambda self, prefix="": real(self, prefix)
                        + (["manifests/000000000009.json"] if prefix == "manifests/" else []))
    assert [i.step for i in chain.list_checkpoints(tmp_path)] == [1]


def test_the_cached_parent_is_what_the_file_holds(tmp_path: Path, monkeypatch) -> None:
    # the caller's tensors change after they are coded but before the save returns (a save on
    # a side thread while training goes on): the next delta must still apply to the file
    state = _state(3)
    saved = clone_tree(state)
    real = api.write_flattened

    def then_train(*args, **kwargs):
        out = real(*args, **kwargs)
        state["w"].add_(1.0)  # the optimizer steps before save_checkpoint returns
        return out

    monkeypatch.setattr(chain, "write_flattened", then_train)
    s4weights.save_checkpoint(state, tmp_path, 1)
    monkeypatch.setattr(chain, "write_flattened", real)
    nxt = clone_tree(state)
    nxt["b"].add_(0.5)
    info = s4weights.save_checkpoint(nxt, tmp_path, 2)
    assert info.parent_step == 1
    assert_same(s4weights.load_checkpoint(tmp_path, 1), saved)
    assert_same(s4weights.load_checkpoint(tmp_path, 2), nxt)


class _FakeS3:
    """Just enough of an S3 client for the multipart writer, counting live uploads."""

    def __init__(self) -> None:
        self.n, self.live, self.lock = 0, set(), threading.Lock()

    def create_multipart_upload(self, **kw):
        with self.lock:
            self.n += 1
            self.live.add(f"u{self.n}")
            return {"UploadId": f"u{self.n}"}

    def upload_part(self, **kw):
        time.sleep(0.002)
        return {"ETag": '"00"'}  # no ChecksumCRC32: some S3-compatible servers omit it

    def abort_multipart_upload(self, UploadId, **kw):
        self.live.discard(UploadId)

    def list_multipart_uploads(self, Prefix, **kw):  # (one writer's key: Prefix is that key)
        with self.lock:
            return {"Uploads": [{"Key": Prefix, "UploadId": u} for u in sorted(self.live)]}


def test_an_s3_upload_aborted_during_a_write_stops_it_and_leaves_no_upload() -> None:
    from s4weights.store.s3 import MiB, S3Store

    seen: collections.Counter = collections.Counter()
    big = memoryview(bytearray(40 * MiB))
    for trial in range(20):
        client = _FakeS3()
        w = S3Store("b", "p", client=client, part_size=5 * MiB, max_concurrency=4) \
            .writer("data/x.s4w")

        def run(w=w) -> None:
            try:
                w.write(big)
                seen["returned"] += 1
            except StorageError:
                seen["StorageError"] += 1
            except BaseException as exc:
                seen[type(exc).__name__] += 1

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.001 + 0.0015 * trial)
        w.abort()
        t.join(10)
        assert not t.is_alive()
        assert not client.live, trial  # no multipart upload left behind
    assert set(seen) <= {"returned", "StorageError"}, seen
