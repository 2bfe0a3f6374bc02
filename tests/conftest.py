"""Fixtures for the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The suite runs numba's kernels, whatever this machine has built ahead of time, so that it
# tests the same code everywhere; tests/format/test_kernels_built.py tests the built ones
# (S4_KERNELS=built runs the whole suite on this machine's built kernels).
os.environ.setdefault("S4_KERNELS", "jit")


@pytest.fixture(scope="session", autouse=True)
def _chains_without_read_budget() -> Iterator[float | None]:
    """Most chain tests save training states whose deltas are nearly as large as a full save,
    which the default read budget would turn into bases; they test chains, so they lift it
    (from the start of the session: module-scoped fixtures save chains too). Yields the
    default."""
    from s4weights import chainpolicy

    default = chainpolicy.READ_BUDGET
    chainpolicy.READ_BUDGET = None
    yield default
    chainpolicy.READ_BUDGET = default


@pytest.fixture(autouse=True)
def _read_budget_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                              _chains_without_read_budget: float | None) -> None:
    """Tests marked ``read_budget`` keep the default (tests/weights/test_chain_policy.py)."""
    if request.node.get_closest_marker("read_budget") is not None:
        from s4weights import chainpolicy

        monkeypatch.setattr(chainpolicy, "READ_BUDGET", _chains_without_read_budget)


@pytest.fixture(scope="session", autouse=True)
def _small_deltas_kept() -> Iterator[int]:
    """The suite's states are small (tensors of a few hundred bytes to a few KiB, to keep it
    fast), and their deltas save fewer bytes than the writer's DELTA_MIN_SAVED, which would
    store them whole; the chain tests are about deltas, so the bar is lowered to none (from
    the start of the session, as for the read budget). Yields the default."""
    from s4format import writer

    default = writer.DELTA_MIN_SAVED
    writer.DELTA_MIN_SAVED = 0
    yield default
    writer.DELTA_MIN_SAVED = default


@pytest.fixture(autouse=True)
def _delta_min_saved_where_marked(request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch,
                                  _small_deltas_kept: int) -> None:
    """Tests marked ``delta_min_saved`` keep the writer's default (tests/format/
    test_delta_rough.py)."""
    if request.node.get_closest_marker("delta_min_saved") is not None:
        from s4format import writer

        monkeypatch.setattr(writer, "DELTA_MIN_SAVED", _small_deltas_kept)
