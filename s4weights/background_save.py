"""Saves that return once the state is captured: ``blocking=False`` on ``save`` and
``save_checkpoint``.

Capturing copies every tensor: host tensors into host memory, CUDA tensors into a device copy
(device-to-device, milliseconds) when the device has room for it, else into page-locked host
memory. The copy is coded, written and committed on a thread of its own, CUDA work on a stream
of its own, and freed when the save ends; until then it is the memory an asynchronous save
holds. Saves submitted to one destination run one after the other, in order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from s4format.tensor import Tensor
from s4weights import hostmem
from s4weights.torchtree import DeviceTensor, Flattened

log = logging.getLogger("s4weights")

# Free device memory a device copy must leave, besides the copy itself.
DEVICE_HEADROOM = 256 << 20

_TAILS: dict[str, Future[Any]] = {}  # destination -> its last submitted save
_TAILS_LOCK = threading.Lock()


def capture(flat: Flattened) -> tuple[Flattened, dict[torch.device, torch.cuda.Stream]]:
    """A copy of ``flat``'s tensors that the caller may change right after, and the streams
    the copies were queued on, by device (the save's own streams: they wait for the caller's
    queued work first)."""
    streams: dict[torch.device, torch.cuda.Stream] = {}
    on_device = {}
    for name, t in flat.tensors:
        if isinstance(t, DeviceTensor):
            on_device.setdefault(t.device_bytes.device, []).append((name, t))
    copies: dict[str, Tensor | DeviceTensor] = {}
    for dev, run in on_device.items():
        streams[dev] = _stream_after_caller(dev)
        copies.update(_copy_device(dev, run, streams[dev]))
        with torch.cuda.device(dev):  # the caller's later work, which may change the tensors,
            torch.cuda.current_stream().wait_stream(streams[dev])  # comes after the copies
    tensors = []
    for name, t in flat.tensors:
        if name in copies:
            tensors.append((name, copies[name]))
        else:
            tensors.append((name, Tensor(t.dtype, t.shape, np.array(t.data, copy=True))))
    return Flattened(flat.tree, tensors), streams


def _stream_after_caller(dev: torch.device) -> torch.cuda.Stream:
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
    return side


def _copy_device(dev: torch.device, run: list[tuple[str, DeviceTensor]],
                 stream: torch.cuda.Stream) -> dict[str, Tensor | DeviceTensor]:
    """Device copies of ``run`` where the device has room, else page-locked host copies."""
    nbytes = sum(t.nbytes for _n, t in run)
    with torch.cuda.device(dev):
        free, _total = torch.cuda.mem_get_info()
    out: dict[str, Tensor | DeviceTensor] = {}
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        if free >= nbytes + DEVICE_HEADROOM:
            for name, t in run:
                out[name] = DeviceTensor(t.dtype, t.shape, t.device_bytes.clone())
            return out
        log.info("asynchronous save: %d bytes on %s do not fit beside the free device memory;"
                 " captured in host memory, coded on the CPU", nbytes, dev)
        host = hostmem.populated(nbytes).result()
        hostmem.lock(host, dev.index)
        at = 0
        for name, t in run:
            h = host[at:at + t.nbytes]
            if t.nbytes:
                torch.from_numpy(h).copy_(t.device_bytes, non_blocking=True)
            out[name] = Tensor(t.dtype, t.shape, h)
            at += t.nbytes
    return out


def submit(key: str, job: Callable[[], Any],
           streams: dict[torch.device, torch.cuda.Stream]) -> Future[Any]:
    """Run ``job`` on a thread of its own once the saves submitted before it to ``key`` have
    ended, with each device's current stream set to its capture stream; the future of its
    result. The thread is not a daemon: the interpreter waits for it at exit."""
    done: Future[Any] = Future()
    with _TAILS_LOCK:
        before = _TAILS.get(key)
        _TAILS[key] = done

    def run() -> None:
        if before is not None:
            with contextlib.suppress(BaseException):  # (its own caller sees its error)
                before.result()
        if not done.set_running_or_notify_cancel():
            return
        try:
            with contextlib.ExitStack() as using:
                for stream in streams.values():
                    using.enter_context(torch.cuda.stream(stream))
                result = job()
                for stream in streams.values():
                    stream.synchronize()
            done.set_result(result)
        except BaseException as exc:
            done.set_exception(exc)
        finally:
            with _TAILS_LOCK:
                if _TAILS.get(key) is done:
                    del _TAILS[key]

    threading.Thread(target=run, name="s4w-save", daemon=False).start()
    return done


def wait_for(key: str) -> None:
    """Wait for the saves submitted to ``key`` (a blocking save comes after them)."""
    with _TAILS_LOCK:
        before = _TAILS.get(key)
    if before is not None:
        with contextlib.suppress(BaseException):
            before.result()
