// The split layouts of spec/planes.md as the plane kernels see them (planes.cu, fused.cu):
// Lay<L>::W is the word, NP the byte planes besides the sign, and plane k (0-based, after the
// sign) holds bits [shift(k), shift(k) + width) of the word, width = popcount(mask(k)).
#pragma once
#include "common.cuh"

template <int L> struct Lay;
// bf16: sign 15 | exponent 14-7 | mantissa0 6-0
template <> struct Lay<1> {
    typedef u16 W;
    static constexpr int NP = 2;
    static __device__ __forceinline__ int shift(int k) { return k == 0 ? 7 : 0; }
    static __device__ __forceinline__ u32 mask(int k) { return k == 0 ? 0xFFu : 0x7Fu; }
};
// fp16: sign 15 | exponent 14-10 | mantissa0 9-8 | mantissa1 7-0
template <> struct Lay<2> {
    typedef u16 W;
    static constexpr int NP = 3;
    static __device__ __forceinline__ int shift(int k) { return k == 0 ? 10 : (k == 1 ? 8 : 0); }
    static __device__ __forceinline__ u32 mask(int k) { return k == 0 ? 0x1Fu : (k == 1 ? 0x3u : 0xFFu); }
};
// fp32: sign 31 | exponent 30-23 | mantissa0 22-16 | mantissa1 15-8 | mantissa2 7-0
template <> struct Lay<3> {
    typedef u32 W;
    static constexpr int NP = 4;
    static __device__ __forceinline__ int shift(int k) { return k == 0 ? 23 : (k == 1 ? 16 : (k == 2 ? 8 : 0)); }
    static __device__ __forceinline__ u32 mask(int k) { return k == 0 ? 0xFFu : (k == 1 ? 0x7Fu : 0xFFu); }
};
