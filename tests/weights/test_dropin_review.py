"""Where s4weights.save/load differed from torch.save/torch.load in ways a user switching over
would notice (found in review): a BytesIO read from its current position, map_location
callables given a storage, saves through a symlink, and a file's permissions on overwrite."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import torch

import s4weights


def test_a_bytesio_is_read_from_its_current_position() -> None:
    buf = io.BytesIO()
    buf.write(b"HEADER")
    s4weights.save({"a": torch.arange(5)}, buf)
    buf.seek(6)
    got = s4weights.load(buf)
    assert torch.equal(got["a"], torch.arange(5))
    assert buf.tell() == len(buf.getvalue())  # left after the object, as torch.load does


def test_a_map_location_callable_gets_a_storage_and_may_return_one() -> None:
    buf = io.BytesIO()
    base = torch.arange(6.0)
    s4weights.save({"v": base[1:4], "b": base}, buf)  # a view: placed by map_location
    seen = []

    def keep(storage, location):
        seen.append((type(storage), location, storage.nbytes()))
        return storage

    got = s4weights.load(buf.getvalue(), map_location=keep)
    assert seen and seen[0][0] is torch.UntypedStorage and seen[0][1] == "cpu"
    assert torch.equal(got["v"], torch.tensor([1.0, 2.0, 3.0]))
    got = s4weights.load(buf.getvalue(), map_location=lambda s, loc: None)
    assert got["v"].device.type == "cpu"


def test_a_save_through_a_symlink_writes_its_target(tmp_path: Path) -> None:
    target = tmp_path / "ckpt-1.s4w"
    target.write_bytes(b"")
    link = tmp_path / "latest.s4w"
    link.symlink_to(target)
    s4weights.save({"a": torch.ones(3)}, link)
    assert link.is_symlink()
    assert torch.equal(s4weights.load(target)["a"], torch.ones(3))


def test_overwriting_a_file_keeps_its_permissions(tmp_path: Path) -> None:
    p = tmp_path / "m.s4w"
    s4weights.save({"a": torch.ones(3)}, p)
    os.chmod(p, 0o664)
    s4weights.save({"a": torch.zeros(3)}, p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o664
    assert torch.equal(s4weights.load(p)["a"], torch.zeros(3))
