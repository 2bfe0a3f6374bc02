"""Binding the kernels to numba's: all of them are put in place at once. A thread that calls a
kernel already in place compiles it outside the binding's lock; had a kernel it calls still
been a placeholder, its typing failed ("Untyped global name '_count_fields'"), which an H100
host's GPU tests met on the first save coded on the CPU in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent("""
    import numba
    from s4format import jit
    from s4format.codecs import view  # noqa: F401 - its kernels registered

    def placed():
        return sum(not isinstance(module.get(name), jit._Kernel)
                   for module, name, *_ in jit._kernels)

    seen = []
    njit = numba.njit

    def watching(*args, **kwargs):
        seen.append(placed())  # kernels in place while another's dispatcher is made
        return njit(*args, **kwargs)

    numba.njit = watching
    jit.compile_all()
    print(len(seen), max(seen), placed(), len(jit._kernels))
""")


def test_no_kernel_is_in_place_before_every_one_is_made(tmp_path) -> None:
    env = dict(os.environ, S4_KERNELS="jit", NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    made, most_in_place_meanwhile, placed, kernels = map(int, out)
    assert made == kernels > 0
    assert most_in_place_meanwhile == 0
    assert placed == kernels


_BOUND_PROBE = textwrap.dedent("""
    import numpy as np
    from s4format import jit
    from s4format.codecs import rans

    before = [name for _m, name in jit.bound()]
    rans.normalise(np.array([3, 1] + [0] * 254))
    after = jit.bound()
    names = [name for _m, name in after]
    placeholders = [name for m, name in after if type(m[name]) is jit._Kernel]
    print(len(before), "_normalise" in names, len(placeholders))
""")


def test_bound_lists_the_kernels_called_and_no_placeholder(tmp_path) -> None:
    # A profiler wraps what bound() lists: a placeholder wrapped would bind to its own wrapper.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _BOUND_PROBE], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out == ["0", "True", "0"]
