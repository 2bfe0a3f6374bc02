"""DCP storage of CUDA tensors: the rank file holds the planes s4weights.save writes for the same
CUDA tensors, and it loads bit-exactly into CUDA and CPU destinations. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4weights.dcp import S4StorageReader, S4StorageWriter  # noqa: E402
from tests.dcp.states import NO_DIST, assert_same  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 768, generator=g) * 0.02
    return {"w": w.to(device), "bf": w.to(torch.bfloat16).to(device),
            "view": torch.randn(64, 96, generator=g).to(device)[:, 5:69],
            "small": torch.arange(7, dtype=torch.int64).to(device), "step": 3}


def _rank_file(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.suffix == ".s4w")


def test_cuda_items_code_as_s4weights_save_and_load_anywhere(tmp_path: Path) -> None:
    dcp.save(_state("cuda"), storage_writer=S4StorageWriter(str(tmp_path / "gpu")),
             **NO_DIST)
    rank_file = _rank_file(tmp_path / "gpu")
    items = {k: v.cuda() for k, v in s4weights.load(rank_file).items()
             if isinstance(v, torch.Tensor)}
    s4weights.save(items, tmp_path / "plain.s4w", device="cuda")
    with s4format.Reader(rank_file) as got, s4format.Reader(tmp_path / "plain.s4w") as want:
        for a, b in zip(got.tensors, want.tensors):
            assert (a.name, a.content_hash, len(a.planes)) == (b.name, b.content_hash,
                                                               len(b.planes))
            for k in range(len(a.planes)):
                assert a.planes[k].codec == b.planes[k].codec, a.name
                assert got.read_stored(a, k).tobytes() == want.read_stored(b, k).tobytes()
    for device in ("cuda", "cpu"):
        want = _state(device)
        dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                for k, v in want.items()}
        dcp.load(dest, storage_reader=S4StorageReader(str(tmp_path / "gpu")), **NO_DIST)
        assert all(v.device.type == device for v in dest.values()
                   if isinstance(v, torch.Tensor))
        assert_same(dest, want)
