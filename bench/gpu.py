"""The GPU codec against nvCOMP, and save/load on CUDA against torch (``python bench/gpu.py``).

One question: how fast is S4 on a GPU, next to nvCOMP's ANS (float mode) and torch.save/load?
Cases: (a) one 1 GiB bf16 tensor N(0, 0.02); (b) the training state of a ~100M-parameter
transformer trained a few hundred steps (bf16 weights, fp32 master weights, AdamW state):
device to device and through the host, against nvCOMP; (c) end to end, s4weights.save/load of
(b) against torch.save/torch.load to local disk and to memory; (d) smaller states (prefixes of
(b)) in memory at the default workspace. Every figure is a median after warm-up, timed with
CUDA events by bench/timing.py (host syncs inside the S4 path are part of what is timed);
every result is checked bit-exact. Needs CUDA, the ``gpu`` extra and nvCOMP's Python package.
The table is printed last; JSON to $OUT/gpu.json when OUT is set.

    python bench/gpu.py [--reps 5] [--steps 200] [--small 40,300] [--profile]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import timing
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import s4format
import s4weights
from s4format.writer import Writer
from s4weights.gpu import decode
from s4weights.gpu.encode import Encoder, Item

REPS = int(os.environ.get("S4_BENCH_REPS", "5"))
ROWS: list[dict] = []
PROFILE = False


def timed(fn, reps: int | None = None) -> timing.Timing:
    """CUDA-event times of ``reps`` calls after a warm-up that compiles kernels and fills the
    allocator's caches."""
    # Garbage is collected once, before the warm-up, for every row alike; not before each rep:
    # a collection right before a call slowed the call that followed (on the H200, 2026-11-30,
    # commit 06b5cfa: (b) encode 22 ms per call without, 31 ms with a gc.collect() before
    # each), which is not how a training loop calls save. The collector stays on, as it is there.
    t = timing.measure(fn, reps or REPS, events=True, collect=True)
    # every rep, in order (stderr, the log): whether slow reps come first (settling) or at
    # random shows here, not in the median
    print("  timed reps, ms: " + " ".join(f"{1e3 * w:.2f}" for w in t.walls), file=sys.stderr,
          flush=True)
    return t


def row(case: str, codec: str, raw: int, stored: int, enc_s: float, dec_s: float,
        exact: bool, **extra) -> None:
    r = dict(case=case, codec=codec, raw_bytes=raw, stored_bytes=stored,
             ratio=round(stored / raw, 4), enc_GBps=round(raw / enc_s / 1e9, 1),
             dec_GBps=round(raw / dec_s / 1e9, 1), exact=exact, **extra)
    ROWS.append(r)
    print(json.dumps(r), flush=True)


# -- S4 on a list of device tensors -----------------------------------------------------------

def s4_items(tensors: dict[str, torch.Tensor]) -> list[Item]:
    return [Item.of(t) for t in tensors.values()]


def file_image(coded, tensors: dict[str, torch.Tensor], items: list[Item]) -> bytes:
    """The .s4w file of ``coded`` (the encoder's output for ``tensors``), in memory."""
    buf = io.BytesIO()
    with Writer(buf) as w:
        for (name, t), it, c in zip(tensors.items(), items, coded):
            w.add_coded(name, it.dtype, tuple(t.shape), c.coded, c.content_hash)
        w.set_tree({k: s4format.objtree.TensorRef(i) for i, k in enumerate(tensors)})
    return buf.getvalue()


def load_groups(reader: s4format.Reader, limit: int) -> list[list[int]]:
    """Tensor indices grouped as s4weights.load batches them: the staged payloads and the
    decoded planes waiting for the merge (decode.device_extra) fit the workspace."""
    groups, used, cur = [], 0, []
    for i in range(len(reader.tensors)):
        need = decode.device_extra(reader, i)
        if cur and used + need > limit:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += need
    groups.append(cur)
    return groups


def exact_bytes(outs: list[torch.Tensor], tensors: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(o, t.reshape(-1).view(torch.uint8))
               for o, t in zip(outs, tensors.values()))


def s4_case(case: str, tensors: dict[str, torch.Tensor], workspace: int | None = None) -> None:
    """Two rows. Device-to-device (what nvCOMP's figures measure): device tensors -> compacted
    coded payload buffers on the device with all the metadata a writer needs (codecs, sizes,
    plane checksums, content hashes); and coded payloads already on the device -> tensors
    (checksums, decode, merge, content hashes). Then with the host side: encode to pinned host
    memory (D2H included) and decode from a file image in memory (pinned staging and H2D)."""
    enc = Encoder("auto", workspace=workspace)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    items = s4_items(tensors)
    enc_d2d = timed(lambda: enc.encode_device(items)).wall
    host = timed(lambda: list(enc.code(items)))
    blob = file_image(host.result, tensors, items)
    enc_s = host.wall
    del host
    reader = s4format.Reader(blob)
    outs = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
            for t in tensors.values()]
    groups = load_groups(reader, workspace or (1 << 30))
    on_gpu = [kept for g in groups if (kept := [i for i in g if decode.decodable(reader, i)])]
    on_cpu = [i for i in range(len(outs)) if not decode.decodable(reader, i)]
    staged = [decode.stage(reader, g) for g in on_gpu]

    def dec_d2d() -> None:
        for g, st in zip(on_gpu, staged):
            decode.decode_staged(st, [outs[i] for i in g])
        for i in on_cpu:  # tensors the CPU coder coded (tiny ones): host decode + copy
            outs[i].copy_(torch.from_numpy(reader.read_raw(i)))

    dec_d2d_s = timed(dec_d2d).wall
    exact_d2d = exact_bytes(outs, tensors)
    if PROFILE:
        kernel_profile(f"{case}: encode d2d", lambda: enc.encode_device(items))
        kernel_profile(f"{case}: decode d2d", dec_d2d)
    staged.clear()
    for o in outs:
        o.fill_(0xAB)

    def dec() -> None:
        for g in groups:
            decode.read_tensors(reader, g, [outs[i] for i in g])

    dec_s = timed(dec).wall
    stored = sum(p.stored_len for t in reader.tensors for p in t.planes)
    row(case, "s4 d2d", raw, stored, enc_d2d, dec_d2d_s, exact_d2d, mode="device-to-device")
    row(case, "s4 host", raw, stored, enc_s, dec_s, exact_bytes(outs, tensors),
        file_bytes=len(blob), mode="to pinned host / from file image in memory")


def kernel_profile(what: str, fn) -> None:
    """Device time per kernel of one warm call (torch.profiler/CUPTI sees CuPy's and nvCOMP's
    kernels too), against the call's wall time: where the device time goes, and how much of
    the wall the device is busy at all."""
    try:
        _kernel_profile(what, fn)
    except Exception as e:  # the profile is informative; never lose the run over it
        print(f"kernel profile, {what}: failed: {e!r}", flush=True)


def _kernel_profile(what: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            per.setdefault(e.name, []).append(e.device_time_total if hasattr(
                e, "device_time_total") else e.cuda_time_total)
    busy = sum(sum(v) for v in per.values()) / 1e3
    print(f"kernel profile, {what}: wall {wall * 1e3:.2f} ms, device busy {busy:.2f} ms",
          flush=True)
    for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {sum(v) / 1e3:8.3f} ms  {len(v):5d}x  {name[:90]}", flush=True)


# -- nvCOMP ------------------------------------------------------------------------------------

def nvcomp_case(case: str, tensors: dict[str, torch.Tensor], algorithm: str) -> None:
    from nvidia import nvcomp
    stream = torch.cuda.current_stream().cuda_stream
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    codecs = {}
    for dt in {t.dtype for t in tensors.values()}:
        kw = {}
        if algorithm == "ANS":
            kw["data_type"] = "<f4" if dt == torch.float32 else "<f2"
        codecs[dt] = nvcomp.Codec(algorithm=algorithm, cuda_stream=stream, **kw)
    arrays = {k: nvcomp.as_array(t.reshape(-1).view(torch.uint8) if algorithm != "ANS"
                                 else t.reshape(-1).view(torch.int16 if t.element_size() == 2
                                                         else torch.int32).view(
                                     torch.float16 if t.element_size() == 2 else torch.float32),
                                 stream) for k, t in tensors.items()}

    def enc():
        return {k: codecs[tensors[k].dtype].encode(a) for k, a in arrays.items()}

    encoded = timed(enc)
    comp = encoded.result
    stored = sum(c.buffer_size for c in comp.values())

    def dec():
        return {k: codecs[tensors[k].dtype].decode(c) for k, c in comp.items()}

    decoded = timed(dec)
    if PROFILE:
        kernel_profile(f"{case}: nvcomp {algorithm} encode", enc)
        kernel_profile(f"{case}: nvcomp {algorithm} decode", dec)
    outs = decoded.result
    exact = all(torch.equal(torch.as_tensor(outs[k], device="cuda").view(torch.uint8)
                            .reshape(-1), t.reshape(-1).view(torch.uint8))
                for k, t in tensors.items())
    row(case, f"nvcomp {algorithm}", raw, stored, encoded.wall, decoded.wall, exact,
        mode="device-to-device")


# -- (b) a trained transformer -----------------------------------------------------------------

def training_run():
    """(b)'s transformer (bf16 autocast), its AdamW, and a function that trains it one step
    (returning the loss)."""
    torch.manual_seed(0)
    d, layers, vocab, seq, batch = 768, 12, 32000, 256, 16
    layer = torch.nn.TransformerEncoderLayer(d, 12, 4 * d, batch_first=True, norm_first=True)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, d),
        "body": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        "head": torch.nn.Linear(d, vocab)}).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device="cuda")

    def step() -> torch.Tensor:
        x = torch.randint(0, vocab // 8, (batch, seq + 1), device="cuda")
        x = (x * 7 + torch.arange(seq + 1, device="cuda")) % vocab  # learnable structure
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model["body"](model["emb"](x[:, :-1]), mask=mask, is_causal=True)
            loss = torch.nn.functional.cross_entropy(model["head"](h).flatten(0, 1).float(),
                                                     x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """(b)'s training state: bf16 weights, fp32 master weights (copies), AdamW's state."""
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights_bf16": {k: v.to(torch.bfloat16) for k, v in master.items()},
            "master_fp32": master, "optimizer": opt.state_dict()}


def trained_state(steps: int = 200) -> dict:
    model, opt, step = training_run()
    for _ in range(steps):
        loss = step()
    nparams = sum(p.numel() for p in model.parameters())
    print(f"trained {nparams / 1e6:.1f}M parameters for {steps} steps, loss {loss.item():.3f}",
          flush=True)
    return state_of(model, opt)


def flat_tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(state, torch.Tensor):
        if state.is_cuda and state.dtype in (torch.bfloat16, torch.float16, torch.float32) \
                and state.numel() > 1:
            out[prefix] = state.contiguous()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat_tensors(v, f"{prefix}.{i}"))
    return out


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        # map_location="cuda" moves CPU tensors (AdamW's step counters) too: compare bytes.
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8).to(b.device),
                        b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def end_to_end(state: dict, case: str = "(c) end to end", only: set[str] | None = None) -> None:
    """s4weights.save/load against torch.save/load of ``state``, to disk and to memory, with
    the product's defaults (workspace included); ``only`` picks some of the cases."""
    with tempfile.TemporaryDirectory(prefix="s4bench") as folder:
        cases = api_cases(state, Path(folder))
        for name, (save, load, size) in cases.items():
            if only is None or name in only:
                api_row(case, name, state, save, load, size)


def api_cases(state: dict, tmp: Path) -> dict[str, tuple]:
    """(save, load, stored bytes) per way of saving ``state``."""
    mem: dict[str, io.BytesIO] = {}

    def to_memory(key: str, save, **kw):
        def call() -> None:
            mem[key] = io.BytesIO()
            save(state, mem[key], **kw)
        return call

    return {
        "s4weights disk": (lambda: s4weights.save(state, tmp / "x.s4w"),
                           lambda: s4weights.load(tmp / "x.s4w", map_location="cuda"),
                           lambda: (tmp / "x.s4w").stat().st_size),
        "torch disk": (lambda: torch.save(state, tmp / "x.pt"),
                       lambda: torch.load(tmp / "x.pt", map_location="cuda"),
                       lambda: (tmp / "x.pt").stat().st_size),
        "s4weights memory": (to_memory("s4", s4weights.save), lambda: s4weights.load(
            mem["s4"].getvalue(), map_location="cuda"), lambda: len(mem["s4"].getvalue())),
        "s4weights nvcomp-ans memory": (
            to_memory("ans", s4weights.save, policy="nvcomp-ans"),
            lambda: s4weights.load(mem["ans"].getvalue(), map_location="cuda"),
            lambda: len(mem["ans"].getvalue())),
        "torch memory": (to_memory("pt", torch.save), lambda: torch.load(
            io.BytesIO(mem["pt"].getvalue()), map_location="cuda"),
            lambda: len(mem["pt"].getvalue())),
    }


def api_row(case: str, name: str, state: dict, save, load, size) -> None:
    """One way of saving: save and load timed (3 calls each), with their peak extra GPU memory."""
    raw = sum(t.numel() * t.element_size() for t in flat_tensors(state).values())
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    save_s = timed(save, reps=3).wall
    save_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loaded = timed(load, reps=3)
    load_peak = torch.cuda.max_memory_allocated() - base
    row(case, name, raw, size(), save_s, loaded.wall, same_state(state, loaded.result),
        save_s=round(save_s, 3), load_s=round(loaded.wall, 3),
        save_peak_extra_MiB=round(save_peak / 2**20),
        load_peak_extra_MiB=round(load_peak / 2**20))


def prefix(tensors: dict[str, torch.Tensor], limit: int) -> dict[str, torch.Tensor]:
    """The first of ``tensors`` up to ``limit`` bytes: a smaller state of the same kind."""
    out, total = {}, 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if total + n > limit and out:
            break
        out[k], total = v, total + n
    return out


def one_tensor() -> None:
    """(a): one 1 GiB bf16 tensor, the same bytes in every run (seeded)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    one = {"w": (torch.randn(1 << 29, device="cuda", generator=g) * 0.02).to(torch.bfloat16)}
    s4_case("(a) 1 GiB bf16", one)
    nvcomp_case("(a) 1 GiB bf16", one, "ANS")
    # the API with its default workspace (10% of the state): the tensor is coded and decoded
    # in chunks
    end_to_end(one, "(a) via the API", only={"s4weights memory", "torch memory"})
    del one
    torch.cuda.empty_cache()


def training_state(steps: int, small_mb: list[int]) -> None:
    """(b), (c) and (d) on the trained transformer's state."""
    state = trained_state(steps)
    tensors = flat_tensors(state)
    print(f"state: {len(tensors)} tensors, "
          f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30:.2f} GiB",
          flush=True)
    s4_case("(b) training state", tensors, workspace=1 << 30)
    nvcomp_case("(b) training state", tensors, "ANS")
    end_to_end(state)
    for mb in small_mb:
        part = prefix(tensors, mb * 10**6)
        end_to_end(part, f"(d) {sum(t.nbytes for t in part.values()) / 1e6:.0f} MB state",
                   only={"s4weights memory", "torch memory"})


def table() -> list[str]:
    return timing.markdown(
        ["case", "codec", "ratio", "enc/save GB/s", "dec/load GB/s", "save s", "load s",
         "peak extra MiB save/load", "exact"],
        [[r["case"], r["codec"], f"{r['ratio']:.4f}", r["enc_GBps"], r["dec_GBps"],
          r.get("save_s", "-"), r.get("load_s", "-"),
          f"{r['save_peak_extra_MiB']} / {r['load_peak_extra_MiB']}"
          if "save_peak_extra_MiB" in r else "-", r["exact"]] for r in ROWS])


def main() -> None:
    global REPS, PROFILE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=REPS,
                    help="timed calls per codec figure (default S4_BENCH_REPS or 5)")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("S4_BENCH_STEPS", "200")),
                    help="training steps of (b) (default S4_BENCH_STEPS or 200)")
    ap.add_argument("--small", default=os.environ.get("S4_BENCH_SMALL", "40,300"),
                    help="MB of the (d) states, comma-separated; empty for none")
    ap.add_argument("--profile", action="store_true", help="print each case's kernel times")
    args = ap.parse_args()
    REPS, PROFILE = args.reps, args.profile
    torch.cuda.init()
    one_tensor()
    training_state(args.steps, [int(x) for x in args.small.split(",") if x])
    timing.finish("gpu", "GPU codec against nvCOMP, and save/load against torch", table(),
                  ROWS)
    if not all(r["exact"] for r in ROWS):
        raise SystemExit("a round trip was not bit-exact")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
