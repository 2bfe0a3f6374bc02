"""A state spread over two CUDA devices saves and loads bit-exactly whatever device is
current: each tensor is coded on the device that holds it. Needs two GPUs (skipped otherwise)."""

from __future__ import annotations

import io

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

import s4weights  # noqa: E402

pytestmark = pytest.mark.gpu


def _state() -> dict[str, torch.Tensor]:
    out = {}
    for d in (0, 1):
        g = torch.Generator(device=f"cuda:{d}").manual_seed(d)
        w = torch.randn(3 << 20, device=f"cuda:{d}", generator=g) * 0.02
        out[f"w{d}"] = w.bfloat16()
        out[f"m{d}"] = w
        out[f"s{d}"] = torch.ones(7, device=f"cuda:{d}")
    return out


@pytest.mark.parametrize("current", [0, 1])
def test_tensors_on_two_devices_round_trip(current: int) -> None:
    state = _state()
    with torch.cuda.device(current):
        buf = io.BytesIO()
        s4weights.save(state, buf, device="cuda", workspace=8 << 20)  # chunked coding too
        assert torch.cuda.current_device() == current
        got = s4weights.load(buf.getvalue(), device="cuda")
    for k, v in state.items():
        assert got[k].device == v.device, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    cpu = s4weights.load(buf.getvalue(), map_location="cpu", device="cpu")
    for k, v in state.items():
        assert torch.equal(cpu[k].view(torch.uint8), v.cpu().view(torch.uint8)), k


def _exact(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, where
    assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)), where


def test_map_location_moves_tensors_between_devices() -> None:
    state = _state()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda", workspace=8 << 20)
    swap = {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}
    got = s4weights.load(buf.getvalue(), map_location=swap, device="cuda")
    for k, v in state.items():
        assert got[k].device == torch.device("cuda", 1 - v.device.index), k
        _exact(got[k], v, k)
    with torch.cuda.device(0):  # everything onto the device that is not current
        got = s4weights.load(buf.getvalue(), map_location="cuda:1", device="cuda",
                             workspace=8 << 20)
    for k, v in state.items():
        assert got[k].device == torch.device("cuda", 1), k
        _exact(got[k], v, k)


@pytest.mark.parametrize("current", [0, 1])
def test_into_destinations_on_the_other_device(current: int) -> None:
    state = {k: v for k, v in _state().items() if v.device.index == 0}
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    into = {k: torch.empty_like(v, device="cuda:1") for k, v in state.items()}
    with torch.cuda.device(current):
        got = s4weights.load(buf.getvalue(), device="cuda", into=into)
    for k, v in state.items():
        assert got[k] is into[k], k  # filled in place, on device 1
        assert got[k].device == torch.device("cuda", 1), k
        _exact(got[k], v, k)


def test_delta_chain_coded_on_the_device_that_is_not_current(tmp_path) -> None:
    from s4weights import chain

    chain._PARENT_CACHE.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 64)).to("cuda:1")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    snaps, infos = {}, []
    try:
        with torch.cuda.device(0):
            for step in range(3):
                model(torch.randn(16, 512, device="cuda:1")).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                infos.append(s4weights.save_checkpoint(state, tmp_path, step, device="cuda"))
                snaps[step] = {k: v.detach().cpu().clone()
                               for k, v in state["model"].items()}
            assert infos[0].is_base and not infos[1].is_base
            for step in range(3):
                chain._PARENT_CACHE.clear()
                got = s4weights.load_checkpoint(tmp_path, step, device="cuda")
                for k, v in snaps[step].items():
                    assert got["model"][k].device == torch.device("cuda", 1), k
                    _exact(got["model"][k], v, f"{step} {k}")
                on_cpu = s4weights.load_checkpoint(tmp_path, step, map_location="cpu",
                                                   device="cpu")
                for k, v in snaps[step].items():
                    _exact(on_cpu["model"][k], v, f"{step} {k} (CPU)")
    finally:
        chain._PARENT_CACHE.clear()


def test_a_restarted_process_reads_its_parent_on_the_state_s_device(tmp_path,
                                                                      monkeypatch) -> None:
    # the state on cuda:1, cuda:0 current: after a restart the parent's chain is decoded on
    # cuda:1, into the buffer its snapshot then takes over
    from s4weights import chain, hostmem

    chain._PARENT_CACHE.clear()
    hostmem.forget()
    g = torch.Generator(device="cuda:1").manual_seed(3)
    state = {"w": (torch.randn(3 << 20, device="cuda:1", generator=g) * .02).bfloat16(),
             "m": torch.randn(1 << 20, device="cuda:1", generator=g)}
    url = tmp_path.resolve().as_uri()
    seen = []
    real = chain._read_on_gpu

    def spy(*a):
        seen.append(torch.cuda.current_device())
        got = real(*a)
        seen.append(got[1].ctypes.data)
        return got

    monkeypatch.setattr(chain, "_read_on_gpu", spy)
    try:
        with torch.cuda.device(0):
            s4weights.save_checkpoint(state, tmp_path, 0, device="cuda")
            chain._PARENT_CACHE.clear()
            hostmem.forget()
            state["m"].add_(1e-3)
            info = s4weights.save_checkpoint(state, tmp_path, 1, device="cuda")
            assert torch.cuda.current_device() == 0
        assert not info.is_base and seen[0] == 1
        buf = chain._PARENT_CACHE[url][3][torch.device("cuda", 1)]
        assert buf.ctypes.data == seen[1] and hostmem.is_page_locked(buf)
        del buf
        chain._PARENT_CACHE.clear()
        got = s4weights.load_checkpoint(tmp_path, 1, map_location="cpu", device="cpu")
        for k, v in state.items():
            _exact(got[k], v.cpu(), k)
    finally:
        chain._PARENT_CACHE.clear()


def test_nvcomp_ans_file_on_the_device_that_is_not_current() -> None:
    from s4weights.gpu import nvans

    if not nvans.available():
        pytest.skip("nvCOMP's ANS is not available")
    state = {k: v for k, v in _state().items() if v.device.index == 1}
    buf = io.BytesIO()
    with torch.cuda.device(0):
        s4weights.save(state, buf, device="cuda", policy="nvcomp-ans")
        got = s4weights.load(buf.getvalue(), device="cuda")
    for k, v in state.items():
        assert got[k].device == torch.device("cuda", 1), k
        _exact(got[k], v, k)
