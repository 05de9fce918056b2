/*
 * A level's factor scale * w_l, the one number each level's dot products are
 * multiplied by, shared by the CPU kernels (through hkt_real.h's level_factor)
 * and the CUDA kernels, so every device takes the same factor.
 *
 * With both nonzero, a product below the smallest subnormal would round to 0,
 * and 0 * inf is NaN where the exact product (an inf in q or k times a nonzero
 * factor) is +-inf: such a factor is kept at the smallest subnormal of its
 * sign, so an infinite dot product stays infinite and finite ones give the 0
 * (or the subnormal) they would.  Any other factor is the plain product.
 * The scale comes as the caller's double: one below half the real type's
 * smallest subnormal rounds to 0, and the product of that 0 would be 0, where
 * the scale the caller gave is not (the rule asks of the caller's numbers).
 * (hkt.reference.level_factor is the same rule in torch.)
 */
#ifndef HKT_LEVEL_H
#define HKT_LEVEL_H

#include <float.h>

#ifndef HKT_HOST_DEVICE
#ifdef __CUDACC__
#define HKT_HOST_DEVICE __host__ __device__
#else
#define HKT_HOST_DEVICE
#endif
#endif

#define HKT_DEFINE_LEVEL_FACTOR(NAME, T, TINY)                                 \
    static HKT_HOST_DEVICE inline T NAME(double scale, T w) {                  \
        const T f = (T)scale * w;                                              \
        if (f == 0 && scale != 0 && w != 0) return (scale < 0) != (w < 0) ? -(TINY) : (TINY); \
        return f;                                                              \
    }
HKT_DEFINE_LEVEL_FACTOR(hkt_level_factor_f, float, FLT_TRUE_MIN)
HKT_DEFINE_LEVEL_FACTOR(hkt_level_factor_d, double, DBL_TRUE_MIN)
#undef HKT_DEFINE_LEVEL_FACTOR

#ifdef __cplusplus
/* the CUDA kernels are templates on the real type: one name for both */
static HKT_HOST_DEVICE inline float hkt_level_factor(double scale, float w) { return hkt_level_factor_f(scale, w); }
static HKT_HOST_DEVICE inline double hkt_level_factor(double scale, double w) { return hkt_level_factor_d(scale, w); }
#endif

#endif
