"""Hostile files at the format level: a file of kilobytes must open or fail fast with an S4Error,
never hang, exhaust memory or pass values torch fails on (spec/README.md, the clarifications of
2026-12-01: T4, O12, O13, L1). Each class has a property test at CI sizes and asserts its
bound: the error class, or the time and the peak memory (tracemalloc) of opening and loading."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.generate import tree_bytes
from s4format import FormatError, LimitError, Reader, S4Error, budget
from s4format.objtree import MAX_KEYS_PER_HASH, Typed
from tests.format import hostile as H

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=40)
MiB = 1 << 20


def measured(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``fn()``'s result (or the S4Error it raised), its seconds and its peak traced bytes."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    except S4Error as exc:
        out = exc
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak


# -- T4: an empty tensor's sizes are bounded like a full one's ------------------------------

sizes = st.one_of(st.integers(0, 8), st.integers(1 << 30, 1 << 34),
                  st.integers((1 << 62) - 8, (1 << 64) - 1))


@settings(**SETTINGS)
@given(shape=st.lists(sizes, min_size=1, max_size=4).map(lambda s: (0, *s)))
def test_empty_tensors_are_refused_past_2p62_with_zeros_counted_as_1(shape) -> None:
    blob = H.with_shape(shape)
    if math.prod(max(n, 1) for n in shape) > 1 << 62:
        with pytest.raises(LimitError, match=r"zeros counted as 1"):
            Reader(blob)
        return
    with Reader(blob) as r:
        t = r.read(0)
    assert t.shape == shape and t.nbytes == 0


# -- O12: registered typed values have their forms -----------------------------------------

def _size_error(entries: list[int]) -> type | None:
    for x in entries:
        if x < 0:
            return FormatError
        if x >= 1 << 63:
            return LimitError
    return None


@settings(**SETTINGS)
@given(entries=st.lists(st.one_of(st.integers(0, 9), st.integers(-(2**70), 2**70)),
                        max_size=5))
def test_torch_size_entries_are_torch_sizes(entries) -> None:
    blob = H.typed("torch.Size", tuple(entries))
    error = _size_error(entries)
    if error is None:
        with Reader(blob) as r:
            assert r.tree == {"x": Typed("torch.Size", tuple(entries))}
    else:
        with pytest.raises(error, match=r"object tree: x: torch\.Size"):
            Reader(blob)


@settings(**SETTINGS)
@given(flag=st.sampled_from(["requires_grad", "parameter"]),
       value=st.one_of(st.booleans(), st.integers(-1, 2), st.none(), st.text(max_size=2)))
def test_view_flags_are_bools(flag: str, value) -> None:
    blob = H.view(**{flag: value})
    if type(value) is bool:
        with Reader(blob) as r:
            assert r.tree["v"].value[flag] is value
    else:
        with pytest.raises(FormatError, match=rf"v: s4\.view {flag} must be a bool"):
            Reader(blob)


@pytest.mark.parametrize("change, error, message", [
    ({"shape": (17,)}, FormatError, "reaches element 16, beyond its storage of 16 bytes"),
    ({"offset": 17, "shape": (0,)}, FormatError, "offset 17 is beyond its storage"),
    ({"shape": (0, 2**63 - 1), "stride": (1, 1)}, LimitError, "zeros counted as 1"),
    ({"stride": (2**64,)}, LimitError, "stride entry 18446744073709551616 is over 2"),
    ({"dtype": "long"}, FormatError, "dtype 'long' is not a dtype name"),
    ({"device": 0}, FormatError, "device must be a str"),
])
def test_views_are_checked_when_the_file_opens(change, error, message) -> None:
    with pytest.raises(error, match=message):
        Reader(H.view(**change))


def test_attributes_cannot_nest_around_each_other() -> None:
    node: Any = {}
    for _ in range(80):
        node = Typed("s4.attrs", (node, {}))
    (exc, seconds, _) = measured(lambda: Reader(H.file_with(node)))
    assert isinstance(exc, FormatError) and "s4.attrs holds Typed" in str(exc)
    assert seconds < 1.0


# -- O13: keys of one hash ----------------------------------------------------------------

def _dict_of(keys: list[int]) -> bytes:
    pairs = b"".join(tree_bytes(k) + tree_bytes(i) for i, k in enumerate(keys))
    return b"\x0a" + struct.pack("<I", len(keys)) + pairs


@settings(**SETTINGS)
@given(buckets=st.lists(st.integers(1, MAX_KEYS_PER_HASH + 3), min_size=1, max_size=4),
       order=st.randoms(use_true_random=False))
def test_a_dict_holds_at_most_64_keys_of_one_hash(buckets, order) -> None:
    keys = [b + 1 + k * H.HASH_MODULUS for b, n in enumerate(buckets) for k in range(n)]
    order.shuffle(keys)
    blob = H.file_with(None, raw_tree=_dict_of(keys))
    if max(buckets) > MAX_KEYS_PER_HASH:
        with pytest.raises(LimitError, match="more than 64 keys of one hash"):
            Reader(blob)
    else:
        with Reader(blob) as r:
            assert list(r.tree.items()) == [(k, i) for i, k in enumerate(keys)]


def test_colliding_keys_cost_linear_time() -> None:
    # 20,000 keys of one hash took 16 s; in buckets of 64, the most O13 allows, they open in
    # about the time of as many keys of distinct hashes
    n = 20_000
    colliding = [b + 1 + k * H.HASH_MODULUS for b in range(n // 64 + 1) for k in range(64)]
    files = [H.file_with(None, raw_tree=_dict_of(keys))
             for keys in (colliding[:n], [(1 << 64) + i for i in range(n)])]
    seconds = []
    for blob in files:
        t0 = time.perf_counter()
        assert len(Reader(blob).tree) == n
        seconds.append(time.perf_counter() - t0)
    assert seconds[0] < 3 * seconds[1] + 0.2
    attack = H.colliding_keys(n)
    t0 = time.perf_counter()
    with pytest.raises(LimitError):
        Reader(attack)
    assert time.perf_counter() - t0 < 0.5


def test_inspect_refuses_colliding_keys_fast(tmp_path) -> None:
    # a 639 KB file of colliding keys held `python -m s4format inspect` for 29 s
    path = tmp_path / "keys.s4w"
    path.write_bytes(H.colliding_keys(64_000))
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "s4format", "inspect", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "LimitError" in run.stderr
    assert "more than 64 keys of one hash" in run.stderr
    assert time.perf_counter() - t0 < 15


# -- L1: a load's decode budget ------------------------------------------------------------

@settings(**SETTINGS)
@given(data=st.data())
def test_a_load_decodes_within_its_budget_each_tensor_counted_once(data) -> None:
    sizes = data.draw(st.lists(st.integers(0, 2 * MiB), min_size=1, max_size=4))
    refs = data.draw(st.lists(st.integers(0, len(sizes) - 1), max_size=12))
    limit = data.draw(st.integers(0, 5 * MiB))
    blob = H.file_with(lambda r: [r[i] for i in refs], [(f"t{i}", n) for i, n in
                                                        enumerate(sizes)])
    total = sum(sizes[i] for i in set(refs))
    with Reader(blob, max_decoded_bytes=limit) as r:
        (out, _, peak) = measured(r.load)
    if total > limit:
        assert isinstance(out, LimitError) and f"decodes {total} bytes" in str(out)
        assert peak < MiB  # refused before anything was decoded
    else:
        assert [t.nbytes for t in out] == [sizes[i] for i in refs]
        assert peak < 3 * max(sizes) + total + MiB


def test_the_default_budget_is_the_memory_available() -> None:
    # twelve 1 GiB CONST tensors in 14 KB took 6.4 GB and ended in MemoryError: a file that
    # declares more than this machine has is refused before it decodes a byte
    count = budget.available_memory() // (1 << 30) + 2
    blob = H.many_const(count, 1 << 30)
    assert len(blob) < 2000 * count
    with Reader(blob) as r:
        (exc, seconds, peak) = measured(r.load)
    assert isinstance(exc, LimitError) and "max_decoded_bytes" in str(exc)
    assert seconds < 1.0 and peak < MiB


# -- linear walks: key paths only for messages ------------------------------------------------

def test_long_keys_cost_memory_linear_in_the_file() -> None:
    # nested dicts of long bytes keys: a 16.8 MB file took 8.5 GB while each level kept its
    # key path; opening one must take memory of the order of the file
    blob = H.long_keys(256, 4096)
    (tree, seconds, peak) = measured(lambda: Reader(blob).tree)
    assert isinstance(tree, dict) and peak < 4 * len(blob) and seconds < 2.0


def test_an_error_deep_under_long_keys_names_a_bounded_path() -> None:
    node: Any = Typed("torch.Size", (-1,))
    for level in range(200):
        node = {bytes([level]) * 4096: node}
    with pytest.raises(FormatError) as err:
        Reader(H.file_with(node))
    text = str(err.value)
    # every key shown, each cut to 80 characters, the outermost first
    assert text.startswith("<buffer>: object tree: b'\\xc7\\xc7")
    assert "torch.Size entry must be >= 0" in text and len(text) < 200 * 90
