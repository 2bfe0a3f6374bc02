// Shared by every kernel source of s4weights.gpu: fixed-width integer names (NVRTC has no
// <cstdint> by default) and the host/device qualifier, so headers compile as plain C++ too
// (tests build them with nvcc as host code and compare against the Python reference).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define S4_HD __host__ __device__ __forceinline__
#else
#define S4_HD inline
#endif
