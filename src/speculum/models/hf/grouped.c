/* Products of float32 rows with group-quantised weights (GGUF Q4_1 and Q8_0), de-quantised inside the product.
 *
 * out[r][n] = sum_k x[r][k] * w[n][k], where each weight is rebuilt exactly as its float32 value:
 *   Q4_1: w = scale * q + minimum (q in 0..15; scale * q is exact in float32, one rounding for the sum),
 *   Q8_0: w = scale * q (q in -128..127; exact).
 * Only the bytes of the groups are read (4.5 or 8.5 bits a weight instead of 32): a decode step is bound by
 * memory bandwidth, so fewer bytes is a faster step.
 *
 * Layout (see grouped.py, which packs it): 16 output features share a "lane block"; for each lane block and
 * each group of 32 inputs one record holds the 16 features' float32 scales (and minimums), then the 32 x 16
 * quantised weights, input-major. Q4_1: byte [kk][lane] holds input kk (low nibble) and kk + 16 (high).
 *
 * Every output element is accumulated in one fixed order, whatever the number of rows and the thread split:
 * two fused multiply-add chains over the inputs of the group's first and second half, added at the end.
 * A row's outputs therefore never depend on the rows multiplied with it (ROW-CANONICAL).
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

#define LANES 16
#define Q4_RECORD (2 * LANES * 4 + 16 * LANES)      /* scales, minimums, 16 x 16 nibble pairs: 384 bytes */
#define Q8_RECORD (LANES * 4 + 32 * LANES)          /* scales, 32 x 16 int8: 576 bytes */

#if defined(__AVX512F__)
#define ROWS_A_PASS 8
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline void q4_decode(const uint8_t *nib, vec scale, vec minimum, vec *lo, vec *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)nib));
    *lo = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), minimum);
    *hi = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), minimum);
}
static inline vec q8_decode(const int8_t *q, vec scale) {
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ROWS_A_PASS 4
typedef struct { __m256 a, b; } vec;           /* 16 lanes as two halves */
static inline vec vzero(void) { vec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline vec vload(const float *p) { vec v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return v; }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline vec vfma(vec a, vec b, vec c) {
    vec v = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; return v;
}
static inline vec vadd(vec a, vec b) { vec v = {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; return v; }
static inline vec vmul(vec a, vec b) { vec v = {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; return v; }
static inline vec vset1(float a) { vec v = {_mm256_set1_ps(a), _mm256_set1_ps(a)}; return v; }
static inline void q4_decode(const uint8_t *nib, vec scale, vec minimum, vec *lo, vec *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)nib);
    const __m256i first = _mm256_cvtepu8_epi32(b), second = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i low = _mm256_set1_epi32(15);
    vec l = {_mm256_cvtepi32_ps(_mm256_and_si256(first, low)), _mm256_cvtepi32_ps(_mm256_and_si256(second, low))};
    vec h = {_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4))};
    *lo = vfma(scale, l, minimum);
    *hi = vfma(scale, h, minimum);
}
static inline vec q8_decode(const int8_t *q, vec scale) {
    vec w = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))))};
    return vmul(scale, w);
}
#else
#error "grouped products need AVX2 with FMA, or AVX-512"
#endif

enum { FROM_Q4, FROM_Q8 };     /* how a lane block's weights are stored */

/* The 16 lanes' weights of inputs kk and kk + 16 of group g, decoded from the records. `source` is a constant
 * in each inlined copy. */
static inline __attribute__((always_inline)) void weights_at(const int source, const uint8_t *block, int64_t g,
        int kk, vec *lo, vec *hi)
{
    if (source == FROM_Q4) {
        const float *scales = (const float *)(block + g * Q4_RECORD);
        q4_decode(block + g * Q4_RECORD + 2 * LANES * 4 + kk * LANES, vload(scales), vload(scales + LANES), lo, hi);
    } else {
        const vec scale = vload((const float *)(block + g * Q8_RECORD));
        const int8_t *q = (const int8_t *)(block + g * Q8_RECORD + LANES * 4);
        *lo = q8_decode(q + kk * LANES, scale);
        *hi = q8_decode(q + (kk + 16) * LANES, scale);
    }
}

/* `rows` (at most ROWS_A_PASS) rows of x times one lane block; `rows` is a constant in each inlined copy. */
static inline __attribute__((always_inline)) void lanes(const int source, const float *x, int64_t in_features,
        const int rows, const uint8_t *block, int64_t groups, float *out, int64_t out_features)
{
    vec first[ROWS_A_PASS], second[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) { first[r] = vzero(); second[r] = vzero(); }
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * 32;
        for (int kk = 0; kk < 16; kk++) {
            vec lo, hi;
            weights_at(source, block, g, kk, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                first[r] = vfma(vset1(xg[r * in_features + kk]), lo, first[r]);
                second[r] = vfma(vset1(xg[r * in_features + kk + 16]), hi, second[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) vstore(out + r * out_features, vadd(first[r], second[r]));
}

/* One group of a lane block for `rows` (at most ROWS_A_PASS) rows, from its decoded weights `tile` (32 x 16),
 * carrying each row's two sums in `sums` (rows x 2 x 16) from one group to the next. */
static inline __attribute__((always_inline)) void group_pass(const float *x, int64_t in_features, const int rows,
        const float *tile, int64_t g, float *sums)
{
    vec first[ROWS_A_PASS], second[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) { first[r] = vload(sums + 2 * r * LANES); second[r] = vload(sums + (2 * r + 1) * LANES); }
    const float *xg = x + g * 32;
    for (int kk = 0; kk < 16; kk++) {
        const vec lo = vload(tile + kk * LANES), hi = vload(tile + (kk + 16) * LANES);
        for (int r = 0; r < rows; r++) {
            first[r] = vfma(vset1(xg[r * in_features + kk]), lo, first[r]);
            second[r] = vfma(vset1(xg[r * in_features + kk + 16]), hi, second[r]);
        }
    }
    for (int r = 0; r < rows; r++) { vstore(sums + 2 * r * LANES, first[r]); vstore(sums + (2 * r + 1) * LANES, second[r]); }
}

#define PASS_CASE(source, n) case n: lanes(source, x + r0 * in_features, in_features, n, block, groups, \
                                           out + r0 * out_features + b * LANES, out_features); break;
#define GROUP_CASE(n) case n: group_pass(x + r0 * in_features, in_features, n, tile, g, sums + r0 * 2 * LANES); break;

#if ROWS_A_PASS == 8
#define PASSES(source) PASS_CASE(source, 1) PASS_CASE(source, 2) PASS_CASE(source, 3) PASS_CASE(source, 4) \
                       PASS_CASE(source, 5) PASS_CASE(source, 6) PASS_CASE(source, 7) PASS_CASE(source, 8)
#define GROUP_PASSES GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4) GROUP_CASE(5) GROUP_CASE(6) \
                     GROUP_CASE(7) GROUP_CASE(8)
#else
#define PASSES(source) PASS_CASE(source, 1) PASS_CASE(source, 2) PASS_CASE(source, 3) PASS_CASE(source, 4)
#define GROUP_PASSES GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4)
#endif

/* Lane blocks are shared among the threads. Up to ROWS_A_PASS rows, a block's weights are decoded inside the
 * product and the sums stay in registers. More rows: each group's weights are decoded once into a small
 * tile, every row multiplies them ROWS_A_PASS rows at a time, and the sums wait in cache between groups.
 * Both add the same products in the same order: the same numbers. */
#define PRODUCT(kind, record, source)                                                                          \
void kind##_product(const float *x, int64_t rows, int64_t in_features, const uint8_t *packed,                 \
                    int64_t out_features, float *out)                                                        \
{                                                                                                            \
    const int64_t blocks = out_features / LANES, groups = in_features / 32;                                  \
    _Pragma("omp parallel")                                                                                  \
    {                                                                                                        \
        float *tile = NULL, *sums = NULL;                                                                    \
        if (rows > ROWS_A_PASS) {                                                                            \
            tile = aligned_alloc(64, 32 * LANES * sizeof(float));                                            \
            sums = aligned_alloc(64, (size_t)rows * 2 * LANES * sizeof(float));                              \
        }                                                                                                    \
        _Pragma("omp for schedule(static)")                                                                  \
        for (int64_t b = 0; b < blocks; b++) {                                                               \
            const uint8_t *block = packed + b * groups * record;                                             \
            if (tile == NULL || sums == NULL) {                                                              \
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_PASS) {                                         \
                    const int n = rows - r0 < ROWS_A_PASS ? (int)(rows - r0) : ROWS_A_PASS;                  \
                    switch (n) { PASSES(source) }                                                            \
                }                                                                                            \
                continue;                                                                                    \
            }                                                                                                \
            for (int64_t i = 0; i < rows * 2; i++) vstore(sums + i * LANES, vzero());                        \
            for (int64_t g = 0; g < groups; g++) {                                                           \
                for (int kk = 0; kk < 16; kk++) {                                                            \
                    vec lo, hi;                                                                              \
                    weights_at(source, block, g, kk, &lo, &hi);                                        \
                    vstore(tile + kk * LANES, lo);                                                           \
                    vstore(tile + (kk + 16) * LANES, hi);                                                    \
                }                                                                                            \
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_PASS) {                                         \
                    const int n = rows - r0 < ROWS_A_PASS ? (int)(rows - r0) : ROWS_A_PASS;                  \
                    switch (n) { GROUP_PASSES }                                                              \
                }                                                                                            \
            }                                                                                                \
            for (int64_t r = 0; r < rows; r++)                                                               \
                vstore(out + r * out_features + b * LANES,                                                   \
                       vadd(vload(sums + 2 * r * LANES), vload(sums + (2 * r + 1) * LANES)));                \
        }                                                                                                    \
        free(tile);                                                                                          \
        free(sums);                                                                                          \
    }                                                                                                        \
}

PRODUCT(q4, Q4_RECORD, FROM_Q4)
PRODUCT(q8, Q8_RECORD, FROM_Q8)
