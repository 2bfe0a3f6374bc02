// Batched copies: op i copies len[i] bytes from src[i] to dst[i], one CTA per op, with the
// widest access the alignment of both ends and the length allow. The host assembles every
// stored payload from pieces with it (stream headers and tables, rANS counts, states and words,
// GDeflate page tables and pages, raw planes) into one compacted buffer per group.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void copy_as(const u8* s, u8* d, u64 n) {
    const u64 k = n / sizeof(T);
    for (u64 i = threadIdx.x; i < k; i += blockDim.x) ((T*)d)[i] = ((const T*)s)[i];
}

extern "C" __global__ void copy_ops(const u64* src, const u64* dst, const u64* len) {
    const u8* s = (const u8*)src[blockIdx.x];
    u8* d = (u8*)dst[blockIdx.x];
    const u64 n = len[blockIdx.x];
    const u64 a = (u64)s | (u64)d | n;
    if ((a & 15) == 0) copy_as<uint4>(s, d, n);
    else if ((a & 7) == 0) copy_as<u64>(s, d, n);
    else if ((a & 3) == 0) copy_as<u32>(s, d, n);
    else if ((a & 1) == 0) copy_as<u16>(s, d, n);
    else copy_as<u8>(s, d, n);
}
