"""``load_checkpoint(resume=True)``: a restarted training run loads its latest checkpoint and
keeps a host copy of it as the parent of its next delta, so that save reads nothing of the
chain back from the store; the copy is what the file holds, whatever the caller then does to
the loaded tensors, and it is used only where it is that save's parent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import s4format
import s4weights
from s4weights import chain
from s4weights.store import open_store
from tests.weights.common import assert_same, clone_tree, save_on_latest
from tests.weights.test_chain import _Run


@pytest.fixture(autouse=True)
def _fresh_parent_cache():
    chain._PARENT_CACHE.clear()
    yield
    chain._PARENT_CACHE.clear()


def _reads(monkeypatch) -> list[str]:
    """The names of the tensors the CPU reader decodes from here on."""
    names = []
    real = s4format.Reader.read_raw

    def spy(self, i):
        names.append(self.tensors[i].name)
        return real(self, i)

    monkeypatch.setattr(s4format.Reader, "read_raw", spy)
    return names


def _saved(run: _Run, root, steps: range) -> None:
    for step in steps:
        run.train()
        save_on_latest(run.state(step), root, step, device="cpu")


def _save_and_check(monkeypatch, state, root, step: int):
    """Save ``state`` as ``step``, recording what the CPU reader decodes meanwhile; then load
    it back with nothing cached and check it. Returns (those reads, the save's info)."""
    want = clone_tree(state)
    reads = _reads(monkeypatch)
    info = save_on_latest(state, root, step, device="cpu")
    monkeypatch.undo()
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(root, step, device="cpu"), want)
    return reads, info


@pytest.mark.parametrize("into", [False, True])
def test_the_first_save_after_resuming_reads_no_chain(tmp_path, monkeypatch, into) -> None:
    run = _Run()
    _saved(run, tmp_path, range(4))
    chain._PARENT_CACHE.clear()  # a restarted process
    fresh = _Run(seed=1)  # other weights until loaded
    target = {"model": fresh.model.state_dict()} if into else None
    state = s4weights.load_checkpoint(tmp_path, resume=True, device="cpu", into=target)
    fresh.model.load_state_dict(state["model"])
    fresh.opt.load_state_dict(state["optimizer"])
    # the caller trains the loaded tensors in place: the kept copy is the file's, not theirs
    fresh.train(2)
    reads, info = _save_and_check(monkeypatch, fresh.state(4), tmp_path, 4)
    assert reads == []
    assert not info.is_base and info.parent_step == 3


def test_deltas_against_the_base_read_it_once_then_hold_it(tmp_path, monkeypatch) -> None:
    run = _Run()
    opened = []
    real_open = chain.open_chain

    def spy(store, files, *args, **kw):
        opened.append([i.step for i in files])
        return real_open(store, files, *args, **kw)

    monkeypatch.setattr(chain, "open_chain", spy)
    reads = _reads(monkeypatch)
    saved = {}
    for step in range(5):
        if step == 3:
            chain._PARENT_CACHE.clear()  # a restarted process
        run.train()
        saved[step] = clone_tree(run.state(step))
        opened.clear()
        reads.clear()
        info = s4weights.save_checkpoint(run.state(step), tmp_path, step, device="cpu")
        assert info.parent_step == (None if step == 0 else 0)
        # only the base is opened (a held one too: checked to be there), never a delta; a
        # fresh process decodes it once, and holds it after
        assert opened == ([[0]] if step else []), step
        if step == 3:
            base = s4weights.list_checkpoints(tmp_path)[0]
            with s4format.Reader(tmp_path / base.file) as r:
                assert sorted(reads) == sorted(t.name for t in r.tensors)
        else:
            assert reads == [], step
        assert chain._PARENT_CACHE[open_store(tmp_path).url][0] == \
            s4weights.list_checkpoints(tmp_path)[0].checkpoint_id
    monkeypatch.undo()
    chain._PARENT_CACHE.clear()
    for step, want in saved.items():
        assert_same(s4weights.load_checkpoint(tmp_path, step, device="cpu"), want)


@pytest.mark.parametrize("into", [False, True])
def test_resuming_from_a_delta_on_a_base_holds_the_base(tmp_path, monkeypatch, into) -> None:
    # deltas against the base (the default): resuming from a delta step keeps its base, made
    # from the copy by XORing the step's own bytes back out, so the next save reads nothing
    run = _Run()
    for step in range(3):
        run.train()
        s4weights.save_checkpoint(run.state(step), tmp_path, step, device="cpu")
    chain._PARENT_CACHE.clear()  # a restarted process
    fresh = _Run(seed=1)
    target = {"model": fresh.model.state_dict()} if into else None
    state = s4weights.load_checkpoint(tmp_path, resume=True, device="cpu", into=target)
    base = s4weights.list_checkpoints(tmp_path)[0]
    assert chain._PARENT_CACHE[open_store(tmp_path).url][0] == base.checkpoint_id
    fresh.model.load_state_dict(state["model"])
    fresh.opt.load_state_dict(state["optimizer"])
    fresh.train(2)
    want = clone_tree(fresh.state(3))
    reads = _reads(monkeypatch)
    info = s4weights.save_checkpoint(fresh.state(3), tmp_path, 3, device="cpu")
    assert reads == [] and info.parent_step == 0
    monkeypatch.undo()
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path, 3, device="cpu"), want)


@pytest.mark.parametrize("against", ["base", "latest"])
def test_resuming_a_first_delta_holds_what_its_run_saves_against(tmp_path, monkeypatch,
                                                                  against) -> None:
    # a chain of one delta looks the same either way; its manifest says which parent the run's
    # next save takes: the base, or the step itself
    run = _Run()
    for step in range(2):
        run.train()
        s4weights.save_checkpoint(run.state(step), tmp_path, step, device="cpu",
                                  delta_against=against)
    chain._PARENT_CACHE.clear()  # a restarted process
    state = s4weights.load_checkpoint(tmp_path, resume=True, device="cpu")
    infos = s4weights.list_checkpoints(tmp_path)
    assert [i.delta_against for i in infos] == [against, against]
    held = infos[0 if against == "base" else 1].checkpoint_id
    assert chain._PARENT_CACHE[open_store(tmp_path).url][0] == held
    fresh = _Run(seed=1)
    fresh.model.load_state_dict(state["model"])
    fresh.opt.load_state_dict(state["optimizer"])
    fresh.train(2)
    want = clone_tree(fresh.state(2))
    reads = _reads(monkeypatch)
    info = s4weights.save_checkpoint(fresh.state(2), tmp_path, 2, device="cpu",
                                     delta_against=against)
    assert reads == [] and info.parent_step == (0 if against == "base" else 1)
    monkeypatch.undo()
    chain._PARENT_CACHE.clear()
    assert_same(s4weights.load_checkpoint(tmp_path, 2, device="cpu"), want)


def test_a_resumed_base_keeps_tensors_of_equal_bytes_apart(tmp_path, monkeypatch) -> None:
    # two tensors of the base hold the same bytes (as the norms of a fresh model do): a
    # delta's parent is found by content hash, yet the base made from the copy holds both,
    # by name, and the next save codes neither alone
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    same = torch.randn(4096, generator=g)

    def state(step: int) -> dict:
        a = same.clone()
        a[::16] += step * 1e-3  # a few words change: "a" is a delta of the base's "a"
        return {"w": w + step * 1e-3, "a": a, "b": same.clone()}

    for step in range(2):
        s4weights.save_checkpoint(state(step), tmp_path, step, device="cpu")
    chain._PARENT_CACHE.clear()  # a restarted process
    s4weights.load_checkpoint(tmp_path, resume=True, device="cpu")
    with s4format.Reader(tmp_path / s4weights.list_checkpoints(tmp_path)[1].file) as r:
        assert r.tensors[r.index_of("a")].is_delta
    held = chain._PARENT_CACHE[open_store(tmp_path).url]
    assert sorted(held[1]) == ["a", "b", "w"]
    reads = _reads(monkeypatch)
    warm = s4weights.save_checkpoint(state(2), tmp_path, 2, device="cpu")
    assert reads == []
    monkeypatch.undo()
    cold = tmp_path / "cold"
    for step in range(2):
        s4weights.save_checkpoint(state(step), cold, step, device="cpu")
    chain._PARENT_CACHE.clear()
    assert (cold / s4weights.save_checkpoint(state(2), cold, 2, device="cpu").file
            ).read_bytes() == (tmp_path / warm.file).read_bytes()


def test_without_resume_the_first_save_reads_the_chain(tmp_path, monkeypatch) -> None:
    run = _Run()
    _saved(run, tmp_path, range(3))
    chain._PARENT_CACHE.clear()
    state = s4weights.load_checkpoint(tmp_path, device="cpu")
    assert not chain._PARENT_CACHE
    reads = _reads(monkeypatch)
    info = save_on_latest(state, tmp_path, 3, device="cpu")
    assert reads and not info.is_base


def test_a_copy_of_an_older_step_is_not_the_next_parent(tmp_path, monkeypatch) -> None:
    # resuming from step 1 of 0..2: the next save's parent is the latest (2), read from the
    # store; the copy of step 1 is never used as a parent
    run = _Run()
    _saved(run, tmp_path, range(3))
    chain._PARENT_CACHE.clear()
    state = s4weights.load_checkpoint(tmp_path, 1, resume=True, device="cpu")
    assert not chain._PARENT_CACHE  # (nor does it replace a newer parent a save left)
    reads, info = _save_and_check(monkeypatch, state, tmp_path, 3)
    assert reads and info.parent_step == 2


def test_no_copy_without_verification_or_after_a_failed_load(tmp_path) -> None:
    run = _Run()
    _saved(run, tmp_path, range(2))
    chain._PARENT_CACHE.clear()
    s4weights.load_checkpoint(tmp_path, resume=True, verify=False, device="cpu")
    assert not chain._PARENT_CACHE  # unverified bytes never become a parent
    data = sorted((tmp_path / "data").glob("*.s4w"))[-1]
    r = s4format.Reader(str(data))
    p = max((p for t in r.tensors for p in t.planes), key=lambda p: p.stored_len)
    r.close()
    blob = bytearray(data.read_bytes())
    blob[p.offset + p.stored_len // 2] ^= 0x40
    data.write_bytes(bytes(blob))
    with pytest.raises(s4format.S4Error):
        s4weights.load_checkpoint(tmp_path, resume=True, device="cpu")
    assert not chain._PARENT_CACHE


def test_a_process_that_saved_keeps_its_own_parent(tmp_path, monkeypatch) -> None:
    # a process that saved, then loads the latest again (a rollback to it, say): it already
    # holds that checkpoint as the next parent (its save's copy, whose buffer it keeps), and
    # the next save is its delta without reading the chain
    run = _Run()
    _saved(run, tmp_path, range(3))
    url = tmp_path.resolve().as_uri()
    held = chain._PARENT_CACHE[url]
    state = s4weights.load_checkpoint(tmp_path, resume=True, device="cpu")
    assert chain._PARENT_CACHE[url] is held
    # an older step's load leaves it too
    s4weights.load_checkpoint(tmp_path, 1, resume=True, device="cpu")
    assert chain._PARENT_CACHE[url] is held
    for t in state["model"].values():
        if t.is_floating_point():
            t.add_(1e-3)
    reads, info = _save_and_check(monkeypatch, state, tmp_path, 3)
    assert reads == [] and info.parent_step == 2


def test_resume_keeps_tensors_no_part_of_the_tree_uses(tmp_path) -> None:
    # the copy holds every stored tensor, the ones read for the tree and the others
    run = _Run()
    _saved(run, tmp_path, range(3))
    chain._PARENT_CACHE.clear()
    s4weights.load_checkpoint(tmp_path, resume=True, device="cpu")
    entry = chain._PARENT_CACHE[tmp_path.resolve().as_uri()]
    r = chain.open_chain(open_store(tmp_path),
                         chain.chain_of(2, chain.by_step(s4weights.list_checkpoints(tmp_path))),
                         verify=True)
    try:
        assert set(entry[1]) == {t.name for t in r.tensors}
        for i, t in enumerate(r.tensors):
            assert np.asarray(entry[1][t.name].data).tobytes() == r.read_raw(i).tobytes(), \
                t.name
            assert entry[2][t.name] == t.content_hash
    finally:
        chain.close_chain(r)


def _host_out_of_memory(monkeypatch, when: str) -> None:
    """hostmem.populated failing as a host out of memory does: when "mapping it" (the mmap)
    or when "populating it" (its page-writing threads)."""
    from s4weights import hostmem

    class Failing:
        def __init__(self, nbytes):
            if when == "mapping it":
                raise OSError(12, "Cannot allocate memory")

        def result(self):
            raise MemoryError("a test")

    monkeypatch.setattr(hostmem, "populated", Failing)


@pytest.mark.parametrize("when", ["mapping it", "populating it"])
def test_a_host_out_of_memory_gives_the_copy_up_not_the_load(tmp_path, monkeypatch, caplog,
                                                             when) -> None:
    import logging

    run = _Run()
    _saved(run, tmp_path, range(2))
    chain._PARENT_CACHE.clear()
    want = s4weights.load_checkpoint(tmp_path, device="cpu")

    _host_out_of_memory(monkeypatch, when)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = s4weights.load_checkpoint(tmp_path, resume=True, device="cpu")
    assert_same(got, want)
    assert not chain._PARENT_CACHE and "no host copy" in caplog.text


@pytest.mark.parametrize("when", ["mapping it", "populating it"])
def test_the_device_path_gives_the_copy_up_too(tmp_path, monkeypatch, caplog, when) -> None:
    # _HostCopy.device (the GPU loader's on_decoded), driven with CPU tensors under the
    # emulation's torch: no copy queued, nothing to wait for, no entry
    import logging

    import torch

    from tests.gpu.emulated import Torch

    run = _Run()
    _saved(run, tmp_path, range(2))
    monkeypatch.setattr(chain, "torch", Torch())  # (its cuda.current_stream)

    _host_out_of_memory(monkeypatch, when)
    store = open_store(tmp_path)
    infos = chain.by_step(chain.list_checkpoints(store))
    r = chain.open_chain(store, chain.chain_of(max(infos), infos), True, "cpu")
    try:
        with caplog.at_level(logging.WARNING, logger="s4weights"):
            copy = chain._HostCopy(r)
            for i in range(len(r.tensors)):
                copy.device(i, torch.from_numpy(np.asarray(r.read_raw(i)).copy()))
        assert copy.entry("x") is None and copy.devices == set()
        copy.abandon()
    finally:
        chain.close_chain(r)
    assert "no host copy" in caplog.text
