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
 *   q4_0, q5_0, q8_0:  out = fma(scale[n] * d, (float)I, out)
 *   q4_1, q5_1:        out = fma(scale[n] * d, (float)I, out), then out = fma(minimum[n], s, out), where
 *                      s = d * (float)S is the block's float32 "d times sum", kept when the row is quantised
 *                      (as llama.cpp's Q8_1 keeps it)
 *   q6_k (q - 32, a scale per 16 inputs): I_lo, I_hi over inputs 0..15 and 16..31, each minus 32 * S_lo or
 *                      32 * S_hi; out = fma(scale_lo[n] * d, (float)I_lo, out), then the same with scale_hi, I_hi
 * every product rounded to float32 as written, fma(a, b, c) = a * b + c rounded once (the instruction, in both
 * vector widths; nothing else is contracted: -ffp-contract=off). Two fused multiply-adds a group and row, where
 * separate products and sums would take four multiplies and two adds on the pipes the dot products need. |I| is
 * below 2^24, so (float)I is exact. The order does not depend on the number of rows, their position or the thread
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

/* q4_1f, q5_1f, q6_kf: q4_1, q5_1 and q6_k records whose floats factor, over each super-block of 8 groups, into
 * one float32 a lane times an int8 a group (K-quants: a float16 times a 6- or 8-bit integer). A super-block
 * holds the lanes' float32 factors (q4_1f, q5_1f: 16 for the scales, then 16 for the minimums; q6_kf: 16 for
 * both halves' scales), then its 8 groups, each the lanes' two int8 factors (16 + 16 bytes: scale and minimum,
 * or the halves' scales) and the quants as in q4_1, q5_1 or q6_k. */
#define Q4_1F_RECORD (2 * LANES + 256)
#define Q5_1F_RECORD (2 * LANES + 256 + 64)
#define Q6_KF_RECORD (2 * LANES + 256 + 128)

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0, Q4_1F, Q5_1F, Q6_KF };
#define FACTORED(kind) ((kind) == Q4_1F || (kind) == Q5_1F || (kind) == Q6_KF)
#define WITH_MINIMUM(kind) ((kind) == Q4_1 || (kind) == Q5_1 || (kind) == Q4_1F || (kind) == Q5_1F)
#define FIVE_BITS(kind) ((kind) == Q5_0 || (kind) == Q5_1 || (kind) == Q5_1F)
#define SIX_BITS(kind) ((kind) == Q6_K || (kind) == Q6_KF)
#define FACTORS(kind) ((kind) == Q6_KF ? SCALES : 2 * SCALES)      /* bytes of a super-block's float32 factors */
/* Bytes of one lane block's records over `groups` groups. */
#define LANE_BLOCK(kind, record, groups) (FACTORED(kind) ? (groups) / 8 * (FACTORS(kind) + 8 * (record)) \
                                                         : (groups) * (record))
/* 4 quantised inputs read in place as one int32, the operand each dot product broadcasts. */
typedef int32_t unaligned_int32 __attribute__((aligned(1), may_alias));

/* ------------------------------------------------------------------------------------------ the rows */

/* Block b (row r, group g) of 32 inputs quantised: quants at q, its scale, the sums of its inputs 0..15 and
 * 16..31, and (where `dsum` is given) s = d * (float)(their total), rounded to float32. amax is the largest
 * |x| ignoring NaN (max is exact in any order); each quant is x * inverse (float32) rounded half away from zero
 * as roundf does, from its truncation and the exact fraction v - trunc(v); a NaN input gives the quant 0 (the
 * conversion's 0x80000000, truncated to 8 bits). The AVX-512 and AVX2 paths give the same bits (tested). */
static inline void quantise_block(const float *xb, int8_t *q, float *d, int32_t *sums, float *dsum)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    /* max_ps(a, b) is b where a is NaN: NaN inputs leave the running maximum as it is */
    __m512 top = _mm512_max_ps(_mm512_and_ps(x0, sign), _mm512_setzero_ps());
    top = _mm512_max_ps(_mm512_and_ps(x1, sign), top);
    const float amax = _mm512_reduce_max_ps(top);
    const float scale = amax / 127.0f;
    const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum[2];
    for (int half = 0; half < 2; half++) {
        const __m512 v = _mm512_mul_ps(half ? x1 : x0, _mm512_set1_ps(inverse));
        __m512i i = _mm512_cvttps_epi32(v);
        const __m512 fraction = _mm512_sub_ps(v, _mm512_cvtepi32_ps(i));
        const __m512i one = _mm512_set1_epi32(1);
        i = _mm512_mask_add_epi32(i, _mm512_cmp_ps_mask(fraction, _mm512_set1_ps(0.5f), _CMP_GE_OQ), i, one);
        i = _mm512_mask_sub_epi32(i, _mm512_cmp_ps_mask(fraction, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), i, one);
        _mm_storeu_si128((__m128i *)(q + 16 * half), _mm512_cvtepi32_epi8(i));
        sum[half] = _mm512_reduce_add_epi32(i);
    }
#elif defined(__AVX2__)
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], top = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(xb + 8 * j);
        top = _mm256_max_ps(_mm256_and_ps(x[j], sign), top);
    }
    __m128 high = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    high = _mm_max_ps(high, _mm_movehl_ps(high, high));
    const float amax = _mm_cvtss_f32(_mm_max_ss(high, _mm_movehdup_ps(high)));
    const float scale = amax / 127.0f;
    const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    __m256i i[4];
    for (int j = 0; j < 4; j++) {
        const __m256 v = _mm256_mul_ps(x[j], _mm256_set1_ps(inverse));
        i[j] = _mm256_cvttps_epi32(v);
        const __m256 fraction = _mm256_sub_ps(v, _mm256_cvtepi32_ps(i[j]));
        /* the comparisons' masks are -1 where true */
        i[j] = _mm256_sub_epi32(i[j], _mm256_castps_si256(_mm256_cmp_ps(fraction, _mm256_set1_ps(0.5f), _CMP_GE_OQ)));
        i[j] = _mm256_add_epi32(i[j], _mm256_castps_si256(_mm256_cmp_ps(fraction, _mm256_set1_ps(-0.5f), _CMP_LE_OQ)));
    }
    int32_t sum[2];
    for (int half = 0; half < 2; half++) {
        const __m256i both = _mm256_add_epi32(i[2 * half], i[2 * half + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        sum[half] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
    }
    /* the low byte of each int32 (truncation, as AVX-512's vpmovdb), in input order */
    const __m256i byte = _mm256_set1_epi32(0xff);
    const __m256i words01 = _mm256_packus_epi32(_mm256_and_si256(i[0], byte), _mm256_and_si256(i[1], byte));
    const __m256i words23 = _mm256_packus_epi32(_mm256_and_si256(i[2], byte), _mm256_and_si256(i[3], byte));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words01, words23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
#else
#error "8-bit products need AVX2, or AVX-512 VNNI"
#endif
    *d = scale;
    sums[0] = sum[0];
    sums[1] = sum[1];
    if (dsum) *dsum = scale * (float)(sum[0] + sum[1]);
}

/* Rows (rows, in_features) -> quants (rows, in_features) int8, scales (rows, in_features / 32) float32, sums
 * (rows, in_features / 32, 2) int32 (inputs 0..15, 16..31 of each block). */
void quantise_rows(const float *x, int64_t rows, int64_t in_features, int8_t *q, float *d, int32_t *sums,
                   int threads)
{
    const int64_t blocks = rows * (in_features / GROUP);
    #pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 4096)
    for (int64_t b = 0; b < blocks; b++)
        quantise_block(x + b * GROUP, q + b * GROUP, d + b, sums + 2 * b, NULL);
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
static inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
static inline fvec fzero(void) { return _mm512_setzero_ps(); }
static inline fvec fload(const float *p) { return _mm512_loadu_ps(p); }
static inline void fstore(float *p, fvec v) { _mm512_storeu_ps(p, v); }
static inline fvec fset1(float v) { return _mm512_set1_ps(v); }
static inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec fadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
static inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline fvec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
static inline fvec int8_to_float(const uint8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__) && defined(__FMA__)
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
/* maddubs adds pairs of u8 x s8 products into int16 (at most 2 x 128 x 127 here: no saturation); widen16 adds
 * such int16 sums into int32 by madd. dots() adds several pairs in int16 before widening them where the weights'
 * bits allow it. */
#define NARROW_SUMS 1
static inline ivec pairs_u8(ivec w, int32_t x4) { return _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)); }
/* int8 weights as llama.cpp multiplies them: |w| (u8) times the input with w's sign. */
static inline ivec q8_weights(ivec w) { return w; }
static inline ivec pairs_s8(ivec w, int32_t x4)
{
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(x4), w));
}
static inline ivec add16(ivec a, ivec b) { return _mm256_add_epi16(a, b); }
static inline ivec widen16(ivec acc, ivec pairs)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#define Q8_OFFSET 0
static inline ivec isub(ivec a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
static inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
static inline fvec fzero(void) { return _mm256_setzero_ps(); }
static inline fvec fload(const float *p) { return _mm256_loadu_ps(p); }
static inline void fstore(float *p, fvec v) { _mm256_storeu_ps(p, v); }
static inline fvec fset1(float v) { return _mm256_set1_ps(v); }
static inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
static inline fvec fadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
static inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline fvec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
static inline fvec int8_to_float(const uint8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
#error "8-bit products need AVX2 with FMA, or AVX-512 VNNI"
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
    const uint8_t *chunks = at + (FACTORED(kind) ? 2 * LANES : (WITH_MINIMUM(kind) || kind == Q6_K ? 2 : 1) * SCALES);
    for (int v = 0; v < 4; v++) {
        const ivec b = iload(chunks + v * 64 + part * bytes);
        w[v] = low_nibbles(b);
        w[4 + v] = high_nibbles(b);
    }
    if (FIVE_BITS(kind) || SIX_BITS(kind)) {
        const ivec fifth = iload(chunks + 256 + part * bytes);
        for (int k = 0; k < 8; k++) w[k] = plane_bit(w[k], fifth, k, 16);
    }
    if (SIX_BITS(kind)) {
        const ivec sixth = iload(chunks + 320 + part * bytes);
        for (int k = 0; k < 8; k++) w[k] = plane_bit(w[k], sixth, k, 32);
    }
}

/* The integer dot products of quads k0 .. k1 - 1 of one group for `rows` rows. Integer sums are exact: any
 * split or order gives the same sums. */
#if defined(NARROW_SUMS)
/* AVX2: each maddubs sum of two products is at most 2 (2^b - 1) 127 for b-bit unsigned weights, so RUN(kind) of
 * them add in int16 without overflow (8 x 2 x 15 x 127 = 30480 for 4 bits; 4 for 5 bits, 2 for 6; int8 weights
 * reach 2 x 128 x 127 alone: 1) before one madd widens them: up to 9 multiplies a row and group instead of 16. */
#define RUN(kind) ((kind) == Q8_0 ? 1 : SIX_BITS(kind) ? 2 : FIVE_BITS(kind) ? 4 : 8)
static inline __attribute__((always_inline)) void dots(const int kind, const int rows, const int8_t *xq,
        const ivec w[8], int k0, int k1, ivec sum[ROWS_A_PASS])
{
    for (int r = 0; r < rows; r++) sum[r] = izero();
    #pragma GCC unroll 8
    for (int k = k0; k < k1; k += RUN(kind)) {
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const unaligned_int32 *x4 = (const unaligned_int32 *)(xq + r * GROUP);
            ivec pairs = kind == Q8_0 ? pairs_s8(w[k], x4[k]) : pairs_u8(w[k], x4[k]);
            for (int j = 1; j < RUN(kind); j++) pairs = add16(pairs, pairs_u8(w[k + j], x4[k + j]));
            sum[r] = widen16(sum[r], pairs);
        }
    }
}
#else
/* Quad-outer, row-inner, so that the rows' sums are independent chains the CPU overlaps (a row's 8 dot products
 * in one chain would wait on each other's latency); one or two rows keep two chains each. */
static inline __attribute__((always_inline)) void dots(const int kind, const int rows, const int8_t *xq,
        const ivec w[8], int k0, int k1, ivec sum[ROWS_A_PASS])
{
    ivec spare[2] = {izero(), izero()};
    for (int r = 0; r < rows; r++) sum[r] = izero();
    #pragma GCC unroll 8
    for (int k = k0; k < k1; k++) {
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int32_t x4 = ((const unaligned_int32 *)(xq + r * GROUP))[k];
            ivec *into = rows <= 2 && (k & 1) ? &spare[r] : &sum[r];
            *into = kind == Q8_0 ? dot_s8(*into, w[k], x4) : dot_u8(*into, w[k], x4);
        }
    }
    if (rows <= 2)
        for (int r = 0; r < rows; r++) sum[r] = iadd(sum[r], spare[r]);
}
#endif

/* `rows` rows (a constant in each inlined copy) of one pass times lanes `part` * WIDTH .. of one lane block. The
 * pass is laid out group-major (passed_rows): group g's quants, scales and sums of its rows side by side. */
static inline __attribute__((always_inline)) void lanes(const int kind, const int record, const int rows,
        const int8_t *q, const float *d, const int32_t *sums, const float *dsum, int64_t groups,
        const uint8_t *block, int part, float *out, int64_t out_features)
{
    fvec acc[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) acc[r] = fzero();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *super = block + g / 8 * (FACTORS(kind) + 8 * record);          /* factored kinds */
        const uint8_t *at = FACTORED(kind) ? super + FACTORS(kind) + g % 8 * record : block + g * record;
        const float *scales = (const float *)at;
        const float *dg = d + g * rows, *dsg = dsum + g * rows;
        const int32_t *sg = sums + 2 * g * rows;
        ivec w[8], sum[ROWS_A_PASS];
        quads(kind, at, part, w);
        /* minimum: q4_1 and q5_1's; second: q6_k's scale of inputs 16..31 */
        fvec scale, minimum = fzero(), second = fzero();
        if (FACTORED(kind)) {      /* float32 factor times int8 factor: exactly the unfactored record's floats */
            const float *factors = (const float *)super;
            scale = fmul(fload(factors + part * WIDTH), int8_to_float(at + part * WIDTH));
            const fvec other = fmul(fload(factors + (kind == Q6_KF ? 0 : LANES) + part * WIDTH),
                                    int8_to_float(at + LANES + part * WIDTH));
            if (kind == Q6_KF) second = other;
            else minimum = other;
        } else {
            scale = fload(scales + part * WIDTH);
            if (WITH_MINIMUM(kind)) minimum = fload(scales + LANES + part * WIDTH);
            if (kind == Q6_K) second = fload(scales + LANES + part * WIDTH);
        }
        /* inputs 0..31 (q6_k: 0..15, its first scale) */
        dots(kind, rows, q + g * rows * GROUP, w, 0, SIX_BITS(kind) ? 4 : 8, sum);
        #pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int32_t s_low = sg[2 * r], sr = s_low + sg[2 * r + 1];
            ivec low = sum[r];
            if (kind == Q4_0) low = isub(low, 8 * sr);
            if (kind == Q5_0) low = isub(low, 16 * sr);
            if (kind == Q8_0 && Q8_OFFSET) low = isub(low, Q8_OFFSET * sr);
            if (SIX_BITS(kind)) low = isub(low, 32 * s_low);
            acc[r] = ffma(fmul(scale, fset1(dg[r])), to_float(low), acc[r]);
            if (WITH_MINIMUM(kind)) acc[r] = ffma(minimum, fset1(dsg[r]), acc[r]);
        }
        if (SIX_BITS(kind)) {                     /* inputs 16..31, the second scale */
            dots(kind, rows, q + g * rows * GROUP, w, 4, 8, sum);
            #pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const ivec high = isub(sum[r], 32 * sg[2 * r + 1]);
                acc[r] = ffma(fmul(second, fset1(dg[r])), to_float(high), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) fstore(out + r * out_features + part * WIDTH, acc[r]);
}

/* The scratch of `rows` rows in passes of ROWS_A_PASS: pass p (rows r0 = p ROWS_A_PASS .., n of them) holds at
 * q + r0 in_features its quants [group][row][32], at d + r0 groups and dsum + r0 groups its scales and
 * d-times-sums [group][row], at sums + 2 r0 groups its half sums [group][row][2]: a pass reads one stream a kind. */
static void passed_rows(const float *x, int64_t rows, int64_t in_features, int8_t *q, float *d, int32_t *sums,
                        float *dsum, int threads)
{
    const int64_t groups = in_features / GROUP, blocks = rows * groups;
    #pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 4096)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t row = b / groups, g = b % groups, r0 = row - row % ROWS_A_PASS;
        const int64_t n = rows - r0 < ROWS_A_PASS ? rows - r0 : ROWS_A_PASS;
        const int64_t at = r0 * groups + g * n + (row - r0);
        quantise_block(x + b * GROUP, q + at * GROUP, d + at, sums + 2 * at, dsum + at);
    }
}

#define CASE(n) case n: lanes(kind, record, n, q + r0 * in_features, d + r0 * groups, sums + 2 * r0 * groups, \
                              dsum + r0 * groups, groups, block, part, out + r0 * out_features + b * LANES,  \
                              out_features); break;
#if ROWS_A_PASS == 8
#define PASSES CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#else
#define PASSES CASE(1) CASE(2) CASE(3) CASE(4)
#endif

/* Rows are taken in tiles of at most TILE_ROWS, as even as whole passes allow, each tile's quantised rows (at
 * most 128 x in_features bytes) staying in the cache while every lane block multiplies them; the (tile, lane
 * block) pairs are shared among `threads` threads (PyTorch's count, passed in), tile-major. A lane block takes
 * its tile's rows ROWS_A_PASS a pass, a group's quads unpacked once a pass. */
#define TILE_ROWS (16 * ROWS_A_PASS)
static inline int64_t tile_rows(int64_t rows)
{
    const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS, even = (rows + tiles - 1) / tiles;
    return (even + ROWS_A_PASS - 1) / ROWS_A_PASS * ROWS_A_PASS;
}
#define PRODUCT(name, KIND, RECORD)                                                                          \
static void name(const int8_t *q, const float *d, const int32_t *sums, const float *dsum, int64_t rows,      \
                 int64_t in_features, const uint8_t *packed, int64_t out_features, float *out, int threads)  \
{                                                                                                            \
    const int kind = KIND, record = RECORD;                                                                  \
    const int64_t blocks = out_features / LANES, groups = in_features / GROUP;                               \
    const int64_t tile = tile_rows(rows), tiles = (rows + tile - 1) / tile;                                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                        \
    for (int64_t item = 0; item < tiles * blocks; item++) {                                                  \
        const int64_t b = item % blocks, first = item / blocks * tile;                                       \
        const int64_t last = first + tile < rows ? first + tile : rows;                                      \
        const uint8_t *block = packed + b * LANE_BLOCK(kind, record, groups);                                \
        for (int part = 0; part < LANES / WIDTH; part++)                                                     \
            for (int64_t r0 = first; r0 < last; r0 += ROWS_A_PASS) {                                         \
                const int n = last - r0 < ROWS_A_PASS ? (int)(last - r0) : ROWS_A_PASS;                      \
                switch (n) { PASSES }                                                                        \
            }                                                                                                \
    }                                                                                                        \
}

/* Float32 rows quantised (passed_rows) into a buffer of this call, then multiplied: one call a product, as a
 * decode step makes ~120 of them. Returns 0, or -1 where the buffer cannot be allocated. */
#define ROWS_PRODUCT(name, product)                                                                          \
int name(const float *x, int64_t rows, int64_t in_features, const uint8_t *packed, int64_t out_features,     \
         float *out, int threads)                                                                            \
{                                                                                                            \
    const int64_t groups = in_features / GROUP;                                                              \
    /* quants (rows x in_features bytes: a multiple of 32), scales, sums, then d-times-sums: 4-byte aligned */ \
    uint8_t *scratch = malloc((size_t)(rows * in_features + rows * groups * 16));                            \
    if (scratch == NULL) return -1;                                                                          \
    int8_t *q = (int8_t *)scratch;                                                                           \
    float *d = (float *)(scratch + rows * in_features);                                                      \
    int32_t *sums = (int32_t *)(scratch + rows * in_features + rows * groups * 4);                           \
    float *dsum = (float *)(scratch + rows * in_features + rows * groups * 12);                              \
    passed_rows(x, rows, in_features, q, d, sums, dsum, threads);                                            \
    product(q, d, sums, dsum, rows, in_features, packed, out_features, out, threads);                        \
    free(scratch);                                                                                           \
    return 0;                                                                                                \
}

PRODUCT(q4_0_q8_product, Q4_0, Q4_0_RECORD)
PRODUCT(q4_1_q8_product, Q4_1, Q4_1_RECORD)
PRODUCT(q5_0_q8_product, Q5_0, Q5_0_RECORD)
PRODUCT(q5_1_q8_product, Q5_1, Q5_1_RECORD)
PRODUCT(q6_k_q8_product, Q6_K, Q6_K_RECORD)
PRODUCT(q8_0_q8_product, Q8_0, Q8_0_RECORD)
PRODUCT(q4_1f_q8_product, Q4_1F, Q4_1F_RECORD)
PRODUCT(q5_1f_q8_product, Q5_1F, Q5_1F_RECORD)
PRODUCT(q6_kf_q8_product, Q6_KF, Q6_KF_RECORD)
ROWS_PRODUCT(q4_0_rows, q4_0_q8_product)
ROWS_PRODUCT(q4_1_rows, q4_1_q8_product)
ROWS_PRODUCT(q5_0_rows, q5_0_q8_product)
ROWS_PRODUCT(q5_1_rows, q5_1_q8_product)
ROWS_PRODUCT(q6_k_rows, q6_k_q8_product)
ROWS_PRODUCT(q8_0_rows, q8_0_q8_product)
ROWS_PRODUCT(q4_1f_rows, q4_1f_q8_product)
ROWS_PRODUCT(q5_1f_rows, q5_1f_q8_product)
ROWS_PRODUCT(q6_kf_rows, q6_kf_q8_product)

/* Which vector path this library was compiled with: 512 (AVX-512 VNNI) or 256 (AVX2). */
int q8_vector_bits(void) { return WIDTH * 32; }
