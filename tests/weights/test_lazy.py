"""``s4weights.open``: keys, metadata and single tensors read lazily, as safetensors.safe_open
gives them; only the tensor asked for is read."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

import s4weights
from s4format.errors import ParentMismatchError
from s4format.source import BufferSource
from s4weights.torchtree import tensor_leaves
from tests.weights.common import Trainer, assert_same


class CountingSource(BufferSource):
    """A byte source that counts what the reader fetches (what ranged GETs would fetch)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data, name="counted.s4w")
        self.read_bytes = 0

    def read_at(self, offset: int, length: int) -> np.ndarray:
        self.read_bytes += length
        return super().read_at(offset, length)


def _checkpoint() -> dict:
    t = Trainer(seed=1)
    t.step()
    state = t.state()
    p = torch.nn.Parameter(torch.randn(6, 4))
    p.partition_dim = 0
    state["extra"] = {"param": p, "row": p.data[1], "big": torch.randn(4096)}
    return state


def test_keys_metadata_and_every_tensor(tmp_path: Path) -> None:
    state = _checkpoint()
    s4weights.save(state, tmp_path / "c.s4w", metadata={"run": "7"})
    want = tensor_leaves(s4weights.load(tmp_path / "c.s4w"))
    with s4weights.open(tmp_path / "c.s4w") as f:
        assert f.keys() == list(want) == list(f)
        assert "model.fc1.weight" in f and "x" not in f and "optimizer.state.0.exp_avg" in f
        assert len(f) == len(want)
        assert f.metadata()["run"] == "7"
        for k, v in want.items():
            assert_same(f.get_tensor(k), v, k)
        assert f.get_tensor("extra.param").partition_dim == 0
        assert torch.equal(f.get_tensor("extra.row"), state["extra"]["param"].data[1])
        with pytest.raises(KeyError, match=r"no tensor at key .model\.nope."):
            f.get_tensor("model.nope")
    assert f.reader.source._fd == -1  # closed on leaving the block


def test_only_the_tensor_asked_for_is_read() -> None:
    big = {f"w{i}": torch.randn(1 << 16) for i in range(8)}
    buf = io.BytesIO()
    s4weights.save(big, buf)
    src = CountingSource(buf.getvalue())
    f = s4weights.open(src)
    opened = src.read_bytes
    assert opened < 4096  # header, footer and index
    stored = f.reader.tensors[f.reader.index_of("w3")].stored_nbytes
    assert torch.equal(f.get_tensor("w3"), big["w3"])
    assert stored <= src.read_bytes - opened < stored + 4096
    assert src.read_bytes < len(buf.getvalue()) / 4


def test_a_delta_opens_with_its_parent(tmp_path: Path) -> None:
    w = {"w": torch.randn(4096)}
    s4weights.save_checkpoint(w, tmp_path / "run", step=1)
    w["w"][:10] += 1
    s4weights.save_checkpoint(w, tmp_path / "run", step=2)
    infos = {i.step: i for i in s4weights.list_checkpoints(tmp_path / "run")}
    assert not infos[2].is_base
    child, parent = (tmp_path / "run" / infos[s].file for s in (2, 1))
    with s4weights.open(child) as f, pytest.raises(ParentMismatchError, match="is a delta"):
        f.get_tensor("w")
    with s4weights.open(child, parent=parent) as f:
        assert torch.equal(f.get_tensor("w"), w["w"])


def test_device_and_numpy_values() -> None:
    buf = io.BytesIO()
    s4weights.save({"t": torch.arange(4.0), "n": np.arange(3)}, buf)
    with s4weights.open(buf.getvalue()) as f:
        assert f.keys() == ["t"]  # numpy arrays are not torch tensors
        t = f.get_tensor("t", device="meta")
        assert t.device.type == "meta" and t.shape == (4,)
