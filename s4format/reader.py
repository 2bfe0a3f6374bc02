"""Reading .s4w files: header and footer checks, the index, random access to any tensor.

A :class:`Reader` reads the header, the footer and the index once (three reads, so it works the
same over S3 ranged GETs), validates every record and the object tree (typed values included),
and then decodes single tensors on demand; :meth:`Reader.load` first checks that the tensors
the tree references fit its decode budget. Deltas need their parent: pass it as ``parent=``
(another Reader, itself possibly a delta, or a file, opened after this one as rules A order).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from construct import ConstructError

from s4format import (
    budget,
    codecs,
    hashing,
    layouts,
    masked,
    objtree,
    scratch,
    threads,
    typedvalues,
)
from s4format.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    ContentHashError,
    FormatError,
    LimitError,
    ParentMismatchError,
    S4Error,
    TruncatedError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from s4format.indexread import read_index
from s4format.records import (
    TensorInfo,
    check_no_overlap,
    decodable_codec,
    plain_info,
    tensor_info,
)
from s4format.schema import (
    END_MAGIC,
    FOOTER_SIZE,
    HEADER_SIZE,
    KNOWN_REQUIRED_FLAGS,
    MAGIC,
    MAJOR,
    NO_PARENT,
    Footer,
    Header,
    Index,
    compiled_index,
)
from s4format.source import ByteSource, open_source
from s4format.tensor import Tensor

MAX_INDEX_SIZE = 256 << 20
MAX_ALIGN_LOG2 = 16
MAX_TENSORS = 1 << 20  # tensors per file this reader parses (rule I0), unless configured
REPARSE_TENSORS = 1 << 16  # a failed index of more tensors is not parsed a second time
MIN_TENSOR_RECORD = 32  # bytes of the smallest tensor record (empty name, no dims, no planes)
MIN_INDEX = 34  # bytes of an index besides its records (magic, counts, parent ID, prefixes)


class _Checked:
    """What this process found valid (the rules checked passed), by the bytes it was found in,
    the last :attr:`KEPT` of at most :attr:`LARGEST` bytes each."""

    KEPT = 16              # entries remembered
    LARGEST = 4 << 20      # bytes of the largest entry remembered

    def __init__(self) -> None:
        self._known: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # (a thread of the parent may have held it)

    def get(self, key: tuple | None) -> Any:
        if key is None:
            return None
        with self._lock:
            found = self._known.get(key)
            if found is not None:
                self._known.move_to_end(key)
            return found

    def add(self, key: tuple | None, value: Any) -> None:
        if key is None:
            return
        with self._lock:
            self._known[key] = value
            while len(self._known) > self.KEPT:
                self._known.popitem(last=False)


class _CheckedTrees(_Checked):
    """Object trees this process has decoded and found valid (rule X4), with their tensor
    reference counts, by their bytes and a digest of the shapes and sizes of the tensors they
    were checked against (all that the typed-value checks read). The files of a delta chain
    hold one tree byte for byte, and a chain load uses only the newest file's: the others are
    checked by a lookup instead of a decode that costs milliseconds per file."""

    def add(self, key: tuple | None, uses: list[int]) -> None:
        super().add(key, tuple(uses))

    @classmethod
    def key(cls, raw: bytes, tensors: list[TensorInfo]) -> tuple | None:
        if len(raw) > cls.LARGEST:
            return None
        # (a cryptographic digest: a file cannot be made to match another file's tensors)
        shapes = repr([(t.shape, t.raw_nbytes) for t in tensors]).encode()
        return bytes(raw), len(tensors), hashlib.blake2b(shapes, digest_size=32).digest()


class _Index(NamedTuple):
    """A parsed index found valid, as :class:`_CheckedIndexes` remembers it."""
    tensors: tuple[TensorInfo, ...]
    parent_id: bytes | None
    tree: bytes
    metadata: bytes
    codecs: frozenset[int]  # the codec IDs its planes use


class _CheckedIndexes(_Checked):
    """Indexes this process has parsed and found valid, by their bytes and all else their
    rules read (the data area's end, the alignment, the tensor limit): the tensors' records,
    the parent ID, the object tree's and the metadata's bytes, and the codec IDs the planes
    use. A chain's base is opened by every load and delta save of its steps, and an index of
    147 tensors takes about 2 ms to parse and check (13 µs a tensor)."""

    @classmethod
    def key(cls, raw: bytes, data_end: int, alignment: int, max_tensors: int) -> tuple | None:
        if len(raw) > cls.LARGEST:
            return None
        return bytes(raw), data_end, alignment, max_tensors


_CHECKED_TREES = _CheckedTrees()
_CHECKED_INDEXES = _CheckedIndexes()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: (_CHECKED_TREES.after_fork(),
                                                _CHECKED_INDEXES.after_fork()))
_UNDECODED = object()  # a tree found valid by its bytes, decoded when first asked for


def _codecs_load(ids) -> bool:
    """Whether this process decodes every codec of ``ids`` (their libraries load)."""
    try:
        for c in ids:
            decodable_codec(c)
    except S4Error:
        return False
    return True


def checkpoint_id(content_hashes: list[bytes]) -> bytes:
    """The identity deltas name their parent by: XXH3-128 of the u32 tensor count followed by
    every tensor's content hash in index order."""
    return hashing.xxhash.xxh3_128_digest(struct.pack("<I", len(content_hashes))
                                          + b"".join(content_hashes))


def _parse_index(raw: bytes, name: str, max_tensors: int = MAX_TENSORS,
                 plain: Callable[..., TensorInfo | None] | None = None):
    """The index's records. :func:`~s4format.indexread.read_index` reads a well-formed index
    without extensions; construct's compiled parser what it gives up on (several times faster
    than the interpreted one, with the same result); anything that fails on is parsed again
    by the interpreted parser, which names what is malformed exactly as it always has (the
    compiled code raises bare struct, codec and index errors instead).

    The compiled code does not check that a length-prefixed field's bytes are all there: a
    short read is caught by the fixed-size field after it, except for the last extension's
    data, which only the end of the index follows. An index with extensions (our writer
    writes none) is therefore always parsed by the interpreted parser.

    The tensor count is checked before anything is parsed (rule I0): parsing costs about 6 s
    and 0.8 GB per million records, and a hostile 256 MiB index can declare 8 million. A
    failed index of more than ``REPARSE_TENSORS`` records is reported from the compiled
    parser's error instead of being parsed a second time.

    ``plain``: makes a record's checked :class:`TensorInfo` from its fields, or None where the
    record needs the rules one by one (``records.plain_info``); where it makes every record's,
    the index's tensors are those, with ``plain`` set on the index."""
    count = struct.unpack_from("<I", raw, 4)[0] if len(raw) >= 8 else 0
    if count * MIN_TENSOR_RECORD > len(raw) - MIN_INDEX:  # I2, found without parsing
        raise FormatError(f"{name}: malformed index: {count} tensor records cannot fit in its "
                          f"{len(raw)} bytes")
    if count > max_tensors:
        raise LimitError(f"{name}: the index declares {count} tensors, more than this reader's "
                         f"limit of {max_tensors} (max_tensors)")
    if plain is not None and (idx := read_index(raw, plain)) is not None:
        return idx._replace(plain=True)
    idx = read_index(raw)
    if idx is not None:
        return idx
    try:
        idx = compiled_index().parse(raw)
        if not idx.extensions:
            return idx
    except Exception as exc:  # malformed bytes: the reference parser below reports them
        if count > REPARSE_TENSORS:
            raise FormatError(f"{name}: malformed index ({type(exc).__name__}: "
                              f"{_short(exc) if isinstance(exc, ConstructError) else exc})"
                              ) from None
    try:
        return Index.parse(raw)
    except ConstructError as exc:
        raise FormatError(f"{name}: malformed index: {_short(exc)}") from None


class Reader:
    def __init__(self, source: str | os.PathLike[str] | bytes | ByteSource, *,
                 parent: Reader | str | os.PathLike[str] | bytes | ByteSource | None = None,
                 verify: bool = True,
                 max_index_size: int = MAX_INDEX_SIZE,
                 max_tensor_bytes: int | None = None,
                 max_tensors: int = MAX_TENSORS,
                 max_decoded_bytes: int | None = None) -> None:
        """``max_tensor_bytes`` caps the raw size of a tensor this reader will decode (default:
        this machine's physical memory): codecs may legitimately expand a small file enormously
        (spec/validation.md, R0), and a tensor that cannot fit is refused up front with a
        LimitError instead of failing inside an allocation. ``max_decoded_bytes`` caps what
        :meth:`load` decodes in all (rule L1; default: the memory available when it starts).
        ``max_tensors`` caps the tensors an index may declare (rule I0). ``parent``: the
        delta's parent, a Reader or a file to open as one after this file (rules A)."""
        self.max_tensors = max_tensors
        self.max_tensor_bytes = budget.physical_memory() if max_tensor_bytes is None \
            else max_tensor_bytes
        self.max_decoded_bytes = max_decoded_bytes
        self.source = open_source(source)
        self.name = self.source.name
        self.verify_hashes = verify
        self.parent: Reader | None = None
        self._owns_parent = False
        try:
            self._read_header()
            self._read_footer(max_index_size)
            self._read_index()
            self.checkpoint_id = checkpoint_id([t.content_hash for t in self.tensors])
            self._by_name = {t.name: i for i, t in enumerate(self.tensors)}
            if parent is not None:
                self.attach_parent(parent)
        except BaseException:
            # A source we opened is ours to close: the exception's traceback keeps this
            # half-built Reader (and so the file descriptor) alive for as long as it is held.
            if self.source is not source:
                self.close()
            raise

    # -- structure -------------------------------------------------------------------------

    def _read_header(self) -> None:
        size = self.source.size()
        head = self.source.read_at(0, min(size, HEADER_SIZE)).tobytes()
        if head[:8] != MAGIC[:len(head)]:
            raise BadMagicError(f"{self.name}: not a .s4w file ({_describe_magic(head)})")
        if size < HEADER_SIZE + FOOTER_SIZE:
            raise TruncatedError(f"{self.name}: {size} bytes is shorter than a header and footer "
                                 f"({HEADER_SIZE + FOOTER_SIZE}); the file is truncated")
        h = Header.parse(head)
        if h.major != MAJOR:
            raise UnsupportedVersionError(
                f"{self.name}: format version {h.major}.{h.minor}; this reader understands major "
                f"version {MAJOR} only — upgrade s4weights to read it")
        if h.checksum != hashing.bytes_checksum(head[:24]):
            raise ChecksumError(f"{self.name}: header checksum mismatch (bytes 0..31 damaged)")
        if h.required_flags & ~KNOWN_REQUIRED_FLAGS:
            raise UnsupportedFeatureError(
                f"{self.name}: must-understand flags {h.required_flags:#010x} are not known to "
                "this reader; upgrade s4weights to read this file")
        if h.reserved != bytes(3):
            raise FormatError(f"{self.name}: reserved header bytes are not zero")
        if h.align_log2 > MAX_ALIGN_LOG2:
            raise LimitError(f"{self.name}: alignment 2^{h.align_log2} exceeds 2^{MAX_ALIGN_LOG2}")
        self.header = h
        self.version = (h.major, h.minor)
        self.alignment = 1 << h.align_log2

    def _read_footer(self, max_index_size: int) -> None:
        size = self.source.size()
        raw = self.source.read_at(size - FOOTER_SIZE, FOOTER_SIZE).tobytes()
        if raw[-8:] != END_MAGIC:
            raise TruncatedError(f"{self.name}: no footer at the end of the file: truncated, "
                                 "the save that wrote it did not finish, or other bytes follow "
                                 "it (a .s4w file runs to the end of what is read)")
        f = Footer.parse(raw)
        if f.checksum != hashing.bytes_checksum(raw[:24]):
            raise ChecksumError(f"{self.name}: footer checksum mismatch (last {FOOTER_SIZE} bytes)")
        if f.index_length > min(max_index_size, size):
            raise LimitError(f"{self.name}: index of {f.index_length} bytes exceeds the limit of "
                             f"{min(max_index_size, size)}")
        if f.index_offset < HEADER_SIZE or f.index_offset + f.index_length != size - FOOTER_SIZE:
            raise FormatError(f"{self.name}: index at {f.index_offset} of {f.index_length} bytes "
                              f"does not end where the footer starts ({size - FOOTER_SIZE})")
        self.footer = f
        self.data_end = f.index_offset

    def _read_index(self) -> None:
        f = self.footer
        raw = self.source.read_at(f.index_offset, f.index_length).tobytes()
        if hashing.bytes_checksum(raw) != f.index_checksum:
            raise ChecksumError(f"{self.name}: index checksum mismatch (bytes "
                                f"{f.index_offset}..{f.index_offset + f.index_length})")
        key = _CheckedIndexes.key(raw, self.data_end, self.alignment, self.max_tensors)
        known = _CHECKED_INDEXES.get(key)
        if known is not None and _codecs_load(known.codecs):
            tensors, self.parent_id = list(known.tensors), known.parent_id
            tree, metadata = known.tree, known.metadata
        else:  # (a codec whose library no longer loads: the parse says which)
            tensors, self.parent_id, tree, metadata = self._parse_index(raw)
            _CHECKED_INDEXES.add(key, _Index(tuple(tensors), self.parent_id, tree, metadata,
                                             frozenset(p.codec for t in tensors
                                                       for p in t.planes)))
        self.tensors: list[TensorInfo] = tensors
        # how many references each tensor has: a load decodes each once and keeps it only
        # while references to it remain
        key = _CheckedTrees.key(tree, tensors)
        uses = _CHECKED_TREES.get(key)
        if uses is not None:
            self.tensor_uses = list(uses)
            self._tree, self._tree_raw = _UNDECODED, tree
        else:
            self.tensor_uses = [0] * len(tensors)
            self._tree = self._decode_tree(tree, len(tensors), "object tree", self.tensor_uses)
            _CHECKED_TREES.add(key, self.tensor_uses)
        meta = self._decode_tree(metadata, 0, "metadata")
        if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise FormatError(f"{self.name}: metadata must be a dict of str to str")
        self.metadata: dict[str, str] = meta

    def _parse_index(self, raw: bytes) -> tuple[list[TensorInfo], bytes | None, bytes, bytes]:
        """The index's tensors, each record checked, the parent checkpoint ID (None for a
        base), and the object tree's and the metadata's bytes, not yet decoded."""
        codec_of = functools.cache(decodable_codec)  # (the few codec IDs of many planes)
        data_end, alignment = self.data_end, self.alignment

        def plain(*fields) -> TensorInfo | None:  # (checked as it is read: no dict per record)
            return plain_info(*fields, data_end, alignment, codec_of)
        idx = _parse_index(raw, self.name, self.max_tensors, plain)
        for ext in idx.extensions:
            if ext.required:
                raise UnsupportedFeatureError(
                    f"{self.name}: must-understand index extension {ext.tag!r} is unknown")
        name = self.name
        tensors = idx.tensors if getattr(idx, "plain", False) else [
            tensor_info(rec, lambda i=i, rec=rec: f"{name}: tensor {i} {rec['name']!r}",
                        data_end, alignment, codec_of) for i, rec in enumerate(idx.tensors)]
        names = set()
        for t in tensors:
            if t.name in names:
                raise FormatError(f"{self.name}: tensor name {t.name!r} appears twice")
            names.add(t.name)
        check_no_overlap(tensors, self.name)
        parent_id = None if idx.parent_id == NO_PARENT else bytes(idx.parent_id)
        if parent_id is None and any(t.is_delta for t in tensors):
            raise FormatError(f"{self.name}: delta tensors but no parent checkpoint ID")
        return tensors, parent_id, bytes(idx.tree), bytes(idx.metadata)

    @property
    def tree(self) -> Any:
        """The decoded object tree, its tensors as :class:`~s4format.objtree.TensorRef`."""
        tree = self._tree
        if tree is _UNDECODED:  # (two threads may both decode it: the same tree)
            tree = self._tree = self._decode_tree(self._tree_raw, len(self.tensors),
                                                  "object tree")
        return tree

    def _decode_tree(self, raw: bytes, tensor_count: int, part: str,
                     uses: list[int] | None = None) -> Any:
        def check_typed(name: str, value: Any) -> None:
            typedvalues.check(name, value, self.tensors)
        try:
            return objtree.decode(raw, tensor_count, check_typed=check_typed, uses=uses)
        except FormatError as exc:  # LimitError among them: the same class, naming the file
            raise type(exc)(f"{self.name}: {part}: {exc}") from None

    # -- parents ---------------------------------------------------------------------------

    def attach_parent(self, parent: Reader | str | os.PathLike[str] | bytes | ByteSource
                      ) -> None:
        """Rules A, after this file's own (H-X): A1 on this file, then a parent given as a
        file is opened (its own rules, its own errors), then A2. A parent opened here is
        closed with this Reader."""
        if self.parent_id is None:
            raise ParentMismatchError(f"{self.name} is not a delta; it takes no parent")
        opened = not isinstance(parent, Reader)
        if opened:
            parent = Reader(parent, verify=self.verify_hashes,
                            max_tensor_bytes=self.max_tensor_bytes, max_tensors=self.max_tensors)
        if parent.checkpoint_id != self.parent_id:
            if opened:
                parent.close()
            raise ParentMismatchError(
                f"{self.name} is a delta against checkpoint {self.parent_id.hex()}, but "
                f"{parent.name} is checkpoint {parent.checkpoint_id.hex()}")
        if self._owns_parent and self.parent is not None:
            self.parent.close()
        self.parent, self._owns_parent = parent, opened
        self._parent_by_hash = {t.content_hash: i for i, t in enumerate(parent.tensors)}

    def _parent_index(self, t: TensorInfo) -> int:
        """Rule R5's parent tensor of delta ``t``, found before any of ``t``'s planes is read:
        without it the delta cannot be decoded, whatever its planes hold."""
        if self.parent is None:
            raise ParentMismatchError(
                f"{self.name}: tensor {t.name!r} is a delta; open the file with its parent "
                f"checkpoint {self.parent_id.hex() if self.parent_id else '?'}")
        i = self._parent_by_hash.get(t.parent_hash)
        if i is None or self.parent.tensors[i].raw_nbytes != t.raw_nbytes:
            raise ParentMismatchError(f"{self.name}: parent {self.parent.name} holds no tensor "
                                      f"with hash {t.parent_hash.hex()} of {t.raw_nbytes} bytes "
                                      f"for delta {t.name!r}")
        return i

    # -- payloads --------------------------------------------------------------------------

    def index_of(self, name: str) -> int:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.name} has no tensor named {name!r}") from None

    def read_stored(self, t: TensorInfo, plane_no: int,
                    span: tuple[int, np.ndarray] | None = None) -> np.ndarray:
        """A plane's stored bytes, checksum verified (codecs only ever see verified bytes).
        ``span`` = ``(offset, bytes)`` already read that cover the plane (see
        :meth:`read_span`)."""
        p = t.planes[plane_no]
        if span is not None and span[0] <= p.offset \
                and p.offset + p.stored_len <= span[0] + span[1].size:
            stored = span[1][p.offset - span[0]:p.offset - span[0] + p.stored_len]
        else:
            stored = self.source.read_at(p.offset, p.stored_len)
        if hashing.plane_checksum(stored) != p.checksum:
            raise ChecksumError(f"{self.name}: tensor {t.name!r} plane {p.label}: checksum of "
                                f"the {p.stored_len} stored bytes at offset {p.offset} mismatch")
        return stored

    def read_span(self, t: TensorInfo) -> tuple[int, np.ndarray]:
        """All of a tensor's stored planes in one read (one ranged GET on S3): they are
        contiguous but for alignment padding when written by our writer."""
        lo, hi = _bounds(t)
        return lo, self.source.read_at(lo, hi - lo)

    def compact_span(self, t: TensorInfo) -> tuple[int, np.ndarray] | None:
        """:meth:`read_span` when the tensor's planes sit together (as our writer puts them),
        else None: a hostile file whose planes lie far apart is read plane by plane instead
        of as one huge span."""
        return None if self.compact_bounds(t) is None else self.read_span(t)

    def compact_bounds(self, t: TensorInfo) -> tuple[int, int] | None:
        """The byte range :meth:`compact_span` reads (for a caller reading it its own way,
        e.g. in parallel pieces), or None when it reads none."""
        return _compact_bounds(t)

    def read_plane(self, t: TensorInfo, plane_no: int,
                   span: tuple[int, np.ndarray] | None = None) -> np.ndarray:
        """A plane's decoded bytes."""
        return self._decode_plane(t, plane_no, self.read_stored(t, plane_no, span))

    def _decode_plane(self, t: TensorInfo, plane_no: int, stored: np.ndarray) -> np.ndarray:
        p = t.planes[plane_no]
        try:
            out = codecs.get(p.codec).decode(stored, p.decoded_len, p.params)
        except S4Error as exc:
            # Codecs know nothing of files and tensors; verify prints this message as it is.
            raise type(exc)(f"{self.name}: tensor {t.name!r} plane {p.label}: {exc}") from None
        if out.shape != (p.decoded_len,):  # R3: a stream of another length breaks its codec
            raise CodecError(f"{self.name}: tensor {t.name!r} plane {p.label} decoded to "
                             f"{out.size} bytes, declared {p.decoded_len}")
        return out

    def read_raw(self, i: int) -> np.ndarray:
        """The tensor's raw bytes (uint8), checked against its content hash when verifying
        (a delta's always). A delta's chain is applied in one buffer: its base decoded, then
        each level XORed in as it is merged and its hash checked."""
        t = self._tensor(i)
        if not t.is_delta:
            if len(t.planes) == 1 and t.layout.layout_id == layouts.RAW.layout_id \
                    and t.planes[0].stored_len < scratch.MIN_READ:
                # One small plane, whole (a bias, a norm): read and decoded without the merge
                # that several planes need (and no reused buffer, which it would not get).
                raw, fresh, leaves = self._plane_by_plane(t, [self.read_stored(t, 0)]), False, None
            else:
                leaves = self._leaves(t) if self.verify_hashes else None
                raw, fresh = self._own(t, leaves)
            if not raw.flags.writeable or (raw.base is not None
                                           and raw.nbytes != raw.base.nbytes):
                raw = raw.copy()  # read-only, or a view that would keep a larger buffer alive
            if self.verify_hashes:
                self._check_hash(t, raw, leaves if fresh else None)
            return raw
        # From the base up, each level XORed into one buffer as it is merged: the buffer then
        # holds every level's bytes in turn, and each level's hash is checked on them (R6).
        # Anything wrong: the chain is read again level by level, in the spec's order (R5
        # before a tensor's planes, its planes before its parent's), which names the fault.
        try:
            levels = [(self, t)]
            while levels[-1][1].is_delta:
                r, lt = levels[-1]
                k = r._parent_index(lt)
                levels.append((r.parent, r.parent._tensor(k)))  # type: ignore[union-attr]
            reader, base = levels.pop()
            leaves = reader._leaves(base) if reader.verify_hashes else None
            acc, fresh = reader._own(base, leaves)
            if not fresh:  # (a plane as read or decoded: the caller's buffer, maybe)
                acc = acc.copy()
            checked = None  # the content hash acc's bytes were found to have
            if reader.verify_hashes:
                reader._check_hash(base, acc, leaves if fresh else None)
                checked = base.content_hash
            for r, lt in reversed(levels):
                if r._keeps_nothing(lt):
                    # An unchanged tensor (a frozen layer's): the bytes stay as checked below
                    # it, so a hash equal to theirs needs no second pass over them.
                    if not r._mask_clear(lt):
                        break
                    if lt.content_hash != checked:
                        r._check_hash(lt, acc)
                else:
                    leaves = r._leaves(lt)
                    if not r._xor_own(lt, acc, leaves):
                        break
                    r._check_hash(lt, acc, leaves)
                checked = lt.content_hash
            else:
                return acc
        except S4Error:
            pass
        return self._read_level_by_level(i)

    def _tensor(self, i: int) -> TensorInfo:
        if not 0 <= i < len(self.tensors):
            raise IndexError(f"{self.name} has {len(self.tensors)} tensors, no tensor {i}")
        t = self.tensors[i]
        if t.raw_nbytes > self.max_tensor_bytes:
            raise LimitError(f"{self.name}: tensor {t.name!r} declares {t.raw_nbytes} raw bytes, "
                             f"more than this reader's limit of {self.max_tensor_bytes} "
                             "(max_tensor_bytes)")
        return t

    def _check_hash(self, t: TensorInfo, raw: np.ndarray, leaves: np.ndarray | None = None
                    ) -> None:
        """Check ``raw`` against ``t``'s content hash; ``leaves``: the digests of its leaves
        where they were hashed as it was merged (:meth:`_leaves`), else None."""
        got = hashing.content_hash(raw) if leaves is None else \
            hashing.content_hash_of(raw.nbytes, leaves)
        if got != t.content_hash:
            raise ContentHashError(f"{self.name}: tensor {t.name!r} content hash mismatch after "
                                   "decoding: the file is corrupt or its parent is wrong")

    def _span_buffer(self, bounds: tuple[int, int] | None) -> np.ndarray | None:
        """A reused buffer (:mod:`scratch`) to read a tensor's stored planes into, where they
        sit together in ``bounds`` (:meth:`compact_bounds`) and the source reads into
        buffers; else None. The caller gives it back."""
        if bounds is None or bounds[1] > self.source.size() \
                or not hasattr(self.source, "read_into"):
            return None  # (a read past the end then says the file is truncated)
        return scratch.take(bounds[1] - bounds[0])

    @contextlib.contextmanager
    def _read_planes(self, t: TensorInfo
                     ) -> Iterator[tuple[list[np.ndarray], np.ndarray | None]]:
        """``t``'s stored planes (:meth:`_stored_planes`) and the reused buffer they were read
        into (None where none was), given back on leaving."""
        bounds = self.compact_bounds(t)
        buf = self._span_buffer(bounds)
        try:
            yield self._stored_planes(t, bounds, buf), buf
        finally:
            scratch.give(buf)

    def _stored_planes(self, t: TensorInfo, bounds: tuple[int, int] | None,
                       into: np.ndarray | None = None) -> list[np.ndarray]:
        """The stored bytes of ``t``'s planes, read as one span where they sit together in
        ``bounds`` (:meth:`compact_bounds`): into ``into`` where given (a read-only view of
        it, from :meth:`_span_buffer`)."""
        span = None
        if bounds is not None:
            lo, hi = bounds
            if into is None:
                span = lo, self.source.read_at(lo, hi - lo)
            else:
                view = self.source.read_into(lo, into[:hi - lo]).view()  # type: ignore
                view.flags.writeable = False
                span = lo, view
        # Every plane's checksum (R1) before any decoding (R2), as the GPU decoder does: a
        # damaged plane is reported as such even when an earlier plane fails to decode.
        return threads.map_sized(lambda k: self.read_stored(t, k, span),
                                 range(len(t.planes)), t.raw_nbytes)

    @staticmethod
    def _leaves(t: TensorInfo) -> np.ndarray | None:
        """Where ``t``'s planes merge in pieces (a masked tensor's, where its words are put
        in place in pieces), the array its merge fills with the leaf digests of its bytes
        (:meth:`_merged`); else None."""
        if not t.layout.merges_in_pieces(t.dtype.itemsize):
            return None
        return hashing.leaves_for(t.raw_nbytes)

    def _merged(self, t: TensorInfo, stored: list[np.ndarray],
                xor_into: np.ndarray | None = None, leaves: np.ndarray | None = None
                ) -> np.ndarray | None:
        """The tensor's bytes merged from its stored planes (XORed into ``xor_into``
        instead, where given), or None (:func:`layouts.merge_stored`); ``leaves`` from
        :meth:`_leaves`: filled where the bytes are returned."""
        if t.masked:
            return self._expanded(t, stored, xor_into, leaves)
        return layouts.merge_stored(t.layout, t.dtype.itemsize, t.raw_nbytes, [
            (p.codec, s, p.decoded_len, p.params) for p, s in zip(t.planes, stored)], xor_into,
            leaves)

    def _expanded(self, t: TensorInfo, stored: list[np.ndarray],
                  xor_into: np.ndarray | None = None, leaves: np.ndarray | None = None
                  ) -> np.ndarray | None:
        """A masked tensor's raw bytes (XORed into ``xor_into`` instead, where given): its
        kept words merged a piece at a time, then put in place by the mask, or both at once
        by :meth:`_expanded_bytes` for 2-byte words kept as bytes, up to
        :data:`masked.ONE_CALL_WORDS` words (``leaves``, where given, filled with the digests of
        the bytes put in place); None where anything is wrong (``xor_into`` may then be
        spoiled), or where its layout merges only whole planes (:meth:`_plane_by_plane` then
        decodes them)."""
        word = t.layout.word_size(t.dtype.itemsize)
        raw_layout = t.layout is layouts.RAW
        if not (raw_layout or t.layout.merges_in_pieces(t.dtype.itemsize)):
            return None
        if word == 2 and t.layout is layouts.BYTES and len(stored) == 3 \
                and t.raw_nbytes <= word * masked.ONE_CALL_WORDS:
            return self._expanded_bytes(t, stored, xor_into, leaves)
        try:
            mask = self._decode_plane(t, 0, stored[0])
            if raw_layout:
                kept = self._decode_plane(t, 1, stored[1])
            else:
                kept = layouts.merge_stored(
                    t.layout, t.dtype.itemsize, t.layout_planes[0].decoded_len * word,
                    [(p.codec, s, p.decoded_len, p.params)
                     for p, s in zip(t.layout_planes, stored[1:])])
            return None if kept is None else _placed(t, mask, kept, xor_into, leaves)
        except S4Error:
            return None

    def _expanded_bytes(self, t: TensorInfo, stored: list[np.ndarray],
                        xor_into: np.ndarray | None, leaves: np.ndarray | None
                        ) -> np.ndarray | None:
        """:meth:`_expanded` of a tensor of 2-byte words kept under the bytes layout: its
        three planes decoded whole, then put in place by one kernel call."""
        try:
            mask, low, high = self._decoded_planes(t, stored)
        except S4Error:
            return None
        out = np.zeros(t.raw_nbytes, np.uint8) if xor_into is None else xor_into
        return out if masked.expand_bytes(mask, low, high, out, xor_into is not None,
                                          leaves) else None

    def _decoded_planes(self, t: TensorInfo, stored: list[np.ndarray]) -> list[np.ndarray]:
        """Every plane of ``t`` decoded whole from its stored bytes ``stored``."""
        return threads.map_sized(lambda k: self._decode_plane(t, k, stored[k]),
                                 range(len(t.planes)), t.raw_nbytes)

    def _plane_by_plane(self, t: TensorInfo, stored: list[np.ndarray]) -> np.ndarray:
        """The tensor's own raw bytes from whole decoded planes, which names what is wrong."""
        planes = self._decoded_planes(t, stored)
        try:
            if not t.masked:
                return t.layout.merge(planes, t.raw_nbytes, t.dtype.itemsize)
            word = t.layout.word_size(t.dtype.itemsize)
            kept = t.layout.merge(planes[1:], planes[1].size * word, t.dtype.itemsize)
            return _placed(t, planes[0], kept, None)
        except FormatError as exc:
            raise FormatError(f"{self.name}: tensor {t.name!r}: {exc}") from None

    def _own(self, t: TensorInfo, leaves: np.ndarray | None = None
             ) -> tuple[np.ndarray, bool]:
        """The bytes ``t``'s own planes decode to (a delta's XOR against its parent), and
        whether they are a new buffer, merged (else a plane as decoded or read, maybe shared,
        and ``leaves`` not filled)."""
        with self._read_planes(t) as (stored, buf):
            raw = self._merged(t, stored, leaves=leaves)
            if raw is not None:
                return raw, True
            raw = self._plane_by_plane(t, stored)
            if buf is not None and np.may_share_memory(raw, buf):
                raw = raw.copy()  # (a plane as stored: the buffer is read into again)
            return raw, False

    @staticmethod
    def _keeps_nothing(t: TensorInfo) -> bool:
        """Whether ``t`` is masked and its planes keep no word (its own bytes all zero, as a
        tensor unchanged since its parent stores them)."""
        return t.masked and all(p.decoded_len == 0 for p in t.layout_planes)

    def _mask_clear(self, t: TensorInfo) -> bool:
        """Whether the mask of ``t`` (:meth:`_keeps_nothing`) sets no bit, its planes past
        their checksums (R1); False where it sets one (the rules then name it)."""
        n = t.raw_nbytes // t.layout.word_size(t.dtype.itemsize)
        with self._read_planes(t) as (stored, _buf):
            # (read while the buffer is held: a mask stored raw is a view of it)
            mask = self._decode_plane(t, 0, stored[0])
            return mask.size == masked.mask_len(n) and not mask.any()

    def _xor_own(self, t: TensorInfo, acc: np.ndarray, leaves: np.ndarray | None = None
                 ) -> bool:
        """XOR ``t``'s own decoded bytes into ``acc``, merged straight into it where its
        layout allows; False where that merge stopped part way (``acc`` is then spoiled)
        although the planes decode whole. ``leaves`` (:meth:`_leaves`): filled with the leaf
        digests of ``acc`` after the XOR."""
        with self._read_planes(t) as (stored, _buf):
            if t.layout.merges_in_pieces(t.dtype.itemsize):
                if self._merged(t, stored, xor_into=acc, leaves=leaves) is not None:
                    return True
                self._plane_by_plane(t, stored)  # raises, naming what is wrong
                return False
            np.bitwise_xor(acc, self._plane_by_plane(t, stored), out=acc)
            return True

    def read_own(self, i: int) -> np.ndarray:
        """Tensor i's own planes decoded, writable: a delta's XOR against its parent, which
        no content hash covers (its hash is of the bytes with every parent applied, the
        caller's to check); a tensor stored whole, its bytes unchecked."""
        raw, _fresh = self._own(self._tensor(i))
        return raw if raw.flags.writeable else raw.copy()

    def undo_delta(self, i: int, raw: np.ndarray) -> int:
        """Turn ``raw``, delta tensor i's bytes, into its parent's, in place: its own
        decoded bytes (the XOR) XORed out of them, one level's decode. Returns the parent
        tensor's index in :attr:`parent`; ParentMismatchError where it is not there, an
        S4Error where the planes do not decode. ``raw`` is not checked against the parent's
        content hash (the caller's to do)."""
        t = self._tensor(i)
        if not t.is_delta:
            raise ValueError(f"tensor {t.name!r} is not a delta")
        if raw.ndim != 1 or raw.nbytes != t.raw_nbytes or raw.dtype != np.uint8 \
                or not raw.flags.writeable or not raw.flags.c_contiguous:
            raise ValueError(f"raw must be the {t.raw_nbytes} writable bytes of {t.name!r}, "
                             "contiguous, in one dimension")
        k = self._parent_index(t)
        if not self._xor_own(t, raw):
            raise FormatError(f"{self.name}: tensor {t.name!r}: its planes do not merge")
        return k

    def _read_level_by_level(self, i: int) -> np.ndarray:
        """:meth:`read_raw` of a delta one level at a time, every rule in the spec's order."""
        t = self._tensor(i)
        parent = self._parent_index(t) if t.is_delta else None
        raw, _fresh = self._own(t)
        if parent is not None:
            raw = np.bitwise_xor(raw, self.parent._read_level_by_level(parent))  # type: ignore
        if self.verify_hashes or parent is not None:
            self._check_hash(t, raw)
        return raw

    def read(self, key: int | str) -> Tensor:
        i = self.index_of(key) if isinstance(key, str) else key
        t = self.tensors[i]
        return Tensor(t.dtype, t.shape, self.read_raw(i))

    def decode_budget(self) -> int:
        """The bytes one load may decode: ``max_decoded_bytes``, or the memory available now."""
        if self.max_decoded_bytes is not None:
            return self.max_decoded_bytes
        return budget.available_memory()

    def check_budget(self, indices: Any, limit: int | None = None) -> None:
        """Rule L1: LimitError, before anything is decoded, when the distinct tensors
        ``indices`` hold more raw bytes than ``limit`` (default :meth:`decode_budget`)."""
        total = sum(self.tensors[i].raw_nbytes for i in set(indices))
        budget.check(total, self.decode_budget() if limit is None else limit, self.name)

    def load(self) -> Any:
        """The object tree with every tensor reference replaced by its :class:`Tensor`."""
        self.check_budget(i for i, n in enumerate(self.tensor_uses) if n)
        cache: dict[int, Tensor] = {}

        def tensor(ref: objtree.TensorRef) -> Tensor:
            if ref.index not in cache:
                cache[ref.index] = self.read(ref.index)
            return cache[ref.index]

        return resolve_refs(self.tree, tensor)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close:
            close()
        if self._owns_parent and self.parent is not None:
            self.parent.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _placed(t: TensorInfo, mask: np.ndarray, kept: np.ndarray,
            xor_into: np.ndarray | None, leaves: np.ndarray | None = None) -> np.ndarray:
    """Masked tensor ``t``'s kept words put in place by its decoded mask: into new zero bytes,
    or XORed into ``xor_into``; ``leaves``: filled with the leaf digests of the result."""
    out = np.zeros(t.raw_nbytes, np.uint8) if xor_into is None else xor_into
    masked.expand(mask, kept, out, t.layout.word_size(t.dtype.itemsize), xor_into is not None,
                  leaves)
    return out


def _bounds(t: TensorInfo) -> tuple[int, int]:
    """First and one-past-last byte of a tensor's stored planes; (0, 0) without planes."""
    if not t.planes:
        return 0, 0
    return (min(p.offset for p in t.planes), max(p.offset + p.stored_len for p in t.planes))


def _compact_bounds(t: TensorInfo) -> tuple[int, int] | None:
    """:func:`_bounds` where the planes sit together (64 KiB of padding a plane at most),
    else None."""
    if not t.planes:
        return None
    lo, hi = _bounds(t)
    return (lo, hi) if hi - lo <= t.stored_nbytes + 64 * len(t.planes) * 1024 else None


def resolve_refs(obj: Any, tensor) -> Any:
    """Rebuild a decoded tree with ``tensor(ref)`` in place of each TensorRef."""
    t = type(obj)
    if t is objtree.TensorRef:
        return tensor(obj)
    if t is list:
        return [resolve_refs(x, tensor) for x in obj]
    if t is tuple:
        return tuple(resolve_refs(x, tensor) for x in obj)
    if t is dict or t.__name__ == "OrderedDict":
        return t((k, resolve_refs(v, tensor)) for k, v in obj.items())
    if t is objtree.Typed:
        return objtree.Typed(obj.name, resolve_refs(obj.value, tensor))
    return obj


def _describe_magic(head: bytes) -> str:
    if head.startswith(b"\x89S4W\r\r\n") or head.startswith(b"\x89S4W\n\x1a") or \
            head.startswith(b"\x89S4W\r\n\x1a\r\n"):
        return "its magic bytes show text-mode damage (line endings converted); transfer it " \
               "in binary mode"
    if head.startswith(b"\x89S4W"):
        return "its magic is damaged"
    return f"starts with {head[:8]!r}"


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
