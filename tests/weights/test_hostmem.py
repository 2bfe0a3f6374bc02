"""s4weights.hostmem: the snapshot buffers kept between checkpoint saves are handed out again
only when they fit and nothing refers to them; without CUDA nothing is page-locked (the GPU
side, registration and copies, is in tests/gpu/test_gpu_snapshot.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from s4weights import chain, hostmem

KEY = "dev"


@pytest.fixture(autouse=True)
def _clean():
    hostmem.forget()
    yield
    hostmem.forget()


def _kept(n: int = 1000) -> int:
    """Keep a new buffer of ``n`` bytes that nothing else refers to; its address."""
    buf = np.zeros(n, np.uint8)
    hostmem.keep(KEY, buf)
    return buf.ctypes.data


def test_a_kept_buffer_is_handed_out_once_for_a_size_it_fits() -> None:
    at = _kept()
    assert hostmem.take("other", 1000) is None
    got = hostmem.take(KEY, 900)  # 100 bytes to spare: within 1/8
    assert got is not None and got.ctypes.data == at and got.size == 1000
    assert hostmem.take(KEY, 900) is None  # taken: not handed out twice


@pytest.mark.parametrize("nbytes", [1001, 800, 0])
def test_a_kept_buffer_that_does_not_fit_is_let_go(nbytes: int) -> None:
    _kept()
    assert hostmem.take(KEY, nbytes) is None
    assert hostmem.take(KEY, 1000) is None  # let go, not kept for a later fit


def test_a_kept_buffer_still_viewed_is_not_handed_out() -> None:
    # a snapshot's tensors are views of its buffer: while one lives (a caller still reading a
    # parent), the buffer must not be overwritten by the next snapshot
    buf = np.zeros(1000, np.uint8)
    view = buf[10:20]
    hostmem.keep(KEY, buf)
    del buf
    assert hostmem.take(KEY, 1000) is None
    del view


def test_a_view_through_torch_counts_too() -> None:
    buf = np.zeros(1000, np.uint8)
    t = torch.from_numpy(buf[:100])
    hostmem.keep(KEY, buf)
    del buf
    assert hostmem.take(KEY, 1000) is None
    del t


def test_keep_replaces_and_forget_drops() -> None:
    _kept()
    at = _kept()
    got = hostmem.take(KEY, 1000)
    assert got is not None and got.ctypes.data == at
    hostmem.keep(KEY, got)
    del got
    hostmem.forget()
    assert hostmem.take(KEY, 1000) is None


def test_nothing_is_page_locked_without_cuda(caplog) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/gpu/test_gpu_snapshot.py")
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        assert hostmem.page_locked(1 << 20) is None
    assert "could not be page-locked" in caplog.text
    assert not hostmem.is_page_locked(np.zeros(10, np.uint8))


def test_a_replaced_parent_keeps_its_buffers_for_the_next_snapshot() -> None:
    # save_checkpoint's cache: when a save replaces the parent (or retention drops it), the
    # old parent's page-locked buffers become the next snapshot's, one per device
    url = "file:///nowhere"
    dev = torch.device("cuda", 0)
    old = np.zeros(1000, np.uint8)
    at = old.ctypes.data
    try:
        chain._cache(url, ("a", {}, {}, {dev: old}))
        del old
        assert hostmem.take(dev, 1000) is None
        chain._cache(url, ("b", {}, {}, {}))
        assert chain._PARENT_CACHE[url][0] == "b"
        got = hostmem.take(dev, 1000)
        assert got is not None and got.ctypes.data == at
        chain._cache(url, None)
        assert url not in chain._PARENT_CACHE
    finally:
        chain._PARENT_CACHE.pop(url, None)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4097, 3 * (1 << 20) + 7])
def test_a_populated_mapping_is_zeroed_at_its_exact_size(nbytes: int) -> None:
    # its pages are written by several threads, in page-aligned parts
    arr = hostmem.populated(nbytes).result()
    assert arr.dtype == np.uint8 and arr.size == max(1, nbytes) and arr.flags.writeable
    assert not arr.any()
    arr[:] = 7  # writable to the last byte
    assert int(arr[-1]) == 7


def test_a_buffer_the_new_parent_took_over_is_not_kept_as_well() -> None:
    # a save on the GPU path writes its snapshot into the replaced one's buffer: that buffer
    # is the new parent's, not a spare
    url = "file:///nowhere"
    dev = torch.device("cuda", 0)
    buf = np.zeros(1000, np.uint8)
    try:
        chain._cache(url, ("a", {}, {}, {dev: buf}))
        chain._cache(url, ("b", {}, {}, {dev: buf}))
        assert not hostmem._KEPT
    finally:
        chain._PARENT_CACHE.pop(url, None)


@pytest.mark.parametrize("size,nbytes,ok", [(1000, 1000, True), (1000, 889, True),
                                            (1000, 888, False), (1000, 1001, False)])
def test_fits(size: int, nbytes: int, ok: bool) -> None:
    assert hostmem.fits(np.zeros(size, np.uint8), nbytes) is ok
