"""The source handed to CuPy names the kernels' headers by digest (runs without a GPU): CuPy's
on-disk cache is keyed by the source text, so a header changed alone must change the text, or
an upgraded install would load kernels compiled from the old header."""

from __future__ import annotations

import pytest

from s4weights.gpu import runtime


def test_a_changed_header_changes_every_kernel_source(tmp_path) -> None:
    (tmp_path / "a.cu").write_text('#include "h.cuh"\nvoid k() {}\n')
    (tmp_path / "h.cuh").write_text("#define W 7\n")
    before = runtime.kernel_source("a", tmp_path)
    assert before.endswith('#include "h.cuh"\nvoid k() {}\n')
    assert runtime.kernel_source("a", tmp_path) == before
    (tmp_path / "h.cuh").write_text("#define W 6\n")
    assert runtime.kernel_source("a", tmp_path) != before


def test_the_shipped_kernels_compile_from_their_files() -> None:
    for cu in runtime.KERNELS.glob("*.cu"):
        src = runtime.kernel_source(cu.stem)
        assert src.splitlines()[0].startswith("// headers ")
        assert src.split("\n", 1)[1] == cu.read_text()


def test_the_first_request_compiles_every_module_at_once(monkeypatch) -> None:
    # runtime._module: a cold process waits for the slowest module, not for their sum; each
    # module is compiled once per device, and a failed compile is compiled again
    import threading

    monkeypatch.setattr(runtime, "_MODULES", {})
    names = sorted(p.stem for p in runtime.KERNELS.glob("*.cu"))
    started = threading.Barrier(len(names), timeout=10)  # every compile running at once
    calls: list[tuple[str, int]] = []
    fail = {"rans"}

    def compiled(name: str, device: int):
        calls.append((name, device))
        started.wait()
        if name in fail:
            fail.discard(name)
            raise RuntimeError(f"nvrtc: {name}")
        return f"module {name} on {device}"

    monkeypatch.setattr(runtime, "_compiled", compiled)
    assert runtime._module("planes", 0) == "module planes on 0"
    assert sorted(calls) == [(n, 0) for n in names]
    for n in names:
        if n != "rans":
            assert runtime._module(n, 0) == f"module {n} on 0"
    # rans failed in the background, unrequested: forgotten at once, so the next request
    # compiles it again, alone
    failed = runtime._MODULES.get(("rans", 0))
    if failed is not None:
        with pytest.raises(RuntimeError, match="nvrtc: rans"):
            failed.result(timeout=10)
    assert ("rans", 0) not in runtime._MODULES
    started = threading.Barrier(1, timeout=10)
    assert runtime._module("rans", 0) == "module rans on 0"
    assert len(calls) == len(names) + 1
    started = threading.Barrier(len(names), timeout=10)
    assert runtime._module("copy", 1) == "module copy on 1"  # another device: its own
    assert len(calls) == 2 * len(names) + 1


def test_a_module_whose_thread_cannot_start_is_compiled_by_the_caller(monkeypatch) -> None:
    # Thread.start raises under a limit on threads, or from an atexit handler (Python 3.12):
    # the caller compiles that module itself, and no request waits for ever
    import threading

    monkeypatch.setattr(runtime, "_MODULES", {})
    monkeypatch.setattr(runtime, "_compiled", lambda name, device: (
        threading.current_thread().name, name))
    real = threading.Thread.start

    def start(self):
        if self.name == "s4weights-nvrtc-copy":
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    me = threading.current_thread().name
    assert runtime._module("copy", 0) == (me, "copy")
    assert runtime._module("rans", 0) == ("s4weights-nvrtc-rans", "rans")


def test_an_interrupted_compile_raises_and_is_compiled_again(monkeypatch) -> None:
    # Ctrl-C while the caller compiles a module itself (no thread could start) reaches the
    # caller; while it starts the threads, the modules not yet started fail (nobody waits for
    # ever); either way the next request compiles them again
    import threading

    monkeypatch.setattr(runtime, "_MODULES", {})
    interrupt = {"compile": "copy", "start": None}

    def compiled(name: str, device: int):
        if interrupt["compile"] == name:
            interrupt["compile"] = None
            raise KeyboardInterrupt
        return name

    real = threading.Thread.start

    def start(self):
        if interrupt["start"] == self.name:
            interrupt["start"] = None
            raise KeyboardInterrupt
        if self.name.startswith("s4weights-nvrtc-") and interrupt["compile"]:
            raise RuntimeError("can't start new thread")  # (the caller compiles)
        return real(self)

    monkeypatch.setattr(runtime, "_compiled", compiled)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        runtime._module("rans", 0)  # copy comes first, in the caller
    assert ("copy", 0) not in runtime._MODULES
    assert runtime._module("copy", 0) == "copy"

    monkeypatch.setattr(runtime, "_MODULES", {})
    interrupt["start"] = "s4weights-nvrtc-copy"
    with pytest.raises(KeyboardInterrupt):
        runtime._module("rans", 0)
    assert all(f.done() for f in runtime._MODULES.values())
    assert runtime._module("rans", 0) == "rans"
    assert runtime._module("planes", 0) == "planes"
