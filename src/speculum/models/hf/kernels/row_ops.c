/* Row-wise float32 glue between a decoder block's matrix products: RMSNorm, the residual add with its
 * norm, the query/key bias, head norms and rotary rotation, and the gated activation of the MLP.
 *
 * Every output row is a function of its own input row alone, computed in one fixed order: sums of
 * squares in 16 lanes (lane i holds elements i, i + 16, ...; a short last chunk is padded with zeros,
 * which add exact zeros), then one fixed tree over the lanes. Nothing depends on the number of rows in a
 * call, on where a row lies in memory or on the thread count, so rows are bitwise the same however they
 * are batched (ROW-CANONICAL by construction).
 *
 * The vectors are GCC's generic vector extensions, 16 floats wide: the compiler lowers them to AVX-512,
 * to pairs of AVX2 registers, or to SSE or scalar code. Each lane's operations are the same IEEE
 * operations in the same order whatever it lowers them to (no contraction: -ffp-contract=off), so every
 * target computes the same bits.
 *
 * exp is a range-reduced polynomial (Cody-Waite reduction by ln 2, a degree-7 polynomial, scaling by two
 * powers of two so that results near overflow and in the subnormal range round once); it is within 2 ulp
 * of a correctly rounded expf over the float range, saturates to inf above 88.73 and to +0 below -103.98.
 *
 * log_mass is each row's float64 log-sum-exp of float32 logits (the normaliser of its log-probabilities),
 * with a float64 exp of its own (Cody-Waite reduction, the Taylor polynomial to degree 13: a few ulp), the
 * exponentials summed in 32 lanes, then one fixed tree.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The vectors stay inside this file: how a target without 512-bit registers passes them does not matter. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define LANES 16
#define PARALLEL_ELEMENTS 32768     /* below this a call's rows run on the calling thread alone */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* The first n (< 16) elements, the other lanes zero. */
static inline vf load_part(const float *p, int64_t n) { vf v = {0}; memcpy(&v, p, (size_t)n * 4); return v; }
static inline void store_part(float *p, vf v, int64_t n) { memcpy(p, &v, (size_t)n * 4); }
static inline vf load_n(const float *p, int64_t n) { return n == LANES ? load(p) : load_part(p, n); }
static inline void store_n(float *p, vf v, int64_t n) { if (n == LANES) store(p, v); else store_part(p, v, n); }
static inline vf broadcast(float x) { return (vf){0} + x; }
static inline vf select(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }

static inline vf vexp(vf x)
{
    /* Clamped where the result is inf or +0 anyway (NaN passes both comparisons and stays NaN). */
    x = select(x > 89.0f, broadcast(89.0f), x);
    x = select(x < -104.0f, broadcast(-104.0f), x);
    const vf magic = broadcast(12582912.0f);           /* 1.5 * 2^23: adding it rounds to an integer */
    vf t = x * 1.44269504088896341f + magic;
    vf n = t - magic;
    vi k = (vi)((vu)t - (vu)magic);                    /* n as an integer, in [-150, 129] */
    /* ln 2 = C1 + C2 with C1 of 9 bits: n * C1 is exact, so r is x - n ln 2 to within C2's rounding. */
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = broadcast(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * (r * r);
    y = y + r;
    y = y + 1.0f;
    /* 2^k as 2^(k/2) * 2^(k - k/2): each factor a normal float; the last product rounds once. */
    vi k1 = k >> 1, k2 = k - k1;
    vf s1 = (vf)((vu)(k1 + 127) << 23), s2 = (vf)((vu)(k2 + 127) << 23);
    return (y * s1) * s2;
}

/* Lane-wise partial sums of squares of n elements (16 at a time, a short last chunk padded with zeros). */
static inline vf squares(const float *p, int64_t n)
{
    vf sum = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        vf v = load_n(p + i, n - i < LANES ? n - i : LANES);
        sum = sum + v * v;
    }
    return sum;
}

/* 1 / sqrt(mean + eps) from the lanes' partial sums: lanes folded in halves, 8 then 4, 2, 1. */
static inline float inverse_rms(vf sum, int64_t n, float eps)
{
    float s[LANES];
    memcpy(s, &sum, sizeof s);
    for (int width = LANES / 2; width; width >>= 1)
        for (int i = 0; i < width; i++)
            s[i] = s[i] + s[i + width];
    return 1.0f / sqrtf(s[0] / (float)n + eps);
}

/* out = (x * r) * weight over n elements. */
static inline void scale(const float *x, float r, const float *weight, float *out, int64_t n)
{
    for (int64_t i = 0; i < n; i += LANES) {
        int64_t m = n - i < LANES ? n - i : LANES;
        store_n(out + i, (load_n(x + i, m) * r) * load_n(weight + i, m), m);
    }
}

/* Runs body for each row, on `threads` OpenMP threads where the call is large enough to gain from them. */
#define FOR_ROWS(rows, width, threads, ...)                                                     \
    do {                                                                                        \
        if ((rows) > 1 && (threads) > 1 && (rows) * (width) > PARALLEL_ELEMENTS) {              \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                   \
            for (int64_t row = 0; row < (rows); row++) __VA_ARGS__                              \
        } else {                                                                                \
            for (int64_t row = 0; row < (rows); row++) __VA_ARGS__                              \
        }                                                                                       \
    } while (0)

void rowops_norm(const float *x, const float *weight, float eps, float *out, int64_t rows, int64_t features,
                 int threads)
{
    FOR_ROWS(rows, features, threads, {
        const float *in = x + row * features;
        scale(in, inverse_rms(squares(in, features), features, eps), weight, out + row * features, features);
    });
}

void rowops_residual_norm(float *x, const float *delta, const float *weight, float eps, float *out,
                          const float *post_weight, float post_eps, int64_t rows, int64_t features, int threads)
{
    FOR_ROWS(rows, features, threads, {
        float *sum = x + row * features;
        const float *add = delta + row * features;
        float post = post_weight ? inverse_rms(squares(add, features), features, post_eps) : 0.0f;
        vf acc = {0};
        for (int64_t i = 0; i < features; i += LANES) {
            int64_t m = features - i < LANES ? features - i : LANES;
            vf d = load_n(add + i, m);
            if (post_weight)
                d = (d * post) * load_n(post_weight + i, m);
            vf s = load_n(sum + i, m) + d;
            store_n(sum + i, s, m);
            acc = acc + s * s;            /* padded lanes are zero */
        }
        scale(sum, inverse_rms(acc, features, eps), weight, out + row * features, features);
    });
}

/* In place on each row: bias added, then each of the first `heads` heads normalised by its weight row
 * (where head_weight is given) and rotated by the row's cos / sin (rotate-half convention). */
void rowops_rotate(float *qkv, int64_t rows, int64_t features, int64_t heads, int64_t head_dim,
                   const float *cos, int64_t cos_stride, const float *sin, int64_t sin_stride,
                   const float *bias, const float *head_weight, float head_eps, int threads)
{
    int64_t half = head_dim / 2;
    FOR_ROWS(rows, features, threads, {
        float *line = qkv + row * features;
        const float *c = cos + row * cos_stride, *s = sin + row * sin_stride;
        if (bias)
            for (int64_t i = 0; i < features; i += LANES) {
                int64_t m = features - i < LANES ? features - i : LANES;
                store_n(line + i, load_n(line + i, m) + load_n(bias + i, m), m);
            }
        for (int64_t h = 0; h < heads; h++) {
            float *p = line + h * head_dim;
            const float *w = head_weight ? head_weight + h * head_dim : 0;
            float r = w ? inverse_rms(squares(p, head_dim), head_dim, head_eps) : 0.0f;
            for (int64_t i = 0; i < half; i += LANES) {
                int64_t m = half - i < LANES ? half - i : LANES;
                vf a = load_n(p + i, m), b = load_n(p + half + i, m);
                if (w) {
                    a = (a * r) * load_n(w + i, m);
                    b = (b * r) * load_n(w + half + i, m);
                }
                /* h * cos + rotate_half(h) * sin, rotate_half(a, b) = (-b, a): two products, one add. */
                vf first = a * load_n(c + i, m) + (-b) * load_n(s + i, m);
                vf second = b * load_n(c + half + i, m) + a * load_n(s + half + i, m);
                store_n(p + i, first, m);
                store_n(p + half + i, second, m);
            }
        }
    });
}

/* act(x) * up with act(x) = x / (1 + exp(-scale * (x + cube * x^3))): silu (scale 1, cube 0), and the
 * tanh GELU, 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)) with y = sqrt(2/pi) (x + 0.044715 x^3), which
 * keeps full precision where 1 + tanh(y) would cancel. */
void rowops_gated(const float *gate_up, float *out, int64_t rows, int64_t inner, int gelu, int threads)
{
    float factor = gelu ? -1.5957691216057308f : -1.0f, cube = gelu ? 0.044715f : 0.0f;
    FOR_ROWS(rows, 2 * inner, threads, {
        const float *g = gate_up + row * 2 * inner, *u = g + inner;
        float *o = out + row * inner;
        for (int64_t i = 0; i < inner; i += LANES) {
            int64_t m = inner - i < LANES ? inner - i : LANES;
            vf x = load_n(g + i, m);
            vf y = gelu ? x + ((x * x) * x) * cube : x;
            vf act = x / (1.0f + vexp(y * factor));
            store_n(o + i, act * load_n(u + i, m), m);
        }
    });
}

/* exp of n floats (the tests check it against the correctly rounded one). */
void rowops_exp(const float *x, float *out, int64_t n)
{
    for (int64_t i = 0; i < n; i += LANES) {
        int64_t m = n - i < LANES ? n - i : LANES;
        store_n(out + i, vexp(load_n(x + i, m)), m);
    }
}

/* ------------------------------------------------------------------------------------------ log-probabilities */

typedef double vd __attribute__((vector_size(64)));       /* 8 doubles */
typedef int64_t vl __attribute__((vector_size(64)));
typedef float vh __attribute__((vector_size(32)));        /* the 8 floats widened into one vd */

/* exp(x) for x <= 0: x = n ln2 + r (ln2 in two parts, the first exact times n), |r| <= ln2 / 2, exp(r) by
 * Horner's rule on its Taylor series to r^13 (the rest below 1e-17 relative), times 2^n through the exponent
 * bits; exactly 0 below -700 (a term that small is below an ulp of any sum holding exp(0) = 1), -inf too. */
static inline vd vexp64(vd x)
{
    const vd low = (vd){0} - 700.0, magic = (vd){0} + 6755399441055744.0;   /* 1.5 * 2^52: rounds to an integer */
    const vl under = x < low;
    x = (vd)((~under & (vl)x) | (under & (vl)low));
    const vd shifted = x * 1.4426950408889634 + magic;
    const vd n = shifted - magic;
    vd r = x - n * 6.93147180369123816490e-01;
    r = r - n * 1.90821492927058770002e-10;
    static const double taylor[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                      1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600,
                                      1.0 / 6227020800.0};
    vd p = (vd){0} + taylor[13];
    for (int k = 12; k >= 0; k--) p = p * r + taylor[k];
    const vl exponent = ((vl)shifted - (vl)magic) << 52;
    return (vd)(((vl)p + exponent) & ~under);
}

/* Each row's log-sum-exp (float64) of float32 logits (rows, vocab) into mass[row]; where out is given, also
 * the row's log-probabilities out[row][j] = (double)logits[row][j] - mass[row]. A row holding NaN or +inf
 * gets the mass NaN; a row whose largest logit is -inf (all -inf) gets -inf, as log(0). */
void rowops_log_mass(const float *logits, int64_t rows, int64_t vocab, double *mass, double *out, int threads)
{
    FOR_ROWS(rows, vocab, threads, {
        const float *x = logits + row * vocab;
        vf top16 = broadcast(-INFINITY);
        vi bad16 = {0};
        for (int64_t i = 0; i < vocab; i += LANES) {
            vf part = broadcast(-INFINITY);
            memcpy(&part, x + i, (size_t)(vocab - i < LANES ? vocab - i : LANES) * 4);
            bad16 |= (part != part) | (part == broadcast(INFINITY));
            top16 = select(part > top16, part, top16);           /* exact in any order; NaN left out */
        }
        float top32 = top16[0];
        int bad = bad16[0] != 0;
        for (int l = 1; l < LANES; l++) {
            top32 = top16[l] > top32 ? top16[l] : top32;
            bad |= bad16[l] != 0;
        }
        const double top = top32 == -INFINITY ? 0.0 : (double)top32;
        vd acc[4] = {{0}, {0}, {0}, {0}};
        for (int64_t i = 0; i < vocab; i += 32) {
            float chunk[32];
            const int64_t m = vocab - i < 32 ? vocab - i : 32;
            memcpy(chunk, x + i, (size_t)m * 4);
            for (int64_t j = m; j < 32; j++) chunk[j] = -INFINITY;      /* exp(-inf) adds an exact 0 */
            for (int k = 0; k < 4; k++) {
                vh h;
                memcpy(&h, chunk + 8 * k, sizeof h);
                acc[k] += vexp64(__builtin_convertvector(h, vd) - top);
            }
        }
        const vd both = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        double lanes[8];
        memcpy(lanes, &both, sizeof lanes);
        for (int width = 4; width; width /= 2)
            for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
        const double total = bad ? NAN : log(lanes[0]) + top;
        mass[row] = total;
        if (out != NULL) {
            double *o = out + row * vocab;
            for (int64_t j = 0; j < vocab; j++) o[j] = (double)x[j] - total;
        }
    });
}
