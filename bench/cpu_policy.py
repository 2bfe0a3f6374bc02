"""CPU save and load of bf16 and fp32 weights under the default policy (format 1.1: 7-bit
mantissa planes bit-packed, codec 8) against ``auto-1.0`` (format 1.0: rANS on them): seconds,
MB/s and ratio, best of ``--repeat`` runs, on the machine's CPU (numba uses its threads).

Not a test: prints one row per (dtype, policy).

    python bench/cpu_policy.py [--elements 32M] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import time

import torch

import s4weights


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", default="32M")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = int(a.elements.rstrip("M")) * (1 << 20) if a.elements.endswith("M") else int(a.elements)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g) * 0.02
    print(f"{'dtype':9} {'policy':9} {'ratio':>7} {'save s':>7} {'load s':>7} "
          f"{'save MB/s':>9} {'load MB/s':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        state = {"w": w.to(dtype)}
        raw = state["w"].numel() * state["w"].element_size()
        for policy in ("auto", "auto-1.0"):
            buf = io.BytesIO()
            s4weights.save(state, buf, policy=policy, device="cpu", progress=False)
            blob = buf.getvalue()

            def save(state=state, policy=policy) -> None:
                s4weights.save(state, io.BytesIO(), policy=policy, device="cpu", progress=False)

            def load(blob=blob) -> None:
                s4weights.load(blob)

            ts, tl = _best(save, a.repeat), _best(load, a.repeat)
            back = s4weights.load(blob)["w"]
            assert torch.equal(back.view(torch.uint8), state["w"].view(torch.uint8))
            print(f"{str(dtype).removeprefix('torch.'):9} {policy:9} {len(blob) / raw:7.4f} "
                  f"{ts:7.3f} {tl:7.3f} {raw / ts / 1e6:9.0f} {raw / tl / 1e6:9.0f}")


if __name__ == "__main__":
    main()
