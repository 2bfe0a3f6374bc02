"""The GPU path's answer to a device out of memory, without a GPU: ``gpu._with_fallback`` codes
again from the tensor it was at with half the workspace, down to the smallest, then leaves the
rest to the CPU (None); ``write_flattened`` codes a tensor the GPU path left on the CPU. The
same on the H200, with real allocations refused: tests/gpu/test_gpu_out_of_memory.py."""

from __future__ import annotations

import io
import logging

import pytest
import torch

import s4format
import s4format.writer as writer_mod
import s4weights
from s4format import hashing
from s4weights import gpu

MIB = 1 << 20


class _T:  # what _with_fallback reads of a chosen tensor
    def __init__(self, n: int) -> None:
        self.nbytes = n
        self.device_bytes = torch.empty(0, dtype=torch.uint8)


def _chosen(n: int) -> list:
    return [(f"t{k}", _T(1 << 20), None) for k in range(n)]


def _fake_stream(fail_at: dict[tuple[int, int], bool], calls: list):
    """A stand-in for ``_coded_stream``: yields the chosen tensors' names, and raises a device
    out-of-memory error on reaching ``(workspace MiB, name index)`` in ``fail_at``."""
    def stream(chosen, policy, ws):
        calls.append((ws // MIB, [n for n, _t, _p in chosen]))
        for name, _t, _p in chosen:
            k = int(name[1:])
            if fail_at.get((ws // MIB, k)):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")
            yield name
    return stream


def test_out_of_memory_codes_again_from_that_tensor_with_half_the_workspace(
        monkeypatch, caplog) -> None:
    calls: list = []
    monkeypatch.setattr(gpu, "_coded_stream", _fake_stream({(64, 3): True, (32, 5): True}, calls))
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = list(gpu._with_fallback(_chosen(8), "auto", 64 * MIB))
    assert got == [f"t{k}" for k in range(8)]  # each once, in order
    assert calls == [(64, [f"t{k}" for k in range(8)]), (32, [f"t{k}" for k in range(3, 8)]),
                     (16, [f"t{k}" for k in range(5, 8)])]
    text = caplog.text
    assert "ran out of memory coding 't3' with a workspace of 64 MiB" in text
    assert "coding again from that tensor with 32 MiB" in text
    assert "'t5' with a workspace of 32 MiB" in text


def test_a_small_default_workspace_is_halved_too(monkeypatch) -> None:
    # a 200 MiB state's default workspace, with no device memory free to raise it, is 20 MiB:
    # halved to 10 MiB and 5 MiB before the CPU takes over
    chosen = [(f"t{k}", _T(25 * MIB), None) for k in range(8)]
    calls: list = []
    monkeypatch.setattr(gpu, "_free_bytes", lambda dev: 0)
    monkeypatch.setattr(gpu, "_coded_stream", _fake_stream({(20, 1): True, (10, 4): True},
                                                           calls))
    assert list(gpu._with_fallback(chosen, "auto", None)) == [f"t{k}" for k in range(8)]
    assert [ws for ws, _names in calls] == [20, 10, 5]


@pytest.mark.parametrize(("free_gib", "ws_mib"), [(0, 20), (1, 128), (8, 1024), (64, 2048)])
def test_the_default_workspace_is_an_eighth_of_free_memory_up_to_2_gib(
        monkeypatch, free_gib, ws_mib) -> None:
    calls: list = []
    monkeypatch.setattr(gpu, "_free_bytes", lambda dev: free_gib << 30)
    monkeypatch.setattr(gpu, "_coded_stream", _fake_stream({}, calls))
    chosen = [(f"t{k}", _T(25 * MIB), None) for k in range(8)]
    assert list(gpu._with_fallback(chosen, "auto", None)) == [f"t{k}" for k in range(8)]
    assert [ws for ws, _names in calls] == [ws_mib]


def test_past_the_smallest_workspace_the_rest_goes_to_the_cpu(monkeypatch, caplog) -> None:
    calls: list = []
    fail = {(ws, 2): True for ws in (64, 32, 16, 8, 4)}
    monkeypatch.setattr(gpu, "_coded_stream", _fake_stream(fail, calls))
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = list(gpu._with_fallback(_chosen(6), "auto", 64 * MIB))
    assert got == ["t0", "t1", None, None, None, None]
    assert [ws for ws, _names in calls] == [64, 32, 16, 8, 4]
    assert "the CPU codes it and the 3 tensors after it on that device" in caplog.text


def test_nvcomp_ans_goes_to_the_cpu_at_once_and_other_errors_pass(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(gpu, "_coded_stream", _fake_stream({(64, 1): True}, calls))
    assert list(gpu._with_fallback(_chosen(3), "nvcomp-ans", 64 * MIB)) == ["t0", None, None]
    assert len(calls) == 1

    def broken(chosen, policy, ws):
        yield chosen[0][0]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu, "_coded_stream", broken)
    it = gpu._with_fallback(_chosen(3), "auto", 64 * MIB)
    assert next(it) == "t0"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        next(it)


def test_a_tensor_the_gpu_path_leaves_is_coded_on_the_cpu(monkeypatch) -> None:
    # the save hook's streams give None for some tensors (out of device memory): the writer
    # codes those on the CPU, the others as the hook coded them, and the file reads back
    def stand_in(tensors, policy, device, parents, workspace=None, parent_hashes=None):
        names = [n for n, _t in tensors if n.startswith("g")]

        def results():
            for k, (n, t) in enumerate(tensors):
                if n in names:
                    if k % 4 == 1:
                        yield None
                        continue
                    c = writer_mod.code_tensor(t.data, t.dtype, policy)
                    yield c, hashing.content_hash(t.data), None, c.stored

        stream = results()
        return {n: stream for n in names}

    monkeypatch.setattr(gpu, "coded_in_order", stand_in)
    state = {f"{'g' if k % 2 else 'h'}{k}": torch.randn(3000 + k) for k in range(12)}
    buf = io.BytesIO()
    s4weights.save(state, buf)
    got = s4weights.load(buf.getvalue())
    assert all(torch.equal(got[k].view(torch.int32), v.view(torch.int32))
               for k, v in state.items())
    assert [t.name for t in s4format.Reader(buf.getvalue()).tensors] == list(state)


class _Tensor:
    def __init__(self, k: int) -> None:
        self.name, self.raw_nbytes, self.shape = f"t{k}", 64, (64,)
        self.dtype = type("D", (), {"name": "uint8"})


class _Reader:
    def __init__(self, n: int) -> None:
        self.tensors = [_Tensor(k) for k in range(n)]
        self.tensor_uses = [1] * n


def _loader(monkeypatch, n: int, extra: int, chunkable: bool, fails,
            workspace: int | None = 64 * MIB):
    """``gpu.loader_for`` over a stand-in reader of n tensors (each needing ``extra`` bytes of
    workspace) with the decoders replaced: ``fails(device, batch size or 0 for chunks,
    workspace)`` says whether that attempt runs out of memory. Returns (load, what ran)."""
    import contextlib

    from s4weights.gpu import decode, runtime
    from s4weights.gpu import decode_large as chunked

    ran: list = []

    def read_tensors(reader, idx, outs=None, ahead=None, staged=None):
        dev = current[0]
        ran.append((dev, "batch", len(idx)))
        if fails(dev, len(idx), None):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")
        return [torch.full((64,), i, dtype=torch.uint8) for i in idx]

    def load_large(reader, i, raw, ws):
        ran.append((current[0], "chunks", ws))
        if fails(current[0], 0, ws):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")
        raw.fill_(i)

    def read_on_cpu(reader, i, out):
        ran.append((current[0], "cpu", i))
        out.fill_(i)

    current = ["cuda:0"]

    @contextlib.contextmanager
    def device(d):
        current[0] = str(d)
        yield

    monkeypatch.setattr(gpu, "use_gpu", lambda device, wanted: True)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(decode, "read_tensors", read_tensors)
    monkeypatch.setattr(decode, "read_on_cpu", read_on_cpu)
    monkeypatch.setattr(decode, "decodable", lambda reader, i: True)
    monkeypatch.setattr(decode, "over_limit", lambda reader, i, cap=None: False)
    monkeypatch.setattr(decode, "limit", lambda reader: 1 << 62)
    monkeypatch.setattr(decode, "check_limit", lambda reader, i: None)
    monkeypatch.setattr(decode, "device_extra", lambda reader, i: extra)
    monkeypatch.setattr(chunked, "chunkable", lambda reader, i: chunkable)
    monkeypatch.setattr(chunked, "load_large", load_large)
    monkeypatch.setattr(runtime, "device_empty", lambda n: torch.empty(n, dtype=torch.uint8))
    return gpu.loader_for(_Reader(n), "cuda", workspace=workspace), ran


def test_a_load_out_of_memory_shrinks_its_batches_on_that_device_only(monkeypatch,
                                                                      caplog) -> None:
    # batches of more than two tensors run out of memory on cuda:0: 64 MiB (6 tensors of
    # 10 MiB) and 32 MiB (3) fail, 16 MiB (1) works, and stays for the later tensors there
    load, ran = _loader(monkeypatch, 6, 10 * MIB, False,
                        lambda dev, size, ws: dev == "cuda:0" and size > 2)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = [load(k, "cuda:0") for k in range(3)] + [load(k, "cuda:1") for k in range(3, 6)]
    assert [int(g[0]) for g in got] == list(range(6))
    assert ran == [("cuda:0", "batch", 6), ("cuda:0", "batch", 3), ("cuda:0", "batch", 1),
                   ("cuda:0", "batch", 1), ("cuda:0", "batch", 1),
                   ("cuda:1", "batch", 3)]  # cuda:1 keeps 64 MiB (6 fit, 3 are left)
    assert caplog.text.count("decoding again") == 2 and "CPU" not in caplog.text


def test_past_the_smallest_workspace_the_cpu_decodes_that_devices_tensors(monkeypatch,
                                                                         caplog) -> None:
    load, ran = _loader(monkeypatch, 4, 10 * MIB, False, lambda dev, size, ws: True)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = [load(k, "cuda:0") for k in range(4)]
    assert [int(g[0]) for g in got] == list(range(4))
    assert ran == [("cuda:0", "batch", 4), ("cuda:0", "batch", 3), ("cuda:0", "batch", 1),
                   *(("cuda:0", "cpu", k) for k in range(4))]  # no GPU try after the switch
    assert "the CPU decodes it and the later tensors on that device" in caplog.text


def test_a_tensor_decoded_whole_and_alone_goes_to_the_cpu_at_once(monkeypatch, caplog) -> None:
    # 40 MiB each, not chunkable: a batch of one at 64 MiB; half would not help it
    load, ran = _loader(monkeypatch, 3, 40 * MIB, False,
                        lambda dev, size, ws: ran[-1:] == [("cuda:0", "batch", 1)]
                        and len([r for r in ran if r[1] == "batch"]) == 1)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = [load(k, "cuda:0") for k in range(3)]
    assert [int(g[0]) for g in got] == list(range(3))
    assert ran == [("cuda:0", "batch", 1), ("cuda:0", "cpu", 0), ("cuda:0", "batch", 1),
                   ("cuda:0", "batch", 1)]  # the workspace stays 64 MiB for the others
    assert "the CPU decodes it" in caplog.text and "later tensors" not in caplog.text


def test_a_chunked_tensor_is_decoded_again_in_smaller_chunks(monkeypatch, caplog) -> None:
    load, ran = _loader(monkeypatch, 1, 100 * MIB, True,
                        lambda dev, size, ws: ws is not None and ws > 16 * MIB)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        assert int(load(0, "cuda:0")[0]) == 0
    assert ran == [("cuda:0", "chunks", 64 * MIB), ("cuda:0", "chunks", 32 * MIB),
                   ("cuda:0", "chunks", 16 * MIB)]
    assert caplog.text.count("decoding again") == 2 and "CPU" not in caplog.text


def test_chunks_are_halved_down_to_4_mib_then_the_device_is_taken_as_full(
        monkeypatch, caplog) -> None:
    # every attempt fails: chunks at 64, 32, 16, 8 and 4 MiB, then the CPU decodes it and
    # (an attempt of at most FULL_BELOW failed) the next tensor too, without trying the GPU
    load, ran = _loader(monkeypatch, 2, 100 * MIB, True, lambda dev, size, ws: True)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        assert [int(load(k, "cuda:0")[0]) for k in range(2)] == [0, 1]
    assert ran == [*(("cuda:0", "chunks", ws * MIB) for ws in (64, 32, 16, 8, 4)),
                   ("cuda:0", "cpu", 0), ("cuda:0", "cpu", 1)]
    assert "the CPU decodes it and the later tensors on that device" in caplog.text


@pytest.mark.parametrize("n,chunkable", [(1, True), (2, False)])
def test_a_small_attempt_that_fails_sends_the_device_to_the_cpu_at_once(
        monkeypatch, caplog, n: int, chunkable: bool) -> None:
    # one chunkable tensor, or a batch of two (the file's last), needing 1 MiB each: a smaller
    # workspace would try the very same decode again, and a device that cannot give 1-2 MiB is
    # full: the CPU decodes them, the later ones without trying the device
    load, ran = _loader(monkeypatch, n + 1, 1 * MIB, chunkable, lambda dev, size, ws: True)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        got = [load(k, "cuda:0") for k in range(1, n + 1)] + [load(0, "cuda:0")]
    assert [int(g[0]) for g in got] == [*range(1, n + 1), 0]
    assert ran == [("cuda:0", "batch", n), *(("cuda:0", "cpu", k) for k in range(1, n + 1)),
                   ("cuda:0", "cpu", 0)]
    assert "decoding again" not in caplog.text
    assert "the CPU decodes it and the later tensors on that device" in caplog.text


def test_a_large_chunkable_tensor_alone_is_retried_in_chunks(monkeypatch) -> None:
    # 40 MiB, chunkable, alone at 64 MiB (whole): half (32 MiB) is below its need, so it
    # chunks there; a whole decode never runs twice
    load, ran = _loader(monkeypatch, 1, 40 * MIB, True,
                        lambda dev, size, ws: size == 1 and ws is None)
    assert int(load(0, "cuda:0")[0]) == 0
    assert ran == [("cuda:0", "batch", 1), ("cuda:0", "chunks", 32 * MIB)]


def test_a_load_asks_each_device_for_its_free_memory_when_it_first_decodes_there(monkeypatch
                                                                                ) -> None:
    # a loader built for a load that stays on the CPU asks no device (that would start CUDA
    # there); each device used gets an eighth of what it has free besides the state's bytes
    asked: list = []
    free = {"cuda:0": 16 << 30, "cuda:1": 128 * MIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda dev=None: (asked.append(str(dev)) or free[str(dev)], 0))
    monkeypatch.setattr(gpu, "use_gpu", lambda device, wanted: True)
    loader = gpu._Loader(_Reader(4), None, {}, None, False, None)
    assert asked == []
    total = 4 * _Tensor(0).raw_nbytes
    assert loader._budget("cuda:0", "cuda:0") == 1 << 30
    assert loader._budget("cuda:1", "cuda:1") == max(4 * MIB, (128 * MIB - total) // 8)
    assert loader._budget("cuda:0", "cuda:0") == 1 << 30
    assert asked == ["cuda:0", "cuda:1"]
    assert gpu._Loader(_Reader(4), None, {}, 64 * MIB, False, None)._budget("cuda:0", 0) \
        == 64 * MIB


@pytest.mark.parametrize(("need_gib", "whole"), [(1.5, True), (3, False)])
def test_with_the_default_workspace_a_tensor_an_eighth_of_free_memory_holds_decodes_whole(
        monkeypatch, need_gib: float, whole: bool) -> None:
    # 16 GiB free: the default workspace is 1 GiB, and a tensor that alone needs more is
    # decoded whole while an eighth of the free memory (2 GiB) holds it, else in chunks; a
    # workspace the caller gives is kept to
    monkeypatch.setattr(gpu, "_free_bytes", lambda dev: 16 << 30)
    need = int(need_gib * (1 << 30))
    load, ran = _loader(monkeypatch, 1, need, True, lambda dev, size, ws: False, None)
    assert int(load(0, "cuda:0")[0]) == 0
    assert ran == [("cuda:0", "batch", 1) if whole else ("cuda:0", "chunks", 1 << 30)]
    load, ran = _loader(monkeypatch, 1, need, True, lambda dev, size, ws: False, 1 << 30)
    load(0, "cuda:0")
    assert ran == [("cuda:0", "chunks", 1 << 30)]


def test_a_whole_decode_past_the_default_workspace_that_runs_out_goes_to_chunks(
        monkeypatch) -> None:
    monkeypatch.setattr(gpu, "_free_bytes", lambda dev: 16 << 30)
    load, ran = _loader(monkeypatch, 2, int(1.5 * (1 << 30)), True,
                        lambda dev, size, ws: size == 1, None)
    assert [int(load(k, "cuda:0")[0]) for k in range(2)] == [0, 1]
    assert ran == [("cuda:0", "batch", 1), ("cuda:0", "chunks", 512 << 20),
                   ("cuda:0", "chunks", 512 << 20)]  # (the device's later tensors too)


def test_deltas_whose_levels_the_cpu_decodes_join_the_gpus_batches(monkeypatch) -> None:
    # the odd tensors: deltas the GPU does not decode (their own levels on the CPU, their
    # parents on the GPU), batched with the others so that their parents decode together
    from s4weights.gpu import decode

    load, ran = _loader(monkeypatch, 6, MIB, False, lambda dev, size, ws: False)
    monkeypatch.setattr(decode, "decodable", lambda reader, i: i % 2 == 0)
    monkeypatch.setattr(decode, "host_level", lambda reader, i: i % 2 == 1)
    got = [load(k, "cuda:0") for k in range(6)]
    assert [int(g[0]) for g in got] == list(range(6))
    assert ran == [("cuda:0", "batch", 6)]
    # read whole by the CPU instead (each its own call of read_tensors, its own batch)
    monkeypatch.setattr(decode, "host_level", lambda reader, i: False)
    load, ran = _loader(monkeypatch, 6, MIB, False, lambda dev, size, ws: False)
    monkeypatch.setattr(decode, "decodable", lambda reader, i: i % 2 == 0)
    [load(k, "cuda:0") for k in range(6)]
    assert ran == [("cuda:0", "batch", 3), *[("cuda:0", "batch", 1)] * 3]
