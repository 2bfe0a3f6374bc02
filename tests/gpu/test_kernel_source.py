"""The source handed to CuPy names the kernels' headers by digest (runs without a GPU): CuPy's
on-disk cache is keyed by the source text, so a header changed alone must change the text, or
an upgraded install would load kernels compiled from the old header."""

from __future__ import annotations

from s4weights.gpu import runtime


def test_a_changed_header_changes_every_kernel_source(tmp_path) -> None:
    (tmp_path / "a.cu").write_text('#include "h.cuh"\nvoid k() {}\n')
    (tmp_path / "h.cuh").write_text("#define W 7\n")
    before = runtime.kernel_source("a", tmp_path)
    assert before.endswith('#include "h.cuh"\nvoid k() {}\n')
    assert runtime.kernel_source("a", tmp_path) == before
    # a source kept elsewhere (bench/'s probes) that includes the folder's headers
    (tmp_path / "elsewhere").mkdir()
    probe = tmp_path / "elsewhere" / "p.cu"
    probe.write_text('#include "h.cuh"\n')
    other = runtime.kernel_source("", tmp_path, source=probe)
    assert other.endswith('#include "h.cuh"\n') and other.splitlines()[0] == before.splitlines()[0]
    (tmp_path / "h.cuh").write_text("#define W 6\n")
    assert runtime.kernel_source("a", tmp_path) != before
    assert runtime.kernel_source("", tmp_path, source=probe) != other


def test_the_shipped_kernels_compile_from_their_files() -> None:
    for cu in runtime.KERNELS.glob("*.cu"):
        src = runtime.kernel_source(cu.stem)
        assert src.splitlines()[0].startswith("// headers ")
        assert src.split("\n", 1)[1] == cu.read_text()
