"""The CPU path's worker threads: one pool per process, as many threads as usable cores up to
:data:`DEFAULT_MAX` (``S4_THREADS`` overrides), running kernels that release the GIL; and a
second pool for copies into memory (:mod:`s4format.memsink`), up to :data:`COPY_MAX` threads.

A thread that waits for tasks runs queued tasks itself meanwhile (newest first: most likely the
pieces it just split its own work into), so a task may split its work into more tasks and wait
for them without deadlocking the pool, and the caller's thread is one of the workers. Results
never depend on the number of threads: work is cut into pieces by size alone.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Threads by default, at most: the Python between kernels holds the GIL, and past this the
# workers mostly wait for it (16 cores, CUDA hidden, 2026-12-06: the LoRA state saved in 228-280
# ms on 4 threads against 319-376 on 8, loaded in 100-130 against 171-175 ms; 16 threads were
# 10-17% slower than 8 before).
DEFAULT_MAX = 4
# ... for copies into memory, which hold no GIL while they run: the GPU path's saves into memory
# copy its stored bytes on them (10-15% slower on 4 threads than on 8, bench/RESULTS.md).
COPY_MAX = 8


def count() -> int:
    """Threads the CPU path uses: ``S4_THREADS`` if set, else the cores this process may use,
    at most :data:`DEFAULT_MAX`."""
    return _threads(DEFAULT_MAX)


def copy_count() -> int:
    """Threads the copies into memory use: ``S4_THREADS`` if set, else the cores this process
    may use, at most :data:`COPY_MAX`."""
    return _threads(COPY_MAX)


def _threads(most: int) -> int:
    env = os.environ.get("S4_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"S4_THREADS must be a positive integer, got {env!r}") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, most))


class Task:
    __slots__ = ("_args", "_done", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._fn, self._args = fn, args
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._fn(*self._args)
        except BaseException as exc:  # handed to whoever waits for it
            self._error = exc
        self._fn = self._args = None

    def result(self) -> Any:
        """The task's result, handed over once (the task forgets it: the worker that ran the
        task may still hold it a moment after it is done), or its error raised."""
        if self._error is not None:
            raise self._error
        result, self._result = self._result, None
        return result


class Pool:
    """Tasks on ``threads - 1`` daemon workers plus whichever thread waits for them."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pid = os.getpid()
        self._queue: collections.deque[Task] = collections.deque()
        self._cond = threading.Condition()
        self._started = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Task:
        task = Task(fn, args)
        with self._cond:
            self._queue.append(task)
            if self._started < self.threads - 1:
                self._started += 1
                threading.Thread(target=self._work, name=f"s4-worker-{self._started}",
                                 daemon=True).start()
            self._cond.notify()
        return task

    def wait(self, tasks: Iterable[Task]) -> list[Any]:
        """The results of ``tasks`` in order (the first error raised, once all are done)."""
        tasks = list(tasks)
        for task in tasks:
            self._help_until(task)
        return [t.result() for t in tasks]

    def map(self, fn: Callable[..., Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(x) for x in items]`` across the pool; the last item runs on this thread."""
        items = list(items)
        if len(items) <= 1 or self.threads == 1:
            return [fn(x) for x in items]
        last = Task(fn, (items[-1],))
        tasks = [self.submit(fn, x) for x in items[:-1]]
        last.run()
        return [*self.wait(tasks), last.result()]

    def _help_until(self, task: Task) -> None:
        while not task._done:
            with self._cond:
                if task._done:
                    return
                other = self._queue.pop() if self._queue else None
                if other is None:
                    self._cond.wait()
                    continue
            self._run(other)

    def _run(self, task: Task) -> None:
        task.run()
        with self._cond:
            task._done = True
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                task = self._queue.popleft()
            self._run(task)
            # An idle worker holding its last task would keep the task's result alive: a view
            # of a page-locked buffer that the next save then found still in use.
            del task


# Work on at least this many bytes is shared by the workers; less runs on the caller's thread
# (the tasks would cost more than they share).
SHARE_MIN = 1 << 20


def map_sized(fn: Callable[[Any], Any], items: Iterable[Any], nbytes: int) -> list[Any]:
    """``[fn(x) for x in items]``, across the pool when the work covers ``nbytes`` >=
    :data:`SHARE_MIN`."""
    if nbytes < SHARE_MIN:
        return [fn(x) for x in items]
    return pool().map(fn, items)


def ordered(pool: Pool, fn: Callable[[Any], Any], items: Iterable[tuple[Any, int]],
            limit: int, inline_below: int = 0) -> Iterator[Any]:
    """``fn(x)`` for each ``(x, size)`` of ``items``, in order, computed ahead on the pool while
    the sizes of the items in flight stay under ``limit`` (at least one is); items under
    ``inline_below`` are computed on the caller's thread as their turn comes (the later ones
    already started on the pool meanwhile)."""
    pending: collections.deque[tuple[Task | None, Any, int]] = collections.deque()
    held = 0

    def take() -> Any:  # (no task held while suspended: see _work)
        nonlocal held
        task, x, size = pending.popleft()
        held -= size
        return fn(x) if task is None else pool.wait([task])[0]

    for x, size in items:
        while pending and held + size > limit:
            yield take()
        inline = size < inline_below and pool.threads > 1
        pending.append((None, x, size) if inline else (pool.submit(fn, x), None, size))
        held += size
    while pending:
        yield take()


_pool: Pool | None = None
_copy_pool: Pool | None = None
_pool_lock = threading.Lock()


def pool() -> Pool:
    """The process's pool, started on first use (and again in a forked child)."""
    global _pool
    with _pool_lock:
        _pool = _alive(_pool, count)
        return _pool


def copy_pool() -> Pool:
    """The process's pool for copies into memory, started as :func:`pool` is."""
    global _copy_pool
    with _pool_lock:
        _copy_pool = _alive(_copy_pool, copy_count)
        return _copy_pool


def _alive(found: Pool | None, threads: Callable[[], int]) -> Pool:
    return found if found is not None and found.pid == os.getpid() else Pool(threads())


def _forget_pool() -> None:
    # A forked child has none of the parent's workers, and a lock a worker held stays held.
    global _pool, _copy_pool, _pool_lock
    _pool, _copy_pool, _pool_lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class Prefetch:
    """``fn(key)`` for the ``(key, size)`` of ``order``, computed ahead on the pool (at most
    ``limit`` of size in flight; those under ``inline_below`` on the caller's thread, as
    :func:`ordered` does) for a caller that asks for them mostly in that order: ``get``
    of the next key takes its result, of a later key computes the ones between too (keeping
    them), of another key calls ``fn`` on this thread."""

    def __init__(self, fn: Callable[[Any], Any], order: Iterable[tuple[Any, int]],
                 limit: int, inline_below: int = 0) -> None:
        order = list(order)
        self._fn = fn
        self._keys = collections.deque(k for k, _ in order)
        self._ahead = ordered(pool(), fn, order, limit, inline_below)
        self._held: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        if key in self._held:
            return self._held.pop(key)
        if key not in self._keys:
            return self._fn(key)
        while True:
            k = self._keys.popleft()
            value = next(self._ahead)
            if k == key:
                return value
            self._held[k] = value
