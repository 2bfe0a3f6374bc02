"""The save side of the CUDA path: :class:`Encoder` codes tensors that live on the GPU into
coded tensors (``CodedTensor``), in order.

Consecutive tensors form windows. A window whose worst case fits the workspace is one group,
split and histogrammed in one pass; otherwise one histogram pass (``histograms``) sizes its
groups by what they really hold (``plan.group_need``). ``encode_group`` codes each group, and its
payloads go to pinned host memory while the next group runs; a tensor larger than the workspace
goes to ``encode_large``. Tensors under ``SPLIT_MIN`` bytes are stored raw, copied on the
device; other dtypes, and tensors whose planes would store more than their raw bytes, go to the
CPU coder as the CPU path codes them. GDeflate runs only where asked for.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from s4format import layouts, policy
from s4format.codecs import rans
from s4format.writer import SPLIT_MIN
from s4weights.gpu import encode_group, encode_large, gdeflate, histograms, plan, segments
from s4weights.gpu.choose import candidates
from s4weights.gpu.encode_group import DeviceGroup, Prepared
from s4weights.gpu.items import Coded, Item
from s4weights.gpu.planes import (
    ALIGN_PAYLOAD,
    Planes,
    kept_as_split,
    pack_widths,
    stored_bound,
)

MANTISSA_MODES = ("auto", "rans", "gdeflate", "raw")


class Encoder:
    """Code GPU tensors for ``Writer.add_coded``; ``code(items)`` yields results in order."""

    def __init__(self, policy_name: str = "auto", *, mantissa: str = "auto",
                 log2_block: int = rans.LOG2_BLOCK_DEFAULT, workspace: int | None = None,
                 gdeflate_algorithm: int = gdeflate.DEFAULT_ALGORITHM) -> None:
        if mantissa not in MANTISSA_MODES:
            raise ValueError(f"mantissa must be one of {MANTISSA_MODES}")
        self.policy = policy.check_policy(policy_name)
        self.mantissa = mantissa
        self.log2_block = log2_block
        self.workspace = workspace
        self.gd_algorithm = gdeflate_algorithm
        self.gd = (mantissa == "gdeflate" or self.policy == "seed") and gdeflate.available()
        # a group split before its codecs are known (``histograms.window_planes``) stores its
        # narrow mantissa planes packed where bitpack-w is a candidate for them: the codec they
        # take unless rANS saves over 1/65 (then its kernel reads them packed), so the assembly
        # usually copies them as they are
        self.packs = self.policy == "auto" and mantissa == "auto"
        self._copy_stream: torch.cuda.Stream | None = None
        # a group split before its codecs are known queues its rANS launch before the host has
        # read its figures, the planes picked on the device (``histograms``); the groups
        # where that launch picked other planes than the host's rule (a bug: rans_jobs is
        # candidates' rule; the host's wins and codes again)
        self.early_rans = True
        self.mispredicted = 0
        # a sized group's split also writes the planes with no candidate codec (``stays_raw``)
        # where the result keeps them (``kept_as_split``)
        self.keep_raw = True

    def _workspace(self, items: list[Item]) -> int:
        return self.workspace or plan.default_workspace(sum(i.nbytes for i in items))

    def _budgets(self, items: list[Item]) -> tuple[int, int]:
        """(the share of the workspace a window's histogram pass may hold, what groups may
        hold: the rest)."""
        workspace = self._workspace(items)
        cap = workspace // plan.WINDOW_SHARE
        return cap, workspace - cap

    @staticmethod
    def _layouts(items: list[Item]) -> None:
        for it in items:
            it.layout = plan.gpu_layout(it.dtype.name, it.nbytes)
            if it.layout is None and it.nbytes < SPLIT_MIN:
                # small tensors (biases, norms, step counters: hundreds per state, a few KiB
                # in all) are stored as one raw plane, copied on the device: coding them on
                # the CPU costs more host time than all their bytes are worth
                it.layout = layouts.RAW

    def _plan(self, items: list[Item], pipelined: bool = False, chunked: bool = False
              ) -> Iterator[tuple[list[Item], Planes | None, int, tuple | None] | Item]:
        """The groups to code, in order, each as (its items, its plane table with candidates or
        None, its device bytes, the next group's items and table if the next group is of the
        same window). A window that fits the workspace even if every plane took rANS is one
        group, split and histogrammed as it is coded (table None); otherwise one histogram pass
        decides every plane's candidates and sizes the groups by what they hold. ``pipelined``:
        the previous group's payloads are still on the device while the next one is coded.
        ``chunked``: a tensor that alone needs more than the workspace, and every item with a
        parent, comes alone as an ``Item`` for ``encode_large``."""
        if not chunked and any(it.parent is not None for it in items):
            raise ValueError("an item with a parent is coded by Encoder.code only")
        self._layouts(items)
        cap, budget = self._budgets(items)
        needs: dict[tuple, tuple[int, int, bool]] = {}  # a model's layers repeat a few shapes

        def need_of(it: Item) -> tuple[int, int, bool]:
            """(the most it can need, its window tables' bytes, whether it is alone over the
            budget even with no plane rANS-coded (the least it can need): no sizing to do)."""
            key = (-1 if it.layout is None else it.layout.layout_id, it.nbytes,
                   it.dtype.itemsize)
            if (v := needs.get(key)) is None:
                least, most = (plan.encode_need(it.layout, it.nbytes, it.dtype.itemsize,
                                                self.gd, self.log2_block, rans=r)
                               for r in (False, True))
                v = needs[key] = (most, plan.window_meta(it.layout),
                                  it.layout is not layouts.RAW and least > budget)
            return v

        window: list[Item] = []
        meta = worst = 0
        for it in items:
            most, m, alone = need_of(it)
            large = it.parent is not None or (chunked and alone and not self.gd)
            if large or alone or (window and meta + m > cap):
                yield from self._window(window, budget, pipelined, chunked, worst)
                window, meta, worst = [], 0, 0
            if large:
                yield it
            elif alone:
                yield [it], None, most, None
            else:
                window.append(it)
                meta += m
                worst += most
        yield from self._window(window, budget, pipelined, chunked, worst)

    def _window(self, items: list[Item], budget: int, pipelined: bool, chunked: bool,
                worst: int) -> Iterator[tuple[list[Item], Planes | None, int, tuple | None]
                                        | Item]:
        if not items:
            return
        if worst <= budget:
            yield items, None, worst, None
            return
        pl, tables, _none = histograms.window_planes(self, items)
        nbytes = np.array([it.nbytes for it in items], np.int64)
        width = pack_widths(pl)
        kept = kept_as_split(pl, width, self.keep_raw)
        # a tensor that may store more than its raw bytes is copied raw for the CPU coder,
        # while its kept planes stay where the split wrote them: its need counts both
        bound = stored_bound(pl, width, kept, self.log2_block)
        may_cpu = np.bincount(pl.item, weights=bound, minlength=nbytes.size) > nbytes
        # the compacted payloads: a tensor that may go to the CPU coder (or has no rows: the
        # CPU codes it) copied raw, any other its rows' bounds but the kept ones' (16-byte
        # aligned each)
        rows = np.bincount(pl.item, minlength=nbytes.size)
        may_cpu |= rows == 0
        # (a may_cpu tensor the GPU codes after all: its rows' payloads, 16-byte aligned)
        payload = np.where(may_cpu, (nbytes + 255) // 256 * 256 + ALIGN_PAYLOAD * rows, np.bincount(
            pl.item, weights=np.where(kept, 0, (bound + ALIGN_PAYLOAD - 1) // ALIGN_PAYLOAD
                                      * ALIGN_PAYLOAD), minlength=nbytes.size)).astype(np.int64)
        need = plan.group_need(pl.item, width, pl.kind != layouts.KIND_RAW, pl.n,
                               pl.runs_rans, pl.cand_gd, nbytes, self.log2_block,
                               words=pl.words, payload=payload)
        # what a group's result holds on the device: its compacted payloads and the planes
        # kept where its split wrote them (counted whole: those of a tensor the CPU codes
        # stay there too)
        held = payload + np.bincount(pl.item, weights=np.where(
            kept, plan.split_plane_bytes(pl.n, width), 0), minlength=nbytes.size).astype(np.int64)
        first = np.searchsorted(pl.item, np.arange(len(items) + 1))
        run: list[int] = []

        def flush() -> Iterator[tuple[list[Item], Planes, int, tuple | None]]:
            groups = []
            for grp in plan.groups_by_need(need[run].tolist(), held[run].tolist(), budget,
                                           pipelined):
                k0, k1 = run[grp.start], run[grp.stop - 1] + 1  # runs are consecutive
                rows = np.arange(first[k0], first[k1])
                sub = pl.take(rows, pl.item[rows] - k0)
                sub.tables = tables  # table inputs and bytes: until the group's copy
                groups.append((items[k0:k1], sub, int(need[k0:k1].sum())))
            run.clear()
            for g, (its, sub, nd) in enumerate(groups):  # each with the next one's items
                yield its, sub, nd, groups[g + 1][:2] if g + 1 < len(groups) else None

        for k, it in enumerate(items):
            if chunked and need[k] > budget and not self.gd and it.layout is not layouts.RAW:
                yield from flush()
                yield it
            else:
                run.append(k)
        yield from flush()

    def code(self, items: list[Item]) -> Iterator[Coded]:
        """Coded tensors with payloads in pinned host memory, in order; one group's D2H is in
        flight while the next group runs on the device. A tensor too large for the workspace
        is coded alone, in chunks (``encode_large``), once the group before it is done. A
        large tensor whose values change distribution along it is coded as segments and
        stored with codec 9 (``segments``)."""
        cut = segments.cuts_of(items, self.policy) if self.mantissa == "auto" and not self.gd \
            else [None] * len(items)
        if all(c is None for c in cut):
            yield from self._code(items)
            return
        parts = [[it] if c is None else segments.split(it, c) for it, c in zip(items, cut)]
        whole = [it for it, c in zip(items, cut) if c is not None]
        hashes = iter(segments.content_hashes(whole))
        results = self._code([p for ps in parts for p in ps])
        for it, c, ps in zip(items, cut, parts):
            if c is None:
                yield next(results)
            else:
                coded = [next(results) for _ in ps]
                yield segments.stitch(it, coded, next(hashes), self.policy)

    def _code(self, items: list[Item]) -> Iterator[Coded]:
        pending: DeviceGroup | None = None
        ready: Prepared | None = None  # the next group's tables, made while this one ran
        _cap, budget = self._budgets(items)
        for grp in self._plan(items, pipelined=True, chunked=True):
            if isinstance(grp, Item):
                if pending is not None:
                    yield from pending.results(self.policy)
                    pending = None
                # the chunked coders get what groups get: a tensor handed out in the middle
                # of a window leaves the window's tables (up to the rest) on the device
                split = grp.layout is not None and grp.layout is not layouts.RAW
                yield (encode_large.code_large(self, grp, budget) if split
                       else encode_large.code_host(self, grp, budget))
                continue
            its, pl, need, following = grp
            if pending is not None and pending.device_bytes + need > budget:
                # the first group of a new window: wait for the previous group's copy
                yield from pending.results(self.policy)
                pending = None
            box: list[Prepared] = []
            g = encode_group.encode(self, its, pl, pending, ready, self._ahead(following, box),
                                    fits=need <= budget)
            ready = box[0] if box else None
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream()
            g.start_copy(self._copy_stream)
            if pending is not None:
                yield from pending.results(self.policy)
            pending = g
        if pending is not None:
            yield from pending.results(self.policy)

    def encode_device(self, items: list[Item]) -> list[DeviceGroup]:
        """Device-to-device: every group's compacted payload buffer stays on the device (so a
        tensor larger than the workspace is one group of its own, whatever it needs)."""
        out: list[DeviceGroup] = []
        ready: Prepared | None = None
        _cap, budget = self._budgets(items)
        for its, pl, need, following in self._plan(items):
            # the previous group's hashes are rooted and the next group's tables made while
            # this group's kernels run
            box: list[Prepared] = []
            out.append(encode_group.encode(self, its, pl, out[-1] if out else None, ready,
                                           self._ahead(following, box), fits=need <= budget))
            ready = box[0] if box else None
        if out:
            out[-1].finish()
        return out

    def _ahead(self, following: tuple | None, box: list):
        """A callable that makes the ``following`` group's tables into ``box`` (or None)."""
        if following is None:
            return None
        return lambda: box.append(encode_group.prepare(self, *following))

    def candidates(self, pl: Planes) -> None:
        """Every plane's candidate codecs under this encoder's policy (``choose.candidates``)."""
        candidates(pl, self.policy, self.mantissa, self.gd, self.log2_block)


def file_of(enc: Encoder, tensors: dict[str, torch.Tensor]) -> bytes:
    """A file image of ``tensors`` coded by ``enc`` (``Encoder.code``), each a top-level entry
    under its name: what the device-to-device benchmarks and the coder's tests read back (no
    torch object tree, no deltas; ``s4weights.save`` writes real checkpoints)."""
    import io

    from s4format import objtree
    from s4format.writer import Writer

    items = [Item.of(t) for t in tensors.values()]
    buf = io.BytesIO()
    with Writer(buf) as w:
        for (name, t), it, c in zip(tensors.items(), items, enc.code(items)):
            w.add_coded(name, it.dtype, tuple(t.shape), c.coded, c.content_hash)
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(tensors)})
    return buf.getvalue()


