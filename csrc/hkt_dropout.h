/*
 * The dropout decision, shared by the CPU and CUDA kernels so both drop the same
 * entries for the same seed.  Counter-based: entry (b, h, i, j) is kept when
 *
 *   mix64(mix64(seed) + index * golden) >> 11  >=  p * 2^53,
 *   index = ((b * H + h) * T + i) * S + j,
 *
 * so forward, backward and any thread order see the same mask.
 */
#ifndef HKT_DROPOUT_H
#define HKT_DROPOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define HKT_HOST_DEVICE __host__ __device__
#else
#define HKT_HOST_DEVICE
#endif

/* splitmix64's finaliser */
static HKT_HOST_DEVICE inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static HKT_HOST_DEVICE inline uint64_t keep_threshold(double p) {
    if (p <= 0.0) return 0;
    if (p >= 1.0) return (uint64_t)1 << 53;
    return (uint64_t)(p * 9007199254740992.0); /* p * 2^53 */
}

/* What a kept entry is multiplied by: 1 / (1 - p), and 0 when everything is dropped. */
static HKT_HOST_DEVICE inline double keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

static HKT_HOST_DEVICE inline int keep_entry(uint64_t seed_mixed, uint64_t threshold, uint64_t index) {
    return (mix64(seed_mixed + index * 0x9e3779b97f4a7c15ULL) >> 11) >= threshold;
}

#endif
