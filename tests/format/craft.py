"""Take a valid .s4w file apart and put it back together with one thing changed.

``parse`` splits a file into its header fields, data section, index (tensor records, tree bytes,
metadata, extensions) and footer fields as plain dicts and lists; ``build`` reassembles them and
recomputes every derived value (header checksum, index length and checksum, footer checksum), so
a test that edits one field exercises exactly the rule about that field and no other check.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from construct import Container, ListContainer

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
    footer: dict[str, Any] = field(default_factory=dict)

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.index["tensors"]

    def copy(self) -> Parts:
        return copy.deepcopy(self)


def parse(blob: bytes) -> Parts:
    header = plain(Header.parse(blob[:HEADER_SIZE]))
    footer = plain(Footer.parse(blob[-FOOTER_SIZE:]))
    start, length = footer["index_offset"], footer["index_length"]
    index = plain(Index.parse(blob[start:start + length]))
    return Parts(header, blob[HEADER_SIZE:start], index, footer)


def seal(struct_: Any, fields: dict[str, Any]) -> bytes:
    """Build a header or footer whose checksum covers its first 24 bytes."""
    draft = struct_.build({**fields, "checksum": 0})
    return struct_.build({**fields, "checksum": hashing.bytes_checksum(draft[:24])})


def header_bytes(header: dict[str, Any]) -> bytes:
    return seal(Header, header)


def index_bytes(index: dict[str, Any]) -> bytes:
    return Index.build(index)


def build(parts: Parts, *, index: bytes | None = None) -> bytes:
    """Reassemble ``parts``; ``index`` replaces the built index with raw bytes of one's own."""
    head = header_bytes(parts.header)
    idx = index_bytes(parts.index) if index is None else index
    offset = len(head) + len(parts.data)
    foot = seal(Footer, dict(index_offset=offset, index_length=len(idx),
                             index_checksum=hashing.bytes_checksum(idx)))
    return head + parts.data + idx + foot


def with_footer(blob: bytes, **changes: int) -> bytes:
    """``blob`` with footer fields changed and the footer checksum recomputed."""
    footer = {k: v for k, v in plain(Footer.parse(blob[-FOOTER_SIZE:])).items()
              if k not in ("checksum", "end_magic")}
    return blob[:-FOOTER_SIZE] + seal(Footer, {**footer, **changes})


def set_plane_bytes(parts: Parts, tensor: int, plane: int, payload: bytes) -> None:
    """Overwrite a plane's stored bytes in place (same length) and fix its checksum."""
    p = parts.tensors[tensor]["planes"][plane]
    if len(payload) != p["stored_len"]:
        raise ValueError("payload must keep the plane's stored length")
    at = p["offset"] - HEADER_SIZE
    parts.data = parts.data[:at] + payload + parts.data[at + len(payload):]
    p["checksum"] = hashing.plane_checksum(payload)


def plane_bytes(parts: Parts, tensor: int, plane: int) -> bytes:
    p = parts.tensors[tensor]["planes"][plane]
    at = p["offset"] - HEADER_SIZE
    return parts.data[at:at + p["stored_len"]]
