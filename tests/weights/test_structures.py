"""Every structure a training checkpoint holds comes back with its type, sharing and bits;
unsupported objects are refused by key path; register_type opts a class in."""

from __future__ import annotations

import io
import random
import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import s4format
import s4weights
from s4format import dtypes
from s4weights import torchtree
from tests.weights.common import TinyNet, assert_same, roundtrip, tensor_bytes

TORCH_DTYPES = [getattr(torch, n) for n in dtypes.BY_NAME if isinstance(getattr(torch, n, None),
                                                                         torch.dtype)]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (NaNs and all), made from random bytes."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) * itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return torch.from_numpy(raw).view(dtype).reshape(shape)


# -- model, optimizer, scheduler, scaler, RNG ----------------------------------------------

def test_model_state_dict_keeps_ordereddict_and_metadata_and_loads_into_a_fresh_model() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    model.train()
    model(torch.randn(4, 8))  # move the BatchNorm running stats off their init values
    sd = model.state_dict()
    got = roundtrip(sd)
    assert type(got) is OrderedDict
    assert got._metadata == sd._metadata
    assert got._metadata["bn"]["version"] == 2
    assert_same(got, sd)
    assert got["bn.num_batches_tracked"].dtype == torch.int64
    fresh = TinyNet()
    missing, unexpected = fresh.load_state_dict(got, strict=True)
    assert (missing, unexpected) == ([], [])
    for k, v in fresh.state_dict().items():
        assert tensor_bytes(v) == tensor_bytes(sd[k]), k


def test_optimizer_state_dict_keeps_int_keys_and_step_types() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    adamw.step()
    sgd.step()
    sd = adamw.state_dict()
    # Older checkpoints and other optimizers keep the step counter as a plain int.
    legacy = {"state": {i: {**s, "step": 7} for i, s in sd["state"].items()},
              "param_groups": sd["param_groups"]}
    for want in (sd, sgd.state_dict(), legacy):
        got = roundtrip(want)
        assert_same(got, want)
        assert all(type(k) is int for k in got["state"])
    got = roundtrip(sd)
    assert type(got["state"][0]["step"]) is torch.Tensor
    assert got["state"][0]["step"].dtype == torch.float32 and got["state"][0]["step"].ndim == 0
    assert type(roundtrip(legacy)["state"][0]["step"]) is int
    fresh = torch.optim.AdamW(TinyNet().parameters(), lr=1e-3)
    fresh.load_state_dict(got)
    assert_same(fresh.state_dict(), sd)


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=4),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s),
    lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
], ids=["step", "onecycle", "cosine_restarts", "lambda", "plateau"])
def test_lr_scheduler_state_round_trips_and_loads(make) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    sched = make(opt)
    for _ in range(5):
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0)
        else:
            sched.step()
    sd = sched.state_dict()
    got = roundtrip(sd)
    assert_same(got, sd)
    other = make(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    other.load_state_dict(got)
    assert other.state_dict() == sd


def test_grad_scaler_state_round_trips() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sd = scaler.state_dict()
    assert_same(roundtrip(sd), sd)
    like = {"scale": torch.tensor(65536.0), "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 2000, "_growth_tracker": torch.tensor(3, dtype=torch.int32)}
    assert_same(roundtrip(like), like)


def test_rng_states_round_trip_and_reproduce_the_same_draws() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    gen = np.random.default_rng(5)
    gen.random(3)
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate(), "pcg64": gen.bit_generator.state,
             "generator": torch.Generator().manual_seed(9).get_state()}
    want = (torch.rand(4), np.random.random(4), random.random(), gen.random(2))
    got = roundtrip(state)
    assert_same(got, state)
    assert got["pcg64"]["state"]["state"] > 2**64  # a big int survives
    torch.set_rng_state(got["torch"])
    np.random.set_state(got["numpy"])
    random.setstate(got["python"])
    gen2 = np.random.default_rng()
    gen2.bit_generator.state = got["pcg64"]
    again = (torch.rand(4), np.random.random(4), random.random(), gen2.random(2))
    assert tensor_bytes(again[0]) == tensor_bytes(want[0])
    assert again[1].tobytes() == want[1].tobytes()
    assert again[2] == want[2]
    assert again[3].tobytes() == want[3].tobytes()


def test_nested_containers_and_plain_values() -> None:
    obj = {"list": [1, [2, (3, {"x": None})], []], "tuple": (), "dict": {},
           "od": OrderedDict([("b", 1), ("a", 2)]), "ints": {0: "zero", -1: "neg", 2**70: "big"},
           "tuple_key": {(1, "a"): True}, "floats": [0.0, -0.0, float("inf"), float("-inf"),
                                                      1e-310, struct.unpack("<d", struct.pack(
                                                          "<Q", 0x7FF8_0000_DEAD_BEEF))[0]],
           "bytes": b"\x00\xff", "str": "héllo ☃", "bools": [True, False],
           "deep": [[[[[[torch.tensor([1, 2])]]]]]]}
    assert_same(roundtrip(obj), obj)


# -- sharing and views ---------------------------------------------------------------------

def test_shared_storage_is_shared_again_after_load() -> None:
    base = torch.arange(20, dtype=torch.float32)
    obj = {"base": base, "slice": base[2:7], "matrix": base.view(4, 5), "alias": base,
           "tied": {"a": torch.nn.Parameter(torch.ones(3)), "b": None}}
    obj["tied"]["b"] = obj["tied"]["a"]
    got = roundtrip(obj)
    assert_same(got, obj)
    storage = got["base"].untyped_storage().data_ptr()
    for k in ("slice", "matrix", "alias"):
        assert got[k].untyped_storage().data_ptr() == storage, k
    assert got["slice"].data_ptr() == got["base"].data_ptr() + 2 * 4
    got["base"][3] = -1.0
    assert got["slice"][1].item() == -1.0
    assert got["matrix"][0, 3].item() == -1.0
    assert got["alias"][3].item() == -1.0
    with torch.no_grad():
        got["tied"]["a"][0] = 5.0
    assert got["tied"]["b"][0].item() == 5.0


def test_unshared_tensors_do_not_alias_after_load() -> None:
    got = roundtrip({"a": torch.zeros(4), "b": torch.zeros(4)})
    got["a"][0] = 1.0
    assert got["b"][0].item() == 0.0


def test_views_and_non_contiguous_tensors_keep_their_strides() -> None:
    m = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
    obj = {"transpose": m.transpose(0, 2), "step_slice": m[:, ::2, 1::2],
           "expand": torch.arange(3.0).expand(4, 3), "unsqueeze_expand": torch.tensor(7).expand(
               2, 2), "as_strided": torch.arange(10.0).as_strided((4, 3), (2, 1)),
           "offset_only": torch.arange(8, dtype=torch.int16)[5:],
           "narrow_col": torch.arange(12).reshape(3, 4)[:, 1]}
    got = roundtrip(obj)
    assert_same(got, obj)
    assert got["expand"].stride() == (0, 1)
    assert got["as_strided"].stride() == (2, 1)
    # Only the storage goes into the file, once, however many views share it.
    buf = io.BytesIO()
    s4weights.save({"a": m, "b": m.t() if m.ndim == 2 else m.permute(2, 1, 0)}, buf)
    assert s4format.Reader(buf.getvalue()).tensors[0].raw_nbytes == 60 * 8
    assert len(s4format.Reader(buf.getvalue()).tensors) == 1


# -- dtypes and bit patterns ---------------------------------------------------------------

def test_the_dtype_list_covers_this_torch() -> None:
    names = {str(d).removeprefix("torch.") for d in TORCH_DTYPES}
    assert {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "bfloat16", "float32", "float64", "complex32", "complex64",
            "complex128", "float8_e4m3fn", "float8_e5m2"} <= names


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_dtype_round_trips_plain_view_zero_d_and_empty(dtype: torch.dtype) -> None:
    big = _random_tensor(dtype, (64, 80), seed=3)  # large enough to be split into planes
    obj = {"plain": big, "small": _random_tensor(dtype, (3, 5), seed=4),
           "view": _random_tensor(dtype, (6, 8), seed=5)[1:5, ::2],
           "transposed": _random_tensor(dtype, (4, 6), seed=6).t(),
           "zero_d": _random_tensor(dtype, (), seed=7),
           "empty": torch.empty(0, dtype=dtype), "empty_2d": torch.empty(3, 0, dtype=dtype),
           "dtype": dtype}
    got = roundtrip(obj)
    assert_same(got, obj)
    assert got["dtype"] is dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("policy", ["auto", "seed"])
def test_all_65536_half_precision_bit_patterns(dtype: torch.dtype, policy: str) -> None:
    patterns = torch.from_numpy(np.arange(65536, dtype=np.uint16)).view(dtype)
    shuffled = patterns[torch.from_numpy(np.random.default_rng(0).permutation(65536))]
    buf = io.BytesIO()
    s4weights.save({"sorted": patterns, "shuffled": shuffled}, buf, policy=policy)
    got = s4weights.load(buf.getvalue())
    assert tensor_bytes(got["sorted"]) == tensor_bytes(patterns)
    assert tensor_bytes(got["shuffled"]) == tensor_bytes(shuffled)


def test_fp32_nan_payloads_survive() -> None:
    bits = np.array([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
                     0xFFFFFFFF, 0x7FFFFFFF, 0x7F800000, 0x80000000, 0x00000001] * 500,
                    dtype=np.uint32)
    t = torch.from_numpy(bits.view(np.float32).copy())
    got = roundtrip({"nan": t, "zero_d": t[3].clone()})
    assert got["nan"].numpy().view(np.uint32).tobytes() == bits.tobytes()
    assert got["zero_d"].numpy().view(np.uint32) == 0x7F800001


# -- parameters, torch values, numpy -------------------------------------------------------

def test_parameters_and_requires_grad() -> None:
    obj = {"p": torch.nn.Parameter(torch.randn(3, 3)),
           "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
           "leaf": torch.randn(4).requires_grad_(True), "plain": torch.randn(2)}
    got = roundtrip(obj)
    assert_same(got, obj)
    assert got["p"].requires_grad and not got["frozen"].requires_grad
    assert type(got["leaf"]) is torch.Tensor and got["leaf"].requires_grad


def test_torch_size_dtype_device() -> None:
    obj = {"size": torch.Size([2, 3]), "empty_size": torch.Size([]),
           "dtypes": [torch.float32, torch.bfloat16, torch.int64, torch.bool],
           "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]}
    got = roundtrip(obj)
    assert_same(got, obj)
    assert type(got["size"]) is torch.Size


def test_numpy_arrays_and_scalars() -> None:
    obj = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "bool": np.array([True, False]),
           "u64": np.array([2**64 - 1], dtype=np.uint64), "c128": np.array([1 + 2j]),
           "empty": np.zeros((0, 4), dtype=np.int16), "zero_d": np.array(3.5),
           "f16": np.float16(1.5), "i64": np.int64(-3), "bool_": np.bool_(True),
           "u8": np.uint8(255), "f64": np.float64("nan")}
    got = roundtrip(obj)
    assert_same(got, obj)
    got["f32"][0, 0] = 9.0  # loaded arrays are writable and owned
    assert got["f32"].flags.writeable


def test_numpy_strided_fortran_and_big_endian_arrays_keep_their_values() -> None:
    obj = {"fortran": np.asfortranarray(np.arange(6).reshape(2, 3)),
           "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],
           "big_endian": np.arange(5, dtype=">f4")}
    got = roundtrip(obj)
    for k, want in obj.items():
        assert np.array_equal(got[k], want), k
        assert got[k].dtype == want.dtype.newbyteorder("="), k


# -- refusals and register_type ------------------------------------------------------------

class _Custom:
    pass


@pytest.mark.parametrize(("obj", "path", "what"), [
    ({"a": [1, {"b": {1, 2}}]}, "a.1.b", "builtins.set"),
    ({"fn": (1, lambda: 0)}, "fn.1", "builtins.function"),
    ({"x": {"y": _Custom()}}, "x.y", "_Custom"),
    ({"model": torch.nn.Linear(2, 2)}, "model", "torch.nn.modules.linear.Linear"),
    ({"opt": {"state": {0: {"arr": np.array([1, "a"], dtype=object)}}}}, "opt.state.0.arr",
     "object"),
    ({"dates": np.array(["2020-01-01"], dtype="datetime64[D]")}, "dates", "datetime64"),
    ({"sp": torch.eye(3).to_sparse()}, "sp", "sparse"),
    ({"w": [torch.eye(3).to_sparse_csr()]}, "w.0", "sparse_csr"),
], ids=["set", "lambda", "custom", "module", "numpy_object", "numpy_datetime", "sparse",
        "sparse_csr"])
def test_unsupported_objects_are_refused_with_their_key_path(obj, path: str, what: str) -> None:
    with pytest.raises(s4weights.UnsupportedObjectError) as info:
        s4weights.save(obj, io.BytesIO())
    assert f" at {path}" in str(info.value)
    assert what in str(info.value)


def test_colliding_key_paths_are_stored_apart() -> None:
    obj = {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}, 1: torch.full((2,), 3.0),
           "1": torch.full((2,), 4.0)}
    assert_same(roundtrip(obj), obj)


@dataclass
class Point:
    x: torch.Tensor
    label: str


@pytest.fixture
def point_type(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(torchtree, "_CONVERTERS", dict(torchtree._CONVERTERS))
    s4weights.register_type("tests.Point", Point, lambda p: {"x": p.x, "label": p.label},
                            lambda v: Point(v["x"], v["label"]))
    return "tests.Point"


def test_register_type_round_trips_a_custom_class(point_type: str) -> None:
    x = torch.arange(4.0)
    got = roundtrip({"pts": [Point(x, "a"), Point(x[1:], "b")]})
    a, b = got["pts"]
    assert type(a) is Point and a.label == "a" and tensor_bytes(a.x) == tensor_bytes(x)
    assert b.x.untyped_storage().data_ptr() == a.x.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", ["torch.Foo", "numpy.Bar", "s4.view"])
def test_register_type_refuses_reserved_names(name: str) -> None:
    with pytest.raises(ValueError, match="is reserved"):
        s4weights.register_type(name, Point, lambda p: p, lambda v: v)


def test_unregistered_typed_value_strict_and_opaque(point_type: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.BytesIO()
    s4weights.save({"p": Point(torch.arange(3), "lbl")}, buf)
    monkeypatch.delitem(torchtree._CONVERTERS, point_type)
    with pytest.raises(s4weights.UnsupportedObjectError, match=r"'tests\.Point' is not known"):
        s4weights.load(buf.getvalue())
    got = s4weights.load(buf.getvalue(), strict=False)["p"]
    assert type(got) is s4format.Typed and got.name == "tests.Point"
    assert got.value["label"] == "lbl"
    assert tensor_bytes(got.value["x"]) == tensor_bytes(torch.arange(3))
