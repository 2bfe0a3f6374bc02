// rANS decode fused into the plane merge (spec/rans.md, spec/planes.md) for the bf16, fp16 and
// fp32 layouts: one warp per block of a tensor's elements decodes the block of each of the
// tensor's rANS planes (one state per lane and plane, all planes in step, row by row from the
// last), reads its other planes in place, and writes the merged words straight into the
// destination. No decoded plane ever goes to memory: against rans_decode + merge this saves a
// write and a read of every rANS plane and the device memory that held it.
//
// A tensor goes this way when every plane is raw, bitpack (sign only) or rans, and its streams
// in RANS mode (at most FUSED_TABLES of them) share one log2_block: its element blocks are then
// exactly their blocks. Each plane has a kind:
//   BYTES  plane byte of element e is ptr[e >> shift]: a raw plane or a RAW-mode stream's bytes
//          (shift 0), or a CONST stream's fill bytes (shift = its log2_block);
//   BITS   the bitpack sign plane: bit e % 8 of ptr[e / 8];
//   RANS   a RANS-mode stream: block j's 32 final states at ptr + 128 j, its words and count per
//          block in the block table, its decoder table in shared memory slot ``tab``.
//
// Tables (built by the host, s4weights/gpu/fused.py), T tensors, NB element blocks:
//   per tensor:        t_out (destination address), t_n (elements), t_first (first block),
//                      t_lb (log2 of the block size), t_cum[2] (frequency prefix sums, u32[256],
//                      per table slot; 0 if unused)
//   per tensor plane:  tp_kind, tp_shift, tp_tab, tp_ptr   (T x 5: sign, then layout order)
//   per block:         blk_tensor; per block plane: bp_words (address), bp_count (T x 5 -> NB x 5)
// Errors: blk_err[b] = code | plane << 8 for the first failing rANS plane of block b (codes as
// rans_decode: 1 state out of range, 2 word underflow, 3 words left over, 4 wrong final state);
// t_err[t] = 1 when a plane byte has bits outside its field (spec: merge MUST reject those).
#include "common.cuh"
#include "layouts.cuh"
#include "ransdec.cuh"

#define FUSED_WARPS 8
#define FUSED_TABLES 2
#define K_BYTES 0
#define K_BITS 1
#define K_RANS 2

// A block's state: per plane, either a rANS lane (x, p words left, words, table offset) or a
// byte source read as (src[e >> sh] >> (e & bsel)) & bm (BYTES: bsel 0, bm 0xFF; BITS: sh 3,
// bsel 7, bm 1), so the two memory kinds take no branch.
template <int NK> struct BlockState {
    bool rans[NK];
    const u8* src[NK];
    const u16* words[NK];
    u32 x[NK], p[NK], toff[NK], sh[NK], bsel[NK], bm[NK];
};

// One row of a block (row r, elements r*32 + lane): every plane's byte, merged and stored.
// FULL rows have all 32 lanes active. Returns the error (2 | plane << 8 on a word underflow,
// the same in every lane), else 0; ``bad`` collects bits outside the fields.
template <int L, bool FULL>
__device__ __forceinline__ int fused_row(BlockState<Lay<L>::NP + 1>& s, const u32* dtab, int r,
                                         u32 len, i64 start, typename Lay<L>::W* out, u32 lt,
                                         u32& bad) {
    typedef typename Lay<L>::W W;
    constexpr int NK = Lay<L>::NP + 1;
    constexpr int TOP = 8 * sizeof(W) - 1;
    const u32 i = ((u32)r << 5) + (threadIdx.x & 31);
    const bool active = FULL || i < len;
    const u64 e = (u64)start + i;
    u32 w = 0;
    int err = 0;
#pragma unroll
    for (int k = 0; k < NK; k++) {
        u32 v = 0;
        if (s.rans[k]) {
            bool need = false;
            if (active) {
                v = rans_step(s.x[k], dtab[s.toff[k] + (s.x[k] & (RANS_M - 1))]);
                need = s.x[k] < RANS_L;
            }
            if (!rans_refill(s.x[k], s.p[k], need, s.words[k], lt) && !err) err = 2 | (k << 8);
        } else if (active) {
            v = ((u32)__ldg(s.src[k] + (e >> s.sh[k])) >> ((u32)e & s.bsel[k])) & s.bm[k];
        }
        bad |= v & ~(k == 0 ? 1u : Lay<L>::mask(k - 1));
        w |= v << (k == 0 ? TOP : Lay<L>::shift(k - 1));
    }
    if (!err && active) out[i] = (W)w;
    return err;
}

template <int L>
__device__ void fused_impl(const u32* cta_first, const u8* cta_warps, const u32* blk_tensor,
                           const u64* t_out, const i64* t_n, const u32* t_first, const u8* t_lb,
                           const u64* t_cum, const u8* tp_kind, const u8* tp_shift,
                           const u8* tp_tab, const u64* tp_ptr, const u64* bp_words,
                           const u32* bp_count, int* blk_err, int* t_err) {
    typedef typename Lay<L>::W W;
    constexpr int NK = Lay<L>::NP + 1;        // planes: sign, then the layout's byte planes
    __shared__ u32 dtab[FUSED_TABLES * RANS_M];
    __shared__ u32 cum[257];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 b0 = cta_first[blockIdx.x];
    const u32 t = blk_tensor[b0];             // every block of a CTA is of one tensor
    for (int k = 0; k < FUSED_TABLES; k++) {
        const u32* g = (const u32*)t_cum[FUSED_TABLES * t + k];
        if (g) build_dtab(g, cum, dtab + k * RANS_M);
    }
    if (warp >= cta_warps[blockIdx.x]) return;
    const u32 b = b0 + warp;
    const int lb = t_lb[t];
    const u64 j = b - t_first[t];
    const i64 start = (i64)(j << lb);
    const i64 rest = t_n[t] - start;
    const u32 len = rest < ((i64)1 << lb) ? (u32)rest : (1u << lb);
    W* out = (W*)t_out[t] + start;
    const u32 lt = lanemask_lt();

    BlockState<NK> s;
    int err = 0;
#pragma unroll
    for (int k = 0; k < NK; k++) {
        const u64 q = (u64)t * 5 + k, qb = (u64)b * 5 + k;
        const int kind = tp_kind[q];
        s.rans[k] = kind == K_RANS;
        s.src[k] = (const u8*)tp_ptr[q];
        s.sh[k] = kind == K_BITS ? 3 : tp_shift[q];
        s.bsel[k] = kind == K_BITS ? 7 : 0;
        s.bm[k] = kind == K_BITS ? 1 : 0xFF;
        s.toff[k] = (tp_tab[q] % FUSED_TABLES) * RANS_M;
        s.words[k] = (const u16*)bp_words[qb];
        s.p[k] = bp_count[qb];
        s.x[k] = RANS_L;
        if (s.rans[k]) {
            s.x[k] = ((const u32*)(s.src[k] + 128 * j))[lane];
            const bool out_of_range = s.x[k] < RANS_L || s.x[k] >= (1u << 31);
            if (__any_sync(0xFFFFFFFFu, out_of_range) && !err) err = 1 | (k << 8);
        }
    }
    if (err) {
        if (lane == 0) blk_err[b] = err;
        return;
    }
    // rows from the last down to the first: a partial last row, then full rows
    u32 bad = 0;
    int r = (int)((len + 31) >> 5) - 1;
    if (len & 31) err = fused_row<L, false>(s, dtab, r--, len, start, out, lt, bad);
#pragma unroll 2
    for (; r >= 0 && !err; r--) err = fused_row<L, true>(s, dtab, r, len, start, out, lt, bad);
#pragma unroll
    for (int k = 0; k < NK; k++) {
        if (!s.rans[k] || err) continue;
        if (s.p[k] != 0) err = 3 | (k << 8);
        else if (__any_sync(0xFFFFFFFFu, s.x[k] != RANS_L)) err = 4 | (k << 8);
    }
    if (lane == 0 && err) blk_err[b] = err;
    if (__any_sync(0xFFFFFFFFu, bad != 0) && lane == 0) atomicExch(&t_err[t], 1);
}

#define S4_FUSED(L, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(FUSED_WARPS * 32) NAME(                       \
        const u32* cf, const u8* cw, const u32* bt, const u64* to, const i64* tn,              \
        const u32* tf, const u8* tl, const u64* tc, const u8* pk, const u8* ps, const u8* pt,  \
        const u64* pp, const u64* bw, const u32* bc, int* be, int* te) {                       \
        fused_impl<L>(cf, cw, bt, to, tn, tf, tl, tc, pk, ps, pt, pp, bw, bc, be, te);         \
    }
S4_FUSED(1, decode_merge_bf16)
S4_FUSED(2, decode_merge_fp16)
S4_FUSED(3, decode_merge_fp32)
