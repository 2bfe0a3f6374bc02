// rANS decoding pieces shared by rans.cu (plane decode) and fused.cu (decode into the merge):
// the decoder table built in shared memory, one lane's decode step and a row's renormalisation.
#pragma once
#include "common.cuh"

#define RANS_M 4096u            // 2^PROB_BITS
#define RANS_L (1u << 15)       // lower bound of a normalised state

// The decoder table of one plane, built by the whole CTA from the exclusive prefix sums of its
// frequencies (u32 gcum[256]) into ``dtab[4096]``, with ``cum[257]`` as scratch: slot t belongs
// to the symbol s with cum[s] <= t < cum[s + 1] (the largest s with cum[s] <= t: absent symbols
// before s share its cum, absent ones after it start past t) and holds
// (f - 1) << 20 | (t - cum[s]) << 8 | s, as ranshost.decoder_tables. Starts and ends with a
// CTA barrier (cum may be reused by the next call).
__device__ __forceinline__ void build_dtab(const u32* gcum, u32* cum, u32* dtab) {
    __syncthreads();
    for (int s = threadIdx.x; s < 256; s += blockDim.x) cum[s] = gcum[s];
    if (threadIdx.x == 0) cum[256] = RANS_M;
    __syncthreads();
    for (u32 t = threadIdx.x; t < RANS_M; t += blockDim.x) {
        u32 lo = 0, hi = 255;
        while (lo < hi) {
            const u32 mid = (lo + hi + 1) >> 1;
            if (cum[mid] <= t) lo = mid;
            else hi = mid - 1;
        }
        const u32 c = cum[lo];
        dtab[t] = ((cum[lo + 1] - c - 1) << 20) | ((t - c) << 8) | lo;
    }
    __syncthreads();
}

// One lane's decode step from a decoder table entry: the symbol of state x, and x advanced
// past it (not renormalised). The caller looks the entry up: dtab[x & (RANS_M - 1)].
__device__ __forceinline__ u32 rans_step(u32& x, const u32 e) {
    x = ((e >> 20) + 1) * (x >> 12) + ((e >> 8) & (RANS_M - 1));
    return e & 0xFF;
}

// A row's renormalisation, warp-wide: lanes with ``need`` take the next word from the end of
// the block's words (p words left; lanes in lane order). Returns false, the same in every lane,
// when the row needs more words than are left (word underflow); nothing is read then.
__device__ __forceinline__ bool rans_refill(u32& x, u32& p, bool need, const u16* words, u32 lt) {
    const u32 ballot = __ballot_sync(0xFFFFFFFFu, need);
    const u32 total = __popc(ballot);
    if (total > p) return false;
    p -= total;
    if (need) x = (x << 16) | __ldg(words + p + __popc(ballot & lt));
    return true;
}
