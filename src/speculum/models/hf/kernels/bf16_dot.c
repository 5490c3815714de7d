/* bfloat16 products by AVX-512 BF16 dot products: rows (m, k) bfloat16 times a packed weight (n, k) -> (m, n)
 * float32.
 *
 * Every output element has one float32 accumulator, to which VDPBF16PS adds the products of one pair of
 * consecutive inputs at a time, the pairs in the order of k: the same instructions in the same order whatever
 * the number of rows, the rows and lane blocks computed beside it or the thread that computes it. A row's
 * outputs therefore do not depend on the rows multiplied with it (ROW-CANONICAL).
 *
 * Layouts (the caller pads k to even with zeros): rows row-major, read as one uint32 a pair of inputs;
 * packed (ceil(n / 16), k / 2, 16, 2): for lane block b and pair p, the 16 lanes' two inputs 2 p and 2 p + 1
 * (one 512-bit load), lanes past n zero; out row-major (m, n), the last block's missing lanes not written.
 * Work: groups of BLOCKS lane blocks shared out among the threads; within a group, ROWS rows at a time, each
 * weight load multiplied by every row of the pass (the weight group stays in cache while the rows pass). */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define LANES 16
#define ROWS 4                 /* rows a pass: ROWS x BLOCKS accumulators, BLOCKS weight vectors, one broadcast */
#define BLOCKS 4               /* lane blocks a group */

/* out[r][16 b + lane] for `rows` (<= ROWS) rows and `blocks` (<= BLOCKS) lane blocks; constant arguments at
 * each call let the compiler keep the accumulators in registers. */
static inline __attribute__((always_inline)) void pass(const uint32_t *a, const __m512i *w, float *c, int64_t pairs,
                                                        int64_t n, int64_t first_lane, const int rows,
                                                        const int blocks) {
    __m512 acc[ROWS][BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[BLOCKS];
        for (int b = 0; b < blocks; b++) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * pairs + p);
        for (int r = 0; r < rows; r++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * pairs + p]);
            for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], av, wv[b]);
        }
    }
    for (int b = 0; b < blocks; b++) {
        const int64_t lane = first_lane + b * LANES, left = n - lane;
        const __mmask16 mask = left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(c + r * n + lane, mask, acc[r][b]);
    }
}

#define PASS_ROWS(R)                                                                                     \
    switch (blocks) {                                                                                    \
        case 4: pass(a, w, c, pairs, n, lane, R, 4); break;                                            \
        case 3: pass(a, w, c, pairs, n, lane, R, 3); break;                                            \
        case 2: pass(a, w, c, pairs, n, lane, R, 2); break;                                            \
        default: pass(a, w, c, pairs, n, lane, R, 1); break;                                           \
    }

void bf16_dot_product(const uint16_t *rows, const uint16_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                      int threads) {
    const int64_t pairs = k / 2, lane_blocks = (n + LANES - 1) / LANES;
    const int64_t groups = (lane_blocks + BLOCKS - 1) / BLOCKS;
    const uint32_t *row_pairs = (const uint32_t *)rows;
    const __m512i *weights = (const __m512i *)packed;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * BLOCKS;
        const int blocks = (int)(lane_blocks - first < BLOCKS ? lane_blocks - first : BLOCKS);
        const __m512i *w = weights + first * pairs;
        const int64_t lane = first * LANES;
        for (int64_t r = 0; r < m; r += ROWS) {
            const uint32_t *a = row_pairs + r * pairs;
            float *c = out + r * n;
            const int64_t left = m - r;
            if (left >= 4) { PASS_ROWS(4) }
            else if (left == 3) { PASS_ROWS(3) }
            else if (left == 2) { PASS_ROWS(2) }
            else { PASS_ROWS(1) }
        }
    }
}

int bf16_dot_compiled(void) { return 1; }

#else
/* Built for a CPU without AVX-512 BF16: the Python side reads bf16_dot_compiled() == 0. */
void bf16_dot_product(const uint16_t *rows, const uint16_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                      int threads) {
    (void)rows; (void)packed; (void)out; (void)m; (void)n; (void)k; (void)threads;
}
int bf16_dot_compiled(void) { return 0; }
#endif
