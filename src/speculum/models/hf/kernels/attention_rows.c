/* Causal attention of many query rows in one call, each (row, head) computed alone in one fixed order.
 *
 * For query row r and head h (key/value head h / (heads / kv_heads)), reading keys first[r] .. last[r]:
 *   s_j = reduce16(sum over 16-lane chunks of q * k_j) * scale          (the chunks in order, lane by lane)
 *   e_j = exp(s_j - max_j s_j)                                            (exp: Cephes' polynomial, below)
 *   out = (sum over j in order of e_j * v_j) / reduce16(lane sums of e)
 * where reduce16 adds lane l and l + 8, then l and l + 4, l + 2, l + 1: one tree for every score. Every
 * operation is a float32 add, multiply or divide (no contraction, no fast-math), so the output is the same
 * function of the row's query and its keys and values whatever else the call holds, the thread that runs it,
 * or the vector width the compiler chose (ROW-CANONICAL by construction). Up to 4 query heads that share a
 * key/value head are attended in one pass over its keys and values: they share the loads, not the arithmetic.
 *
 * Layouts: q row r, head h at q + r * q_row_stride + h * dim; row r's keys for key/value head g at
 * keys + offsets[r] + g * head_stride + position * dim (a slot of a store, or a sequence of a batch), its
 * values alike in values; out (rows, heads, dim) row-major. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* A 16-lane chunk is held as HALVES vectors of NATIVE lanes, the CPU's own width: a vector wider than its
 * registers lives on the stack, every operation on it a load and a store. Every operation is lane by lane and
 * the score tree adds the same pairs at any width, so the width changes no number. NATIVE_LANES=16 builds
 * AVX-512's code on any CPU (tested against the native build). */
#if defined(NATIVE_LANES)
#define NATIVE NATIVE_LANES
#elif defined(__AVX512F__)
#define NATIVE 16
#else
#define NATIVE 8
#endif
#define HALVES (LANES / NATIVE)
#define VALUE_PASS 4

typedef float vec __attribute__((vector_size(NATIVE * 4)));
typedef int32_t ivec __attribute__((vector_size(NATIVE * 4)));
typedef float uvec __attribute__((vector_size(NATIVE * 4), aligned(4)));      /* an unaligned load or store */

static inline vec load(const float *p) { return *(const uvec *)p; }
static inline void store(float *p, vec v) { *(uvec *)p = v; }
/* 0 + x in every lane (-0 becomes +0): a broadcast and one add. A lane-by-lane assignment of the scalar
 * compiles to a chain of inserts on AVX2, in the values' inner loop. */
static inline vec splat(float x) { return (vec){0} + x; }
/* *p in every lane, one load (p's value as it is: -0 stays -0). */
static inline vec broadcast(const float *p) {
#if NATIVE == 16
    return (vec){*p, *p, *p, *p, *p, *p, *p, *p, *p, *p, *p, *p, *p, *p, *p, *p};
#else
    return (vec){*p, *p, *p, *p, *p, *p, *p, *p};
#endif
}

/* The 16 lanes of a chunk (its HALVES vectors) added by the same tree. */
static inline float sum16(const vec v[HALVES]) {
    float t[LANES];
    for (int h = 0; h < HALVES; h++) store(t + h * NATIVE, v[h]);
    for (int width = 8; width; width /= 2)
        for (int l = 0; l < width; l++) t[l] += t[l + width];
    return t[0];
}

/* Scores of 16 keys from their 16 lane partials (part[j][h]: lanes h NATIVE ..), times scale, into out[0 .. 15]:
 * out[j] = tree(part[j]) * scale (see the header). Keys missing from a last block have zero partials and do not
 * change the others. */
#if NATIVE == 16
static inline vec tree16(const vec part[LANES]) {
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

static inline void scores16(const vec part[LANES][HALVES], float scale, float *out) {
    vec whole[LANES];
    for (int j = 0; j < LANES; j++) whole[j] = part[j][0];
    store(out, tree16(whole) * splat(scale));
}
#elif defined(__AVX2__)
#include <immintrin.h>
/* The tree's first step (lanes l and l + 8) adds the two halves; then 128-bit halves (l and l + 4), pairs
 * within them (l + 2), neighbours (l + 1), eight keys a register. */
static inline vec scores8(const vec t[8]) {
    __m256 u[4], w[2];
    for (int j = 0; j < 4; j++)        /* [key 2j's l + l+4 | key 2j+1's], l < 4 */
        u[j] = _mm256_add_ps(_mm256_permute2f128_ps((__m256)t[2 * j], (__m256)t[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps((__m256)t[2 * j], (__m256)t[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++)        /* [keys 4j, 4j+2: l + l+2, l < 2 | keys 4j+1, 4j+3] */
        w[j] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * j], u[2 * j + 1], 0x44),
                             _mm256_shuffle_ps(u[2 * j], u[2 * j + 1], 0xEE));
    /* lanes: keys 0, 2, 4, 6 | 1, 3, 5, 7, then in order */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xDD));
    return (vec)_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline void scores16(const vec part[LANES][HALVES], float scale, float *out) {
    vec t[LANES];
    for (int j = 0; j < LANES; j++) t[j] = part[j][0] + part[j][1];
    store(out, scores8(t) * splat(scale));
    store(out + 8, scores8(t + 8) * splat(scale));
}
#else
static inline void scores16(const vec part[LANES][HALVES], float scale, float *out) {
    for (int j = 0; j < LANES; j++) out[j] = sum16(part[j]) * (0.0f + scale);
}
#endif

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

/* A tail of n < 16 floats as one chunk, zeros after it. */
static inline void load_tail(const float *p, int64_t n, vec out[HALVES]) {
    float t[LANES] = {0};
    for (int64_t i = 0; i < n; i++) t[i] = p[i];
    for (int h = 0; h < HALVES; h++) out[h] = load(t + h * NATIVE);
}

#define GROUP_MAX 4          /* query heads attended together over one read of their shared keys and values */

/* Heads h .. h + n - 1 (n <= GROUP_MAX) of one row, which share one key/value head: `count` keys and values
 * from k and v (rows of dim floats), queries at q (n rows of dim floats), outputs at out (alike); scores holds
 * n times count rounded up to 16 floats. Each head's operations are those of the head alone, in the same
 * order; the heads only share the loads (a block of 16 keys stays in the first-level cache for all of them,
 * and each value row is read once for all). A width that is not a multiple of 16 ends in a partial chunk,
 * zeros after it. Inlined with dim and n constants for the common shapes. */
static inline __attribute__((always_inline)) void attend_heads(const float *q, const int64_t n, const float *k,
                                                               const float *v, int64_t count, const int64_t dim,
                                                               float scale, float *scores, float *out) {
    const int64_t chunks = dim / LANES, tail = dim % LANES, used = chunks + (tail > 0);
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t j0 = 0; j0 < count; j0 += LANES) {
        const int64_t n_keys = count - j0 < LANES ? count - j0 : LANES;
        for (int64_t head = 0; head < n; head++) {
            const float *qh = q + head * dim;
            vec query[used][HALVES];
            for (int64_t c = 0; c < chunks; c++)
                for (int h = 0; h < HALVES; h++) query[c][h] = load(qh + c * LANES + h * NATIVE);
            if (tail) load_tail(qh + chunks * LANES, tail, query[chunks]);
            vec part[LANES][HALVES];
            for (int64_t jj = 0; jj < LANES; jj++) {
                vec sum[HALVES], key_tail[HALVES];
                for (int h = 0; h < HALVES; h++) sum[h] = (vec){0};
                if (jj < n_keys) {
                    const float *key = k + (j0 + jj) * dim;
                    if (!chunks) load_tail(key, tail, key_tail);
                    for (int h = 0; h < HALVES; h++)
                        sum[h] = query[0][h] * (chunks ? load(key + h * NATIVE) : key_tail[h]);
                    for (int64_t c = 1; c < chunks; c++)
                        for (int h = 0; h < HALVES; h++) sum[h] += query[c][h] * load(key + c * LANES + h * NATIVE);
                    if (tail && chunks) {
                        load_tail(key + chunks * LANES, tail, key_tail);
                        for (int h = 0; h < HALVES; h++) sum[h] += query[chunks][h] * key_tail[h];
                    }
                }
                for (int h = 0; h < HALVES; h++) part[jj][h] = sum[h];
            }
            scores16(part, scale, scores + head * padded + j0);
        }
    }
    vec sum[GROUP_MAX];
    for (int64_t head = 0; head < n; head++) {
        float *sh = scores + head * padded;
        for (int64_t j = count; j < padded; j++) sh[j] = -INFINITY;
        /* The largest score, 16 lanes at a time: a scalar chain would wait on each comparison's latency. The
         * same value in any order (NaN past the first score left out as before, the -inf padding never wins;
         * a tie of -0 and +0 gives the same exponentials). */
        vec top = splat(sh[0]);
        for (int64_t j0 = 0; j0 < padded; j0 += NATIVE) {
            const vec v = load(sh + j0);
            const ivec more = v > top;
            top = (vec)(((ivec)v & more) | ((ivec)top & ~more));
        }
        float best = top[0];
        for (int l = 1; l < NATIVE; l++) best = top[l] > best ? top[l] : best;
        vec total[HALVES];
        for (int h = 0; h < HALVES; h++) total[h] = (vec){0};
        for (int64_t j0 = 0; j0 < padded; j0 += LANES)
            for (int h = 0; h < HALVES; h++) {
                const vec e = exp_nonpositive(load(sh + j0 + h * NATIVE) - splat(best));
                store(sh + j0 + h * NATIVE, e);
                total[h] += e;
            }
        sum[head] = splat(sum16(total));
    }
    /* Values in passes of up to `pass` vectors, each pass's accumulators (`pass` a head) in registers: 4 of
     * AVX-512's 32 registers a head; on AVX2's 16, 4 for up to 3 heads (12), else 2. */
    const int64_t pass = NATIVE == 16 || n <= 3 ? VALUE_PASS : VALUE_PASS / 2;
    for (int64_t c0 = 0; c0 < chunks * HALVES; c0 += pass) {
        const int64_t width = chunks * HALVES - c0 < pass ? chunks * HALVES - c0 : pass;
        vec acc[GROUP_MAX][VALUE_PASS];
        for (int64_t head = 0; head < n; head++)
            for (int64_t c = 0; c < pass; c++) acc[head][c] = (vec){0};
        for (int64_t j = 0; j < count; j++) {
            const float *value = v + j * dim + c0 * NATIVE;
            for (int64_t head = 0; head < n; head++) {
                /* an exponential is never -0: its broadcast is 0 + it, splat's value */
                const vec weight = broadcast(scores + head * padded + j);
                for (int64_t c = 0; c < width; c++) acc[head][c] += weight * load(value + c * NATIVE);
            }
        }
        for (int64_t head = 0; head < n; head++)
            for (int64_t c = 0; c < width; c++)
                store(out + head * dim + (c0 + c) * NATIVE, acc[head][c] / sum[head]);
    }
    for (int64_t head = 0; head < n; head++)
        for (int64_t i = chunks * LANES; i < dim; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < count; j++) acc += scores[head * padded + j] * v[j * dim + i];
            out[head * dim + i] = acc / sum[head][0];
        }
}

#define HEADS(n) switch (dim) {                                                                               \
    case 64: attend_heads(q, n, k, v, count, 64, scale, scores, out); break;                                  \
    case 128: attend_heads(q, n, k, v, count, 128, scale, scores, out); break;                                \
    case 256: attend_heads(q, n, k, v, count, 256, scale, scores, out); break;                                \
    default: attend_heads(q, n, k, v, count, dim, scale, scores, out); }

static void attend_any(const float *q, int64_t n, const float *k, const float *v, int64_t count, int64_t dim,
                       float scale, float *scores, float *out) {
    switch (n) {
    case 1: HEADS(1) break;
    case 2: HEADS(2) break;
    case 3: HEADS(3) break;
    default: HEADS(4) break;
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
    /* A work item is up to GROUP_MAX heads of one row sharing a key/value head, or a single head where that
     * would leave fewer items than two per thread: the same operations for each head either way. */
    const int64_t together = group < GROUP_MAX ? group : GROUP_MAX;
    const int64_t per_item = parallel && rows * kv_heads * ((group + together - 1) / together) < 2 * threads
                             ? 1 : together;
    const int64_t parts = (group + per_item - 1) / per_item, grouped = rows * kv_heads * parts;
    int failed = 0;
#pragma omp parallel if (parallel) num_threads(threads) reduction(| : failed)
    {
        const int64_t padded = (longest + LANES - 1) / LANES * LANES;
        float *scores = malloc(sizeof(float) * (size_t)(padded * per_item));
        failed |= scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t done = 0; done < grouped; done++) {
            /* the last rows first: in a prompt they read the most keys, and the threads end together */
            const int64_t item = grouped - 1 - done;
            if (scores == NULL) continue;
            const int64_t r = item / (kv_heads * parts), g = item / parts % kv_heads, part = item % parts;
            const int64_t h = g * group + part * per_item;
            const int64_t n = group - part * per_item < per_item ? group - part * per_item : per_item;
            const int64_t at = offsets[r] + g * head_stride + first[r] * dim;
            attend_any(q + r * q_row_stride + h * dim, n, keys + at, values + at, last[r] - first[r] + 1, dim,
                       scale, scores, out + (r * heads + h) * dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
