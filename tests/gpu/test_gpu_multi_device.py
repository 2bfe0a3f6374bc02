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
