// A measurement, not part of the codec (bench/fused_decode_probe.py): how fast could one
// kernel decode a bf16 tensor's rANS exponent plane, merge it with the packed sign and
// mantissa planes into the tensor's bytes, and make its content-hash leaf digests, where the
// codec runs rans_decode, then merge_bf16 (which hashes)? One warp per rANS block of 2^16
// symbols (128 KiB of bf16, two 64 KiB leaves); only the case of bench/gpu.py's (a): every
// block full, the sign plane packed at 1 bit, the mantissa plane bitpack-w at 7 bits, both
// 4-byte aligned. A row of 32 symbols is 32 elements, 64 bytes: one XXH3 stripe. The rows run
// backwards (spec/rans.md), so each 1 KiB block's 8 accumulator sums go to global scratch and
// a leaf's scrambles run once its last row (its first, in order) is decoded.
#include "common.cuh"
#include "ransdec.cuh"
#include "xxh3.cuh"
#ifndef PROBE_MINB
#define PROBE_MINB 1   // CTAs per SM for __launch_bounds__ (a register cap)
#endif
#ifndef PROBE_PIPE
#define PROBE_PIPE 0   // merge the group before while a group's rows decode
#endif

__device__ __forceinline__ u16 load_nc_u16(const u16* p) {
    u16 w;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(w) : "l"(p));
    return w;
}

// one row's symbol (every lane active): the codec's ahead row (ransdec.cuh) when AHEAD (at
// least 32 words left), else the word loaded after the ballot, checked; false when the row
// lacks words
template <bool AHEAD>
__device__ __forceinline__ bool row_symbol(u32& x, u32& p, const u32* dtab, const u16* words,
                                           u32 lt, int lane, u32& sym) {
    if (AHEAD) {
        sym = ahead_row(x, p, dtab, words, lt, lane);
        return true;
    }
    const u32 e = dtab[x & 4095u];
    sym = e & 0xFF;
    x = ((e >> 20) + 1) * (x >> 12) + ((e >> 8) & 4095u);
    const bool need = x < (1u << 15);
    const u32 ballot = __ballot_sync(0xFFFFFFFFu, need);
    const u32 total = __popc(ballot);
    const u32 rank = __popc(ballot & lt);
    if (total > p) return false;
    p -= total;
    if (need) x = (x << 16) | load_nc_u16(words + p + rank);
    return true;
}

// A 64 KiB leaf's XXH3-64 from its 64 blocks' 8 accumulator sums (lb[8 blk + i]): the 63
// scrambles between blocks (lanes 0-7, one accumulator each), then the merge (lane 0 writes).
__device__ void leaf_digest(const u64* lb, int lane, u64* out) {
    const int i = lane & 7;
    u64 acc;
    {
        u64 init[8];
        xxh3_acc_init(init);
        acc = init[0];
#pragma unroll
        for (int j = 1; j < 8; j++) acc = i == j ? init[j] : acc;
    }
    for (int blk = 0; blk < 63; blk++) acc = xxh3_scramble_lane(acc + lb[8 * blk + i], i);
    acc += lb[8 * 63 + i];
    u64 all[8];
#pragma unroll
    for (int j = 0; j < 8; j++) all[j] = __shfl_sync(0xFFFFFFFFu, acc, j);
    if (lane == 0) *out = xxh3_merge(all, 65536);
}

extern "C" __global__ void __launch_bounds__(256, PROBE_MINB)
fused_bf16(const u32* cta_first, const u8* cta_warps, const u64* blk_words, const u32* blk_count,
           const u64* blk_states, const u32* gcum, const u32* mant, const u32* sign, u16* out,
           u64* bsum, u64* digests, int* errors) {
    __shared__ u32 dtab[4096];
    __shared__ u32 cum[257];
    __shared__ u64 hsec[32];  // the secret's 24 words, then the last stripe's 8
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x < 24) hsec[threadIdx.x] = xxh_secret64(8 * threadIdx.x);
    else if (threadIdx.x < 32)
        hsec[threadIdx.x] = xxh_secret64(XXH_LAST_STRIPE_SOFF + 8 * (threadIdx.x - 24));
    decoder_table(gcum, cum, dtab);
    __syncthreads();
    if (warp >= cta_warps[blockIdx.x]) return;
    const u32 b = cta_first[blockIdx.x] + warp;
    const u16* words = (const u16*)blk_words[b];
    u32 x = ((const u32*)blk_states[b])[lane];
    if (__any_sync(0xFFFFFFFFu, x < (1u << 15) || x >= (1u << 31))) {
        if (lane == 0) errors[b] = 1;
        return;
    }
    u32 p = blk_count[b];
    const u32 lt = lanemask_lt();
    const u32* mb = mant + 14336ull * b;  // 2^16 values of 7 bits: 14,336 words a block
    const u32* sb = sign + 2048ull * b;   // 2^16 bits: 2,048 words a block
    u16* ob = out + 65536ull * b;
    u64* bs = bsum + 1024ull * b;         // 128 blocks of 1 KiB, 8 sums each
    // this lane's 7 mantissa bits in a row's 7 words: word k0, from bit sh (sh > 25: into k0 + 1)
    const int k0 = (7 * lane) >> 5, sh = (7 * lane) & 31, k = lane >> 2;
    u64 P = 0, D = 0;
    // group gi: rows 4 gi .. 4 gi + 3 (block gi >> 2); its mantissa and sign words, loaded
    // before its rows decode (they wait on nothing)
    auto preload = [&](int gi, u32* mlo, u32* mhi, u32* sw) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = 4 * gi + 3 - q;
            mlo[q] = mb[7 * r + k0];
            mhi[q] = sh > 25 ? mb[7 * r + k0 + 1] : mlo[q];
            sw[q] = sb[r];
        }
    };
    // the merge and hash of group gi's rows; after a block's last group (in decode order), its
    // sums, and after a leaf's last block, its digest
    auto merge = [&](int gi, const u32* sym, const u32* mlo, const u32* mhi, const u32* sw) {
        const int kb = gi >> 2;
        const bool lastblk = (kb & 63) == 63;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int r = 4 * gi + 3 - q;  // the row (its stripe: r & 15)
            const u32 m = __funnelshift_r(mlo[q], mhi[q], sh) & 0x7Fu;
            const u32 s = (sw[q] >> lane) & 1u;
            const u32 v = (s << 15) | (sym[q] << 7) | m;
            ob[32 * r + lane] = (u16)v;
            // XXH3: lane 4k holds the stripe's data word k
            const u32 pr = v | (__shfl_down_sync(0xFFFFFFFFu, v, 1) << 16);
            const u32 pr2 = __shfl_down_sync(0xFFFFFFFFu, pr, 2);
            const u64 d = (u64)pr | ((u64)pr2 << 32);
            const int st = r & 15;
            const u64 key = (lastblk && st == 15) ? hsec[24 + k] : hsec[st + k];
            const u64 dk = d ^ key;
            P += (u64)(u32)dk * (u32)(dk >> 32);
            D += d;
        }
        if (gi & 3) return;
        // the block's sums: acc[k] gets word k's products and word k ^ 1's data
        const u64 Dx = __shfl_xor_sync(0xFFFFFFFFu, D, 4);
        if ((lane & 3) == 0) bs[8 * kb + k] = P + Dx;
        P = 0;
        D = 0;
        if (kb & 63) return;
        __syncwarp();  // the leaf's last block in decode order: its digest
        leaf_digest(bs + 8 * kb, lane, digests + 2ull * b + (kb >> 6));
    };
    // PROBE_PIPE: software-pipelined, group gi's rows decode while group gi + 1's merge, whose
    // symbols are ready, fills the decode chain's waits (a warp issues in order); else each
    // group merges right after its rows decode
    u32 psym[4], pmlo[4], pmhi[4], psw[4];
    for (int gi = 511; gi >= 0; gi--) {
        u32 sym[4], mlo[4], mhi[4], sw[4];
        preload(gi, mlo, mhi, sw);
        if (p >= 128) {  // words for four rows whatever they take
#pragma unroll
            for (int q = 0; q < 4; q++) row_symbol<true>(x, p, dtab, words, lt, lane, sym[q]);
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (!row_symbol<false>(x, p, dtab, words, lt, lane, sym[q])) {  // (uniform)
                    if (lane == 0) errors[b] = 2;
                    return;
                }
        }
        if constexpr (PROBE_PIPE) {
            if (gi < 511) merge(gi + 1, psym, pmlo, pmhi, psw);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                psym[q] = sym[q];
                pmlo[q] = mlo[q];
                pmhi[q] = mhi[q];
                psw[q] = sw[q];
            }
        } else {
            merge(gi, sym, mlo, mhi, sw);
        }
    }
    if constexpr (PROBE_PIPE) merge(0, psym, pmlo, pmhi, psw);
    const bool wrong = __any_sync(0xFFFFFFFFu, x != (1u << 15));
    if (lane == 0 && (p != 0 || wrong)) errors[b] = p != 0 ? 3 : 4;
}

// The same work split between warps: a CTA of 4 decode warps and 4 merge warps, decode warp w
// handing each 1 KiB block's 16 rows of symbols to merge warp w through a slot in shared
// memory (named barriers, strictly alternating: FULL once the slot is written, EMPTY once the
// merge warp has copied it to registers; a warp must not arrive twice at one barrier before it
// completes, so there is one slot, not two). The merge warp merges and hashes rows that wait
// on nothing, so the decode chain is no longer in its instruction stream. Block b = 4 CTA + w.
__device__ __forceinline__ void bar_sync(int id) {
    asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id) {
    asm volatile("bar.arrive %0, 64;" ::"r"(id) : "memory");
}

extern "C" __global__ void __launch_bounds__(256, PROBE_MINB)
fused_bf16_ws(const u64* blk_words, const u32* blk_count, const u64* blk_states,
              const u32* gcum, const u32* mant, const u32* sign, u16* out, u64* bsum,
              u64* digests, int* errors) {
    __shared__ u32 dtab[4096];
    __shared__ u32 cum[257];
    __shared__ u64 hsec[32];
    __shared__ __align__(16) u8 ring[4][16 * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = warp & 3;
    if (threadIdx.x < 24) hsec[threadIdx.x] = xxh_secret64(8 * threadIdx.x);
    else if (threadIdx.x < 32)
        hsec[threadIdx.x] = xxh_secret64(XXH_LAST_STRIPE_SOFF + 8 * (threadIdx.x - 24));
    decoder_table(gcum, cum, dtab);
    __syncthreads();
    const u32 b = 4 * blockIdx.x + pair;
    const int FULL = 1 + 2 * pair, EMPTY = 2 + 2 * pair;
    if (warp < 4) {  // decode: every chunk handed over, whatever happens (the merge waits on it)
        const u16* words = (const u16*)blk_words[b];
        u32 x = ((const u32*)blk_states[b])[lane];
        bool bad = __any_sync(0xFFFFFFFFu, x < (1u << 15) || x >= (1u << 31));
        if (bad && lane == 0) errors[b] = 1;
        u32 p = blk_count[b];
        const u32 lt = lanemask_lt();
        for (int c = 0; c < 128; c++) {
            if (c >= 1) bar_sync(EMPTY);  // the merge has taken the slot's last rows
            u8* slot = ring[pair];
            for (int g = 3; g >= 0; g--) {
                u32 sym[4] = {0, 0, 0, 0};
                if (!bad) {
                    if (p >= 128) {
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            row_symbol<true>(x, p, dtab, words, lt, lane, sym[q]);
                    } else {
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            if (!bad && !row_symbol<false>(x, p, dtab, words, lt, lane, sym[q])) {
                                bad = true;  // (uniform)
                                if (lane == 0) errors[b] = 2;
                            }
                    }
                }
#pragma unroll
                for (int q = 0; q < 4; q++) slot[(4 * g + 3 - q) * 32 + lane] = (u8)sym[q];
            }
            __syncwarp();
            __threadfence_block();
            bar_arrive(FULL);
        }
        bar_sync(EMPTY);  // the merge's last hand-back
        const bool wrong = __any_sync(0xFFFFFFFFu, x != (1u << 15));
        if (!bad && lane == 0 && (p != 0 || wrong)) errors[b] = p != 0 ? 3 : 4;
        return;
    }
    const u32* mb = mant + 14336ull * b;
    const u32* sb = sign + 2048ull * b;
    u16* ob = out + 65536ull * b;
    u64* bs = bsum + 1024ull * b;
    const int k0 = (7 * lane) >> 5, sh = (7 * lane) & 31, k = lane >> 2;
    for (int c = 0; c < 128; c++) {
        const int kb = 127 - c;
        const bool lastblk = (kb & 63) == 63;
        bar_sync(FULL);
        // the 16 rows' symbols of this lane's column to registers, and the slot handed back
        u32 col[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            col[j] = ring[pair][(4 * j) * 32 + lane] | ring[pair][(4 * j + 1) * 32 + lane] << 8 |
                     ring[pair][(4 * j + 2) * 32 + lane] << 16 |
                     (u32)ring[pair][(4 * j + 3) * 32 + lane] << 24;
        __syncwarp();
        bar_arrive(EMPTY);
        u64 P = 0, D = 0;
#pragma unroll
        for (int rr = 0; rr < 16; rr++) {
            const int r = 16 * kb + rr;
            const u32 lo = mb[7 * r + k0];
            const u32 hi = sh > 25 ? mb[7 * r + k0 + 1] : lo;
            const u32 m = __funnelshift_r(lo, hi, sh) & 0x7Fu;
            const u32 s = (sb[r] >> lane) & 1u;
            const u32 v = (s << 15) | (((col[rr >> 2] >> (8 * (rr & 3))) & 0xFFu) << 7) | m;
            ob[32 * r + lane] = (u16)v;
            const u32 pr = v | (__shfl_down_sync(0xFFFFFFFFu, v, 1) << 16);
            const u32 pr2 = __shfl_down_sync(0xFFFFFFFFu, pr, 2);
            const u64 d = (u64)pr | ((u64)pr2 << 32);
            const u64 key = (lastblk && rr == 15) ? hsec[24 + k] : hsec[rr + k];
            const u64 dk = d ^ key;
            P += (u64)(u32)dk * (u32)(dk >> 32);
            D += d;
        }
        const u64 Dx = __shfl_xor_sync(0xFFFFFFFFu, D, 4);
        if ((lane & 3) == 0) bs[8 * kb + k] = P + Dx;
        if (kb & 63) continue;
        __syncwarp();  // the leaf's last block in decode order: its digest
        leaf_digest(bs + 8 * kb, lane, digests + 2ull * b + (kb >> 6));
    }
}
