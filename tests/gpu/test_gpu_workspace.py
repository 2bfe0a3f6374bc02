"""The GPU path keeps its extra device memory under the workspace setting, on save and on load,
whatever the state's size (tensors no larger than the workspace allows). Skipped without CUDA."""

from __future__ import annotations

import io

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4weights  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20
SLACK = 4 * MIB  # small tables, histograms, block tables, allocator rounding


def _state(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    if kind == "small":  # 4,000 fp32 tensors just over the split threshold: per-plane and
        # per-block tables outweigh their bytes (4 KiB each, 16 MiB in all)
        for i in range(4000):
            out[f"s{i}"] = torch.randn(1024, device="cuda", generator=g) * 0.02
        return out
    if kind == "fp16":  # fp16 splits into the most planes per raw byte: the costliest to code
        for i in range(48):  # 48 x 2 MiB
            out[f"t{i}"] = (torch.randn(1 << 20, device="cuda", generator=g) * 0.02).half()
        return out
    for i in range(24):  # bf16, fp16 (1 MiB each) and fp32 (2 MiB) tensors, 32 MiB in all
        x = torch.randn(1 << 19, device="cuda", generator=g) * 0.02
        out[f"t{i}"] = x.to(torch.bfloat16 if i % 3 == 0 else torch.float16) if i % 3 != 2 \
            else x[: 1 << 19]
    return out


@pytest.mark.parametrize("kind,workspace", [("mixed", 16 * MIB), ("mixed", 40 * MIB),
                                            ("fp16", 64 * MIB), ("small", 8 * MIB),
                                            ("mixed", 4 * MIB), ("fp16", 4 * MIB)])
def test_save_and_load_stay_within_the_workspace(kind: str, workspace: int) -> None:
    state = _state(kind)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda", workspace=workspace)
    torch.cuda.synchronize()
    save_extra = torch.cuda.max_memory_allocated() - base
    assert save_extra <= workspace + SLACK, save_extra / MIB

    blob = buf.getvalue()
    raw = sum(t.numel() * t.element_size() for t in state.values())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = s4weights.load(blob, map_location="cuda", device="cuda", workspace=workspace)
    torch.cuda.synchronize()
    load_extra = torch.cuda.max_memory_allocated() - base - raw  # the loaded tensors are kept
    assert load_extra <= workspace + SLACK, load_extra / MIB
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


@pytest.mark.parametrize("workspace", [48 * MIB, None])  # (None: the default, from free memory)
def test_checkpoint_chain_stays_within_the_workspace_and_holds_no_device_memory(
        tmp_path, monkeypatch, workspace) -> None:
    # save_checkpoint keeps the next delta's parent in host memory: the deltas are XORed on the
    # device in workspace-sized buffers, and nothing stays on the device between saves
    from s4weights import chain
    from s4weights.gpu import plan, runtime

    chain._PARENT_CACHE.clear()
    xored = []
    real_xor = runtime.xor

    def spy(a, b, out=None):
        xored.append(b.device.type)
        return real_xor(a, b, out)

    monkeypatch.setattr(runtime, "xor", spy)
    state = _state("mixed")
    big = torch.randn(12 << 20, device="cuda") * 0.02  # 48 MiB: XORed in chunks
    state["big"] = big
    root = tmp_path / "run"
    total = sum(v.numel() * v.element_size() for v in state.values())
    snaps = []
    try:
        for step in range(3):
            for v in state.values():
                v.add_(torch.randn_like(v) * 1e-4)  # a training step's change
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            limit = workspace or plan.default_save_workspace(total, torch.cuda.mem_get_info()[0])
            info = s4weights.save_checkpoint(state, root, step, device="cuda",
                                             workspace=workspace)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            assert extra <= limit + SLACK, (step, extra / MIB)
            # nothing held after the save (but the kernels' constant tables, made once)
            assert torch.cuda.memory_allocated() <= base + MIB, step
            assert info.is_base == (step == 0)
            snaps.append({k: v.cpu().clone() for k, v in state.items()})
        assert "cpu" in xored  # the parents came from host memory, XORed on the device
        for step in range(3):
            chain._PARENT_CACHE.clear()
            got = s4weights.load_checkpoint(root, step, device="cuda")
            for k, v in snaps[step].items():
                assert torch.equal(got[k].cpu().view(torch.uint8), v.view(torch.uint8)), (step, k)
        # a fresh process (no cache): the parent is read from the store, still XORed on the GPU
        xored.clear()
        info = s4weights.save_checkpoint(state, root, 3, device="cuda", workspace=workspace)
        assert not info.is_base and "cpu" in xored
        got = s4weights.load_checkpoint(root, 3, map_location="cpu", device="cpu")
        for k, v in state.items():
            assert torch.equal(got[k].view(torch.uint8), v.cpu().view(torch.uint8)), k
    finally:
        chain._PARENT_CACHE.clear()
