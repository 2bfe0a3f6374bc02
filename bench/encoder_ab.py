"""A/B of one switch of the GPU encoder, on the GPU machine: ``python3 bench/encoder_ab.py
ATTR`` times ``Encoder.encode_device`` (device to device, as bench/gpu.py's rows) with the
encoder's attribute ATTR on (True) and off (False), in alternating rounds, on single tensors
(the (a) case: 1 GiB bf16; and 256 MiB bf16, 512 MiB fp32) and on a state of many small
tensors, then decodes each file on the CPU reader and compares the two files byte for byte.
Prints the median wall ms per call of each side. Informative: bench/gpu.py holds the
figures the issue's targets are read from."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import torch

from s4weights.gpu.encode import Encoder, Item, file_of

ROUNDS = 5


def cases() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1 << 29, device="cuda", generator=g) * 0.02
    small = {f"layer{i}.w": torch.randn(1 << 16, device="cuda", generator=g).to(torch.bfloat16)
             for i in range(64)}
    return {"(a) 1 GiB bf16": {"w": x.to(torch.bfloat16)},
            "256 MiB bf16": {"w": x[: 1 << 27].to(torch.bfloat16)},
            "512 MiB fp32": {"w": x[: 1 << 27].clone()},
            "64 x 128 KiB bf16": small}


def main() -> None:
    attr = sys.argv[1]
    print(torch.cuda.get_device_name(), "switch:", attr, flush=True)
    for name, tensors in cases().items():
        items = [Item.of(t) for t in tensors.values()]
        encs = {}
        for on in (True, False):
            enc = Encoder("auto")
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
