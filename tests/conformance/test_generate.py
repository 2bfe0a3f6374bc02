"""The committed vectors are exactly what the generator writes, and the generator refuses to
change a frozen vector silently."""

from __future__ import annotations

import json

import pytest

from conformance import craft, generate
from s4format import codecs, errors

pytestmark = pytest.mark.skipif(
    not codecs.get(codecs.GDEFLATE).available(),
    reason="the GDeflate vectors need nvCOMP's CPU library to be regenerated")


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, bytes]]:
    """Suite folder name -> its rendered files."""
    return {name: generate.render(vectors(), name)
            for name, (_version, vectors) in generate.SUITES.items()}


@pytest.mark.parametrize("suite", list(generate.SUITES))
def test_committed_vectors_are_byte_identical(rendered, suite: str) -> None:
    folder = generate.ROOT / suite
    committed = {p.name for p in folder.iterdir()}
    assert committed == set(rendered[suite]), f"vector files missing from or extra in {folder}"
    differ = [n for n, data in rendered[suite].items() if (folder / n).read_bytes() != data]
    assert differ == [], f"regenerated vectors differ from the committed ones: {differ}"


def test_suites_are_within_their_size_budget(rendered) -> None:
    assert sum(len(data) for files in rendered.values() for data in files.values()) \
        < generate.SIZE_BUDGET


@pytest.mark.parametrize("suite", list(generate.SUITES))
def test_manifest_is_complete(rendered, suite: str) -> None:
    manifest = json.loads(rendered[suite]["manifest.json"])
    assert (manifest["suite"], manifest["version"]) == (suite, generate.SUITES[suite][0])
    names = {n for n in dir(errors) if n.endswith("Error")}
    for v in manifest["vectors"]:
        assert v["file"] in rendered[suite] and v["description"] and v["rules"] is not None, \
            v["id"]
        if v["expect"] == "valid":
            assert all(len(t["sha256"]) == 64 for t in v["tensors"]), v["id"]
        else:
            assert v["expect"] == "error" and v["error"] in names, v["id"]
        if "parent" in v:
            assert v["parent"] in rendered[suite], v["id"]
    kinds = {v["expect"] for v in manifest["vectors"]}
    assert kinds == {"valid", "error"}


def test_suites_do_not_share_ids(rendered) -> None:
    ids = [v["id"] for files in rendered.values()
           for v in json.loads(files["manifest.json"])["vectors"]]
    assert len(ids) == len(set(ids))


def test_v1_is_format_1_0_and_v1_1_adds_codec_8(rendered) -> None:
    """A 1.0 reader passes v1: no v1 vector declares a later minor (except the one that tests
    minor 9) or uses codec 8; every v1.1 vector that names a codec uses bitpack-w."""
    v1 = json.loads(rendered["v1"]["manifest.json"])["vectors"]
    assert not [v["id"] for v in v1 if "bitpack-w" in v["codecs"]]
    minors = {v["id"]: rendered["v1"][v["file"]][10] for v in v1
              if len(rendered["v1"][v["file"]]) >= 72 and v["expect"] == "valid"}
    assert {k: m for k, m in minors.items() if m} == {"minor_version_9": 9}
    v11 = json.loads(rendered["v1.1"]["manifest.json"])["vectors"]
    assert all("bitpack-w" in v["codecs"] for v in v11)


def test_v1_3_adds_codec_9(rendered) -> None:
    """Only v1.3 uses rans-seg, every vector of it does, and its files declare minor 3 but the
    one that tests an earlier minor."""
    earlier = [v["id"] for name in ("v1", "v1.1", "v1.2")
               for v in json.loads(rendered[name]["manifest.json"])["vectors"]
               if "rans-seg" in v["codecs"]]
    assert earlier == []
    v13 = json.loads(rendered["v1.3"]["manifest.json"])["vectors"]
    assert all("rans-seg" in v["codecs"] for v in v13)
    minors = {v["id"]: rendered["v1.3"][v["file"]][10] for v in v13}
    assert {k: m for k, m in minors.items() if m != 3} == {"ransseg_in_minor_1": 1}


def _masked_records(blob: bytes) -> list[bool]:
    try:
        tensors = craft.parse(blob).tensors
    except Exception:  # (vectors that break the index on purpose)
        return []
    return [bool(t["flags"] & 0x02) for t in tensors]


def test_v1_4_adds_masked_tensors(rendered) -> None:
    """Only v1.4 has masked tensor records (flag 0x02); its files declare minor 4, and its
    valid masked files hold masked deltas of four layouts (twice: bf16's and fp16's kept words
    under their own layouts, then under the bytes layout) and masked tensors that are not
    deltas, seven of them."""
    earlier = [v["id"] for name in ("v1", "v1.1", "v1.2", "v1.3")
               for v in json.loads(rendered[name]["manifest.json"])["vectors"]
               if any(_masked_records(rendered[name][v["file"]]))]
    assert earlier == []
    v14 = json.loads(rendered["v1.4"]["manifest.json"])["vectors"]
    assert {rendered["v1.4"][v["file"]][10] for v in v14} == {4}
    masked = {v["id"]: _masked_records(rendered["v1.4"][v["file"]]) for v in v14
              if v["expect"] == "valid"}
    assert masked == {"masked_delta_base": [False] * 4, "masked_delta": [True] * 4,
                      "masked_delta_bytes": [True] * 4, "masked_forms": [True] * 7}


def test_v1_5_adds_codec_10(rendered) -> None:
    """Only v1.5 uses seg-lz, every vector of it does, its files declare minor 5, and its
    valid vectors' codec-10 planes hold zstd segments, one of them of the writer's choice."""
    earlier = [v["id"] for name in ("v1", "v1.1", "v1.2", "v1.3", "v1.4")
               for v in json.loads(rendered[name]["manifest.json"])["vectors"]
               if "seg-lz" in v["codecs"]]
    assert earlier == []
    v15 = json.loads(rendered["v1.5"]["manifest.json"])["vectors"]
    assert all("seg-lz" in v["codecs"] for v in v15)
    assert {rendered["v1.5"][v["file"]][10] for v in v15} == {5}
    zstd = {v["id"] for v in v15 if v["expect"] == "valid" and any(
        "zstd" in {c for _n, c in segs} for segs in generate.segment_codecs(
            rendered["v1.5"][v["file"]], codecs.SEG_LZ).values())}
    assert zstd == {"seglz_every_codec", "seglz_flat_moments", "seglz_rle_frame", "seglz_base"}


def test_v1_3_valid_segments_take_every_segment_codec(rendered) -> None:
    """The valid vectors' records name every codec a segment may take: raw, bitpack, rans in
    each mode and bitpack-w at two widths, and some plane ends in a partial segment."""
    v13 = json.loads(rendered["v1.3"]["manifest.json"])["vectors"]
    planes = [segs for v in v13 if v["expect"] == "valid"
              for segs in generate.segment_codecs(rendered["v1.3"][v["file"]]).values()]
    taken = {codec for segs in planes for _n, codec in segs}
    assert taken == {"raw", "bitpack", "rans/RANS", "rans/CONST", "rans/RAW", "bitpack-w/3",
                     "bitpack-w/7"}
    assert any(len(segs) > 1 and segs[-1][0] % generate.SEG_UNIT for segs in planes)


def test_refuses_to_overwrite_changed_vectors(tmp_path, rendered) -> None:
    generate.write_suite(tmp_path)
    (tmp_path / "appendix_a.s4w").write_bytes(b"changed")
    with pytest.raises(SystemExit, match=r"refusing to overwrite frozen vectors.*appendix_a"):
        generate.write_suite(tmp_path)
    assert (tmp_path / "appendix_a.s4w").read_bytes() == b"changed"
    generate.write_suite(tmp_path, force=True)
    assert (tmp_path / "appendix_a.s4w").read_bytes() == rendered["v1"]["appendix_a.s4w"]


def test_cli_writes_one_suite_into_out(tmp_path, capsys, rendered) -> None:
    assert generate.main(["--suite", "v1.1", "--out", str(tmp_path)]) == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == rendered["v1.1"]
    n = len(json.loads(rendered["v1.1"]["manifest.json"])["vectors"])
    assert f"{tmp_path}: {n} vectors" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        generate.main(["--out", str(tmp_path)])
