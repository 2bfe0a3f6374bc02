// Pieces of the rANS decoder (spec/rans.md) that kernels/rans.cu builds its decode kernels
// from.
#pragma once
#include "common.cuh"

// The lanes below this one, as a bit mask.
__device__ __forceinline__ u32 lanemask_lt() {
    u32 m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// A plane's decoder table in shared memory, built by the whole CTA from the exclusive prefix
// sums of its frequencies (gcum: u32 cum[256]; `cum`: 257 shared words of scratch): slot t
// belongs to the symbol s with cum[s] <= t < cum[s + 1] (the largest s with cum[s] <= t:
// absent symbols before s share its cum, absent ones after it start past t) and holds
// (f - 1) << 20 | (t - cum[s]) << 8 | s, as ranshost.decoder_tables. The caller synchronises
// the CTA before reading it.
__device__ __forceinline__ void decoder_table(const u32* gcum, u32* cum, u32* dtab) {
    for (int s = threadIdx.x; s < 256; s += blockDim.x) cum[s] = gcum[s];
    if (threadIdx.x == 0) cum[256] = 4096;
    __syncthreads();
    for (u32 t = threadIdx.x; t < 4096; t += blockDim.x) {
        u32 lo = 0, hi = 255;
        while (lo < hi) {
            const u32 mid = (lo + hi + 1) >> 1;
            if (cum[mid] <= t) lo = mid;
            else hi = mid - 1;
        }
        const u32 c = cum[lo];
        dtab[t] = ((cum[lo + 1] - c - 1) << 20) | ((t - c) << 8) | lo;
    }
}

// An unchecked row of a block's decode (all lanes active, at least 32 words left) that takes
// its word by a shuffle; returns the lane's symbol. Every lane loads one of the 32 words below
// p before the row decodes (the load waits on nothing in the row), and a renormalising lane
// then takes word p - total + rank, which lane 32 - total + rank holds. The row's chain then
// waits on a shuffle, not on a load: ncu showed the decoder's warps spending ~40% of their
// stalls on that load. It pays where a launch has too few warps to hide the load (4,096 fp32
// blocks: 0.73 -> 0.56 ms on the H200) and costs where it has enough (8,192 blocks: 0.69 ->
// 0.74 ms), so the host picks rans.cu's build by the launch's size (runtime.rans_decode_kernel).
__device__ __forceinline__ u32 ahead_row(u32& x, u32& p, const u32* dtab, const u16* words,
                                         u32 lt, int lane) {
    u16 cand;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(cand) : "l"(words + (p - 32 + lane)));
    const u32 e = dtab[x & 4095u];
    x = ((e >> 20) + 1) * (x >> 12) + ((e >> 8) & 4095u);
    const bool need = x < (1u << 15);
    const u32 ballot = __ballot_sync(0xFFFFFFFFu, need);
    const u32 total = __popc(ballot);
    p -= total;
    const u32 w = __shfl_sync(0xFFFFFFFFu, (u32)cand, (int)(32 - total + __popc(ballot & lt)) & 31);
    if (need) x = (x << 16) | w;
    return e & 0xFF;
}
