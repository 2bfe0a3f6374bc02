"""Hostile files through ``s4weights.load``: each case the review found (a 915-byte file
reaching 5.66 GB, 20 levels of ``s4.attrs`` taking 5 s, a 16.8 MB file taking 8.5 GB, ...),
rebuilt from the spec at CI sizes, fails fast with an S4Error or loads within about twice the
file's own decode work and memory. Peaks are tracemalloc's: numpy and Python objects, where
decoding and the tree's copies live."""

from __future__ import annotations

import io
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
import s4weights
from s4format import FormatError, LimitError, S4Error, UnsupportedDeviceError
from s4format.objtree import TensorRef, Typed
from s4weights import api
from tests.format import hostile as H

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=30)
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


class CountingReader(s4format.Reader):
    """A Reader that counts the tensors it decodes (the real decode, counted)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoded: list[int] = []

    def read(self, key: int | str) -> s4format.Tensor:
        self.decoded.append(key)
        return super().read(key)


# -- case 2: attributes walked once -----------------------------------------------------------

def _attrs_chain(levels: int) -> Any:
    """s4.attrs on a plain dict (which takes no attributes), each holding the next as an
    attribute: every level falls back to an opaque value under strict=False."""
    node: Any = None
    for _ in range(levels):
        node = Typed("s4.attrs", ({}, {"a": node}))
    return node


def test_attributes_of_what_takes_none_are_walked_once() -> None:
    # each level was walked twice: 20 levels took 5.3 s, 128 over 9 CPU-minutes
    blob = H.file_with(_attrs_chain(80))  # 80 x 3 levels: near the depth limit of 256
    (got, seconds, _) = measured(lambda: s4weights.load(blob, strict=False))
    assert seconds < 1.0
    for _ in range(80):
        assert type(got) is Typed and got.name == "s4.attrs" and got.value[0] == {}
        got = got.value[1]["a"]
    assert got is None
    with pytest.raises(s4format.UnsupportedObjectError, match=r"^(a\.){78}a: s4\.attrs gives "
                       r"attributes to a dict"):
        s4weights.load(blob)


# -- case 3: every reference decoded once --------------------------------------------------

def test_a_tensor_referenced_many_times_as_numpy_is_decoded_and_copied_once() -> None:
    # one stored tensor referenced K times as a numpy array was decoded and copied K times:
    # a 915-byte file reached 5.66 GB
    size = 8 * MiB
    blob = H.numpy_refs(200, size)
    assert len(blob) < 5000
    (got, _, peak) = measured(lambda: s4weights.load(blob))
    assert len(got) == 200 and len({id(a) for a in got}) == 1
    assert got[0].shape == (size,) and not got[0].any()
    assert peak < 2 * size + MiB  # the decoded bytes and the one copy numpy owns


WRAPPERS = {
    "plain": lambda ref: ref,
    "numpy": lambda ref: Typed("numpy.ndarray", ref),
    "view": lambda ref: Typed("s4.view", {
        "storage": ref, "dtype": "int16", "offset": 1, "shape": (3,), "stride": (2,),
        "device": "cpu", "requires_grad": False, "parameter": False}),
    "meta_view": lambda ref: Typed("s4.view", {
        "storage": ref, "dtype": "uint8", "offset": 0, "shape": (16,), "stride": (1,),
        "device": "meta", "requires_grad": False, "parameter": False}),
    "attrs": lambda ref: Typed("s4.attrs", (ref, {"tag": 1})),
}


@settings(**SETTINGS)
@given(wraps=st.lists(st.sampled_from(sorted(WRAPPERS)), min_size=1, max_size=12),
       other=st.booleans())
def test_each_stored_tensor_is_decoded_once_whatever_wraps_it(wraps, other) -> None:
    tensors = [("s", 16)] + ([("t", 16)] if other else [])
    tree = lambda refs: [WRAPPERS[w](refs[0]) for w in wraps] + refs[1:]  # noqa: E731
    with CountingReader(H.file_with(tree, tensors)) as r:
        got = api.read_tree(r, show=False)
        assert sorted(r.decoded) == list(range(len(tensors)))
    for w, x in zip(wraps, got):
        want = {"plain": torch.Tensor, "numpy": np.ndarray, "view": torch.Tensor,
                "meta_view": torch.Tensor, "attrs": torch.Tensor}[w]
        assert isinstance(x, want) and (w != "attrs" or x.tag == 1)


# -- case 4: key paths only for messages -----------------------------------------------------

def test_deep_long_keys_load_in_memory_linear_in_the_file() -> None:
    # every level kept its full key path: a 16.8 MB file took 8.5 GB and 49 s
    blob = H.long_keys(256, 4096)
    (got, seconds, peak) = measured(lambda: s4weights.load(blob))
    assert peak < 4 * len(blob) and seconds < 3.0
    for level in reversed(range(256)):
        got = got[bytes([level % 256]) * 4096]
    assert torch.equal(got, torch.zeros(16, dtype=torch.uint8))
    # into= matches key paths: a short destination path must not make the walk build long ones
    (exc, _, peak) = measured(lambda: s4weights.load(blob, into={"w": torch.zeros(16)}))
    assert isinstance(exc, s4weights.IntoMismatchError) and peak < 4 * len(blob)


def test_into_finds_its_tensor_below_long_keys_of_other_branches() -> None:
    long = {bytes([i]) * 4096: {"t": TensorRef(0)} for i in range(64)}
    blob = H.file_with(lambda refs: {"long": long, "short": {"w": refs[0]}}, [("w", 16)])
    dest = torch.ones(16, dtype=torch.uint8)
    got = s4weights.load(blob, into={"short": {"w": dest}})
    assert got["short"]["w"] is dest and not dest.any()


# -- case 5: dict keys of one hash ---------------------------------------------------------

def test_dict_keys_of_one_hash_fail_fast_and_are_refused_on_save() -> None:
    # 20k int keys of one Python hash took 16 s in s4weights.load
    (exc, seconds, _) = measured(lambda: s4weights.load(H.colliding_keys(20_000)))
    assert isinstance(exc, LimitError) and seconds < 1.0
    state = {1 + k * H.HASH_MODULUS: torch.ones(1) for k in range(65)}
    buf = io.BytesIO()
    with pytest.raises(s4format.UnsupportedObjectError,
                       match=r"dict at opt has more than 64 keys of one hash"):
        s4weights.save({"opt": state}, buf)
    assert buf.tell() == 0  # refused before anything was written
    del state[1 + 64 * H.HASH_MODULUS]
    s4weights.save({"opt": state}, buf)
    assert len(s4weights.load(buf.getvalue())["opt"]) == 64


# -- case 6: the decode budget ---------------------------------------------------------------

def test_the_decode_budget_refuses_before_decoding() -> None:
    blob = H.many_const(12, 4 * MiB)
    (exc, _, peak) = measured(lambda: s4weights.load(blob, max_decoded_bytes=40 * MiB))
    assert isinstance(exc, LimitError) and "decodes 50331648 bytes" in str(exc)
    assert peak < MiB
    assert len(s4weights.load(blob, max_decoded_bytes=48 * MiB)) == 12
    # one tensor referenced 100 times counts once
    assert len(s4weights.load(H.numpy_refs(100, 4 * MiB), max_decoded_bytes=4 * MiB)) == 100


def test_a_file_declaring_more_than_memory_is_refused_by_default() -> None:
    count = s4format.budget.available_memory() // (1 << 30) + 2
    blob = H.many_const(count, 1 << 30)
    (exc, seconds, peak) = measured(lambda: s4weights.load(blob))
    assert isinstance(exc, LimitError) and "max_decoded_bytes" in str(exc)
    assert seconds < 1.0 and peak < MiB


# -- case 7: shapes, typed values and devices ------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 2**64 - 1), (2**63, 0), (0, 2**31, 2**31, 2)])
def test_empty_tensors_with_sizes_torch_cannot_hold_are_limit_errors(shape) -> None:
    with pytest.raises(LimitError, match="zeros counted as 1"):
        s4weights.load(H.with_shape(shape))


@pytest.mark.parametrize("shape", [(0, 2**62), (0, 2**31, 2**31)])
def test_an_empty_tensor_at_the_limit_loads(shape) -> None:
    got = s4weights.load(H.with_shape(shape))["t"]
    assert got.shape == shape and got.dtype == torch.uint8


@pytest.mark.parametrize("value, error", [((2**70,), LimitError), ((-5,), FormatError),
                                          ([3], FormatError)])
def test_torch_sizes_out_of_torchs_range_fail_at_load(value, error) -> None:
    with pytest.raises(error, match=r"x: torch\.Size"):
        s4weights.load(H.typed("torch.Size", value))


def test_a_negative_torch_size_is_refused_on_save() -> None:
    buf = io.BytesIO()
    with pytest.raises(s4format.UnsupportedObjectError, match=r"torch\.Size at x holds a "
                       r"negative size \[-5\]"):
        s4weights.save({"x": torch.Size([-5]), "w": torch.ones(2)}, buf)
    assert buf.tell() == 0


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_requires_grad_must_be_a_bool(value) -> None:
    with pytest.raises(FormatError, match=r"v: s4\.view requires_grad must be a bool"):
        s4weights.load(H.view(requires_grad=value))


@settings(**SETTINGS)
@given(device=st.one_of(
    st.sampled_from(["mps", "xla", "xla:0", "hpu:0", "xpu", "ipu", "mtia", "lazy", "ve",
                     "privateuseone", "cpu", "meta", "cpu:3"]),
    st.sampled_from(["cuda", "cuda:0", "cuda:7"]).filter(
        lambda _: not torch.cuda.is_available())))
def test_devices_this_machine_lacks_are_named(device: str) -> None:
    blob = H.view(device=device)
    kind = torch.device(device).type
    if kind in ("cpu", "meta"):
        got = s4weights.load(blob)["v"]
        assert got.device.type == kind and got.shape == (16,)
        return
    with pytest.raises(UnsupportedDeviceError, match=rf"at v is to be loaded onto {device}"):
        s4weights.load(blob)
    assert issubclass(UnsupportedDeviceError, RuntimeError)
    assert torch.equal(s4weights.load(blob, map_location="cpu")["v"],
                       torch.zeros(16, dtype=torch.uint8))


def test_a_map_location_this_machine_lacks_is_named() -> None:
    buf = io.BytesIO()
    s4weights.save({"w": torch.ones(2), "v": torch.ones(4)[1:]}, buf)
    for where in ("xla", "hpu:0"):
        with pytest.raises(UnsupportedDeviceError, match=f"loaded onto {where}"):
            s4weights.load(buf.getvalue(), map_location=where)


CASES = [
    ("nested_attrs", lambda: H.nested_attrs(40), FormatError),
    ("numpy_refs", lambda: H.numpy_refs(50, MiB), list),
    ("long_keys", lambda: H.long_keys(64, 1024), dict),
    ("colliding_keys", lambda: H.colliding_keys(1000), LimitError),
    ("many_const", lambda: H.many_const(3, MiB), dict),
    ("budget", lambda: H.many_const(9, MiB), LimitError),
    ("empty_huge", lambda: H.with_shape((0, 2**64 - 1)), LimitError),
    ("device", lambda: H.view(device="mps"), UnsupportedDeviceError),
    ("size", lambda: H.typed("torch.Size", (2**70,)), LimitError),
    ("requires_grad", lambda: H.view(requires_grad=2), FormatError),
]


@pytest.mark.parametrize("name, build, outcome", CASES, ids=[c[0] for c in CASES])
def test_every_case_gives_a_value_or_an_s4error(name, build, outcome) -> None:
    # under both strict settings, never an error of torch or numpy
    for strict in (True, False):
        try:
            got = s4weights.load(build(), strict=strict, max_decoded_bytes=8 * MiB)
        except S4Error as exc:
            got = exc
        assert type(got) is outcome, (name, strict, got)


def test_load_checkpoint_takes_a_decode_budget(tmp_path) -> None:
    from s4format.errors import LimitError

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    s4weights.save_checkpoint(state, tmp_path, step=1)
    with pytest.raises(LimitError, match="max_decoded_bytes"):
        s4weights.load_checkpoint(tmp_path, max_decoded_bytes=1000)
    assert torch.equal(s4weights.load_checkpoint(tmp_path, max_decoded_bytes=1 << 20)["w"],
                       state["w"])
