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

/* `rows` (at most ROWS_A_PASS) rows of x times one lane block; `rows` is a constant in each inlined copy. */
static inline __attribute__((always_inline)) void q4_lanes(const float *x, int64_t in_features, const int rows,
        const uint8_t *block, int64_t groups, float *out, int64_t out_features)
{
    vec first[ROWS_A_PASS], second[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) { first[r] = vzero(); second[r] = vzero(); }
    for (int64_t g = 0; g < groups; g++) {
        const float *scales = (const float *)(block + g * Q4_RECORD);
        const vec scale = vload(scales), minimum = vload(scales + LANES);
        const uint8_t *nib = block + g * Q4_RECORD + 2 * LANES * 4;
        const float *xg = x + g * 32;
        for (int kk = 0; kk < 16; kk++) {
            vec lo, hi;
            q4_decode(nib + kk * LANES, scale, minimum, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                first[r] = vfma(vset1(xg[r * in_features + kk]), lo, first[r]);
                second[r] = vfma(vset1(xg[r * in_features + kk + 16]), hi, second[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) vstore(out + r * out_features, vadd(first[r], second[r]));
}

static inline __attribute__((always_inline)) void q8_lanes(const float *x, int64_t in_features, const int rows,
        const uint8_t *block, int64_t groups, float *out, int64_t out_features)
{
    vec first[ROWS_A_PASS], second[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) { first[r] = vzero(); second[r] = vzero(); }
    for (int64_t g = 0; g < groups; g++) {
        const vec scale = vload((const float *)(block + g * Q8_RECORD));
        const int8_t *q = (const int8_t *)(block + g * Q8_RECORD + LANES * 4);
        const float *xg = x + g * 32;
        for (int kk = 0; kk < 16; kk++) {
            const vec lo = q8_decode(q + kk * LANES, scale), hi = q8_decode(q + (kk + 16) * LANES, scale);
            for (int r = 0; r < rows; r++) {
                first[r] = vfma(vset1(xg[r * in_features + kk]), lo, first[r]);
                second[r] = vfma(vset1(xg[r * in_features + kk + 16]), hi, second[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) vstore(out + r * out_features, vadd(first[r], second[r]));
}

#define PASS_CASE(kind, n) case n: kind##_lanes(x + r0 * in_features, in_features, n, block, groups, \
                                                out + r0 * out_features + b * LANES, out_features); break;

#if ROWS_A_PASS == 8
#define PASSES(kind) PASS_CASE(kind, 1) PASS_CASE(kind, 2) PASS_CASE(kind, 3) PASS_CASE(kind, 4) \
                     PASS_CASE(kind, 5) PASS_CASE(kind, 6) PASS_CASE(kind, 7) PASS_CASE(kind, 8)
#else
#define PASSES(kind) PASS_CASE(kind, 1) PASS_CASE(kind, 2) PASS_CASE(kind, 3) PASS_CASE(kind, 4)
#endif

/* Lane blocks are shared among the threads; each block multiplies every row, ROWS_A_PASS at a time, while its
 * records are in cache. */
#define PRODUCT(kind, record)                                                                                  \
void kind##_product(const float *x, int64_t rows, int64_t in_features, const uint8_t *packed,                 \
                    int64_t out_features, float *out)                                                        \
{                                                                                                            \
    const int64_t blocks = out_features / LANES, groups = in_features / 32;                                  \
    _Pragma("omp parallel for schedule(static)")                                                             \
    for (int64_t b = 0; b < blocks; b++) {                                                                   \
        const uint8_t *block = packed + b * groups * record;                                                 \
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_PASS) {                                                 \
            const int n = rows - r0 < ROWS_A_PASS ? (int)(rows - r0) : ROWS_A_PASS;                          \
            switch (n) { PASSES(kind) }                                                                      \
        }                                                                                                    \
    }                                                                                                        \
}

PRODUCT(q4, Q4_RECORD)
PRODUCT(q8, Q8_RECORD)
