"""Reading a tensor through a chain of deltas: the base decoded once, each level XORed into it
as it is merged, one content hash for the result; a level whose bytes are wrong is still named
(the chain is then read again level by level)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance import craft
from s4format import ContentHashError, Reader, Tensor, Writer, codecs
from s4format.source import BufferSource

DEPTH = 3


def _state(rng: np.random.Generator) -> dict[str, Tensor]:
    bf16 = (rng.standard_normal(30000).astype("<f4").view("<u4") >> 16).astype("<u2")
    return {
        "bf16": Tensor.from_numpy(bf16, "bfloat16"),
        "fp16": Tensor.from_numpy(rng.standard_normal(20001).astype("<f2")),
        "fp32": Tensor.from_numpy(rng.standard_normal((100, 97)).astype("<f4")),
        "i64": Tensor.from_numpy(rng.integers(-50, 50, 7000).astype("<i8")),
        "u8": Tensor.from_numpy(rng.integers(0, 4, 9000).astype(np.uint8)),
        "c128": Tensor.from_numpy((rng.standard_normal(900)
                                   + 1j * rng.standard_normal(900)).astype("<c16")),
        "flags": Tensor.from_numpy(rng.integers(0, 2, 5000).astype(bool)),
    }


def _step(state: dict[str, Tensor], rng: np.random.Generator) -> dict[str, Tensor]:
    """A few elements of every tensor change, as in a fine-tuning step."""
    out = {}
    for name, t in state.items():
        raw = np.array(t.data, copy=True)
        n = raw.size // t.dtype.itemsize
        for at in rng.integers(0, n, max(1, n // 200)):
            raw[at * t.dtype.itemsize] ^= 1 << int(rng.integers(0, 7 if name == "flags" else 8))
        if name == "flags":
            raw &= 1
        out[name] = Tensor(t.dtype, t.shape, raw)
    return out


def _write(path: Path, state: dict[str, Tensor], parent: Reader | None = None,
           parents: dict[str, Tensor] | None = None) -> None:
    with open(path, "wb") as f, Writer(f, parent_id=parent.checkpoint_id if parent else None
                                       ) as w:
        for name, t in state.items():
            w.add(name, t, parent=parents[name] if parents else None)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[list[Path], list[dict[str, Tensor]]]:
    folder = tmp_path_factory.mktemp("chain")
    rng = np.random.default_rng(5)
    states = [_state(rng)]
    paths = [folder / "step0.s4w"]
    _write(paths[0], states[0])
    for k in range(1, DEPTH + 1):
        states.append(_step(states[-1], rng))
        paths.append(folder / f"step{k}.s4w")
        with _open(paths[:-1]) as parent:
            _write(paths[-1], states[-1], parent, states[-2])
    return paths, states


def _open(paths: list[Path], **kw) -> Reader:
    reader = None
    for p in paths:
        reader = Reader(p, parent=reader, **kw) if reader is not None else Reader(p, **kw)
    assert reader is not None
    return reader


@pytest.mark.parametrize("verify", [True, False])
def test_every_level_reads_back_exactly_without_reading_level_by_level(chain, monkeypatch,
                                                                        verify) -> None:
    paths, states = chain

    def refused(self, i):
        raise AssertionError("a sound chain was read level by level")
    monkeypatch.setattr(Reader, "_read_level_by_level", refused)
    for k in range(DEPTH + 1):
        with _open(paths[:k + 1], verify=verify) as r:
            assert sum(t.is_delta for t in r.tensors) == (0 if k == 0 else len(states[k]))
            for name, want in states[k].items():
                got = r.read(name)
                assert got.data.tobytes() == want.data.tobytes(), (k, name)
                assert got.data.flags.writeable


def test_the_fused_read_equals_the_level_by_level_one(chain) -> None:
    paths, _states = chain
    with _open(paths) as r:
        for i in range(len(r.tensors)):
            assert np.array_equal(r.read_raw(i), r._read_level_by_level(i))


def test_reading_leaves_the_parents_buffers_alone(chain) -> None:
    paths, states = chain
    with _open(paths) as r:
        base = r.parent.parent.parent
        first = base.read_raw(base.index_of("u8"))
        r.read("u8")
        assert np.array_equal(base.read_raw(base.index_of("u8")), first)
        assert first.tobytes() == states[0]["u8"].data.tobytes()


def test_undo_delta_gives_the_parents_bytes(chain) -> None:
    # a delta's own bytes XORed out of its tensor's: the parent's, one level down, for every
    # layout and form (masked, plain, raw)
    paths, states = chain
    with _open(paths[:3]) as r:
        for i, t in enumerate(r.tensors):
            raw = r.read_raw(i)
            k = r.undo_delta(i, raw)
            assert r.parent.tensors[k].name == t.name
            assert raw.tobytes() == states[1][t.name].data.tobytes(), t.name
        for wrong in (np.zeros(3, np.uint8), np.zeros((2, r.tensors[0].raw_nbytes // 2),
                                                     np.uint8),
                      np.zeros(2 * r.tensors[0].raw_nbytes, np.uint8)[::2]):
            with pytest.raises(ValueError, match="writable bytes"):
                r.undo_delta(0, wrong)
    with Reader(paths[0]) as base, pytest.raises(ValueError, match="is not a delta"):
        base.undo_delta(0, base.read_raw(0))


def test_a_wrong_level_in_the_middle_is_named(chain, tmp_path) -> None:
    """The middle delta's plane replaced by raw XOR bytes one bit off, with a valid plane
    checksum: the top file's hash fails, and reading level by level names the middle file."""
    paths, _states = chain
    parts = craft.parse(paths[2].read_bytes())
    with _open(paths[:3]) as good:
        xor = good.read_raw(good.index_of("fp32")) \
            ^ good.parent.read_raw(good.parent.index_of("fp32"))
    xor[7] ^= 1
    _raw_plane(parts, "fp32", xor)
    bad = tmp_path / "step2-bad.s4w"
    bad.write_bytes(craft.build(parts))
    with _open([paths[0], paths[1], bad, paths[3]], verify=False) as r:
        with pytest.raises(ContentHashError, match=r"step2-bad\.s4w: tensor 'fp32' content hash"):
            r.read("fp32")
        assert r.read("bf16").data.tobytes() == _states[3]["bf16"].data.tobytes()


def test_a_wrong_base_is_named(chain, tmp_path) -> None:
    """The base's plane replaced by raw bytes one bit off, with a valid plane checksum: the
    base's hash fails as the chain is applied, and reading level by level names the base."""
    paths, states = chain
    parts = craft.parse(paths[0].read_bytes())
    raw = np.array(states[0]["fp32"].data, copy=True)
    raw[3] ^= 4
    _raw_plane(parts, "fp32", raw)
    bad = tmp_path / "step0-bad.s4w"
    bad.write_bytes(craft.build(parts))
    with _open([bad, *paths[1:]]) as r:
        with pytest.raises(ContentHashError, match=r"step0-bad\.s4w: tensor 'fp32' content hash"):
            r.read("fp32")
        assert r.read("u8").data.tobytes() == states[DEPTH]["u8"].data.tobytes()


def _raw_plane(parts, name: str, xor: np.ndarray) -> None:
    """Store tensor ``name`` of ``parts`` as one raw plane holding ``xor`` (layout raw)."""
    i = next(i for i, t in enumerate(parts.tensors) if t["name"] == name)
    rec = parts.tensors[i]
    parts.data += bytes(-(32 + len(parts.data)) % 64) + xor.tobytes()
    rec["layout"], rec["flags"] = 0, 0  # (not masked, whatever the writer chose)
    rec["planes"] = [dict(kind=0, index=0, codec=codecs.RAW, params=b"",
                          offset=32 + len(parts.data) - xor.size, stored_len=xor.size,
                          decoded_len=xor.size, checksum=0)]
    craft.set_plane_bytes(parts, i, 0, xor.tobytes())


def test_a_writable_source_is_not_written_through(chain) -> None:
    """A delta stored raw, read from a caller's writable buffer: its plane is the caller's
    bytes, so the parents must be XORed into a copy, never into them."""
    paths, states = chain
    parts = craft.parse(paths[2].read_bytes())
    _raw_plane(parts, "u8", states[2]["u8"].data ^ states[1]["u8"].data)
    top = bytearray(craft.build(parts))
    before = bytes(top)
    with Reader(paths[0]) as base, Reader(paths[1], parent=base) as mid, \
            Reader(BufferSource(memoryview(top)), parent=mid) as r:
        got = r.read("u8").data
        assert got.tobytes() == states[2]["u8"].data.tobytes()
        assert bytes(top) == before
        assert not np.shares_memory(got, np.frombuffer(top, np.uint8))
