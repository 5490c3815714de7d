/* bfloat16 products on AMX tiles: rows (m, k) bfloat16 times a packed weight (n, k) -> (m, n) float32.
 *
 * Every output element is the float32 sum of its k / 32 tile dot products (TDPBF16PS) in the order of k,
 * each adding 32 products to the same accumulator: the same instructions in the same order whatever the
 * number of rows, the tile a row falls in or the thread that computes it. A row's outputs therefore do not
 * depend on the rows beside it (row-canonical).
 *
 * Layouts (the caller pads with zeros): m a multiple of 16, k of 32, n of 16; rows row-major; packed
 * (n / 16, k / 32, 16, 16, 2): for column block b and step s, 16 pairs of k by 16 columns, each pair the
 * two consecutive inputs 32 s + 2 p and 32 s + 2 p + 1 (the tiles' "VNNI" layout); out row-major.
 * Work: column blocks in chunks, each chunk's weight held in cache while every row tile passes over it. */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* 1 when this process may use the tiles (Linux grants them per process on request), else 0. */
int tiles_permitted(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

static void configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {              /* every tile 16 rows of 64 bytes */
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* Tiles 0-3 accumulate a 32 x 32 block of out (two row tiles by two column blocks), 4-5 hold the rows,
 * 6-7 the weight; a missing second row tile or column block is skipped, never computed differently. */
void tiles_product(const uint16_t *rows, const uint16_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                   int threads) {
    const int64_t blocks = n / 16, steps = k / 32, row_tiles = m / 16;
    const int64_t block = 512 * steps;                 /* elements of one column block's weight */
    int64_t chunk = blocks / (4 * (int64_t)threads);
    chunk = chunk < 2 ? 2 : chunk > 16 ? 16 : chunk & ~(int64_t)1;
    const int64_t chunks = (blocks + chunk - 1) / chunk;
    #pragma omp parallel num_threads(threads)
    {
        configure();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t first = c * chunk, last = first + chunk < blocks ? first + chunk : blocks;
            for (int64_t t = 0; t < row_tiles; t += 2) {
                const int pair = t + 1 < row_tiles;
                const uint16_t *a0 = rows + t * 16 * k, *a1 = a0 + 16 * k;
                for (int64_t b = first; b < last; b += 2) {
                    const int two = b + 1 < last;
                    const uint16_t *b0 = packed + b * block, *b1 = b0 + block;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t s = 0; s < steps; s++) {
                        _tile_loadd(4, a0 + s * 32, k * 2);
                        _tile_loadd(6, b0 + s * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two) {
                            _tile_loadd(7, b1 + s * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (pair) {
                            _tile_loadd(5, a1 + s * 32, k * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            if (two) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    float *c0 = out + t * 16 * n + b * 16;
                    _tile_stored(0, c0, n * 4);
                    if (two) _tile_stored(1, c0 + 16, n * 4);
                    if (pair) {
                        _tile_stored(2, c0 + 16 * n, n * 4);
                        if (two) _tile_stored(3, c0 + 16 * n + 16, n * 4);
                    }
                }
            }
        }
        _tile_release();
    }
}

int tiles_compiled(void) { return 1; }

static uint16_t bf16_of(float value) {         /* exact for the small integers used below */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/* 1 when one 16 x 16 x 32 product on the tiles gives the exact sums of small integers, else 0. Run in a
 * child process first: where the system does not really grant the tiles, an AMX instruction kills it. */
int tiles_selftest(void) {
    uint16_t rows[16 * 32], packed[16 * 16 * 2];
    float out[16 * 16];
    if (!tiles_permitted()) return 0;
    for (int r = 0; r < 16; r++)
        for (int i = 0; i < 32; i++) rows[r * 32 + i] = bf16_of((float)((r + i) % 5));
    for (int p = 0; p < 16; p++)              /* packed: pair p, column c, element e = input 2 p + e */
        for (int c = 0; c < 16; c++)
            for (int e = 0; e < 2; e++) packed[(p * 16 + c) * 2 + e] = bf16_of((float)((c + 2 * p + e) % 3) - 1.0f);
    tiles_product(rows, packed, out, 16, 16, 32, 1);
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) {
            float sum = 0.0f;
            for (int i = 0; i < 32; i++) sum += (float)((r + i) % 5) * ((float)((c + i) % 3) - 1.0f);
            if (out[r * 16 + c] != sum) return 0;
        }
    return 1;
}

#else
/* Built for a CPU without AMX-BF16 (or not on Linux): the Python side reads tiles_compiled() == 0. */
int tiles_permitted(void) { return 0; }
void tiles_product(const uint16_t *rows, const uint16_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                   int threads) {
    (void)rows; (void)packed; (void)out; (void)m; (void)n; (void)k; (void)threads;
}
int tiles_compiled(void) { return 0; }
int tiles_selftest(void) { return 0; }
#endif
