"""A/B of switches of the GPU encoder, on the GPU machine: ``python3 bench/encoder_ab.py ATTR
[ATTR ...]`` times ``Encoder.encode_device`` (device to device, as bench/gpu.py's rows) with
each of the encoder's attributes ATTR on (True) and off (False), one at a time, in alternating
rounds, on single tensors (the (a) case: 1 GiB bf16; and 256 MiB bf16, 512 MiB fp32), on a
state of many small tensors and on bench/gpu.py's (b) training state (20 steps,
``S4_AB_STEPS``; its 1 GiB workspace), then decodes each file on the CPU reader and compares
the two files byte for byte. Prints the median wall ms per call of each side. ``S4_AB_CASES``:
the cases whose names start with one of these comma-separated prefixes (e.g. ``(b)``).
Informative: bench/gpu.py holds the figures the issue's targets are read from."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import torch

from s4weights.gpu.encode import Encoder, Item, file_of

ROUNDS = 5


def cases() -> dict[str, tuple[dict[str, torch.Tensor], int | None]]:
    """name -> (tensors, workspace or None: the default)."""
    want = [p for p in os.environ.get("S4_AB_CASES", "").split(",") if p]
    out = {}

    def on(name: str) -> bool:
        return not want or any(name.startswith(p) for p in want)

    g = torch.Generator(device="cuda").manual_seed(0)
    if any(on(k) for k in ("(a)", "256", "512", "64 x")):
        x = torch.randn(1 << 29, device="cuda", generator=g) * 0.02
        small = {f"layer{i}.w": torch.randn(1 << 16, device="cuda", generator=g).to(
            torch.bfloat16) for i in range(64)}
        for name, t in (("(a) 1 GiB bf16", {"w": x.to(torch.bfloat16)}),
                        ("256 MiB bf16", {"w": x[: 1 << 27].to(torch.bfloat16)}),
                        ("512 MiB fp32", {"w": x[: 1 << 27].clone()}),
                        ("64 x 128 KiB bf16", small)):
            if on(name):
                out[name] = (t, None)
    if on("(b)"):
        state = gpu.trained_state(int(os.environ.get("S4_AB_STEPS", "20")))
        out["(b) training state"] = (gpu.flat_tensors(state), 1 << 30)
    return out


def main() -> None:
    attrs = sys.argv[1:]
    print(torch.cuda.get_device_name(), "switches:", " ".join(attrs), flush=True)
    for name, (tensors, workspace) in cases().items():
        items = [Item.of(t) for t in tensors.values()]
        for attr in attrs:
            encs = {}
            for on in (True, False):
                enc = Encoder("auto", workspace=workspace)
                assert hasattr(enc, attr), attr
                setattr(enc, attr, on)
                encs[on] = enc
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(ROUNDS):
                for on, enc in encs.items():
                    t, _ = gpu.timed(lambda e=enc, i=items: e.encode_device(i), reps=3)
                    times[on].append(t)
            same = file_of(encs[True], tensors) == file_of(encs[False], tensors)
            on, off = (statistics.median(times[k]) * 1e3 for k in (True, False))
            raw = sum(t.numel() * t.element_size() for t in tensors.values())
            print(f"{name:20} {attr}=True {on:8.3f} ms ({raw / on / 1e6:6.1f} GB/s)  "
                  f"False {off:8.3f} ms ({raw / off / 1e6:6.1f} GB/s)  same file: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
