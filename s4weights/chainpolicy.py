"""When a checkpoint is saved as a delta and when it starts a new base, and why.

A chain pays only while loading its newest step reads little more than one full save would: a
delta is written only if the files of its chain plus the delta's estimated size stay within
``read_budget`` times a full save. The delta's size is estimated on windows of the state (1/64
of it, at most 4 MiB, spread over its tensors), by the codecs' estimates of each window's
planes whole and as the XOR against the parent (as the writer chooses, without coding them);
or, where the latest delta on the same base leaves room for :data:`GROWTH` times its size, not
estimated but checked on the delta as coded (a delta over the budget is then saved again as a
base).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

import s4format
from s4format.policy import POLICIES
from s4format.writer import delta_pays, delta_share_pays, estimate_tensor

if TYPE_CHECKING:
    from s4weights.manifests import CheckpointInfo
    from s4weights.torchtree import DeviceTensor

# Loading the newest step of a chain may read this many full saves' bytes, by default.
READ_BUDGET: float | None = 1.5
# Bytes of the state estimated twice: this share of it, within these bounds.
SAMPLE_SHARE, SAMPLE_MIN, SAMPLE_MAX = 1 / 64, 256 << 10, 4 << 20
# The smallest window: each costs a fixed ~0.1 ms per plane to estimate, so fewer, larger
# windows keep the estimate at a few percent of the save.
WINDOW = 64 << 10
WINDOWS = 4  # at most, per tensor large enough, spread over it


# What a delta is taken against, by default: the base of the latest checkpoint, so that every
# step loads from two files at most (the deltas of a fine-tuning run store less that way too:
# the words that change from the base are much the same set from one save to the next).
DELTA_AGAINST = "base"
DELTA_TARGETS = ("base", "latest")


def reason_without_parent(latest: CheckpointInfo | None, step: int, *, delta: bool,
                          keyframe_interval: int, min_delta_gain: float,
                          on_base: int | None = None) -> str | None:
    """Why checkpoint ``step`` cannot be a delta of ``latest`` (or of its base), or None when
    it can. ``on_base``: the saves on the latest's base up to it, itself included, as its
    manifest records them (deltas against the base; :func:`manifests.saves_on`); None: the
    files of the latest's chain (deltas against the latest)."""
    if latest is None:
        return "first checkpoint of the run"
    if not delta:
        return "saved with delta=False"
    if latest.step >= step:
        return f"not after the latest step {latest.step}"
    if (latest.depth + 1 if on_base is None else on_base) + 1 > keyframe_interval:
        return f"keyframe_interval={keyframe_interval} reached"
    if not latest.is_base and latest.stored_bytes > (1.0 - min_delta_gain) * \
            latest.full_stored_bytes:
        return (f"the delta of step {latest.step} saved less than {min_delta_gain:.0%} of a "
                "full save")
    return None


def over_budget(chain: Sequence[CheckpointInfo], tensors: Sequence[tuple[str, object]],
                parents: Mapping[str, s4format.Tensor], read_budget: float,
                policy: str) -> tuple[str | None, dict[str, int]]:
    """Why a delta of ``chain[-1]`` would make loading it read more than ``read_budget`` full
    saves, or None when it fits; and :attr:`Sample.alone` of the sample that says so."""
    s = sample(tensors, parents, policy)
    why = over_budget_share(s.delta / s.full if s.full else 0.0, chain_share(chain),
                            read_budget)
    return why, s.alone


def chain_share(chain: Sequence[CheckpointInfo]) -> float:
    """The bytes of ``chain``'s files, in full saves (estimated from its newest checkpoint)."""
    full = _full_file(chain[-1])
    return sum(i.file_bytes for i in chain) / full if full > 0 else float("inf")


# A delta is expected to store at most this many times what the latest delta on the same base
# stored. Where that keeps it within the read budget, the budget is not sampled before the save
# but checked on the delta as coded (:func:`clear_by_latest`). (bench/checkpoints.py's CPU
# fine-tuning chain, 2026-12-06: each delta against the base stored at most 1.3 times the one
# before, and the sample took 1.1-1.4 ms of a 23 ms save.)
GROWTH = 2.0


def clear_by_latest(chain: Sequence[CheckpointInfo], latest: CheckpointInfo | None,
                    read_budget: float) -> bool:
    """Whether a delta of ``chain``'s last checkpoint is taken to fit the budget without
    sampling it: ``latest`` (the run's latest checkpoint) is a delta on the same base, and
    :data:`GROWTH` times its own share of a full save fits."""
    if latest is None or latest.is_base or latest.base_step != chain[0].step:
        return False
    return chain_share(chain) + GROWTH * own_share(latest) <= read_budget


def own_share(info: CheckpointInfo) -> float:
    """The bytes of ``info``'s file, in full saves of its state."""
    full = _full_file(info)
    return info.file_bytes / full if full > 0 else float("inf")


def _full_file(info: CheckpointInfo) -> int:
    """The bytes a file of ``info``'s state stored whole would take (its tensors' full stored
    bytes and the rest of its file)."""
    return info.full_stored_bytes + (info.file_bytes - info.stored_bytes)


def over_budget_share(delta: float, held: float, read_budget: float) -> str | None:
    """Why a delta of ``delta`` full saves on a chain of ``held`` full saves exceeds the budget,
    or None."""
    if held + delta <= read_budget:
        return None
    return (f"read budget: as a delta, loading it would read {held + delta:.2f} full saves "
            f"(read_budget={read_budget})")


class Sample(NamedTuple):
    full: int  # estimated stored bytes of the windows coded whole
    delta: int  # ... and as deltas against the parents where that codes smaller
    # Each tensor with windows of its own, what it would store coded whole, scaled from them:
    # the writer's figure to compare the delta with, which it need not estimate again.
    alone: dict[str, int]


def sample(tensors: Sequence[tuple[str, object]], parents: Mapping[str, s4format.Tensor],
           policy: str) -> Sample:
    """The estimates of windows of ``tensors``, whole and as deltas against ``parents``."""
    policy = policy if policy in POLICIES else "auto"
    full = delta = 0
    alone_of: dict[str, int] = {}
    for name, t, spans in _sample(tensors):
        parent = parents.get(name)
        dtype = t.dtype  # type: ignore[attr-defined]
        mine_total = 0
        for at, length in spans:
            mine = _window(t, at, length)
            alone = estimate_tensor(mine, dtype, policy)[0]
            mine_total += alone
            if parent is not None and parent.nbytes == _nbytes(t):
                theirs = np.asarray(parent.data).reshape(-1).view(np.uint8)[at:at + length]
                est = estimate_tensor(mine ^ theirs, dtype, policy)[0]
                # (a window of the whole tensor is judged as the writer judges the tensor)
                pays = delta_pays if length == _nbytes(t) else delta_share_pays
                delta += est if pays(est, alone) else alone
            else:
                delta += alone
        full += mine_total
        covered = sum(length for _at, length in spans)
        if covered:
            alone_of[name] = mine_total * _nbytes(t) // covered
    return Sample(full, delta, alone_of)


def sample_sizes(tensors: Sequence[tuple[str, object]], parents: Mapping[str, s4format.Tensor],
                 policy: str) -> tuple[int, int]:
    """Estimated stored bytes of windows of the tensors coded whole, and as deltas against
    ``parents`` where that codes smaller (each tensor stores the smaller)."""
    s = sample(tensors, parents, policy)
    return s.full, s.delta


def _sample(tensors: Sequence[tuple[str, object]]
            ) -> Iterator[tuple[str, object, list[tuple[int, int]]]]:
    """The windows to estimate, as (start, length) per tensor: each tensor's share of the
    sample in up to WINDOWS windows of at least WINDOW where that share is large enough, else
    one window of every so many smaller tensors: one of WINDOW bytes in a tensor that holds
    one, a whole tensor of those under WINDOW bytes. Each of the two kinds pays its own
    share, so the many small tensors of a state (biases, norms) do not take the share of the
    larger ones in windows of a few hundred bytes, each costing what a large window does.
    Starts and lengths are multiples of 16 (element bounds)."""
    total = sum(_nbytes(t) for _n, t in tensors)
    sample = min(max(total * SAMPLE_SHARE, SAMPLE_MIN), SAMPLE_MAX)
    share = min(1.0, sample / total) if total else 0.0
    owed = [0.0, 0.0]  # by tensors under WINDOW bytes, and by larger ones
    for name, t in tensors:
        n = _nbytes(t)
        want = share * n
        if want >= WINDOW:
            k = min(WINDOWS, int(want // WINDOW))
            length = int(want / k) // 16 * 16
            step = (n - length) // max(1, k - 1)
            yield name, t, [((i * step) // 16 * 16, length) for i in range(k)]
            continue
        large = n >= WINDOW
        owed[large] += want
        length = min(WINDOW, n)
        if n and owed[large] >= length:
            owed[large] -= length
            yield name, t, [((n - length) // 32 * 16, length)]


def _nbytes(t: object) -> int:
    return int(t.nbytes)  # type: ignore[attr-defined]


def _window(t: s4format.Tensor | DeviceTensor, at: int, length: int) -> np.ndarray:
    """Bytes ``at``..``at + length`` of tensor ``t``, on the host."""
    from s4weights.torchtree import DeviceTensor

    if isinstance(t, DeviceTensor):
        return t.device_bytes[at:at + length].cpu().numpy()
    return np.asarray(t.data).reshape(-1).view(np.uint8)[at:at + length]
