"""GPU benchmark (run on the H200 by bench/gpu_run.sh): S4 vs nvCOMP ANS float mode vs nvCOMP
GDeflate on (a) one 1 GiB bf16 tensor N(0, 0.02), (b) the training state of a ~100M-parameter
transformer trained a few hundred steps (bf16 weights, fp32 master weights, AdamW state), and
(c) end to end: s4weights.save/load of (b) vs torch.save/torch.load to local disk and to memory.

Every figure is a median after warm-up, timed with CUDA events (host syncs inside the S4 path are
part of what is timed); every run checks bit-exactness. The table is printed last and written
to $OUT/gpu_results.json when $OUT is set.
"""

from __future__ import annotations

import gc
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import s4format
import s4weights
from s4format.writer import Writer
from s4weights.gpu import decode
from s4weights.gpu.encode import Encoder, Item

REPS = int(os.environ.get("S4_BENCH_REPS", "5"))
ROWS: list[dict] = []


def timed(fn, reps: int = REPS) -> tuple[float, object]:
    # Garbage is collected once, before the warm-up, for every row alike; not before each rep:
    # a collection right before a call slowed the call that followed (bench/timeline.py on the
    # H200, (b) encode: 22 ms per call without, 31 ms with a gc.collect() before each), which
    # is not how a training loop calls save. The garbage collector stays on, as it is there.
    gc.collect()
    fn()  # warm-up (compiles kernels, fills allocator caches)
    times, out = [], None
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the previous rep's result is dropped before the clock starts (holding it while the
        # next rep runs would time the allocator under twice the memory one call needs)
        out = None
        torch.cuda.synchronize()
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    # every rep, in order (stderr, the log): whether slow reps come first (settling) or at
    # random shows here, not in the median
    print("  timed reps, ms: " + " ".join(f"{1e3 * t:.2f}" for t in times), file=sys.stderr,
          flush=True)
    return statistics.median(times), out


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


def s4_case(case: str, tensors: dict[str, torch.Tensor], mantissa: str,
            workspace: int | None = None) -> None:
    """Two rows. Device-to-device (what nvCOMP's figures measure): device tensors -> compacted
    coded payload buffers on the device with all the metadata a writer needs (codecs, sizes,
    plane checksums, content hashes); and coded payloads already on the device -> tensors
    (checksums, decode, merge, content hashes). Then with the host side: encode to pinned host
    memory (D2H included) and decode from a file image in memory (pinned staging and H2D)."""
    enc = Encoder("auto", mantissa=mantissa, workspace=workspace)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    items = s4_items(tensors)

    enc_d2d, _groups = timed(lambda: enc.encode_device(items))
    del _groups
    enc_s, coded = timed(lambda: list(enc.code(items)))
    buf = io.BytesIO()
    with Writer(buf) as w:
        for (name, t), it, c in zip(tensors.items(), items, coded):
            w.add_coded(name, it.dtype, tuple(t.shape), c.coded, c.content_hash)
        w.set_tree({k: s4format.objtree.TensorRef(i) for i, k in enumerate(tensors)})
    blob = buf.getvalue()
    del coded
    reader = s4format.Reader(blob)
    outs = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
            for t in tensors.values()]
    groups, used, cur = [], 0, []
    # as s4weights.load batches: the staged payloads and the decoded planes waiting for the
    # merge (decode.device_extra) fit the workspace
    limit = workspace or (1 << 30)
    for i in range(len(outs)):
        need = decode.device_extra(reader, i)
        if cur and used + need > limit:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += need
    groups.append(cur)
    on_gpu = [[i for i in g if decode.decodable(reader, i)] for g in groups]
    on_cpu = [i for i in range(len(outs)) if not decode.decodable(reader, i)]
    staged = [decode.stage(reader, g) for g in on_gpu if g]

    def dec_d2d() -> None:
        for g, st in zip([g for g in on_gpu if g], staged):
            decode.decode_staged(st, [outs[i] for i in g])
        for i in on_cpu:  # tensors the CPU coder coded (tiny ones): host decode + copy
            outs[i].copy_(torch.from_numpy(reader.read_raw(i)))

    dec_d2d_s, _ = timed(dec_d2d)
    exact_d2d = all(torch.equal(o, t.reshape(-1).view(torch.uint8))
                    for o, t in zip(outs, tensors.values()))
    # one warm profiled pass of each d2d direction (stage times on stderr; each stage is
    # synchronised there, so this pass is not part of the timings)
    os.environ["S4_GPU_PROFILE"] = "1"
    print(f"warm d2d profile, {case}:", file=sys.stderr, flush=True)
    enc.encode_device(items)
    dec_d2d()
    del os.environ["S4_GPU_PROFILE"]
    kernel_profile(f"{case}: encode d2d", lambda: enc.encode_device(items))
    kernel_profile(f"{case}: decode d2d", dec_d2d)
    host_profile(f"{case}: encode d2d", lambda: enc.encode_device(items))
    host_profile(f"{case}: decode d2d", dec_d2d)
    staged.clear()
    for o in outs:
        o.fill_(0xAB)

    def dec() -> None:
        for g in groups:
            decode.read_tensors(reader, g, [outs[i] for i in g])

    dec_s, _ = timed(dec)
    exact = all(torch.equal(o, t.reshape(-1).view(torch.uint8))
                for o, t in zip(outs, tensors.values()))
    stored = sum(p.stored_len for t in reader.tensors for p in t.planes)
    row(case, f"s4 d2d (mantissa={mantissa})", raw, stored, enc_d2d, dec_d2d_s, exact_d2d,
        mode="device-to-device")
    row(case, f"s4 host (mantissa={mantissa})", raw, stored, enc_s, dec_s, exact,
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


def _cprofile(fn):
    """cProfile of one warm call of ``fn``, the device synchronised around it."""
    import cProfile
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    return pr


def _stats(pr, key: str, top: int) -> list[str]:
    import pstats
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats(key).print_stats(top)
    return [ln for ln in out.getvalue().splitlines() if ln.strip()]


def profile_call(fn, top: int) -> None:
    """The ``top`` functions of one warm call of ``fn``, by own and by cumulative time."""
    pr = _cprofile(fn)
    for key in ("tottime", "cumulative"):
        print(f"-- by {key}", *_stats(pr, key, top)[3:], sep="\n", flush=True)


def host_profile(what: str, fn, top: int = 18) -> None:
    """Where the host's time goes in one warm call (cProfile, by own time)."""
    lines = _stats(_cprofile(fn), "tottime", top)
    print(f"host profile, {what}:", *lines[2:top + 6], sep="\n  ", flush=True)


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

    enc_s, comp = timed(enc)
    stored = sum(c.buffer_size for c in comp.values())

    def dec():
        return {k: codecs[tensors[k].dtype].decode(c) for k, c in comp.items()}

    dec_s, outs = timed(dec)
    kernel_profile(f"{case}: nvcomp {algorithm} encode", enc)
    kernel_profile(f"{case}: nvcomp {algorithm} decode", dec)
    exact = all(torch.equal(torch.as_tensor(outs[k], device="cuda").view(torch.uint8)
                            .reshape(-1), t.reshape(-1).view(torch.uint8))
                for k, t in tensors.items())
    row(case, f"nvcomp {algorithm}", raw, stored, enc_s, dec_s, exact, mode="device-to-device")


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
    raw = sum(t.numel() * t.element_size() for t in flat_tensors(state).values())
    tmp = Path(tempfile.mkdtemp(prefix="s4bench"))
    cases = {
        "s4weights disk": (lambda: s4weights.save(state, tmp / "x.s4w"),
                           lambda: s4weights.load(tmp / "x.s4w", map_location="cuda"),
                           lambda: (tmp / "x.s4w").stat().st_size),
        "torch disk": (lambda: torch.save(state, tmp / "x.pt"),
                       lambda: torch.load(tmp / "x.pt", map_location="cuda"),
                       lambda: (tmp / "x.pt").stat().st_size),
    }
    mem: dict[str, io.BytesIO] = {}

    def s4_mem_save():
        mem["s4"] = io.BytesIO()
        s4weights.save(state, mem["s4"])

    def torch_mem_save():
        mem["pt"] = io.BytesIO()
        torch.save(state, mem["pt"])

    cases["s4weights memory"] = (s4_mem_save, lambda: s4weights.load(
        mem["s4"].getvalue(), map_location="cuda"), lambda: len(mem["s4"].getvalue()))
    def s4_ans_save():
        mem["ans"] = io.BytesIO()
        s4weights.save(state, mem["ans"], policy="nvcomp-ans")

    cases["s4weights nvcomp-ans memory"] = (s4_ans_save, lambda: s4weights.load(
        mem["ans"].getvalue(), map_location="cuda"), lambda: len(mem["ans"].getvalue()))
    cases["torch memory"] = (torch_mem_save, lambda: torch.load(
        io.BytesIO(mem["pt"].getvalue()), map_location="cuda"), lambda: len(mem["pt"].getvalue()))
    for name, (save, load, size) in cases.items():
        if only is not None and name not in only:
            continue
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        save_s, _ = timed(save, reps=3)
        save_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        load_s, got = timed(load, reps=3)
        load_peak = torch.cuda.max_memory_allocated() - base
        row(case, name, raw, size(), save_s, load_s, same_state(state, got),
            save_s=round(save_s, 3), load_s=round(load_s, 3),
            save_peak_extra_MiB=round(save_peak / 2**20),
            load_peak_extra_MiB=round(load_peak / 2**20))
        del got


def main() -> None:
    torch.cuda.init()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    # 1 GiB, the same bytes in every run (drawn unseeded until session 21: stored sizes then
    # differed by a few KB from run to run)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1 << 29, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    one = {"w": x}
    # one profiled pass (stage times on stderr; each stage synchronised, so not timed below)
    os.environ["S4_GPU_PROFILE"] = "1"
    groups = Encoder("auto").encode_device(s4_items(one))
    del groups
    buf = io.BytesIO()
    s4weights.save(one, buf, device="cuda")
    decode.read_tensors(s4format.Reader(buf.getvalue()), [0])
    del os.environ["S4_GPU_PROFILE"], buf
    for m in ("auto",):
        s4_case("(a) 1 GiB bf16", one, m)
    for alg in ("ANS",):
        nvcomp_case("(a) 1 GiB bf16", one, alg)
    # the API with its default workspace (10% of the state): the tensor is coded and decoded
    # in chunks
    end_to_end(one, "(a) via the API", only={"s4weights memory", "torch memory"})
    del x, one
    torch.cuda.empty_cache()
    state = trained_state(int(os.environ.get("S4_BENCH_STEPS", "200")))
    tensors = flat_tensors(state)
    print(f"state: {len(tensors)} tensors, "
          f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30:.2f} GiB",
          flush=True)
    for m in ("auto",):
        s4_case("(b) training state", tensors, m, workspace=1 << 30)
    for alg in ("ANS",):
        nvcomp_case("(b) training state", tensors, alg)
    end_to_end(state)
    print(f"\n{'case':20} {'codec':28} {'ratio':>7} {'enc GB/s':>9} {'dec GB/s':>9} exact")
    for r in ROWS:
        print(f"{r['case']:20} {r['codec']:28} {r['ratio']:7.4f} {r['enc_GBps']:9.1f} "
              f"{r['dec_GBps']:9.1f} {r['exact']}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_results.json").write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                 rows=ROWS), indent=1))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
