"""Progress bars for long saves and loads: shown on a terminal, silent otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

# Below this many bytes a bar is noise.
MIN_BYTES = 64 << 20


@contextmanager
def bar(desc: str, total_bytes: int, enabled: bool | None) -> Iterator[tqdm]:
    if enabled is None:
        enabled = sys.stderr.isatty() and total_bytes >= MIN_BYTES
    with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              disable=not enabled, leave=False) as t:
        yield t
