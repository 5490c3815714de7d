/* Products of float32 rows with group-quantised weights (GGUF Q4_1 and Q8_0), de-quantised inside the product.
 *
 * out[r][n] = sum_k x[r][k] * w[n][k], where each weight is rebuilt exactly as its float32 value:
 *   Q4_1: w = scale * q + minimum (q in 0..15; scale * q is exact in float32, one rounding for the sum),
 *   Q8_0: w = scale * q (q in -128..127; exact).
 * Only the bytes of the groups are read (6 or 9 bits a weight, scales widened to float32, instead of 32): a
 * decode step is bound by memory bandwidth, so fewer bytes is a faster step.
 *
 * Layout (see gguf_groups.py, which packs it): 16 output features share a "lane block"; for each lane block and
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

#if defined(__AVX512F__)
#define TILE_BLOCKS 2       /* lane blocks sharing each row's broadcast inputs */
#define TILE_ROWS 6         /* rows a pass: 6 x 2 x 2 sums, 4 weight vectors and 2 inputs in 32 registers */
#else
#define TILE_BLOCKS 1
#define TILE_ROWS 4
#endif

/* Group g of `blocks` lane blocks (decoded in `tile`, blocks x 32 x 16) for `rows` rows, carrying each row's
 * sums (rows x TILE_BLOCKS x 2 x 16) from one group to the next. `rows` and `blocks` are constants in each
 * inlined copy. */
static inline __attribute__((always_inline)) void tile_pass(const float *x, int64_t in_features, const int rows,
        const int blocks, const float *tile, int64_t g, float *sums)
{
    vec first[TILE_ROWS][TILE_BLOCKS], second[TILE_ROWS][TILE_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < blocks; k++) {
            first[r][k] = vload(sums + ((r * TILE_BLOCKS + k) * 2) * LANES);
            second[r][k] = vload(sums + ((r * TILE_BLOCKS + k) * 2 + 1) * LANES);
        }
    const float *xg = x + g * 32;
    for (int kk = 0; kk < 16; kk++) {
        vec lo[TILE_BLOCKS], hi[TILE_BLOCKS];
        for (int k = 0; k < blocks; k++) {
            lo[k] = vload(tile + (k * 32 + kk) * LANES);
            hi[k] = vload(tile + (k * 32 + kk + 16) * LANES);
        }
        for (int r = 0; r < rows; r++) {
            const vec low_input = vset1(xg[r * in_features + kk]), high_input = vset1(xg[r * in_features + kk + 16]);
            for (int k = 0; k < blocks; k++) {
                first[r][k] = vfma(low_input, lo[k], first[r][k]);
                second[r][k] = vfma(high_input, hi[k], second[r][k]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < blocks; k++) {
            vstore(sums + ((r * TILE_BLOCKS + k) * 2) * LANES, first[r][k]);
            vstore(sums + ((r * TILE_BLOCKS + k) * 2 + 1) * LANES, second[r][k]);
        }
}

#define DIRECT_CASE(n) case n: lanes(source, x + r0 * in_features, in_features, n, block, groups, \
                                     out + r0 * out_features + b * LANES, out_features); break;
#define TILE_CASE(nb, n) case (nb) * 16 + (n): tile_pass(x + r0 * in_features, in_features, n, nb, tile, g, \
                                                        sums + r0 * TILE_BLOCKS * 2 * LANES); break;
#if ROWS_A_PASS == 8
#define DIRECT_PASSES DIRECT_CASE(1) DIRECT_CASE(2) DIRECT_CASE(3) DIRECT_CASE(4) DIRECT_CASE(5) DIRECT_CASE(6) \
                      DIRECT_CASE(7) DIRECT_CASE(8)
#else
#define DIRECT_PASSES DIRECT_CASE(1) DIRECT_CASE(2) DIRECT_CASE(3) DIRECT_CASE(4)
#endif
#if TILE_BLOCKS == 2
#define TILE_PASSES TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4) TILE_CASE(1, 5) TILE_CASE(1, 6) \
                    TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4) TILE_CASE(2, 5) TILE_CASE(2, 6)
#else
#define TILE_PASSES TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
#endif

/* Lane block b for every row, ROWS_A_PASS rows a pass, its weights decoded inside each pass. */
static inline __attribute__((always_inline)) void direct(const int source, const int record, const float *x,
        int64_t rows, int64_t in_features, const uint8_t *packed, int64_t b, float *out, int64_t out_features)
{
    const int64_t groups = in_features / 32;
    const uint8_t *block = packed + b * groups * record;
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_PASS) {
        const int n = rows - r0 < ROWS_A_PASS ? (int)(rows - r0) : ROWS_A_PASS;
        switch (n) { DIRECT_PASSES }
    }
}

/* Lane blocks are shared among `threads` threads (PyTorch's count, passed in: the caller's thread may not be
 * the one that set it). Up to ROWS_A_PASS rows, each block's weights are decoded inside the product and the
 * sums stay in registers. More rows: TILE_BLOCKS blocks at a time, each group's weights are decoded once
 * into a small tile, every row multiplies them TILE_ROWS rows a pass, and the sums wait in cache between
 * groups. Each output gets the same products added in the same order either way: the same numbers. */
#define PRODUCT(name, source, record)                                                                                \
void name(const float *x, int64_t rows, int64_t in_features, const uint8_t *packed, int64_t out_features,            \
          float *out, int threads)                                                                                   \
{                                                                                                                    \
    const int64_t blocks = out_features / LANES, groups = in_features / 32;                                          \
    if (rows <= ROWS_A_PASS) {                                                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                            \
        for (int64_t b = 0; b < blocks; b++)                                                                         \
            direct(source, record, x, rows, in_features, packed, b, out, out_features);                              \
        return;                                                                                                      \
    }                                                                                                                \
    const int64_t tiles = (blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;                                                  \
    _Pragma("omp parallel num_threads(threads)")                                                                     \
    {                                                                                                                \
        float *tile = aligned_alloc(64, TILE_BLOCKS * 32 * LANES * sizeof(float));                                   \
        float *sums = aligned_alloc(64, (size_t)rows * TILE_BLOCKS * 2 * LANES * sizeof(float));                     \
        _Pragma("omp for schedule(static)")                                                                          \
        for (int64_t t = 0; t < tiles; t++) {                                                                        \
            const int64_t first_block = t * TILE_BLOCKS;                                                             \
            const int nb = blocks - first_block < TILE_BLOCKS ? (int)(blocks - first_block) : TILE_BLOCKS;           \
            if (tile == NULL || sums == NULL) {                                                                      \
                for (int k = 0; k < nb; k++) direct(source, record, x, rows, in_features, packed, first_block + k,   \
                                                    out, out_features);                                              \
                continue;                                                                                            \
            }                                                                                                        \
            for (int64_t i = 0; i < rows * TILE_BLOCKS * 2; i++) vstore(sums + i * LANES, vzero());                  \
            for (int64_t g = 0; g < groups; g++) {                                                                   \
                for (int k = 0; k < nb; k++)                                                                         \
                    for (int kk = 0; kk < 16; kk++) {                                                                \
                        vec lo, hi;                                                                                  \
                        weights_at(source, packed + (first_block + k) * groups * record, g, kk, &lo, &hi);           \
                        vstore(tile + (k * 32 + kk) * LANES, lo);                                                    \
                        vstore(tile + (k * 32 + kk + 16) * LANES, hi);                                               \
                    }                                                                                                \
                for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {                                                   \
                    const int n = rows - r0 < TILE_ROWS ? (int)(rows - r0) : TILE_ROWS;                              \
                    switch (nb * 16 + n) { TILE_PASSES }                                                             \
                }                                                                                                    \
            }                                                                                                        \
            for (int64_t r = 0; r < rows; r++)                                                                       \
                for (int k = 0; k < nb; k++)                                                                         \
                    vstore(out + r * out_features + (first_block + k) * LANES,                                       \
                           vadd(vload(sums + ((r * TILE_BLOCKS + k) * 2) * LANES),                                   \
                                vload(sums + ((r * TILE_BLOCKS + k) * 2 + 1) * LANES)));                             \
        }                                                                                                            \
        free(tile);                                                                                                  \
        free(sums);                                                                                                  \
    }                                                                                                                \
}

/* One function, and so one set of OpenMP regions, per kind: the kind is a constant inside its loops. */
PRODUCT(q4_product, FROM_Q4, Q4_RECORD)
PRODUCT(q8_product, FROM_Q8, Q8_RECORD)
