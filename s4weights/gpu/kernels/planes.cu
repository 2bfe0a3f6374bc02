// Plane split and merge (spec/planes.md) for the bf16, fp16 and fp32 layouts, batched: one
// launch covers many tensors through a chunk table (chunk -> tensor segment, first element).
//
// hist: reads each element once and adds per-segment byte histograms of the byte planes (plus
// the count of set sign bits), which the host needs for the codec choice and the rANS
// frequency tables before anything is split (the encoder sizes its groups by them).
// split: reads each element once and writes the packed sign bits (the bitpack codec's stored
// form: bit i of the plane is bit i % 8 of byte i / 8) and one byte plane per other field, or,
// where asked, the narrow mantissa field (7 bits in bf16 and fp32, 2 in fp16) as bitpack-w at
// its width: the stored form that plane usually takes, so the assembly copies it as it is.
// split_hist: both at once (a group that needs no sizing: one tensor alone, or a window that
// fits the workspace whatever its planes take). One template (split_impl), the histograms and
// the stores switched at compile time.
// merge: the inverse; it reads the sign plane as packed bits or as bytes, every other plane as
// bytes or as bitpack-w's w-bit values (codec 8: eight values in w stored bytes), and flags any
// plane byte with bits outside its field (spec: merge MUST reject those); where asked, it also
// makes the content hash's digests of the full 64 KiB leaves it writes (merge_impl).
//
// Every thread handles 8 consecutive elements, so its sign bits are exactly one stored byte and
// its plane bytes one 8-byte store. Words are read and written as integers, never as floats
// (NaN payloads survive).
#include "packing.cuh"
#include "xxh3.cuh"

#define SPLIT_THREADS 256
#define SPLIT_WARPS (SPLIT_THREADS / 32)
#define CHUNK_ELEMS 65536   // elements per CTA; a multiple of 8 * SPLIT_THREADS
#define LEAF_BYTES 65536    // the content hash's leaves (spec/format.md, "Hashes")
// Tuning, fixed at compile time: SPLIT_G / MERGE_G rounds of 8 elements per thread whose loads
// are issued together (-D builds the other choices, to time them against these on a GPU).
#ifndef SPLIT_G
#define SPLIT_G 2
#endif
#ifndef SPLIT_PERM  // bf16: its sign bits and byte planes by byte permutes (a u32 holds two)
#define SPLIT_PERM 1
#endif
#ifndef MERGE_CONSTW  // the narrow plane at its field's width unpacked with constant shifts
#define MERGE_CONSTW 1
#endif
#ifndef MERGE_G
#define MERGE_G 2
#endif
#ifndef MERGE_PERM  // bf16: two elements per u32 assembled by byte permutes
#define MERGE_PERM 1
#endif

template <int L> struct Lay;
// NARROW: the width of byte plane 1, a mantissa field narrower than a byte in every layout
// here (the plane the split may store as bitpack-w at that width).
// bf16: sign 15 | exponent 14-7 | mantissa0 6-0
template <> struct Lay<1> {
    typedef u16 W;
    static constexpr int NP = 2;
    static __device__ __forceinline__ int shift(int k) { return k == 0 ? 7 : 0; }
    static __device__ __forceinline__ u32 mask(int k) { return k == 0 ? 0xFFu : 0x7Fu; }
    static constexpr u32 NARROW = 7;
};
// fp16: sign 15 | exponent 14-10 | mantissa0 9-8 | mantissa1 7-0
template <> struct Lay<2> {
    typedef u16 W;
    static constexpr int NP = 3;
    static __device__ __forceinline__ int shift(int k) { return k == 0 ? 10 : (k == 1 ? 8 : 0); }
    static __device__ __forceinline__ u32 mask(int k) { return k == 0 ? 0x1Fu : (k == 1 ? 0x3u : 0xFFu); }
    static constexpr u32 NARROW = 2;
};
// fp32: sign 31 | exponent 30-23 | mantissa0 22-16 | mantissa1 15-8 | mantissa2 7-0
template <> struct Lay<3> {
    typedef u32 W;
    static constexpr int NP = 4;
    static __device__ __forceinline__ int shift(int k) { return k == 0 ? 23 : (k == 1 ? 16 : (k == 2 ? 8 : 0)); }
    static __device__ __forceinline__ u32 mask(int k) { return k == 0 ? 0xFFu : (k == 1 ? 0x7Fu : 0xFFu); }
    static constexpr u32 NARROW = 7;
};

// A warp's 32 groups of 8 values (lane l: group l, its values as the bytes of v, 0 past the
// end) stored at WD bits each (bitpack-w) at `o`, the warp's first group's place (4-aligned):
// the warp's 256 WD bits are 8 WD words, word i the bits 32 i .. 32 i + 31, which lie in the
// groups of lanes 32 i / (8 WD) and the next (WD = 2 or 7); each lane makes words lane and
// lane + 32 from those lanes' bits by shuffles and stores them, or, for the last groups of a
// plane (`rest` values from the warp's first on, under 256), their bytes up to the plane's
// last stored byte. Every lane of the warp calls it.
template <u32 WD>
__device__ __forceinline__ void warp_pack(u8* o, u64 v, i64 rest, int lane) {
    static_assert(WD >= 2 && WD <= 7, "a word must span at most two lanes' groups");
    constexpr u32 B = 8 * WD, NW = 8 * WD;  // bits per lane, words per warp
    const u64 acc = compress8<WD>(v);
    const u32 lo = (u32)acc, hi = (u32)(acc >> 32);
    u32 word[2] = {0, 0};
#pragma unroll
    for (u32 r = 0; r < 2; r++) {
        if (32 * r >= NW) break;  // (uniform)
        const u32 bit = 32 * (lane + 32 * r);
        const u32 l0 = bit / B, o0 = bit % B;
        const u32 s0 = l0 < 31 ? l0 : 31, s1 = l0 + 1 < 31 ? l0 + 1 : 31;
        const u64 a0 = (u64)__shfl_sync(0xFFFFFFFFu, lo, s0)
                       | (u64)__shfl_sync(0xFFFFFFFFu, hi, s0) << 32;
        const u64 a1 = (u64)__shfl_sync(0xFFFFFFFFu, lo, s1)
                       | (u64)__shfl_sync(0xFFFFFFFFu, hi, s1) << 32;
        u64 x = a0 >> o0;
        if (B - o0 < 32) x |= a1 << (B - o0);
        word[r] = (u32)x;
    }
    if (rest >= 256) {
        if (lane < NW) ((u32*)o)[lane] = word[0];
        if (lane + 32 < NW) ((u32*)o)[lane + 32] = word[1];
    } else if (rest > 0) {
        const u32 nb = (u32)((rest * WD + 7) / 8);
        for (u32 r = 0; r < 2; r++)
            for (u32 b = 0; b < 4; b++) {
                const u32 at = 4 * (lane + 32 * r) + b;
                if (at < nb) o[at] = (u8)(word[r] >> (8 * b));
            }
    }
}

// The 8 bytes of v counted in the bins hk[256]: each byte picked by a permute, its bin's
// address one LEA (a loop over a runtime count shifted the u64 by a variable per byte).
__device__ __forceinline__ void count8(u32* hk, u64 v) {
    const u32 lo = (u32)v, hi = (u32)(v >> 32);
#pragma unroll
    for (u32 j = 0; j < 4; j++) atomicAdd(&hk[__byte_perm(lo, 0, 0x4440 + j)], 1u);
#pragma unroll
    for (u32 j = 0; j < 4; j++) atomicAdd(&hk[__byte_perm(hi, 0, 0x4440 + j)], 1u);
}

// Segment table, one entry per tensor, as parallel arrays:
//   src/dst[s]     the tensor's words (split reads, merge writes)
//   n[s]           elements
//   planes[s*5+k]  k = 0: sign (packed bits or bytes), 1..: the byte planes in layout order
//   pack[s]        split: 1 stores the narrow mantissa plane (Lay::NARROW) as bitpack-w at its
//                  width (the plane 4-aligned), 0 as bytes
//   hist           u64[nseg][4][256] byte histograms of planes 1..NP; sign_ones u64[nseg]
template <int L, bool HIST, bool WRITE>
__device__ void split_impl(const int* chunk_seg, const i64* chunk_start, const u64* src,
                           const i64* nelem, const u64* planes, const u8* pack, u64* hist,
                           u64* sign_ones) {
    typedef typename Lay<L>::W W;
    constexpr int NP = Lay<L>::NP;
    __shared__ u32 h[HIST ? SPLIT_WARPS : 1][NP][256];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if constexpr (HIST) {
        for (int i = tid; i < SPLIT_WARPS * NP * 256; i += SPLIT_THREADS) (&h[0][0][0])[i] = 0;
        __syncthreads();
    }

    const int seg = chunk_seg[blockIdx.x];
    const i64 n = nelem[seg];
    const i64 c0 = chunk_start[blockIdx.x];
    const i64 c1 = c0 + CHUNK_ELEMS < n ? c0 + CHUNK_ELEMS : n;
    const W* in = (const W*)src[seg];
    u8* sign = WRITE ? (u8*)planes[seg * 5] : nullptr;
    u8* outp[NP];  // (loaded once: the stores below may alias the table for all the compiler knows)
#pragma unroll
    for (int k = 0; k < NP; k++) outp[k] = WRITE ? (u8*)planes[seg * 5 + 1 + k] : nullptr;
    const bool packs = WRITE && pack[seg];
    const bool vec = ((u64)in & 15) == 0;
    u32 ones = 0;
    // rounds of 8 * SPLIT_THREADS elements, SPLIT_G at a time (every load of a step before its
    // work), every thread in every round (the packed stores are a warp's); a thread past the
    // end has m = 0 and zeros
    for (i64 s0 = c0; s0 < c1; s0 += SPLIT_G * 8 * SPLIT_THREADS) {
        // a group's 8 words: as 4 u32 (two 16-bit words each) or 8 u32
        u32 x[SPLIT_G][8 * sizeof(W) / 4];
        int m[SPLIT_G];
#pragma unroll
        for (int g = 0; g < SPLIT_G; g++) {
            const i64 e = s0 + (i64)g * 8 * SPLIT_THREADS + 8 * (i64)tid;
            m[g] = e >= c1 ? 0 : (c1 - e < 8 ? (int)(c1 - e) : 8);
            if (m[g] == 8 && vec) {
                const uint4 v0 = *(const uint4*)(in + e);
                x[g][0] = v0.x; x[g][1] = v0.y; x[g][2] = v0.z; x[g][3] = v0.w;
                if constexpr (sizeof(W) == 4) {
                    const uint4 v1 = *(const uint4*)(in + e + 4);
                    x[g][4] = v1.x; x[g][5] = v1.y; x[g][6] = v1.z; x[g][7] = v1.w;
                }
            } else {  // (unrolled: constant indices keep x in registers)
#pragma unroll
                for (int i = 0; i < 8 * (int)sizeof(W) / 4; i++) x[g][i] = 0;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (j < m[g])
                        x[g][j * sizeof(W) / 4] |= (u32)in[e + j] << (sizeof(W) == 2 ? 16 * (j & 1) : 0);
            }
        }
#pragma unroll
        for (int g = 0; g < SPLIT_G; g++) {
            const i64 r0 = s0 + (i64)g * 8 * SPLIT_THREADS;  // this round's first element
            const i64 e = r0 + 8 * (i64)tid;
            // the sign bits (bit j: element j) and each byte plane's 8 bytes
            u32 sbits = 0;
            u64 pk[NP];
            if constexpr (L == 1 && SPLIT_PERM) {
                const u32* q = x[g];
                const u32 c = ((q[0] & 0x80008000u) >> 15) | ((q[1] & 0x80008000u) >> 13)
                              | ((q[2] & 0x80008000u) >> 11) | ((q[3] & 0x80008000u) >> 9);
                sbits = (c | (c >> 15)) & 0xFFu;
                pk[0] = __byte_perm(q[0] >> 7, q[1] >> 7, 0x6420)
                        | (u64)__byte_perm(q[2] >> 7, q[3] >> 7, 0x6420) << 32;
                pk[1] = __byte_perm(q[0] & 0x007F007Fu, q[1] & 0x007F007Fu, 0x6420)
                        | (u64)__byte_perm(q[2] & 0x007F007Fu, q[3] & 0x007F007Fu, 0x6420) << 32;
            } else {
                W w[8];
                for (int j = 0; j < 8; j++)
                    w[j] = sizeof(W) == 2 ? (W)(x[g][j >> 1] >> (16 * (j & 1))) : (W)x[g][j];
                for (int j = 0; j < 8; j++) sbits |= (u32)(w[j] >> (8 * sizeof(W) - 1)) << j;
                for (int k = 0; k < NP; k++) {
                    pk[k] = 0;
                    for (int j = 0; j < 8; j++)
                        pk[k] |= (u64)(((u32)w[j] >> Lay<L>::shift(k)) & Lay<L>::mask(k)) << (8 * j);
                }
            }
            if constexpr (WRITE) if (m[g]) sign[e >> 3] = (u8)sbits;
            ones += __popc(sbits);
            for (int k = 0; k < NP; k++) {
                const u64 packed = pk[k];
                if constexpr (HIST) {
                    if (m[g] == 8) count8(h[warp][k], packed);
                    else
                        for (int j = 0; j < m[g]; j++)
                            atomicAdd(&h[warp][k][(u32)(packed >> (8 * j)) & 0xFFu], 1u);
                }
                if constexpr (WRITE) {
                    u8* out = outp[k];
                    if (k == 1 && packs) {  // the warp's groups start at element r0 + 256 warp
                        const i64 ew = r0 + 256 * (i64)warp;
                        warp_pack<Lay<L>::NARROW>(out + (ew >> 3) * Lay<L>::NARROW, packed,
                                                  c1 - ew, lane);
                    } else if (m[g] == 8) {
                        *(u64*)(out + e) = packed;
                    } else {
                        for (int j = 0; j < m[g]; j++) out[e + j] = (u8)(packed >> (8 * j));
                    }
                }
            }
        }
    }
    if constexpr (HIST) {
        for (int off = 16; off; off >>= 1) ones += __shfl_xor_sync(0xFFFFFFFFu, ones, off);
        if ((tid & 31) == 0 && ones) atomicAdd(&sign_ones[seg], (u64)ones);
        __syncthreads();
        for (int i = tid; i < NP * 256; i += SPLIT_THREADS) {
            u32 t = 0;
            for (int wi = 0; wi < SPLIT_WARPS; wi++) t += h[wi][i >> 8][i & 255];
            if (t) atomicAdd(&hist[(u64)seg * 1024 + i], (u64)t);
        }
    }
}

// 8 bytes of a plane at element e (m of them valid, the rest 0): one aligned load when it can.
__device__ __forceinline__ u64 load8(const u8* p, i64 e, int m) {
    if (m == 8 && (((u64)(p + e)) & 7) == 0) return *(const u64*)(p + e);
    u64 v = 0;
    for (int j = 0; j < m; j++) v |= (u64)p[e + j] << (8 * j);
    return v;
}

// width[s*5 + k]: plane k's stored form; the sign plane (k = 0): 1 packed bits, 0 bytes; the
// others: 0 bytes, w = bitpack-w of width w.
//
// The content hash's leaf digests (spec/format.md, "Hashes": XXH3-64 of each 64 KiB leaf of the
// tensor's bytes) of every FULL leaf, from the words the merge writes, where digests is not
// null and dfirst[s] >= 0 (segment s's first leaf digest goes to digests[dfirst[s]]; a last
// partial leaf is the host's to hash). A warp's step covers whole 1 KiB blocks of the output
// (8 elements per lane, its groups one after another), and inside a block XXH3's 16 stripes only
// add into the 8 accumulators: each lane adds what its words give, the warp sums them by
// shuffles, and the block's 8 sums go to shared memory; after the chunk (2 or 4 leaves) one warp
// per full leaf runs the 63 scrambles between blocks and the merge (xxh3_long's order exactly).
template <int L>
__device__ void merge_impl(const int* chunk_seg, const i64* chunk_start, const u64* dst,
                           const i64* nelem, const u64* planes, const u8* width,
                           int* errors, u64* digests, const i64* dfirst) {
    typedef typename Lay<L>::W W;
    constexpr int NP = Lay<L>::NP;
    constexpr int G = MERGE_G;  // groups of 8 elements per thread and step: loads first
    constexpr int WPL = sizeof(W);                  // u64 words of a lane's 8 elements
    constexpr int LPS = 8 / WPL;                    // lanes per 64-byte stripe
    constexpr int GPB = 1024 / (256 * sizeof(W));   // a warp's groups per 1 KiB block
    constexpr int NBW = G / GPB;                    // blocks per warp step
    constexpr int LPC = CHUNK_ELEMS * sizeof(W) / LEAF_BYTES;  // leaves per chunk
    static_assert(G % GPB == 0 && LPC <= SPLIT_WARPS, "a warp step is whole blocks");
    __shared__ u64 hsum[LPC][64][8];  // per leaf of the chunk: each block's 8 sums
    __shared__ u64 hsec[XXH_SECRET_SIZE / 8 + 8];  // the secret's words, then the last stripe's
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int seg = chunk_seg[blockIdx.x];
    const i64 n = nelem[seg];
    const i64 c0 = chunk_start[blockIdx.x];
    const i64 c1 = c0 + CHUNK_ELEMS < n ? c0 + CHUNK_ELEMS : n;
    W* out = (W*)dst[seg];
    const u8* sign = (const u8*)planes[seg * 5];
    const u8* pl[NP];
    for (int k = 0; k < NP; k++) pl[k] = (const u8*)planes[seg * 5 + 1 + k];
    const bool packed_sign = width[seg * 5] != 0;
    u32 wd[NP];
    for (int k = 0; k < NP; k++) wd[k] = width[seg * 5 + 1 + k];
    const bool vec = ((u64)out & 15) == 0;
    const i64 dfs = digests ? dfirst[seg] : -1;  // (uniform: the CTA's segment)
    const i64 full_leaves = n * (i64)sizeof(W) / LEAF_BYTES;
    if (dfs >= 0) {
        for (int i = tid; i < XXH_SECRET_SIZE / 8; i += SPLIT_THREADS) hsec[i] = xxh_secret64(8 * i);
        if (tid < 8) hsec[XXH_SECRET_SIZE / 8 + tid] = xxh_secret64(XXH_LAST_STRIPE_SOFF + 8 * tid);
        __syncthreads();
    }
    u64 bad = 0;
    // a step: warp w's elements [s0 + w G 256, + G 256), group g's 256 of them from g 256 on,
    // 8 per lane
    for (i64 s0 = c0; s0 < c1; s0 += G * 8 * SPLIT_THREADS) {
        const i64 w0 = s0 + (i64)warp * G * 256;
        int m[G];
        u64 sv[G], v[G][NP];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const i64 e = w0 + (i64)g * 256 + 8 * lane;
            m[g] = e >= c1 ? 0 : (c1 - e < 8 ? (int)(c1 - e) : 8);
            if (packed_sign) sv[g] = m[g] ? sign[e >> 3] : 0;
            else sv[g] = load8(sign, e, m[g]);
#pragma unroll
            for (int k = 0; k < NP; k++) {
                if (m[g] == 0) v[g][k] = 0;
                else if (MERGE_CONSTW && k == 1 && wd[k] == Lay<L>::NARROW)
                    v[g][k] = unpack8c<Lay<L>::NARROW>(pl[k], e, m[g]);
                else if (wd[k]) v[g][k] = unpack8(pl[k], e, m[g], wd[k]);
                else v[g][k] = load8(pl[k], e, m[g]);
            }
        }
        // the step's blocks' place: leaf (of the tensor) and block in it; hashed when the leaf
        // is full (then every lane has 8 elements in every group)
        const i64 bofs = (w0 - c0) * (i64)sizeof(W);  // the warp's first byte in the chunk
        const i64 leaf = (c0 * (i64)sizeof(W) + bofs) / LEAF_BYTES;
        const bool hashing = dfs >= 0 && leaf < full_leaves;  // (uniform in the warp)
        u64 part[NBW][WPL];
#pragma unroll
        for (int b = 0; b < NBW; b++)
#pragma unroll
            for (int j = 0; j < WPL; j++) part[b][j] = 0;
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (!m[g]) continue;
            const i64 e = w0 + (i64)g * 256 + 8 * lane;
            if (packed_sign) {
                if (m[g] < 8) bad |= sv[g] >> m[g];  // padding bits of the last byte must be 0
            } else {
                bad |= sv[g] & 0xFEFEFEFEFEFEFEFEull;  // sign bytes are 0 or 1
            }
            for (int k = 0; k < NP; k++) {
                const u64 mk = 0x0101010101010101ull * (u64)(0xFFu & ~Lay<L>::mask(k));
                bad |= v[g][k] & mk;  // bits outside the field
            }
            // the 8 words as u32 (bf16: two per u32, element 2i + 1 in the high half)
            constexpr int NO = 2 * (int)sizeof(W);
            u32 o[NO];
            if constexpr (L == 1 && MERGE_PERM) {
                // the sign values as bytes (0 or 1): 4 packed bits to 4 bytes by one multiply
                const u32 s0 = (u32)sv[g], s1 = (u32)(sv[g] >> 32);
                const u32 sb[2] = {packed_sign ? ((s0 & 0xFu) * 0x00204081u) & 0x01010101u : s0,
                                   packed_sign ? (((s0 >> 4) & 0xFu) * 0x00204081u) & 0x01010101u : s1};
                const u32 ex[2] = {(u32)v[g][0], (u32)(v[g][0] >> 32)};
                const u32 mt[2] = {(u32)v[g][1], (u32)(v[g][1] >> 32)};
                // elements 2i, 2i + 1: bytes (e, s, e', s') shifted left 7 put the exponents at
                // bits 7 and 23 and the signs at 15 and 31; (m, 0, m', 0) fills bits 0-6, 16-22
#pragma unroll
                for (int i = 0; i < 4; i++)
                    o[i] = (__byte_perm(ex[i >> 1], sb[i >> 1], i & 1 ? 0x7362 : 0x5140) << 7)
                           + __byte_perm(mt[i >> 1], 0, i & 1 ? 0x4342 : 0x4140);
            } else {
                W w[8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 s = packed_sign ? (u32)(sv[g] >> j) & 1u : (u32)(sv[g] >> (8 * j)) & 1u;
                    w[j] = (W)((u32)s << (8 * sizeof(W) - 1));
                }
#pragma unroll
                for (int k = 0; k < NP; k++)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        w[j] |= (W)(((u32)(v[g][k] >> (8 * j)) & 0xFFu) << Lay<L>::shift(k));
#pragma unroll
                for (int i = 0; i < NO; i++)
                    o[i] = sizeof(W) == 2 ? (u32)w[2 * i] | (u32)w[2 * i + 1] << 16 : (u32)w[i];
            }
            if (hashing) {  // this lane's words of stripe `st`: words i0 .. i0 + WPL - 1
                const int st = lane / LPS + (32 / LPS) * (g % GPB), i0 = WPL * (lane % LPS);
                const int blk = (int)(((bofs + (i64)g * 256 * sizeof(W)) >> 10) & 63);
                const bool last = blk == 63 && st == 15;  // the leaf's last stripe: its secret
#pragma unroll
                for (int j = 0; j < WPL; j++) {
                    const u64 d = o[2 * j] | (u64)o[2 * j + 1] << 32;
                    const u64 k = d ^ hsec[last ? XXH_SECRET_SIZE / 8 + i0 + j : st + i0 + j];
                    part[g / GPB][j] += (u64)(u32)k * (k >> 32);
                    part[g / GPB][j ^ 1] += d;
                }
            }
            if (m[g] == 8 && vec) {
#pragma unroll
                for (int i = 0; i < NO; i += 4)
                    *(uint4*)((u32*)(out + e) + i) = make_uint4(o[i], o[i + 1], o[i + 2], o[i + 3]);
            } else {  // (unrolled: constant indices keep o in registers)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (j < m[g])
                        out[e + j] = (W)(sizeof(W) == 2 ? o[j >> 1] >> (16 * (j & 1)) : o[j]);
            }
        }
        if (hashing) {  // each block's sums: over the lanes of its stripes, to shared memory
#pragma unroll
            for (int b = 0; b < NBW; b++) {
#pragma unroll
                for (int j = 0; j < WPL; j++)
                    for (int off = LPS; off < 32; off <<= 1)
                        part[b][j] += __shfl_xor_sync(0xFFFFFFFFu, part[b][j], off);
                const i64 bo = bofs + (i64)b * 1024;
                if (lane < LPS)
#pragma unroll
                    for (int j = 0; j < WPL; j++)
                        hsum[bo / LEAF_BYTES][(bo >> 10) & 63][WPL * lane + j] = part[b][j];
            }
        }
    }
    if (bad) atomicExch(&errors[seg], 1);
    if (dfs >= 0) {  // the chunk's full leaves: the scrambles between blocks, then the merge
        __syncthreads();
        const i64 leaf = c0 * (i64)sizeof(W) / LEAF_BYTES + warp;
        if (warp < LPC && leaf < full_leaves) {
            const int i = lane & 7;
            u64 acc = 0;  // xxh3_acc_init's lane i (selected: no array in local memory)
            {
                u64 init[8];
                xxh3_acc_init(init);
#pragma unroll
                for (int k = 0; k < 8; k++) acc = i == k ? init[k] : acc;
            }
            for (int b = 0; b < 63; b++) acc = xxh3_scramble_lane(acc + hsum[warp][b][i], i);
            acc += hsum[warp][63][i];
            u64 all[8];
#pragma unroll
            for (int k = 0; k < 8; k++) all[k] = __shfl_sync(0xFFFFFFFFu, acc, k);
            if (lane == 0) digests[dfs + leaf] = xxh3_merge(all, LEAF_BYTES);
        }
    }
}

// split_*: the planes; hist_*: the histograms and set sign bits (``planes`` unused);
// split_hist_*: both in one pass. One argument list for all three.
#define S4_SPLIT(L, NAME, HIST, WRITE)                                                         \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) NAME(                          \
        const int* cs, const i64* c0, const u64* src, const i64* n, const u64* planes,         \
        const u8* pack, u64* hist, u64* ones) {                                                \
        split_impl<L, HIST, WRITE>(cs, c0, src, n, planes, pack, hist, ones);                  \
    }
#define S4_MERGE(L, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) NAME(                          \
        const int* cs, const i64* c0, const u64* dst, const i64* n, const u64* planes,         \
        const u8* packed, int* err, u64* digests, const i64* dfirst) {                         \
        merge_impl<L>(cs, c0, dst, n, planes, packed, err, digests, dfirst);                   \
    }
S4_SPLIT(1, split_bf16, false, true)
S4_SPLIT(2, split_fp16, false, true)
S4_SPLIT(3, split_fp32, false, true)
S4_SPLIT(1, hist_bf16, true, false)
S4_SPLIT(2, hist_fp16, true, false)
S4_SPLIT(3, hist_fp32, true, false)
S4_SPLIT(1, split_hist_bf16, true, true)
S4_SPLIT(2, split_hist_fp16, true, true)
S4_SPLIT(3, split_hist_fp32, true, true)
S4_MERGE(1, merge_bf16)
S4_MERGE(2, merge_fp16)
S4_MERGE(3, merge_fp32)

// out = a ^ b over n bytes (XOR delta against a parent tensor).
extern "C" __global__ void xor_bytes(const u8* a, const u8* b, u8* out, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if ((((u64)a | (u64)b | (u64)out) & 15) == 0) {
        const i64 nv = n >> 4;
        for (i64 i = t; i < nv; i += stride) {
            uint4 x = ((const uint4*)a)[i], y = ((const uint4*)b)[i];
            ((uint4*)out)[i] = make_uint4(x.x ^ y.x, x.y ^ y.y, x.z ^ y.z, x.w ^ y.w);
        }
        for (i64 i = (nv << 4) + t; i < n; i += stride) out[i] = a[i] ^ b[i];
    } else {
        for (i64 i = t; i < n; i += stride) out[i] = a[i] ^ b[i];
    }
}

// a[i] ^= b[i] over len[i] bytes, one CTA per op (the host cuts long ops into 64 KiB pieces):
// the deltas of a chain level made whole in one launch instead of one launch per tensor.
extern "C" __global__ void xor_ops(const u64* a, const u64* b, const u64* len) {
    u8* x = (u8*)a[blockIdx.x];
    const u8* y = (const u8*)b[blockIdx.x];
    const u64 n = len[blockIdx.x];
    if ((((u64)x | (u64)y | n) & 15) == 0) {
        for (u64 i = threadIdx.x; i < n / 16; i += blockDim.x) {
            const uint4 p = ((const uint4*)x)[i], q = ((const uint4*)y)[i];
            ((uint4*)x)[i] = make_uint4(p.x ^ q.x, p.y ^ q.y, p.z ^ q.z, p.w ^ q.w);
        }
    } else {
        for (u64 i = threadIdx.x; i < n; i += blockDim.x) x[i] ^= y[i];
    }
}
