"""Bit-exact round trips through a file: every dtype, every bf16/fp16 bit pattern, adversarial
fp32 values, degenerate shapes and strides, and tensors large enough to split into planes and to
span several hash leaves."""

from __future__ import annotations

import numpy as np
import pytest

import s4format
from s4format import Reader, Tensor, Writer, dtypes, hashing, layouts
from s4format.writer import SPLIT_MIN
from tests.format.common import POLICIES, assert_same_tree, read_everything, small_file, small_tree

NUMPY_BACKED = [d for d in dtypes.BY_NAME.values()
                if d.name not in ("bfloat16", "complex32") and not d.name.startswith("float8")
                and not d.name.startswith("float4")]
BITS_ONLY = [d for d in dtypes.BY_NAME.values() if d not in NUMPY_BACKED]


def _write_read(tmp_path, tensors: dict[str, Tensor | np.ndarray], **kwargs) -> dict[str, Tensor]:
    path = tmp_path / "t.s4w"
    with Writer(path, **kwargs) as w:
        for name, t in tensors.items():
            w.add(name, t)
    with Reader(path) as r:
        assert s4format.verify(r) == []
        return {t.name: r.read(t.name) for t in r.tensors}


def _random_array(d: dtypes.DType, n: int, rng: np.random.Generator) -> np.ndarray:
    if d.kind == "bool":
        return rng.random(n) < 0.5
    bits = rng.integers(0, 256, n * d.itemsize, dtype=np.uint8)
    return bits.view(np.dtype(d.numpy))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", [1, 7, 4096 + 3])
def test_every_numpy_dtype_round_trips(tmp_path, policy: str, n: int) -> None:
    rng = np.random.default_rng(n)
    arrays = {d.name: _random_array(d, n, rng) for d in NUMPY_BACKED}
    got = _write_read(tmp_path, arrays, policy=policy)
    for name, a in arrays.items():
        assert got[name].dtype.name == name
        assert got[name].shape == (n,)
        assert got[name].data.tobytes() == a.tobytes()
        back = got[name].to_numpy()
        assert back.dtype == a.dtype and back.tobytes() == a.tobytes()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", [1, 5, 8192 + 1])
def test_every_bits_only_dtype_round_trips(tmp_path, policy: str, n: int) -> None:
    rng = np.random.default_rng(n)
    tensors = {}
    for d in BITS_ONLY:
        bits = rng.integers(0, 256, n * d.itemsize, dtype=np.uint8).view(np.dtype(d.numpy))
        tensors[d.name] = Tensor.from_numpy(bits.reshape(n, 1), dtype=d.name)
    got = _write_read(tmp_path, tensors, policy=policy)
    assert set(got) == {d.name for d in BITS_ONLY}
    for name, t in tensors.items():
        assert got[name].dtype is dtypes.by_name(name)
        assert got[name].shape == (n, 1)
        assert got[name].data.tobytes() == t.data.tobytes()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_all_16_bit_patterns(tmp_path, policy: str, dtype: str) -> None:
    every = np.arange(1 << 16, dtype="<u2")
    shuffled = np.random.default_rng(1).permutation(every)
    tensors = {"ordered": Tensor.from_numpy(every, dtype=dtype),
               "shuffled": Tensor.from_numpy(shuffled, dtype=dtype),
               "grid": Tensor.from_numpy(shuffled.reshape(256, 256), dtype=dtype)}
    got = _write_read(tmp_path, tensors, policy=policy)
    for name, t in tensors.items():
        assert got[name].dtype.name == dtype and got[name].shape == t.shape
        assert got[name].data.tobytes() == t.data.tobytes(), name


def _fp32_adversarial() -> np.ndarray:
    rng = np.random.default_rng(32)
    payloads = np.concatenate([np.arange(1, 4096, dtype="<u4"),
                               rng.integers(1, 1 << 22, 4096, dtype="<u4"),
                               np.array([1, (1 << 22) - 1], dtype="<u4")])
    quiet = 0x7FC00000 | (payloads & 0x3FFFFF)
    signalling = 0x7F800000 | (payloads & 0x3FFFFF)  # quiet bit clear, payload non-zero
    specials = np.array([
        0x7F800000, 0xFF800000,  # +-inf
        0x00000000, 0x80000000,  # +-0
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # smallest/largest subnormal
        0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF,  # smallest/largest normal
        0x3F800000, 0xBF800000], dtype="<u4")
    bits = np.concatenate([quiet, quiet | 0x80000000, signalling, signalling | 0x80000000,
                           specials, rng.integers(0, 1 << 32, 20000, dtype="<u4")])
    return bits


@pytest.mark.parametrize("policy", POLICIES)
def test_fp32_adversarial_bit_patterns(tmp_path, policy: str) -> None:
    bits = _fp32_adversarial()
    assert bits.nbytes >= SPLIT_MIN
    tensors = {"as_float32": bits.view("<f4"),
               "as_bits": Tensor.from_numpy(bits, dtype="float32"),
               "specials_only": bits[-20014:-20000].view("<f4")}
    got = _write_read(tmp_path, tensors, policy=policy)
    for name, t in tensors.items():
        want = t.data.tobytes() if isinstance(t, Tensor) else t.tobytes()
        assert got[name].data.tobytes() == want, name
    # The NaNs came back as NaNs with their payload and sign bits, not canonicalised.
    assert np.array_equal(got["as_float32"].to_numpy().view("<u4"), bits)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (0, 0), (1,), (1, 1, 1, 1)])
@pytest.mark.parametrize("dtype", ["<f4", "<i2", "|b1", "<c16", "<f2"])
def test_degenerate_shapes(tmp_path, shape: tuple[int, ...], dtype: str) -> None:
    a = (np.arange(int(np.prod(shape)), dtype="<i8") % 2).astype(dtype).reshape(shape)
    got = _write_read(tmp_path, {"x": a})["x"]
    assert got.shape == shape
    assert got.to_numpy().shape == shape
    assert got.data.tobytes() == a.tobytes()


def test_non_contiguous_and_big_endian_arrays(tmp_path) -> None:
    rng = np.random.default_rng(3)
    base = rng.standard_normal((64, 96))
    arrays = {
        "transposed": base.T,
        "strided": base[::3, ::-2],
        "big_endian_f8": base.astype(">f8"),
        "big_endian_f4_strided": base.astype(">f4")[::2, 1::5],
        "big_endian_i4": rng.integers(-(2**31), 2**31, (33, 7)).astype(">i4"),
        "big_endian_c8": (base + 1j * base[::-1]).astype(">c8"),
        "fortran": np.asfortranarray(base.astype("<f2")),
    }
    got = _write_read(tmp_path, arrays)
    for name, a in arrays.items():
        assert got[name].shape == a.shape, name
        want = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"))
        assert got[name].data.tobytes() == want.tobytes(), name
        assert np.array_equal(got[name].to_numpy(), a, equal_nan=True), name


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", ["<f4", "<f2", "<i8", "|u1"])
def test_large_tensors_split_and_span_hash_leaves(tmp_path, policy: str, dtype: str) -> None:
    rng = np.random.default_rng(11)
    n = (5 * hashing.LEAF_SIZE + 123) // np.dtype(dtype).itemsize  # > 5 leaves, odd tail
    a = (rng.standard_normal(n) * 1000).astype(dtype)
    path = tmp_path / "big.s4w"
    s4format.write(path, {"a": a}, policy=policy)
    with Reader(path) as r:
        t = r.tensors[0]
        assert t.raw_nbytes > 5 * hashing.LEAF_SIZE
        assert t.layout is layouts.preferred(t.dtype.name, t.dtype.itemsize) or \
            t.layout is layouts.RAW
        got = r.read("a")
        assert s4format.verify(r) == []
    assert got.data.tobytes() == a.tobytes()
    assert hashing.content_hash(got.data) == t.content_hash


def test_split_threshold_boundary(tmp_path) -> None:
    # Normally distributed fp32 compresses when split: just below the threshold stays one raw
    # plane, at the threshold it becomes the five fp32 planes.
    rng = np.random.default_rng(5)
    below = rng.standard_normal(SPLIT_MIN // 4 - 1).astype("<f4")
    at = rng.standard_normal(SPLIT_MIN // 4).astype("<f4")
    path = tmp_path / "t.s4w"
    s4format.write(path, {"below": below, "at": at})
    with Reader(path) as r:
        layout = {t.name: t.layout for t in r.tensors}
        assert layout["below"] is layouts.RAW
        assert layout["at"] is layouts.FP32
        assert [p.label for p in r.tensors[r.index_of("at")].planes] == \
            ["sign", "exponent", "mantissa0", "mantissa1", "mantissa2"]
        assert r.read("below").data.tobytes() == below.tobytes()
        assert r.read("at").data.tobytes() == at.tobytes()


def test_small_file_tree_round_trips_from_path_and_bytes(tmp_path) -> None:
    blob = small_file()
    path = tmp_path / "small.s4w"
    path.write_bytes(blob)
    for source in (path, str(path), blob, bytearray(blob), memoryview(blob)):
        with Reader(source) as r:
            assert_same_tree(r.load(), small_tree())
            assert r.metadata == {"framework": "test"}
    read_everything(path)


def test_write_to_path_and_dumps_give_the_same_bytes(tmp_path) -> None:
    path = tmp_path / "a.s4w"
    result = s4format.write(path, small_tree(), metadata={"framework": "test"})
    assert path.read_bytes() == small_file()
    assert result.file_size == len(small_file())
    assert result.tensor_count == 4
    with Reader(path) as r:
        assert result.checkpoint_id == r.checkpoint_id
        assert result.raw_nbytes == sum(t.raw_nbytes for t in r.tensors)
        assert result.stored_nbytes == sum(t.stored_nbytes for t in r.tensors)


def test_shared_array_is_stored_once_and_loaded_as_one_tensor() -> None:
    a = np.arange(10, dtype="<i4")
    with Reader(s4format.dumps({"x": a, "y": [a, a]})) as r:
        assert len(r.tensors) == 1
        tree = r.load()
    assert tree["x"] is tree["y"][0] is tree["y"][1]
    assert tree["x"].data.tobytes() == a.tobytes()


def test_writer_is_deterministic() -> None:
    assert small_file() == small_file()
