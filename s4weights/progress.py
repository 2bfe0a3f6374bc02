"""Progress bars for long saves and loads: shown on a terminal, silent otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

# Below this many bytes a bar is noise.
MIN_BYTES = 64 << 20


class Silent:
    """A bar that is never drawn. It is not a disabled tqdm: tqdm takes a lock shared with
    forked children and starts a monitor thread, and a child killed holding that lock would
    hang its siblings."""

    def update(self, n: int = 1) -> None:
        pass


Bar = tqdm | Silent


@contextmanager
def bar(desc: str, total_bytes: int, enabled: bool | None,
        min_bytes: int = MIN_BYTES) -> Iterator[Bar]:
    if enabled is None:
        enabled = sys.stderr.isatty() and total_bytes >= min_bytes
    if not enabled:
        yield Silent()
        return
    with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              leave=False) as t:
        yield t
