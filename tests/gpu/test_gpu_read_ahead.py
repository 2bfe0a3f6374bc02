"""The GPU load reads planes ahead of their batch (``staging.Ahead``): the next batch's while
one decodes, and every parent level of a chain's deltas. The loads stay bit-exact, the reads
ahead are the ones the batches take, and a read ahead that no batch takes holds nothing past
the load. Skipped without CUDA."""

from __future__ import annotations

import io

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import s4weights  # noqa: E402
from s4weights import chain  # noqa: E402
from s4weights.gpu import staging  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def _state(seed: int = 1, scale: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    for i in range(24):
        x = torch.randn(1 << 19, device="cuda", generator=g) * 0.02
        out[f"t{i}"] = x.to(torch.bfloat16) if i % 2 else x
    if scale:
        g.manual_seed(seed)
        out = {k: (v.float() + scale * torch.randn(v.shape, device="cuda", generator=g))
               .to(v.dtype) for k, v in out.items()}
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a)


@pytest.fixture
def takes(monkeypatch) -> list[bool]:
    """Whether each staging found its planes read ahead."""
    seen: list[bool] = []
    real = staging.Ahead.take

    def take(self, reader, idx):
        got = real(self, reader, idx)
        seen.append(got is not None)
        return got
    monkeypatch.setattr(staging.Ahead, "take", take)
    return seen


@pytest.mark.parametrize("source", ["memory", "file"])
def test_each_batch_after_the_first_was_read_ahead(tmp_path, takes, source: str) -> None:
    state = _state()
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cuda")
    path = tmp_path / "s.s4w"
    path.write_bytes(buf.getvalue())
    got = s4weights.load(buf.getvalue() if source == "memory" else path, map_location="cuda",
                         workspace=8 * MIB)
    assert _same(state, got)
    assert len(takes) > 3 and takes[0] is False and all(takes[1:]), takes


def test_a_chain_reads_its_levels_ahead(tmp_path, takes) -> None:
    states = [_state(n, 1e-3 * n) for n in range(3)]
    for n, st in enumerate(states):
        info = s4weights.save_checkpoint(st, tmp_path, n, read_budget=None, min_delta_gain=0,
                                         delta_against="latest")
    assert info.depth == 2
    chain._PARENT_CACHE.clear()
    takes.clear()
    got = s4weights.load_checkpoint(tmp_path, 2, map_location="cuda")
    assert _same(states[2], got)
    # the newest file's batch reads its own planes; both levels below were read ahead
    assert takes == [False, True, True], takes
    chain._PARENT_CACHE.clear()
    takes.clear()
    got = s4weights.load_checkpoint(tmp_path, 2, map_location="cuda", workspace=8 * MIB)
    assert _same(states[2], got)
    assert takes.count(True) >= 2 * takes.count(False) > 0, takes


def test_a_read_ahead_nobody_takes_is_dropped(tmp_path) -> None:
    state = _state()
    path = tmp_path / "s.s4w"
    s4weights.save(state, path, device="cuda")
    import s4format

    with s4format.Reader(path) as r:
        ahead = staging.Ahead()
        ahead.start(r, list(range(len(r.tensors))))
        ahead.start(r, list(range(len(r.tensors))))  # (once per batch)
        assert len(ahead._pending) == 1 and staging._AHEAD.held > 0
        ahead.drop()
        assert not ahead._pending and staging._AHEAD.held == 0
        st = staging.stage_planes(r, [0, 1], ahead)  # nothing read ahead: read now
        assert st.host.size >= sum(p.stored_len for p in r.tensors[0].planes)


def test_reads_ahead_stop_at_the_limit(tmp_path, monkeypatch) -> None:
    state = _state()
    path = tmp_path / "s.s4w"
    s4weights.save(state, path, device="cuda")
    import s4format

    monkeypatch.setattr(staging, "AHEAD_LIMIT", 1 * MIB)
    with s4format.Reader(path) as r:
        ahead, other = staging.Ahead(), staging.Ahead()
        for i in range(len(r.tensors)):
            (ahead if i % 2 else other).start(r, [i])  # (one limit for all of them)
        assert 0 < staging._AHEAD.held <= 1 * MIB
        assert len(ahead._pending) + len(other._pending) < len(r.tensors)
        ahead.drop()
        other.drop()
        assert staging._AHEAD.held == 0
