"""Deliberately wrong readers behind the external-reader protocol (``spec/conformance.md``), each
with one mistake an outside implementation could make; the conformance runner must fail them.

    python wrong_readers.py KIND decode FILE OUTDIR [--parent PARENTFILE]

KIND: ``crash`` (an uncaught exception, so Python prints a traceback and exits 1),
``format-error`` (rejects every file as FormatError), ``no-checksums`` (the reference reader
with every checksum and content-hash comparison passing), ``flip-byte`` (the reference reader,
then one byte of the first non-empty tensor flipped), ``no-gdeflate`` (the reference reader
without nvCOMP's CPU library: a reader that lacks the optional codec).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONFORMANCE = Path(__file__).resolve().parents[2] / "conformance"


class _AlwaysEqual:
    """Compares equal to every stored checksum, so no checksum check can fail."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def _reference_main(argv: list[str]) -> int:
    sys.path.insert(0, str(CONFORMANCE))
    import reference_reader

    return reference_reader.main(argv)


def crash(argv: list[str]) -> int:
    raise RuntimeError(f"this reader always crashes ({argv[1]})")


def format_error(argv: list[str]) -> int:
    print(f"FormatError: {argv[1]}: this reader refuses every file", file=sys.stderr)
    return 1


def no_checksums(argv: list[str]) -> int:
    from types import SimpleNamespace

    import xxhash

    from s4format import reader

    equal = _AlwaysEqual()
    reader.hashing = SimpleNamespace(  # type: ignore[assignment]
        xxhash=xxhash, bytes_checksum=lambda _data: equal, plane_checksum=lambda _data: equal,
        content_hash=lambda _data: equal, leaves_for=lambda _nbytes: None,
        content_hash_of=lambda _nbytes, _leaves: equal)
    return _reference_main(argv)


def flip_byte(argv: list[str]) -> int:
    status = _reference_main(argv)
    if status == 0:
        outdir = Path(argv[2])
        for t in json.loads((outdir / "index.json").read_text())["tensors"]:
            data = bytearray((outdir / t["file"]).read_bytes())
            if data:
                data[len(data) // 2] ^= 0x10
                (outdir / t["file"]).write_bytes(bytes(data))
                break
    return status


def no_gdeflate(argv: list[str]) -> int:
    os.environ["S4_NVCOMP_CPU_LIB"] = str(Path(argv[2]) / "no-such-libnvcomp_cpu.so")
    return _reference_main(argv)


KINDS = {"crash": crash, "format-error": format_error, "no-checksums": no_checksums,
         "flip-byte": flip_byte, "no-gdeflate": no_gdeflate}

if __name__ == "__main__":
    sys.exit(KINDS[sys.argv[1]](sys.argv[2:]))
