// XXH3-64, seed 0, default secret: every length class (0, 1-3, 4-8, 9-16, 17-128, 129-240 and
// the long form with stripes, accumulate, scramble and merge), written from the published
// algorithm description. Host and device: the same functions hash a leaf on either side.
//
// The long form is also exposed piecewise (xxh3_block_partial / xxh3_long_finish) so that a warp
// can hash one 64 KiB leaf cooperatively: inside a 1024-byte block the 16 stripes only ADD into
// the accumulators, so lanes may sum stripes in any order; scrambles between blocks stay serial.
#pragma once
#include "common.cuh"

#define XXH_P32_1 0x9E3779B1ULL
#define XXH_P32_2 0x85EBCA77ULL
#define XXH_P32_3 0xC2B2AE3DULL
#define XXH_P64_1 0x9E3779B185EBCA87ULL
#define XXH_P64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_P64_3 0x165667B19E3779F9ULL
#define XXH_P64_4 0x85EBCA77C2B2AE63ULL
#define XXH_P64_5 0x27D4EB2F165667C5ULL
#define XXH_MX1 0x165667919E3779F9ULL
#define XXH_MX2 0x9FB21C651E98DF25ULL

#define XXH_SECRET_SIZE 192
#define XXH_STRIPE 64
#define XXH_STRIPES_PER_BLOCK 16              // (192 - 64) / 8
#define XXH_BLOCK 1024                        // 64 * 16

#define XXH_SECRET_BYTES \
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, \
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, \
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, \
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, \
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, \
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, \
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, \
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, \
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, \
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, \
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, \
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,

// The secret lives in constant memory on the device and in a plain array on the host.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// A global array, not __constant__: lanes read different offsets, which constant memory
// would serialise.
__device__ __align__(16) u8 xxh_secret_dev[XXH_SECRET_SIZE] = {XXH_SECRET_BYTES};
#endif
#if !defined(__CUDACC_RTC__)
alignas(16) static const u8 xxh_secret_host[XXH_SECRET_SIZE] = {XXH_SECRET_BYTES};
#endif
#if defined(__CUDA_ARCH__)
#define XXH_SECRET_ARR xxh_secret_dev
#else
#define XXH_SECRET_ARR xxh_secret_host
#endif

// Little-endian loads byte by byte: inputs need no alignment (leaves of a stored payload start
// anywhere) and the result is the same on every host.
S4_HD u32 xxh_r32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
S4_HD u64 xxh_r64(const u8* p) {
#if defined(__CUDA_ARCH__)
    if (((u64)p & 7) == 0) return *(const u64*)p;  // little-endian device, aligned: one load
#endif
    return (u64)xxh_r32(p) | ((u64)xxh_r32(p + 4) << 32);
}
S4_HD u64 xxh_secret64(int off) { return xxh_r64(XXH_SECRET_ARR + off); }
S4_HD u32 xxh_secret32(int off) { return xxh_r32(XXH_SECRET_ARR + off); }

S4_HD u64 xxh_rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
S4_HD u64 xxh_swap64(u64 x) {
    x = ((x & 0x00FF00FF00FF00FFULL) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
    x = ((x & 0x0000FFFF0000FFFFULL) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
    return (x << 32) | (x >> 32);
}

S4_HD u64 xxh_mul128_fold64(u64 a, u64 b) {
#if defined(__CUDA_ARCH__)
    return (a * b) ^ __umul64hi(a, b);
#else
    unsigned __int128 m = (unsigned __int128)a * b;
    return (u64)m ^ (u64)(m >> 64);
#endif
}

S4_HD u64 xxh3_avalanche(u64 h) {
    h ^= h >> 37;
    h *= XXH_MX1;
    return h ^ (h >> 32);
}

S4_HD u64 xxh64_avalanche(u64 h) {
    h ^= h >> 33;
    h *= XXH_P64_2;
    h ^= h >> 29;
    h *= XXH_P64_3;
    return h ^ (h >> 32);
}

S4_HD u64 xxh3_rrmxmx(u64 h, u64 len) {
    h ^= xxh_rotl64(h, 49) ^ xxh_rotl64(h, 24);
    h *= XXH_MX2;
    h ^= (h >> 35) + len;
    h *= XXH_MX2;
    return h ^ (h >> 28);
}

S4_HD u64 xxh3_mix16(const u8* in, int soff) {
    return xxh_mul128_fold64(xxh_r64(in) ^ xxh_secret64(soff), xxh_r64(in + 8) ^ xxh_secret64(soff + 8));
}

S4_HD u64 xxh3_len_0to16(const u8* in, u64 len) {
    if (len > 8) {
        u64 lo = xxh_r64(in) ^ (xxh_secret64(24) ^ xxh_secret64(32));
        u64 hi = xxh_r64(in + len - 8) ^ (xxh_secret64(40) ^ xxh_secret64(48));
        u64 acc = len + xxh_swap64(lo) + hi + xxh_mul128_fold64(lo, hi);
        return xxh3_avalanche(acc);
    }
    if (len >= 4) {
        u64 in64 = (u64)xxh_r32(in + len - 4) + ((u64)xxh_r32(in) << 32);
        u64 keyed = in64 ^ (xxh_secret64(8) ^ xxh_secret64(16));
        return xxh3_rrmxmx(keyed, len);
    }
    if (len > 0) {
        u32 combined = ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24) | (u32)in[len - 1] |
                       ((u32)len << 8);
        u64 keyed = (u64)combined ^ (u64)(xxh_secret32(0) ^ xxh_secret32(4));
        return xxh64_avalanche(keyed);
    }
    return xxh64_avalanche(xxh_secret64(56) ^ xxh_secret64(64));
}

S4_HD u64 xxh3_len_17to128(const u8* in, u64 len) {
    u64 acc = len * XXH_P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += xxh3_mix16(in + 48, 96);
                acc += xxh3_mix16(in + len - 64, 112);
            }
            acc += xxh3_mix16(in + 32, 64);
            acc += xxh3_mix16(in + len - 48, 80);
        }
        acc += xxh3_mix16(in + 16, 32);
        acc += xxh3_mix16(in + len - 32, 48);
    }
    acc += xxh3_mix16(in, 0);
    acc += xxh3_mix16(in + len - 16, 16);
    return xxh3_avalanche(acc);
}

S4_HD u64 xxh3_len_129to240(const u8* in, u64 len) {
    u64 acc = len * XXH_P64_1;
    int rounds = (int)(len / 16);
    for (int i = 0; i < 8; i++) acc += xxh3_mix16(in + 16 * i, 16 * i);
    acc = xxh3_avalanche(acc);
    for (int i = 8; i < rounds; i++) acc += xxh3_mix16(in + 16 * i, 16 * (i - 8) + 3);
    acc += xxh3_mix16(in + len - 16, 136 - 17);
    return xxh3_avalanche(acc);
}

// One accumulator lane `i` (0..7) of one stripe: what the stripe adds to acc[i]. A stripe adds
// data[i] to acc[i ^ 1] and lo32(k) * hi32(k) to acc[i], k = data[i] ^ secret word: so acc[i]
// receives the product of word i and the data word i ^ 1.
S4_HD u64 xxh3_stripe_lane(const u8* stripe, int soff, int i) {
    u64 d = xxh_r64(stripe + 8 * i);
    u64 k = d ^ xxh_secret64(soff + 8 * i);
    return (u64)(u32)k * (k >> 32) + xxh_r64(stripe + 8 * (i ^ 1));
}

S4_HD void xxh3_acc_init(u64* acc) {
    acc[0] = XXH_P32_3; acc[1] = XXH_P64_1; acc[2] = XXH_P64_2; acc[3] = XXH_P64_3;
    acc[4] = XXH_P64_4; acc[5] = XXH_P32_2; acc[6] = XXH_P64_5; acc[7] = XXH_P32_1;
}

S4_HD u64 xxh3_scramble_lane(u64 a, int i) {
    a ^= a >> 47;
    a ^= xxh_secret64(XXH_SECRET_SIZE - XXH_STRIPE + 8 * i);
    return a * XXH_P32_1;
}

// Geometry of the long form for `len` > 240 bytes: full blocks (each followed by a scramble),
// then `tail_stripes` stripes of the last block, then the final stripe at len - 64.
S4_HD u64 xxh3_full_blocks(u64 len) { return (len - 1) / XXH_BLOCK; }
S4_HD int xxh3_tail_stripes(u64 len) {
    return (int)(((len - 1) - XXH_BLOCK * xxh3_full_blocks(len)) / XXH_STRIPE);
}
#define XXH_LAST_STRIPE_SOFF (XXH_SECRET_SIZE - XXH_STRIPE - 7)

// The long form's final step: the 8 accumulators folded pairwise with the secret from `soff`
// on, onto `start` (XXH3-64: offset 11, len * P64_1; XXH3-128 takes a second one, below).
S4_HD u64 xxh3_merge_from(const u64* acc, int soff, u64 start) {
    u64 r = start;
    for (int i = 0; i < 4; i++)
        r += xxh_mul128_fold64(acc[2 * i] ^ xxh_secret64(soff + 16 * i),
                               acc[2 * i + 1] ^ xxh_secret64(soff + 16 * i + 8));
    return xxh3_avalanche(r);
}

S4_HD u64 xxh3_merge(const u64* acc, u64 len) { return xxh3_merge_from(acc, 11, len * XXH_P64_1); }

// The long form's accumulators over `len` > 240 bytes (before the merge).
S4_HD void xxh3_long_acc(const u8* in, u64 len, u64* acc) {
    xxh3_acc_init(acc);
    u64 nb = xxh3_full_blocks(len);
    for (u64 b = 0; b < nb; b++) {
        const u8* blk = in + b * XXH_BLOCK;
        for (int i = 0; i < 8; i++) {
            u64 sum = 0;
            for (int s = 0; s < XXH_STRIPES_PER_BLOCK; s++)
                sum += xxh3_stripe_lane(blk + s * XXH_STRIPE, 8 * s, i);
            acc[i] = xxh3_scramble_lane(acc[i] + sum, i);
        }
    }
    const u8* blk = in + nb * XXH_BLOCK;
    int ts = xxh3_tail_stripes(len);
    for (int i = 0; i < 8; i++) {
        u64 sum = 0;
        for (int s = 0; s < ts; s++) sum += xxh3_stripe_lane(blk + s * XXH_STRIPE, 8 * s, i);
        acc[i] += sum + xxh3_stripe_lane(in + len - XXH_STRIPE, XXH_LAST_STRIPE_SOFF, i);
    }
}

S4_HD u64 xxh3_long(const u8* in, u64 len) {
    u64 acc[8];
    xxh3_long_acc(in, len, acc);
    return xxh3_merge(acc, len);
}

S4_HD u64 xxh3_64(const u8* in, u64 len) {
    if (len <= 16) return xxh3_len_0to16(in, len);
    if (len <= 128) return xxh3_len_17to128(in, len);
    if (len <= 240) return xxh3_len_129to240(in, len);
    return xxh3_long(in, len);
}

// ---- XXH3-128, seed 0, default secret (the content hash's root, spec/format.md "Hashes") ----
// Every length class, from the published algorithm; `hi` and `lo` are the two halves (the
// canonical form is hi then lo, each big-endian: xxh128_canonical).
struct xxh128 {
    u64 lo, hi;
};

S4_HD xxh128 xxh_mul64to128(u64 a, u64 b) {
    xxh128 r;
#if defined(__CUDA_ARCH__)
    r.lo = a * b;
    r.hi = __umul64hi(a, b);
#else
    unsigned __int128 m = (unsigned __int128)a * b;
    r.lo = (u64)m;
    r.hi = (u64)(m >> 64);
#endif
    return r;
}

S4_HD u32 xxh_swap32(u32 x) {
    return ((x << 24) & 0xff000000u) | ((x << 8) & 0x00ff0000u) | ((x >> 8) & 0x0000ff00u) |
           ((x >> 24) & 0x000000ffu);
}

S4_HD xxh128 xxh3_128_len_0to16(const u8* in, u64 len) {
    xxh128 h;
    if (len > 8) {
        const u64 bitflipl = xxh_secret64(32) ^ xxh_secret64(40);
        const u64 bitfliph = xxh_secret64(48) ^ xxh_secret64(56);
        const u64 input_lo = xxh_r64(in);
        u64 input_hi = xxh_r64(in + len - 8);
        xxh128 m = xxh_mul64to128(input_lo ^ input_hi ^ bitflipl, XXH_P64_1);
        m.lo += (len - 1) << 54;
        input_hi ^= bitfliph;
        m.hi += input_hi + (u64)(u32)input_hi * (XXH_P32_2 - 1);
        m.lo ^= xxh_swap64(m.hi);
        h = xxh_mul64to128(m.lo, XXH_P64_2);
        h.hi += m.hi * XXH_P64_2;
        h.lo = xxh3_avalanche(h.lo);
        h.hi = xxh3_avalanche(h.hi);
        return h;
    }
    if (len >= 4) {
        const u64 input_64 = (u64)xxh_r32(in) + ((u64)xxh_r32(in + len - 4) << 32);
        const u64 keyed = input_64 ^ (xxh_secret64(16) ^ xxh_secret64(24));
        h = xxh_mul64to128(keyed, XXH_P64_1 + (len << 2));
        h.hi += h.lo << 1;
        h.lo ^= h.hi >> 3;
        h.lo ^= h.lo >> 35;
        h.lo *= XXH_MX2;
        h.lo ^= h.lo >> 28;
        h.hi = xxh3_avalanche(h.hi);
        return h;
    }
    if (len > 0) {
        const u32 combinedl = ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24) | (u32)in[len - 1] |
                              ((u32)len << 8);
        const u32 sw = xxh_swap32(combinedl);
        const u32 combinedh = (sw << 13) | (sw >> 19);
        h.lo = xxh64_avalanche((u64)combinedl ^ (u64)(xxh_secret32(0) ^ xxh_secret32(4)));
        h.hi = xxh64_avalanche((u64)combinedh ^ (u64)(xxh_secret32(8) ^ xxh_secret32(12)));
        return h;
    }
    h.lo = xxh64_avalanche(xxh_secret64(64) ^ xxh_secret64(72));
    h.hi = xxh64_avalanche(xxh_secret64(80) ^ xxh_secret64(88));
    return h;
}

// mix32B: two 16-byte inputs into both halves.
S4_HD void xxh3_128_mix32(xxh128& acc, const u8* in1, const u8* in2, int soff) {
    acc.lo += xxh3_mix16(in1, soff);
    acc.lo ^= xxh_r64(in2) + xxh_r64(in2 + 8);
    acc.hi += xxh3_mix16(in2, soff + 16);
    acc.hi ^= xxh_r64(in1) + xxh_r64(in1 + 8);
}

S4_HD xxh128 xxh3_128_mid_finish(xxh128 acc, u64 len) {
    xxh128 h;
    h.lo = xxh3_avalanche(acc.lo + acc.hi);
    h.hi = 0 - xxh3_avalanche(acc.lo * XXH_P64_1 + acc.hi * XXH_P64_4 + len * XXH_P64_2);
    return h;
}

S4_HD xxh128 xxh3_128_len_17to128(const u8* in, u64 len) {
    xxh128 acc;
    acc.lo = len * XXH_P64_1;
    acc.hi = 0;
    for (int i = (int)((len - 1) / 32); i >= 0; i--)
        xxh3_128_mix32(acc, in + 16 * i, in + len - 16 * (i + 1), 32 * i);
    return xxh3_128_mid_finish(acc, len);
}

S4_HD xxh128 xxh3_128_len_129to240(const u8* in, u64 len) {
    xxh128 acc;
    acc.lo = len * XXH_P64_1;
    acc.hi = 0;
    for (int i = 0; i < 4; i++) xxh3_128_mix32(acc, in + 32 * i, in + 32 * i + 16, 32 * i);
    acc.lo = xxh3_avalanche(acc.lo);
    acc.hi = xxh3_avalanche(acc.hi);
    const int rounds = (int)(len / 32);
    for (int i = 4; i < rounds; i++)
        xxh3_128_mix32(acc, in + 32 * i, in + 32 * i + 16, 3 + 32 * (i - 4));
    xxh3_128_mix32(acc, in + len - 16, in + len - 32, 136 - 17 - 16);
    return xxh3_128_mid_finish(acc, len);
}

// The long form's two merges of the same accumulators.
S4_HD xxh128 xxh3_128_long_finish(const u64* acc, u64 len) {
    xxh128 h;
    h.lo = xxh3_merge_from(acc, 11, len * XXH_P64_1);
    h.hi = xxh3_merge_from(acc, XXH_SECRET_SIZE - 64 - 11, ~(len * XXH_P64_2));
    return h;
}

S4_HD xxh128 xxh3_128(const u8* in, u64 len) {
    if (len <= 16) return xxh3_128_len_0to16(in, len);
    if (len <= 128) return xxh3_128_len_17to128(in, len);
    if (len <= 240) return xxh3_128_len_129to240(in, len);
    u64 acc[8];
    xxh3_long_acc(in, len, acc);
    return xxh3_128_long_finish(acc, len);
}

// The canonical 16 bytes: hi, then lo, each big-endian (python xxhash's xxh3_128_digest).
S4_HD void xxh128_canonical(xxh128 h, u8* out) {
    for (int k = 0; k < 8; k++) {
        out[k] = (u8)(h.hi >> (56 - 8 * k));
        out[8 + k] = (u8)(h.lo >> (56 - 8 * k));
    }
}
