"""S3 throughput of s4weights against a local SeaweedFS, next to boto3's own transfer manager.

Not a test. Starts ``weed mini`` on loopback (as the test suite does), builds a float32 state
dict of ``--size`` bytes (N(0, 0.02) weights in 4 MiB tensors) and times, each once:

* ``boto3 upload_file`` / ``download_file`` of the raw tensor bytes (one file on local disk,
  TransferConfig defaults: 8 MiB parts, 10 threads) — the transport baseline;
* ``S3Store`` streaming the same raw bytes through ``writer()`` / ``source().read_at`` — our
  transport alone (no codec), so the two are comparable;
* ``s4weights.save(state, "s3://...")`` / ``s4weights.load`` end to end (coding + transport),
  and the same to a local file, so the difference is what S3 costs on top of the codec.

Rates are raw (uncompressed) bytes per second, in MB/s (10^6).

    python bench/s3.py [--size 1G] [--part-size 8M] [--concurrency 4] [--policy auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import s4weights
from s4weights.store.s3 import S3Store
from tests.s3 import seaweed

TENSOR = 4 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def make_state(size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:04d}.weight": torch.randn(TENSOR // 4, generator=g) * 0.02
            for i in range(size // TENSOR)}


def timed(label: str, nbytes: int, fn) -> float:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    print(f"{label:<44} {dt:8.2f} s  {nbytes / dt / 1e6:8.1f} MB/s", flush=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="raw checkpoint size (default 1G)")
    ap.add_argument("--part-size", default="8M")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--policy", default="auto", choices=["auto", "seed"])
    args = ap.parse_args()
    size = parse_size(args.size) // TENSOR * TENSOR
    part = parse_size(args.part_size)

    from boto3.s3.transfer import TransferConfig

    with tempfile.TemporaryDirectory(prefix="s4w-bench-s3-") as tmp:
        root = Path(tmp)
        server = seaweed.start(root)
        try:
            client = seaweed.admin_client(server.endpoint)
            client.create_bucket(Bucket="bench")
            store = S3Store("bench", "run", client=client, part_size=part,
                            max_concurrency=args.concurrency)
            state = make_state(size)
            raw = root / "raw.bin"
            with open(raw, "wb") as f:
                for t in state.values():
                    f.write(t.numpy().tobytes())
            print(f"{size / 2**30:.2f} GiB raw float32 in {len(state)} tensors; S3Store part "
                  f"{part >> 20} MiB x {args.concurrency} threads; {os.cpu_count()} CPUs",
                  flush=True)
            cfg = TransferConfig()
            timed("boto3 upload_file (raw bytes)", size,
                  lambda: client.upload_file(str(raw), "bench", "raw.bin", Config=cfg))
            timed("boto3 download_file (raw bytes)", size,
                  lambda: client.download_file("bench", "raw.bin", str(root / "raw.out"),
                                               Config=cfg))
            (root / "raw.out").unlink()

            def stream_up() -> None:
                with store.writer("raw.bin") as w:
                    for t in state.values():
                        w.write(t.numpy())

            timed("S3Store writer (raw bytes, no codec)", size, stream_up)
            timed("S3Store source read_at (raw bytes)", size,
                  lambda: store.source("raw.bin").read_at(0, size))

            url = "s3://bench/run/ckpt.s4w"
            os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_DEFAULT_REGION=seaweed.REGION,
                              AWS_ACCESS_KEY_ID=seaweed.ACCESS_KEY,
                              AWS_SECRET_ACCESS_KEY=seaweed.SECRET_KEY)
            result = None

            def save() -> None:
                nonlocal result
                result = s4weights.save(state, url, policy=args.policy)

            timed(f"s4weights.save -> s3 (policy {args.policy})", size, save)
            assert result is not None
            print(f"{'':<44} stored {result.file_size} bytes, ratio "
                  f"{result.file_size / size:.4f}")
            loaded: dict = {}
            timed("s4weights.load <- s3 (verify on)", size,
                  lambda: loaded.update(s4weights.load(url)))
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
            loaded.clear()
            local = root / "ckpt.s4w"
            timed(f"s4weights.save -> local file (policy {args.policy})", size,
                  lambda: s4weights.save(state, local, policy=args.policy))
            timed("s4weights.load <- local file (verify on)", size,
                  lambda: loaded.update(s4weights.load(local)))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
