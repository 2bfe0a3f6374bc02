"""The v1.2 conformance suite (typed names of Python values): our reader passes it in-process and
through the external-reader protocol, it ships with the CLI, and a reader that does not check
the forms (a 1.1 reader) fails exactly its must-fail vectors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from s4format import conformance, objtree
from s4format.cli import PACKAGED_SUITES
from s4format.reader import Reader

SUITE = Path(__file__).resolve().parents[2] / "conformance" / "v1.2"
REFERENCE = f"{sys.executable} {SUITE.parent / 'reference_reader.py'}"


def test_every_vector_passes_on_the_cpu_reader() -> None:
    results = conformance.run_suite(SUITE)
    assert [f"{r.id}: {r.got}" for r in results if not r.passed] == []
    manifest = conformance.load_manifest(SUITE)
    assert (manifest["version"], len(results)) == ("1.2", 36)
    assert sum(v["expect"] == "valid" for v in manifest["vectors"]) == 3


def test_the_reference_reader_reports_the_tree_through_the_protocol(tmp_path: Path) -> None:
    manifest = conformance.load_manifest(SUITE)
    manifest["vectors"] = [v for v in manifest["vectors"]
                           if v["id"] in ("py_values", "py_deque_maxlen_2p63")]
    for v in manifest["vectors"]:
        (tmp_path / v["file"]).symlink_to(SUITE / v["file"])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    results = conformance.run_suite(tmp_path, REFERENCE, timeout=120)
    assert [(r.id, r.passed, r.got) for r in results] == [
        ("py_values", True, "valid"), ("py_deque_maxlen_2p63", True, "rejected LimitError")]


def test_the_cli_runs_it_by_default() -> None:
    assert [s.name for s in PACKAGED_SUITES] == ["v1", "v1.1", "v1.2", "v1.3", "v1.4", "v1.5"]
    assert (PACKAGED_SUITES[2] / "manifest.json").resolve() == (SUITE / "manifest.json")


def test_a_reader_without_the_forms_accepts_only_the_must_fail_vectors(monkeypatch) -> None:
    """A 1.1 reader returns these names opaque: the suite tells it from a 1.2 reader by
    its must-fail vectors alone."""
    real = objtree.decode
    monkeypatch.setattr(objtree, "decode",
                        lambda data, n, *, check_typed=None, uses=None: real(data, n, uses=uses))
    results = conformance.run_suite(SUITE)
    failed = {r.id for r in results if not r.passed}
    must_fail = {v["id"] for v in conformance.load_manifest(SUITE)["vectors"]
                 if v["expect"] == "error"}
    assert failed == must_fail and {r.got for r in results if not r.passed} == {"accepted"}
    with Reader(SUITE / "py_values.s4w") as r:
        assert r.version == (1, 2)
