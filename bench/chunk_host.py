"""The chunked loader's host time per chunk, on the GPU machine (``python3 bench/chunk_host.py``):
one bf16 tensor of ``S4_CHUNK_MB`` MB (default 49, N(0, 0.02)) saved to memory and decoded by
``chunked.load_large`` at ``S4_CHUNK_WS`` MiB of workspace (default 4.7, its state's default),
warm; the wall time against the exclusive host time of the loader's stages and of the torch,
CuPy and numpy calls it makes (wrapped with ``time.perf_counter``), per chunk. Informative:
where a host-bound chunked load spends its time."""

from __future__ import annotations

import io
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import host_stages
from walls import walls

import s4format
import s4weights
from s4weights.gpu import decode, plan, runtime
from s4weights.gpu import decode_large as chunked

MB = int(float(os.environ.get("S4_CHUNK_MB", "49")) * 1e6)
WS = int(float(os.environ.get("S4_CHUNK_WS", "4.7")) * (1 << 20))
REPS = int(os.environ.get("S4_CHUNK_REPS", "10"))

WRAPPED = [
    (chunked, ["_load_chunk", "_tables", "_windows", "_check"]),
    (chunked._Level, ["__init__", "pieces", "span", "need", "align"]),
    (chunked._Run, ["__init__", "addresses", "tables", "launch"]),
    (decode, ["copy_into"]),
    (runtime, ["upload", "launch", "leaf_digests", "device_empty", "pinned",
               "rans_decode_kernel"]),
    (plan, ["cta_table", "chunk_table"]),
    (torch, ["zeros", "argmax", "cat", "empty"]),
    (torch.Tensor, ["to", "copy_", "__ne__", "__getitem__", "reshape", "numpy", "data_ptr"]),
    (torch.cuda.Event, ["record", "synchronize", "__init__"]),
    (np, ["concatenate", "arange", "where", "cumsum"]),
]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(MB // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    buf = io.BytesIO()
    s4weights.save({"x": x}, buf, device="cuda")
    reader = s4format.Reader(buf.getvalue())
    out = torch.empty(x.numel() * 2, dtype=torch.uint8, device="cuda")

    def call() -> None:
        chunked.load_large(reader, 0, out, WS)

    call()
    torch.cuda.synchronize()
    assert torch.equal(out, x.view(torch.uint8)), "not bit-exact"
    times = walls(call, REPS, warm=2)
    lv = chunked._Level(reader, 0)
    chunk = chunked._load_chunk([lv], out.numel(), WS)
    n = -(-out.numel() // chunk)
    print(f"{MB / 1e6:.1f} MB bf16 at {WS / (1 << 20):.1f} MiB: {n} chunks of {chunk} bytes; "
          f"wall median {1e3 * statistics.median(times):.2f} ms "
          f"({1e3 * statistics.median(times) / n:.3f} ms per chunk), unwrapped", flush=True)
    done = set()
    for owner, names in WRAPPED:
        for name in names:
            if getattr(owner, name, None) is not None and (owner, name) not in done:
                done.add((owner, name))
                host_stages._timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
    host_stages.report(f"load_large, {n} chunks, wrapped", call, REPS)
    print(f"(per chunk: divide by {n})", flush=True)


if __name__ == "__main__":
    main()
