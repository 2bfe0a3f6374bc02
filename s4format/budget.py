"""The decode budget (``spec/validation.md``, rule L1): how many decoded bytes one load may
allocate. Codecs expand a few stored bytes up to 2^20 times, so a file of kilobytes can declare
more tensors than memory holds; a load sums what it will decode and refuses it, before it
allocates anything, when the sum is over the budget. The default is the memory available now.
"""

from __future__ import annotations

import os
from pathlib import Path

from s4format.errors import LimitError

_CGROUP = Path("/sys/fs/cgroup")


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def available_memory() -> int:
    """Memory a load can still take: Linux's MemAvailable plus free swap, within what the
    process's cgroup (v2) and address-space limit (``ulimit -v``) allow; physical memory
    where none of these can be read."""
    meminfo = _meminfo()
    free = (meminfo["MemAvailable"] + meminfo.get("SwapFree", 0)) * 1024 \
        if "MemAvailable" in meminfo else physical_memory()
    rooms = [room for room in (_cgroup_room(), _address_space_room()) if room is not None]
    return min([free, *rooms])


def check(total: int, budget: int, where: str) -> None:
    """LimitError naming ``where`` when ``total`` decoded bytes are over ``budget``."""
    if total > budget:
        raise LimitError(f"{where}: the load decodes {total} bytes, more than its budget of "
                         f"{budget} (max_decoded_bytes; by default the memory available): "
                         "free memory, or pass a larger max_decoded_bytes if the file is "
                         "trusted and the memory is there")


def _meminfo() -> dict[str, int]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name] = int(fields[0])
    return out


def _cgroup_room() -> int | None:
    """memory.max minus memory.current of this process's cgroup v2, or None (no limit)."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split("::", 1)[1]
        group = _CGROUP / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        used = int((group / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def _address_space_room() -> int | None:
    """RLIMIT_AS minus this process's virtual size, or None (no limit, or not Linux)."""
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        status = Path("/proc/self/status").read_text()
        size = next(int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration, ValueError):
        return None
    return max(0, limit - size * 1024)
