/* Causal attention of many query rows in one call, each (row, head) computed alone in one fixed order.
 *
 * For query row r and head h (key/value head h / (heads / kv_heads)), reading keys first[r] .. last[r]:
 *   s_j = reduce16(sum over 16-lane chunks of q * k_j) * scale          (the chunks in order, lane by lane)
 *   e_j = exp(s_j - max_j s_j)                                            (exp: Cephes' polynomial, below)
 *   out = (sum over j in order of e_j * v_j) / reduce16(lane sums of e)
 * where reduce16 adds lane l and l + 8, then l and l + 4, l + 2, l + 1: one tree for every score. Every
 * operation is a float32 add, multiply or divide (no contraction, no fast-math), so the output is the same
 * function of the row's query and its keys and values whatever else the call holds, the thread that runs it,
 * or the vector width the compiler chose (ROW-CANONICAL by construction).
 *
 * Layouts: q row r, head h at q + r * q_row_stride + h * dim; row r's keys for key/value head g at
 * keys + offsets[r] + g * head_stride + position * dim (a slot of a store, or a sequence of a batch), its
 * values alike in values; out (rows, heads, dim) row-major. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
typedef float uvec __attribute__((vector_size(64), aligned(4)));      /* an unaligned load or store */

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void store(float *p, vec v) { *(uvec *)p = v; }
static inline vec splat(float x) { return (vec){0} + x; }

/* Scores of 16 keys from their 16 lane partials: out[j] = tree(part[j]) (see the header). Keys missing from a
 * last block have zero partials and do not change the others. */
static inline vec reduce16(const vec part[LANES]) {
    vec pairs[8], quads[4], octs[2];
    for (int i = 0; i < 8; i++)
        pairs[i] = __builtin_shufflevector(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                           21, 22, 23)
                 + __builtin_shufflevector(part[2 * i], part[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                           27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        quads[i] = __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                           24, 25, 26, 27)
                 + __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                           23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        octs[i] = __builtin_shufflevector(quads[2 * i], quads[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21,
                                          24, 25, 28, 29)
                + __builtin_shufflevector(quads[2 * i], quads[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                          23, 26, 27, 30, 31);
    return __builtin_shufflevector(octs[0], octs[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(octs[0], octs[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* One vector's lanes added by the same tree. */
static inline float sum16(vec v) {
    float t[LANES];
    store(t, v);
    for (int width = 8; width; width /= 2)
        for (int l = 0; l < width; l++) t[l] += t[l + width];
    return t[0];
}

/* exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) = 1 + r + r^2 P(r), times 2^n by the
 * exponent bits); exactly 0 below -87.3 (where 2^n would leave the normal range), -inf included. */
static inline vec exp_nonpositive(vec x) {
    const vec low = splat(-87.33654f), magic = splat(12582912.0f);         /* 1.5 * 2^23: rounds to an integer */
    const ivec under = x < low;
    x = (vec)(((ivec)x & ~under) | ((ivec)low & under));
    const vec shifted = x * splat(1.44269504088896341f) + magic;
    const vec n = shifted - magic;
    vec r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vec p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    const vec y = p * (r * r) + r + splat(1.0f);
    const ivec exponent = ((ivec)shifted - (ivec)magic) << 23;
    return (vec)(((ivec)y + exponent) & ~under);
}

/* A tail of n < 16 floats as one vector, zeros after it. */
static inline vec load_tail(const float *p, int64_t n) {
    float t[LANES] = {0};
    for (int64_t i = 0; i < n; i++) t[i] = p[i];
    return load(t);
}

/* One head of one row: `count` keys and values from k and v (rows of dim floats); scores holds count rounded up
 * to 16 floats. A width that is not a multiple of 16 ends in a partial chunk, zeros after it. Inlined with dim a
 * constant for the common widths (the same operations, unrolled and kept in registers). */
static inline __attribute__((always_inline)) void attend_one(const float *q, const float *k, const float *v,
                                                             int64_t count, const int64_t dim, float scale,
                                                             float *scores, float *out) {
    const int64_t chunks = dim / LANES, tail = dim % LANES, used = chunks + (tail > 0);
    vec query[used];
    for (int64_t c = 0; c < chunks; c++) query[c] = load(q + c * LANES);
    if (tail) query[chunks] = load_tail(q + chunks * LANES, tail);
    for (int64_t j0 = 0; j0 < count; j0 += LANES) {
        vec part[LANES];
        const int64_t n = count - j0 < LANES ? count - j0 : LANES;
        for (int64_t jj = 0; jj < LANES; jj++) {
            vec sum = {0};
            if (jj < n) {
                const float *key = k + (j0 + jj) * dim;
                sum = query[0] * (chunks ? load(key) : load_tail(key, tail));
                for (int64_t c = 1; c < chunks; c++) sum += query[c] * load(key + c * LANES);
                if (tail && chunks) sum += query[chunks] * load_tail(key + chunks * LANES, tail);
            }
            part[jj] = sum;
        }
        store(scores + j0, reduce16(part) * splat(scale));
    }
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t j = count; j < padded; j++) scores[j] = -INFINITY;
    float best = scores[0];
    for (int64_t j = 1; j < count; j++) best = scores[j] > best ? scores[j] : best;
    vec total = {0};
    for (int64_t j0 = 0; j0 < padded; j0 += LANES) {
        const vec e = exp_nonpositive(load(scores + j0) - splat(best));
        store(scores + j0, e);
        total += e;
    }
    const vec sum = splat(sum16(total));
    /* Values in passes of up to 4 chunks, each pass's accumulators in registers. */
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        const int64_t width = chunks - c0 < 4 ? chunks - c0 : 4;
        vec acc[4] = {{0}, {0}, {0}, {0}};
        for (int64_t j = 0; j < count; j++) {
            const vec weight = splat(scores[j]);
            const float *value = v + j * dim + c0 * LANES;
            for (int64_t c = 0; c < width; c++) acc[c] += weight * load(value + c * LANES);
        }
        for (int64_t c = 0; c < width; c++) store(out + (c0 + c) * LANES, acc[c] / sum);
    }
    for (int64_t i = chunks * LANES; i < dim; i++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < count; j++) acc += scores[j] * v[j * dim + i];
        out[i] = acc / sum[0];
    }
}

static void attend_any(const float *q, const float *k, const float *v, int64_t count, int64_t dim, float scale,
                       float *scores, float *out) {
    switch (dim) {
    case 64: attend_one(q, k, v, count, 64, scale, scores, out); break;
    case 128: attend_one(q, k, v, count, 128, scale, scores, out); break;
    case 256: attend_one(q, k, v, count, 256, scale, scores, out); break;
    default: attend_one(q, k, v, count, dim, scale, scores, out);
    }
}

int attention_rows_lanes(void) { return LANES; }

/* Where new_keys is not NULL, row r's own key and value (new_keys / new_values + r * new_row_stride, its kv heads
 * dim floats apart) are first written at its position, every row's before any row attends (a row reads the keys
 * of the rows before it in the call). Returns 0, or -1 where a thread's score buffer could not be allocated
 * (nothing is then trusted). */
int attention_rows(int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const float *q, int64_t q_row_stride,
                   float *keys, float *values, int64_t head_stride, const int64_t *offsets, const int64_t *first,
                   const int64_t *last, float scale, float *out, const float *new_keys, const float *new_values,
                   int64_t new_row_stride, int threads) {
    const int64_t group = heads / kv_heads, items = rows * heads;
    if (new_keys != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t at = offsets[r] + g * head_stride + last[r] * dim, from = r * new_row_stride + g * dim;
                memcpy(keys + at, new_keys + from, sizeof(float) * (size_t)dim);
                memcpy(values + at, new_values + from, sizeof(float) * (size_t)dim);
            }
    int64_t longest = 0, work = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t count = last[r] - first[r] + 1;
        longest = count > longest ? count : longest;
        work += count;
    }
    /* Threads only where the work outweighs waking them (a few microseconds). */
    const int parallel = threads > 1 && items > 1 && work * heads * dim >= (1 << 17);
    int failed = 0;
#pragma omp parallel if (parallel) num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)((longest + LANES - 1) / LANES * LANES));
        failed |= scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t done = 0; done < items; done++) {
            /* the last rows first: in a prompt they read the most keys, and the threads end together */
            const int64_t item = items - 1 - done;
            if (scores == NULL) continue;
            const int64_t r = item / heads, h = item % heads;
            const int64_t at = offsets[r] + h / group * head_stride + first[r] * dim;
            attend_any(q + r * q_row_stride + h * dim, keys + at, values + at, last[r] - first[r] + 1, dim, scale,
                       scores, out + item * dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
