/* e^x on 16 fp32 lanes, shared by tree_attention.c (softmax) and decoder_layer.c (SwiGLU). */
#ifndef PARDEC_VECTOR_MATH_H
#define PARDEC_VECTOR_MATH_H

#include <stdint.h>

typedef float f32x16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4), may_alias));

/* Every lane x: one broadcast ((f32x16){0} + x would be an add too, since 0 + -0 is +0). */
static inline f32x16 splat16(float x) { return (f32x16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* e^x: x = n ln2 + r, |r| <= ln2/2; e^r by its degree-6 Taylor polynomial (within 2.8 ulp of exp
 * over [-87, 0], measured at 32M points); 2^n goes into the exponent. x is clamped to [-87, 88],
 * which keeps 2^n a normal float: below -87 the result (< 2e-38) stops there instead of reaching
 * denormals, above 88 at ~1.7e38. Lane by lane, so a lane's result never depends on the others. */
static inline f32x16 vexp16(f32x16 x) {
    const f32x16 lowest = splat16(-87.0f), highest = splat16(88.0f);
    i32x16 below = x < lowest, above = x > highest;
    x = (f32x16)(((i32x16)x & ~below) | ((i32x16)lowest & below));
    x = (f32x16)(((i32x16)x & ~above) | ((i32x16)highest & above));
    const f32x16 round_magic = splat16(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    f32x16 n = (x * splat16(1.44269504f) + round_magic) - round_magic;
    f32x16 r = x - n * splat16(0.693145752f); /* ln2 in two parts: the first product is exact */
    r = r - n * splat16(1.42860677e-06f);
    f32x16 p = splat16(1.0f / 720.0f);
    p = p * r + splat16(1.0f / 120.0f);
    p = p * r + splat16(1.0f / 24.0f);
    p = p * r + splat16(1.0f / 6.0f);
    p = p * r + splat16(0.5f);
    p = p * r + splat16(1.0f);
    p = p * r + splat16(1.0f);
    i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
    return p * (f32x16)exponent;
}

#endif
