"""blocking=False with CUDA tensors: a device copy when the device has room (the caller's
next in-place step cannot reach the file), page-locked host memory when it has not; the file
coded on the GPU from the copy, bit-exact. Skipped without CUDA."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4weights  # noqa: E402
from s4format.tensor import Tensor  # noqa: E402
from s4weights import background_save, chain, hostmem  # noqa: E402
from s4weights.torchtree import DeviceTensor, flatten  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _clean():
    chain._PARENT_CACHE.clear()
    hostmem.forget()
    yield
    chain._PARENT_CACHE.clear()
    hostmem.forget()


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"w": torch.randn(1 << 22, device="cuda", generator=g).to(torch.bfloat16),
            "m": torch.randn(1 << 20, device="cuda", generator=g), "step": 3}


@pytest.mark.parametrize("room", [True, False])
def test_the_copy_is_taken_before_the_caller_moves_on(tmp_path, monkeypatch, room) -> None:
    if not room:
        monkeypatch.setattr(background_save, "DEVICE_HEADROOM", 1 << 62)
    state = _state()
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    captured, streams = background_save.capture(flatten(state))
    kinds = {type(t) for _n, t in captured.tensors}
    assert kinds == ({DeviceTensor} if room else {Tensor})
    for s in streams.values():
        s.synchronize()
    future = s4weights.save_checkpoint(state, tmp_path, step=1, blocking=False)
    state["w"].mul_(3)  # queued on the caller's stream at once
    state["m"].zero_()
    assert future.result(timeout=300).step == 1
    got = s4weights.load_checkpoint(tmp_path, map_location="cuda")
    for k in ("w", "m"):
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k

