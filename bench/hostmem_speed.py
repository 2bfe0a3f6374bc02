"""What a checkpoint snapshot's host buffer costs to make, on the GPU machine
(``python3 bench/hostmem_speed.py``): ``S4_HOSTMEM_BYTES`` (default 1.88 GB, bench/gpu.py's (b)
state) of page-locked memory from torch's pinned allocator against an anonymous mapping
registered with CUDA (s4weights.hostmem), with and without transparent huge pages and with the
pages populated first (in one thread or several); then a device-to-host copy of that size into
page-locked, fresh pageable and touched pageable memory; then whether registering in another
thread holds up kernel launches on this one. Median of ``S4_HOSTMEM_REPS`` (default 3)."""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

N = int(os.environ.get("S4_HOSTMEM_BYTES", str(1_879_300_000)))
REPS = int(os.environ.get("S4_HOSTMEM_REPS", "3"))
MADV_POPULATE_WRITE = 23  # Linux 5.14
CUDART = torch.cuda.cudart()


def register(arr: np.ndarray) -> None:
    torch.cuda.check_error(CUDART.cudaHostRegister(arr.ctypes.data, arr.size, 1))


def unregister(arr: np.ndarray) -> None:
    torch.cuda.check_error(CUDART.cudaHostUnregister(arr.ctypes.data))


def mapping(huge: bool, populate: str) -> tuple[mmap.mmap, np.ndarray, float]:
    """A mapping of N bytes; the seconds spent populating it (``populate``: "" none, "madvise"
    MADV_POPULATE_WRITE, "threads" eight threads writing zeros)."""
    area = mmap.mmap(-1, N)
    if huge:
        area.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(area, dtype=np.uint8, count=N)
    t0 = time.perf_counter()
    if populate == "madvise":
        area.madvise(MADV_POPULATE_WRITE)
    elif populate == "threads":
        step = -(-N // 8) + 4095 & ~4095

        def touch(k: int) -> None:
            arr[k * step:(k + 1) * step] = 0

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(touch, range(8)))
    return area, arr, time.perf_counter() - t0


def variant(huge: bool, populate: str) -> tuple[float, float]:
    area, arr, pop_s = mapping(huge, populate)
    t0 = time.perf_counter()
    register(arr)
    reg_s = time.perf_counter() - t0
    unregister(arr)
    del arr
    area.close()
    return pop_s, reg_s


def torch_pinned(n: int = N) -> float:
    """Seconds for torch's pinned allocator to make ``n`` bytes (rounded up to a power of two)
    with nothing cached."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    t0 = time.perf_counter()
    block = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    took = time.perf_counter() - t0
    del block
    if empty is not None:
        empty()
    return took


def median(fn) -> list[float]:
    runs = [fn() for _ in range(REPS)]
    if isinstance(runs[0], tuple):
        return [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]
    return [statistics.median(runs)]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=dst.is_pinned())
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def launches_while(work) -> tuple[float, float, float]:
    """Median and worst seconds of a tiny kernel launch + synchronize on this thread while
    ``work`` runs on another, and how long ``work`` took."""
    x = torch.zeros(1024, device="cuda")
    lat, done = [], threading.Event()
    took = [0.0]

    def other() -> None:
        t0 = time.perf_counter()
        work()
        took[0] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=other)
    th.start()
    while not done.is_set():
        t0 = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - t0)
    th.join()
    return statistics.median(lat), max(lat), took[0]


def main() -> None:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    lock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    print(f"{N / 1e9:.2f} GB, median of {REPS}; THP: {thp}; RLIMIT_MEMLOCK: {lock}", flush=True)
    torch.zeros(1, device="cuda")
    rows = [("torch pinned allocator (rounds to a power of two)", median(torch_pinned))]
    for huge in (False, True):
        for populate in ("", "madvise", "threads"):
            name = f"mapping{' + huge pages' if huge else ''}" \
                   f"{' + populated (' + populate + ')' if populate else ''} + register"
            rows.append((name, median(lambda h=huge, p=populate: variant(h, p))))
    for name, t in rows:
        extra = f" (populate {t[0]:.3f} s, register {t[1]:.3f} s)" if len(t) == 2 else ""
        print(f"  {name}: {sum(t):.3f} s{extra}", flush=True)

    src = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
    area, arr, _ = mapping(True, "madvise")
    register(arr)
    locked = torch.from_numpy(arr)
    took = median(lambda d=locked, s=src: copy_into(d, s))[0]
    print(f"device-to-host copy, page-locked: {took:.3f} s", flush=True)
    del locked
    unregister(arr)
    fresh = [copy_into(torch.from_numpy(np.empty(N, np.uint8)), src) for _ in range(REPS)]
    print(f"device-to-host copy, fresh pageable: {statistics.median(fresh):.3f} s", flush=True)
    touched = torch.from_numpy(arr)
    print(f"device-to-host copy, touched pageable: "
          f"{median(lambda d=touched, s=src: copy_into(d, s))[0]:.3f} s", flush=True)
    del touched, arr
    area.close()
    del src

    base = launches_while(lambda: time.sleep(0.5))
    print(f"launch + sync on this thread, another idle: median {base[0] * 1e6:.0f} us, "
          f"worst {base[1] * 1e3:.1f} ms", flush=True)
    for huge in (False, True):
        def reg(h=huge) -> None:
            area, arr, _ = mapping(h, "madvise")
            register(arr)
            unregister(arr)
            del arr
            area.close()
        med, worst, took = launches_while(reg)
        print(f"launch + sync while another thread populates and registers "
              f"({'huge pages' if huge else 'small pages'}, {took:.3f} s): median "
              f"{med * 1e6:.0f} us, worst {worst * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
