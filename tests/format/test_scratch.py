"""The buffers a file's stored bytes are read into and reused (s4format.scratch): what a load
returns never shares them, they stay bounded, and a short file still reads as truncated."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

import s4format
from s4format import Reader, TruncatedError, codecs, scratch
from s4format.tensor import Tensor


@pytest.fixture(autouse=True)
def _no_kept_buffers():
    scratch.forget()
    yield
    scratch.forget()


def _file(path, seed: int, n: int = 1 << 17) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tree = {
        # random bytes: the raw layout, one plane stored by codec raw (the decoded bytes are
        # then the stored ones)
        "ints": rng.integers(0, 256, n, dtype=np.uint8),
        "floats": rng.standard_normal(n).astype(np.float32),
    }
    s4format.write(path, {k: Tensor.from_numpy(v) for k, v in tree.items()})
    return tree


def test_a_tensor_read_as_stored_does_not_share_the_reused_buffer(tmp_path) -> None:
    first = _file(tmp_path / "a.s4w", 1)
    second = _file(tmp_path / "b.s4w", 2)
    with Reader(tmp_path / "a.s4w") as r:
        ints = r.tensors[r.index_of("ints")]
        assert [codecs.get(p.codec).name for p in ints.planes] == ["raw"]  # the case under test
        got = {t.name: r.read(i) for i, t in enumerate(r.tensors)}
    with Reader(tmp_path / "b.s4w") as r:  # reads into the buffers the first file used
        again = {t.name: r.read(i) for i, t in enumerate(r.tensors)}
    for name, want in first.items():
        assert got[name].data.tobytes() == want.tobytes()
        assert got[name].data.flags.writeable
    for name, want in second.items():
        assert again[name].data.tobytes() == want.tobytes()


def test_a_plane_as_stored_is_copied_before_its_buffer_goes_back(tmp_path) -> None:
    # (read level by level, a delta's parent bytes come from _own and are XORed after the
    # buffer went back: another thread's read may be filling it by then)
    _file(tmp_path / "a.s4w", 4)
    with Reader(tmp_path / "a.s4w") as r:
        raw, fresh = r._own(r.tensors[r.index_of("ints")])
        assert not fresh and scratch._free
        assert not any(np.may_share_memory(raw, b) for b in scratch._free)


def test_kept_buffers_stay_under_the_bound(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(scratch, "KEEP", 1 << 20)
    for seed, n in enumerate((1 << 16, 1 << 17, 1 << 18, 1 << 19)):
        tree = _file(tmp_path / f"{seed}.s4w", seed, n)
        with Reader(tmp_path / f"{seed}.s4w") as r:
            for i, t in enumerate(r.tensors):
                assert r.read(i).data.tobytes() == tree[t.name].tobytes()
        assert sum(b.size for b in scratch._free) <= 1 << 20
    assert scratch._free  # and something is kept for the next load


def test_a_short_file_still_reads_as_truncated(tmp_path) -> None:
    _file(tmp_path / "a.s4w", 3)
    blob = (tmp_path / "a.s4w").read_bytes()
    with Reader(tmp_path / "a.s4w") as r:
        t = r.tensors[1]
        lo = min(p.offset for p in t.planes)
        # the planes of the float tensor cut off: the file keeps its index, loses their end
        (tmp_path / "a.s4w").write_bytes(blob[:lo + 1000])
        with pytest.raises(TruncatedError):
            r.read(1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_takes_buffers_while_a_parent_thread_held_the_lock() -> None:
    scratch.give(scratch.take(1 << 20))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with scratch._lock:
            held.set()
            release.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: a take that waited on the copied lock would hang
            signal.alarm(10)
            ok = scratch.take(1 << 20) is not None and not scratch._free
            os._exit(0 if ok else 1)
    finally:
        release.set()
        t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_one_plane_tensor_read_from_memory_is_a_copy_of_its_own(tmp_path) -> None:
    # (one plane in the raw layout is read without the reused buffers: what is returned must
    # still be writable and must not be the caller's bytes, whichever codec stored it)
    rng = np.random.default_rng(5)
    tree = {"random": rng.integers(0, 256, 3000, dtype=np.uint8),
            "text": np.frombuffer(b"a plane that zstd stores " * 40, np.uint8).copy(),
            "flags": (rng.random(3000) < 0.5).astype(np.uint8)}
    path = tmp_path / "a.s4w"
    s4format.write(path, {k: Tensor.from_numpy(v) for k, v in tree.items()})
    data = path.read_bytes()
    with Reader(data) as r:
        names = {t.name: [codecs.get(p.codec).name for p in t.planes] for t in r.tensors}
        assert {n[0] for n in names.values()} >= {"raw", "zstd"} and \
            all(len(n) == 1 for n in names.values())  # the cases under test
        got = {t.name: r.read(i).data for i, t in enumerate(r.tensors)}
    for name, want in tree.items():
        assert got[name].tobytes() == want.tobytes()
        assert got[name].flags.writeable
        assert not np.may_share_memory(got[name], np.frombuffer(data, np.uint8))
