"""Run code in a child process whose numba compiles for a generic CPU (no AVX2 nor AVX-512), so a
test can compare the vector kernels this machine runs with the scalar ones every machine has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def on_generic_cpu(tmp_path: Path, module: str, expression: str) -> Any:
    """The value (through JSON) of ``expression`` evaluated in ``module``'s namespace (a test
    module, as ``tests.codecs.test_rans_rows``) in a child process compiling for a generic
    CPU, with a numba cache of its own in ``tmp_path``."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path),
               S4_KERNELS="jit")
    code = ("import importlib, json, sys; sys.path.insert(0, sys.argv[1]); "
            "m = importlib.import_module(sys.argv[2]); "
            "print(json.dumps(eval(sys.argv[3], vars(m))))")
    child = subprocess.run([sys.executable, "-c", code, str(ROOT), module, expression],
                           env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def vbmi2_vectors_expected() -> bool:
    """Whether this CPU and numba's LLVM should run the kernels gated by
    :func:`s4format.jit.vbmi2_vectors` (Linux flags)."""
    return _vectors_expected({"avx512f", "avx512bw", "avx512_vbmi2"})


def avx2_vectors_expected() -> bool:
    """Whether this CPU and numba's LLVM should run the kernels gated by
    :func:`s4format.jit.avx2_vectors` (Linux flags)."""
    return _vectors_expected({"avx2"})


def _vectors_expected(flags: set[str]) -> bool:
    import llvmlite.binding

    from s4format import jit

    return flags <= cpu_flags() and \
        tuple(llvmlite.binding.llvm_version_info[:2]) >= jit.LLVM_VECTORS
