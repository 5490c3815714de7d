/* Products of float32 rows with group-quantised weights (GGUF blocks), de-quantised inside the product.
 *
 * out[r][n] = sum_k x[r][k] * w[n][k], where each weight is rebuilt exactly as the float32 value gguf-py's
 * dequantize gives (gguf_records.py says why each decode is exact):
 *   q4_1, q5_1: w = fma(scale, q, minimum) (q in 0..15 or 0..31; scale * q is exact, one rounding),
 *   q4_0, q5_0, q6_k, q8_0: w = scale * (q - offset) (offset 8, 16, 32, 0; Q6_K's scale is per 16 inputs),
 *   the records holding q - offset in two's complement (4, 5, 6 or 8 bits), decoded sign-extended.
 * Only the bytes of the records are read (5 to 9 bits a weight, scales widened to float32, instead of 32): a
 * decode step is bound by memory bandwidth, so fewer bytes is a faster step.
 *
 * Layout (see gguf_records.py, which packs it): 16 output features share a "lane block"; for each lane block and
 * each group of 32 inputs one record holds the 16 features' float32 scales (q6_k: for inputs 0..15, then for
 * 16..31; q4_1, q5_1: then the minimums), then the quantised weights, input-major. q8_0: int8 [kk][lane]. The
 * others: byte [kk][lane] holds input kk (low nibble) and kk + 16 (high); q5_*: then a uint16 per input whose bit
 * `lane` is the quant's bit 4; q6_k: then a uint32 per input whose bits 2 lane, 2 lane + 1 are its bits 4, 5.
 * q4_0, q5_0 and q6_k store q XOR offset: the bits of q - offset in two's complement.
 *
 * Every output element is accumulated in one fixed order, whatever the number of rows and the thread split:
 * two fused multiply-add chains over the inputs of the group's first and second half, added at the end.
 * A row's outputs therefore never depend on the rows multiplied with it (ROW-CANONICAL).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define LANES 16
#define SCALES (LANES * 4)                        /* one float32 a lane */
#define NIBBLES (16 * LANES)                      /* 32 x 16 quants, two a byte */
#define Q4_0_RECORD (SCALES + NIBBLES)            /* 320 bytes */
#define Q4_1_RECORD (2 * SCALES + NIBBLES)        /* 384 */
#define Q5_0_RECORD (SCALES + NIBBLES + 32 * 2)   /* 384 */
#define Q5_1_RECORD (2 * SCALES + NIBBLES + 32 * 2)   /* 448 */
#define Q6_K_RECORD (2 * SCALES + NIBBLES + 32 * 4)   /* 512 */
#define Q8_0_RECORD (SCALES + 32 * LANES)         /* 576 */

#if defined(__AVX512F__)
#define ROWS_A_PASS 8
typedef __m512 vec;
typedef __m512i ivec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec to_float(ivec q) { return _mm512_cvtepi32_ps(q); }
/* The 16 lanes' quants of inputs kk (low nibbles) and kk + 16 (high) from their 16 bytes. */
static inline void nibbles(const uint8_t *p, ivec *lo, ivec *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_and_si512(b, _mm512_set1_epi32(15));
    *hi = _mm512_srli_epi32(b, 4);
}
/* The same for nibbles holding 4-bit two's complement values: sign-extended. */
static inline void signed_nibbles(const uint8_t *p, ivec *lo, ivec *hi) {
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28);
    *hi = _mm512_srai_epi32(b, 4);
}
static inline ivec signed_bytes(const int8_t *q) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)); }
/* q + 16 in the lanes whose bit is set in `bits` (bit `lane`): an unsigned fifth bit. */
static inline ivec fifth_bit(ivec q, uint16_t bits) {
    return _mm512_mask_or_epi32(q, (__mmask16)bits, q, _mm512_set1_epi32(16));
}
/* q - 16 in those lanes: a two's complement fifth bit (the sign). */
static inline ivec sign_bit(ivec q, uint16_t bits) {
    return _mm512_mask_sub_epi32(q, (__mmask16)bits, q, _mm512_set1_epi32(16));
}
/* q + 16 * (bits 2 lane, 2 lane + 1 of `bits`, a two's complement pair): the pair is shifted to the top and
 * back down arithmetically, landing as its signed value times 16 above 4 bits of the lower lanes' pairs,
 * which the AND with ~15 drops before q fills them (one ternary-logic op: (f & ~15) | q). */
static inline ivec signed_pair(ivec q, uint32_t bits) {
    const __m512i shifts = _mm512_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i f = _mm512_srai_epi32(_mm512_sllv_epi32(_mm512_set1_epi32((int)bits), shifts), 26);
    return _mm512_ternarylogic_epi32(f, q, _mm512_set1_epi32(-16), 0xEC);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ROWS_A_PASS 4
typedef struct { __m256 a, b; } vec;           /* 16 lanes as two halves */
typedef struct { __m256i a, b; } ivec;
static inline vec vzero(void) { vec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline vec vload(const float *p) { vec v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return v; }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline vec vfma(vec a, vec b, vec c) {
    vec v = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; return v;
}
static inline vec vadd(vec a, vec b) { vec v = {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; return v; }
static inline vec vmul(vec a, vec b) { vec v = {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; return v; }
static inline vec vset1(float a) { vec v = {_mm256_set1_ps(a), _mm256_set1_ps(a)}; return v; }
static inline vec to_float(ivec q) { vec v = {_mm256_cvtepi32_ps(q.a), _mm256_cvtepi32_ps(q.b)}; return v; }
static inline void nibbles(const uint8_t *p, ivec *lo, ivec *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i first = _mm256_cvtepu8_epi32(b), second = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i low = _mm256_set1_epi32(15);
    ivec l = {_mm256_and_si256(first, low), _mm256_and_si256(second, low)};
    ivec h = {_mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    *lo = l;
    *hi = h;
}
static inline void signed_nibbles(const uint8_t *p, ivec *lo, ivec *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i first = _mm256_cvtepi8_epi32(b), second = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    ivec l = {_mm256_srai_epi32(_mm256_slli_epi32(first, 28), 28),
              _mm256_srai_epi32(_mm256_slli_epi32(second, 28), 28)};
    ivec h = {_mm256_srai_epi32(first, 4), _mm256_srai_epi32(second, 4)};
    *lo = l;
    *hi = h;
}
static inline ivec signed_bytes(const int8_t *q) {
    ivec v = {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)),
              _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))};
    return v;
}
/* 16 in the lanes whose bit is set in `bits`, else 0. */
static inline ivec sixteens(uint16_t bits) {
    const __m256i all = _mm256_set1_epi32(bits), sixteen = _mm256_set1_epi32(16);
    const __m256i first = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i second = _mm256_setr_epi32(256, 512, 1024, 2048, 4096, 8192, 16384, 32768);
    ivec v = {_mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(all, first), first), sixteen),
              _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(all, second), second), sixteen)};
    return v;
}
static inline ivec fifth_bit(ivec q, uint16_t bits) {
    const ivec s = sixteens(bits);
    ivec v = {_mm256_or_si256(q.a, s.a), _mm256_or_si256(q.b, s.b)};
    return v;
}
static inline ivec sign_bit(ivec q, uint16_t bits) {
    const ivec s = sixteens(bits);
    ivec v = {_mm256_sub_epi32(q.a, s.a), _mm256_sub_epi32(q.b, s.b)};
    return v;
}
static inline ivec signed_pair(ivec q, uint32_t bits) {
    const __m256i all = _mm256_set1_epi32((int)bits), high = _mm256_set1_epi32(-16);
    const __m256i first = _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16);
    const __m256i second = _mm256_setr_epi32(14, 12, 10, 8, 6, 4, 2, 0);
    const __m256i fa = _mm256_srai_epi32(_mm256_sllv_epi32(all, first), 26);
    const __m256i fb = _mm256_srai_epi32(_mm256_sllv_epi32(all, second), 26);
    ivec v = {_mm256_or_si256(_mm256_and_si256(fa, high), q.a), _mm256_or_si256(_mm256_and_si256(fb, high), q.b)};
    return v;
}
#else
#error "grouped products need AVX2 with FMA, or AVX-512"
#endif

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0 };     /* how a lane block's weights are stored */

/* The 16 lanes' weights of inputs kk and kk + 16 of group g, decoded from the records. `kind` and `record` are
 * constants in each inlined copy. */
static inline __attribute__((always_inline)) void weights_at(const int kind, const int record, const uint8_t *block,
        int64_t g, int kk, vec *lo, vec *hi)
{
    const uint8_t *at = block + g * record;
    const float *scales = (const float *)at;
    if (kind == Q8_0) {
        const vec scale = vload(scales);
        const int8_t *q = (const int8_t *)(at + SCALES);
        *lo = vmul(scale, to_float(signed_bytes(q + kk * LANES)));
        *hi = vmul(scale, to_float(signed_bytes(q + (kk + 16) * LANES)));
        return;
    }
    const int second_set = kind == Q4_1 || kind == Q5_1 || kind == Q6_K;     /* minimums, or second scales */
    const uint8_t *pairs = at + (second_set ? 2 : 1) * SCALES;
    ivec ql, qh;
    if (kind == Q4_0) signed_nibbles(pairs + kk * LANES, &ql, &qh);
    else nibbles(pairs + kk * LANES, &ql, &qh);
    if (kind == Q5_0 || kind == Q5_1) {
        uint16_t low_bits, high_bits;
        memcpy(&low_bits, pairs + NIBBLES + kk * 2, 2);
        memcpy(&high_bits, pairs + NIBBLES + (kk + 16) * 2, 2);
        ql = kind == Q5_0 ? sign_bit(ql, low_bits) : fifth_bit(ql, low_bits);
        qh = kind == Q5_0 ? sign_bit(qh, high_bits) : fifth_bit(qh, high_bits);
    } else if (kind == Q6_K) {
        uint32_t low_bits, high_bits;
        memcpy(&low_bits, pairs + NIBBLES + kk * 4, 4);
        memcpy(&high_bits, pairs + NIBBLES + (kk + 16) * 4, 4);
        ql = signed_pair(ql, low_bits);
        qh = signed_pair(qh, high_bits);
    }
    if (kind == Q4_1 || kind == Q5_1) {
        const vec scale = vload(scales), minimum = vload(scales + LANES);
        *lo = vfma(scale, to_float(ql), minimum);
        *hi = vfma(scale, to_float(qh), minimum);
    } else {       /* ql, qh are q - offset already */
        *lo = vmul(vload(scales), to_float(ql));
        *hi = vmul(vload(scales + (kind == Q6_K ? LANES : 0)), to_float(qh));
    }
}

/* `rows` (at most ROWS_A_PASS) rows of x times one lane block; `rows` is a constant in each inlined copy. */
static inline __attribute__((always_inline)) void lanes(const int source, const int record, const float *x,
        int64_t in_features, const int rows, const uint8_t *block, int64_t groups, float *out, int64_t out_features)
{
    vec first[ROWS_A_PASS], second[ROWS_A_PASS];
    for (int r = 0; r < rows; r++) { first[r] = vzero(); second[r] = vzero(); }
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * 32;
        for (int kk = 0; kk < 16; kk++) {
            vec lo, hi;
            weights_at(source, record, block, g, kk, &lo, &hi);
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
#define TILE_ROWS 3         /* rows a pass: 3 x 2 x 2 sums and 4 weight vectors fill 16 registers (4 rows spilled) */
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

#define DIRECT_CASE(n) case n: lanes(source, record, x + r0 * in_features, in_features, n, block, groups, \
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
#define TILE_PASSES TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3)
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

/* Products of fewer rows than this decode each lane block's weights inside every pass of ROWS_A_PASS rows
 * ("direct"); more rows decode each group once into a tile ("tiled"). Which is faster depends on the CPU (how
 * much room its vector pipes leave beside the multiply-adds for decoding again), so the library's user times
 * both and sets it once, before any product (grouped_tiled_from). */
static int64_t tiled_from = ROWS_A_PASS + 1;
void grouped_tiled_from(int64_t rows) { tiled_from = rows < 1 ? 1 : rows; }
int64_t grouped_rows_a_pass(void) { return ROWS_A_PASS; }

/* Lane blocks are shared among `threads` threads (PyTorch's count, passed in: the caller's thread may not be
 * the one that set it). Direct: each block's weights are decoded inside the product and the sums stay in
 * registers. Tiled: TILE_BLOCKS blocks at a time, each group's weights are decoded once into a small tile,
 * every row multiplies them TILE_ROWS rows a pass, and the sums wait in cache between groups. Each output
 * gets the same products added in the same order either way: the same numbers. */
#define PRODUCT(name, source, record)                                                                                \
void name(const float *x, int64_t rows, int64_t in_features, const uint8_t *packed, int64_t out_features,            \
          float *out, int threads)                                                                                   \
{                                                                                                                    \
    const int64_t blocks = out_features / LANES, groups = in_features / 32;                                          \
    if (rows < tiled_from) {                                                                                         \
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
                        weights_at(source, record, packed + (first_block + k) * groups * record, g, kk, &lo, &hi);   \
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
PRODUCT(q4_0_product, Q4_0, Q4_0_RECORD)
PRODUCT(q4_1_product, Q4_1, Q4_1_RECORD)
PRODUCT(q5_0_product, Q5_0, Q5_0_RECORD)
PRODUCT(q5_1_product, Q5_1, Q5_1_RECORD)
PRODUCT(q6_k_product, Q6_K, Q6_K_RECORD)
PRODUCT(q8_0_product, Q8_0, Q8_0_RECORD)
