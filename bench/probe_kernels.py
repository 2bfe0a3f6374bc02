"""One warm device-to-device encode and decode of 1 GiB of N(0, 0.02) bf16, for a profiler
to watch (e.g. ``ncu --kernel-name regex:'rans_|split_hist|merge' python3
bench/probe_kernels.py``): the kernels of bench/gpu.py's case (a), nothing else timed."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu

import s4format
from s4weights.gpu import decode
from s4weights.gpu.encode import Encoder, file_of


def main() -> None:
    x = {"w": (torch.randn(1 << 29, device="cuda") * 0.02).to(torch.bfloat16)}
    enc = Encoder("auto")
    enc.encode_device(gpu.s4_items(x))              # the encode kernels, first
    torch.cuda.synchronize()
    blob = file_of(enc, x)
    st = decode.stage(s4format.Reader(blob), [0])
    out = [torch.empty_like(x["w"]).view(torch.uint8).reshape(-1)]
    decode.decode_staged(st, out)
    torch.cuda.synchronize()
    print("exact", torch.equal(out[0], x["w"].view(torch.uint8).reshape(-1)), flush=True)


if __name__ == "__main__":
    main()
