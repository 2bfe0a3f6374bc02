// S4 rANS (spec/rans.md), one warp per block of 2^log2_block symbols, 32 lanes = 32 states.
// Byte-identical to the CPU reference encoder: same table, same exact division by reciprocal,
// same word order (within a row, renormalising lanes in lane order: one ballot per row, a lane's
// word index is the words before the row plus the popcount of the lower lanes' ballot bits).
//
// Blocks of many planes go into one encode launch through a plane table (source, length, table
// input, scratch, first block) and a CTA table: each CTA takes up to RANS_WARPS consecutive
// blocks of ONE plane (cta_plane, cta_block: its first block inside the plane, cta_warps), so
// its warps share the plane's table, which the CTA builds in shared memory once from the
// plane's frequencies; each warp finds its block from them (no table per block). (A warp's 32 table lookups per row are a random
// gather: from global memory they touch ~28 cache lines per row and were the decoder's
// bottleneck; from shared memory they cost a few bank conflicts.) The encoder writes a block's
// words to its own scratch region and its word count, 32 final states, first symbol and "not
// constant" flag, and the region's place (boff: in words from the plane's scratch); the host
// then knows every stream size and assembles the streams with the copy kernel (rans_place
// moves the words). A plane's region per block is either a fixed slot of one word per symbol
// (p_cap null or p_cap[q] = ~0: the most a block can write), or, where the host sized the
// plane's scratch by its bound (p_cap[q] words, rans_normalise's bound >> 20), the block's own
// bound: the warp first sums wcost[f] over its symbols (a pass over the block before coding
// it), then takes that sum >> 20 words from the plane's cursor (an atomic add; the blocks'
// bounds add up to at most the plane's: ranshost.WORD_COST). A block whose words would not
// fit (never, by that bound) codes nothing and reports count ~0 (the host raises). A plane is read as bytes, or as the split stored
// it packed (p_w[q] < 8: bitpack-w of that width, the sign plane's bits at 1), unpacked into
// the warp's stage.
//
// Encoder table entry per symbol (uint4): x = x_max (renormalise while x >= x_max), y = the
// reciprocal, z = the bias, w = shift | (4096 - freq) << 8; coding is
// x' = x + bias + ((umulhi(x, rcp) >> shift) * (4096 - freq)).
#include "packing.cuh"
#include "ransdec.cuh"

#define RANS_WARPS 8          // warps (blocks of one plane) per CTA
#define STAGE 512             // symbols staged in shared memory per warp step (16 rows)

extern "C" __global__ void __launch_bounds__(RANS_WARPS * 32)
rans_encode(const u32* cta_plane, const u32* cta_block, const u8* cta_warps, const u64* p_src,
            const i64* p_n, const u64* p_tab, const u64* p_scratch, const i64* p_first,
            const u8* p_w, int log2_block, u32* counts, u32* states, u8* firsts, u8* varied,
            const u8* p_run, const u64* p_cap, u64* cursor, u64* boff, const u32* wcost) {
    __shared__ __align__(16) u8 stage[RANS_WARPS][STAGE];
    __shared__ uint4 tab[256];
    __shared__ u32 wc[256];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 q = cta_plane[blockIdx.x];
    if (p_run && !p_run[q]) {  // a plane rans_jobs did not pick: its blocks code nothing
        if (warp < cta_warps[blockIdx.x] && lane == 0) {
            const u64 b = (u64)p_first[q] + cta_block[blockIdx.x] + warp;
            counts[b] = 0;
            firsts[b] = 0;
            varied[b] = 0;
        }
        return;
    }
    // the plane's encoder table, built here from its frequencies and their exclusive prefix
    // sums (u32 freq[256], cum[256]): exactly ranshost.encoder_tables / rans._encoder_table
    const u32* fc = (const u32*)p_tab[q];
    const u64 cap = p_cap ? p_cap[q] : ~0ull;
    const bool bounded = cap != ~0ull;  // (uniform in the CTA)
    for (int s = threadIdx.x; s < 256; s += blockDim.x) {
        const u32 f = fc[s], c = fc[256 + s];
        if (bounded) wc[s] = f ? wcost[f] : 0;
        uint4 e = make_uint4(0, 0, 0, 0);
        if (f == 1) {
            e = make_uint4(1u << 19, 0xFFFFFFFFu, c + 4095u, 4095u << 8);
        } else if (f > 1) {
            const u32 bits = 32 - __clz(f - 1);  // bit length of f - 1
            const u32 rcp = (u32)(((1ull << (bits + 31)) + f - 1) / f);
            e = make_uint4(f << 19, rcp, c, (bits - 1) | ((4096u - f) << 8));
        }
        tab[s] = e;
    }
    __syncthreads();
    if (warp >= cta_warps[blockIdx.x]) return;
    const u64 k = (u64)cta_block[blockIdx.x] + warp;  // the block inside the plane
    const u64 start = k << log2_block, rest = (u64)p_n[q] - start;
    const u64 b = (u64)p_first[q] + k;                // the block in the launch
    const u32 sw = p_w[q];  // 8: bytes; else packed at sw bits (start is a multiple of 8)
    const u8* src = (const u8*)p_src[q] + (sw == 8 ? start : (start >> 3) * sw);
    const u32 len = (u32)(rest < (1ull << log2_block) ? rest : (1ull << log2_block));
    const bool vec = sw == 8 && ((u64)src & 15) == 0;
    u64 off = start, most = ~0ull;  // the block's region (words) and its bound
    if (bounded) {
        u64 sb = 0;  // the block's symbols' wcost, summed
        if (vec) {
            for (u32 i0 = 16 * lane; i0 < len; i0 += 512) {
                if (i0 + 16 <= len) {
                    const uint4 v = *(const uint4*)(src + i0);
                    const u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int j = 0; j < 16; j++) sb += wc[(w4[j >> 2] >> (8 * (j & 3))) & 0xFF];
                } else {
                    for (u32 i = i0; i < len; i++) sb += wc[src[i]];
                }
            }
        } else if (sw < 8) {
            for (u32 i0 = 8 * lane; i0 < len; i0 += 256) {
                const int m = len - i0 < 8 ? len - i0 : 8;
                const u64 v = unpack8(src, i0, m, sw);
                for (int j = 0; j < m; j++) sb += wc[(v >> (8 * j)) & 0xFF];
            }
        } else {
            for (u32 i = lane; i < len; i += 32) sb += wc[src[i]];
        }
        for (int o = 16; o; o >>= 1) sb += __shfl_xor_sync(0xFFFFFFFFu, sb, o);
        most = sb >> 20;
        if (lane == 0) off = atomicAdd((unsigned long long*)&cursor[q], (unsigned long long)most);
        off = __shfl_sync(0xFFFFFFFFu, off, 0);
        if (off + most > cap) {  // (never: the bounds add up to at most cap)
            if (lane == 0) counts[b] = ~0u;
            return;
        }
    }
    if (lane == 0) boff[b] = off;
    // the block's region in the scratch (the pointer laundered through a mov, so that it stays
    // in a register pair: a row's store address is then one IMAD.WIDE, where the compiler's
    // uniform base plus 64-bit offset took four instructions)
    u16* words;
    asm("mov.b64 %0, %1;" : "=l"(words) : "l"((u16*)p_scratch[q] + off));
    u8* st = stage[warp];
    const u8 first = sw == 8 ? src[0] : (u8)unpack8(src, 0, 1, sw);
    const u32 lt = lanemask_lt();
    const u32 f4 = 0x01010101u * first;
    const u64 f8 = 0x0101010101010101ull * first;
    u32 x = 1u << 15, w = 0, diff = 0;  // diff: a staged byte differs from the first symbol
    // full chunks: the next chunk's 16 bytes per lane are loaded while this one is coded
    uint4 pre = make_uint4(0, 0, 0, 0);
    if (vec && len >= STAGE) pre = ((const uint4*)src)[lane];
    for (u32 base = 0; base < len; base += STAGE) {
        const u32 chunk = len - base < STAGE ? len - base : STAGE;
        __syncwarp();
        if (vec && chunk == STAGE) {
            ((uint4*)st)[lane] = pre;
            diff |= ((pre.x ^ f4) | (pre.y ^ f4) | (pre.z ^ f4) | (pre.w ^ f4)) != 0;
            if (base + 2 * STAGE <= len) pre = ((const uint4*)(src + base + STAGE))[lane];
        } else if (sw < 8) {  // two groups of 8 per lane (unpack8 zeroes the bytes past m)
            for (u32 i0 = 16 * lane; i0 < 16 * lane + 16 && i0 < chunk; i0 += 8) {
                const int m = chunk - i0 < 8 ? chunk - i0 : 8;
                const u64 v = unpack8(src, base + i0, m, sw);
                *(u64*)(st + i0) = v;
                diff |= ((v ^ f8) & (m == 8 ? ~0ull : (1ull << (8 * m)) - 1)) != 0;
            }
        } else {
            for (u32 i = lane; i < chunk; i += 32) {
                st[i] = src[base + i];
                diff |= src[base + i] != first;
            }
        }
        __syncwarp();
        // a row: x' = x + bias + floor(x / f) (4096 - f), the quotient as umulhi(x, rcp)
        // shifted right by the entry's low bits (a funnel shift: it reads only the shift's low
        // 5 bits, so no mask)
        if (chunk == STAGE) {  // every lane active
#pragma unroll 4
            for (u32 r = 0; r < STAGE; r += 32) {
                const uint4 e = tab[st[r + lane]];
                const bool need = x >= e.x;
                const u32 ballot = __ballot_sync(0xFFFFFFFFu, need);
                if (need) {
                    words[w + __popc(ballot & lt)] = (u16)(x & 0xFFFF);
                    x >>= 16;
                }
                x = x + e.z + __funnelshift_r(__umulhi(x, e.y), 0, e.w) * (e.w >> 8);
                w += __popc(ballot);
            }
            continue;
        }
        for (u32 r = 0; r < chunk; r += 32) {
            const bool active = r + lane < chunk;
            const uint4 e = tab[active ? st[r + lane] : first];
            const bool need = active && x >= e.x;
            const u32 ballot = __ballot_sync(0xFFFFFFFFu, need);
            if (need) {
                words[w + __popc(ballot & lt)] = (u16)(x & 0xFFFF);
                x >>= 16;
            }
            if (active) x = x + e.z + __funnelshift_r(__umulhi(x, e.y), 0, e.w) * (e.w >> 8);
            w += __popc(ballot);
        }
    }
    states[(u64)b * 32 + lane] = x;
    const u32 any = __ballot_sync(0xFFFFFFFFu, diff);
    if (lane == 0) {
        counts[b] = w <= most ? w : ~0u;  // (over the bound: never)
        firsts[b] = first;
        varied[b] = any != 0;
    }
}

__device__ u16 rans_no_words;  // what the decoder's loads read in a block of no words

// One decoder row: each active lane decodes its symbol into out[i] and, if its state drops
// below 2^15, takes the next word from the end (lanes in lane order): every lane loads, at an
// index clamped into the block's words (`last`: the last word's index), so the load needs no
// branch. Returns false, the same in every lane, when the row needs more words than the block
// has left (error 2); CHECK false: the caller knows it has enough.
template <bool CHECK>
__device__ __forceinline__ bool decode_row(u32& x, u32& p, const u32* dtab, u8* out, int i,
                                           bool active, const u16* words, u32 last, u32 lt) {
    bool need = false;
    if (active) {
        const u32 e = dtab[x & 4095u];
        out[i] = (u8)(e & 0xFF);
        x = ((e >> 20) + 1) * (x >> 12) + ((e >> 8) & 4095u);
        need = x < (1u << 15);
    }
    const u32 ballot = __ballot_sync(0xFFFFFFFFu, need);
    const u32 total = __popc(ballot);
    if (CHECK && total > p) return false;
    p -= total;
    const u32 at = p + __popc(ballot & lt);
    u16 w;  // (volatile: the compiler would sink the load under `need`, behind a branch)
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(w) : "l"(words + (at < last ? at : last)));
    if (need) x = (x << 16) | w;
    return true;
}

// Decode one block per warp straight into its output bytes. mode 0: RANS (words, states,
// decode table); mode 1: CONST (fill with `fill`); mode 2: nothing (its stream failed
// rans_blocks' checks). Errors per block, numbered as the CPU reference: 1 state out of range,
// 2 word underflow, 3 words left over, 4 wrong final state.
// Two builds (the host picks one per launch, runtime.rans_decode_kernel): rans_decode loads each
// renormalising lane's word in its row; rans_decode_ahead takes the words of its unchecked rows
// by a shuffle from a load made before the row (ransdec.cuh, ahead_row).
template <bool AHEAD>
__device__ void decode_impl(const u32* cta_first, const u8* cta_warps, const u8* blk_mode,
                            const u8* blk_fill, const u64* blk_words, const u32* blk_count,
                            const u64* blk_states, const u64* blk_dtab, const u64* blk_out,
                            const u32* blk_len, int* errors) {
    __shared__ u32 dtab[4096];
    __shared__ u32 cum[257];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 b0 = cta_first[blockIdx.x];
    // the plane's decoder table (ransdec.cuh; null for CONST planes)
    const u32* gcum = (const u32*)blk_dtab[b0];
    if (gcum) decoder_table(gcum, cum, dtab);
    __syncthreads();
    if (warp >= cta_warps[blockIdx.x]) return;
    const u32 b = b0 + warp;
    u8* out = (u8*)blk_out[b];
    const u32 len = blk_len[b];
    if (blk_mode[b] == 2) return;
    if (blk_mode[b] == 1) {
        const u8 v = blk_fill[b];
        for (u32 i = lane; i < len; i += 32) out[i] = v;
        return;
    }
    const u16* words = (const u16*)blk_words[b];
    u32 x = ((const u32*)blk_states[b])[lane];
    int err = (x < (1u << 15) || x >= (1u << 31)) ? 1 : 0;
    if (__any_sync(0xFFFFFFFFu, err)) {
        if (lane == 0) errors[b] = 1;
        return;
    }
    // Rows from the last down to the first; a lane that renormalises takes the next word from
    // the end: after p -= total, lane l's word is words[p + (renormalising lanes below l)].
    u32 p = blk_count[b];
    const u32 lt = lanemask_lt();
    const u16* safe = p ? words : &rans_no_words;
    const u32 last = p ? p - 1 : 0;
    int r = (int)(((len - 1) >> 5) << 5);
    if (len & 31) {  // the last row is partial
        if (!decode_row<true>(x, p, dtab, out, r + lane, (u32)r + lane < len, safe, last, lt)) {
            if (lane == 0) errors[b] = 2;
            return;
        }
        r -= 32;
    }
    while (r >= 0) {  // full rows
        if (r >= 96 && p >= 128) {  // words left for four rows whatever they take: unchecked
#pragma unroll
            for (int k = 0; k < 4; k++, r -= 32) {
                if constexpr (AHEAD) out[r + lane] = (u8)ahead_row(x, p, dtab, words, lt, lane);
                else decode_row<false>(x, p, dtab, out, r + lane, true, safe, last, lt);
            }
        } else {
            if (!decode_row<true>(x, p, dtab, out, r + lane, true, safe, last, lt)) {
                if (lane == 0) errors[b] = 2;
                return;
            }
            r -= 32;
        }
    }
    if (p != 0) err = 3;
    else if (x != (1u << 15)) err = 4;
    const u32 bad = __ballot_sync(0xFFFFFFFFu, err != 0);
    if (bad && lane == 0) errors[b] = p != 0 ? 3 : 4;
}
#define S4_DECODE(NAME, AHEAD)                                                                 \
    extern "C" __global__ void __launch_bounds__(RANS_WARPS * 32) NAME(                        \
        const u32* cf, const u8* cw, const u8* mode, const u8* fill, const u64* words,         \
        const u32* count, const u64* states, const u64* dtab, const u64* out, const u32* len,  \
        int* errors) {                                                                         \
        decode_impl<AHEAD>(cf, cw, mode, fill, words, count, states, dtab, out, len, errors);  \
    }
S4_DECODE(rans_decode, false)
S4_DECODE(rans_decode_ahead, true)

// A sum over the CTA's 256 threads (8 warps), every thread gets it; `red` is 8 shared slots.
__device__ __forceinline__ u64 cta_sum(u64 v, u64* red) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 t = 0;
    for (int i = 0; i < 8; i++) t += red[i];
    __syncthreads();  // red may be reused
    return t;
}

// The inclusive prefix sum of v over the warp's lanes.
template <typename T>
__device__ __forceinline__ T warp_scan(T v, int lane) {
    for (int o = 1; o < 32; o <<= 1) {
        const T x = __shfl_up_sync(0xFFFFFFFFu, v, o);
        if (lane >= o) v += x;
    }
    return v;
}

// rans.normalise of many histograms (spec/rans.md: the exact integer procedure), one CTA of
// 256 threads per plane, thread s for symbol s; writes each plane's encoder-table input as
// rans_encode reads it: u32 freq[256] then u32 cum[256] (exclusive prefix sums) at fc + 512 q.
// Plane q's bins are the 256 u64 at hist[q]; a sign plane (hist[q] == 0) has the bins
// [n[q] - ones, ones], ones being the u64 at ones[q]. An empty histogram gives zeros.
// For the host, which then needs no histogram or table (32 bytes per plane instead of 3 KiB):
// the u64 row stats + 4 q = [symbols present, the rANS size estimate (ranshost.estimate_many,
// sbits = ranshost.SYMBOL_BITS: the bit costs summed in symbol order, one addition at a time),
// the first symbol present | the last one << 16 (bitpack-w's width), the frequency table's
// size T], and the table's T bytes
// (rans.table_bytes) at tbytes + TABLE_STRIDE q, for the assembly to copy into the stream.
// (rans_jobs, below, decides from these figures which planes rans_encode codes.)
#define TABLE_STRIDE 544  // 32 + 2 * 256: the largest frequency table
extern "C" __global__ void __launch_bounds__(256)
rans_normalise(const u64* hist, const u64* ones, const i64* n, const double* sbits, u32* fc,
               u64* stats, u8* tbytes, int log2_block, const u32* wcost, u64* bound) {
    __shared__ u64 red[8];
    __shared__ u64 rem[256];
    __shared__ u8 pres[256];
    __shared__ u32 wsum[8];
    __shared__ u32 wpres[8];
    __shared__ double cost[256];
    const int q = blockIdx.x, s = threadIdx.x, lane = s & 31, warp = s >> 5;
    u64 c;
    if (hist[q]) {
        c = ((const u64*)hist[q])[s];
    } else {
        const u64 o = *(const u64*)ones[q];
        c = s == 0 ? (u64)n[q] - o : (s == 1 ? o : 0);
    }
    const bool present = c > 0;
    const u64 total = cta_sum(c, red);
    const u64 k = cta_sum(present ? 1 : 0, red);
    u32 f = 0;
    u64 r = 0;
    if (present) {  // total > 0
        const u64 share = c * (4096 - k);  // c < 2^48: no overflow
        f = (u32)(share / total) + 1;
        r = share - (u64)(f - 1) * total;
    }
    rem[s] = r;
    pres[s] = present;
    const u64 fsum = cta_sum(f, red);  // also orders rem/pres before the reads below
    const u64 leftover = total ? 4096 - fsum : 0;
    if (present && leftover) {  // the `leftover` largest remainders, ties to the lower symbol
        u32 rank = 0;
        for (int t = 0; t < 256; t++)
            rank += pres[t] && (rem[t] > r || (rem[t] == r && t < s));
        f += rank < leftover;
    }
    // exclusive prefix sum of f over the CTA
    const u32 v = warp_scan(f, lane);
    if (lane == 31) wsum[warp] = v;
    __syncthreads();
    u32 before = 0;
    for (int i = 0; i < warp; i++) before += wsum[i];
    fc[(u64)q * 512 + s] = f;
    fc[(u64)q * 512 + 256 + s] = before + v - f;
    // the bound of the plane's rANS words (ranshost.WORD_COST): sum over symbols of count *
    // wcost[f], whose >> 20 bounds the words of every block together (c < 2^44: no overflow)
    const u64 wsum_q = cta_sum(present ? c * wcost[f] : 0, red);
    if (s == 0) bound[q] = wsum_q;
    // the table's bytes: presence bitmap (bit s % 8 of byte s / 8 is bit s % 32 of the
    // little-endian u32 s / 32: a warp's ballot), then each present symbol's u16 frequency at
    // its rank among the present symbols, then 2 zero bytes when k is odd
    const u32 pb = __ballot_sync(0xFFFFFFFFu, present);
    if (lane == 0) wpres[warp] = pb;
    cost[s] = present ? __dmul_rn((double)c, sbits[f]) : 0.0;
    __syncthreads();
    u32 rank_p = __popc(pb & lanemask_lt());
    for (int i = 0; i < warp; i++) rank_p += __popc(wpres[i]);
    u8* tb = tbytes + (u64)q * TABLE_STRIDE;
    if (lane == 0) ((u32*)tb)[warp] = pb;
    if (present) ((u16*)(tb + 32))[rank_p] = (u16)f;
    if (s == 0) {
        const u32 tsize = 32 + 2 * (u32)k + 2 * (u32)(k & 1);
        if (k & 1) ((u16*)(tb + 32))[k] = 0;
        u32 sym0 = 0, top = 0;
        for (int i = 7; i >= 0; i--)
            if (wpres[i]) sym0 = 32 * i + __ffs(wpres[i]) - 1;
        for (int i = 0; i < 8; i++)
            if (wpres[i]) top = 32 * i + 31 - __clz(wpres[i]);
        u64 est = 12;
        if (k == 1) {
            est = 12 + ((total + (1ull << 20) - 1) >> 20);  // CONST, 2^20-symbol blocks
        } else if (k > 1) {
            double bits = 0.0;
            for (int t = 0; t < 256; t++) bits = __dadd_rn(bits, cost[t]);
            const u64 nb = (total + (1ull << log2_block) - 1) >> log2_block;
            const u64 full = 12 + tsize + 132 * nb + 2 * (u64)ceil(bits / 16.0);
            est = full < 12 + total ? full : 12 + total;
        }
        stats[4 * (u64)q] = k;
        stats[4 * (u64)q + 1] = est;
        stats[4 * (u64)q + 2] = sym0 | (top << 16);
        stats[4 * (u64)q + 3] = tsize;
    }
}

// Which planes rans_encode codes (run[q] = 1), from rans_normalise's figures of plane q
// (stats + 4 q) and what its kind allows (rule[q]: bit 0 rANS is a candidate, bit 1 bitpack,
// bit 2 bitpack-w; 0 for planes under policy.MIN_CODED bytes): encode.candidates' runs_rans
// exactly, so that a group that splits and codes in one pass can queue its rANS launch
// before the host has read the figures. The host computes the same rule once it has them
// and takes the launch only where both agree (histograms.window_planes). slack = policy's
// PACKED_SLACK: bitpack-w's size s ranks before an estimate e when slack_s s <= slack_e e.
extern "C" __global__ void __launch_bounds__(256)
rans_jobs(const u64* stats, const i64* n, const u8* rule, int rows, int slack_s, int slack_e,
          u8* run) {
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= rows) return;
    const i64 m = n[q];
    const u64* st = stats + 4 * (u64)q;
    const u32 r = rule[q];
    const i64 est = (r & 1) ? (i64)st[1] : 0;
    const bool cand_rans = (r & 1) && est < m;
    const i64 est_bp = (m + 7) / 8;
    const bool cand_bp = (r & 2) && est_bp < m;
    const u32 top = (u32)(st[2] >> 16);
    const i64 width = top ? 32 - __clz(top) : 1;  // bits of the largest symbol, at least 1
    const i64 est_bw = (m * width + 7) / 8;
    const bool cand_bw = (r & 4) && width <= 7 && est_bw < m;
    const bool bp_first = cand_bp && cand_rans && est_bp <= est;
    const bool bw_first = cand_bw && (!cand_rans || slack_s * est_bw <= slack_e * est);
    run[q] = cand_rans && !bp_first && !bw_first && st[0] > 1;
}

// The decoder's block table, made on the device from the streams (one CTA of 256 threads per
// CONST or RANS stream s, whose header and frequency table the host has checked): stream s is
// at src[s], stores stored[s] bytes, decodes n[s] symbols into dst[s] in nb[s] blocks of
// 2^lg[s] symbols, mode[s] 1 = CONST (block j's fill byte at offset pos[s] + j) or 2 = RANS
// (word counts at pos[s], then the final states, then the words; its decode table's input,
// the exclusive prefix sums of its frequencies, at cums + 256 tab_of[s]). Its blocks are rows
// first[s] .. of the table's columns, as rans_decode reads them.
// The checks the host has not made (spec/rans.md, section 6, check 4): no block stores more
// words than symbols, and the stream's length is 12 + T + 132 nb + 2 (its words) exactly. A
// stream that fails one gets bad[s] = 1 and its blocks mode 2 (rans_decode skips them); the
// host names the failure after the decode.
extern "C" __global__ void __launch_bounds__(256)
rans_blocks(const u64* src, const i64* stored, const i64* n, const u64* dst, const i64* nb,
            const i64* pos, const i64* first, const u32* cums, const i64* tab_of,
            const u8* lg, const u8* mode,
            u8* b_mode, u8* b_fill, u64* b_words, u32* b_count, u64* b_states, u64* b_dtab,
            u64* b_out, u32* b_len, int* bad) {
    __shared__ u64 wsum[8];
    __shared__ int any_bad;
    const int s = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const u8* in = (const u8*)src[s];
    const i64 nbs = nb[s], p = pos[s], f0 = first[s], ns = n[s];
    const int l = lg[s];
    const bool is_rans = mode[s] == 2;
    const u8* words = in + p + 132 * nbs;
    if (t == 0) any_bad = 0;
    u64 carry = 0;  // words of the stream's blocks before this chunk
    int badt = 0;
    for (i64 j0 = 0; j0 < nbs; j0 += 256) {
        const i64 j = j0 + t;
        const bool active = j < nbs;
        u64 c = 0, len = 0, start = 0;
        if (active) {
            start = (u64)j << l;
            len = (u64)ns - start < (1ull << l) ? (u64)ns - start : (1ull << l);
            if (is_rans) {
                const u8* cp = in + p + 4 * j;  // little-endian u32, byte loads (any alignment)
                c = (u64)cp[0] | (u64)cp[1] << 8 | (u64)cp[2] << 16 | (u64)cp[3] << 24;
                badt |= c > len;
            }
        }
        // exclusive prefix sum of c over the chunk
        const u64 v = warp_scan(c, lane);
        if (lane == 31) wsum[warp] = v;
        __syncthreads();
        u64 before = 0, chunk = 0;
        for (int i = 0; i < 8; i++) {
            if (i < warp) before += wsum[i];
            chunk += wsum[i];
        }
        __syncthreads();  // wsum is reused by the next chunk
        if (active) {
            const i64 b = f0 + j;
            b_mode[b] = is_rans ? 0 : 1;
            b_fill[b] = is_rans ? 0 : in[p + j];
            b_count[b] = (u32)c;
            b_words[b] = is_rans ? (u64)(words + 2 * (carry + before + v - c)) : 0;
            b_states[b] = is_rans ? (u64)(in + p + 4 * nbs + 128 * j) : 0;
            b_dtab[b] = is_rans ? (u64)(cums + 256 * tab_of[s]) : 0;
            b_out[b] = dst[s] + start;
            b_len[b] = (u32)len;
        }
        carry += chunk;
    }
    if (badt) any_bad = 1;  // (a benign race: every writer writes 1)
    __syncthreads();
    const bool failed = any_bad || (is_rans && (u64)stored[s] != (u64)(p + 132 * nbs) + 2 * carry);
    if (failed) {
        for (i64 j = t; j < nbs; j += 256) {
            b_mode[f0 + j] = 2;
            b_dtab[f0 + j] = 0;
        }
        if (t == 0) bad[s] = 1;
    }
}
