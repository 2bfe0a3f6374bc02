"""Messages a new user meets, each naming what to do: s4weights.load of a checkpoint directory
(load_checkpoint), of a torch.save or safetensors file (s4weights convert), and s4format verify
of a delta without its parent (once, with the command; a damaged delta is still INVALID)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

import s4format
import s4format.cli
import s4weights
from s4format.errors import BadMagicError, StorageError


def test_a_directory_points_to_load_checkpoint(tmp_path: Path) -> None:
    s4weights.save_checkpoint({"w": torch.ones(3)}, tmp_path / "run1", step=1)
    with pytest.raises(StorageError) as err:
        s4weights.load(tmp_path / "run1")
    assert str(err.value) == (f"{tmp_path / 'run1'} is a checkpoint directory, not a .s4w "
                              f"file: load it with s4weights.load_checkpoint("
                              f"{str(tmp_path / 'run1')!r}) (the latest step, or step=N)")
    with pytest.raises(StorageError, match=r"is a directory, not a \.s4w file: s4weights\.load "
                                           r"reads one file"):
        s4weights.load(tmp_path)
    with pytest.raises(StorageError, match="is a checkpoint directory"):
        s4weights.open(str(tmp_path / "run1"))


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors"])
def test_a_file_of_another_format_names_convert(tmp_path: Path, kind: str) -> None:
    path = tmp_path / ("w.safetensors" if kind == "safetensors" else "w.pt")
    if kind == "safetensors":
        st = pytest.importorskip("safetensors.torch")
        st.save_file({"w": torch.ones(2)}, path)
    else:
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=kind == "zip")
    with pytest.raises(BadMagicError) as err:
        s4weights.load(path)
    what = "looks like a safetensors file" if kind == "safetensors" else \
        "is a torch.save file: read it with torch.load(weights_only=True)"
    assert f"{path}: not a .s4w file" in str(err.value) and what in str(err.value)
    assert str(err.value).endswith(f"or convert it once: s4weights convert {path} w.s4w")
    with pytest.raises(BadMagicError, match="s4weights convert"):
        s4weights.load(path.read_bytes())


def test_verify_of_a_delta_without_its_parent(tmp_path: Path, capsys) -> None:
    def _verify(*args: object) -> subprocess.CompletedProcess:
        code = s4format.cli.main(["verify", *map(str, args)])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    w = {"w": torch.randn(1 << 14), "b": torch.randn(8)}
    s4weights.save_checkpoint(w, tmp_path, step=1)
    w["w"][:5] += 1
    s4weights.save_checkpoint(w, tmp_path, step=2)
    infos = {i.step: tmp_path / i.file for i in s4weights.list_checkpoints(tmp_path)}
    res = _verify(infos[2])
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1
    assert "every stored plane's checksum and the content hashes of its 1 full tensors are " \
           "valid; its 1 delta tensors can only be checked with the parent: python -m " \
           f"s4format verify {infos[2]} --parent PARENT.s4w" in res.stderr
    assert _verify(infos[2], "--parent", infos[1]).returncode == 0
    with s4format.Reader(infos[2]) as r:  # damage a stored plane of the delta tensor
        at = next(t for t in r.tensors if t.is_delta).planes[0].offset
    fd = os.open(infos[2], os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)
    res = _verify(infos[2])
    assert res.returncode == 1 and "checksum" in res.stderr
    assert res.stderr.splitlines()[-1] == f"{infos[2]}: INVALID, 1 problem(s)"
