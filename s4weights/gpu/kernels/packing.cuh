// Bitpack-w (codec 8) on the device, shared by the split and merge, the rANS encoder's staging
// and the assembly's pack ops: a plane of width w stores eight values in w bytes, the
// little-endian integer sum(v_j << (w * j)) (spec/codecs.md). A sign plane's packed bits are
// the same form at w = 1.
#pragma once
#include "common.cuh"

// 8 values of a bitpack-w plane of width w (1..7) at element e (a multiple of 8; m valid, the
// rest 0) as 8 bytes: the group's ceil(m * w / 8) stored bytes, unpacked. The padding bits of
// the last byte are the host's to check.
__device__ __forceinline__ u64 unpack8(const u8* p, i64 e, int m, u32 w) {
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
    const u64 mask = (1ull << w) - 1;
    u64 v = 0;
    for (int j = 0; j < m; j++) v |= ((acc >> (w * j)) & mask) << (8 * j);
    return v;
}

// unpack8 at a width fixed at compile time: every value's shift a constant (the merge's common
// case, the narrow mantissa plane at its field's width; a runtime width costs a 64-bit
// variable shift per value).
template <u32 W>
__device__ __forceinline__ u64 unpack8c(const u8* p, i64 e, int m) {
    const u8* g = p + (e >> 3) * W;
    u64 acc = 0;
    if (m == 8) {
        const u32* q = (const u32*)((u64)g & ~(u64)3);
        const u32 sh = 8 * (u32)((u64)g & 3);
        acc = (u64)q[0] >> sh;
        if (sh + 8 * W > 32) acc |= (u64)q[1] << (32 - sh);
        if (sh + 8 * W > 64) acc |= (u64)q[2] << (64 - sh);
    } else {
        const u32 nb = (m * W + 7) / 8;
        for (u32 b = 0; b < nb; b++) acc |= (u64)g[b] << (8 * b);
    }
    constexpr u64 mask = (1ull << W) - 1;
    u64 v = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) v |= ((acc >> (W * j)) & mask) << (8 * j);
    // values past m are 0 (their bits are the last byte's padding, which the host checks)
    return m >= 8 ? v : v & ((1ull << (8 * m)) - 1);
}
