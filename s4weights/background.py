"""A writer thread: the sink's writes run while the caller's thread codes the next tensors, so
a save takes about the longer of the two instead of their sum. Coding never moves: torch's
current stream is per thread, and the CPU coders share state that is not thread-safe. The
sink is written from this thread (one thread at a time, never two at once).

Jobs run one at a time, in submission order. The bytes of payloads waiting in the queue are
bounded (one job is always accepted, however large): queued GPU results hold pinned host
memory. A job's exception stops the thread; the caller sees it at its next ``submit`` or at
``finish``, with nothing after it written.

``finish`` and ``abort`` return only once the thread has stopped, even when interrupted
(Ctrl-C): the caller aborts the sink next, and a thread still writing into it would race that.
A first interrupt during the wait drops the jobs not started, lets the running one end, and is
raised then; a second one is raised at once (a write that hangs must not make the save
impossible to stop).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable


class Background:
    def __init__(self, limit: int, name: str = "s4w-writer") -> None:
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[Callable[[], None], int]] = collections.deque()
        self._queued = 0
        self._limit = limit
        self._error: BaseException | None = None
        self._closing = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        """Queue ``job`` (holding about ``nbytes`` of payload); waits while the queue holds
        more than the limit. Raises the error of a job that failed before."""
        with self._cv:
            while self._error is None and self._queued and self._queued + nbytes > self._limit:
                self._cv.wait()
            if self._error is not None:
                raise self._error
            self._jobs.append((job, nbytes))
            self._queued += nbytes
            self._cv.notify_all()

    def finish(self) -> None:
        """Wait until every job has run; raise the first job error."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._wait_stopped()
        if self._error is not None:
            raise self._error

    def abort(self) -> BaseException | None:
        """Drop the jobs not started yet and wait for the running one (the caller failed).
        Returns the error a job raised before, if any (the caller's own error is what it
        raises; this one would otherwise be lost)."""
        with self._cv:
            self._jobs.clear()
            self._closing = True
            self._cv.notify_all()
        self._wait_stopped()
        return self._error

    def _wait_stopped(self) -> None:
        interrupt: BaseException | None = None
        while True:
            try:
                with self._cv:
                    while not self._stopped:
                        self._cv.wait()
                break
            except KeyboardInterrupt as exc:  # not now: the running job is inside the sink
                if interrupt is not None:
                    raise  # the second one: the user insists
                interrupt = exc
                with self._cv:
                    self._jobs.clear()
                    self._closing = True
                    self._cv.notify_all()
        self._thread.join()
        if interrupt is not None:
            raise interrupt

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._cv:
                self._stopped = True
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs[0]
            try:
                job()
                job = None  # its payload can go before the next job arrives
            except BaseException as exc:  # handed to the caller's thread
                with self._cv:
                    self._error = exc
                    self._jobs.clear()
                    self._queued = 0
                    self._cv.notify_all()
                return
            with self._cv:
                if self._jobs:
                    self._jobs.popleft()
                self._queued -= nbytes
                self._cv.notify_all()


class Inline:
    """``Background``'s interface, running each job at once on the caller's thread."""

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        job()

    def finish(self) -> None:
        pass

    def abort(self) -> BaseException | None:
        return None
