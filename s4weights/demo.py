"""End-to-end demo (the README's main job): train a small transformer, keep a base and deltas
with ``save_checkpoint``, reload every checkpoint, check it bit for bit, and compare with
``torch.save``/``torch.load`` of the same states, both written to disk with fsync and read back
from it. Runs on the GPU when there is one, on the CPU otherwise. A temporary folder is removed
at the end unless ``--keep``; ``--dir`` is kept.

    python -m s4weights.demo [--steps 60] [--every 10] [--dir DIR | --keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import s4weights
from s4format import jit
from s4format.errors import S4Error


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        block = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def train(model: TinyLM, opt: torch.optim.Optimizer, steps: int,
          device: str | torch.device = "cpu") -> Iterator[tuple[int, torch.Tensor]]:
    """Train ``model`` for ``steps`` steps on random tokens (next-token loss, batches of 8 x 64),
    yielding ``(step, loss)`` after each optimizer step, counting from 1, so that the caller can
    snapshot or save between steps."""
    vocab = model.embed.num_embeddings
    for step in range(1, steps + 1):
        x = torch.randint(0, vocab, (8, 64), device=device)
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1),
                                                 x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step, loss


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state()}


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of two checkpoint trees (dtype, shape and every byte)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().cpu().reshape(-1).view(torch.uint8),
                                b.detach().cpu().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m s4weights.demo", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=_positive, default=60, help="training steps (default 60)")
    ap.add_argument("--every", type=_positive, default=10,
                    help="a checkpoint every this many steps (default 10)")
    ap.add_argument("--dir", help="where to write (default: a fresh temporary folder, removed "
                                  "at the end); S4 checkpoints go to DIR/s4, torch.save files "
                                  "to DIR/torch, and DIR/s4 must not hold the demo's steps")
    ap.add_argument("--dim", type=_positive, default=256, help="model width (default 256)")
    ap.add_argument("--layers", type=_positive, default=4, help="transformer layers (default 4)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary folder (its path is printed)")
    args = ap.parse_args(argv)
    if args.steps < args.every:
        ap.error("--steps must be at least --every (no checkpoint would be saved)")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="s4w-demo-"))
    try:
        return _demo(args, root)
    except S4Error as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if args.dir or args.keep:
            print(f"checkpoints left in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            print(f"removed {root}")


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {n}")
    return n


def torch_save_durably(obj: Any, path: Path) -> int:
    """torch.save as s4weights saves: to a temporary file, fsync, rename, fsync of the folder;
    returns the file's size."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return path.stat().st_size


@dataclass
class _Row:
    info: Any
    s4_save: float
    torch_bytes: int
    torch_save: float


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def _demo(args: argparse.Namespace, root: Path) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyLM(dim=args.dim, layers=args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    s4_dir, torch_dir = root / "s4", root / "torch"
    torch_dir.mkdir(parents=True, exist_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"s4weights demo: {n_params / 1e6:.2f}M-parameter transformer on {device}, "
          f"{args.steps} steps, a checkpoint every {args.every} -> {root}\n"
          "both sides write to disk, fsync'd and renamed into place; loads read them back")
    rows = []
    for step, _loss in train(model, opt, args.steps, device):
        if step % args.every == 0:
            state = snapshot(model, opt, step)
            info, t_s4 = _timed(s4weights.save_checkpoint, state, s4_dir, step=step)
            size, t_torch = _timed(torch_save_durably, state, torch_dir / f"step-{step}.pt")
            rows.append(_Row(info, t_s4, size, t_torch))
    return _report(rows, s4_dir, torch_dir)


def _report(rows: list[_Row], s4_dir: Path, torch_dir: Path) -> int:
    print(f"{'':27}{' s4weights ':-^32}  {' torch ':-^24}")
    print(f"{'step':>5} {'kind':<12} {'raw MB':>8} {'MB':>8} {'ratio':>6} {'save s':>7} "
          f"{'load s':>7}  {'MB':>8} {'save s':>7} {'load s':>7}  bit-exact")
    ok, loads = True, []
    for r in rows:
        info = r.info
        want, t_torch = _timed(torch.load, torch_dir / f"step-{info.step}.pt")
        back, t_s4 = _timed(s4weights.load_checkpoint, s4_dir, step=info.step)
        exact = same(want, back)
        ok &= exact
        loads.append((t_s4, t_torch))
        kind = "base" if info.is_base else f"delta<-{info.parent_step}"
        print(f"{info.step:>5} {kind:<12} {info.raw_bytes / 1e6:>8.2f} "
              f"{info.file_bytes / 1e6:>8.2f} {info.file_bytes / info.raw_bytes:>6.3f} "
              f"{r.s4_save:>7.3f} {t_s4:>7.3f}  {r.torch_bytes / 1e6:>8.2f} "
              f"{r.torch_save:>7.3f} {t_torch:>7.3f}  {'yes' if exact else 'NO'}")
    total = sum(r.info.file_bytes for r in rows)
    torch_total = sum(r.torch_bytes for r in rows)
    print(f"total: S4 {total / 1e6:.2f} MB, saves {sum(r.s4_save for r in rows):.2f} s, loads "
          f"{sum(s for s, _ in loads):.2f} s; torch.save {torch_total / 1e6:.2f} MB, saves "
          f"{sum(r.torch_save for r in rows):.2f} s, loads {sum(t for _, t in loads):.2f} s; "
          f"size ratio {total / torch_total:.3f}; every checkpoint bit-exact: "
          f"{'yes' if ok else 'NO'}")
    if jit.numba_started():
        print("(the first save included numba's start-up, about half a second: "
              "python -m s4format kernels build, once per machine, builds the CPU kernels "
              "ahead of time)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
