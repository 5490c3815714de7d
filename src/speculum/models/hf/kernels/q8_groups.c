/* Products of rows quantised to 8 bits (blocks of 32, as llama.cpp's Q8_0 / Q8_1) with group-quantised
 * weights (GGUF blocks), by integer dot products.
 *
 * Rows: quantise_rows() cuts each row into blocks of 32 inputs and, for each block, keeps
 *   d = amax / 127 (float32; amax the largest |x| of the block), q = roundf(x * (1 / d)) in -127..127
 *   (round half away from zero; d = 0 gives q = 0), and the sums of q over its inputs 0..15 and 16..31 (int32),
 * as llama.cpp's quantize_row_q8_1_ref, except that d stays float32 (llama.cpp rounds it to float16) and the
 * sum comes in two halves (Q6_K's scales are per 16 inputs). A row's quants are a function of that row alone.
 *
 * Weights: records of 16 output lanes x 32 inputs (gguf_records.py), their quants repacked (q8_groups.py) so
 * that the 4 weights one 32-bit lane of VNNI's vpdpbusd multiplies are adjacent: 8 "quads" a group, quad k
 * holding inputs 4k .. 4k + 3 of the 16 lanes, byte p = 4 lane + i. After the scales (and minimums, or Q6_K's
 * second scales): q8_0: 8 quads of int8. The others: 4 chunks of 64 bytes, chunk v's low nibbles the low 4 bits
 * of quad v, its high nibbles those of quad 4 + v (the raw quants: 0..15, 0..31 or 0..63); q5_0, q5_1: then a
 * plane of 64 bytes whose byte p has bit k = bit 4 of quad k; q6_k: that plane, then one for bit 5.
 *
 * Each output, for row r, lane n, summed over the groups g in order, from 0, with S = S_lo + S_hi:
 *   I = sum_k wq[n][k] * xq[r][k] over the group's 32 inputs (int32, exact), minus offset * S for the kinds
 *       whose weight is scale * (q - offset) (q4_0: 8, q5_0: 16); then
 *   q4_0, q5_0, q8_0:  out += (scale[n] * d) * (float)I
 *   q4_1, q5_1:        out += (scale[n] * d) * (float)I, then out += (minimum[n] * d) * (float)S
 *   q6_k (q - 32, a scale per 16 inputs): I_lo, I_hi over inputs 0..15 and 16..31, each minus 32 * S_lo or
 *                      32 * S_hi; out += (scale_lo[n] * d) * (float)I_lo, then out += (scale_hi[n] * d) * (float)I_hi
 * every product and sum rounded to float32 as written (no fused multiply-add: -ffp-contract=off). |I| is below
 * 2^24, so (float)I is exact. The order does not depend on the number of rows, their position or the thread
 * split: a row's outputs never depend on the rows multiplied with it (ROW-CANONICAL).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define LANES 16
#define GROUP 32
#define SCALES (LANES * 4)                      /* one float32 a lane */
#define Q4_0_RECORD (SCALES + 256)
#define Q4_1_RECORD (2 * SCALES + 256)
#define Q5_0_RECORD (SCALES + 256 + 64)
#define Q5_1_RECORD (2 * SCALES + 256 + 64)
#define Q6_K_RECORD (2 * SCALES + 256 + 128)
#define Q8_0_RECORD (SCALES + 512)

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0 };

/* ------------------------------------------------------------------------------------------ the rows */

/* roundf's rounding (half away from zero) for |v| < 2^31, without the C library: the fraction v - trunc(v)
 * is exact in float32. */
static inline int round_away(float v)
{
    int i = (int)v;
    const float fraction = v - (float)i;
    if (fraction >= 0.5f) i++;
    else if (fraction <= -0.5f) i--;
    return i;
}

/* Rows (rows, in_features) -> quants (rows, in_features) int8, scales (rows, in_features / 32) float32, sums
 * (rows, in_features / 32, 2) int32 (inputs 0..15, 16..31 of each block). */
void quantise_rows(const float *x, int64_t rows, int64_t in_features, int8_t *q, float *d, int32_t *sums,
                   int threads)
{
    const int64_t blocks = rows * (in_features / GROUP);
    #pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 4096)
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * GROUP;
        float amax = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            const float a = xb[j] < 0.0f ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
        }
        const float scale = amax / 127.0f;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < GROUP; j++) {
            const int v = round_away(xb[j] * inverse);
            q[b * GROUP + j] = (int8_t)v;
            sum[j / 16] += v;
        }
        d[b] = scale;
        sums[2 * b] = sum[0];
        sums[2 * b + 1] = sum[1];
    }
}

/* ------------------------------------------------------------------------------------------ the vectors */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WIDTH 16                      /* lanes a vector */
#define ROWS_A_PASS 8
typedef __m512i ivec;
typedef __m512 fvec;
static inline ivec iload(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec low_nibbles(ivec b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
static inline ivec high_nibbles(ivec b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15)); }
static inline ivec izero(void) { return _mm512_setzero_si512(); }
/* q with `value` added in the bytes whose bit `bit` of `plane` is set. */
static inline ivec plane_bit(ivec q, ivec plane, int bit, int value)
{
    const __mmask64 set = _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(1 << bit)));
    return _mm512_mask_add_epi8(q, set, q, _mm512_set1_epi8((char)value));
}
/* u8 weights times 4 s8 inputs (broadcast), added in each 32-bit lane. */
static inline ivec dot_u8(ivec acc, ivec w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
/* int8 weights: VNNI takes unsigned weights, so w + 128 (w XOR 0x80) is multiplied; the caller subtracts 128 S. */
static inline ivec q8_weights(ivec w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
static inline ivec dot_s8(ivec acc, ivec w, int32_t x4) { return dot_u8(acc, w, x4); }
#define Q8_OFFSET 128
static inline ivec isub(ivec a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
static inline fvec fzero(void) { return _mm512_setzero_ps(); }
static inline fvec fload(const float *p) { return _mm512_loadu_ps(p); }
static inline void fstore(float *p, fvec v) { _mm512_storeu_ps(p, v); }
static inline fvec fset1(float v) { return _mm512_set1_ps(v); }
static inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec fadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
static inline fvec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
#elif defined(__AVX2__)
#define WIDTH 8
#define ROWS_A_PASS 4
typedef __m256i ivec;
typedef __m256 fvec;
static inline ivec iload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec low_nibbles(ivec b) { return _mm256_and_si256(b, _mm256_set1_epi8(15)); }
static inline ivec high_nibbles(ivec b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15)); }
static inline ivec izero(void) { return _mm256_setzero_si256(); }
static inline ivec plane_bit(ivec q, ivec plane, int bit, int value)
{
    const __m256i mask = _mm256_set1_epi8((char)(1 << bit));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(plane, mask), mask);
    return _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8((char)value)));
}
/* maddubs adds pairs of u8 x s8 products into int16 (at most 2 x 128 x 127 here: no saturation), madd the
 * pairs of int16 into int32. */
static inline ivec dot_u8(ivec acc, ivec w, int32_t x4)
{
    const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
/* int8 weights as llama.cpp multiplies them: |w| (u8) times the input with w's sign. */
static inline ivec q8_weights(ivec w) { return w; }
static inline ivec dot_s8(ivec acc, ivec w, int32_t x4)
{
    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#define Q8_OFFSET 0
static inline ivec isub(ivec a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
static inline fvec fzero(void) { return _mm256_setzero_ps(); }
static inline fvec fload(const float *p) { return _mm256_loadu_ps(p); }
static inline void fstore(float *p, fvec v) { _mm256_storeu_ps(p, v); }
static inline fvec fset1(float v) { return _mm256_set1_ps(v); }
static inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
static inline fvec fadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
static inline fvec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
#else
#error "8-bit products need AVX2, or AVX-512 VNNI"
#endif

/* ------------------------------------------------------------------------------------------ the products */

/* The 8 quads of group g (lanes `part` * WIDTH .. + WIDTH - 1 of the record), as the dot products take them. */
static inline __attribute__((always_inline)) void quads(const int kind, const uint8_t *at, int part, ivec w[8])
{
    const int bytes = WIDTH * 4;                      /* one quad of this part's lanes */
    if (kind == Q8_0) {
        for (int k = 0; k < 8; k++) w[k] = q8_weights(iload(at + SCALES + k * 64 + part * bytes));
        return;
    }
    const uint8_t *chunks = at + (kind == Q4_1 || kind == Q5_1 || kind == Q6_K ? 2 : 1) * SCALES;
    for (int v = 0; v < 4; v++) {
        const ivec b = iload(chunks + v * 64 + part * bytes);
        w[v] = low_nibbles(b);
        w[4 + v] = high_nibbles(b);
    }
    if (kind == Q5_0 || kind == Q5_1 || kind == Q6_K) {
        const ivec fifth = iload(chunks + 256 + part * bytes);
        for (int k = 0; k < 8; k++) w[k] = plane_bit(w[k], fifth, k, 16);
    }
    if (kind == Q6_K) {
        const ivec sixth = iload(chunks + 320 + part * bytes);
        for (int k = 0; k < 8; k++) w[k] = plane_bit(w[k], sixth, k, 32);
    }
}

/* `rows` rows (a constant in each inlined copy) times lanes `part` * WIDTH .. of one lane block. */
static inline __attribute__((always_inline)) void lanes(const int kind, const int record, const int rows,
        const int8_t *q, const float *d, const int32_t *sums, int64_t in_features, const uint8_t *block, int part,
        float *out, int64_t out_features)
{
    const int64_t groups = in_features / GROUP;
    fvec acc[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) acc[r] = fzero();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *at = block + g * record;
        const float *scales = (const float *)at;
        ivec w[8];
        quads(kind, at, part, w);
        const fvec scale = fload(scales + part * WIDTH);
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = q + r * in_features + g * GROUP;
            ivec low = izero(), high = izero();          /* inputs 0..15, 16..31 */
            for (int k = 0; k < 8; k++) {
                int32_t x4;
                memcpy(&x4, xq + 4 * k, 4);
                if (kind == Q8_0) low = dot_s8(low, w[k], x4);
                else if (kind == Q6_K && k >= 4) high = dot_u8(high, w[k], x4);
                else low = dot_u8(low, w[k], x4);
            }
            const float dr = d[r * groups + g];
            const int32_t s_low = sums[2 * (r * groups + g)], s_high = sums[2 * (r * groups + g) + 1];
            const int32_t sr = s_low + s_high;
            if (kind == Q4_0) low = isub(low, 8 * sr);
            if (kind == Q5_0) low = isub(low, 16 * sr);
            if (kind == Q8_0 && Q8_OFFSET) low = isub(low, Q8_OFFSET * sr);
            if (kind == Q6_K) {
                low = isub(low, 32 * s_low);
                high = isub(high, 32 * s_high);
            }
            acc[r] = fadd(acc[r], fmul(fmul(scale, fset1(dr)), to_float(low)));
            if (kind == Q4_1 || kind == Q5_1) {
                const fvec minimum = fload(scales + LANES + part * WIDTH);
                acc[r] = fadd(acc[r], fmul(fmul(minimum, fset1(dr)), fset1((float)sr)));
            }
            if (kind == Q6_K) {
                const fvec second = fload(scales + LANES + part * WIDTH);
                acc[r] = fadd(acc[r], fmul(fmul(second, fset1(dr)), to_float(high)));
            }
        }
    }
    for (int r = 0; r < rows; r++) fstore(out + r * out_features + part * WIDTH, acc[r]);
}

#define CASE(n) case n: lanes(kind, record, n, q + r0 * in_features, d + r0 * groups, sums + 2 * r0 * groups, \
                              in_features, block, part, out + r0 * out_features + b * LANES, out_features); break;
#if ROWS_A_PASS == 8
#define PASSES CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#else
#define PASSES CASE(1) CASE(2) CASE(3) CASE(4)
#endif

/* Lane blocks are shared among `threads` threads (PyTorch's count, passed in); each takes every row, ROWS_A_PASS
 * rows a pass, a group's quads unpacked once a pass. */
#define PRODUCT(name, KIND, RECORD)                                                                          \
void name(const int8_t *q, const float *d, const int32_t *sums, int64_t rows, int64_t in_features,           \
          const uint8_t *packed, int64_t out_features, float *out, int threads)                              \
{                                                                                                            \
    const int kind = KIND, record = RECORD;                                                                  \
    const int64_t blocks = out_features / LANES, groups = in_features / GROUP;                               \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                        \
    for (int64_t b = 0; b < blocks; b++) {                                                                   \
        const uint8_t *block = packed + b * groups * record;                                                 \
        for (int part = 0; part < LANES / WIDTH; part++)                                                     \
            for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_PASS) {                                             \
                const int n = rows - r0 < ROWS_A_PASS ? (int)(rows - r0) : ROWS_A_PASS;                      \
                switch (n) { PASSES }                                                                        \
            }                                                                                                \
    }                                                                                                        \
}

/* Float32 rows quantised (quantise_rows) into a buffer of this call, then multiplied: one call a product, as a
 * decode step makes ~120 of them. Returns 0, or -1 where the buffer cannot be allocated. */
#define ROWS_PRODUCT(name, product)                                                                          \
int name(const float *x, int64_t rows, int64_t in_features, const uint8_t *packed, int64_t out_features,     \
         float *out, int threads)                                                                            \
{                                                                                                            \
    const int64_t groups = in_features / GROUP;                                                              \
    /* quants (rows x in_features bytes: a multiple of 32), scales, then sums: each 4-byte aligned */        \
    uint8_t *scratch = malloc((size_t)(rows * in_features + rows * groups * 12));                            \
    if (scratch == NULL) return -1;                                                                          \
    int8_t *q = (int8_t *)scratch;                                                                           \
    float *d = (float *)(scratch + rows * in_features);                                                      \
    int32_t *sums = (int32_t *)(scratch + rows * in_features + rows * groups * 4);                           \
    quantise_rows(x, rows, in_features, q, d, sums, threads);                                                \
    product(q, d, sums, rows, in_features, packed, out_features, out, threads);                              \
    free(scratch);                                                                                           \
    return 0;                                                                                                \
}

PRODUCT(q4_0_q8_product, Q4_0, Q4_0_RECORD)
PRODUCT(q4_1_q8_product, Q4_1, Q4_1_RECORD)
PRODUCT(q5_0_q8_product, Q5_0, Q5_0_RECORD)
PRODUCT(q5_1_q8_product, Q5_1, Q5_1_RECORD)
PRODUCT(q6_k_q8_product, Q6_K, Q6_K_RECORD)
PRODUCT(q8_0_q8_product, Q8_0, Q8_0_RECORD)
ROWS_PRODUCT(q4_0_rows, q4_0_q8_product)
ROWS_PRODUCT(q4_1_rows, q4_1_q8_product)
ROWS_PRODUCT(q5_0_rows, q5_0_q8_product)
ROWS_PRODUCT(q5_1_rows, q5_1_q8_product)
ROWS_PRODUCT(q6_k_rows, q6_k_q8_product)
ROWS_PRODUCT(q8_0_rows, q8_0_q8_product)

/* Which vector path this library was compiled with: 512 (AVX-512 VNNI) or 256 (AVX2). */
int q8_vector_bits(void) { return WIDTH * 32; }
