// Pieces of the rANS decoder (spec/rans.md) shared by kernels/rans.cu and the fused decode
// probe (bench/fused_decode_probe.cu).
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
