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

// The roots of nseg segments (spec/format.md, "Hashes": the hash of u64 length || the leaf
// digests) whose digests lie in buf with a free slot before each segment's: segment s's slot
// is buf[first[s] + s] (first: the leaf prefix sums, first[nseg] the total). One warp per
// segment puts its length in the slot and hashes that root input in place: wide = 0, the plane
// checksum (XXH3-64) to out[s]; wide = 1, the content hash (XXH3-128, canonical bytes) to the
// 16 bytes at out + 2 s.
extern "C" __global__ void hash_roots(int nseg, const u64* len, const i64* first, u64* buf,
                                      u64* out, int wide) {
    const i64 s = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;  // (uniform in a warp)
    const int lane = threadIdx.x & 31;
    if (s >= nseg) return;
    u64* in = buf + first[s] + s;
    if (lane == 0) in[0] = len[s];
    __syncwarp();
    const u64 n = 8 * (u64)(first[s + 1] - first[s] + 1);
    if (!wide) {
        const u64 h = n > 240 ? xxh3_long_warp((const u8*)in, n, lane)
                              : xxh3_64((const u8*)in, n);
        if (lane == 0) out[s] = h;
        return;
    }
    xxh128 h;
    if (n > 240) {
        u64 all[8];
        xxh3_long_warp_acc((const u8*)in, n, lane, all);
        h = xxh3_128_long_finish(all, n);
    } else {
        h = xxh3_128((const u8*)in, n);
    }
    if (lane == 0) xxh128_canonical(h, (u8*)(out + 2 * s));
}
