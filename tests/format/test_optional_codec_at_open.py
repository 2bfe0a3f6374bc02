"""Rule P3 for a registered codec whose library is missing: a reader without nvCOMP's CPU
library refuses a file with a GDeflate plane when it opens it (spec/codecs.md), not when it
decodes that plane. The library is hidden the way a user without it would be: the process
starts with ``$S4_NVCOMP_CPU_LIB`` naming a file that does not exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

V1 = Path(__file__).resolve().parents[2] / "conformance" / "v1"

# Opens each file of v1 given on the command line and prints what happened, as JSON: the
# error class and message, or the tensors it could then read.
_PROBE = """
import json, sys
from s4format import Reader, S4Error
out = {}
for path in sys.argv[1:]:
    try:
        with Reader(path) as r:
            out[path] = ["opened", [r.read_raw(i).size for i in range(len(r.tensors))]]
    except S4Error as exc:
        out[path] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def _open_without_gdeflate(tmp_path: Path, *names: str) -> dict[str, list]:
    env = {**os.environ, "S4_NVCOMP_CPU_LIB": str(tmp_path / "no-such-libnvcomp_cpu.so")}
    files = [str(V1 / f"{n}.s4w") for n in names]
    done = subprocess.run([sys.executable, "-c", _PROBE, *files], env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    result = json.loads(done.stdout)
    return {n: result[f] for n, f in zip(names, files)}


def test_a_file_with_a_gdeflate_plane_is_refused_at_open(tmp_path: Path) -> None:
    got = _open_without_gdeflate(tmp_path, "read_base", "raw_params", "gdeflate_pages",
                                 "bitpack_short", "appendix_a")
    # read_base's tensor w (index 0) decodes without GDeflate; its tensor h has a GDeflate
    # plane. Before the fix the file opened and w was read; raw_params (tensor r broken) failed
    # with CodecError instead of UnsupportedCodecError.
    for name in ("read_base", "raw_params"):
        cls, message = got[name]
        assert cls == "UnsupportedCodecError", (name, got[name])
        assert "tensor 1 'h' plane mantissa1: codec 'gdeflate' (ID 5)" in message
        assert "nvCOMP's CPU library" in message and "no-such-libnvcomp_cpu.so" in message
    assert got["gdeflate_pages"][0] == "UnsupportedCodecError"
    # P4 of tensor w's sign plane comes before P3 of tensor h's GDeflate plane.
    assert got["bitpack_short"][0] == "LimitError"
    assert got["appendix_a"] == ["opened", [8]]
