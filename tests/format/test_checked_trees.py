"""Object trees found valid by their bytes (``s4format.reader._CheckedTrees``): a tree seen
before is checked by a lookup, never against tensors other than the ones it was checked with,
and a reader still hands out a tree of its own."""

from __future__ import annotations

import pytest
import torch

import s4weights
from conformance import craft
from s4format import Reader, objtree, reader
from s4format.errors import FormatError
from s4format.objtree import Typed
from tests.format import hostile as H
from tests.weights.common import save_on_latest


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(reader, "_CHECKED_TREES", reader._CheckedTrees())


def _views(storage: int, *, shape=(16,)) -> bytes:
    def tree(refs):
        return {"v": Typed("s4.view", {
            "storage": refs[0], "dtype": "uint8", "offset": 0, "shape": shape, "stride": (1,),
            "device": "cpu", "requires_grad": False, "parameter": False})}
    return H.file_with(tree, [("s", storage)])


def _decodes(monkeypatch) -> list[int]:
    """The tensor counts of the object trees decoded from now on (metadata has none)."""
    calls: list[int] = []
    real = objtree.decode

    def counted(data, tensor_count, **kw):
        if tensor_count:
            calls.append(tensor_count)
        return real(data, tensor_count, **kw)
    monkeypatch.setattr(objtree, "decode", counted)
    return calls


@pytest.mark.parametrize("valid_first", [True, False])
def test_a_known_tree_is_checked_against_the_tensors_of_its_file(valid_first) -> None:
    good, bad = _views(16), _views(8)  # the same tree: a view of 16 bytes
    assert craft.parse(good).index["tree"] == craft.parse(bad).index["tree"]
    for blob in ([good, bad] if valid_first else [bad, good]) * 2:
        if blob is good:
            with Reader(blob) as r:
                assert r.tree["v"].value["shape"] == (16,)
        else:
            with pytest.raises(FormatError, match="beyond its storage of 8 bytes"):
                Reader(blob)


def test_a_known_tree_is_not_decoded_again_and_each_reader_has_its_own(monkeypatch) -> None:
    blob = _views(16)
    calls = _decodes(monkeypatch)
    first, second = Reader(blob), Reader(blob)
    assert calls == [1]  # the second reader's tree was found valid by its bytes
    assert second.tensor_uses == first.tensor_uses == [1]
    assert second.tensor_uses is not first.tensor_uses
    assert second.tree == first.tree and calls == [1, 1]  # decoded when asked for
    assert second.tree is not first.tree
    first.tree["v"].value["shape"] = (1,)
    assert second.tree["v"].value["shape"] == (16,) and Reader(blob).tree["v"].value[
        "shape"] == (16,)


def test_large_trees_and_old_ones_are_forgotten(monkeypatch) -> None:
    calls = _decodes(monkeypatch)
    monkeypatch.setattr(reader._CheckedTrees, "KEPT", 2)
    blobs = [_views(16, shape=(n,)) for n in (14, 15, 16)]
    for blob in blobs:
        Reader(blob)
    Reader(blobs[2])
    Reader(blobs[0])  # pushed out by the two after it
    assert calls == [1, 1, 1, 1]
    monkeypatch.setattr(reader._CheckedTrees, "LARGEST", 8)
    Reader(blobs[1])
    Reader(blobs[1])
    assert calls == [1, 1, 1, 1, 1, 1]


def test_a_chain_load_decodes_one_tree(tmp_path, monkeypatch) -> None:
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64, 64).to(torch.bfloat16) for i in range(4)}
    states = []
    for step in range(3):
        state = {k: (v.float() + 1e-3 * torch.randn_like(v.float())).to(torch.bfloat16)
                 for k, v in state.items()}
        states.append(state)
        info = save_on_latest(state, tmp_path, step, read_budget=None)
    assert info.depth == 2
    monkeypatch.setattr(reader, "_CHECKED_TREES", reader._CheckedTrees())
    calls = _decodes(monkeypatch)
    got = s4weights.load_checkpoint(tmp_path, 2)
    assert calls == [len(state)]  # the newest file's; its parents' trees are the same bytes
    assert all(torch.equal(got[k].view(torch.int16), state[k].view(torch.int16))
               for k in state)


def test_threads_asking_for_a_tree_found_by_its_bytes_all_get_it(monkeypatch) -> None:
    import threading
    import time

    blob = _views(16)
    Reader(blob)
    real = Reader._decode_tree

    def slow(self, *a, **k):
        time.sleep(0.01)  # (every thread inside the decode at once)
        return real(self, *a, **k)
    monkeypatch.setattr(Reader, "_decode_tree", slow)
    for _ in range(5):
        r = Reader(blob)  # (found by its bytes: decoded when first asked for)
        barrier, got, errors = threading.Barrier(4), [], []

        def ask(r=r, barrier=barrier, got=got, errors=errors) -> None:
            barrier.wait()
            try:
                got.append(r.tree["v"].value["shape"])
            except Exception as exc:  # (the failure is the test's finding)
                errors.append(exc)
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and got == [(16,)] * 4
