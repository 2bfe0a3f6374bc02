"""Numba kernels compiled on their first call, so that importing s4format (the CLIs, ``inspect``,
a reader that decodes nothing) does not import numba, which takes longer than the rest.

:func:`kernel` marks a function as an ``njit`` kernel (``cache=True``: compiled once per machine
and loaded from numba's cache after). On the first call of any marked kernel, every kernel
marked so far is compiled lazily by numba and replaces its placeholder in its module, so kernels
may call each other by their global names. Kernels are serial and release the GIL: the CPU path
runs them on :mod:`s4format.threads`'s workers, one piece of a plane each.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

_pending: list[tuple[dict[str, Any], str, Callable[..., Any], dict[str, Any]]] = []
_pending_intrinsics: list[tuple[dict[str, Any], str, Callable[..., Any]]] = []
_lock = threading.Lock()


class _Kernel:
    """The placeholder of a kernel not compiled yet; calling it compiles every pending one."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self._func = func
        self._dispatcher: Any = None
        self.__doc__ = func.__doc__
        self.__name__ = func.__name__

    def __call__(self, *args: Any) -> Any:
        if self._dispatcher is None:
            _compile_pending()
            self._dispatcher = self._func.__globals__[self._func.__name__]
        return self._dispatcher(*args)

    @property
    def py_func(self) -> Callable[..., Any]:
        return self._func


def kernel(**options: Any) -> Callable[[Callable[..., Any]], _Kernel]:
    """Decorator: ``func`` becomes ``numba.njit(cache=True, nogil=True, **options)(func)`` at
    the first call of any kernel (without ``cache`` where numba finds no folder to write)."""
    def mark(func: Callable[..., Any]) -> _Kernel:
        with _lock:
            _pending.append((func.__globals__, func.__name__, func, options))
        return _Kernel(func)
    return mark


def intrinsic(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``func`` becomes ``numba.extending.intrinsic(func)`` before the first kernel
    compiles, so that kernels may call it by its global name without importing numba early."""
    with _lock:
        _pending_intrinsics.append((func.__globals__, func.__name__, func))
    return func


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


def _compile_pending() -> None:
    import numba

    with _lock:
        _load_numba_arraymath()
        if _pending_intrinsics:
            from numba.extending import intrinsic as numba_intrinsic

            for module, name, func in _pending_intrinsics:
                if module.get(name) is func:
                    module[name] = numba_intrinsic(func)
            _pending_intrinsics.clear()
        for module, name, func, options in _pending:
            if isinstance(module.get(name), _Kernel):
                try:
                    module[name] = numba.njit(cache=True, nogil=True, **options)(func)
                except RuntimeError:  # no writable cache folder: compiled in each process
                    module[name] = numba.njit(nogil=True, **options)(func)
        _pending.clear()
