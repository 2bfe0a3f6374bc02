"""Run a command (as root) in a private mount namespace where the given folders are reachable
by every user at their usual paths, then exec it: ``unshare --mount --propagation private
python reachable.py STASH DIR... -- CMD...``, with STASH an empty folder outside every DIR (the
caller removes it afterwards).

The privilege tests start the runner as root and check that it continues as a throwaway user;
that user must be able to read the interpreter, the site-packages and the checkout, which on
a test machine may lie under a 0700 home. For each such closed ancestor, this namespace (and
only it) mounts an empty 0755 tmpfs over it and binds back just the children on the way to the
folders asked for, so nothing else of that home is exposed and the host is left as it was.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path


def closed_ancestor(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that others cannot traverse."""
    for p in reversed(path.parents):
        if p != Path("/") and not os.stat(p).st_mode & stat.S_IXOTH:
            return p
    return None


def open_up(closed: Path, wanted: list[Path], stash_root: Path) -> None:
    stash = stash_root / f"s{len(list(stash_root.iterdir()))}"
    stash.mkdir()
    subprocess.run(["mount", "--bind", str(closed), str(stash)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", str(closed)],
                   check=True)
    for child in sorted({w.relative_to(closed).parts[0] for w in wanted
                         if closed in w.parents}):
        src, dst = stash / child, closed / child
        if src.is_dir():
            dst.mkdir()
        else:
            dst.touch()
        subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    stash_root = Path(argv[0])
    wanted = [Path(a).resolve() for a in argv[1:sep]]
    command = argv[sep + 1:]
    # the stash's mounts must outlive the tmpfs laid over a closed ancestor of the stash
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=1m", "tmpfs",
                    str(stash_root)], check=True)
    for _ in range(8):  # one closed ancestor per round; deeper ones are found after binding
        closed = sorted({c for w in wanted if (c := closed_ancestor(w)) is not None},
                        key=lambda p: len(p.parts))
        if not closed:
            break
        open_up(closed[0], wanted, stash_root)
    os.execvp(command[0], command)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
