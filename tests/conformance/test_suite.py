"""The conformance suite on the CPU path, and the runner's judgement of external readers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from s4format import conformance

SUITE = conformance.DEFAULT_SUITE
SUITE_1_1 = SUITE.parent / "v1.1"
SUITE_1_3 = SUITE.parent / "v1.3"
SUITE_1_4 = SUITE.parent / "v1.4"
SUITE_1_5 = SUITE.parent / "v1.5"
REFERENCE = f"{sys.executable} {SUITE.parent / 'reference_reader.py'}"


def _manifest_subset(tmp_path: Path, ids: list[str], suite: Path = SUITE) -> Path:
    """A suite folder with only the vectors ``ids`` (files linked from the real suite)."""
    manifest = conformance.load_manifest(suite)
    manifest["vectors"] = [v for v in manifest["vectors"] if v["id"] in ids]
    for v in manifest["vectors"]:
        for name in filter(None, (v["file"], v.get("parent"))):
            if not (tmp_path / name).exists():
                (tmp_path / name).symlink_to(suite / name)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


@pytest.mark.parametrize(("suite", "least"), [(SUITE, 150), (SUITE_1_1, 15), (SUITE_1_3, 20),
                                              (SUITE_1_4, 12)])
def test_every_vector_passes_on_the_cpu_reader(suite: Path, least: int) -> None:
    results = conformance.run_suite(suite)
    failed = [f"{r.id}: {r.got} ({r.detail})" for r in results if not r.passed]
    assert failed == []
    assert len(results) == len(conformance.load_manifest(suite)["vectors"]) > least


def test_default_suites_are_v1_to_v1_5(monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(conformance, "run_suite", lambda suite, *_a, **_k: ran.append(suite) or [])
    monkeypatch.setattr(conformance, "print_table", lambda *_args: None)
    args = argparse.Namespace(reader=None, error_map=None, require=[], device="cpu", suite=None,
                              timeout=10.0, json=False, jobs=1)
    assert conformance.main(args) == 0
    assert ran == [SUITE, SUITE_1_1, SUITE.parent / "v1.2", SUITE_1_3, SUITE_1_4, SUITE_1_5]


def test_reference_reader_through_the_protocol(tmp_path: Path) -> None:
    suite = _manifest_subset(tmp_path, ["tree_all_tags", "major_2", "delta_child",
                                        "delta_parent_missing"])
    results = conformance.run_suite(suite, REFERENCE, timeout=120)
    assert [(r.id, r.passed, r.got) for r in results] == [
        ("tree_all_tags", True, "valid"), ("delta_child", True, "valid"),
        ("major_2", True, "rejected UnsupportedVersionError"),
        ("delta_parent_missing", True, "rejected ParentMismatchError")]


def test_reference_reader_decodes_codec_8(tmp_path: Path) -> None:
    suite = _manifest_subset(tmp_path, ["bitpackw_spec_examples", "bitpackw_padding_low"],
                             SUITE_1_1)
    results = conformance.run_suite(suite, REFERENCE, timeout=120)
    assert [(r.id, r.passed, r.got) for r in results] == [
        ("bitpackw_spec_examples", True, "valid"),
        ("bitpackw_padding_low", True, "rejected CodecError")]


def test_reference_reader_decodes_masked_tensors(tmp_path: Path) -> None:
    suite = _manifest_subset(tmp_path, ["masked_forms", "masked_delta", "masked_delta_bytes",
                                        "masked_count_short"], SUITE_1_4)
    results = conformance.run_suite(suite, REFERENCE, timeout=120)
    assert [(r.id, r.passed, r.got) for r in results] == [
        ("masked_delta", True, "valid"), ("masked_delta_bytes", True, "valid"),
        ("masked_forms", True, "valid"),
        ("masked_count_short", True, "rejected FormatError")]


def test_runner_catches_bad_external_readers(tmp_path: Path) -> None:
    suite = _manifest_subset(tmp_path, ["appendix_a", "major_2"])
    fake = tmp_path / "fake.py"
    # Accepts everything and reports float32 [2] zeros: right names, wrong bytes.
    fake.write_text(
        "import json, pathlib, sys\n"
        "out = pathlib.Path(sys.argv[3])\n"
        "(out / 't').write_bytes(bytes(8))\n"
        "(out / 'index.json').write_text(json.dumps({'tensors': [{'name': 'w', "
        "'dtype': 'float32', 'shape': [2], 'file': 't'}]}))\n")
    results = conformance.run_suite(suite, f"{sys.executable} {fake}")
    assert [(r.id, r.passed, r.got) for r in results] == [
        ("appendix_a", False, "wrong tensors"), ("major_2", False, "accepted")]
    fake.write_text("import sys\nprint('ChecksumError: no', file=sys.stderr)\nsys.exit(1)\n")
    results = conformance.run_suite(suite, f"{sys.executable} {fake}")
    assert [(r.passed, r.got) for r in results] == [
        (False, "rejected ChecksumError"), (False, "rejected ChecksumError")]
    fake.write_text("import sys\nprint('MyOwnName: nope', file=sys.stderr)\nsys.exit(1)\n")
    results = conformance.run_suite(suite, f"{sys.executable} {fake}")
    assert [(r.passed, r.got) for r in results] == [(False, "unknown class")] * 2
    fake.write_text("import sys\nsys.exit(139)\n")
    results = conformance.run_suite(suite, f"{sys.executable} {fake}")
    assert [(r.passed, r.got) for r in results] == [(False, "crash"), (False, "crash")]
    fake.write_text("import time\ntime.sleep(30)\n")
    results = conformance.run_suite(suite, f"{sys.executable} {fake}", timeout=0.5)
    assert [(r.passed, r.detail) for r in results] == [(False, "timed out after 0.5 s")] * 2


def test_cuda_gate_fails_loudly_without_the_gpu_path(capsys) -> None:
    gpu = pytest.importorskip("s4weights.gpu")
    if gpu.available():
        pytest.skip("a GPU is present: the gate runs for real (see --device cuda)")
    args = argparse.Namespace(reader=None, error_map=None, require=[], device="cuda",
                              suite=[SUITE], timeout=10.0, json=False, jobs=1)
    assert conformance.main(args) == 1
    err = capsys.readouterr().err
    assert "FAIL: --device cuda requested but the GPU path cannot run" in err
