// Host harness for s4weights/gpu/kernels/xxh3.cuh, built by test_xxh3_host.py with nvcc as
// plain host code. stdin: u64 count, then per input u64 length + bytes. stdout per input: the
// scalar XXH3-64 and the warp-cooperative long form emulated lane by lane, then the scalar
// XXH3-128 and the long form's 128-bit finish from the emulated accumulators (canonical), in hex.
#include <cstdio>
#include <vector>
#include "xxh3.cuh"

// Lane-by-lane emulation of xxh3_long_warp (hash.cu): 32 lanes, lanes 8g + i sum stripes
// g, g + 4, ... for accumulator i; the shuffle reductions become sums over g.
static void long_emulated(const u8* in, u64 len, u64* acc) {
    xxh3_acc_init(acc);
    const u64 nb = xxh3_full_blocks(len);
    for (u64 b = 0; b < nb; b++) {
        for (int i = 0; i < 8; i++) {
            u64 sum = 0;
            for (int g = 0; g < 4; g++)
                for (int s = g; s < XXH_STRIPES_PER_BLOCK; s += 4)
                    sum += xxh3_stripe_lane(in + b * XXH_BLOCK + s * XXH_STRIPE, 8 * s, i);
            acc[i] = xxh3_scramble_lane(acc[i] + sum, i);
        }
    }
    const int ts = xxh3_tail_stripes(len);
    for (int i = 0; i < 8; i++) {
        u64 sum = 0;
        for (int g = 0; g < 4; g++)
            for (int s = g; s < ts; s += 4)
                sum += xxh3_stripe_lane(in + nb * XXH_BLOCK + s * XXH_STRIPE, 8 * s, i);
        acc[i] += sum + xxh3_stripe_lane(in + len - XXH_STRIPE, XXH_LAST_STRIPE_SOFF, i);
    }
}

static void hex16(xxh128 h) {
    u8 c[16];
    xxh128_canonical(h, c);
    for (int k = 0; k < 16; k++) printf("%02x", c[k]);
}

int main() {
    u64 count = 0;
    if (fread(&count, 8, 1, stdin) != 1) return 2;
    for (u64 k = 0; k < count; k++) {
        u64 len = 0;
        if (fread(&len, 8, 1, stdin) != 1) return 2;
        std::vector<u8> buf(len + 1);
        if (len && fread(buf.data(), 1, len, stdin) != len) return 2;
        const u64 a = xxh3_64(buf.data(), len);
        const xxh128 c = xxh3_128(buf.data(), len);
        u64 b = a;
        xxh128 d = c;
        if (len > 240) {
            u64 acc[8];
            long_emulated(buf.data(), len, acc);
            b = xxh3_merge(acc, len);
            d = xxh3_128_long_finish(acc, len);
        }
        printf("%016llx %016llx ", a, b);
        hex16(c);
        printf(" ");
        hex16(d);
        printf("\n");
    }
    return 0;
}
