"""Numba kernels compiled on their first call, so that importing s4format (the CLIs, ``inspect``,
a reader that decodes nothing) does not import numba, which takes longer than the rest.

:func:`kernel` marks a function as an ``njit`` kernel (``cache=True``: compiled once per machine
and loaded from numba's cache after). Kernels are serial and release the GIL: the CPU path runs
them on :mod:`s4format.threads`'s workers, one piece of a plane each.

On the first call of any marked kernel, the kernels built ahead of time for this machine
(:mod:`s4format.kernels`, ``python -m s4format kernels build``) are used where they exist:
they load without numba, whose import and start-up cost a fresh process about half a second.
A call whose argument types no kernel was built for, or any call where none were built, runs
numba's compiled kernel: every kernel marked so far is then compiled lazily by numba and
replaces its placeholder in its module, so kernels may call each other by their global names.
``S4_KERNELS=jit`` in the environment skips the kernels built ahead of time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from s4format.kernels import array_flags

# Every kernel and intrinsic marked, as (module globals, name, function[, njit options]).
_kernels: list[tuple[dict[str, Any], str, Callable[..., Any], dict[str, Any]]] = []
_intrinsics: list[tuple[dict[str, Any], str, Callable[..., Any]]] = []
_lock = threading.RLock()
_built: dict[str, dict[tuple, Callable[..., Any]]] | None = None  # loaded on first use
# (module, name) -> argument types of the calls that found no kernel built ahead of time
fallbacks: dict[str, set[tuple]] = {}


def numba_started() -> bool:
    """Whether this process started numba for a kernel (none built ahead of time here, or a
    call with argument types none was built for)."""
    return any(not isinstance(module.get(name), _Kernel) for module, name, *_ in _kernels)


def started() -> bool:
    """Whether a kernel has run in this process (built ahead of time or numba's), so that
    another costs no start-up."""
    return _built is not None or numba_started()


def bound() -> list[tuple[dict[str, Any], str]]:
    """``(module globals, name)`` of each kernel bound so far (built ahead of time or numba's):
    what a profiler may wrap. Placeholders are left out: one binds on its first call, and
    wrapped it would bind to its own wrapper."""
    with _lock:
        return [(module, name) for module, name, *_ in _kernels
                if type(module.get(name)) is not _Kernel]


def _qualname(module: dict[str, Any], name: str) -> str:
    return f"{module['__name__']}.{name}"


class _Kernel:
    """The placeholder of a kernel not bound yet; calling it binds it (see the module)."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self._func = func
        self._dispatcher: Any = None
        self.__doc__ = func.__doc__
        self.__name__ = func.__name__

    def __call__(self, *args: Any) -> Any:
        if self._dispatcher is None:
            self._dispatcher = _bind(self._func)
        return self._dispatcher(*args)

    @property
    def py_func(self) -> Callable[..., Any]:
        return self._func


class _Built(_Kernel):
    """A kernel built ahead of time: the built function for the calls' argument types, or
    numba's kernel for types none was built for (which then binds every kernel to numba)."""

    def __init__(self, func: Callable[..., Any], by_key: dict[tuple, Callable[..., Any]]) -> None:
        super().__init__(func)
        self._by_key = by_key
        self._numba: Any = None
        self._params = func.__code__.co_argcount
        self._defaults = func.__defaults__ or ()

    def __call__(self, *args: Any) -> Any:
        given = args
        missing = self._params - len(args)
        if 0 < missing <= len(self._defaults):  # a built function takes every argument
            given = args + self._defaults[len(self._defaults) - missing:]
        key = arguments_key(given)
        built = self._by_key.get(key)
        if built is not None:
            return built(*given)
        fallbacks.setdefault(_qualname(self._func.__globals__, self._func.__name__),
                             set()).add(key)
        if self._numba is None:
            self._numba = _numba_kernel(self._func)
        return self._numba(*args)


def kernel(**options: Any) -> Callable[[Callable[..., Any]], _Kernel]:
    """Decorator: ``func`` becomes ``numba.njit(cache=True, nogil=True, **options)(func)`` at
    the first call of any kernel (without ``cache`` where numba finds no folder to write), or
    the kernel built ahead of time from it."""
    def mark(func: Callable[..., Any]) -> _Kernel:
        with _lock:
            _kernels.append((func.__globals__, func.__name__, func, options))
        return _Kernel(func)
    return mark


def intrinsic(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``func`` becomes ``numba.extending.intrinsic(func)`` before the first kernel
    compiles, so that kernels may call it by its global name without importing numba early."""
    with _lock:
        _intrinsics.append((func.__globals__, func.__name__, func))
    return func


def target_has(context: Any, *features: str) -> bool:
    """Whether numba's target in ``context`` (an intrinsic's codegen) has every CPU feature
    named (LLVM's names: "avx512bw"), so that an intrinsic may emit what needs them."""
    import llvmlite.binding

    codegen = context.codegen()
    found = getattr(codegen, "_tm_features", "") or ""
    if not found and getattr(codegen, "_cpu_name", None) == "host":
        # (ahead of time, s4format.kernelbuild, for this CPU: numba's codegen names no features)
        found = llvmlite.binding.get_host_cpu_features().flatten()
    have = found.split(",")
    return all(f"+{f}" in have for f in features)


# The vector kernels' intrinsics (word expands and compresses among them) as named and typed
# from LLVM 20 on, the oldest LLVM they were checked with here; an older llvmlite keeps the
# scalar loops.
LLVM_VECTORS = (20, 0)


def vbmi2_vectors(context: Any) -> bool:
    """Whether numba's target in ``context`` has AVX-512 F, BW and VBMI2 and an LLVM that knows
    the intrinsics the vector kernels call (rANS rows, masked words)."""
    return _llvm_vectors() and target_has(context, "avx512f", "avx512bw", "avx512vbmi2")


def avx2_vectors(context: Any) -> bool:
    """Whether numba's target in ``context`` has AVX2 and an LLVM that knows the intrinsics the
    AVX2 kernels call (rANS rows by 8-lane gathers and word permutes)."""
    return _llvm_vectors() and target_has(context, "avx2")


def any_vectors(context: Any) -> bool:
    """Whether numba's target in ``context`` runs either kind of vector kernel:
    :func:`vbmi2_vectors` or :func:`avx2_vectors`."""
    return vbmi2_vectors(context) or avx2_vectors(context)


def _llvm_vectors() -> bool:
    import llvmlite.binding

    return tuple(llvmlite.binding.llvm_version_info[:2]) >= LLVM_VECTORS


def lane_picks(kind: str) -> list[int]:
    """For each 8-lane mask, the lane of the source each lane of a permute takes (0 where the
    mask clears it): "compress", lane k takes the k-th lane set (lowest first); "expand", the
    k-th lane set takes lane k; "below", the k-th of the c lanes set takes lane 8 - c + k (of
    the 8 words just below a pointer, the lowest lane the lowest of the c words a lane takes)."""
    out = []
    for mask in range(256):
        on = [lane for lane in range(8) if mask >> lane & 1]
        picks = [0] * 8
        if kind == "compress":
            picks[:len(on)] = on
        else:
            for k, lane in enumerate(on):
                picks[lane] = k if kind == "expand" else 8 - len(on) + k
        out += picks
    return out


def _table_row(builder: Any, name: str, values: list[int], width: int, mask: Any) -> Any:
    """Row ``mask`` (an i8) of the constant table ``name`` of 256 rows of ``values``' ints of
    ``width`` bits (made in the module being built on first use), as one vector."""
    from llvmlite import ir

    item, i64 = ir.IntType(width), ir.IntType(64)
    lanes = len(values) // 256
    table = builder.module.globals.get(name)
    if table is None:
        kind_type = ir.ArrayType(item, len(values))
        table = ir.GlobalVariable(builder.module, kind_type, name)
        table.linkage = "internal"
        table.global_constant = True
        table.initializer = ir.Constant(kind_type, values)
    row = builder.mul(builder.zext(mask, i64), ir.Constant(i64, lanes))
    return builder.load(builder.bitcast(builder.gep(table, [ir.Constant(i64, 0), row]),
                                        ir.PointerType(ir.VectorType(item, lanes))),
                        align=width // 8)


def permute8(builder: Any, words: Any, mask: Any, kind: str) -> Any:
    """``words`` (<8 x i32>) permuted by the 8-lane ``mask`` (<8 x i1>) as :func:`lane_picks`
    says for ``kind``: AVX2's expand and compress, which it has no instruction for, as one
    permute by a row of a constant table (8 KiB) in the module being built."""
    from llvmlite import ir
    from numba.core import cgutils

    v8 = ir.VectorType(ir.IntType(32), 8)
    picks = _table_row(builder, f"s4_lanes_{kind}", lane_picks(kind), 32,
                       builder.bitcast(mask, ir.IntType(8)))
    permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8]),
                                             "llvm.x86.avx2.permd")
    return builder.call(permute, [words, picks])


def shuffle8x16(builder: Any, words: Any, mask: Any, kind: str) -> Any:
    """:func:`permute8` of 8 words of 16 bits (<8 x i16>) by the i8 ``mask``, as one byte
    shuffle (SSSE3's pshufb) by a row of a constant table (4 KiB); with "expand", the lanes
    the mask clears are zero."""
    from llvmlite import ir
    from numba.core import cgutils

    v16 = ir.VectorType(ir.IntType(8), 16)
    picks = lane_picks(kind)
    cleared = [not (m >> lane & 1) and kind == "expand" for m in range(256) for lane in range(8)]
    # (a pshufb index with its top bit set writes a zero byte)
    values = [0x80 if off else 2 * pick + half
              for pick, off in zip(picks, cleared) for half in (0, 1)]
    row = _table_row(builder, f"s4_bytes_{kind}", values, 8, mask)
    shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16]),
                                             "llvm.x86.ssse3.pshuf.b.128")
    got = builder.call(shuffle, [builder.bitcast(words, v16), row])
    return builder.bitcast(got, words.type)


def constant(value: Callable[[Any], bool]) -> Callable[..., Any]:
    """An intrinsic's codegen of the boolean constant ``value(context)``."""
    from numba.core import types

    def codegen(context, builder, signature, args):
        return context.get_constant(types.boolean, value(context))

    return codegen


def arguments_key(args: tuple) -> tuple:
    """The types of a call's arguments as numba would type them, as :mod:`s4format.kernels`
    names a built kernel's: an array as (dtype, dimensions, ``array_flags``), a scalar as
    its numba type's name, a tuple as ("t", its items); None where numba's type would be
    another kind."""
    return tuple(map(_value_key, args))


# numpy's flag bits: C- and F-contiguous, writeable (ndarray.flags.num)
_C, _F, _WRITEABLE = 0x1, 0x2, 0x400
_FLAG_BITS = _C | _F | _WRITEABLE
_FLAGS = {bits: array_flags("C" if bits & _C else "F" if bits & _F else "A",
                            not bits & _WRITEABLE)
          for bits in range(_FLAG_BITS + 1) if not bits & ~_FLAG_BITS}


def _value_key(v: Any) -> Any:
    # (numba's typeof rules for these kinds; an array key costs about 0.3 us: a call's
    # overhead, paid by each of a save's thousand or so kernel calls)
    if isinstance(v, np.ndarray):
        return (v.dtype, v.ndim, _FLAGS[v.flags.num & _FLAG_BITS])
    t = type(v)
    if t is int:
        return "int64" if -(1 << 63) <= v < (1 << 63) else "uint64" if 0 <= v < (1 << 64) \
            else None
    if t is bool:
        return "bool"
    if t is float:
        return "float64"
    if t is tuple:
        return ("t", *map(_value_key, v))
    if isinstance(v, np.generic):
        return v.dtype.name
    return None


def _bind(func: Callable[..., Any]) -> Any:
    """What calls of ``func`` run from now on: its kernels built ahead of time, else numba's."""
    global _built
    module, name = func.__globals__, func.__name__
    with _lock:
        if type(module.get(name)) is not _Kernel:
            return module[name]  # bound already (by another kernel's first call)
        if _built is None:
            _built = {}
            if os.environ.get("S4_KERNELS", "").strip().lower() != "jit":
                from s4format import kernels

                _built = kernels.load()
        by_key = _built.get(_qualname(module, name))
        if by_key:
            module[name] = _Built(func, by_key)
            return module[name]
    return _numba_kernel(func)


def _numba_kernel(func: Callable[..., Any]) -> Any:
    """numba's kernel of ``func``, every marked kernel compiled lazily by numba first."""
    compile_all()
    return func.__globals__[func.__name__]


class _NoSciPyBLAS:
    """An import hook that refuses ``scipy.linalg`` to the thread that installed it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "scipy.linalg" and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"{name} is held back while numba loads", name=name)


def _load_numba_arraymath() -> None:
    """Import numba's array functions without SciPy's linear algebra. numba imports them with
    its first kernel, and their import-time BLAS check imports ``scipy.linalg`` where SciPy is
    installed: 0.6-0.8 s, most of a first save's extra time, for numba's BLAS inner product
    (np.correlate and np.convolve of floats in jitted code), which then loops instead. Our
    kernels use no BLAS; numba's linear algebra still imports SciPy when it is compiled."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    hook = _NoSciPyBLAS()
    sys.meta_path.insert(0, hook)
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        sys.meta_path.remove(hook)


def compile_all() -> None:
    """Bind every kernel marked so far to numba's (compiled lazily, on each one's first call
    with new argument types), in place of placeholders and kernels built ahead of time."""
    import numba

    with _lock:
        _load_numba_arraymath()
        from numba.extending import intrinsic as numba_intrinsic

        for module, name, func in _intrinsics:
            if module.get(name) is func:
                module[name] = numba_intrinsic(func)
        # Every kernel's dispatcher made first, then all put in place at once: a thread that
        # calls a kernel already in place compiles it at once, outside this lock, and a kernel
        # it calls that is still a placeholder fails its typing ("Untyped global name").
        made: list[tuple[dict[str, Any], str, Any]] = []
        for module, name, func, options in _kernels:
            if isinstance(module.get(name), _Kernel):  # (a placeholder, or built)
                try:
                    kernel = numba.njit(cache=True, nogil=True, **options)(func)
                    _lock_cache(kernel)
                except RuntimeError:  # no writable cache folder: compiled in each process
                    kernel = numba.njit(nogil=True, **options)(func)
                made.append((module, name, kernel))
        for module, name, kernel in made:
            module[name] = kernel


# numba names the file of a signature it saves from the cache index it reads first, then writes
# the index and the file. Two processes saving other signatures of one kernel at once (the
# ranks of a distributed job on an empty cache, or just after an upgrade) can name theirs alike:
# the index then gives one signature the other's code, which crashes the process that loads it
# (numba issue 4807). Each kernel's cache is read and written under a lock of its folder.
CACHE_LOCK = "s4format-numba.lock"


def _lock_cache(kernel: Any) -> None:
    """Give numba's dispatcher ``kernel`` (made with ``cache=True``) a cache whose loads and
    saves each hold :data:`CACHE_LOCK` in its folder, across processes."""
    from numba.core.caching import FunctionCache

    global _LockedCache
    if type(getattr(kernel, "_cache", None)) is not FunctionCache:
        return  # (another numba's layout: its own cache is kept)
    if _LockedCache is None:
        class LockedCache(FunctionCache):
            def load_overload(self, sig: Any, target_context: Any) -> Any:
                with _folder_lock(self._cache_path):
                    return super().load_overload(sig, target_context)

            def save_overload(self, sig: Any, data: Any) -> None:
                with contextlib.suppress(OSError):  # (numba's save says why it cannot)
                    self._impl.locator.ensure_cache_path()
                with _folder_lock(self._cache_path):
                    super().save_overload(sig, data)

        _LockedCache = LockedCache
    kernel._cache = _LockedCache(kernel.py_func)


_LockedCache: Any = None


@contextlib.contextmanager
def _folder_lock(folder: str) -> Iterator[None]:
    """An exclusive lock of ``folder`` (its file :data:`CACHE_LOCK`) across processes, held
    while in the block; none where the folder or the lock cannot be had (a cache folder not made
    yet holds nothing to load; a file system without locks: numba's own behaviour)."""
    try:
        import fcntl
    except ImportError:  # (not on POSIX)
        yield
        return
    try:
        fd = os.open(os.path.join(folder, CACHE_LOCK), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (which lets the lock go)
