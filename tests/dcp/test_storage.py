"""S4StorageWriter/S4StorageReader in one process (``no_dist``): what the files hold, retries
into one path, refusals (no ``.metadata``, damaged or foreign files, unsafe metadata), ranged
reads of single items, pickling, and the conversions format_utils makes with a reader."""

from __future__ import annotations

import inspect
import io
import os
import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import (  # noqa: E402
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: E402

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format.errors import ChecksumError, FormatError, StorageError  # noqa: E402
from s4weights.dcp import S4StorageReader, S4StorageWriter  # noqa: E402
from s4weights.dcp.checkpoint import METADATA, RANK_FILE  # noqa: E402
from tests.dcp.states import NO_DIST, assert_same  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dtypes() -> list[torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
             "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
             "float8_e4m3fn", "float8_e5m2"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _state(seed: int = 0) -> dict:
    """Tensors of every dtype (one large enough to be split into planes), a non-contiguous
    one, a 0-d and an empty one, and non-tensor values DCP stores as bytes items."""
    g = torch.Generator().manual_seed(seed)
    out: dict = {"t": {}}
    for dt in _dtypes():
        bits = torch.randint(0, 2 if dt == torch.bool else 256,
                             (6000 * torch.empty(0, dtype=dt).element_size(),),
                             dtype=torch.uint8, generator=g)
        out["t"][str(dt).removeprefix("torch.")] = bits.view(dt).reshape(40, -1)
    out["t"]["transposed"] = torch.randn(24, 40, generator=g).t()
    out["t"]["scalar"] = torch.tensor(seed + 0.5)
    out["t"]["empty"] = torch.zeros(0, 3)
    out["step"] = seed
    out["meta"] = {"name": f"run-{seed}", "betas": [0.9, 0.95]}
    return out


def _fs_state(seed: int) -> dict:
    """:func:`_state` without the dtypes this torch's own serialisation cannot write, for
    FileSystemWriter (torch 2.4 has no uint16, uint32 or uint64 storages)."""
    state = _state(seed)

    def saveable(t: torch.Tensor) -> bool:
        try:
            torch.save(t.reshape(-1)[:1].clone(), io.BytesIO())
        except (KeyError, RuntimeError, TypeError):
            return False
        return True
    state["t"] = {k: v for k, v in state["t"].items() if saveable(v)}
    return state


def _blank(state: dict) -> dict:
    return {"t": {k: torch.zeros_like(v) for k, v in state["t"].items()}, "step": -1,
            "meta": {"name": None, "betas": None}}


def _save(state: dict, url: str, **kwargs) -> None:
    dcp.save(state, storage_writer=S4StorageWriter(url, **kwargs), **NO_DIST)


def _load(url: str, state: dict | None = None, **kwargs) -> dict:
    dest = _blank(state or _state())
    dcp.load(dest, storage_reader=S4StorageReader(url, **kwargs), **NO_DIST)
    return dest


def _rank_files(path: Path) -> list[str]:
    return sorted(f for f in os.listdir(path) if RANK_FILE.fullmatch(f))


def test_every_dtype_and_bytes_item_round_trips(tmp_path: Path) -> None:
    state = _state(1)
    _save(state, str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck"))[0] == METADATA
    assert len(_rank_files(tmp_path / "ck")) == 1
    assert_same(_load(str(tmp_path / "ck"), state), state)


def test_rank_file_codes_tensors_as_s4weights_save(tmp_path: Path) -> None:
    """Every item's planes in the rank file are the bytes s4weights.save writes for it."""
    state = _state(2)
    _save(state, str(tmp_path / "ck"))
    rank_file = tmp_path / "ck" / _rank_files(tmp_path / "ck")[0]
    items = {k: v for k, v in s4weights.load(rank_file).items() if isinstance(v, torch.Tensor)}
    s4weights.save({k: v.clone() for k, v in items.items()}, tmp_path / "plain.s4w")
    with s4format.Reader(rank_file) as got, s4format.Reader(tmp_path / "plain.s4w") as want:
        assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
        assert any(len(t.planes) > 1 for t in got.tensors)
        for a, b in zip(got.tensors, want.tensors):
            assert (a.dtype, a.shape, a.layout, a.content_hash) == \
                (b.dtype, b.shape, b.layout, b.content_hash), a.name
            for k in range(len(b.planes)):
                assert a.planes[k].codec == b.planes[k].codec, a.name
                assert got.read_stored(a, k).tobytes() == want.read_stored(b, k).tobytes()


def test_save_into_a_checkpoint_replaces_it_whole(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    old, new = _state(3), _state(4)
    _save(old, url)
    first = _rank_files(tmp_path / "ck")
    (tmp_path / "ck" / "__7_0123456789ab.s4w").write_bytes(b"left by a killed save")
    with pytest.raises(CheckpointException, match="overwrite=False"):
        _save(new, url, overwrite=False)
    assert_same(_load(url), old)
    _save(new, url)
    files = _rank_files(tmp_path / "ck")
    assert len(files) == 1 and files != first  # the old file and the leftover are gone
    assert_same(_load(url), new)


def test_directory_without_metadata_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    _save(_state(5), url)
    (tmp_path / "ck" / METADATA).unlink()
    with pytest.raises(StorageError, match=r"holds no committed checkpoint: it has no "
                                           r"\.metadata"):
        S4StorageReader(url).read_metadata()
    with pytest.raises(CheckpointException) as info:
        _load(url)
    exc, _trace = info.value.failures[0]  # ours, or DCP's note that every way to read failed
    # torch 2.13 puts the reader's reason in that note; 2.11 drops it and says only this.
    assert ("holds no committed checkpoint: it has no .metadata" in str(exc)
            or str(exc) == "metadata is None")
    with pytest.raises(StorageError, match="holds no committed checkpoint"):
        S4StorageReader(str(tmp_path / "missing")).read_metadata()


def _first_plane(path: Path, name: str) -> int:
    with s4format.Reader(path) as r:
        return r.tensors[r.index_of(name)].planes[0].offset


def test_damaged_rank_file_names_the_file_and_the_tensor(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    _save(_state(6), url)
    rank_file = tmp_path / "ck" / _rank_files(tmp_path / "ck")[0]
    data = bytearray(rank_file.read_bytes())
    data[_first_plane(rank_file, "t.float32@0,0") + 100] ^= 0x40
    rank_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _load(url)
    exc, _trace = info.value.failures[0]
    assert isinstance(exc, ChecksumError)
    assert str(rank_file) in str(exc) and "'t.float32@0,0'" in str(exc)
    # the other tensors still load alone: the damage is where the error says
    dest = {"t": {"int64": torch.zeros_like(_state()["t"]["int64"])}}
    dcp.load(dest, storage_reader=S4StorageReader(url), **NO_DIST)
    assert torch.equal(dest["t"]["int64"], _state(6)["t"]["int64"])


def test_rank_file_of_another_save_is_refused(tmp_path: Path) -> None:
    _save(_state(7), str(tmp_path / "a"))
    _save(_state(8), str(tmp_path / "b"))
    a, b = (tmp_path / d / _rank_files(tmp_path / d)[0] for d in "ab")
    a.write_bytes(b.read_bytes())
    with pytest.raises(CheckpointException) as info:
        _load(str(tmp_path / "a"))
    exc, _trace = info.value.failures[0]
    assert isinstance(exc, FormatError) and str(a) in str(exc)
    assert "is not the one the checkpoint's metadata names" in str(exc)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo unsafe",))


def test_metadata_may_not_run_code(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    _save(_state(9), url)
    (tmp_path / "ck" / METADATA).write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(FormatError, match=r"\.metadata: not DCP metadata: it refers to "
                                          r"posix\.system"):
        S4StorageReader(url).read_metadata()


def test_filesystem_writer_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_fs_state(10), storage_writer=dcp.FileSystemWriter(tmp_path / "fs"),
                 **NO_DIST)
    with pytest.raises(FormatError, match=r"another storage writer .* FileSystemReader"):
        S4StorageReader(str(tmp_path / "fs")).read_metadata()


def test_whole_checkpoint_as_format_utils_loads_it(tmp_path: Path) -> None:
    """dcp_to_torch_save's way (an empty state dict and the planner that fills it) gives
    the same state from our reader as from FileSystemReader for the same save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = _fs_state(11)
    _save(state, str(tmp_path / "s4"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "fs"), **NO_DIST)
        dcp_to_torch_save(tmp_path / "fs", tmp_path / "fs.pt")
        ours: dict = {}
        _load_state_dict(ours, storage_reader=S4StorageReader(str(tmp_path / "s4")),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_same(ours, torch.load(tmp_path / "fs.pt", weights_only=False))
    assert_same(ours, state)


def test_writer_and_reader_pickle(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    writer, reader = S4StorageWriter(url, policy="auto-1.0"), S4StorageReader(url)
    writer.store(), reader.store()
    writer, reader = pickle.loads(pickle.dumps(writer)), pickle.loads(pickle.dumps(reader))
    state = _state(12)
    dcp.save(state, storage_writer=writer, **NO_DIST)
    dest = _blank(state)
    dcp.load(dest, storage_reader=reader, **NO_DIST)
    assert_same(dest, state)


@pytest.mark.skipif("use_collectives" not in inspect.signature(dcp.save).parameters,
                    reason="this torch saves with collectives only")
def test_save_without_collectives_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="use_collectives=True"):
        dcp.save(_state(), storage_writer=S4StorageWriter(str(tmp_path / "ck")),
                 use_collectives=False, **NO_DIST)
    assert not (tmp_path / "ck" / METADATA).exists()


def test_checkpoint_ids() -> None:
    for ok in ("/a/b", "rel/dir", "file:///a/b", "s3://bucket/prefix", Path("/x")):
        assert S4StorageWriter.validate_checkpoint_id(ok)
        assert S4StorageReader.validate_checkpoint_id(ok)
    assert not S4StorageWriter.validate_checkpoint_id("gs://bucket/x")


class _Counting:
    """A byte source that counts the bytes read through it (or, over S3, fetched)."""

    def __init__(self, source) -> None:
        self._source, self.name, self._read = source, source.name, 0

    def size(self) -> int:
        return self._source.size()

    def read_at(self, offset: int, length: int):
        self._read += length
        return self._source.read_at(offset, length)

    def fetched(self) -> int:
        return getattr(self._source, "bytes_fetched", self._read)

    def close(self) -> None:
        getattr(self._source, "close", lambda: None)()


def _big_state() -> dict:
    g = torch.Generator().manual_seed(13)
    return {f"layer{i}": torch.randn(256, 512, generator=g) for i in range(6)}


def _one_item_read(url: str) -> tuple[int, int, int]:
    """(bytes read, the item's stored bytes, the rank file's size) loading one item."""
    reader = S4StorageReader(url)
    store, sources = reader.store(), []
    opened = store.source
    store.source = lambda name: sources.append(_Counting(opened(name))) or sources[-1]
    dest = {"layer3": torch.zeros(256, 512)}
    dcp.load(dest, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True),
             **NO_DIST)
    assert torch.equal(dest["layer3"], _big_state()["layer3"])
    read = sum(s.fetched() for s in sources)
    with s4format.Reader(opened(store.list("__")[0])) as r:
        stored = r.tensors[r.index_of("layer3@0,0")].stored_nbytes
        return read, stored, r.source.size()


def test_one_item_is_read_alone_locally(tmp_path: Path) -> None:
    _save(_big_state(), str(tmp_path / "ck"))
    read, stored, size = _one_item_read(str(tmp_path / "ck"))
    # the header, footer and index, then the item's planes in one span
    assert stored < read < stored + 8192 < size // 4


def test_s3_round_trip_and_one_item_read(aws_env, bucket: str) -> None:
    from s4weights.store.s3 import TAIL_CACHE

    url = f"s3://{bucket}/run/step-1"
    state = _state(14)
    _save(state, url)
    assert_same(_load(url), state)
    _save(_big_state(), f"{url}-big")
    read, stored, size = _one_item_read(f"{url}-big")
    assert stored < read < stored + TAIL_CACHE + 8192 < size // 2
    with pytest.raises(StorageError, match=f"s3://{bucket}/run/none holds no committed"):
        S4StorageReader(f"s3://{bucket}/run/none").read_metadata()


def test_s3_load_of_every_item_fetches_a_small_rank_file_once(aws_env, bucket: str) -> None:
    # a load with the sharding it was saved with reads every item of the rank file: the file
    # (3 MB) comes in one GET, not one per item; a load of one item still reads by range
    # (test_s3_round_trip_and_one_item_read)
    url = f"s3://{bucket}/run/whole"
    state = _big_state()
    _save(state, url)
    reader = S4StorageReader(url)
    store, sources = reader.store(), []
    opened = store.source
    store.source = lambda name: sources.append(opened(name)) or sources[-1]
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=reader, **NO_DIST)
    assert_same(dest, state)
    assert [src.requests for src in sources] == [1]


def test_item_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    _save(_state(15), url)
    md = pickle.loads((tmp_path / "ck" / METADATA).read_bytes())
    index, info = next(iter(md.storage_data.items()))
    md.storage_data[index] = type(info)("../elsewhere.s4w", info.name, info.content_hash)
    (tmp_path / "ck" / METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointException) as caught:
        _load(url)
    exc, _trace = caught.value.failures[0]
    assert isinstance(exc, StorageError) and "'../elsewhere.s4w'" in str(exc)


def test_a_rank_file_is_read_whole_only_where_the_plan_reads_every_item(tmp_path: Path) -> None:
    from types import SimpleNamespace

    url = str(tmp_path / "ck")
    state = {**_big_state(), "extra": io.BytesIO(b"bytes")}
    _save(state, url)
    reader = S4StorageReader(url)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    (name,) = {info.relative_path for info in reader.storage_data.values()}
    items = [SimpleNamespace(storage_index=idx) for idx in reader.storage_data]
    assert reader._reads_all(name, items)
    assert reader._reads_all(name, items + items[:1])  # an item asked for twice
    assert not reader._reads_all(name, items[1:])
    assert not reader._reads_all(name, [i for i in items if i.storage_index.fqn != "extra"])
