"""GPU path: ``load(into=...)`` decodes straight into the caller's CUDA tensors (same objects,
same memory, bit-exact; mismatches refused), and XOR deltas are made, coded and decoded on the
device: GPU-written chains load bit-exactly on the CPU path and CPU-written chains on the GPU
path, with the same checkpoint IDs either way. Skipped without CUDA and CuPy."""

from __future__ import annotations

import io

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format.errors import ContentHashError  # noqa: E402
from s4weights import chain  # noqa: E402
from s4weights.gpu import decode, runtime  # noqa: E402
from s4weights.store import open_store  # noqa: E402
from s4weights.torchtree import DeviceTensor, IntoMismatchError  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_parent_cache():
    chain._PARENT_CACHE.clear()
    yield
    chain._PARENT_CACHE.clear()


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256),
                               torch.nn.Linear(256, 64)).cuda()


def _snapshot(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


def _assert_bytes(got, want, path="") -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert _bytes(got) == _bytes(want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            _assert_bytes(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_bytes(g, w, f"{path}.{i}")
    else:
        assert got == want, path


def test_xor_kernel_equals_torch_xor_at_every_alignment() -> None:
    base = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    other = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    for off, n in ((0, 0), (0, 1), (1, 17), (3, 4099), (0, 1 << 19), (5, (1 << 19) + 7)):
        a, b = base[off:off + n], other[16:16 + n]
        assert torch.equal(runtime.xor(a, b), torch.bitwise_xor(a, b)), (off, n)


def _record_outs(monkeypatch) -> set[int]:
    seen: set[int] = set()
    real = decode.read_tensors

    def spy(reader, idx, outs=None, *more):
        if outs is not None:
            seen.update(o.data_ptr() for o in outs)
        return real(reader, idx, outs, *more)

    monkeypatch.setattr(decode, "read_tensors", spy)
    return seen


@pytest.mark.parametrize("writer_device", ["cuda", "cpu"])
def test_into_cuda_state_dict_is_decoded_in_place(monkeypatch, writer_device: str) -> None:
    src = _net(0).state_dict()
    if writer_device == "cpu":
        src = {k: v.cpu() for k, v in src.items()}  # bare tensor refs in the file
    buf = io.BytesIO()
    s4weights.save(src, buf, device=writer_device)
    dst = _net(1).state_dict()
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    seen = _record_outs(monkeypatch)
    got = s4weights.load(buf.getvalue(), into=dst, device="cuda")
    for k in src:
        assert got[k] is dst[k] and dst[k].data_ptr() == ptrs[k], k
        assert _bytes(dst[k]) == _bytes(src[k]), k
    # the decoder wrote into the caller's memory: no decode-then-copy
    assert set(ptrs.values()) <= seen


def test_into_cuda_views_shared_storage_and_mismatch() -> None:
    base = torch.randn(300_000, device="cuda")
    src = {"base": base, "part": base[10:1010], "t": torch.randn(64, 32, device="cuda").t()}
    buf = io.BytesIO()
    s4weights.save(src, buf, device="cuda")
    dst = {"base": torch.zeros(300_000, device="cuda"), "part": torch.zeros(1000, device="cuda"),
           "t": torch.zeros(32, 64, device="cuda")}
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    got = s4weights.load(buf.getvalue(), into=dst, device="cuda")
    for k in src:
        assert got[k] is dst[k] and dst[k].data_ptr() == ptrs[k], k
        assert _bytes(dst[k]) == _bytes(src[k]), k
    with pytest.raises(IntoMismatchError, match="part has shape"):
        s4weights.load(buf.getvalue(), into={"part": torch.zeros(999, device="cuda")},
                       device="cuda")
    with pytest.raises(IntoMismatchError, match="base is float16"):
        s4weights.load(buf.getvalue(), device="cuda",
                       into={"base": torch.zeros(300_000, device="cuda", dtype=torch.float16)})


class _Run:
    def __init__(self) -> None:
        self.model = _net(0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def train(self) -> None:
        self.model(torch.randn(32, 256, device="cuda")).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self, step: int) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "step": step}


def _save_chains(*roots_devices, steps: int = 4):
    """One training run, each step saved to every ``(root, writer device)``:
    ({root: infos}, CPU snapshots by step)."""
    chain._PARENT_CACHE.clear()
    run = _Run()
    infos: dict = {root: [] for root, _d in roots_devices}
    snaps = {}
    for step in range(steps):
        run.train()
        state = run.state(step)
        for root, writer_device in roots_devices:
            infos[root].append(s4weights.save_checkpoint(state, root, step,
                                                         device=writer_device))
        snaps[step] = _snapshot(state)
    return infos, snaps


def test_gpu_delta_chain_equals_cpu_chain_and_loads_both_ways(tmp_path) -> None:
    g, c = tmp_path / "g", tmp_path / "c"
    infos, snaps = _save_chains((g, "cuda"), (c, "cpu"))
    for cached in chain._PARENT_CACHE.values():  # parents kept in host memory, never GPU
        assert cached[1] and not any(isinstance(t, DeviceTensor) for t in cached[1].values())
    g_infos, c_infos = infos[g], infos[c]
    assert g_infos[0].is_base and not g_infos[1].is_base
    assert [i.is_base for i in g_infos] == [i.is_base for i in c_infos]
    # same meaning: equal content hashes give equal checkpoint IDs, parents included
    assert [i.checkpoint_id for i in g_infos] == [i.checkpoint_id for i in c_infos]
    assert [i.parent_id for i in g_infos] == [i.parent_id for i in c_infos]
    with s4format.Reader(str(g / g_infos[1].file)) as r:
        assert any(t.is_delta for t in r.tensors), "no tensor chose the delta on the GPU"
    assert g_infos[1].stored_bytes < g_infos[1].full_stored_bytes
    for root in (g, c):
        for step in range(len(g_infos)):
            chain._PARENT_CACHE.clear()
            on_cpu = s4weights.load_checkpoint(root, step, map_location="cpu", device="cpu")
            _assert_bytes(on_cpu, snaps[step], f"{root.name}{step}cpu")
            on_gpu = s4weights.load_checkpoint(root, step, device="cuda")
            assert on_gpu["model"]["0.weight"].is_cuda
            _assert_bytes(on_gpu, snaps[step], f"{root.name}{step}gpu")


def test_delta_tensors_decode_on_the_gpu_and_wrong_parent_is_refused(tmp_path) -> None:
    _save_chains((tmp_path, "cuda"), steps=2)
    store = open_store(tmp_path)
    by = chain.by_step(chain.list_checkpoints(store))
    reader = chain.open_chain(store, chain.chain_of(1, by), verify=True)
    deltas = [i for i, t in enumerate(reader.tensors) if t.is_delta]
    on_gpu = [i for i in deltas if decode.decodable(reader, i)]
    assert on_gpu
    outs = decode.read_tensors(reader, deltas)
    for i, o in zip(deltas, outs):
        assert o.cpu().numpy().tobytes() == reader.read_raw(i).tobytes()
    i = on_gpu[0]
    t = reader.tensors[i]
    out = torch.empty(t.raw_nbytes, dtype=torch.uint8, device="cuda")
    decode.decode_staged(decode.stage(reader, [i]), [out])  # the XOR bytes
    parent_raw = reader.parent.read_raw(
        next(j for j, p in enumerate(reader.parent.tensors) if p.content_hash == t.parent_hash))
    assert (np.bitwise_xor(out.cpu().numpy(), parent_raw) == reader.read_raw(i)).all()
    bad = torch.full((t.raw_nbytes,), 0x5A, dtype=torch.uint8, device="cuda")
    with pytest.raises(ContentHashError):
        decode._apply_parents(reader, [i], [bad])
