/* W8A8 linear layer on CPU: per-row int8 quantization of the activations, an exact int32 GEMM
 * against prepacked int8 weights, and the scales applied in fp32 (see native_linear.py).
 *
 * Every step is per row and exact or order-free: the row's max-abs, one IEEE division and
 * round-half-even per value, integer sums (exact in any order), then ((sum * row scale) * channel
 * scale) + bias, the same rounding steps as the torch path (quant.py) takes, so both give the
 * same bits. Built with -ffp-contract=off: no FMA may merge those products and sums.
 *
 * Packed weights: tiles of 64 output channels, each one stream of bytes: for every 4 inputs k4,
 * four 64-byte vectors (channels 0-15, 16-31, 32-47, 48-63 of the tile), each holding
 * w[channel 0][4k4 .. 4k4+3], w[channel 1][4k4 ..], ..., w[channel 15][...]: the operand layout
 * of AVX512-VNNI's vpdpbusd, which adds four u8 x s8 products into each of 16 int32 lanes. The
 * activations go in as u8 (x + 128); `correction` = 128 * sum_k w[n][k] takes the offset back out.
 * The AVX2 build reads the same 64-byte vectors with each tile's four blocks of 16 channels one
 * after another instead of interleaved (BLOCKS_CONTIGUOUS; w8a8_blocks_contiguous tells
 * native_linear.pack), each vector as two 32-byte halves of 8 channels: vpmaddubsw
 * multiplies u8 x s8 pairs into saturating int16 sums, which u8 activations (up to 255 x 127
 * twice) would overflow, so it multiplies |w| by x carrying w's sign (x the signed activation,
 * which this build's quantization writes as s8: Q_OFFSET is 0): each pair is at most
 * 2 x 128 x 127 = 32512, exact, and vpmaddwd adds the pairs into int32 lanes. Those sums have no
 * offset in them (OFFSET_IN_SUMS is 0).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#ifdef HAVE_AVX2
#define Q_OFFSET 0   /* the quantized activations are s8 x (AVX2 multiplies signed x) */
#else
#define Q_OFFSET 128 /* they are u8 x + 128, vpdpbusd's unsigned operand (portable code: the same) */
#endif

#define CHANNELS 16     /* output channels per packed block */
/* A pass of the GEMM: up to ROW_TILE rows x BLOCK_TILE vectors of 16 channels (a 64-channel
 * tile), 16 int32 accumulators; each weight vector loaded feeds ROW_TILE dot products and each
 * broadcast row value BLOCK_TILE. Measured here against 8 x 2 and 16 x 1, no slower with 1..64
 * rows: those load more per dot product. The packed weights are padded to whole tiles. */
#define ROW_TILE 4
#define BLOCK_TILE 4 /* native_linear.TILE_CHANNELS / CHANNELS */

/* q[k] = round_half_even(x[k] / scale) + Q_OFFSET as a byte, scale = max|x| / 127 (at least FLT_MIN). */
static float quantize_row_f32(const float *x, int64_t n, int64_t padded, uint8_t *q) {
    /* The max of |x| is exact in any order: 16 lanes, then across them (fmaxf was a libm call). */
    f32x16 lanes = splat16(0.0f);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        f32x16 magnitude = (f32x16)((i32x16)load16(x + k) & 0x7fffffff);
        i32x16 larger = magnitude > lanes;
        lanes = (f32x16)(((i32x16)magnitude & larger) | ((i32x16)lanes & ~larger));
    }
    float amax = 0.0f;
    for (int j = 0; j < 16; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    for (; k < n; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    float scale = amax / 127.0f;
    if (!(scale >= 1.17549435e-38f)) scale = 1.17549435e-38f;
    for (int64_t k = 0; k < n; k++) q[k] = (uint8_t)((int32_t)nearbyintf(x[k] / scale) + Q_OFFSET);
    memset(q + n, Q_OFFSET, (size_t)(padded - n));
    return scale;
}

/* x[0 .. n) times blockdiag(H, H, ...), H Sylvester's unnormalized Hadamard matrix of size block,
 * in place: quant.block_hadamard's butterflies (a, b) -> (a + b, a - b), the same adds and
 * subtracts of the same operands (a + b and b + a are the same IEEE sum). Butterflies closer than
 * a vector's lanes run inside one: each lane meets its partner i ^ half by a shuffle with a
 * constant mask, the lower lane keeping a + b and the upper a - b. The masks are literals (with a
 * mask built at run time GCC shuffled lane by lane, an order of magnitude slower; figures in
 * docs/benchmarks.md), and AVX2 works in 8-lane vectors. */
#ifdef __AVX512F__
#define HADAMARD_LANES 16
typedef f32x16 hadamard_f32;
typedef i32x16 hadamard_i32;
#define hadamard_load load16
#define hadamard_store store16
#define HADAMARD_IOTA {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#else
#define HADAMARD_LANES 8
typedef f32x8 hadamard_f32;
typedef i32x8 hadamard_i32;
#define hadamard_load load8
#define hadamard_store store8
#define HADAMARD_IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#endif
static inline void hadamard_in_vector(float *x, int64_t n, hadamard_i32 partner) {
    const hadamard_i32 upper = partner < (hadamard_i32)HADAMARD_IOTA;
    for (int64_t i = 0; i < n; i += HADAMARD_LANES) {
        hadamard_f32 v = hadamard_load(x + i), p = __builtin_shuffle(v, partner);
        hadamard_f32 sum = v + p, difference = p - v;
        hadamard_store(x + i, (hadamard_f32)(((hadamard_i32)sum & ~upper) | ((hadamard_i32)difference & upper)));
    }
}

static void block_hadamard(float *x, int64_t n, int64_t block) {
    int64_t half = 1;
    if (block % HADAMARD_LANES == 0) {
#ifdef __AVX512F__
        hadamard_in_vector(x, n, (i32x16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
        hadamard_in_vector(x, n, (i32x16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
        hadamard_in_vector(x, n, (i32x16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
        hadamard_in_vector(x, n, (i32x16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#else
        hadamard_in_vector(x, n, (i32x8){1, 0, 3, 2, 5, 4, 7, 6});
        hadamard_in_vector(x, n, (i32x8){2, 3, 0, 1, 6, 7, 4, 5});
        hadamard_in_vector(x, n, (i32x8){4, 5, 6, 7, 0, 1, 2, 3});
#endif
        for (half = HADAMARD_LANES; half < block; half *= 2)
            for (int64_t group = 0; group < n; group += 2 * half)
                for (int64_t i = group; i < group + half; i += HADAMARD_LANES) {
                    hadamard_f32 a = hadamard_load(x + i), b = hadamard_load(x + i + half);
                    hadamard_store(x + i, a + b);
                    hadamard_store(x + i + half, a - b);
                }
        return;
    }
    for (; half < block; half *= 2)
        for (int64_t group = 0; group < n; group += 2 * half)
            for (int64_t i = group; i < group + half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a + b;
                x[i + half] = a - b;
            }
}

/* The fp64 input (attention computed in fp64) is quantized in fp64, its scale rounded to fp32. */
static float quantize_row_f64(const double *x, int64_t n, int64_t padded, uint8_t *q) {
    double amax = 0.0;
    for (int64_t k = 0; k < n; k++) amax = fmax(amax, fabs(x[k]));
    float scale = (float)(amax / 127.0);
    if (!(scale >= 1.17549435e-38f)) scale = 1.17549435e-38f;
    for (int64_t k = 0; k < n; k++) q[k] = (uint8_t)((int32_t)nearbyint(x[k] / (double)scale) + Q_OFFSET);
    memset(q + n, Q_OFFSET, (size_t)(padded - n));
    return scale;
}

#ifdef HAVE_VNNI
#define OFFSET_IN_SUMS 1 /* the sums are of (x + 128) * w: finish subtracts `correction` */
#else
#define OFFSET_IN_SUMS 0
#endif

/* out[c] = (((float)(sums[c] - correction[c]) * row_scale) * weight_scale[c]) + bias[c] for the
 * first min(count, CHANNELS) channels of one block: each value rounded as in the torch path. */
static inline void finish(const int32_t *sums, int64_t count, float row_scale, const int32_t *correction,
                          const float *weight_scale, const float *bias, float *out) {
#ifdef HAVE_VNNI
    const __mmask16 mask = count >= CHANNELS ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
    __m512 value = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums),
                                                       _mm512_maskz_loadu_epi32(mask, correction)));
    value = _mm512_mul_ps(value, _mm512_set1_ps(row_scale));
    value = _mm512_mul_ps(value, _mm512_maskz_loadu_ps(mask, weight_scale));
    if (bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(out, mask, value);
#else
    if (count > CHANNELS) count = CHANNELS;
    for (int64_t c = 0; c < count; c++) {
        float value = (float)(sums[c] - (OFFSET_IN_SUMS ? correction[c] : 0));
        value = value * row_scale;
        value = value * weight_scale[c];
        if (bias) value = value + bias[c];
        out[c] = value;
    }
#endif
}

#ifdef HAVE_VNNI
/* rows x (blocks * 16) outputs; inlined with constant rows and blocks so acc stays in registers. */
static inline __attribute__((always_inline)) void tile(
    int rows, const uint8_t *q, int64_t q_stride, const int8_t *w, int64_t groups, const int8_t *next,
    int64_t first_line, int lines_per_group, int32_t sums[ROW_TILE][BLOCK_TILE][CHANNELS]) {
    __m512i acc[ROW_TILE][BLOCK_TILE];
    const int blocks = BLOCK_TILE;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        __m512i weights[BLOCK_TILE];
        for (int b = 0; b < blocks; b++) weights[b] = _mm512_loadu_si512(w + (g * BLOCK_TILE + b) * 64);
        for (int i = 0; i < lines_per_group; i++) {
            int64_t line = first_line + g * lines_per_group + i;
            if (next && line < groups * BLOCK_TILE) _mm_prefetch((const char *)next + line * 64, _MM_HINT_T1);
        }
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, q + r * q_stride + g * 4, 4);
            __m512i x = _mm512_set1_epi32(four);
            for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], x, weights[b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) _mm512_storeu_si512(sums[r][b], acc[r][b]);
}

#define TILE_CASE(R) case R: tile(R, q, q_stride, w, groups, next, first_line, lines_per_group, sums); break;
static void tile_dispatch(int rows, const uint8_t *q, int64_t q_stride, const int8_t *w, int64_t groups,
                          const int8_t *next, int64_t first_line, int lines_per_group,
                          int32_t sums[ROW_TILE][BLOCK_TILE][CHANNELS]) {
    switch (rows) {
        TILE_CASE(1)
#if ROW_TILE > 1
        TILE_CASE(2)
#endif
#if ROW_TILE > 2
        TILE_CASE(3)
#endif
#if ROW_TILE > 3
        TILE_CASE(4)
#endif
#if ROW_TILE > 4
        TILE_CASE(5)
#endif
#if ROW_TILE > 5
        TILE_CASE(6)
#endif
#if ROW_TILE > 6
        TILE_CASE(7)
#endif
#if ROW_TILE > 7
        TILE_CASE(8)
#endif
    }
}
#elif defined(HAVE_AVX2)
/* The AVX2 path reads its blocks from a layout of its own (BLOCKS_CONTIGUOUS): each block of 16
 * channels is one contiguous stream over the groups, so one pass of up to 4 rows (2 accumulators a
 * row, 8 in all, within AVX2's 16 registers) reads each weight once, in order, from memory.
 * Interleaved blocks (the VNNI layout) made 2-4 rows work on 4 KB chunks in L1, block by block,
 * whose stream from memory the arithmetic stalled, so the rows past the first were far from free.
 * The contiguous stream, prefetched PREFETCH_GROUPS groups (4 KB) ahead, keeps memory busy while
 * the rows compute: 2-8 rows run faster than interleaved, 1 row the same, with the same bits
 * (figures: docs/benchmarks.md, "Figures behind design choices"). */
#define BLOCKS_CONTIGUOUS 1
#define PREFETCH_GROUPS 64

/* rows x 16 channels of one contiguous block over all its groups, into sums[r][0]. */
static inline __attribute__((always_inline)) void block_avx2(
    int rows, const uint8_t *q, int64_t q_stride, const int8_t *w, int64_t groups,
    int32_t sums[ROW_TILE][BLOCK_TILE][CHANNELS]) {
    __m256i acc[ROW_TILE][2];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        /* Past the block's end this reaches into the next block, the next one this thread reads;
         * past the weights' end it is harmless (a prefetch never faults). */
        _mm_prefetch((const char *)w + (g + PREFETCH_GROUPS) * 64, _MM_HINT_T0);
        __m256i x[ROW_TILE];
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, q + r * q_stride + g * 4, 4);
            x[r] = _mm256_set1_epi32(four); /* one load: s8 x needs no conversion (Q_OFFSET 0) */
        }
        for (int half = 0; half < 2; half++) {
            const __m256i weight = _mm256_loadu_si256((const __m256i *)(w + g * 64 + half * 32));
            const __m256i magnitude = _mm256_abs_epi8(weight);
            for (int r = 0; r < rows; r++)
                acc[r][half] = _mm256_add_epi32(acc[r][half], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[r], weight)), ones));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int half = 0; half < 2; half++) _mm256_storeu_si256((__m256i *)(sums[r][0] + half * 8), acc[r][half]);
}

_Static_assert(ROW_TILE == 4, "tile_dispatch below has a case per row count");
static void tile_dispatch(int rows, const uint8_t *q, int64_t q_stride, const int8_t *w, int64_t groups,
                          const int8_t *next, int64_t first_line, int lines_per_group,
                          int32_t sums[ROW_TILE][BLOCK_TILE][CHANNELS]) {
    (void)next, (void)first_line, (void)lines_per_group;
    switch (rows) {
    case 1: block_avx2(1, q, q_stride, w, groups, sums); break;
    case 2: block_avx2(2, q, q_stride, w, groups, sums); break;
    case 3: block_avx2(3, q, q_stride, w, groups, sums); break;
    case 4: block_avx2(4, q, q_stride, w, groups, sums); break;
    }
}
#else
/* Portable integer code: the same sums, exact, at whatever speed the compiler makes of it. */
static void tile_dispatch(int rows, const uint8_t *q, int64_t q_stride, const int8_t *w, int64_t groups,
                          const int8_t *next, int64_t first_line, int lines_per_group,
                          int32_t sums[ROW_TILE][BLOCK_TILE][CHANNELS]) {
    (void)next, (void)first_line, (void)lines_per_group;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < BLOCK_TILE; b++) {
            int32_t acc[CHANNELS] = {0};
            for (int64_t g = 0; g < groups; g++)
                for (int c = 0; c < CHANNELS; c++)
                    for (int j = 0; j < 4; j++)
                        acc[c] += ((int32_t)q[r * q_stride + g * 4 + j] - Q_OFFSET) * (int32_t)w[(g * BLOCK_TILE + b) * 64 + c * 4 + j];
            memcpy(sums[r][b], acc, sizeof acc);
        }
}
#endif
#ifndef BLOCKS_CONTIGUOUS
#define BLOCKS_CONTIGUOUS 0
#endif

#ifdef HAVE_AMX
/* AMX (Sapphire Rapids and later): tdpbusd multiplies a tile of up to 16 rows x 64 u8 activations
 * by a tile of 16 x 64 s8 weights laid out as 16 groups of 4 inputs x 16 channels, adding into
 * 16 rows x 16 int32 sums: the VNNI packing's 64-byte vectors are exactly such weight tile rows
 * (a block's vectors for consecutive groups lie 4 x 64 bytes apart in a tile's stream, the tile
 * load's stride). The same u8 x s8 products and int32 sums as vpdpbusd, so the same bits; what
 * changes is that 16 rows cost one instruction per 1 KB of weights where AVX-512 spends one per
 * row per 64 bytes. Measured with weights streamed from memory, AMX pays at 16 rows and more and
 * gains nothing at 1 to 8, hence AMX_MIN_ROWS (figures: docs/benchmarks.md, "Figures behind
 * design choices"). */
#define AMX_ROWS 16
#define AMX_GROUPS 16 /* groups of 4 inputs per tile: 64 bytes of each activation row */
#define AMX_MIN_ROWS 9

/* Linux hands out AMX's tile state only to a process that asks (arch_prctl, kernel 5.16+): 1 when
 * granted, 0 when refused (then the AVX-512 path serves). Asked once; racing first calls ask twice,
 * which is harmless. */
static int amx_granted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tiles 0-3: the sums of a tile's 4 blocks of 16 channels for `rows` rows; 4: activations; 5 and 6:
 * weights, alternating so that a block's load need not wait for the previous block's product. */
static void amx_configure(int rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 5; t++) config.rows[t] = (uint8_t)rows, config.bytes_per_row[t] = 64;
    for (int t = 5; t < 7; t++) config.rows[t] = AMX_GROUPS, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}
#define AMX_BLOCK(B, W) \
    _tile_loadd(W, w + (g * BLOCK_TILE + B) * 64, BLOCK_TILE * 64); \
    _tile_dpbusd(B, 4, W);
/* Up to 16 rows x one 64-channel tile over all groups (a multiple of AMX_GROUPS), into sums[r][b].
 * Whole tiles, as the AVX-512 path takes them: each thread streams contiguous 4 KB runs of the
 * weights. Units of one or two blocks balanced o_proj's and down_proj's 3 tiles better over 2
 * threads, but read each run in strided pieces and measured 5-35% slower. */
static void amx_tile(const uint8_t *q, int64_t q_stride, const int8_t *w, int64_t groups,
                     int32_t sums[AMX_ROWS][BLOCK_TILE][CHANNELS]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < groups; g += AMX_GROUPS) {
        _tile_loadd(4, q + g * 4, q_stride);
        AMX_BLOCK(0, 5)
        AMX_BLOCK(1, 6)
        AMX_BLOCK(2, 5)
        AMX_BLOCK(3, 6)
    }
    const int64_t row_bytes = BLOCK_TILE * CHANNELS * 4;
    _tile_stored(0, sums[0][0], row_bytes);
    _tile_stored(1, sums[0][1], row_bytes);
    _tile_stored(2, sums[0][2], row_bytes);
    _tile_stored(3, sums[0][3], row_bytes);
}
/* The GEMM of w8a8_linear with AMX over (tile, pass of 16 rows) units, cut into one contiguous
 * range per thread; 0 when it cannot serve this call (too few rows, an input length that is not a
 * multiple of 64, or no AMX state granted). */
static int amx_gemm(int64_t rows, const uint8_t *q, int64_t in_padded, const int8_t *packed,
                    const int32_t *correction, const float *weight_scale, const float *bias,
                    int64_t out_features, float *out, const float *row_scales, int threads) {
    const int64_t groups = in_padded / 4;
    if (rows < AMX_MIN_ROWS || groups % AMX_GROUPS || !amx_granted()) return 0;
    const int64_t span_bytes = groups * 64 * BLOCK_TILE;
    const int64_t spans = ((out_features + CHANNELS - 1) / CHANNELS + BLOCK_TILE - 1) / BLOCK_TILE;
    const int64_t passes = (rows + AMX_ROWS - 1) / AMX_ROWS, work = spans * passes;
    #pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int32_t sums[AMX_ROWS][BLOCK_TILE][CHANNELS];
        int configured = 0;
        for (int64_t unit = work * me / team; unit < work * (me + 1) / team; unit++) {
            const int64_t span = unit / passes, r0 = unit % passes * AMX_ROWS;
            const int n_rows = rows - r0 < AMX_ROWS ? (int)(rows - r0) : AMX_ROWS;
            if (n_rows != configured) amx_configure(configured = n_rows);
            amx_tile(q + r0 * in_padded, in_padded, packed + span * span_bytes, groups, sums);
            for (int r = 0; r < n_rows; r++)
                for (int b = 0; b < BLOCK_TILE; b++) {
                    const int64_t channel = (span * BLOCK_TILE + b) * CHANNELS;
                    if (channel < out_features)
                        finish(sums[r][b], out_features - channel, row_scales[r0 + r], correction + channel,
                               weight_scale + channel, bias ? bias + channel : NULL,
                               out + (r0 + r) * out_features + channel);
                }
        }
        if (configured) _tile_release();
    }
    return 1;
}
#endif

/* The packed layout this build reads (native_linear.pack): 1 when each 16-channel block's groups
 * are contiguous, 0 when a tile's blocks are interleaved group by group. */
int w8a8_blocks_contiguous(void) { return BLOCKS_CONTIGUOUS; }

/* 1 when this build multiplies with AMX (built for a CPU with it, and the kernel granted its state). */
int w8a8_amx(void) {
#ifdef HAVE_AMX
    return amx_granted();
#else
    return 0;
#endif
}

/* out[rows][out_features] = dequant(quant(x') @ w^T), x' = x or, with hadamard > 0 (fp32 only), each
 * row times blockdiag(H_hadamard, ...); x is fp32 (x_is_f64 = 0) or fp64, rows of
 * in_features; in_padded (a multiple of 4) is the packed weights' input length; the packed
 * blocks cover out_features rounded up to whole tiles (zero rows past it, not written out). q (rows *
 * in_padded bytes) and row_scales (rows) are scratch. */
int w8a8_linear(const void *x, int x_is_f64, int64_t rows, int64_t in_features, int64_t in_padded,
                const int8_t *packed, const int32_t *correction, const float *weight_scale,
                const float *bias, int64_t out_features, float *out, uint8_t *q, float *row_scales,
                int64_t hadamard, int threads) {
    if (in_padded % 4 || in_padded < in_features) return 1;
    if (hadamard && (x_is_f64 || hadamard & (hadamard - 1) || in_features % hadamard)) return 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (rows > 1)
    {
        float *rotated = hadamard ? malloc(sizeof(float) * in_features) : NULL;
        if (hadamard && !rotated) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (failed) continue;
            if (x_is_f64) {
                row_scales[r] = quantize_row_f64((const double *)x + r * in_features, in_features, in_padded,
                                                 q + r * in_padded);
                continue;
            }
            const float *row = (const float *)x + r * in_features;
            if (hadamard) {
                memcpy(rotated, row, sizeof(float) * in_features);
                block_hadamard(rotated, in_features, hadamard);
                row = rotated;
            }
            row_scales[r] = quantize_row_f32(row, in_features, in_padded, q + r * in_padded);
        }
        free(rotated);
    }
    if (failed) return 2;
#ifdef HAVE_AMX
    if (amx_gemm(rows, q, in_padded, packed, correction, weight_scale, bias, out_features, out, row_scales, threads))
        return 0;
#endif

    /* A span is what one tile_dispatch call covers: a whole tile of BLOCK_TILE interleaved blocks,
     * or with BLOCKS_CONTIGUOUS one block (tiles are then runs of contiguous blocks, so every block
     * of the weights is one span). */
    const int span_blocks = BLOCKS_CONTIGUOUS ? 1 : BLOCK_TILE;
    const int64_t groups = in_padded / 4, span_bytes = groups * 64 * span_blocks;
    const int64_t blocks = (out_features + CHANNELS - 1) / CHANNELS;
    const int64_t spans = BLOCKS_CONTIGUOUS ? blocks : (blocks + BLOCK_TILE - 1) / BLOCK_TILE;
    /* With several passes over a tile (5+ rows), the VNNI path also prefetches the next tile into
     * L2, spread over them: its stream from memory then overlaps the arithmetic instead of stalling
     * the first pass. Measured on the model's layers (AVX512-VNNI): 9-12% faster for 16-64 rows;
     * for 1-4 rows (one pass, memory-bound) prefetching was 5-7% slower than the hardware
     * prefetcher alone. The AVX2 path prefetches within its own pass (block_avx2). */
    const int64_t passes = (rows + ROW_TILE - 1) / ROW_TILE;
    const int lines_per_group = passes > 1 ? (int)((BLOCK_TILE + passes - 1) / passes) : 0;
    /* Work: every (span, pass) pair, span by span, cut into one contiguous range per thread. Whole
     * tiles per thread left one idle for up to a tile's passes: o_proj and down_proj have 9 tiles,
     * qkv 15, so with 2 threads one did 5/9 of the work. Ranges split at most one span between two
     * threads, whose passes are independent rows. */
    const int64_t work = spans * passes;
    #pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int32_t sums[ROW_TILE][BLOCK_TILE][CHANNELS];
        for (int64_t unit = work * me / team; unit < work * (me + 1) / team; unit++) {
            const int64_t span = unit / passes, pass = unit % passes, r0 = pass * ROW_TILE;
            const int8_t *next = passes > 1 && span + 1 < spans ? packed + (span + 1) * span_bytes : NULL;
            const int n_rows = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            tile_dispatch(n_rows, q + r0 * in_padded, in_padded, packed + span * span_bytes, groups, next,
                          pass * groups * lines_per_group, lines_per_group, sums);
            for (int r = 0; r < n_rows; r++)
                for (int b = 0; b < span_blocks; b++) {
                    const int64_t channel = (span * span_blocks + b) * CHANNELS;
                    if (channel < out_features)
                        finish(sums[r][b], out_features - channel, row_scales[r0 + r], correction + channel,
                               weight_scale + channel, bias ? bias + channel : NULL,
                               out + (r0 + r) * out_features + channel);
                }
        }
    }
    return 0;
}
