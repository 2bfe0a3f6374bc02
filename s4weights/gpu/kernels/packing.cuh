// Bitpack-w (codec 8) on the device, shared by the split and merge, the rANS encoder's staging
// and the assembly's pack ops: a plane of width w stores eight values in w bytes, the
// little-endian integer sum(v_j << (w * j)) (spec/codecs.md). A sign plane's packed bits are
// the same form at w = 1.
#pragma once
#include "common.cuh"

// The stored bytes of the group of 8 values of a bitpack-w plane of width w (1..7) at element e
// (a multiple of 8; m valid) as the low bytes of a u64: ceil(m * w / 8) of them, the rest 0.
__device__ __forceinline__ u64 load_group(const u8* p, i64 e, int m, u32 w) {
    const u8* g = p + (e >> 3) * w;
    u64 acc = 0;
    if (m == 8) {
        // the aligned 4-byte words that hold the group's w bytes (only those: none past its
        // last byte), shifted into place
        const u32* q = (const u32*)((u64)g & ~(u64)3);
        const u32 sh = 8 * (u32)((u64)g & 3);
        acc = (u64)q[0] >> sh;
        if (sh + 8 * w > 32) acc |= (u64)q[1] << (32 - sh);
        if (sh + 8 * w > 64) acc |= (u64)q[2] << (64 - sh);
    } else {
        const u32 nb = (m * w + 7) / 8;
        for (u32 b = 0; b < nb; b++) acc |= (u64)g[b] << (8 * b);
    }
    return acc;
}

// 8 values of a bitpack-w plane of width w (1..7) at element e (a multiple of 8; m valid, the
// rest 0) as 8 bytes: the group's stored bytes, unpacked. The padding bits of the last byte
// are the host's to check.
__device__ __forceinline__ u64 unpack8(const u8* p, i64 e, int m, u32 w) {
    const u64 acc = load_group(p, e, m, w);
    const u64 mask = (1ull << w) - 1;
    u64 v = 0;
    for (int j = 0; j < m; j++) v |= ((acc >> (w * j)) & mask) << (8 * j);
    return v;
}

// Eight bytes below 2^W (byte j: value j) as their 8 W bits (value j at bit W j), and back:
// three steps of pairing neighbours (bytes, then 16-bit, then 32-bit halves), constant masks
// and shifts instead of one shift per value.
template <u32 W>
__device__ __forceinline__ u64 compress8(u64 v) {
    v = (v & 0x00FF00FF00FF00FFull) | ((v >> 8) & 0x00FF00FF00FF00FFull) << W;
    v = (v & 0x0000FFFF0000FFFFull) | ((v >> 16) & 0x0000FFFF0000FFFFull) << (2 * W);
    return (v & 0xFFFFFFFFull) | (v >> 32) << (4 * W);
}
template <u32 W>
__device__ __forceinline__ u64 expand8(u64 a) {
    constexpr u64 m4 = (1ull << (4 * W)) - 1, m2 = ((1ull << (2 * W)) - 1) * 0x0000000100000001ull,
                  m1 = ((1ull << W) - 1) * 0x0001000100010001ull;
    a = (a & m4) | ((a >> (4 * W)) & m4) << 32;
    a = (a & m2) | ((a >> (2 * W)) & m2) << 16;
    return (a & m1) | ((a >> W) & m1) << 8;
}

// unpack8 at a width fixed at compile time: every value's shift a constant (the merge's common
// case, the narrow mantissa plane at its field's width; a runtime width costs a 64-bit
// variable shift per value).
template <u32 W>
__device__ __forceinline__ u64 unpack8c(const u8* p, i64 e, int m) {
    const u64 acc = load_group(p, e, m, W);
    const u64 v = expand8<W>(acc & ((1ull << (8 * W)) - 1));
    // values past m are 0 (their bits are the last byte's padding, which the host checks)
    return m >= 8 ? v : v & ((1ull << (8 * m)) - 1);
}
