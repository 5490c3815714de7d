/* Products of rows quantised to 8 bits (blocks of 32, as llama.cpp's Q8_0 / Q8_1) with group-quantised
 * weights (GGUF blocks), by integer dot products.
 *
 * Rows: quantise_rows() cuts each row into blocks of 32 inputs and, for each block, keeps
 *   d = amax / 127 (float32; amax the largest |x| of the block), q = roundf(x * (1 / d)) in -127..127
 *   (round half away from zero; d = 0 gives q = 0), and S = the sum of the block's q (an int32),
 * as llama.cpp's quantize_row_q8_1_ref, except that d stays float32 (llama.cpp rounds it to float16). A
 * row's quants are a function of that row alone.
 *
 * Weights: records of 16 output lanes x 32 inputs (gguf_records.py), their quants repacked by q8_records.py
 * so that the 4 weights one 32-bit lane of VNNI's vpdpbusd multiplies are adjacent: 8 "quads" per group, quad
 * k holding inputs 4k .. 4k + 3, byte [lane][i]. q4_0, q4_1: 4 chunks of 64 bytes, chunk v's low nibbles quad v,
 * its high nibbles quad 4 + v, the raw quants 0..15; q8_0: 8 quads of int8.
 *
 * Each output, for row r, lane n, summed over the groups g in order, from 0:
 *   I = sum_k wq[n][k] * xq[r][k] over the group's 32 inputs (int32, exact; minus offset * S for q4_0,
 *       whose weights are q - 8),
 *   out += (scale[n] * d) * (float)I                 (q4_0, q8_0)
 *   out += (scale[n] * d) * (float)I, then out += (minimum[n] * d) * (float)S     (q4_1: w = scale * q + min)
 * every product and sum rounded to float32 as written (no fused multiply-add: -ffp-contract=off). I is below
 * 2^24, so (float)I is exact. The order does not depend on the number of rows, their position or the thread
 * split: a row's outputs never depend on the rows multiplied with it (ROW-CANONICAL).
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define LANES 16
#define GROUP 32
#define SCALES (LANES * 4)                      /* one float32 a lane */
#define Q4_0_RECORD (SCALES + 256)
#define Q4_1_RECORD (2 * SCALES + 256)
#define Q8_0_RECORD (SCALES + 512)

enum { Q4_0, Q4_1, Q8_0 };

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
 * (rows, in_features / 32) int32. */
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
        int32_t sum = 0;
        for (int j = 0; j < GROUP; j++) {
            const int v = round_away(xb[j] * inverse);
            q[b * GROUP + j] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        sums[b] = sum;
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
    const uint8_t *chunks = at + (kind == Q4_1 ? 2 : 1) * SCALES;
    for (int v = 0; v < 4; v++) {
        const ivec b = iload(chunks + v * 64 + part * bytes);
        w[v] = low_nibbles(b);
        w[4 + v] = high_nibbles(b);
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
            ivec isum = izero();
            for (int k = 0; k < 8; k++) {
                int32_t x4;
                memcpy(&x4, xq + 4 * k, 4);
                isum = kind == Q8_0 ? dot_s8(isum, w[k], x4) : dot_u8(isum, w[k], x4);
            }
            const float dr = d[r * groups + g];
            const int32_t sr = sums[r * groups + g];
            if (kind == Q4_0) isum = isub(isum, 8 * sr);
            if (kind == Q8_0 && Q8_OFFSET) isum = isub(isum, Q8_OFFSET * sr);
            acc[r] = fadd(acc[r], fmul(fmul(scale, fset1(dr)), to_float(isum)));
            if (kind == Q4_1) {
                const fvec minimum = fload(scales + LANES + part * WIDTH);
                acc[r] = fadd(acc[r], fmul(fmul(minimum, fset1(dr)), fset1((float)sr)));
            }
        }
    }
    for (int r = 0; r < rows; r++) fstore(out + r * out_features + part * WIDTH, acc[r]);
}

#define CASE(n) case n: lanes(kind, record, n, q + r0 * in_features, d + r0 * groups, sums + r0 * groups, \
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

PRODUCT(q4_0_q8_product, Q4_0, Q4_0_RECORD)
PRODUCT(q4_1_q8_product, Q4_1, Q4_1_RECORD)
PRODUCT(q8_0_q8_product, Q8_0, Q8_0_RECORD)

/* Which vector path this library was compiled with: 512 (AVX-512 VNNI) or 256 (AVX2). */
int q8_vector_bits(void) { return WIDTH * 32; }
