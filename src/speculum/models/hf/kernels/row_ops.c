/* Row-wise float32 glue between a decoder block's matrix products: RMSNorm, the residual add with its
 * norm, the query/key bias, head norms and rotary rotation, and the gated activation of the MLP.
 *
 * Every output row is a function of its own input row alone, computed in one fixed order: sums of
 * squares in 16 lanes (lane i holds elements i, i + 16, ...; a short last chunk is padded with zeros,
 * which add exact zeros), then one fixed tree over the lanes. Nothing depends on the number of rows in a
 * call, on where a row lies in memory or on the thread count, so rows are bitwise the same however they
 * are batched (ROW-CANONICAL by construction).
 *
 * The vectors are GCC's generic vector extensions of the CPU's own width (NATIVE lanes: 16 with AVX-512,
 * else 8): a vector wider than the registers would live on the stack, every operation on it a load and a
 * store. A 16-lane partial is then HALVES such vectors, and the tree over its lanes adds the same pairs
 * at any width. Each lane's operations are the same IEEE operations in the same order whatever the
 * width (no contraction: -ffp-contract=off), so every target computes the same bits; NATIVE_LANES=16
 * builds AVX-512's code for any CPU (tested against the native build).
 *
 * exp is a range-reduced polynomial (Cody-Waite reduction by ln 2, a degree-7 polynomial, scaling by two
 * powers of two so that results near overflow and in the subnormal range round once); it is within 2 ulp
 * of a correctly rounded expf over the float range, saturates to inf above 88.73 and to +0 below -103.98.
 *
 * log_mass is each row's float64 log-sum-exp of float32 logits (the normaliser of its log-probabilities),
 * with a float64 exp of its own (Cody-Waite reduction, the Taylor polynomial to degree 13: a few ulp), the
 * exponentials summed in 32 lanes (lane l holds elements l, l + 32, ...), then one fixed tree.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The vectors stay inside this file: how a target passes vectors wider than its registers does not matter. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define LANES 16                    /* the lanes of a sum's partials: lane l holds elements l, l + 16, ... */
#if defined(NATIVE_LANES)
#define NATIVE NATIVE_LANES
#elif defined(__AVX512F__)
#define NATIVE 16
#else
#define NATIVE 8
#endif
#define HALVES (LANES / NATIVE)
#define PARALLEL_ELEMENTS 32768     /* below this a call's rows run on the calling thread alone */

typedef float vf __attribute__((vector_size(NATIVE * 4)));
typedef int32_t vi __attribute__((vector_size(NATIVE * 4)));
typedef uint32_t vu __attribute__((vector_size(NATIVE * 4)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* The first n (< NATIVE) elements, the other lanes `pad`. */
static inline vf load_part(const float *p, int64_t n, float pad)
{
    float lanes[NATIVE];
    for (int l = 0; l < NATIVE; l++) lanes[l] = l < n ? p[l] : pad;
    return load(lanes);
}
static inline void store_part(float *p, vf v, int64_t n) { memcpy(p, &v, (size_t)n * 4); }
static inline vf load_n(const float *p, int64_t n) { return n >= NATIVE ? load(p) : load_part(p, n, 0.0f); }
static inline void store_n(float *p, vf v, int64_t n) { if (n >= NATIVE) store(p, v); else store_part(p, v, n); }
static inline vf broadcast(float x) { return (vf){0} + x; }
static inline vf select(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }
/* The elements left from i of n, at most one vector's worth. */
static inline int64_t part(int64_t n, int64_t i) { return n - i < NATIVE ? n - i : NATIVE; }

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

/* A 16-lane partial sum: HALVES vectors, lanes h * NATIVE .. of the 16 in sum[h]. */
typedef struct { vf half[HALVES]; } sum16;
/* Which of them the vector of elements at .. at + NATIVE - 1 adds into (lane l holds elements l, l + 16, ...). */
static inline int half_of(int64_t at) { return (int)(at / NATIVE % HALVES); }

/* Lane-wise partial sums of squares of n elements, 16 at a time (past the end nothing is added: a padded
 * lane would add an exact +0 to a sum that is never -0). */
static inline sum16 squares(const float *p, int64_t n)
{
    sum16 sum = {{{0}}};
    for (int64_t at = 0; at < n; at += NATIVE) {
        vf v = load_n(p + at, part(n, at));
        sum.half[half_of(at)] = sum.half[half_of(at)] + v * v;
    }
    return sum;
}

/* 1 / sqrt(mean + eps) from the 16 lanes' partial sums: lanes folded in halves, 8 then 4, 2, 1. */
static inline float inverse_rms(sum16 sum, int64_t n, float eps)
{
    float s[LANES];
    for (int h = 0; h < HALVES; h++) store(s + h * NATIVE, sum.half[h]);
    for (int width = LANES / 2; width; width >>= 1)
        for (int i = 0; i < width; i++)
            s[i] = s[i] + s[i + width];
    return 1.0f / sqrtf(s[0] / (float)n + eps);
}

/* out = (x * r) * weight over n elements. */
static inline void scale(const float *x, float r, const float *weight, float *out, int64_t n)
{
    for (int64_t i = 0; i < n; i += NATIVE) {
        int64_t m = part(n, i);
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
        sum16 acc = {{{0}}};
        for (int64_t at = 0; at < features; at += NATIVE) {
            int64_t m = part(features, at);
            vf d = load_n(add + at, m);
            if (post_weight)
                d = (d * post) * load_n(post_weight + at, m);
            vf s = load_n(sum + at, m) + d;
            store_n(sum + at, s, m);
            acc.half[half_of(at)] = acc.half[half_of(at)] + s * s;      /* padded lanes are zero */
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
            for (int64_t i = 0; i < features; i += NATIVE) {
                int64_t m = part(features, i);
                store_n(line + i, load_n(line + i, m) + load_n(bias + i, m), m);
            }
        for (int64_t h = 0; h < heads; h++) {
            float *p = line + h * head_dim;
            const float *w = head_weight ? head_weight + h * head_dim : 0;
            float r = w ? inverse_rms(squares(p, head_dim), head_dim, head_eps) : 0.0f;
            for (int64_t i = 0; i < half; i += NATIVE) {
                int64_t m = part(half, i);
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
        for (int64_t i = 0; i < inner; i += NATIVE) {
            int64_t m = part(inner, i);
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
    for (int64_t i = 0; i < n; i += NATIVE) {
        int64_t m = part(n, i);
        store_n(out + i, vexp(load_n(x + i, m)), m);
    }
}

/* ------------------------------------------------------------------------------------------ log-probabilities */

#define DOUBLES (NATIVE / 2)                 /* doubles a register holds */
#define SPREAD 32                             /* the exponentials' lanes: lane l holds elements l, l + 32, ... */
typedef double vd __attribute__((vector_size(DOUBLES * 8)));
typedef int64_t vl __attribute__((vector_size(DOUBLES * 8)));
typedef float vh __attribute__((vector_size(DOUBLES * 4)));        /* the floats widened into one vd */

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

/* The sums of exp(x - top) over 32 floats into the SPREAD lanes of acc (acc[a]: lanes a * DOUBLES ..). */
static inline void add_exps(vd acc[SPREAD / DOUBLES], const float *x, double top)
{
    for (int a = 0; a < SPREAD / DOUBLES; a++) {
        vh h;
        memcpy(&h, x + a * DOUBLES, sizeof h);
        acc[a] += vexp64(__builtin_convertvector(h, vd) - top);
    }
}

/* Each row's log-sum-exp (float64) of float32 logits (rows, vocab) into mass[row]; where out is given, also
 * the row's log-probabilities out[row][j] = (double)logits[row][j] - mass[row]. A row holding NaN or +inf
 * gets the mass NaN; a row whose largest logit is -inf (all -inf) gets -inf, as log(0). */
void rowops_log_mass(const float *logits, int64_t rows, int64_t vocab, double *mass, double *out, int threads)
{
    FOR_ROWS(rows, vocab, threads, {
        const float *x = logits + row * vocab;
        vf top16[HALVES];
        vi bad16 = {0};
        for (int h = 0; h < HALVES; h++) top16[h] = broadcast(-INFINITY);
        for (int64_t at = 0; at < vocab; at += NATIVE) {
            const int64_t m = part(vocab, at);
            const vf chunk = m == NATIVE ? load(x + at) : load_part(x + at, m, -INFINITY);
            vf *top = &top16[half_of(at)];
            bad16 |= (chunk != chunk) | (chunk == broadcast(INFINITY));
            *top = select(chunk > *top, chunk, *top);                    /* exact in any order; NaN left out */
        }
        float lanes16[LANES];
        for (int h = 0; h < HALVES; h++) store(lanes16 + h * NATIVE, top16[h]);
        float top32 = lanes16[0];
        int bad = 0;
        for (int l = 1; l < LANES; l++) top32 = lanes16[l] > top32 ? lanes16[l] : top32;
        for (int l = 0; l < NATIVE; l++) bad |= bad16[l] != 0;
        const double top = top32 == -INFINITY ? 0.0 : (double)top32;
        vd acc[SPREAD / DOUBLES];
        for (int a = 0; a < SPREAD / DOUBLES; a++) acc[a] = (vd){0};
        int64_t i = 0;
        for (; i + SPREAD <= vocab; i += SPREAD) add_exps(acc, x + i, top);
        if (i < vocab) {
            float chunk[SPREAD];
            for (int j = 0; j < SPREAD; j++) chunk[j] = i + j < vocab ? x[i + j] : -INFINITY;   /* adds exact 0s */
            add_exps(acc, chunk, top);
        }
        double sums[SPREAD], eight[8];
        for (int a = 0; a < SPREAD / DOUBLES; a++) memcpy(sums + a * DOUBLES, &acc[a], sizeof acc[a]);
        /* The 32 lanes into 8 as four groups of 8 added in pairs, then the 8 folded in halves. */
        for (int l = 0; l < 8; l++) eight[l] = (sums[l] + sums[8 + l]) + (sums[16 + l] + sums[24 + l]);
        for (int width = 4; width; width /= 2)
            for (int l = 0; l < width; l++) eight[l] += eight[l + width];
        const double total = bad ? NAN : log(eight[0]) + top;
        mass[row] = total;
        if (out != NULL) {
            double *o = out + row * vocab;
            for (int64_t j = 0; j < vocab; j++) o[j] = (double)x[j] - total;
        }
    });
}
