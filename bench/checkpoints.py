"""Checkpoints as a training loop sees them (``python bench/checkpoints.py [--device cpu]``).

One question: what does a save block, and what does a load of a chain cost, against torch?
On a transformer training state (bf16 weights, fp32 master weights, AdamW; bench/gpu.py's
model on CUDA, a smaller one on the CPU):
- ``save_checkpoint`` to local disk: blocking, and with ``blocking=False`` (the time training
  is blocked, and until the save is committed), against ``torch.save`` + fsync and against a
  plain buffered write + fsync of the same number of bytes as S4 stored;
- ``s4weights.save``/``load`` in memory against ``torch.save``/``torch.load``;
- three chains with the default policy (deltas against the base; ``--against base latest``
  runs each both ways): the training run saved every 10 steps (keyframe 6), a fine-tuning run
  (bf16 weights, learning rate 1e-5), and the same training only the last layer and the head;
  per kept step, ``load_checkpoint``'s time against one full load (the two alternated in
  rounds), and what the chain stores against bases alone. Each chain's last save runs as after
  a restart: the parent is read back from the store.
On CUDA, every save also reports the peak GPU memory it took over the state, what it left
held, and the page-locked host memory the process then holds for its snapshots. Every load is
compared bit for bit. Medians by bench/timing.py; the table is printed last; JSON to
$OUT/checkpoints.json when OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import timing
import torch

import s4weights
from s4weights import chain, chainpolicy, hostmem

MIB = 1 << 20
ROWS: list[dict] = []
# Rounds of a chain's loads: each a full load and one load of every kept step. (Three loads of
# each step in turn, after the full load's three, moved the slowest step's figure on the GPU by
# a third from run to run: 1.54 and 2.01 on one H100 on 2026-12-07.)
CHAIN_ROUNDS = 9


def wall(fn, device: str, reps: int = 3) -> timing.Timing:
    """``reps`` calls after one warm-up, the device synchronised around each."""
    return timing.measure(fn, reps, device=device)


def with_memory(fn, device: str, reps: int = 1, warmup: int = 0) -> tuple[timing.Timing, dict]:
    """``fn`` timed, and on CUDA the GPU memory its calls took over what was allocated before
    (peak, and held after) and the page-locked host memory held for snapshots after them."""
    if device != "cuda":
        return timing.measure(fn, reps, warmup=warmup, device=device), {}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = timing.measure(fn, reps, warmup=warmup, device=device)
    held = [b for entry in chain._PARENT_CACHE.values() for b in entry[3].values()]
    locked = sum(b.nbytes for b in held + list(hostmem._KEPT.values()))
    return t, {"peak_extra_MiB": round((torch.cuda.max_memory_allocated() - base) / MIB),
               "held_after_MiB": round((torch.cuda.memory_allocated() - base) / MIB),
               "host_locked_MiB": round(locked / MIB)}


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
    """A snapshot of the training state: copies, not the live tensors, so that states taken
    steps apart differ as a training loop's saves do. (Before 2026-12-04 the optimizer's
    moments were the live tensors: every state of a chain held the last step's moments.)"""
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights_bf16": {k: v.to(torch.bfloat16) for k, v in master.items()},
            "master_fp32": master, "optimizer": copy.deepcopy(opt.state_dict())}


def raw_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(raw_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(raw_bytes(v) for v in state)
    return 0


def plain_write(path: Path, nbytes: int) -> float:
    """Median seconds to write ``nbytes`` with one buffered write and fsync (the medium's
    floor)."""
    data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return timing.measure(write, 3, warmup=0).wall


def torch_save_fsync(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def disk_saves(state: dict, device: str, tmp: Path) -> None:
    """Blocking and asynchronous saves against torch and the medium."""
    step = iter(range(10**6))

    def s4_save(folder: str, **kw):
        return s4weights.save_checkpoint(state, tmp / folder, next(step), delta=False,
                                         keep_last=1, **kw)
    blocking, memory = with_memory(lambda: s4_save("sync"), device, reps=3, warmup=1)
    stored = chain.list_checkpoints(tmp / "sync")[-1].file_bytes
    pending = []

    def settle() -> None:
        """The previous asynchronous save committed and the device idle: off the clock."""
        while pending:
            pending.pop().result()
        timing.measure(lambda: None, 1, warmup=0, device=device)
    # blocked: until save_checkpoint returns; the device is not synchronised after the call,
    # since the save's copies run on while training goes on
    blocked = timing.measure(lambda: pending.append(s4_save("async", blocking=False)), 3,
                             warmup=0, before=settle)
    settle()
    committed = timing.measure(lambda: s4_save("async", blocking=False).result(), 3, warmup=0,
                               device=device)
    torch_s = wall(lambda: torch_save_fsync(state, tmp / "x.pt"), device).wall
    floor = plain_write(tmp / "plain", stored)
    row("save to local disk", raw_bytes=raw_bytes(state), stored_bytes=stored,
        s4_save_s=round(blocking.wall, 3), torch_save_fsync_s=round(torch_s, 3),
        plain_write_fsync_of_stored_s=round(floor, 3),
        s4_over_plain=round(blocking.wall / floor, 2), async_blocked_s=round(blocked.wall, 3),
        async_until_committed_s=round(committed.wall, 3), **memory)


def memory_round_trips(state: dict, device: str) -> None:
    """s4weights.save/load against torch.save/load, to and from memory."""
    buf = {}

    def s4_mem() -> None:
        buf["s4"] = io.BytesIO()
        s4weights.save(state, buf["s4"])

    def torch_mem() -> None:
        buf["pt"] = io.BytesIO()
        torch.save(state, buf["pt"])
    s4_save = wall(s4_mem, device).wall
    pt_save = wall(torch_mem, device).wall
    s4_load = wall(lambda: s4weights.load(buf["s4"].getvalue(), map_location=device), device)
    pt_load = wall(lambda: torch.load(io.BytesIO(buf["pt"].getvalue()),
                                      map_location=device), device).wall
    row("in memory", raw_bytes=raw_bytes(state), stored_bytes=len(buf["s4"].getvalue()),
        s4_save_s=round(s4_save, 3), torch_save_s=round(pt_save, 3),
        s4_load_s=round(s4_load.wall, 3), torch_load_s=round(pt_load, 3),
        bit_exact=same(state, s4_load.result))


def forget_parents() -> None:
    """What a restarted process starts with: no parent cached, no snapshot buffer kept."""
    chain._PARENT_CACHE.clear()
    hostmem.forget()


def chain_saves(root: Path, device: str, states, against: str
                ) -> tuple[dict, list[dict], Path]:
    """Save every state of ``states`` (a list of (step, state)) with the default policy
    (deltas against ``against``), the
    last one as a restarted process would, and the last one as one full file too, from the
    same device (a full file coded on the CPU path decodes at other speeds); the states kept on
    the CPU, each save's figures and the full file."""
    kept, figures = {}, []
    for n, (step, state) in enumerate(states):
        if n == len(states) - 1:
            forget_parents()
        t, memory = with_memory(lambda s=state, k=step: s4weights.save_checkpoint(
            s, root, k, keyframe_interval=6, delta_against=against), device)
        figures.append({"save_s": t.wall, "base": t.result.is_base, **memory})
        kept[step] = _to_cpu(state)
    full = root.parent / f"{root.name}-full.s4w"
    s4weights.save(state, full)
    return kept, figures, full


def chain_run(name: str, device: str, tmp: Path, states, against: str) -> None:
    """A chain's saves, then each kept step loaded, against one full save's load."""
    if against != chainpolicy.DELTA_AGAINST:
        name += f", deltas against the {against}"
    root = tmp / name
    kept_states, figures, full = chain_saves(root, device, list(states), against)
    infos = chain.list_checkpoints(root)
    by = {i.step: i for i in infos}
    exact = all(same(kept_states[i.step], s4weights.load_checkpoint(root, i.step,
                                                                    map_location=device))
                for i in infos)
    # The full load and every step's, one call of each a round (the slowest step's median
    # against the full load's, both taken over the same minutes).
    loads = {"full": lambda: s4weights.load(full, map_location=device)}
    loads.update({i.step: lambda s=i.step: s4weights.load_checkpoint(root, s,
                                                                      map_location=device)
                  for i in infos})
    t = timing.alternated(loads, CHAIN_ROUNDS, device=device, before=chain._PARENT_CACHE.clear)
    full_s = t["full"].wall
    worst = max(t[i.step].wall for i in infos) / full_s
    # step -> (files read, load seconds)
    steps = {i.step: (len(chain.chain_of(i.step, by)), round(t[i.step].wall, 4)) for i in infos}
    stored = sum(i.file_bytes for i in infos)
    bases = sum(i.full_stored_bytes + i.file_bytes - i.stored_bytes for i in infos)
    memory = {k: max(f[k] for f in figures) for k in figures[0] if k.endswith("MiB")}
    row(f"chain: {name}", checkpoints=len(infos), deltas=sum(not i.is_base for i in infos),
        stored_over_bases_alone=round(stored / bases, 3),
        base_save_s=_median(f["save_s"] for f in figures[:-1] if f["base"]),
        delta_save_s=_median(f["save_s"] for f in figures[:-1] if not f["base"]),
        save_after_restart_s=round(figures[-1]["save_s"], 3),
        after_restart="base" if figures[-1]["base"] else "delta",
        full_load_s=round(full_s, 3), worst_chain_load_over_full=round(worst, 2),
        step_files_and_load_s=steps,
        bit_exact=exact, base_reasons=sorted({i.base_reason for i in infos if i.base_reason}),
        **{f"max_{k}": v for k, v in memory.items()})


def _median(xs) -> float | None:
    xs = list(xs)
    return round(statistics.median(xs), 3) if xs else None


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
    ap.add_argument("--saves", type=int, default=8, help="checkpoints per chain (default 8)")
    ap.add_argument("--dim", type=int, help="model width (default 768 on CUDA, 256 on the CPU)")
    ap.add_argument("--layers", type=int, help="layers (default 12 on CUDA, 4 on the CPU)")
    ap.add_argument("--against", nargs="+", choices=chainpolicy.DELTA_TARGETS,
                    default=[chainpolicy.DELTA_AGAINST],
                    help="what the chains' deltas are taken against (save_checkpoint's "
                    "delta_against; default: its default); several: each chain once per value")
    args = ap.parse_args()
    dev = args.device
    dim = args.dim or (768 if dev == "cuda" else 256)
    layers = args.layers or (12 if dev == "cuda" else 4)
    tmp = Path(tempfile.mkdtemp(prefix="s4ckpt"))
    try:
        run(dev, dim, layers, args.saves, tmp, args.against)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = ["| what | figures |", "|---|---|"]
    table += [f"| {r['what']} | " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "what")
              + " |" for r in ROWS]
    timing.finish("checkpoints", f"Checkpoints in a training loop ({dev}, width {dim}, {layers} "
                  "layers)", table, ROWS)
    if not all(r.get("bit_exact", True) for r in ROWS):
        raise SystemExit("a load differs from the state saved")


def run(dev: str, dim: int, layers: int, saves_per_chain: int, tmp: Path,
        against: list[str]) -> None:
    model, opt, step = training(dev, dim, layers)
    for _ in range(20):
        step()
    state = state_of(model, opt)
    disk_saves(state, dev, tmp)
    memory_round_trips(state, dev)
    del state

    def trained():
        for n in range(saves_per_chain):
            for _ in range(10):
                step()
            yield n * 10, state_of(model, opt)
    states = list(trained())
    for to in against:
        chain_run("training, AdamW, every 10 steps", dev, tmp, states, to)
    del states
    ft_model, _ft_opt, ft_step = training(dev, dim, layers, lr=1e-5)
    ft_model.load_state_dict(model.state_dict())

    def fine_tuned():
        for n in range(saves_per_chain):
            for _ in range(10):
                ft_step()
            yield n * 10, {k: v.detach().to(torch.bfloat16)
                           for k, v in ft_model.state_dict().items()}
    states = list(fine_tuned())
    for to in against:
        chain_run("fine-tuning, bf16 weights, lr 1e-5", dev, tmp, states, to)
    del states
    # The same with the embedding and every layer but the last frozen (a backbone kept as it
    # is, as adapters and classifier heads are trained): most tensors of each delta unchanged.
    ft_model, _ft_opt, ft_step = training(dev, dim, layers, lr=1e-5)
    ft_model.load_state_dict(model.state_dict())
    for name, p in ft_model.named_parameters():
        if not name.startswith((f"body.layers.{layers - 1}.", "head.")):
            p.requires_grad_(False)
    states = list(fine_tuned())
    for to in against:
        chain_run("fine-tuning the last layer and head, bf16 weights, lr 1e-5", dev, tmp,
                  states, to)


if __name__ == "__main__":
    main()
