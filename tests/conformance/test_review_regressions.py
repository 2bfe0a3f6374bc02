"""Regression tests for conformance-tool bugs found in review."""

from __future__ import annotations

import json
from pathlib import Path

import s4format
from conformance import reference_reader
from s4format.conformance import tree_to_json

HUGE = 10**5000  # str() refuses ints of more than 4300 digits


def test_tree_to_json_writes_ints_of_any_size_in_decimal() -> None:
    assert tree_to_json([HUGE, -HUGE, 7]) == [
        {"int": "1" + "0" * 5000}, {"int": "-1" + "0" * 5000}, {"int": "7"}]


def test_reference_reader_decodes_a_tree_holding_a_huge_int(tmp_path: Path) -> None:
    file = tmp_path / "big.s4w"
    s4format.write(file, {"n": HUGE})
    out = tmp_path / "out"
    out.mkdir()
    assert reference_reader.main(["decode", str(file), str(out)]) == 0
    tree = json.loads((out / "index.json").read_text())["tree"]
    assert tree == {"dict": [["n", {"int": "1" + "0" * 5000}]]}
