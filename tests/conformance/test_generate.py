"""The committed vectors are exactly what the generator writes, and the generator refuses to
change a frozen vector silently."""

from __future__ import annotations

import json

import pytest

from conformance import generate
from s4format import codecs, errors

pytestmark = pytest.mark.skipif(
    not codecs.get(codecs.GDEFLATE).available(),
    reason="the GDeflate vectors need nvCOMP's CPU library to be regenerated")


@pytest.fixture(scope="module")
def rendered() -> dict[str, bytes]:
    return generate.render(generate.all_vectors())


def test_committed_vectors_are_byte_identical(rendered: dict[str, bytes]) -> None:
    committed = {p.name for p in generate.SUITE.iterdir()}
    assert committed == set(rendered), "vector files missing from or extra in conformance/v1"
    differ = [n for n, data in rendered.items() if (generate.SUITE / n).read_bytes() != data]
    assert differ == [], f"regenerated vectors differ from the committed ones: {differ}"


def test_suite_is_within_its_size_budget(rendered: dict[str, bytes]) -> None:
    assert sum(map(len, rendered.values())) < generate.SIZE_BUDGET


def test_manifest_is_complete(rendered: dict[str, bytes]) -> None:
    vectors = json.loads(rendered["manifest.json"])["vectors"]
    names = {n for n in dir(errors) if n.endswith("Error")}
    for v in vectors:
        assert v["file"] in rendered and v["description"] and v["rules"] is not None, v["id"]
        if v["expect"] == "valid":
            assert all(len(t["sha256"]) == 64 for t in v["tensors"]), v["id"]
        else:
            assert v["expect"] == "error" and v["error"] in names, v["id"]
        if "parent" in v:
            assert v["parent"] in rendered, v["id"]
    kinds = {v["expect"] for v in vectors}
    assert kinds == {"valid", "error"}


def test_refuses_to_overwrite_changed_vectors(tmp_path, rendered) -> None:
    generate.write_suite(tmp_path)
    (tmp_path / "appendix_a.s4w").write_bytes(b"changed")
    with pytest.raises(SystemExit, match=r"refusing to overwrite frozen vectors.*appendix_a"):
        generate.write_suite(tmp_path)
    assert (tmp_path / "appendix_a.s4w").read_bytes() == b"changed"
    generate.write_suite(tmp_path, force=True)
    assert (tmp_path / "appendix_a.s4w").read_bytes() == rendered["appendix_a.s4w"]
