"""Content hashes and plane checksums (``spec/format.md``, "Hashes").

Both are two-level XXH3 tree hashes so a GPU can compute them in parallel and a CPU can verify
them: the bytes are cut into 64 KiB leaves, each leaf is hashed with XXH3-64 (seed 0), and the
root hashes the little-endian u64 byte length followed by the leaf digests as little-endian
u64s. The content hash of a tensor's raw bytes is the root's XXH3-128 (16 bytes, canonical
big-endian form); the checksum of a plane's stored bytes is the root's XXH3-64.
"""

from __future__ import annotations

import bisect
import itertools
import struct

import numpy as np
import xxhash

from s4format import jit, threads
from s4format.jit import intrinsic, kernel
from s4format.pieces import Pieces

LEAF_SIZE = 64 * 1024


# Leaves per piece of work on a worker thread.
_PIECE_LEAVES = 64
# Whole leaves are hashed by :func:`_hash_leaves`, as the xxhash module holds the GIL while it
# hashes a leaf (so on the pool its hashes would run one at a time); until another kernel has
# run, only where there are at least this many, so that hashing a small file alone does not
# start numba.
KERNEL_MIN_LEAVES = 16

# XXH3's default secret (192 bytes) as the rows :func:`_hash_leaves` reads: row s < 16 the 8
# words at byte s * 8 (stripe s of a block), row 16 at 128 (the scramble), row 17 at 121 (the
# last stripe), row 18 at 11 (the merge).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_ROWS = np.array([np.frombuffer(_SECRET, "<u8", 8, at)
                  for at in (*range(0, 128, 8), 128, 121, 11)], dtype=np.uint64)


def leaf_digests(data: np.ndarray | bytes | memoryview | Pieces,
                 todo: np.ndarray | None = None) -> np.ndarray:
    """The XXH3-64 digests of ``data``'s 64 KiB leaves (all, or the leaves ``todo`` selects, a
    mask: the others are left 0), computed on the pool. A leaf across two pieces is joined
    first: at most 64 KiB copied."""
    parts = data.parts if isinstance(data, Pieces) else [memoryview(data).cast("B")]
    if todo is None and len(parts) == 1:
        return _every_leaf(np.frombuffer(parts[0], np.uint8))
    starts = list(itertools.accumulate((len(p) for p in parts), initial=0))
    n = starts[-1]
    count = (n + LEAF_SIZE - 1) // LEAF_SIZE
    leaves = np.zeros(count, dtype="<u8")
    which = np.arange(count) if todo is None else np.flatnonzero(todo)
    whole = n // LEAF_SIZE
    if whole >= KERNEL_MIN_LEAVES or (whole and jit.started()):
        which = _whole_leaves(parts, starts, which, leaves)

    def leaf(j: int):
        lo, hi = j * LEAF_SIZE, min(n, (j + 1) * LEAF_SIZE)
        k = bisect.bisect_right(starts, lo) - 1
        if hi <= starts[k + 1]:
            return parts[k][lo - starts[k]:hi - starts[k]]
        joined = []
        while lo < hi:
            end = min(hi, starts[k + 1])
            joined.append(parts[k][lo - starts[k]:end - starts[k]])
            lo, k = end, k + 1
        return b"".join(joined)

    for j in which.tolist():  # (a leaf across pieces, a buffer's last, or a few leaves)
        leaves[j] = xxhash.xxh3_64_intdigest(leaf(j))
    return leaves


def _every_leaf(data: np.ndarray) -> np.ndarray:
    """:func:`leaf_digests` of one buffer's every leaf, in fewer steps: a load or a save
    hashes a few hundred planes and tensors, most of them a leaf or a few long."""
    n = data.size
    whole = n // LEAF_SIZE
    leaves = np.empty(-(-n // LEAF_SIZE), dtype="<u8")
    if whole >= KERNEL_MIN_LEAVES or (whole and jit.started()):
        if whole <= _PIECE_LEAVES:
            _hash_leaves(data, 0, whole, leaves, _ROWS)
        else:
            threads.pool().map(lambda a: _hash_leaves(data, a, min(whole, a + _PIECE_LEAVES),
                                                      leaves, _ROWS),
                               range(0, whole, _PIECE_LEAVES))
    else:
        for j in range(whole):
            leaves[j] = xxhash.xxh3_64_intdigest(data[j * LEAF_SIZE:(j + 1) * LEAF_SIZE])
    if whole < leaves.size:
        leaves[whole] = xxhash.xxh3_64_intdigest(data[whole * LEAF_SIZE:])
    return leaves


def _whole_leaves(parts: list[memoryview], starts: list[int], which: np.ndarray,
                  leaves: np.ndarray) -> np.ndarray:
    """Hash the leaves of ``which`` (ascending) that are 64 KiB within one part into
    ``leaves``, on the pool; the others of ``which``."""
    jobs = []
    for k, part in enumerate(parts):
        first, end = -(-starts[k] // LEAF_SIZE), starts[k + 1] // LEAF_SIZE
        lo, hi = np.searchsorted(which, (first, end))
        if hi > lo:
            sel = which[lo:hi]
            data = np.frombuffer(part, np.uint8)
            at = sel * LEAF_SIZE - starts[k]
            jobs += [(data, at, sel, a, min(a + _PIECE_LEAVES, sel.size))
                     for a in range(0, sel.size, _PIECE_LEAVES)]
    threads.map_sized(lambda job: _hash_picked(*job, leaves, _ROWS), jobs,
                      sum(j[4] - j[3] for j in jobs) * LEAF_SIZE)
    done = np.zeros(leaves.size, dtype=bool)
    for _, _, sel, a, b in jobs:
        done[sel[a:b]] = True
    return which[~done[which]]


def root_input(nbytes: int, leaves: np.ndarray) -> bytes:
    """What the root hashes: the u64 byte length, then the leaves' digests (little-endian)."""
    return struct.pack("<Q", nbytes) + np.asarray(leaves, "<u8").tobytes()


def _root_input(data: np.ndarray | bytes | memoryview | Pieces) -> bytes:
    if isinstance(data, Pieces):
        return root_input(data.nbytes, leaf_digests(data))
    view = memoryview(data).cast("B")
    if len(view) <= LEAF_SIZE:  # (one leaf or none: most planes and small tensors)
        return struct.pack("<QQ", len(view), xxhash.xxh3_64_intdigest(view)) if len(view) \
            else struct.pack("<Q", 0)
    return root_input(len(view), _every_leaf(np.frombuffer(view, np.uint8)))


def content_hash(data: np.ndarray | bytes | memoryview) -> bytes:
    """The 16-byte content hash of a tensor's raw bytes."""
    return xxhash.xxh3_128_digest(_root_input(data))


def hash_span(data: np.ndarray, lo: int, hi: int, leaves: np.ndarray) -> None:
    """The digests of the leaves of ``data[lo:hi]`` (uint8) into ``leaves``, ``lo`` a
    multiple of :data:`LEAF_SIZE` and ``hi`` one or the end of ``data``: the leaves of a
    piece hashed on its worker as it is made, while its bytes are still in cache (from memory
    the hash runs at a third of that speed or less)."""
    a, b = lo // LEAF_SIZE, hi // LEAF_SIZE
    if b > a:
        _hash_leaves(data, a, b, leaves, _ROWS)
    if hi > b * LEAF_SIZE:
        leaves[b] = xxhash.xxh3_64_intdigest(data[b * LEAF_SIZE:hi])


def leaves_for(nbytes: int) -> np.ndarray:
    """The array :func:`hash_span` fills for ``nbytes``, and :func:`content_hash_of` reads."""
    return np.empty(-(-nbytes // LEAF_SIZE), dtype="<u8")


def content_hash_of(nbytes: int, leaves: np.ndarray) -> bytes:
    """:func:`content_hash` of ``nbytes`` whose leaves' digests are ``leaves``."""
    return xxhash.xxh3_128_digest(root_input(nbytes, leaves))


def plane_checksum(data: np.ndarray | bytes | memoryview | Pieces) -> int:
    """The u64 checksum of a plane's stored bytes."""
    return xxhash.xxh3_64_intdigest(_root_input(data))


def bytes_checksum(data: bytes) -> int:
    """Plain XXH3-64 (seed 0) used for the header, footer and index."""
    return xxhash.xxh3_64_intdigest(data)


# XXH3's constants (the accumulators' start and the multipliers).
_P32_1, _P32_2, _P32_3 = np.uint64(0x9E3779B1), np.uint64(0x85EBCA77), np.uint64(0xC2B2AE3D)
_P64_1, _P64_2 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F)
_P64_3, _P64_4 = np.uint64(0x165667B19E3779F9), np.uint64(0x85EBCA77C2B2AE63)
_P64_5, _AVALANCHE = np.uint64(0x27D4EB2F165667C5), np.uint64(0x165667919E3779F9)
_LO32 = np.uint64(0xFFFFFFFF)


@kernel(boundscheck=False)
def _hash_leaves(data, a, b, leaves, rows):  # pragma: no cover - compiled
    """``leaves[j]`` = the XXH3-64 of leaf j of ``data`` (64 KiB at j * 64 KiB), j in [a, b)."""
    for j in range(a, b):
        leaves[j] = _leaf(data, j * LEAF_SIZE, rows)


@kernel(boundscheck=False)
def _hash_picked(data, at, sel, a, b, leaves, rows):  # pragma: no cover - compiled
    """``leaves[sel[j]]`` = the XXH3-64 of the 64 KiB at ``data[at[j]:]``, j in [a, b)."""
    for j in range(a, b):
        leaves[sel[j]] = _leaf(data, at[j], rows)


@kernel(inline="always")
def _leaf(data, p, rows):  # pragma: no cover - compiled
    """XXH3-64 (seed 0) of the 64 KiB at ``data[p:]``: XXH3's long-input loop for exactly one
    leaf's length (63 blocks of 16 stripes, each scrambled, then 15 stripes and the last)."""
    acc = np.empty(8, np.uint64)
    acc[0], acc[1], acc[2], acc[3] = _P32_3, _P64_1, _P64_2, _P64_3
    acc[4], acc[5], acc[6], acc[7] = _P64_4, _P32_2, _P64_5, _P32_1
    for block in range(63):
        _block(data, p + block * 1024, rows, acc, True)
    _block(data, p + 63 * 1024, rows, acc, False)
    h = np.uint64(LEAF_SIZE) * _P64_1
    for i in range(0, 8, 2):
        h += _mul_fold(acc[i] ^ rows[18, i], acc[i + 1] ^ rows[18, i + 1])
    h ^= h >> np.uint64(37)
    h *= _AVALANCHE
    return h ^ (h >> np.uint64(32))


@kernel(inline="always")
def _mul_fold(x, y):  # pragma: no cover - compiled
    """The 128-bit product of two uint64s, its halves XORed."""
    x_lo, x_hi, y_lo, y_hi = x & _LO32, x >> np.uint64(32), y & _LO32, y >> np.uint64(32)
    lo_lo, hi_lo, lo_hi = x_lo * y_lo, x_hi * y_lo, x_lo * y_hi
    cross = (lo_lo >> np.uint64(32)) + (hi_lo & _LO32) + lo_hi
    upper = (hi_lo >> np.uint64(32)) + (cross >> np.uint64(32)) + x_hi * y_hi
    return ((cross << np.uint64(32)) | (lo_lo & _LO32)) ^ upper


@intrinsic
def _block(typingctx, data, p, rows, acc, full):  # pragma: no cover - compiled
    """XXH3's accumulate of the 1 KiB block at byte ``p`` of ``data`` (any alignment) into
    ``acc``, as 8-lane vectors: with ``full``, its 16 stripes and the scramble; else the last
    block of a leaf, its first 15 stripes and the leaf's last stripe. A stripe's k is its
    words XOR its secret row, and lane i adds the stripe's word i ^ 1 and lo32(k) * hi32(k)."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, signature, args):
        data_a, p, rows_a, acc_a, full = args
        t_data, _, t_rows, t_acc, _ = signature.args
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vec = ir.VectorType(i64, 8)
        ptr = lambda t, a: context.make_array(t)(context, builder, a).data  # noqa: E731
        splat = lambda v: ir.Constant(vec, [v] * 8)  # noqa: E731
        base = builder.gep(builder.bitcast(ptr(t_data, data_a), i8.as_pointer()), [p])
        secret = builder.bitcast(ptr(t_rows, rows_a), vec.as_pointer())  # (a row is a vector)
        swap = ir.Constant(ir.VectorType(i32, 8), [1, 0, 3, 2, 5, 4, 7, 6])
        out = builder.bitcast(ptr(t_acc, acc_a), vec.as_pointer())

        def stripe(total, at, row):
            src = builder.bitcast(builder.gep(base, [ir.Constant(i64, at)]), vec.as_pointer())
            words = builder.load(src, align=1)
            k = builder.xor(words, builder.load(builder.gep(secret, [ir.Constant(i64, row)]),
                                                align=8))
            product = builder.mul(builder.and_(k, splat(0xFFFFFFFF)),
                                  builder.lshr(k, splat(32)))
            return builder.add(total, builder.add(
                builder.shuffle_vector(words, words, swap), product))

        total = builder.load(out, align=8)
        for s in range(15):
            total = stripe(total, 64 * s, s)
        with builder.if_else(full) as (then, otherwise):
            with then:
                x = stripe(total, 64 * 15, 15)
                x = builder.xor(builder.xor(x, builder.lshr(x, splat(47))),
                                builder.load(builder.gep(secret, [ir.Constant(i64, 16)]),
                                             align=8))
                builder.store(builder.mul(x, splat(0x9E3779B1)), out, align=8)
            with otherwise:
                builder.store(stripe(total, 1024 - 64, 17), out, align=8)
        return context.get_dummy_value()
    return types.none(data, p, rows, acc, full), codegen
