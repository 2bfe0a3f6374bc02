"""Take a .s4w file apart and put it back together with something changed, every derived value
(header, index and footer checksums, index length, plane checksums) recomputed, so that a
must-fail vector (or a test) breaks exactly the rule it is about and no earlier one.

``parse`` splits a file into its header fields, data section, index (tensor records, tree bytes,
metadata, extensions) and footer fields as plain dicts and lists; ``build`` reassembles them.

Used by the generator (must-fail vectors), by the fuzzers (structure-aware mutations and
``reseal``, which lets random mutations get past the checksums into the deeper rules) and by the
test suites under tests/format and tests/weights.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

from construct import ConstructError, Container, ListContainer

from s4format import hashing
from s4format.schema import FOOTER_SIZE, HEADER_SIZE, Footer, Header, Index


def plain(obj: Any) -> Any:
    """construct's containers as plain dicts and lists (without its private ``_io`` keys)."""
    if isinstance(obj, Container):
        return {k: plain(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, ListContainer | list):
        return [plain(v) for v in obj]
    return obj


@dataclass
class Parts:
    header: dict[str, Any]
    data: bytes  # bytes HEADER_SIZE..index_offset: plane payloads and padding
    index: dict[str, Any]  # tensors, parent_id, tree, metadata, extensions
    footer: dict[str, Any] = field(default_factory=dict)  # as parsed; ``build`` recomputes it

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.index["tensors"]

    def copy(self) -> Parts:
        return copy.deepcopy(self)


def parse(blob: bytes) -> Parts:
    footer = plain(Footer.parse(blob[-FOOTER_SIZE:]))
    start, length = footer["index_offset"], footer["index_length"]
    return Parts(plain(Header.parse(blob[:HEADER_SIZE])), blob[HEADER_SIZE:start],
                 plain(Index.parse(blob[start:start + length])), footer)


def seal(struct_: Any, fields: dict[str, Any]) -> bytes:
    """A header or footer whose checksum covers its first 24 bytes."""
    fields = {k: v for k, v in fields.items() if k not in ("checksum", "end_magic")}
    draft = struct_.build({**fields, "checksum": 0})
    return struct_.build({**fields, "checksum": hashing.bytes_checksum(draft[:24])})


def index_bytes(index: dict[str, Any]) -> bytes:
    return Index.build(index)


def build(parts: Parts, *, index: bytes | None = None) -> bytes:
    """Reassemble ``parts``; ``index`` replaces the built index with raw bytes of one's own."""
    head = seal(Header, parts.header)
    idx = index_bytes(parts.index) if index is None else index
    offset = len(head) + len(parts.data)
    foot = seal(Footer, dict(index_offset=offset, index_length=len(idx),
                             index_checksum=hashing.bytes_checksum(idx)))
    return head + parts.data + idx + foot


def with_footer(blob: bytes, **changes: int) -> bytes:
    """``blob`` with footer fields changed and the footer checksum recomputed."""
    footer = plain(Footer.parse(blob[-FOOTER_SIZE:]))
    return blob[:-FOOTER_SIZE] + seal(Footer, {**footer, **changes})


def plane_bytes(parts: Parts, tensor: int, plane: int) -> bytes:
    p = parts.tensors[tensor]["planes"][plane]
    at = p["offset"] - HEADER_SIZE
    return parts.data[at:at + p["stored_len"]]


def set_plane_bytes(parts: Parts, tensor: int, plane: int, payload: bytes) -> None:
    """Overwrite a plane's stored bytes in place (same length) and fix its checksum."""
    p = parts.tensors[tensor]["planes"][plane]
    if len(payload) != p["stored_len"]:
        raise ValueError("payload must keep the plane's stored length")
    at = p["offset"] - HEADER_SIZE
    parts.data = parts.data[:at] + payload + parts.data[at + len(payload):]
    p["checksum"] = hashing.plane_checksum(payload)


def reseal(blob: bytes) -> bytes:
    """``blob`` with every checksum it can locate recomputed: the header's; if the footer's
    index span lies inside the file, each plane checksum whose span does (when the index
    parses), the index checksum and the footer's. Content hashes are left alone: fixing them
    would need a decoder. Bytes that cannot be located are left as they are."""
    out = bytearray(blob)
    if len(out) >= HEADER_SIZE:
        with contextlib.suppress(ConstructError):
            out[:HEADER_SIZE] = seal(Header, plain(Header.parse(bytes(out[:HEADER_SIZE]))))
    if len(out) < HEADER_SIZE + FOOTER_SIZE:
        return bytes(out)
    raw_footer = bytes(out[-FOOTER_SIZE:])
    start, length = (int.from_bytes(raw_footer[i:i + 8], "little") for i in (0, 8))
    if start + length > len(out) - FOOTER_SIZE:
        return bytes(out)
    index = bytes(out[start:start + length])
    try:
        parsed = plain(Index.parse(index))
    except ConstructError:
        parsed = None
    if parsed is not None:
        for t in parsed["tensors"]:
            for p in t["planes"]:
                if p["offset"] + p["stored_len"] <= start:
                    stored = bytes(out[p["offset"]:p["offset"] + p["stored_len"]])
                    p["checksum"] = hashing.plane_checksum(stored)
        try:
            rebuilt = Index.build(parsed)
        except (ConstructError, ValueError, OverflowError):
            rebuilt = index
        if len(rebuilt) == length:
            index = rebuilt
            out[start:start + length] = index
    footer = dict(index_offset=start, index_length=length,
                  index_checksum=hashing.bytes_checksum(index))
    footer_bytes = seal(Footer, footer)
    # Keep a damaged end magic damaged: that is what the mutation was about.
    out[-FOOTER_SIZE:] = footer_bytes[:32] + raw_footer[32:]
    return bytes(out)
