"""``s4weights convert``: torch.save files, safetensors files and Hugging Face model folders to
.s4w and back, every tensor bit for bit; what cannot be converted is refused with a message
that names it and what to do."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import s4weights
import s4weights.cli
from s4format.errors import ContentHashError, UnsupportedError, UnsupportedObjectError
from s4weights import convert as conv
from tests.weights.common import Trainer, assert_same

st = pytest.importorskip("safetensors.torch")


def _weights(seed: int, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{seed}.{i}.weight": torch.randn(64, 32, generator=g) for i in range(n)}
    out[f"layer{seed}.bias"] = torch.randn(32, generator=g).to(torch.bfloat16)
    out[f"layer{seed}.count"] = torch.arange(5, dtype=torch.int64)
    return out


def _training_checkpoint() -> dict:
    t = Trainer(seed=3)
    for _ in range(3):
        t.step()
    state = t.state()
    state["rng"] = {"torch": state["rng"]["torch"], "python": random.getstate()}
    return state


def test_torch_save_training_checkpoint_converts_bit_exact(tmp_path: Path, capsys) -> None:
    state = _training_checkpoint()
    torch.save(state, tmp_path / "ckpt.pt")
    assert s4weights.cli.main(["convert", str(tmp_path / "ckpt.pt"),
                               str(tmp_path / "ckpt.s4w")]) == 0
    out = capsys.readouterr().out
    assert "ckpt.pt -> " in out and "verified bit-exact" in out and "ratio 0." in out
    assert_same(s4weights.load(tmp_path / "ckpt.s4w"), state)


def test_safetensors_round_trip_is_the_same_file(tmp_path: Path) -> None:
    # (one metadata key: safetensors writes several in an order of its own each time)
    weights = _weights(1)
    st.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    [done] = conv.convert(tmp_path / "model.safetensors", tmp_path / "model.s4w")
    raw = sum(t.numel() * t.element_size() for t in weights.values())
    assert (done.tensors, done.raw_bytes, done.verified) == (5, raw, True)
    assert done.dst_bytes == (tmp_path / "model.s4w").stat().st_size < done.src_bytes
    with s4weights.open(tmp_path / "model.s4w") as f:
        assert f.metadata()["safetensors.format"] == "pt"
    conv.convert(tmp_path / "model.s4w", tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == \
        (tmp_path / "model.safetensors").read_bytes()


def test_safetensors_metadata_comes_back(tmp_path: Path) -> None:
    meta = {"format": "pt", "x": "1", "note": "é"}
    st.save_file(_weights(1), tmp_path / "a.safetensors", metadata=meta)
    conv.convert(tmp_path / "a.safetensors", tmp_path / "a.s4w")
    conv.convert(tmp_path / "a.s4w", tmp_path / "b.safetensors")
    from safetensors import safe_open
    with safe_open(tmp_path / "b.safetensors", "pt") as f:
        assert f.metadata() == meta


def _hf_folder(root: Path) -> dict[str, torch.Tensor]:
    root.mkdir()
    shards = {"model-00001-of-00002.safetensors": _weights(1),
              "model-00002-of-00002.safetensors": _weights(2)}
    weight_map = {}
    for name, tensors in shards.items():
        st.save_file(tensors, root / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 123}, "weight_map": weight_map}))
    (root / "config.json").write_text('{"hidden_size": 32}')
    return {k: v for tensors in shards.values() for k, v in tensors.items()}


def test_hugging_face_folder_keeps_its_shards_and_index(tmp_path: Path) -> None:
    every = _hf_folder(tmp_path / "hf")
    done = conv.convert(tmp_path / "hf", tmp_path / "s4")
    assert [Path(d.dst).name for d in done] == ["model-00001-of-00002.s4w",
                                               "model-00002-of-00002.s4w"]
    assert sorted(p.name for p in (tmp_path / "s4").iterdir()) == [
        "config.json", "model-00001-of-00002.s4w", "model-00002-of-00002.s4w",
        "model.s4w.index.json"]
    index = json.loads((tmp_path / "s4" / "model.s4w.index.json").read_text())
    assert index["metadata"] == {"total_size": 123}
    assert set(index["weight_map"]) == set(every)
    for key, shard in index["weight_map"].items():
        with s4weights.open(tmp_path / "s4" / shard) as f:
            assert_same(f.get_tensor(key), every[key])
    # and back: the same shard files and the same index
    conv.convert(tmp_path / "s4", tmp_path / "back")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    assert json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text()) == \
        json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())


def test_hugging_face_folder_into_one_file(tmp_path: Path) -> None:
    every = _hf_folder(tmp_path / "hf")
    [done] = conv.convert(tmp_path / "hf", tmp_path / "one.s4w")
    assert done.tensors == len(every)
    back = s4weights.load(tmp_path / "one.s4w")
    assert sorted(back) == sorted(every)
    for k, v in every.items():
        assert_same(back[k], v, k)


def test_what_safetensors_cannot_hold_is_named(tmp_path: Path, capsys) -> None:
    s4weights.save({"model": {"w": torch.ones(2)}, "step": 7, "c": torch.ones(2, 2,
                    dtype=torch.complex128)}, tmp_path / "ckpt.s4w")
    with pytest.raises(UnsupportedObjectError) as err:
        conv.convert(tmp_path / "ckpt.s4w", tmp_path / "ckpt.safetensors")
    msg = str(err.value)
    assert "safetensors cannot hold 'model' (a dict), 'step' (a int), 'c' (dtype " \
           "complex128)" in msg and "Keep this checkpoint as .s4w" in msg
    assert not (tmp_path / "ckpt.safetensors").exists()
    assert s4weights.cli.main(["convert", str(tmp_path / "ckpt.s4w"),
                               str(tmp_path / "ckpt.safetensors")]) == 2
    assert "UnsupportedObjectError" in capsys.readouterr().err


def test_shared_and_strided_tensors_become_safetensors(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tied = OrderedDict(embed=base, head=base, col=base[:, 1], t=base.t())
    s4weights.save(tied, tmp_path / "tied.s4w")
    conv.convert(tmp_path / "tied.s4w", tmp_path / "tied.safetensors")
    back = st.load_file(tmp_path / "tied.safetensors")
    for k, v in tied.items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype


def test_torch_file_that_needs_code_is_refused_with_what_to_do(tmp_path: Path) -> None:
    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "args.pt")
    with pytest.raises(UnsupportedObjectError) as err:
        conv.convert(tmp_path / "args.pt", tmp_path / "args.s4w")
    msg = str(err.value)
    assert "weights_only=True" in msg and "argparse.Namespace" in msg
    assert "weights_only=False" in msg and "s4weights.save" in msg
    assert not (tmp_path / "args.s4w").exists()


def test_names_that_tell_no_format_are_refused(tmp_path: Path) -> None:
    (tmp_path / "w.xyz").write_bytes(b"x")
    with pytest.raises(UnsupportedError, match="cannot tell its format"):
        conv.convert(tmp_path / "w.xyz", tmp_path / "w.s4w")
    torch.save({"w": torch.ones(1)}, tmp_path / "w.pt")
    with pytest.raises(UnsupportedError, match=r"converts to \.s4w"):
        conv.convert(tmp_path / "w.pt", tmp_path / "w.safetensors")


def test_a_file_that_does_not_read_back_is_reported(tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    torch.save({"w": torch.ones(4)}, tmp_path / "w.pt")
    real = conv._read

    def damaged(f):  # what a disk that flips a bit would hand back
        obj, meta = real(f)
        if f.name.endswith(".s4w"):
            obj["w"][0] = 2.0
        return obj, meta

    monkeypatch.setattr(conv, "_read", damaged)
    with pytest.raises(ContentHashError, match=r"w\.s4w does not read back .* w: the tensor's "
                                               "bytes differ"):
        conv.convert(tmp_path / "w.pt", tmp_path / "w.s4w")
    assert s4weights.cli.main(["convert", str(tmp_path / "w.pt"), str(tmp_path / "w2.s4w")]) \
        == 1
    assert "does not read back" in capsys.readouterr().err
    assert s4weights.cli.main(["convert", "--no-verify", str(tmp_path / "w.pt"),
                               str(tmp_path / "w3.s4w")]) == 0
    assert "not verified (--no-verify)" in capsys.readouterr().out


@pytest.mark.parametrize(("a", "b", "where"), [
    (torch.tensor([0.0]), torch.tensor([-0.0]), "<root>: the tensor's bytes differ"),
    (float("nan"), -float("nan"), "<root>: nan became nan"),
    ({"a": [1, (2, 3.0)]}, {"a": [1, (2, 3.0)]}, None),
    ({"a": [1, (2, 3.0)]}, {"a": [1, [2, 3.0]]}, "a.1: a tuple became a list"),
    (torch.ones(2, dtype=torch.float16), torch.ones(2), "<root>: torch.float16[2] became "
                                                        "torch.float32[2]"),
    (math.inf, math.inf, None),
])
def test_differs_compares_bits(a, b, where) -> None:
    assert conv.differs(a, b) == where
