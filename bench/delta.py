"""Delta size vs full size for a small trained model, at save intervals of 1, 10 and 100 steps.

Not a test. Trains the demo's TinyLM (fp32, AdamW) on the CPU, snapshots the state at step
``S`` and at ``S + k`` for k in 1, 10, 100, and codes each tensor of the later snapshot both
alone and as the XOR against the earlier one (what ``save_checkpoint`` stores is the smaller of
the two, per tensor). Reported per tensor kind: weights, Adam exp_avg, exp_avg_sq.

    python bench/delta.py [--start 200] [--json bench/out/delta.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from s4format.dtypes import BY_NAME
from s4format.writer import code_tensor
from s4weights.demo import TinyLM, train

FP32 = BY_NAME["float32"]


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = defaultdict(list)
    for p in model.parameters():
        out["weights"].append(p.detach().numpy().copy())
        st = opt.state[p]
        out["exp_avg"].append(st["exp_avg"].numpy().copy())
        out["exp_avg_sq"].append(st["exp_avg_sq"].numpy().copy())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=200)
    ap.add_argument("--json", default="bench/out/delta.json")
    args = ap.parse_args()
    intervals = (1, 10, 100)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    snaps = {}
    wanted = {args.start, *(args.start + k for k in intervals)}
    for step, _loss in train(model, opt, max(wanted)):
        if step in wanted:
            snaps[step] = state(model, opt)
    base = snaps[args.start]
    rows = []
    print("| interval | tensor kind | raw MB | full ratio | XOR-delta ratio | stored ratio "
          "(min per tensor) | delta / full |")
    print("|---|---|---|---|---|---|---|")
    for k in intervals:
        later = snaps[args.start + k]
        for kind in ("weights", "exp_avg", "exp_avg_sq"):
            raw = full = xor = best = 0
            for a, b in zip(later[kind], base[kind]):
                ra, rb = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
                f = code_tensor(ra, FP32).stored
                d = code_tensor(np.bitwise_xor(ra, rb), FP32).stored
                raw, full, xor, best = raw + ra.size, full + f, xor + d, best + min(f, d)
            rows.append(dict(interval=k, kind=kind, raw=raw, full=full, xor=xor, stored=best))
            print(f"| {k} | {kind} | {raw / 1e6:.2f} | {full / raw:.4f} | {xor / raw:.4f} | "
                  f"{best / raw:.4f} | {best / full:.3f} |", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
