"""End-to-end demo (the README's main job): train a small transformer, keep a base and deltas
with ``save_checkpoint``, reload every checkpoint, check it bit for bit, and compare with
``torch.save``. Runs on the GPU when there is one, on the CPU otherwise.

    python -m s4weights.demo [--steps 60] [--every 10] [--dir DIR]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

import s4weights
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
    ap.add_argument("--dir", help="checkpoint directory (default: a fresh temporary one; an "
                                  "existing run there must not hold the demo's steps)")
    args = ap.parse_args(argv)
    if args.steps < args.every:
        ap.error("--steps must be at least --every (no checkpoint would be saved)")
    try:
        return _demo(args)
    except S4Error as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {n}")
    return n


def _demo(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    root = args.dir or tempfile.mkdtemp(prefix="s4w-demo-")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"s4weights demo: {n_params / 1e6:.2f}M-parameter transformer on {device}, "
          f"{args.steps} steps, a checkpoint every {args.every} -> {root}")
    rows, saved = [], {}
    for step, loss in train(model, opt, args.steps, device):
        if step % args.every:
            continue
        state = snapshot(model, opt, step)
        t0 = time.perf_counter()
        info = s4weights.save_checkpoint(state, root, step=step)
        t_save = time.perf_counter() - t0
        buf = io.BytesIO()
        t0 = time.perf_counter()
        torch.save(state, buf)
        t_torch = time.perf_counter() - t0
        saved[step] = {k: v for k, v in torch.load(io.BytesIO(buf.getvalue())).items()}
        rows.append((info, t_save, len(buf.getvalue()), t_torch, float(loss.detach())))
    print(f"{'step':>5} {'kind':<12} {'raw MB':>8} {'stored MB':>9} {'ratio':>6} "
          f"{'save s':>7} {'load s':>7} {'MB/s':>7} {'torch MB':>9} {'torch s':>8}  bit-exact")
    ok = True
    for info, t_save, torch_bytes, t_torch, _loss in rows:
        t0 = time.perf_counter()
        back = s4weights.load_checkpoint(root, step=info.step)
        t_load = time.perf_counter() - t0
        exact = same(saved[info.step], back)
        ok &= exact
        kind = "base" if info.is_base else f"delta<-{info.parent_step}"
        print(f"{info.step:>5} {kind:<12} {info.raw_bytes / 1e6:>8.2f} "
              f"{info.file_bytes / 1e6:>9.2f} {info.file_bytes / info.raw_bytes:>6.3f} "
              f"{t_save:>7.3f} {t_load:>7.3f} {info.raw_bytes / 1e6 / t_save:>7.1f} "
              f"{torch_bytes / 1e6:>9.2f} {t_torch:>8.3f}  {'yes' if exact else 'NO'}")
    total = sum(r[0].file_bytes for r in rows)
    torch_total = sum(r[2] for r in rows)
    print(f"total stored {total / 1e6:.2f} MB vs torch.save {torch_total / 1e6:.2f} MB "
          f"({total / torch_total:.3f}); every checkpoint bit-exact: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
