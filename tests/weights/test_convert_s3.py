"""``s4weights convert`` and ``s4weights.open`` with ``s3://`` sources and destinations, on the
S3 suite's real SeaweedFS server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import s4weights
from s4weights import convert as conv
from s4weights.store import open_store
from tests.s3.conftest import admin, aws_env, bucket, server  # noqa: F401 (fixtures)
from tests.weights.common import assert_same

st = pytest.importorskip("safetensors.torch")


def test_files_and_folders_to_and_from_s3(tmp_path: Path, aws_env, bucket) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(256, 64, generator=g) for i in range(3)}
    st.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    url = f"s3://{bucket}/models"
    conv.convert(tmp_path / "model.safetensors", f"{url}/model.s4w")
    with s4weights.open(f"{url}/model.s4w") as f:
        assert f.keys() == ["w0", "w1", "w2"]
        assert_same(f.get_tensor("w1"), weights["w1"])
    [done] = conv.convert(f"{url}/model.s4w", f"{url}/back.safetensors")
    assert done.dst == f"{url}/back.safetensors" and done.verified
    assert open_store(url).get("back.safetensors") == \
        (tmp_path / "model.safetensors").read_bytes()

    folder = tmp_path / "hf"
    folder.mkdir()
    st.save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    conv.convert(folder, f"{url}/hf-s4")
    conv.convert(f"{url}/hf-s4", f"{url}/hf-back")
    conv.convert(f"{url}/hf-back", tmp_path / "local.s4w")
    assert_same(s4weights.load(tmp_path / "local.s4w"), st.load_file(folder / "model.safetensors"))
    assert sorted(open_store(f"{url}/hf-back").list()) == ["config.json", "model.safetensors"]
    assert json.loads(open_store(f"{url}/hf-back").get("config.json")) == {}
