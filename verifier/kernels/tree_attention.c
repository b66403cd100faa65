/* Tree attention in fp32 with one fixed reduction order per query (see native_attention.py).
 *
 * Queries, not keys, fill the vector lanes: the lanes of a work item (16 with AVX-512, 8 otherwise) are as many (row, head) queries
 * of one session's step that share a kv head, so each key is read once for all of them, straight
 * from the cache, with no transposed copy. Every number a query's output depends on comes from
 * one lane and a fixed sequence of operations on it:
 *   score(key)  = q[0] k[0], then + q[d] k[d] for d = 1 .. head_dim - 1, one FMA chain;
 *   max         = over the visible keys (exact in any order);
 *   weight(key) = exp(score - max) for a visible key, exactly 0 for a masked one;
 *   sum, out[d] = accumulated over keys in position order, out scaled by 1 / sum at the end.
 * A masked key adds exactly +0 to a sum that is never -0, which changes nothing, so a query's bits
 * do not depend on which other queries share its item, how many tree nodes follow it, what other
 * sessions are in the call, or where a prompt was cut into chunks. Built with -ffp-contract=fast:
 * a*b+c is one FMA everywhere. Built twice: for an fp32 cache, and with -DKV_BF16 for a bf16 one.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define PV_LANES 4 /* queries whose weighted sums share each loaded value vector */
#define KEY_GROUP 8 /* keys scored together: independent FMA chains to fill the pipelines */
/* A vector register's worth of queries per work item (16 with AVX-512, 8 otherwise), and vectors
 * of head dims accumulated at once, as many as the registers hold (32 with AVX-512, 16 with AVX2).
 * No lane's order of operations depends on either, so every build gives a query the same bits. */
#ifdef __AVX512F__
#define LANES 16
#define VALUE_WIDTH 4
typedef f32x16 vf;
typedef i32x16 vi;
#define splat splat16
#define vexp vexp16
#define vload load16
#define vstore store16
#else
#define LANES 8
#define VALUE_WIDTH 2
typedef f32x8 vf;
typedef i32x8 vi;
#define splat splat8
#define vexp vexp8
#define vload load8
#define vstore store8
#endif


/* What the cache stores. KV_BF16 (a second build): bf16, the top half of an fp32, so widening a
 * key or value is exact and the kernel computes on exactly the numbers stored, in the fp32
 * build's order: the same bits as that build given the same values as fp32. */
#ifdef KV_BF16
typedef uint16_t kv_t;
typedef uint16_t kv_vector __attribute__((vector_size(LANES * 2), aligned(2), may_alias));
typedef uint32_t u32_vector __attribute__((vector_size(LANES * 4)));
static inline vf kv_load(const kv_t *p) { return (vf)(__builtin_convertvector(*(const kv_vector *)p, u32_vector) << 16); }
#else
typedef float kv_t;
static inline vf kv_load(const kv_t *p) { return vload(p); }
#endif

static inline vf vmax(vf a, vf b) {
    vi take_b = a < b;
    return (vf)(((vi)a & ~take_b) | ((vi)b & take_b));
}

/* Key row `key` as fp32: itself in the fp32 build; in the bf16 build widened into `scratch`
 * (head_dim floats) a vector at a time, so the FMA chains below broadcast fp32 from memory. */
static inline const float *fp32_key(const kv_t *key, int64_t head_dim, float *scratch) {
#ifdef KV_BF16
    for (int64_t d = 0; d < head_dim; d += LANES) vstore(scratch + d, kv_load(key + d));
    return scratch;
#else
    (void)head_dim, (void)scratch;
    return key;
#endif
}

/* scores[s][lane] = q_t[.][lane] . key(s) for s in [0, count); q_t is [head_dim][LANES]. */
static void score_keys(const vf *q_t, const kv_t *const *key_rows, int64_t count, int64_t head_dim, vf *scores) {
#ifdef KV_BF16
    float widened[KEY_GROUP][head_dim];
#else
    float *widened[KEY_GROUP] = {0}; /* unused: fp32 keys are read in place */
#endif
    int64_t s = 0;
    for (; s + KEY_GROUP <= count; s += KEY_GROUP) {
        const float *key[KEY_GROUP];
        vf acc[KEY_GROUP];
        for (int j = 0; j < KEY_GROUP; j++) key[j] = fp32_key(key_rows[s + j], head_dim, widened[j]);
        for (int j = 0; j < KEY_GROUP; j++) acc[j] = splat(key[j][0]) * q_t[0];
        for (int64_t d = 1; d < head_dim; d++) {
            const vf q = q_t[d];
            for (int j = 0; j < KEY_GROUP; j++) acc[j] = splat(key[j][d]) * q + acc[j];
        }
        for (int j = 0; j < KEY_GROUP; j++) scores[s + j] = acc[j];
    }
    for (; s < count; s++) {
        const float *key = fp32_key(key_rows[s], head_dim, widened[0]);
        vf acc = splat(key[0]) * q_t[0];
        for (int64_t d = 1; d < head_dim; d++) acc = splat(key[d]) * q_t[d] + acc;
        scores[s] = acc;
    }
}

/* Masked scores are -inf on entry; on return scores hold the weights exp(score - max) (0 where
 * masked) and the function returns each lane's sum of weights, summed in key order. */
static vf weigh(vf *scores, int64_t count) {
    vf top = splat(-INFINITY);
    for (int64_t s = 0; s < count; s++) top = vmax(top, scores[s]);
    vf total = {0};
    for (int64_t s = 0; s < count; s++) {
        vi masked = scores[s] == splat(-INFINITY);
        vf p = vexp(scores[s] - top);
        p = (vf)((vi)p & ~masked);
        scores[s] = p;
        total += p;
    }
    return total;
}

/* acc[l][c] = sum over keys s, in order, of weight[s][first + l] * value(s)[d0 + 16 c ..], for
 * `lanes` lanes and `width` vectors of head dims: constants wherever it is inlined, so acc stays
 * in registers. Each (lane, d) accumulates in key order whatever lanes and width are. */
static inline __attribute__((always_inline)) void accumulate_values(
    const float *weights, const kv_t *const *value_rows, int64_t count, int64_t d0, int first, int lanes,
    int width, vf acc[PV_LANES][4]) {
    for (int l = 0; l < lanes; l++)
        for (int c = 0; c < width; c++) acc[l][c] = (vf){0};
    for (int64_t s = 0; s < count; s++) {
        const kv_t *v = value_rows[s] + d0;
        vf vv[4];
        for (int c = 0; c < width; c++) vv[c] = kv_load(v + c * LANES);
        for (int l = 0; l < lanes; l++) {
            vf p = splat(weights[s * LANES + first + l]);
            for (int c = 0; c < width; c++) acc[l][c] = p * vv[c] + acc[l][c];
        }
    }
}

#define ACCUMULATE(L, W) case L: accumulate_values(weights, value_rows, count, d0, first, L, W, acc); break;

/* out[l][.] = the weighted sum of values for lanes first .. first + lanes - 1 (lanes <= PV_LANES),
 * scaled by 1 / their weight sums; head_dim is a multiple of LANES. */
static void weigh_values(const float *weights, const kv_t *const *value_rows, int64_t count, int64_t head_dim,
                         int first, int lanes, vf total, float *const *out) {
    vf acc[PV_LANES][4];
    for (int64_t d0 = 0; d0 < head_dim;) {
        int width = head_dim - d0 >= VALUE_WIDTH * LANES ? VALUE_WIDTH : 1;
        if (width == VALUE_WIDTH) {
            switch (lanes) {
                ACCUMULATE(1, VALUE_WIDTH) ACCUMULATE(2, VALUE_WIDTH) ACCUMULATE(3, VALUE_WIDTH) ACCUMULATE(4, VALUE_WIDTH)
            }
        } else {
            switch (lanes) { ACCUMULATE(1, 1) ACCUMULATE(2, 1) ACCUMULATE(3, 1) ACCUMULATE(4, 1) }
        }
        for (int l = 0; l < lanes; l++) {
            vf inv = splat(1.0f / total[first + l]);
            for (int c = 0; c < width; c++) vstore(out[l] + d0 + c * LANES, acc[l][c] * inv);
        }
        d0 += width * LANES;
    }
}

/* One layer's attention for all packed rows of a forward.
 *
 * queries, out: [rows, n_heads, head_dim] (queries rotated, unscaled). keys, values: the cache;
 * key d of kv head g at slot s is keys[g * head_stride + s * slot_stride + d] (values alike).
 * Segment i (one session's step): seg_start[i] committed positions, seg_steps[i] rows from packed
 * row seg_row[i]; its positions' slots are slots[seg_slot[i] ...][start + steps]. Row r attends to
 * every committed position and to step rows anc_idx[anc_ptr[r] .. anc_ptr[r + 1]) (ascending,
 * itself last). Strides count elements of kv_t. Returns 0, or -1 when out of memory.
 */
int tree_attention(const float *queries, float *out, int64_t rows, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim, float scale, const kv_t *keys, const kv_t *values,
                   int64_t head_stride, int64_t slot_stride, int64_t n_segments, const int64_t *seg_start,
                   const int64_t *seg_steps, const int64_t *seg_row, const int64_t *seg_slot,
                   const int64_t *slots, const int64_t *anc_ptr, const int64_t *anc_idx, int threads) {
    (void)rows;
    int64_t group = n_heads / n_kv_heads;
    /* Work items: per segment and kv head, its step's queries of that head in blocks of LANES. */
    int64_t *item_at = malloc(sizeof(int64_t) * (n_segments + 1));
    if (!item_at) return -1;
    item_at[0] = 0;
    int64_t longest = 0, most_steps = 0;
    for (int64_t i = 0; i < n_segments; i++) {
        int64_t blocks = (seg_steps[i] * group + LANES - 1) / LANES;
        item_at[i + 1] = item_at[i] + n_kv_heads * blocks;
        longest = seg_start[i] + seg_steps[i] > longest ? seg_start[i] + seg_steps[i] : longest;
        most_steps = seg_steps[i] > most_steps ? seg_steps[i] : most_steps;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        vf *scores = aligned_alloc(64, sizeof(vf) * (longest + 1));
        vf *q_t = aligned_alloc(64, sizeof(vf) * head_dim);
        const kv_t **key_rows = malloc(sizeof(kv_t *) * (longest + 1));
        const kv_t **value_rows = malloc(sizeof(kv_t *) * (longest + 1));
        unsigned char *visible = malloc((most_steps + 1) * LANES);
        if (!scores || !q_t || !key_rows || !value_rows || !visible) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < item_at[n_segments]; item++) {
            if (failed) continue;
            int64_t i = 0;
            while (item_at[i + 1] <= item) i++;
            int64_t blocks = (seg_steps[i] * group + LANES - 1) / LANES;
            int64_t g = (item - item_at[i]) / blocks, first_query = (item - item_at[i]) % blocks * LANES;
            int lanes = seg_steps[i] * group - first_query < LANES ? (int)(seg_steps[i] * group - first_query) : LANES;
            int64_t start = seg_start[i], first_row = seg_row[i];
            /* Lane l: query first_query + l, i.e. step row (first_query + l) / group, head g * group + .. % group. */
            for (int64_t d = 0; d < head_dim; d++) q_t[d] = (vf){0};
            for (int l = 0; l < lanes; l++) {
                int64_t t = (first_query + l) / group, h = g * group + (first_query + l) % group;
                const float *query = queries + ((first_row + t) * n_heads + h) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) q_t[d][l] = query[d] * scale;
            }
            /* Keys: every committed position, then step rows up to the block's last row. */
            int64_t last_row = (first_query + lanes - 1) / group, count = start + last_row + 1;
            const int64_t *slot = slots + seg_slot[i];
            for (int64_t s = 0; s < count; s++) {
                key_rows[s] = keys + g * head_stride + slot[s] * slot_stride;
                value_rows[s] = values + g * head_stride + slot[s] * slot_stride;
            }
            score_keys(q_t, key_rows, count, head_dim, scores);
            /* Step row j is visible to lane l only when it is an ancestor of (or is) l's row. */
            memset(visible, 0, (size_t)(last_row + 1) * LANES);
            for (int l = 0; l < lanes; l++) {
                int64_t row = first_row + (first_query + l) / group;
                for (int64_t a = anc_ptr[row]; a < anc_ptr[row + 1]; a++) visible[anc_idx[a] * LANES + l] = 1;
            }
            for (int64_t j = 0; j <= last_row; j++)
                for (int l = 0; l < LANES; l++)
                    if (!visible[j * LANES + l]) scores[start + j][l] = -INFINITY;
            vf total = weigh(scores, count);
            for (int l0 = 0; l0 < lanes; l0 += PV_LANES) {
                int n = lanes - l0 < PV_LANES ? lanes - l0 : PV_LANES;
                float *outs[PV_LANES];
                for (int l = 0; l < n; l++) {
                    int64_t t = (first_query + l0 + l) / group, h = g * group + (first_query + l0 + l) % group;
                    outs[l] = out + ((first_row + t) * n_heads + h) * head_dim;
                }
                weigh_values((const float *)scores, value_rows, count, head_dim, l0, n, total, outs);
            }
        }
        free(scores), free(q_t), free(key_rows), free(value_rows), free(visible);
    }
    free(item_at);
    return failed ? -1 : 0;
}
