/* The CPU engine's per-row glue (RMSNorm, SwiGLU) and a whole decoder layer in one call
 * (see native_layers.py); linked with int8_linear.c, whose w8a8_linear runs the four GEMMs.
 *
 * A layer as Python modules is ~35 torch ops and 5 kernel calls, each paying dispatch, tensor
 * allocation and thread wake-ups before any arithmetic: a large share of a 1-token step, where the
 * arithmetic is small (figures: docs/benchmarks.md). One call runs the same arithmetic with none
 * of that.
 *
 * Every op is per row and takes the same IEEE steps whatever the row count, so a row's bits do not
 * depend on what else is in the forward (batch invariance, transformer.py), and the Python modules use
 * rms_norm and silu_mul from here too: `decoder_layer` gives their bits exactly (tested). Rotary is
 * x * cos + roll(x) * sin with each product and the sum rounded, as torch computes it. Built with
 * int8_linear.c's flags (-ffp-contract=off: no FMA merges those steps).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

int w8a8_linear(const void *x, int x_is_f64, int64_t rows, int64_t in_features, int64_t in_padded,
                const int8_t *packed, const int32_t *correction, const float *weight_scale,
                const float *bias, int64_t out_features, float *out, uint8_t *q, float *row_scales,
                int64_t hadamard, int threads);

/* native_attention.py's kernel (tree_attention.c, its own library and flags), called by address. */
typedef int (*attention_fn)(const float *queries, float *out, int64_t rows, int64_t n_heads, int64_t n_kv_heads,
                            int64_t head_dim, float scale, const void *keys, const void *values,
                            int64_t head_stride, int64_t slot_stride, int64_t n_segments, const int64_t *seg_start,
                            const int64_t *seg_steps, const int64_t *seg_row, const int64_t *seg_slot,
                            const int64_t *slots, const int64_t *anc_ptr, const int64_t *anc_idx, int threads);

#define LANES 16
typedef f32x16 v16f;
#define splat splat16

/* out = x / sqrt(mean(x^2) + eps) * weight for one row. The squares are summed in 16 lanes
 * (lane j takes k = j mod 16, in k order), the lanes then in lane order, the tail last. */
static void rms_norm_row(const float *x, const float *weight, int64_t dim, float eps, float *out) {
    v16f lanes = splat(0.0f);
    int64_t k = 0;
    for (; k + LANES <= dim; k += LANES) {
        v16f v = load16(x + k);
        lanes += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += lanes[j];
    for (; k < dim; k++) sum += x[k] * x[k];
    const float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
    for (k = 0; k < dim; k++) out[k] = (x[k] * inverse) * weight[k];
}

void rms_norm(const float *x, const float *weight, int64_t rows, int64_t dim, float eps, float *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, weight, dim, eps, out + r * dim);
}

/* out[k] = silu(gate[k]) * up[k] = gate[k] / (1 + e^-gate[k]) * up[k]; gate and up are the two
 * halves of each row of gate_up [rows, 2 * width] (the fused w1/w3 layer's output). */
static void silu_mul_row(const float *gate_up, int64_t width, float *out) {
    const float *gate = gate_up, *up = gate_up + width;
    int64_t k = 0;
    for (; k + LANES <= width; k += LANES) {
        v16f g = load16(gate + k);
        store16(out + k, g / (splat(1.0f) + vexp16(-g)) * load16(up + k));
    }
    if (k < width) { /* the tail through one padded vector: the same lane arithmetic */
        v16f g = splat(0.0f), u = splat(0.0f);
        for (int64_t j = k; j < width; j++) g[j - k] = gate[j], u[j - k] = up[j];
        v16f result = g / (splat(1.0f) + vexp16(-g)) * u;
        for (int64_t j = k; j < width; j++) out[j] = result[j - k];
    }
}

void silu_mul(const float *gate_up, int64_t rows, int64_t width, float *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * 2 * width, width, out + r * width);
}

/* One W8A8 layer's packed weights (native_linear.pack) and shapes. */
struct w8a8_layer {
    const int8_t *packed;
    const int32_t *correction;
    const float *weight_scale;
    const float *bias; /* NULL: none */
    int64_t in_features, in_padded, out_features, hadamard;
};

struct layer_weights {
    const float *attention_norm, *ffn_norm;
    struct w8a8_layer qkv, o, gate_up, down;
    const float *q_norm, *k_norm; /* Qwen3's per-head RMSNorm weights [head_dim]; NULL: none */
};

struct model_shape {
    int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim;
    float norm_eps, attention_scale;
};

/* One forward's rows and where they go: built once per forward, the same for every layer. */
struct step_rows {
    int64_t rows;
    const float *cos, *signed_sin;  /* rotary tables [max_position][head_dim] */
    const int64_t *positions;       /* [rows] */
    const int64_t *store_slots;     /* [rows]: each row's pool slot for its key and value */
    void *pool;                     /* KVPool.kv: [layers][2][n_kv_heads][slots][head_dim] */
    int64_t pool_slots;
    int64_t kv_bf16;                /* the pool holds bf16 (else fp32); attention reads it as stored */
    attention_fn attention;
    int64_t n_segments;             /* native_attention.Layout, as tree_attention reads it */
    const int64_t *seg_start, *seg_steps, *seg_row, *seg_slot, *slots, *anc_ptr, *anc_idx;
    /* Scratch, rows x: dim (normed), qkv width, n_heads * head_dim (queries, attended), dim
     * (linear_out), 2 * ffn_dim (gate_up), ffn_dim (act); quantized: rows x the widest in_padded. */
    float *normed, *qkv, *queries, *attended, *linear_out, *gate_up, *act, *row_scales;
    uint8_t *quantized;
    int threads;
};

static int linear(const struct w8a8_layer *w, const float *x, float *out, const struct step_rows *s) {
    return w8a8_linear(x, 0, s->rows, w->in_features, w->in_padded, w->packed, w->correction, w->weight_scale,
                       w->bias, w->out_features, out, s->quantized, s->row_scales, w->hadamard, s->threads);
}

/* One head's rotary: out[d] = x[d] cos[d] + x[(d + half) mod head_dim] signed_sin[d], as two
 * loops over the halves (no modulo), which the compiler vectorizes: the scalar loop with a modulo
 * was a visible share of a 16-row step (figures: docs/benchmarks.md). */
static void rotate(const float *restrict x, const float *restrict cos, const float *restrict signed_sin,
                   int64_t head_dim, float *restrict out) {
    const int64_t half = head_dim / 2;
    for (int64_t d = 0; d < half; d++) {
        float product = x[d] * cos[d], partner = x[d + half] * signed_sin[d];
        out[d] = product + partner;
    }
    for (int64_t d = half; d < head_dim; d++) {
        float product = x[d] * cos[d], partner = x[d - half] * signed_sin[d];
        out[d] = product + partner;
    }
}

/* fp32 -> bf16 rounded to nearest, ties to even (c10's conversion), so a key the modules store and
 * one stored here are the same bits; a NaN stays a NaN (its payload may differ from torch's). */
static void store_bf16(uint16_t *restrict out, const float *restrict x, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        uint32_t bits;
        memcpy(&bits, x + k, sizeof bits);
        out[k] = isnan(x[k]) ? 0x7FC0 : (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
}

/* h [rows][dim] += attention(norm(h)); h += feed_forward(norm(h)): TransformerBlock.forward, with
 * the step's keys and values stored in the pool at layer `layer`. 0, or the first failing call's code. */
int decoder_layer(float *h, const struct model_shape *m, const struct layer_weights *w, const struct step_rows *s,
                  int64_t layer) {
    const int64_t rows = s->rows, dim = m->dim, hd = m->head_dim;
    const int64_t qkv_width = (m->n_heads + 2 * m->n_kv_heads) * hd, q_width = m->n_heads * hd;
    const int64_t kv_heads_slots = m->n_kv_heads * s->pool_slots * hd, element = s->kv_bf16 ? 2 : 4;
    char *keys = (char *)s->pool + layer * 2 * kv_heads_slots * element, *values = keys + kv_heads_slots * element;
    int status;

    rms_norm(h, w->attention_norm, rows, dim, m->norm_eps, s->normed, s->threads);
    if ((status = linear(&w->qkv, s->normed, s->qkv, s))) return status;
    #pragma omp parallel for schedule(static) num_threads(s->threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = s->qkv + r * qkv_width;
        const float *cos = s->cos + s->positions[r] * hd, *signed_sin = s->signed_sin + s->positions[r] * hd;
        float normed_head[hd]; /* a head after its own norm (Qwen3), as the modules' q_norm/k_norm give it */
        for (int64_t head = 0; head < m->n_heads; head++) {
            const float *x = row + head * hd;
            if (w->q_norm) rms_norm_row(x, w->q_norm, hd, m->norm_eps, normed_head), x = normed_head;
            rotate(x, cos, signed_sin, hd, s->queries + r * q_width + head * hd);
        }
        float rotated[hd];
        for (int64_t g = 0; g < m->n_kv_heads; g++) {
            const int64_t at = (g * s->pool_slots + s->store_slots[r]) * hd;
            const float *x = row + q_width + g * hd, *value = row + q_width + (m->n_kv_heads + g) * hd;
            if (w->k_norm) rms_norm_row(x, w->k_norm, hd, m->norm_eps, normed_head), x = normed_head;
            if (s->kv_bf16) {
                rotate(x, cos, signed_sin, hd, rotated);
                store_bf16((uint16_t *)keys + at, rotated, hd);
                store_bf16((uint16_t *)values + at, value, hd);
            } else {
                rotate(x, cos, signed_sin, hd, (float *)keys + at);
                memcpy((float *)values + at, value, sizeof(float) * hd);
            }
        }
    }
    if (s->attention(s->queries, s->attended, rows, m->n_heads, m->n_kv_heads, hd, m->attention_scale, keys, values,
                     s->pool_slots * hd, hd, s->n_segments, s->seg_start, s->seg_steps, s->seg_row, s->seg_slot,
                     s->slots, s->anc_ptr, s->anc_idx, s->threads))
        return 2;
    if ((status = linear(&w->o, s->attended, s->linear_out, s))) return status;
    for (int64_t k = 0; k < rows * dim; k++) h[k] = h[k] + s->linear_out[k];

    rms_norm(h, w->ffn_norm, rows, dim, m->norm_eps, s->normed, s->threads);
    if ((status = linear(&w->gate_up, s->normed, s->gate_up, s))) return status;
    silu_mul(s->gate_up, rows, m->ffn_dim, s->act, s->threads);
    if ((status = linear(&w->down, s->act, s->linear_out, s))) return status;
    for (int64_t k = 0; k < rows * dim; k++) h[k] = h[k] + s->linear_out[k];
    return 0;
}
