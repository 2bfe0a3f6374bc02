// XXH3-64 digests of 64 KiB leaves (spec/format.md, "Hashes"): one warp per leaf. Segment s
// covers bytes [ptr[s], ptr[s] + len[s]) and owns leaves [first[s], first[s + 1]); its digests
// go to out[at[s]], out[at[s] + 1], ... Then hash_roots hashes each segment's root input (its
// length, then its digests) on the device: the plane checksum (XXH3-64) or the content hash
// (XXH3-128); a host holding the digests may root them itself (s4weights/gpu/hash.py).
#include "xxh3.cuh"

#define LEAF 65536

// Warp-cooperative XXH3-64 of one input longer than 240 bytes: lanes 8g + i (g = 0..3) sum the
// contributions of stripes g, g + 4, ... to accumulator i; the sums meet by shuffles before each
// scramble. Matches xxh3_long exactly (additions inside a block commute).
// Every lane ends with all 8 accumulators (before the merge) in `all`.
__device__ void xxh3_long_warp_acc(const u8* in, u64 len, int lane, u64* all) {
    const int i = lane & 7, g = lane >> 3;
    u64 init[8];
    xxh3_acc_init(init);
    u64 acc = init[i];
    const u64 nb = xxh3_full_blocks(len);
    if (((u64)in & 7) == 0) {
        // Aligned input: each lane loads its word of stripes g, g + 4, g + 8, g + 12 (the
        // neighbour word a stripe adds comes from lane i ^ 1 by a shuffle, not a second load),
        // the next block's words loaded while this block is summed and scrambled.
        const u64* w = (const u64*)in;
        u64 sec[4], d[4], nxt[4];
        for (int k = 0; k < 4; k++) {
            sec[k] = xxh_secret64(8 * (g + 4 * k) + 8 * i);
            d[k] = nb ? w[8 * (g + 4 * k) + i] : 0;
        }
        for (u64 b = 0; b < nb; b++) {
            if (b + 1 < nb)
                for (int k = 0; k < 4; k++) nxt[k] = w[(b + 1) * 128 + 8 * (g + 4 * k) + i];
            u64 sum = 0;
            for (int k = 0; k < 4; k++) {
                const u64 other = __shfl_xor_sync(0xFFFFFFFFu, d[k], 1);
                const u64 x = d[k] ^ sec[k];
                sum += (u64)(u32)x * (x >> 32) + other;
            }
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
            acc = xxh3_scramble_lane(acc + sum, i);
            for (int k = 0; k < 4; k++) d[k] = nxt[k];
        }
    } else {
        for (u64 b = 0; b < nb; b++) {
            const u8* blk = in + b * XXH_BLOCK;
            u64 sum = 0;
            for (int s = g; s < XXH_STRIPES_PER_BLOCK; s += 4)
                sum += xxh3_stripe_lane(blk + s * XXH_STRIPE, 8 * s, i);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
            acc = xxh3_scramble_lane(acc + sum, i);
        }
    }
    const u8* blk = in + nb * XXH_BLOCK;
    const int ts = xxh3_tail_stripes(len);
    u64 sum = 0;
    for (int s = g; s < ts; s += 4) sum += xxh3_stripe_lane(blk + s * XXH_STRIPE, 8 * s, i);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
    acc += sum + xxh3_stripe_lane(in + len - XXH_STRIPE, XXH_LAST_STRIPE_SOFF, i);
    for (int k = 0; k < 8; k++) all[k] = __shfl_sync(0xFFFFFFFFu, acc, k);
}

__device__ u64 xxh3_long_warp(const u8* in, u64 len, int lane) {
    u64 all[8];
    xxh3_long_warp_acc(in, len, lane, all);
    return xxh3_merge(all, len);
}

extern "C" __global__ void leaf_digests(int nseg, const u64* ptr, const u64* len,
                                        const i64* first, const i64* at, u64* out) {
    const i64 leaf = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (leaf >= first[nseg]) return;
    int lo = 0, hi = nseg - 1;  // the segment whose leaves include `leaf`
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= leaf) lo = mid; else hi = mid - 1;
    }
    const u64 off = (u64)(leaf - first[lo]) * LEAF;
    const u64 n = len[lo] - off < LEAF ? len[lo] - off : LEAF;
    const u8* in = (const u8*)ptr[lo] + off;
    u64 h;
    if (n > 240) h = xxh3_long_warp(in, n, lane);
    else h = xxh3_64(in, n);
    if (lane == 0) out[at[lo] + (leaf - first[lo])] = h;
}

// A CTA's XXH3 long form over one input (len > 240), every thread taking part; each ends with
// the 8 accumulators (before the merge) in `all`. Inside a 1 KiB block the stripes only add
// into the accumulators, so the warps sum the blocks' stripes in parallel (warp w: blocks w,
// w + 8, ...; lanes 8g + i as in xxh3_long_warp) into shared memory, ROOT_ROUND blocks a
// round; then lanes 0-7 of warp 0 run the serial part alone: each block's scramble of
// acc + its sum. (A root over a 1 GiB tensor's digests is 128 blocks: one warp doing it all
// waited on its loads block after block, ~0.07 ms.)
#define ROOT_ROUND 128
__device__ void xxh3_long_cta_acc(const u8* in, u64 len, u64* all) {
    __shared__ u64 sums[ROOT_ROUND][8];
    __shared__ u64 accs[8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, i = lane & 7, g = lane >> 3;
    const int warps = blockDim.x >> 5;
    u64 init[8];
    xxh3_acc_init(init);
    u64 acc = init[i];  // (lanes 0-7 of warp 0 carry it)
    const u64 nb = xxh3_full_blocks(len);
    for (u64 base = 0; base < nb; base += ROOT_ROUND) {
        const int m = nb - base < ROOT_ROUND ? (int)(nb - base) : ROOT_ROUND;
        for (int b = warp; b < m; b += warps) {
            const u8* blk = in + (base + b) * XXH_BLOCK;
            u64 sum = 0;
            for (int st = g; st < XXH_STRIPES_PER_BLOCK; st += 4)
                sum += xxh3_stripe_lane(blk + st * XXH_STRIPE, 8 * st, i);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
            if (g == 0) sums[b][i] = sum;
        }
        __syncthreads();
        if (warp == 0 && lane < 8)
            for (int b = 0; b < m; b++) acc = xxh3_scramble_lane(acc + sums[b][i], i);
        __syncthreads();  // (sums is refilled next round)
    }
    if (warp == 0) {
        const u8* blk = in + nb * XXH_BLOCK;
        const int ts = xxh3_tail_stripes(len);
        u64 sum = 0;
        for (int st = g; st < ts; st += 4)
            sum += xxh3_stripe_lane(blk + st * XXH_STRIPE, 8 * st, i);
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
        acc += sum + xxh3_stripe_lane(in + len - XXH_STRIPE, XXH_LAST_STRIPE_SOFF, i);
        if (lane < 8) accs[lane] = acc;
    }
    __syncthreads();
    for (int k = 0; k < 8; k++) all[k] = accs[k];
}

// The roots of nseg segments (spec/format.md, "Hashes": the hash of u64 length || the leaf
// digests) whose digests lie in buf with a free slot before each segment's: segment s's slot
// is buf[first[s] + s] (first: the leaf prefix sums, first[nseg] the total). One CTA per
// segment puts its length in the slot and hashes that root input in place (warp 0 alone for
// the short forms, the whole CTA for the long one): wide = 0, the plane checksum (XXH3-64) to
// out[s]; wide = 1, the content hash (XXH3-128, canonical bytes) to the 16 bytes at out + 2 s.
extern "C" __global__ void hash_roots(int nseg, const u64* len, const i64* first, u64* buf,
                                      u64* out, int wide) {
    const i64 s = blockIdx.x;
    if (s >= nseg) return;  // (uniform in the CTA)
    u64* in = buf + first[s] + s;
    const u64 n = 8 * (u64)(first[s + 1] - first[s] + 1);
    if (threadIdx.x == 0) in[0] = len[s];
    __syncthreads();
    if (n > 240) {
        u64 all[8];
        xxh3_long_cta_acc((const u8*)in, n, all);
        if (threadIdx.x != 0) return;
        if (!wide) {
            out[s] = xxh3_merge(all, n);
        } else {
            xxh128_canonical(xxh3_128_long_finish(all, n), (u8*)(out + 2 * s));
        }
        return;
    }
    if (threadIdx.x != 0) return;
    if (!wide) {
        out[s] = xxh3_64((const u8*)in, n);
    } else {
        xxh128_canonical(xxh3_128((const u8*)in, n), (u8*)(out + 2 * s));
    }
}
