/* Tree attention in fp32 with one fixed reduction order per query row (see native_attention.py).
 *
 * Every number a row's output depends on is computed by code whose operations and order depend on
 * nothing but that row's own keys: the same vector instructions for every key wherever it sits
 * (no scalar remainders: key blocks and lists are padded to whole vectors), softmax and the
 * weighted sum of values over the row's visible keys in position order. So the output of a row is
 * bit-identical whether it is computed alone, in a tree of 64 nodes, next to other sessions, or
 * in a prompt chunk cut anywhere. Built with -ffp-contract=fast: a*b+c is one FMA everywhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define KEY_BLOCK 64 /* keys scored per pass over head_dim: 4 independent FMA chains */

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(LANES * 4), aligned(4), may_alias));

static inline vf splat(float x) { return (vf){0} + x; }

static inline vf vmax(vf a, vf b) {
    vi take_b = a < b;
    return (vf)(((vi)a & ~take_b) | ((vi)b & take_b));
}

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* e^x for x <= 0: x = n ln2 + r, |r| <= ln2/2; e^r by its degree-6 Taylor polynomial (within
 * 2.8 ulp of exp over [-87, 0], measured at 32M points); below -87 the result (< 2e-38) is
 * clamped there instead of reaching denormals. */
static inline vf vexp_nonpositive(vf x) {
    const vf lowest = splat(-87.0f);
    vi below = x < lowest;
    x = (vf)(((vi)x & ~below) | ((vi)lowest & below));
    const vf round_magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * splat(1.44269504f) + round_magic) - round_magic;
    vf r = x - n * splat(0.693145752f); /* ln2 split in two for an exact first product */
    r = r - n * splat(1.42860677e-06f);
    vf p = splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)exponent;
}

/* scores[s] = q . key(s) for s in [0, count), count rounded up to KEY_BLOCK; keys_t is
 * [head_dim][stride], zero past the last key. */
static void score_keys(const float *q, const float *keys_t, int64_t stride, int64_t head_dim,
                       int64_t count, float *scores) {
    for (int64_t s0 = 0; s0 < count; s0 += KEY_BLOCK) {
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const float *column = keys_t + s0;
        for (int64_t d = 0; d < head_dim; d++, column += stride) {
            vf qd = splat(q[d]);
            a0 = qd * *(const vf *)(column) + a0;
            a1 = qd * *(const vf *)(column + LANES) + a1;
            a2 = qd * *(const vf *)(column + 2 * LANES) + a2;
            a3 = qd * *(const vf *)(column + 3 * LANES) + a3;
        }
        *(vf *)(scores + s0) = a0;
        *(vf *)(scores + s0 + LANES) = a1;
        *(vf *)(scores + s0 + 2 * LANES) = a2;
        *(vf *)(scores + s0 + 3 * LANES) = a3;
    }
}

/* out[head_dim] = softmax(list) . values, over `count` keys; list padded with -inf to LANES. */
static void weigh_values(float *list, const float *const *value_rows, int64_t count, int64_t head_dim,
                         float *out) {
    int64_t padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t i = count; i < padded; i++) list[i] = -INFINITY;
    vf m = splat(-INFINITY);
    for (int64_t i = 0; i < padded; i += LANES) m = vmax(m, *(vf *)(list + i));
    vf top = splat(hmax(m)), total = {0};
    for (int64_t i = 0; i < padded; i += LANES) {
        vf p = vexp_nonpositive(*(vf *)(list + i) - top);
        *(vf *)(list + i) = p;
        total += p;
    }
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += total[i];
    /* head_dim is a multiple of LANES (checked by the caller): whole vectors only. */
    for (int64_t d0 = 0; d0 < head_dim; d0 += 4 * LANES) {
        int64_t width = head_dim - d0 < 4 * LANES ? head_dim - d0 : 4 * LANES;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < count; i++) {
            vf p = splat(list[i]);
            const float *v = value_rows[i] + d0;
            a0 = p * *(const vf *)(v) + a0;
            if (width > LANES) a1 = p * *(const vf *)(v + LANES) + a1;
            if (width > 2 * LANES) a2 = p * *(const vf *)(v + 2 * LANES) + a2;
            if (width > 3 * LANES) a3 = p * *(const vf *)(v + 3 * LANES) + a3;
        }
        vf inv = splat(1.0f / sum);
        *(vf *)(out + d0) = a0 * inv;
        if (width > LANES) *(vf *)(out + d0 + LANES) = a1 * inv;
        if (width > 2 * LANES) *(vf *)(out + d0 + 2 * LANES) = a2 * inv;
        if (width > 3 * LANES) *(vf *)(out + d0 + 3 * LANES) = a3 * inv;
    }
}

/* One layer's attention for all packed rows of a forward.
 *
 * queries, out: [rows, n_heads, head_dim] (queries rotated, unscaled). keys, values: the cache;
 * key d of kv head g at slot s is keys[g * head_stride + s * slot_stride + d] (values alike).
 * Segment i (one session's step): seg_start[i] committed positions, seg_steps[i] rows from packed
 * row seg_row[i]; its positions' slots are slots[seg_slot[i] ...][start + steps]. Row r attends to
 * every committed position and to step rows anc_idx[anc_ptr[r] .. anc_ptr[r + 1]) (ascending,
 * itself last). Returns 0, or -1 when out of memory.
 */
int tree_attention(const float *queries, float *out, int64_t rows, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim, float scale, const float *keys, const float *values,
                   int64_t head_stride, int64_t slot_stride, int64_t n_segments, const int64_t *seg_start,
                   const int64_t *seg_steps, const int64_t *seg_row, const int64_t *seg_slot,
                   const int64_t *slots, const int64_t *anc_ptr, const int64_t *anc_idx, int threads) {
    int64_t group = n_heads / n_kv_heads;
    /* Transposed keys [head_dim][padded positions] per (segment, kv head): one region for all. */
    int64_t *keys_at = malloc(sizeof(int64_t) * (n_segments * n_kv_heads + 1));
    int64_t *item_at = malloc(sizeof(int64_t) * (n_segments + 1));
    int64_t longest = 0;
    if (!keys_at || !item_at) {
        free(keys_at), free(item_at);
        return -1;
    }
    keys_at[0] = 0;
    item_at[0] = 0;
    for (int64_t i = 0; i < n_segments; i++) {
        int64_t positions = seg_start[i] + seg_steps[i];
        int64_t padded = (positions + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
        longest = padded > longest ? padded : longest;
        for (int64_t g = 0; g < n_kv_heads; g++)
            keys_at[i * n_kv_heads + g + 1] = keys_at[i * n_kv_heads + g] + head_dim * padded;
        item_at[i + 1] = item_at[i] + seg_steps[i] * n_heads;
    }
    float *keys_t = malloc(sizeof(float) * keys_at[n_segments * n_kv_heads]);
    int failed = keys_t == NULL;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic)
            for (int64_t job = 0; job < n_segments * n_kv_heads; job++) {
                int64_t i = job / n_kv_heads, g = job % n_kv_heads;
                int64_t positions = seg_start[i] + seg_steps[i];
                int64_t padded = (keys_at[job + 1] - keys_at[job]) / head_dim;
                float *dst = keys_t + keys_at[job];
                const int64_t *slot = slots + seg_slot[i];
                for (int64_t s = 0; s < positions; s++) {
                    const float *src = keys + g * head_stride + slot[s] * slot_stride;
                    for (int64_t d = 0; d < head_dim; d++) dst[d * padded + s] = src[d];
                }
                for (int64_t d = 0; d < head_dim; d++)
                    memset(dst + d * padded + positions, 0, sizeof(float) * (padded - positions));
            }
            /* Per thread: scores of every position, the row's visible list, its value rows. */
            float *scores = malloc(sizeof(float) * (longest + LANES));
            float *list = malloc(sizeof(float) * (longest + LANES));
            const float **value_rows = malloc(sizeof(float *) * (longest + LANES));
            float *q = malloc(sizeof(float) * head_dim);
            if (!scores || !list || !value_rows || !q) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 4)
            for (int64_t item = 0; item < item_at[n_segments]; item++) {
                if (failed) continue;
                int64_t i = 0;
                while (item_at[i + 1] <= item) i++;
                int64_t local = item - item_at[i], t = local / n_heads, h = local % n_heads;
                int64_t g = h / group, start = seg_start[i], row = seg_row[i] + t;
                int64_t padded = (keys_at[i * n_kv_heads + g + 1] - keys_at[i * n_kv_heads + g]) / head_dim;
                const float *query = queries + (row * n_heads + h) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) q[d] = query[d] * scale;
                const int64_t *ancestors = anc_idx + anc_ptr[row];
                int64_t n_ancestors = anc_ptr[row + 1] - anc_ptr[row];
                /* Rows only see earlier step rows, so keys past start + t + 1 need no score. */
                score_keys(q, keys_t + keys_at[i * n_kv_heads + g], padded, head_dim, start + t + 1, scores);
                memcpy(list, scores, sizeof(float) * start);
                for (int64_t j = 0; j < n_ancestors; j++) list[start + j] = scores[start + ancestors[j]];
                const int64_t *slot = slots + seg_slot[i];
                const float *value_base = values + g * head_stride;
                for (int64_t s = 0; s < start; s++) value_rows[s] = value_base + slot[s] * slot_stride;
                for (int64_t j = 0; j < n_ancestors; j++)
                    value_rows[start + j] = value_base + slot[start + ancestors[j]] * slot_stride;
                weigh_values(list, value_rows, start + n_ancestors, head_dim, out + (row * n_heads + h) * head_dim);
            }
            free(scores), free(list), free(value_rows), free(q);
        }
    }
    free(keys_t), free(keys_at), free(item_at);
    return failed ? -1 : 0;
}
