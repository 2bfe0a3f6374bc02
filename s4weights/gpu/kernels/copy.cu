// Batched copies: op i copies len[i] bytes from src[i] to dst[i], one CTA per op, with 16-byte
// stores (the source read by aligned words and funnel shifts where the ends are misaligned).
// The host assembles every stored payload from pieces with it (stream headers and tables, rANS
// counts and states, GDeflate page tables and pages, raw planes) into one compacted buffer per
// group; rans_place lays the rANS blocks' words out, where only the device knows their sizes.
#include "packing.cuh"

template <typename T>
__device__ __forceinline__ void copy_as(const u8* s, u8* d, u64 n) {
    const u64 k = n / sizeof(T);
    for (u64 i = threadIdx.x; i < k; i += blockDim.x) ((T*)d)[i] = ((const T*)s)[i];
}

// n bytes from s to d by the CTA
__device__ void copy_bytes(const u8* s, u8* d, u64 n) {
    if ((((u64)s | (u64)d | n) & 15) == 0) {
        copy_as<uint4>(s, d, n);
        return;
    }
    // Misaligned ends (rANS word runs land at 2-byte offsets): bytes up to the first 16-byte
    // boundary of the destination, then 16-byte stores built from aligned 4-byte loads of the
    // source by funnel shifts, then the tail bytes.
    u64 head = (16 - ((u64)d & 15)) & 15;
    if (head > n) head = n;
    for (u64 i = threadIdx.x; i < head; i += blockDim.x) d[i] = s[i];
    s += head;
    d += head;
    n -= head;
    const u64 body = n & ~(u64)15;
    for (u64 i = threadIdx.x; i < n - body; i += blockDim.x) d[body + i] = s[body + i];
    const u64 k = body >> 4;
    uint4* out = (uint4*)d;
    if (((u64)s & 15) == 0) {
        for (u64 i = threadIdx.x; i < k; i += blockDim.x) out[i] = ((const uint4*)s)[i];
        return;
    }
    const u32* w = (const u32*)((u64)s & ~(u64)3);
    const u32 sh = (u32)((u64)s & 3) * 8;
    if (sh == 0) {
        for (u64 i = threadIdx.x; i < k; i += blockDim.x)
            out[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
        return;
    }
    // sh != 0: word 4k still holds needed bytes, so no load runs past the source's end
    for (u64 i = threadIdx.x; i < k; i += blockDim.x) {
        const u32 a0 = w[4 * i], a1 = w[4 * i + 1], a2 = w[4 * i + 2], a3 = w[4 * i + 3],
                  a4 = w[4 * i + 4];
        out[i] = make_uint4(__funnelshift_r(a0, a1, sh), __funnelshift_r(a1, a2, sh),
                            __funnelshift_r(a2, a3, sh), __funnelshift_r(a3, a4, sh));
    }
}

extern "C" __global__ void copy_ops(const u64* src, const u64* dst, const u64* len) {
    copy_bytes((const u8*)src[blockIdx.x], (u8*)dst[blockIdx.x], len[blockIdx.x]);
}

// The words of rANS block b (one CTA each; a stream's blocks are consecutive): count[b] u16
// words from the encoder's scratch to the word section of its job's stream, which starts at
// words[job]: after the words of the job's blocks before b. Job j owns blocks first[j] ..
// first[j + 1] - 1 and its scratch starts at scratch[j], block b's words boff[b] words into it
// (rans_encode's region); excl[b] is the exclusive prefix sum of count over the launch's
// blocks. A job whose stream is not in RANS mode (CONST, or stored raw) has words[j] = 0:
// nothing is copied. cap, where not 0, is the bytes each job's destination holds: a block
// whose words would end past it is not copied (the chunked encoder gathers a chunk's words
// into a slot smaller than the most they can take; the host sees the counts and codes again).
extern "C" __global__ void rans_place(int njobs, const i64* first, const u64* scratch,
                                      const u64* words, const u64* boff, const u32* count,
                                      const i64* excl, u64 cap) {
    const i64 b = blockIdx.x;
    int lo = 0, hi = njobs - 1;  // the job whose blocks include b
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= b) lo = mid; else hi = mid - 1;
    }
    if (words[lo] == 0) return;
    const u64 at = 2 * (u64)(excl[b] - excl[first[lo]]);
    if (cap != 0 && at + 2 * (u64)count[b] > cap) return;
    const u8* src = (const u8*)scratch[lo] + 2 * boff[b];
    copy_bytes(src, (u8*)words[lo] + at, 2 * (u64)count[b]);
}

// Bitpack-w (codec 8): op i packs n[i] plane values at src[i] into w[i] bits each at dst[i],
// one CTA per op (``runtime.pack_ops`` cuts long planes into pieces of whole 8-byte groups).
// Eight values become w stored bytes, the little-endian integer sum(b_j << (w * j)); a last
// group of m < 8 values stores ceil(m * w / 8) bytes, its unused high bits 0; w = 8 stores the
// bytes as they are. The source holds a byte per value (sw[i] = 8) or is itself packed at
// sw[i] bits (a plane the split stored packed, repacked narrower or to bytes). A warp packs 32
// groups (one 8-byte load per lane) into shared memory, then stores their 32 w bytes as 4-byte
// words (the destination 4-aligned, as payloads are) or, at the end, byte by byte.
#define PACK_WARPS 8
extern "C" __global__ void __launch_bounds__(32 * PACK_WARPS)
pack_ops(const u64* src, const u64* dst, const u64* n, const u8* w, const u8* sw) {
    __shared__ __align__(16) u8 stage[PACK_WARPS][32 * 8];
    const u8* s = (const u8*)src[blockIdx.x];
    u8* d = (u8*)dst[blockIdx.x];
    const u64 len = n[blockIdx.x];
    const u32 wd = w[blockIdx.x], ws = sw[blockIdx.x];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool vec = ((u64)s & 7) == 0, words = ((u64)d & 3) == 0;
    u8* st = stage[warp];
    for (u64 g0 = 32 * (u64)warp; 8 * g0 < len; g0 += 32 * PACK_WARPS) {
        const u64 g = g0 + lane;
        const u64 left = 8 * g < len ? len - 8 * g : 0;
        const u32 m = left < 8 ? (u32)left : 8;
        u64 v = 0;
        if (ws < 8) {
            if (m) v = unpack8(s, 8 * g, m, ws);
        } else if (m == 8 && vec) {
            v = ((const u64*)s)[g];
        } else {
            for (u32 j = 0; j < m; j++) v |= (u64)s[8 * g + j] << (8 * j);
        }
        u64 acc = 0;
        for (u32 j = 0; j < 8; j++) acc |= ((v >> (8 * j)) & 0xFFu) << (wd * j);
        for (u32 b = 0; b < wd; b++) st[lane * wd + b] = (u8)(acc >> (8 * b));
        __syncwarp();
        const u64 rest = len - 8 * g0;  // plane bytes from this round on
        u8* o = d + g0 * wd;
        if (rest >= 256 && words) {
            for (u32 i = lane; i < 8 * wd; i += 32) ((u32*)o)[i] = ((const u32*)st)[i];
        } else {
            const u32 nb = rest >= 256 ? 32 * wd : (u32)((rest * wd + 7) / 8);
            for (u32 i = lane; i < nb; i += 32) o[i] = st[i];
        }
        __syncwarp();
    }
}
