"""Kernels compiled by several processes at once into one numba cache: each signature's code
stays its own. numba names a signature's file from the index it read before saving, so two
processes saving other signatures of one kernel could both name theirs ``.1.nbc``; the index
then gave one signature the other's code (numba issue 4807; a distributed job's ranks on an
empty cache). ``s4format.jit`` reads and writes each kernel's cache under a lock of its folder.

The drivers below force that interleaving with files as barriers, each wait given up after a
few seconds (under the lock the other process cannot reach its side of the barrier)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

KERNEL = '''
from s4format.jit import kernel


@kernel()
def add(a, b):  # pragma: no cover - compiled
    return a + b * 2
'''

DRIVER = '''
import os, sys, time
import numba.core.caching as caching

role, here = sys.argv[1], sys.argv[2]
C = caching.IndexDataCacheFile


def mark(name):
    open(os.path.join(here, name), "w").close()


def wait(name, seconds=3.0):
    end = time.monotonic() + seconds
    while not os.path.exists(os.path.join(here, name)) and time.monotonic() < end:
        time.sleep(0.01)


if role == "float":  # reads the index, then saves it and its code after the other's index
    save, load_index, save_data = C.save, C._load_index, C._save_data
    saving = []

    def saving_save(self, key, data):
        saving.append(1)
        return save(self, key, data)

    def late_load_index(self):
        found = load_index(self)
        if saving:
            mark("float_read")
            wait("int_index_saved")
        return found

    def marked_save_data(self, name, data):
        save_data(self, name, data)
        mark("float_data_saved")

    C.save, C._load_index, C._save_data = saving_save, late_load_index, marked_save_data
elif role == "int":  # saves its index between the other's read and save, its code last
    save_index, save_data = C._save_index, C._save_data

    def between_save_index(self, overloads):
        wait("float_read")
        save_index(self, overloads)
        mark("int_index_saved")

    def last_save_data(self, name, data):
        wait("float_data_saved")
        save_data(self, name, data)

    C._save_index, C._save_data = between_save_index, last_save_data

import racekernel

if role == "int":
    print(racekernel.add(2, 3))
elif role == "float":
    print(racekernel.add(2.5, 0.25))
else:
    print(racekernel.add(2, 3), racekernel.add(2.5, 0.25))
'''


def test_two_processes_saving_one_kernel_keep_each_signature_its_code(tmp_path: Path) -> None:
    (tmp_path / "racekernel.py").write_text(textwrap.dedent(KERNEL))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "S4_KERNELS": "jit",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    def run(role: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), role,
                                 str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    both = [run("float"), run("int")]
    outs = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["3.0", "8"]
    # a third process loads both signatures from the cache the two left
    check = run("check")
    out, err = check.communicate(timeout=120)
    assert check.returncode == 0, err
    assert out.strip() == "8 3.0"
    assert len(list((tmp_path / "cache").rglob("*.nbc"))) == 2  # one file a signature
