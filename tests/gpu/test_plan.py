"""Pure planning of the CUDA path (runs without a GPU): groups, chunk and block tables,
workspace sizing, which tensors the GPU splits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from s4format import layouts
from s4weights.gpu import plan


def test_workspace_is_a_tenth_of_the_state_between_4_mib_and_1_gib() -> None:
    assert plan.default_workspace(0) == 4 << 20
    assert plan.default_workspace(40 << 20) == 4 << 20
    assert plan.default_workspace(300 << 20) == 30 << 20
    assert plan.default_workspace(5 << 30) == (5 << 30) // 10
    assert plan.default_workspace(100 << 30) == 1 << 30


def test_a_load_takes_an_eighth_of_the_free_memory_up_to_1_gib() -> None:
    assert plan.default_load_workspace(300 << 20, 0) == 30 << 20
    assert plan.default_load_workspace(300 << 20, 80 << 20) == 30 << 20
    assert plan.default_load_workspace(300 << 20, 800 << 20) == 100 << 20
    assert plan.default_load_workspace(300 << 20, 100 << 30) == 1 << 30
    assert plan.default_load_workspace(20 << 30, 100 << 30) == 1 << 30
    assert plan.default_load_workspace(0, -1) == 4 << 20


def test_groups_keep_order_cover_everything_and_respect_the_bound() -> None:
    need = [10, 10, 10, 100, 5, 5, 1000, 1]
    got = plan.groups_by_need(need, [1] * len(need), workspace=30)
    assert [list(g) for g in got] == [[0, 1, 2], [3], [4, 5], [6], [7]]
    assert plan.groups_by_need([], [], 100) == []


def test_pipelined_groups_count_the_previous_groups_payloads() -> None:
    need, out = [40, 40, 40, 40], [30, 30, 30, 30]
    assert [list(g) for g in plan.groups_by_need(need, out, 100)] == [[0, 1], [2, 3]]
    # the second window also holds the first window's 60 payload bytes: 60 + 40 fits, 60 + 80
    # does not
    got = plan.groups_by_need(need, out, 100, pipelined=True)
    assert [list(g) for g in got] == [[0, 1], [2], [3]]
    for a, b in itertools.pairwise(got):
        assert sum(out[i] for i in a) + sum(need[i] for i in b) <= 100 or len(b) == 1


@pytest.mark.parametrize("lay,isz", [(layouts.BF16, 2), (layouts.FP16, 2), (layouts.FP32, 4)])
def test_encode_need_covers_planes_scratch_and_payloads(lay, isz) -> None:
    nbytes = 1 << 20
    n = nbytes // isz
    planes = len(lay.fields) - 1
    need = plan.encode_need(lay, nbytes, isz)
    # the planes (a byte per element each, sign bits packed), two bytes of rANS scratch per
    # symbol of every plane, the payloads
    assert need >= n // 8 + planes * n + 2 * n * (planes + 1) + nbytes
    assert plan.encode_need(lay, nbytes, isz, gdeflate=True) > need
    assert plan.encode_need(None, 1000, 8) == plan.encode_need(layouts.RAW, 1000, 1) == 1024


def test_gpu_splits_float_dtypes_from_the_writers_threshold() -> None:
    assert plan.gpu_layout("bfloat16", 4096) is layouts.BF16
    assert plan.gpu_layout("float32", 1 << 20) is layouts.FP32
    assert plan.gpu_layout("float16", 4094) is None
    assert plan.gpu_layout("int64", 1 << 20) is None


def test_chunk_table_covers_each_segment_once() -> None:
    seg, first = plan.chunk_table([1, plan.CHUNK_ELEMS, plan.CHUNK_ELEMS + 1, 0])
    assert seg.tolist() == [0, 1, 2, 2]
    assert first.tolist() == [0, 0, 0, plan.CHUNK_ELEMS]


def test_blocks_match_the_spec_block_split() -> None:
    bt = plan.blocks([100, 0, 64, 65], log2_block=5)
    assert bt.first.tolist() == [0, 4, 4, 6, 9]
    assert bt.size == 9
    # CTAs of up to 2 blocks: (plane, first block inside it, blocks)
    plane, within, count = plan.cta_planes(bt.first, warps=2)
    assert plane.tolist() == [0, 0, 2, 3, 3]
    assert within.tolist() == [0, 2, 0, 0, 2]
    assert count.tolist() == [2, 2, 2, 2, 1]


def test_split_copies_tiles_every_op_and_keeps_alignment() -> None:
    rng = np.random.default_rng(7)
    piece = 64
    src = rng.integers(0, 1 << 40, 50).astype(np.uint64)
    dst = rng.integers(0, 1 << 40, 50).astype(np.uint64)
    length = rng.integers(0, 5 * piece, 50).astype(np.uint64)
    length[:3] = [0, piece, piece + 1]
    s, d, n = plan.split_copies(src, dst, length, piece)
    assert (n > 0).all() and (n <= piece).all()
    got = sorted(zip(s.tolist(), d.tolist(), n.tolist()))
    want = []
    for a, b, k in zip(src.tolist(), dst.tolist(), length.tolist()):
        want += [(a + o, b + o, min(piece, k - o)) for o in range(0, k, piece)]
    assert got == sorted(want)
    assert plan.split_copies([1], [2], [piece])[2].tolist() == [piece]


@pytest.mark.parametrize("blocks", [[], [1], [8], [9], [0, 3, 0, 17, 8, 1], [100] * 5])
def test_cta_table_covers_each_plane_with_ctas_of_one_plane(blocks):
    first = np.zeros(len(blocks) + 1, np.int64)
    np.cumsum(blocks, out=first[1:])
    start, count = plan.cta_table(first, warps=8)
    assert start.dtype == np.uint32 and count.dtype == np.uint8
    seen = []
    for s, c in zip(start.tolist(), count.tolist()):
        assert 1 <= c <= 8
        plane = int(np.searchsorted(first, s, side="right")) - 1
        assert s + c <= first[plane + 1]  # never crosses into the next plane
        seen.extend(range(s, s + c))
    assert seen == list(range(int(first[-1])))
    assert start.size == sum((b + 7) // 8 for b in blocks)


def test_large_chunks_fit_the_workspace() -> None:
    from s4format import layouts

    for lay, size in ((layouts.BF16, 2), (layouts.FP16, 2), (layouts.FP32, 4)):
        for rans_planes in range(len(lay.fields) + 1):
            for xor in (False, True):
                for ws, n, lg in itertools.product((4 << 20, 32 << 20, 188 << 20, 1 << 30),
                                                   (1 << 24, 1 << 34), (16, 18, 20)):
                    align = plan.large_align(lg)
                    c = plan.large_chunk(lay, size, ws, n, rans_planes, xor, lg)
                    assert c % align == 0 and c >= align and c % (1 << lg) == 0
                    need = plan.large_need(lay, size, c, rans_planes, xor, lg)
                    digests = 2 * 8 * (n * size // 65536 + 1)
                    # fits, or is the smallest chunk there is
                    assert need + digests <= ws or c == align
                    # and, at the finest alignment, uses most of it (chunks are sized from the
                    # need of the smallest), or one chunk holds the whole tensor
                    if lg == 16:
                        assert need + digests > ws * 3 // 4 or c == align or c >= n
        # a small tensor gets one chunk of its own rounded length, not the workspace's
        assert plan.large_chunk(lay, size, 1 << 30, 3 << 20, 2, False, 16) == 3 << 20
        assert plan.large_chunk(lay, size, 1 << 30, 100_000, 2, False, 16) == 2 << 16
        # the smallest default workspace holds chunks of the finest alignment
        assert plan.large_need(lay, size, plan.large_align(16), len(lay.fields), True, 16) \
            < plan.MIN_WORKSPACE // 3


def test_large_staging_holds_a_slot_per_symbol_of_every_rans_plane() -> None:
    assert plan.large_staging(1 << 20, 0) == 0
    assert plan.large_staging(1 << 20, 2) == 2 << 20  # a byte per symbol
    assert plan.large_staging(1 << 20, 2, slot=2) == 4 << 20  # the most blocks write
    assert plan.large_staging(1000, 1) == 1024  # device buffers are 256-byte aligned
    # the wider slot costs memory, so those chunks are shorter
    for lay, size in ((plan.layouts.BF16, 2), (plan.layouts.FP32, 4)):
        one = plan.large_chunk(lay, size, 64 << 20, 1 << 30, 3, False, 16)
        two = plan.large_chunk(lay, size, 64 << 20, 1 << 30, 3, False, 16, slot=2)
        assert two < one


