"""Checkpoints as a training loop sees them (``python bench/checkpoints.py [--device cpu]``).

One question: what does a save block, and what does a load of a chain cost, against torch?
On a transformer training state (bf16 weights, fp32 master weights, AdamW; bench/gpu.py's
model on CUDA, a smaller one on the CPU):
- ``save_checkpoint`` to local disk: blocking, and with ``blocking=False`` (the time training
  is blocked, and until the save is committed), against ``torch.save`` + fsync and against a
  plain buffered write + fsync of the same number of bytes as S4 stored;
- ``s4weights.save``/``load`` in memory against ``torch.save``/``torch.load``;
- two chains with the default policy: the training run saved every 10 steps (keyframe 6), and
  a fine-tuning run (bf16 weights, learning rate 1e-5); per kept step, ``load_checkpoint``'s
  time against one full load, and what the chain stores against bases alone.
Every load is compared bit for bit. The table is printed last; JSON to $OUT/checkpoints.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import s4weights
from s4weights import chain

ROWS: list[dict] = []


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall(fn, device: str, reps: int = 3) -> tuple[float, object]:
    """Median seconds of ``reps`` calls after one warm-up, the device synchronised around."""
    fn()
    times, out = [], None
    for _ in range(reps):
        out = None
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.detach().reshape(-1).view(torch.uint8).cpu(),
                        b.detach().reshape(-1).view(torch.uint8).cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def row(what: str, **figures) -> None:
    ROWS.append({"what": what, **figures})
    print(json.dumps(ROWS[-1]), flush=True)


def training(device: str, dim: int, layers: int, lr: float = 3e-4):
    """A causal transformer with AdamW (bf16 autocast on CUDA), and one training step."""
    torch.manual_seed(0)
    vocab, seq, batch = 32000 if device == "cuda" else 8000, 128, 8
    layer = torch.nn.TransformerEncoderLayer(dim, max(dim // 64, 1), 4 * dim, batch_first=True,
                                             norm_first=True)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, dim),
        "body": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        "head": torch.nn.Linear(dim, vocab)}).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=device)

    def step() -> None:
        x = torch.randint(0, vocab // 8, (batch, seq + 1), device=device)
        x = (x * 7 + torch.arange(seq + 1, device=device)) % vocab
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            h = model["body"](model["emb"](x[:, :-1]), mask=mask, is_causal=True)
            loss = torch.nn.functional.cross_entropy(model["head"](h).flatten(0, 1).float(),
                                                     x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, opt, step


def state_of(model, opt) -> dict:
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights_bf16": {k: v.to(torch.bfloat16) for k, v in master.items()},
            "master_fp32": master, "optimizer": opt.state_dict()}


def raw_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(raw_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(raw_bytes(v) for v in state)
    return 0


def plain_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` with one buffered write and fsync (the medium's floor)."""
    data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def torch_save_fsync(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def saves(state: dict, device: str, tmp: Path) -> None:
    """Blocking and asynchronous saves against torch and the medium, and in-memory round trips."""
    raw = raw_bytes(state)
    step = iter(range(10**6))

    def s4_ckpt() -> None:
        s4weights.save_checkpoint(state, tmp / "sync", next(step), delta=False, keep_last=1)
    s4_s, _ = wall(s4_ckpt, device)
    stored = chain.list_checkpoints(tmp / "sync")[-1].file_bytes
    blocked, total = [], []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        future = s4weights.save_checkpoint(state, tmp / "async", next(step), delta=False,
                                           keep_last=1, blocking=False)
        blocked.append(time.perf_counter() - t0)
        future.result()
        total.append(time.perf_counter() - t0)
    torch_s, _ = wall(lambda: torch_save_fsync(state, tmp / "x.pt"), device)
    floor = statistics.median(plain_write(tmp / "plain", stored) for _ in range(3))
    row("save to local disk", raw_bytes=raw, stored_bytes=stored,
        s4_save_s=round(s4_s, 3), torch_save_fsync_s=round(torch_s, 3),
        plain_write_fsync_of_stored_s=round(floor, 3), s4_over_plain=round(s4_s / floor, 2),
        async_blocked_s=round(statistics.median(blocked), 3),
        async_until_committed_s=round(statistics.median(total), 3))
    buf = {}

    def s4_mem() -> None:
        buf["s4"] = io.BytesIO()
        s4weights.save(state, buf["s4"])

    def torch_mem() -> None:
        buf["pt"] = io.BytesIO()
        torch.save(state, buf["pt"])
    s4_save, _ = wall(s4_mem, device)
    pt_save, _ = wall(torch_mem, device)
    s4_load, got = wall(lambda: s4weights.load(buf["s4"].getvalue(), map_location=device), device)
    pt_load, _ = wall(lambda: torch.load(io.BytesIO(buf["pt"].getvalue()),
                                         map_location=device), device)
    row("in memory", raw_bytes=raw, stored_bytes=len(buf["s4"].getvalue()),
        s4_save_s=round(s4_save, 3), torch_save_s=round(pt_save, 3),
        s4_load_s=round(s4_load, 3), torch_load_s=round(pt_load, 3), bit_exact=same(state, got))


def chain_run(name: str, device: str, tmp: Path, states) -> None:
    """Save every state of ``states`` (an iterator of (step, state)) with the default policy,
    then load each kept step, against one full save's load."""
    root = tmp / name
    kept_states = {}
    for step, state in states:
        s4weights.save_checkpoint(state, root, step, keyframe_interval=6)
        kept_states[step] = _to_cpu(state)
    infos = chain.list_checkpoints(root)
    full = tmp / f"{name}-full.s4w"
    last = infos[-1].step
    s4weights.save(kept_states[last], full)
    full_s, _ = wall(lambda: s4weights.load(full, map_location=device), device)
    worst, exact = 0.0, True
    for info in infos:
        chain._PARENT_CACHE.clear()
        t, got = wall(lambda i=info: s4weights.load_checkpoint(root, i.step, map_location=device),
                      device, reps=1)
        exact &= same(kept_states[info.step], got)
        worst = max(worst, t / full_s)
    stored = sum(i.file_bytes for i in infos)
    bases = sum(i.full_stored_bytes + i.file_bytes - i.stored_bytes for i in infos)
    row(f"chain: {name}", checkpoints=len(infos), deltas=sum(not i.is_base for i in infos),
        stored_over_bases_alone=round(stored / bases, 3), full_load_s=round(full_s, 3),
        worst_chain_load_over_full=round(worst, 2), bit_exact=exact,
        base_reasons=sorted({i.base_reason for i in infos if i.base_reason}))


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--saves", type=int, default=8, help="checkpoints per chain")
    args = ap.parse_args()
    dev = args.device
    dim, layers = (768, 12) if dev == "cuda" else (256, 4)
    tmp = Path(tempfile.mkdtemp(prefix="s4ckpt"))
    try:
        model, opt, step = training(dev, dim, layers)
        for _ in range(20):
            step()
        saves(state_of(model, opt), dev, tmp)

        def trained():
            for n in range(args.saves):
                for _ in range(10):
                    step()
                yield n * 10, state_of(model, opt)
        chain_run("training, AdamW, every 10 steps", dev, tmp, trained())
        ft_model, _ft_opt, ft_step = training(dev, dim, layers, lr=1e-5)
        ft_model.load_state_dict(model.state_dict())

        def fine_tuned():
            for n in range(args.saves):
                for _ in range(10):
                    ft_step()
                yield n * 10, {k: v.detach().to(torch.bfloat16)
                               for k, v in ft_model.state_dict().items()}
        chain_run("fine-tuning, bf16 weights, lr 1e-5", dev, tmp, fine_tuned())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| what | figures |\n|---|---|")
    for r in ROWS:
        print(f"| {r['what']} | " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "what")
              + " |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "checkpoints.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
