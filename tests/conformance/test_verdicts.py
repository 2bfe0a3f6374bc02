"""The vectors of the verdicts of 2026-12-01 through the external protocol, and the manifests'
``without`` key: what a reader lacking an optional codec owes (spec/conformance.md, section 5),
checked against our reader with nvCOMP's CPU library hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import generate
from s4format import conformance
from s4format.conformance import Outcome, judge

V1 = conformance.DEFAULT_SUITE
REFERENCE = f"{sys.executable} {V1.parent / 'reference_reader.py'}"
P4_FIRST = {"bitpack_short", "rans_const_empty_body"}


def _gdeflate_vectors() -> list[dict]:
    return [v for v in conformance.load_manifest(V1)["vectors"] if "gdeflate" in v["codecs"]]


def test_every_vector_with_an_optional_codec_says_what_a_reader_without_it_owes() -> None:
    vectors = _gdeflate_vectors()
    assert len(vectors) >= 34
    owed = {v["id"]: v["without"] for v in vectors}
    assert {k for k, w in owed.items() if w != {"gdeflate": "UnsupportedCodecError"}} == P4_FIRST
    assert all(owed[k] == {"gdeflate": "LimitError"} for k in P4_FIRST)
    others = [v for v in conformance.load_manifest(V1)["vectors"] if "gdeflate" not in v["codecs"]]
    assert not [v["id"] for v in others if "without" in v]


@pytest.mark.parametrize(("without", "got", "status"), [
    ({"gdeflate": "UnsupportedCodecError"}, "UnsupportedCodecError", "skip"),
    ({"gdeflate": "LimitError"}, "UnsupportedCodecError", "fail"),
    ({"gdeflate": "LimitError"}, "LimitError", "pass"),
    (None, "UnsupportedCodecError", "skip"),  # a manifest from before the key: as it was
])
def test_the_runner_judges_by_without(without, got, status) -> None:
    vector = {"id": "v", "codecs": ["bitpack", "gdeflate"], "expect": "error",
              "error": "LimitError", **({"without": without} if without else {})}
    result = judge(vector, Outcome(False, error_class=got))
    assert result.status == status
    if status == "fail":
        assert result.detail == ("a reader without gdeflate still owes LimitError: the file "
                                 "breaks a rule checked before P3 reaches its gdeflate plane")


# Our reader in-process on the vectors given, with its class for each (or "valid").
_PROBE = """
import json, sys
from pathlib import Path
from s4format import conformance
suite = Path(sys.argv[1])
out = {}
for v in json.loads(sys.argv[2]):
    got = conformance.decode_in_process(suite / v["file"], Path(v["parent"]) if v.get("parent")
                                        else None)
    out[v["id"]] = "valid" if got.ok else got.error_class or got.problem
print(json.dumps(out))
"""


def test_a_reader_without_gdeflate_answers_what_the_manifest_says(tmp_path: Path) -> None:
    """The full set: every vector with a GDeflate plane is refused at open, with
    UnsupportedCodecError or the class ``without`` names; the runner skips exactly the first."""
    vectors = _gdeflate_vectors()
    env = {**os.environ, "S4_NVCOMP_CPU_LIB": str(tmp_path / "no-such-libnvcomp_cpu.so")}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(V1), json.dumps(vectors)], env=env,
                          check=True, capture_output=True, text=True, timeout=300)
    got = json.loads(done.stdout)
    assert got == {v["id"]: v["without"]["gdeflate"] for v in vectors}
    results = [judge(v, Outcome(False, error_class=got[v["id"]])) for v in vectors]
    assert conformance.counts(results) == {
        "passed": len(P4_FIRST), "failed": 0, "skipped": len(vectors) - len(P4_FIRST),
        "skipped_by_codec": {"gdeflate": len(vectors) - len(P4_FIRST)}}


def test_the_reference_adapter_opens_the_parent_after_the_file() -> None:
    """Through the protocol: the file's own rules, then A1, then the parent's, then R5 before
    R1 (the adapter opened the parent first: a damaged child with a garbage parent was a
    BadMagicError)."""
    ids = ("delta_header_damaged_not_s4w_parent", "delta_not_s4w_parent",
           "base_given_not_s4w_parent", "delta_plane_damaged_parent_missing",
           "tree_key_list_300_deep")
    manifest = conformance.load_manifest(V1)
    manifest["vectors"] = [v for v in manifest["vectors"] if v["id"] in ids]
    results = conformance.run_suite(V1, REFERENCE, timeout=300, manifest=manifest, jobs=2)
    assert {r.id: (r.status, r.got) for r in results} == {
        "delta_header_damaged_not_s4w_parent": ("pass", "rejected ChecksumError"),
        "delta_not_s4w_parent": ("pass", "rejected BadMagicError"),
        "base_given_not_s4w_parent": ("pass", "rejected ParentMismatchError"),
        "delta_plane_damaged_parent_missing": ("pass", "rejected ParentMismatchError"),
        "tree_key_list_300_deep": ("pass", "rejected FormatError")}


def test_the_docs_count_the_vectors_of_each_suite() -> None:
    spec = (V1.parents[1] / "spec" / "conformance.md").read_text()
    readme = (V1.parent / "README.md").read_text()
    for suite in (V1.parent / name for name in generate.SUITES):
        vectors = conformance.load_manifest(suite)["vectors"]
        valid = sum(v["expect"] == "valid" for v in vectors)
        files = len({v["file"] for v in vectors})
        assert (f"| `conformance/{suite.name}/` |" in spec
                and f"| {len(vectors)} in {files} files: {valid} valid, "
                    f"{len(vectors) - valid} must-fail |" in spec), suite.name
        assert f"{len(vectors)} vectors in {files} files" in readme, suite.name
        assert f"**{valid} valid**, **{len(vectors) - valid} must-fail**" in readme, suite.name


def test_a_typed_value_is_two_keys_and_key_order_means_nothing() -> None:
    tree = {"typed": "torch.dtype", "value": "bfloat16"}
    vector = {"id": "v", "expect": "valid", "tensors": [], "tree": tree}
    assert judge(vector, Outcome(True, [], {"value": "bfloat16", "typed": "torch.dtype"})
                 ).status == "pass"
    assert judge(vector, Outcome(True, [], {**tree, "str": "x"})).got == "wrong tree"
