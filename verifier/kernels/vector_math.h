/* e^x on 16 fp32 lanes, shared by tree_attention.c (softmax) and decoder_layer.c (SwiGLU). */
#ifndef PARDEC_VECTOR_MATH_H
#define PARDEC_VECTOR_MATH_H

#include <stdint.h>

/* Values in registers have the vectors' natural alignment; memory is read and written through
 * load16/store16 (load8/store8), which assume only a float's. A value type aligned to 4 made GCC
 * keep AVX2's halves of a 16-lane vector on the stack and move them through general registers. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef float f32x8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

static inline f32x16 load16(const float *p) { return *(const f32x16_unaligned *)p; }
static inline void store16(float *p, f32x16 v) { *(f32x16_unaligned *)p = v; }
static inline f32x8 load8(const float *p) { return *(const f32x8_unaligned *)p; }
static inline void store8(float *p, f32x8 v) { *(f32x8_unaligned *)p = v; }

/* Every lane x: one broadcast ((f32x16){0} + x would be an add too, since 0 + -0 is +0). */
static inline f32x16 splat16(float x) { return (f32x16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline f32x8 splat8(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }

/* e^x: x = n ln2 + r, |r| <= ln2/2; e^r by its degree-6 Taylor polynomial (within 2.8 ulp of exp
 * over [-87, 0], measured at 32M points); 2^n goes into the exponent. x is clamped to [-87, 88],
 * which keeps 2^n a normal float: below -87 the result (< 2e-38) stops there instead of reaching
 * denormals, above 88 at ~1.7e38. Lane by lane, so a lane's result never depends on the others,
 * nor on how many lanes the vector has: vexp8 and vexp16 give the same bits. */
#define DEFINE_VEXP(name, F, I, splat)                                                               \
    static inline F name(F x) {                                                                     \
        const F lowest = splat(-87.0f), highest = splat(88.0f);                                     \
        I below = x < lowest, above = x > highest;                                                  \
        x = (F)(((I)x & ~below) | ((I)lowest & below));                                             \
        x = (F)(((I)x & ~above) | ((I)highest & above));                                            \
        const F round_magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */  \
        F n = (x * splat(1.44269504f) + round_magic) - round_magic;                                 \
        F r = x - n * splat(0.693145752f); /* ln2 in two parts: the first product is exact */       \
        r = r - n * splat(1.42860677e-06f);                                                         \
        F p = splat(1.0f / 720.0f);                                                                 \
        p = p * r + splat(1.0f / 120.0f);                                                           \
        p = p * r + splat(1.0f / 24.0f);                                                            \
        p = p * r + splat(1.0f / 6.0f);                                                             \
        p = p * r + splat(0.5f);                                                                    \
        p = p * r + splat(1.0f);                                                                    \
        p = p * r + splat(1.0f);                                                                    \
        I exponent = (__builtin_convertvector(n, I) + 127) << 23;                                   \
        return p * (F)exponent;                                                                     \
    }
DEFINE_VEXP(vexp16, f32x16, i32x16, splat16)
DEFINE_VEXP(vexp8, f32x8, i32x8, splat8)

#endif
