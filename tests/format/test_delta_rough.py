"""Choosing between a tensor alone and its delta without counting both: a sample of both
decides where most words changed, a delta is kept only where it pays (writer.DELTA_PAYS), and
a delta far smaller than the sample says the tensor alone would store is kept without
estimating the tensor alone exactly."""

from __future__ import annotations

import io

import numpy as np
import pytest

from s4format import Reader, Tensor, Writer, layouts, policy, writer
from s4format.dtypes import BY_NAME
from s4format.writer import WriteResult

N = 1 << 20


def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype("<f4").view("<u4") >> 16).astype("<u2").view(np.uint8)


def _weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.02, N)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_rough_estimate_is_close_to_the_exact_one_on_weights(dtype: str) -> None:
    w = _weights(1)
    raw = _bf16(w) if dtype == "bfloat16" else w.astype("<f4").view(np.uint8)
    rough = writer.estimate_rough(raw, BY_NAME[dtype])
    exact = writer.estimate_tensor(raw, BY_NAME[dtype])[0]
    assert rough is not None and abs(rough - exact) <= 0.03 * exact


def test_a_plane_the_lz_coders_may_shrink_gives_no_rough_estimate() -> None:
    w = _weights(2)
    w[N // 4:N // 2] = 0.25  # a quarter of the values: one run, which zstd shrinks
    assert writer.estimate_rough(_bf16(w), BY_NAME["bfloat16"]) is None
    assert writer.estimate_rough(np.zeros(100, np.uint8), BY_NAME["uint8"]) is None


def _tensor(raw: np.ndarray) -> Tensor:
    return Tensor(BY_NAME["bfloat16"], (raw.size // 2,), raw)


def _save(tensors: dict[str, np.ndarray], parents: dict[str, np.ndarray] | None = None,
          parent_id: bytes | None = None) -> tuple[bytes, WriteResult]:
    buf = io.BytesIO()
    with Writer(buf, parent_id=parent_id) as w:
        for name, raw in tensors.items():
            w.add(name, _tensor(raw), parent=None if parents is None else _tensor(parents[name]))
        result = w.close()
    return buf.getvalue(), result


def _exact_estimates_of(monkeypatch) -> list[int]:
    """The sizes of the tensors that the writer estimates exactly, recorded as it goes."""
    seen: list[int] = []
    exact = writer.estimate_tensor

    def spy(raw, dtype, policy_name="auto"):
        seen.append(raw.size)
        return exact(raw, dtype, policy_name)

    monkeypatch.setattr(writer, "estimate_tensor", spy)
    return seen


def test_a_small_delta_is_kept_without_the_exact_estimate_of_the_tensor_alone(
        monkeypatch) -> None:
    base = _weights(3)
    child = base.copy()
    child[np.random.default_rng(4).choice(N, N // 100, replace=False)] *= 1.001
    parent_blob, parent_result = _save({"w": _bf16(base)})
    seen = _exact_estimates_of(monkeypatch)
    blob, result = _save({"w": _bf16(child)}, {"w": _bf16(base)}, parent_result.checkpoint_id)
    assert seen == []  # the delta is masked (estimated by masked_form), the tensor alone
    # is estimated from the sample of both
    assert result.delta_count == 1
    pair = writer.estimate_pair(_bf16(child), _bf16(base), BY_NAME["bfloat16"])
    assert pair is not None and pair.changed < 0.05
    assert result.full_stored_nbytes == pair.alone
    exact = writer.estimate_tensor(_bf16(child), BY_NAME["bfloat16"])[0]
    assert abs(pair.alone / exact - 1) < 0.02
    with Reader(blob, parent=Reader(parent_blob)) as r:
        assert r.read_raw(0).tobytes() == _bf16(child).tobytes()


def test_a_masked_delta_samples_the_tensor_alone_only(monkeypatch) -> None:
    # a glance finds few words changed: the masked form is found from both tensors and the
    # tensor alone is sampled, not the delta too
    base = _weights(11)
    child = base.copy()
    child[np.random.default_rng(12).choice(N, N // 10, replace=False)] *= 1.001
    parent_blob, parent_result = _save({"w": _bf16(base)})
    parents_seen: list = []
    real = writer.estimate_pair
    monkeypatch.setattr(writer, "estimate_pair", lambda raw, parent, dtype: parents_seen.append(
        parent) or real(raw, parent, dtype))
    xors = _spy(monkeypatch, "_xor")
    blob, result = _save({"w": _bf16(child)}, {"w": _bf16(base)}, parent_result.checkpoint_id)
    assert parents_seen == [None] and xors == []
    assert result.delta_count == 1
    assert result.full_stored_nbytes == real(_bf16(child), None, BY_NAME["bfloat16"]).alone
    with Reader(blob, parent=Reader(parent_blob)) as r:
        assert r.tensors[0].masked and r.read_raw(0).tobytes() == _bf16(child).tobytes()


def test_the_glance_judges_the_share_of_words_changed() -> None:
    base = _bf16(_weights(13))
    bf16 = BY_NAME["bfloat16"]
    for share in (0.0, 0.1, 0.3, 0.6, 1.0):
        child = base.view("<u2").copy()
        at = np.random.default_rng(14).random(child.size) < share
        child[at] ^= 1
        glance = writer.changed_glance(child.view(np.uint8), base, bf16)
        assert abs(glance - share) < 0.03, (share, glance)
    # 16-byte words (complex128, split by bytes): the masked kernels take none
    c128 = np.zeros(1 << 12, np.uint8)
    assert writer.changed_glance(c128, c128, BY_NAME["complex128"]) == 1.0


def test_a_delta_past_the_glance_is_not_looked_at_for_a_masked_form(monkeypatch) -> None:
    # most words changed, by one bit each: no masked form is looked for, yet the delta pays
    base = _bf16(_weights(15))
    child = base.view("<u2") ^ np.uint16(1)
    parent_blob, parent_result = _save({"w": base})
    masks = _spy(monkeypatch, "masked_form")
    blob, result = _save({"w": child.view(np.uint8)}, {"w": base}, parent_result.checkpoint_id)
    assert masks == [] and result.delta_count == 1
    with Reader(blob, parent=Reader(parent_blob)) as r:
        assert not r.tensors[0].masked and r.read_raw(0).tobytes() == child.tobytes()


def _spy(monkeypatch, name: str) -> list:
    calls: list = []
    real = getattr(writer, name)
    monkeypatch.setattr(writer, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_tensor_whose_delta_does_not_pay_is_coded_alone_without_making_the_delta(
        monkeypatch) -> None:
    base, child = _weights(5), _weights(6)  # unrelated: the delta is no smaller
    _blob, parent_result = _save({"w": _bf16(base)})
    seen = _exact_estimates_of(monkeypatch)
    xors, masks = _spy(monkeypatch, "_xor"), _spy(monkeypatch, "masked_form")
    _blob, result = _save({"w": _bf16(child)}, {"w": _bf16(base)}, parent_result.checkpoint_id)
    # the sample of both decided: no XOR made, no plane counted but by the coder's own pass
    assert seen == [] and xors == [] and masks == []
    assert result.delta_count == 0
    alone, _ = _save({"w": _bf16(child)})
    assert result.stored_nbytes == result.full_stored_nbytes
    with Reader(alone) as r:
        assert r.tensors[0].stored_nbytes == result.stored_nbytes


def test_a_delta_that_saves_too_little_is_not_kept(monkeypatch) -> None:
    # every word's low mantissa bits moved: the delta stores far less than the tensor alone,
    # and is kept; with the bar set below that share it is not
    base = _weights(8).astype("<f4")
    child = base.view("<u4") ^ np.random.default_rng(9).integers(1, 4, N, dtype="<u4")
    raw, parent = child.view(np.uint8), base.view(np.uint8)
    f32 = BY_NAME["float32"]
    pair = writer.estimate_pair(raw, parent, f32)
    exact = writer.estimate_tensor(raw ^ parent, f32)[0] / writer.estimate_tensor(raw, f32)[0]
    assert pair is not None and pair.changed == 1.0
    assert abs(pair.delta / pair.alone - exact) < 0.02 and exact < 0.5

    def save(bar: float) -> WriteResult:
        monkeypatch.setattr(writer, "DELTA_PAYS", bar)
        buf = io.BytesIO()
        with Writer(buf, parent_id=b"\x01" * 16) as w:
            w.add("w", Tensor(f32, (N,), raw), parent=Tensor(f32, (N,), parent))
            return w.close()

    assert save(0.9).delta_count == 1
    xors = _spy(monkeypatch, "_xor")
    result = save(exact / 2)
    assert result.delta_count == 0 and xors == []


def test_the_pair_is_left_to_the_exact_estimates_for_a_tensor_its_sample_covers() -> None:
    small = _bf16(_weights(10)[:writer.PAIR_CHUNKS * writer.PAIR_CHUNK])
    assert writer.estimate_pair(small, small, BY_NAME["bfloat16"]) is None
    larger = _bf16(_weights(10)[:writer.PAIR_CHUNKS * writer.PAIR_CHUNK + 1])
    assert writer.estimate_pair(larger, larger, BY_NAME["bfloat16"]) is not None
    raw = np.zeros(1 << 20, np.uint8)  # stored whole: not split
    assert writer.estimate_pair(raw, raw, BY_NAME["uint8"]) is None


@pytest.mark.delta_min_saved
def test_delta_pays_below_its_share_of_the_tensor_alone() -> None:
    assert writer.delta_share_pays(89, 100) and not writer.delta_share_pays(90, 100)
    assert not writer.delta_share_pays(0, 0)
    big = 100 * writer.DELTA_MIN_SAVED
    assert writer.delta_pays(89 * big // 100, big) and not writer.delta_pays(90 * big // 100, big)


@pytest.mark.delta_min_saved
def test_a_delta_saves_at_least_its_fixed_bytes() -> None:
    least = writer.DELTA_MIN_SAVED
    assert writer.delta_pays(0, least) and not writer.delta_pays(1, least)
    assert not writer.delta_pays(0, least - 1)  # (the share alone would keep it)
    assert writer.delta_share_pays(0, least - 1)


def test_the_rough_estimate_counts_no_plane() -> None:
    view = layouts.BF16.views(_bf16(_weights(7)), 2, count=False)[1]
    assert policy.rough_estimate(view, layouts.KIND_EXPONENT) > 0
    assert not view.counted  # judged from the sample alone


def test_a_small_tensor_is_coded_from_its_estimate_without_coding_it_again(monkeypatch) -> None:
    # a bias of 1 KiB is one raw plane whose estimate is its zstd encoding: the coder takes
    # the plane's view, encoding and all, as the estimate left it
    from s4format import codecs

    raw = _bf16(_weights(3)[:512])
    bf16 = BY_NAME["bfloat16"]
    zstd = codecs.get(codecs.ZSTD)
    calls = []
    real = type(zstd).encode
    monkeypatch.setattr(type(zstd), "encode", lambda self, p: calls.append(1) or real(self, p))
    est, views = writer.estimate_tensor(raw, bf16)
    coded = writer.code_tensor(raw, bf16, "auto", views)
    assert len(views) == 1 and len(calls) == 1
    again = writer.code_tensor(raw, bf16, "auto")
    assert [(p.codec, bytes(p.payload)) for p in coded.planes] == \
        [(p.codec, bytes(p.payload)) for p in again.planes]
    assert coded.stored == est and coded.layout is layouts.RAW


@pytest.mark.delta_min_saved
def test_a_tensor_too_small_to_save_the_fixed_bytes_is_stored_whole(monkeypatch) -> None:
    # a bias of 2 KiB whose delta would store a fraction of it: whole, its delta never made;
    # 8 KiB of the same (a delta saving more than DELTA_MIN_SAVED) stays a delta
    def pair(n: int) -> tuple[np.ndarray, np.ndarray]:
        base = _bf16(_weights(11)[:n])
        child = base.view("<u2").copy()
        child[::7] ^= 1  # (one word in seven moves by its last bit)
        return child.view(np.uint8), base
    small, small_base = pair(1024)
    large, large_base = pair(4096)
    xors = _spy(monkeypatch, "_xor")
    _blob, result = _save({"bias": small}, {"bias": small_base}, b"\x01" * 16)
    assert result.delta_count == 0 and xors == []
    assert result.stored_nbytes == result.full_stored_nbytes
    _blob, result = _save({"w": large}, {"w": large_base}, b"\x01" * 16)
    assert result.delta_count == 1
    assert result.full_stored_nbytes - result.stored_nbytes >= writer.DELTA_MIN_SAVED
    # with no fixed bytes to save, the small one's delta pays by its share
    monkeypatch.setattr(writer, "DELTA_MIN_SAVED", 0)
    _blob, result = _save({"bias": small}, {"bias": small_base}, b"\x01" * 16)
    assert result.delta_count == 1
