"""atheris target: the .s4w reader on arbitrary bytes, for long fuzzing runs.

    mkdir -p /tmp/corpus && cp conformance/v1/*.s4w /tmp/corpus/
    nice -n 19 python fuzz/fuzz_reader.py /tmp/corpus -max_total_time=600 -rss_limit_mb=2048 \
        -artifact_prefix=fuzz/crashers/

Each input is opened, every tensor read and the file verified; an ``S4Error`` is the expected
answer to a bad file, anything else (another exception, a crash, a hang, memory beyond the
limit) is a finding. Half of the mutations are *resealed* (``conformance.craft.reseal``: header,
plane, index and footer checksums recomputed), so mutated bytes get past the checksums into the
index rules, the object tree and the codecs.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _compiled_modules() -> list[str]:
    """The modules that hold numba kernels: numba compiles them from their bytecode, which
    instrumentation would break (found by their source, so that a module gaining a kernel is
    left out too)."""
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                  for p in (ROOT / "s4format").rglob("*.py")
                  if any(k in p.read_text() for k in ("@kernel", "@intrinsic", "numba")))


with atheris.instrument_imports(include=["s4format", "conformance"],
                                exclude=_compiled_modules()):
    from conformance.craft import reseal
    from s4format import Reader, S4Error, verify

    # The registry imports codecs lazily, outside this block: import them here so they are
    # instrumented too (rans is numba-compiled, see above).
    from s4format.codecs import bitpack, gdeflate, raw, zstd  # noqa: F401


def decode_all(data: bytes) -> None:
    try:
        with Reader(data) as r:
            for i in range(len(r.tensors)):
                r.read_raw(i)
            verify(r)
    except S4Error:
        pass


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    out = atheris.Mutate(data, max_size)
    if seed % 2:
        # Resealing is best effort: the bytes may not parse at all.
        with contextlib.suppress(Exception):
            out = reseal(out)[:max_size]
    return out


def main() -> None:
    atheris.Setup(sys.argv, decode_all, custom_mutator=mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
