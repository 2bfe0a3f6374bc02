"""``save_checkpoint`` in a training loop on the GPU machine (``python3 bench/checkpoint_gpu.py``):
bench/gpu.py's (b) transformer trained on, its state (bf16 weights, fp32 master weights, AdamW)
saved every ``S4_CKPT_INTERVAL`` steps (default 10) to the local disk as a base -> delta chain,
``S4_CKPT_SAVES`` saves (default 6). Per save: base or delta, stored and full bytes, seconds, the
peak extra GPU memory during the save and the GPU memory the save leaves held afterwards (both
over what the training state itself holds) and the page-locked host memory the process then
holds for its snapshots, against torch.save of the same state to the same disk. Then a
restarted process (nothing cached): the parent's read from the store, and its first delta
save, loaded back on the GPU and compared bit for bit. Then one that resumes with
load_checkpoint(resume=True) (timed against without), and its first delta save, compared
too. Last, what a new page-locked buffer of the state's size costs: s4weights.hostmem's
exact size against torch's pinned allocator. Figures in bench/RESULTS.md; JSON to
``$OUT/checkpoint_gpu.json`` when OUT is set."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # bench/gpu.py: the same model and state
import hostmem_speed  # bench/hostmem_speed.py

import s4weights
from s4weights import chain, hostmem
from s4weights.store import open_store

MIB = 1 << 20


def locked_bytes() -> int:
    """Page-locked host memory held for snapshots: the parents cached and the buffers kept."""
    held = [b for entry in chain._PARENT_CACHE.values() for b in entry[3].values()]
    return sum(b.nbytes for b in held + list(hostmem._KEPT.values()))


def main() -> None:
    interval = int(os.environ.get("S4_CKPT_INTERVAL", "10"))
    saves = int(os.environ.get("S4_CKPT_SAVES", "6"))
    model, opt, step = gpu.training_run()
    for _ in range(50):
        step()
    rows = []

    def save(state: dict, root: Path, k: int, kind: str | None = None) -> None:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        info = s4weights.save_checkpoint(state, root, k, device="cuda")
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        row = dict(save=k, kind=kind or ("base" if info.is_base else "delta"),
                   stored_MB=round(info.stored_bytes / 1e6, 1),
                   full_MB=round(info.full_stored_bytes / 1e6, 1),
                   raw_MB=round(info.raw_bytes / 1e6, 1), save_s=round(took, 3),
                   peak_extra_MiB=round((torch.cuda.max_memory_allocated() - base) / MIB),
                   held_after_MiB=round((torch.cuda.memory_allocated() - base) / MIB),
                   host_locked_MiB=round(locked_bytes() / MIB))
        rows.append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory(dir=os.environ.get("S4_BENCH_DIR")) as tmp:
        root = Path(tmp) / "run"
        state = None
        for k in range(saves):
            for _ in range(interval):
                step()
            del state
            state = gpu.state_of(model, opt)
            save(state, root, k)
        # a restarted process: nothing cached, so its first delta reads the parent's chain
        # from the store (decoded on the CPU); that read timed alone first
        chain._PARENT_CACHE.clear()
        hostmem.forget()
        for _ in range(interval):
            step()
        del state
        state = gpu.state_of(model, opt)
        store = open_store(root)
        infos = chain.by_step(chain.list_checkpoints(store))
        reads = {}
        for where in ("cpu", "cuda"):
            t0 = time.perf_counter()
            chain._parent_tensors(store, infos[max(infos)], infos, where)
            reads[where] = time.perf_counter() - t0
        read_s = reads["cuda"]
        print(f"after a restart: reading the parent (step {max(infos)}, chain depth "
              f"{infos[max(infos)].depth}) from the store: {reads['cpu']:.3f} s decoded on "
              f"the CPU, {reads['cuda']:.3f} s on the GPU (what save_checkpoint does)",
              flush=True)
        save(state, root, saves, "delta after a restart")
        t0 = time.perf_counter()
        torch.save(state, Path(tmp) / "x.pt")
        torch_s = time.perf_counter() - t0
        print(f"torch.save of the same state to the same disk: {torch_s:.3f} s", flush=True)
        exact = gpu.same_state(s4weights.load_checkpoint(root, device="cuda"), state)
        print(f"last checkpoint loaded on the GPU: bit-exact {exact}", flush=True)
        # a restarted run that resumes from its latest checkpoint: load_checkpoint with and
        # without resume=True (which keeps a host copy as the next delta's parent), then the
        # first delta save
        loads = {}
        for resume in (False, True):
            chain._PARENT_CACHE.clear()
            hostmem.forget()
            del state
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            state = s4weights.load_checkpoint(root, device="cuda", resume=resume)
            torch.cuda.synchronize()
            loads[resume] = time.perf_counter() - t0
        print(f"resuming from step {saves} (chain depth {infos[max(infos)].depth + 1}): "
              f"load_checkpoint {loads[False]:.3f} s, with resume=True {loads[True]:.3f} s",
              flush=True)
        for v in gpu.flat_tensors(state).values():
            v.add_(1e-3)  # (a training step's worth of change, in place)
        save(state, root, saves + 1, "delta after load_checkpoint(resume=True)")
        chain._PARENT_CACHE.clear()
        again = gpu.same_state(s4weights.load_checkpoint(root, device="cuda"), state)
        print(f"that checkpoint loaded on the GPU: bit-exact {again}", flush=True)
        exact = exact and again
    # what a save's new snapshot buffer costs (the first two saves of a process make one
    # each: the second runs while the first is the parent), against torch's pinned allocator
    # with nothing cached (which takes the next power of two)
    chain._PARENT_CACHE.clear()
    hostmem.forget()
    raw = int(rows[-1]["raw_MB"] * 1e6)
    t0 = time.perf_counter()
    block = hostmem.page_locked(raw, torch.cuda.current_device())
    lock_s = time.perf_counter() - t0
    assert block is not None and hostmem.is_page_locked(block)
    del block
    pin_s = hostmem_speed.torch_pinned(raw)
    print(f"a new buffer of {raw / 1e9:.2f} GB: page-locked at its size {lock_s:.3f} s, "
          f"torch's pinned allocator {pin_s:.3f} s ({1 << (raw - 1).bit_length()} bytes)",
          flush=True)
    if out := os.environ.get("OUT"):
        Path(out, "checkpoint_gpu.json").write_text(json.dumps(
            dict(saves=rows, restart_parent_read_s=round(read_s, 3),
                 restart_parent_read_cpu_s=round(reads["cpu"], 3),
                 torch_save_s=round(torch_s, 3), exact=exact,
                 resume_load_s=round(loads[True], 3), plain_load_s=round(loads[False], 3),
                 lock_s=round(lock_s, 3), pin_s=round(pin_s, 3)), indent=1))
    if not exact:
        sys.exit("the loaded checkpoint differs from the saved state")


if __name__ == "__main__":
    main()
