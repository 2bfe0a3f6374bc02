"""The conformance runner against deliberately wrong external readers (``wrong_readers.py``):
each must fail the suite for its own mistake, the reference adapter must pass, and a reader
without GDeflate gets skips unless ``--require gdeflate``.

Readers that need no decoding run over both suites whole; those built on the reference reader
(about a second per vector) run over the vectors that catch their mistake, chosen from the
manifests by what they expect, so each is caught by vectors that exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from s4format import cli, conformance

V1, V1_1, *_LATER = conformance.DEFAULT_SUITES
HERE = Path(__file__).resolve().parent
REFERENCE = f"{sys.executable} {HERE.parents[1] / 'conformance' / 'reference_reader.py'}"
CHECKSUM_CLASSES = ("ChecksumError", "ContentHashError")


def wrong(kind: str) -> str:
    # -S: the two readers that decode nothing start faster without site-packages.
    fast = " -S" if kind in ("crash", "format-error") else ""
    return f"{sys.executable}{fast} {HERE / 'wrong_readers.py'} {kind}"


def subset(suite: Path, keep) -> dict:
    """``suite``'s manifest with only the vectors ``keep`` accepts (at least one)."""
    manifest = conformance.load_manifest(suite)
    manifest["vectors"] = [v for v in manifest["vectors"] if keep(v)]
    assert manifest["vectors"], f"no vector of {suite} is selected"
    return manifest


def by_id(*ids: str):
    return lambda v: v["id"] in ids


def run(suite: Path, reader: str, keep=None, **kw) -> list[conformance.Result]:
    manifest = subset(suite, keep) if keep else None
    return conformance.run_suite(suite, reader, timeout=300, manifest=manifest, jobs=2, **kw)


def statuses(results: list[conformance.Result]) -> dict[str, int]:
    c = conformance.counts(results)
    return {k: c[k] for k in ("passed", "failed", "skipped")}


@pytest.mark.parametrize("suite", [V1, V1_1])
def test_a_reader_that_always_crashes_fails_every_vector(suite: Path) -> None:
    results = run(suite, wrong("crash"))
    assert {(r.status, r.got) for r in results} == {("fail", "traceback")}
    assert "RuntimeError: this reader always crashes" in results[0].detail


@pytest.mark.parametrize("suite", [V1, V1_1])
def test_a_reader_that_always_says_format_error_fails_the_rest(suite: Path) -> None:
    manifest = conformance.load_manifest(suite)
    results = run(suite, wrong("format-error"))
    want = {v["id"]: v.get("error") == "FormatError" for v in manifest["vectors"]}
    assert {r.id: r.passed for r in results} == want
    assert sum(want.values()) < len(want) / 2
    assert {r.got for r in results} == {"rejected FormatError"}


def test_a_reader_that_ignores_checksums_fails_the_checksum_vectors() -> None:
    results = run(V1, wrong("no-checksums"),
                  lambda v: v.get("error") in CHECKSUM_CLASSES or v["id"] == "appendix_a")
    assert len(results) >= 8
    assert [r.id for r in results if r.passed] == ["appendix_a"]
    # It decodes what it should refuse: 'accepted', or a codec error further on.
    assert {r.got for r in results if not r.passed} <= {"accepted", "rejected CodecError",
                                                        "rejected FormatError"}


def test_a_reader_that_flips_one_byte_fails_the_valid_vectors() -> None:
    results = run(V1, wrong("flip-byte"), by_id("appendix_a", "dtype_float32", "major_2"))
    assert [(r.id, r.status, r.got) for r in results] == [
        ("dtype_float32", "fail", "wrong tensors"), ("appendix_a", "fail", "wrong tensors"),
        ("major_2", "pass", "rejected UnsupportedVersionError")]
    assert results[0].detail.startswith("tensor ")


def test_the_reference_adapter_passes_one_vector_of_every_kind() -> None:
    picked = []
    for suite in (V1, V1_1):
        seen = set()
        for v in conformance.load_manifest(suite)["vectors"]:
            kind = v.get("error", "valid")
            if kind not in seen or v["id"] in ("tree_all_tags", "delta_child"):
                seen.add(kind)
                picked.append((suite, v["id"]))
    results = [r for suite in (V1, V1_1)
               for r in run(suite, REFERENCE, by_id(*(i for s, i in picked if s == suite)))]
    assert [(r.id, r.got, r.detail) for r in results if not r.passed] == []
    assert len(results) >= 14


def test_a_reader_without_gdeflate_is_skipped_unless_required(tmp_path: Path, capsys) -> None:
    keep = by_id("gdeflate_pages", "gdeflate_page_log2", "bitpack_short", "codec_7",
                 "appendix_a")
    results = run(V1, wrong("no-gdeflate"), keep)
    assert [(r.id, r.status, r.codec, r.got) for r in results] == [
        ("gdeflate_pages", "skip", "gdeflate", "rejected UnsupportedCodecError"),
        ("appendix_a", "pass", None, "valid"),
        ("codec_7", "pass", None, "rejected UnsupportedCodecError"),
        ("bitpack_short", "pass", None, "rejected LimitError"),
        ("gdeflate_page_log2", "skip", "gdeflate", "rejected UnsupportedCodecError")]
    assert statuses(results) == {"passed": 3, "failed": 0, "skipped": 2}
    suite = tmp_path / "suite"
    suite.mkdir()
    manifest = subset(V1, by_id("gdeflate_page_log2", "appendix_a"))
    for v in manifest["vectors"]:
        (suite / v["file"]).symlink_to(V1 / v["file"])
    (suite / "manifest.json").write_text(json.dumps(manifest))
    argv = ["conformance", "--reader", wrong("no-gdeflate"), "--suite", str(suite), "--json",
            "--jobs", "2", "--timeout", "300"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["skipped"], report["skipped_by_codec"]) == (
        True, 1, {"gdeflate": 1})
    assert cli.main([*argv, "--require", "gdeflate"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["failed"], report["skipped"]) == (False, 1, 0)
    failed = [r for r in report["suites"][0]["results"] if r["status"] == "fail"]
    assert [(r["id"], r["got"]) for r in failed] == [
        ("gdeflate_page_log2", "rejected UnsupportedCodecError")]
