/* The vector exp of one instruction-set build (exp_nonpos_vec, hkt_real.h)
 * against the scalar exp_nonpos of the same build on float bit patterns, and
 * its unclamped form (exp_nonpos_vec_le0) on the patterns it takes, those <= 0
 * or NaN: every
 * `step`-th of the 2^32 (step 1: all of them) and the special values.  Built by
 * tests/kernels/test_exp_lanes.py with -DHKT_ISA_AVX2 or -DHKT_ISA_AVX512; prints the
 * count checked and the count that differ (NaN against NaN counts as equal),
 * and exits 1 on a difference. */
#include "hkt_isa.h"

#include <stdio.h>
#include <stdlib.h>

typedef float real;
#define REAL_IS_FLOAT 1
#include "hkt_real.h"

#if !HKT_EXPV
#error "this build has no vector exp"
#endif

static long long differ;

static void check(const uint32_t *bits) {
    real x[VL], y[VL], y0[VL];
    memcpy(x, bits, sizeof x);
    const vec v = exp_nonpos_vec(vload(x)), v0 = exp_nonpos_vec_le0(vload(x));
    memcpy(y, &v, sizeof y);
    memcpy(y0, &v0, sizeof y0);
    for (int i = 0; i < VL; i++) {
        const float want = exp_nonpos(x[i]);
        for (int form = 0; form < 2; form++) {
            const float got = form ? y0[i] : y[i];
            if (form && !(x[i] <= 0 || x[i] != x[i])) continue; /* not the unclamped form's input */
            uint32_t a, b;
            memcpy(&a, &got, 4);
            memcpy(&b, &want, 4);
            if (a != b && !(got != got && want != want)) {
                if (differ < 5)
                    printf("x=%a (0x%08x): lanes%s %a, scalar %a\n", x[i], bits[i], form ? " (unclamped)" : "", got,
                           want);
                differ++;
            }
        }
    }
}

int main(int argc, char **argv) {
    const uint64_t step = argc > 1 ? strtoull(argv[1], NULL, 10) : 1;
    static const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                                       0x7f800001u, 0xc2ae0000u /* -87 */, 0xc2ae0001u, 0xc2adffffu, 0x00000001u,
                                       0x80000001u, 0x007fffffu, 0x807fffffu, 0xbf800000u, 0x3f800000u};
    uint32_t lane[VL];
    long long n = 0;
    int k = 0;
    for (size_t s = 0; s < sizeof special / sizeof special[0]; s++) {
        lane[k++] = special[s];
        if (k == VL) { check(lane); k = 0; }
        n++;
    }
    for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += step) {
        lane[k++] = (uint32_t)u;
        if (k == VL) { check(lane); k = 0; }
        n++;
    }
    while (k > 0 && k < VL) lane[k++] = 0;
    if (k) check(lane);
    printf("%lld checked, %lld differ\n", n, differ);
    return differ != 0;
}
HKT_ISA_END /* clang's end of the instruction set (hkt_isa.h) */
