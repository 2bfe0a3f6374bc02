"""What the ranks of the distributed DCP tests run (``tests.dcp.launch`` forks them): one process
group per world size, shared by every case, each case asserting bit-exact loads itself. Rank 0
records the cases that passed, so the test can tell they all ran."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from s4weights.dcp import S4StorageReader, S4StorageWriter
from tests.dcp.states import (
    Replicate,
    Shard,
    apply_state,
    assert_same,
    dcp_state,
    distributed,
    full_state,
    init_group,
    plain_state,
    sharded_model,
    train_step,
    zeros_like_state,
)


def _record(report: str, case: str) -> None:
    if dist.get_rank() == 0:
        path = Path(report)
        done = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*done, case]))


def _wait(result: Any) -> None:
    """async_save's result: a Future, or (newer torch, with some stagers) a response."""
    getattr(result, "upload_completion", result).result()


def _load_fsdp(url: str, world: int, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """A model initialised otherwise, loaded from ``url``."""
    model, opt = sharded_model(seed, world)
    state = dcp_state(model, opt)
    state["step"] = 0
    dcp.load(state, storage_reader=S4StorageReader(url))
    apply_state(model, opt, state)
    return model, opt, state


def world4(rank: int, pg_file: str, ref_path: str, roots: list[str], report: str) -> None:
    """Save FSDP2 states from 4 ranks and load them back on 4 ranks (in every root); save a
    DTensor state and load it as other placements, and save asynchronously in thread mode
    (in the first root)."""
    init_group(rank, 4, pg_file)
    model, opt = sharded_model(0, 4)
    train_step(model, opt, 1)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
    state = dcp_state(model, opt)
    for root in roots:
        dcp.save(state, storage_writer=S4StorageWriter(f"{root}/fsdp4"))
        m2, o2, loaded = _load_fsdp(f"{root}/fsdp4", 4, 5)
        assert loaded["step"] == 1
        assert_same(full_state(m2, o2), ref)
        _record(report, f"fsdp2 4->4 {root}")
    full = plain_state(3)
    dcp.save(distributed(full, [Shard(0)]), checkpoint_id=f"{roots[0]}/dtensor4",
             storage_writer=S4StorageWriter())
    for label, placements in (("Shard(1)", [Shard(1)]), ("Replicate", [Replicate()])):
        dest = distributed(zeros_like_state(full), placements)
        dcp.load(dest, checkpoint_id=f"{roots[0]}/dtensor4", storage_reader=S4StorageReader())
        assert_same(dest, full)
        _record(report, f"Shard(0) -> {label}")
    _wait(dcp.async_save(state, storage_writer=S4StorageWriter(f"{roots[0]}/async-thread")))
    m3, o3, _ = _load_fsdp(f"{roots[0]}/async-thread", 4, 6)
    assert_same(full_state(m3, o3), ref)
    _record(report, "async_save thread")
    dist.destroy_process_group()


def world2(rank: int, pg_file: str, ref_path: str, roots: list[str], report: str) -> None:
    """Load the 4-rank checkpoints on 2 ranks, save a 2-rank one, and save asynchronously in
    process mode where this torch has it."""
    init_group(rank, 2, pg_file)
    ref = torch.load(ref_path)
    for root in roots:
        model, opt, state = _load_fsdp(f"{root}/fsdp4", 2, 7)
        assert state["step"] == 1
        assert_same(full_state(model, opt), ref)
        _record(report, f"fsdp2 4->2 {root}")
        dcp.save(dcp_state(model, opt), storage_writer=S4StorageWriter(f"{root}/fsdp2"))
    kind = getattr(dcp, "AsyncCheckpointerType", None)
    if kind is not None and hasattr(kind, "PROCESS"):
        _wait(dcp.async_save(dcp_state(model, opt), async_checkpointer_type=kind.PROCESS,
                             storage_writer=S4StorageWriter(f"{roots[0]}/async-process")))
        m2, o2, _ = _load_fsdp(f"{roots[0]}/async-process", 2, 8)
        assert_same(full_state(m2, o2), ref)
        _record(report, "async_save process")
    dist.destroy_process_group()


def chains2(rank: int, pg_file: str, root: str, refs: str, report: str,
            s3_root: str | None) -> None:
    """Twelve steps of FSDP2 training saved with save_checkpoint(distributed=True): deltas,
    keyframes and retention; every kept step loads back on 2 ranks (the test loads each in
    one process too)."""
    import s4weights

    init_group(rank, 2, pg_file)
    model, opt = sharded_model(0, 2)
    kinds = []
    for step in range(12):
        train_step(model, opt, step + 1)
        state = dcp_state(model, opt)
        state["step"] = step
        # (an AdamW state's deltas store only a few percent less, its moments coded alone:
        # min_delta_gain=0 keeps the chain this test is about)
        info = s4weights.save_checkpoint(state, root, step, distributed=True,
                                         keyframe_interval=4, keep_last=3, read_budget=None,
                                         min_delta_gain=0.0)
        kinds.append("base" if info.is_base else "delta")
        ref = full_state(model, opt)
        if rank == 0:
            torch.save(ref, f"{refs}/{step}.pt")
    assert kinds.count("delta") >= 6, kinds
    kept = [i.step for i in s4weights.list_checkpoints(root)]
    for step in kept:
        m2, o2 = sharded_model(9, 2)
        dest = dcp_state(m2, o2)
        dest["step"] = -1
        s4weights.load_checkpoint(root, step, into=dest, distributed=True)
        assert dest["step"] == step
        apply_state(m2, o2, dest)
        assert_same(full_state(m2, o2), torch.load(f"{refs}/{step}.pt"))
        _record(report, f"chain step {step} on 2")
    # a budgeted save after the chain: AdamW state does not pay as a delta, so a base
    train_step(model, opt, 100)
    info = s4weights.save_checkpoint(dcp_state(model, opt), root, 100, distributed=True,
                                     min_delta_gain=0.0)
    assert info.is_base and info.base_reason.startswith("read budget"), info
    _record(report, "budget base")
    if s3_root is not None:
        _chain_on_s3(model, opt, s3_root, report)
    dist.destroy_process_group()


def _chain_on_s3(model: Any, opt: Any, root: str, report: str) -> None:
    """A shorter chain on S3: deltas, retention, and the kept steps loaded on 2 ranks."""
    import s4weights

    refs = {}
    for step in range(5):
        train_step(model, opt, 200 + step)
        state = dcp_state(model, opt)
        s4weights.save_checkpoint(state, root, step, distributed=True, keyframe_interval=3,
                                  keep_last=2, read_budget=None, min_delta_gain=0.0)
        refs[step] = copy.deepcopy(full_state(model, opt))  # (the live step counts move)
    infos = s4weights.list_checkpoints(root)
    assert [i.step for i in infos] == [3, 4] and not infos[-1].is_base, infos
    for info in infos:
        m2, o2 = sharded_model(9, 2)
        dest = dcp_state(m2, o2)
        s4weights.load_checkpoint(root, info.step, into=dest, distributed=True)
        apply_state(m2, o2, dest)
        assert_same(full_state(m2, o2), refs[info.step])
    _record(report, "chain on s3")
