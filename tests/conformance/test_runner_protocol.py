"""The runner's side of the external-reader protocol (``spec/conformance.md``): the error map,
the rejection line, OUTDIR, index.json, skips and the JSON report, with small fake readers."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from s4format import cli, conformance, errors
from s4format.conformance import Outcome, judge

V1 = conformance.DEFAULT_SUITE
SPEC = Path(__file__).resolve().parents[2] / "spec"
APPENDIX_A = "appendix_a"  # valid: one float32 tensor
MAJOR_2 = "major_2"  # UnsupportedVersionError


def _suite(*ids: str) -> dict:
    manifest = conformance.load_manifest(V1)
    manifest["vectors"] = [v for v in manifest["vectors"] if v["id"] in ids]
    assert len(manifest["vectors"]) == len(ids)
    return manifest


def _reader(tmp_path: Path, body: str) -> str:
    script = tmp_path / "reader.py"
    script.write_text("import json, os, sys\nfile, out = sys.argv[2], sys.argv[3]\n" + body)
    return f"{sys.executable} -S {script}"


def _run(tmp_path: Path, body: str, *ids: str, **kw) -> list[conformance.Result]:
    return conformance.run_suite(V1, _reader(tmp_path, body), manifest=_suite(*ids), **kw)


def test_the_spec_names_the_classes_the_runner_accepts() -> None:
    table = (SPEC / "validation.md").read_text().split("## Errors")[1].split("\n## ")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == conformance.SPEC_ERROR_CLASSES
    assert all(issubclass(getattr(errors, n), errors.S4Error)
               for n in conformance.SPEC_ERROR_CLASSES)
    protocol = (SPEC / "conformance.md").read_text().split("### 3.2")[1].split("\n## ")[0]
    assert set(re.findall(r"`(\w+Error)`", protocol)) >= conformance.SPEC_ERROR_CLASSES


def test_own_names_pass_only_through_the_error_map(tmp_path: Path, capsys) -> None:
    body = "print('VersionTooNew: major 2', file=sys.stderr)\nsys.exit(1)\n"
    assert [(r.status, r.got) for r in _run(tmp_path, body, MAJOR_2)] == [
        ("fail", "unknown class")]
    emap = tmp_path / "map.json"
    emap.write_text(json.dumps({"VersionTooNew": "UnsupportedVersionError"}))
    reader = conformance.ExternalReader(_reader(tmp_path, body),
                                        error_map=conformance.load_error_map(emap))
    results = conformance.run_suite(V1, reader, manifest=_suite(MAJOR_2))
    assert [(r.status, r.got) for r in results] == [("pass", "rejected UnsupportedVersionError")]
    emap.write_text(json.dumps({"VersionTooNew": "VersionError"}))
    assert cli.main(["conformance", "--reader", "true", "--error-map", str(emap)]) == 2
    assert "maps to VersionError, which spec/validation.md does not name" in \
        capsys.readouterr().err
    assert cli.main(["conformance", "--error-map", str(emap)]) == 2


@pytest.mark.parametrize(("body", "got", "detail"), [
    ("sys.exit(1)\n", "no error class", "exit status 1 and the first line of stderr is empty"),
    ("print(file=sys.stderr)\nprint('ChecksumError', file=sys.stderr)\nsys.exit(1)\n",
     "no error class", "exit status 1 and the first line of stderr is empty"),
    ("raise ValueError('ChecksumError')\n", "traceback", "ValueError: ChecksumError"),
    ("print('UnsupportedVersionErrorX', file=sys.stderr)\nsys.exit(1)\n", "unknown class",
     "first line of stderr: 'UnsupportedVersionErrorX'"),
    ("import signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "crash", "killed by SIGKILL"),
    ("sys.exit(2)\n", "crash", "exit status 2"),
])
def test_what_is_not_a_rejection(tmp_path: Path, body: str, got: str, detail: str) -> None:
    [result] = _run(tmp_path, body, MAJOR_2)
    assert (result.status, result.got) == ("fail", got)
    assert result.detail.startswith(detail)


def test_a_class_alone_on_the_first_line_is_a_rejection(tmp_path: Path) -> None:
    body = "print('UnsupportedVersionError', file=sys.stderr)\nprint('more', file=sys.stderr)\n" \
           "sys.exit(1)\n"
    assert [r.status for r in _run(tmp_path, body, MAJOR_2)] == ["pass"]


def test_outdir_exists_empty_and_stdin_is_empty(tmp_path: Path) -> None:
    body = ("if os.listdir(out) or sys.stdin.read():\n    sys.exit(3)\n"
            "open(os.path.join(out, 't'), 'wb').write(b'')\n"
            "json.dump({'tensors': []}, open(os.path.join(out, 'index.json'), 'w'))\n")
    [result] = _run(tmp_path, body, APPENDIX_A)
    assert (result.status, result.got) == ("fail", "wrong tensors")
    assert result.detail == "expected 1 tensors, got 0"


def test_tensor_files_must_lie_inside_outdir(tmp_path: Path) -> None:
    body = ("open(os.path.join(out, '..', 'outside'), 'wb').write(bytes(8))\n"
            "json.dump({'tensors': [{'name': 'w', 'dtype': 'float32', 'shape': [2], "
            "'file': '../outside'}]}, open(os.path.join(out, 'index.json'), 'w'))\n")
    [result] = _run(tmp_path, body, APPENDIX_A)
    assert (result.status, result.got) == ("fail", "crash")
    assert "is not a file name inside OUTDIR" in result.detail


def test_tensors_are_compared_in_index_order() -> None:
    vector = {"id": "v", "expect": "valid", "tree": None, "tensors": [
        {"name": "a", "dtype": "uint8", "shape": [1], "sha256": "0"},
        {"name": "b", "dtype": "uint8", "shape": [1], "sha256": "1"}]}
    swapped = Outcome(True, [("b", "uint8", [1], "1"), ("a", "uint8", [1], "0")], None)
    result = judge(vector, swapped)
    assert (result.status, result.got) == ("fail", "wrong tensors")
    assert result.detail == "tensor 0: expected ('a', 'uint8', [1], '0'), " \
                            "got ('b', 'uint8', [1], '1')"


def test_a_wrong_tree_names_where_it_differs() -> None:
    vector = {"id": "v", "expect": "valid", "tensors": [],
              "tree": {"dict": [["x", {"float": "7ff0000000000001"}]]}}
    got = Outcome(True, [], {"dict": [["x", {"float": "7FF0000000000001"}]]})
    result = judge(vector, got)
    assert (result.status, result.got) == ("fail", "wrong tree")
    assert result.detail == ('tree.dict[0][1].float: expected "7ff0000000000001", '
                             'got "7FF0000000000001"')


@pytest.mark.parametrize(("codecs", "error", "require", "status"), [
    (["gdeflate", "raw"], "CodecError", (), "skip"),
    (["gdeflate", "raw"], None, (), "skip"),
    (["gdeflate", "raw"], "CodecError", ("gdeflate",), "fail"),
    (["nvcomp-ans"], "ChecksumError", (), "skip"),
    (["rans", "raw"], "CodecError", (), "fail"),
    (["unknown-7"], "UnsupportedCodecError", (), "pass"),
    (["gdeflate"], "UnsupportedCodecError", (), "pass"),
])
def test_unsupported_codec_skips_only_optional_codecs(codecs, error, require, status) -> None:
    vector = {"id": "v", "codecs": codecs, "expect": "error" if error else "valid",
              "error": error, "tensors": [], "tree": None}
    got = Outcome(False, error_class="UnsupportedCodecError")
    assert judge(vector, got, require).status == status


def test_json_report(tmp_path: Path, capsys) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    manifest = _suite(APPENDIX_A, MAJOR_2)
    for v in manifest["vectors"]:
        (suite / v["file"]).symlink_to(V1 / v["file"])
    (suite / "manifest.json").write_text(json.dumps(manifest))
    body = "print('FormatError: no', file=sys.stderr)\nsys.exit(1)\n"
    argv = ["conformance", "--reader", _reader(tmp_path, body), "--suite", str(suite), "--json"]
    assert cli.main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert {k: report[k] for k in ("passed", "failed", "skipped", "ok")} == {
        "passed": 0, "failed": 2, "skipped": 0, "ok": False}
    [s] = report["suites"]
    assert (s["suite"], s["version"], s["failed"]) == ("v1", "1.0", 2)
    assert [(r["id"], r["status"], r["got"]) for r in s["results"]] == [
        (APPENDIX_A, "fail", "rejected FormatError"), (MAJOR_2, "fail", "rejected FormatError")]


def test_a_timeout_kills_the_readers_children_too() -> None:
    # A shell whose child holds stderr open: killing the shell alone would wait 30 s for EOF.
    reader = conformance.ExternalReader("sh -c 'sleep 30 & wait' sh", timeout=0.5)
    start = time.monotonic()
    [result] = conformance.run_suite(V1, reader, manifest=_suite(MAJOR_2))
    assert (result.status, result.got, result.detail) == ("fail", "crash",
                                                          "timed out after 0.5 s")
    assert time.monotonic() - start < 10
