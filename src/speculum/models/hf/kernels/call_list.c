/* A forward's kernel calls, run in order by one call from Python.
 *
 * Each record names its function's signature (kind), the function, and its arguments: the pointer and integer
 * arguments in order, then the float arguments in order. The thread count is every function's last argument,
 * given at run time (one thread for a record whose work is too small to share). Each function is called with
 * exactly the arguments, in the order, its Python call passes: the results are the same bits.
 *
 * The kinds are the signatures of this package's kernels (q8_groups.c, gguf_groups.c, row_ops.c,
 * attention_rows.c); a pointer of any type is passed as void *, as the x86-64 and AArch64 calling conventions
 * pass every data pointer alike. */
#include <stdint.h>
#include <string.h>

enum {
    PRODUCT_STATUS = 0,     /* int  f(x, rows, in, records, out_features, out, threads): 8-bit products */
    PRODUCT = 1,            /* void f(x, rows, in, records, out_features, out, threads): float32 products */
    NORM = 2,               /* void rowops_norm(x, weight, eps, out, rows, width, threads) */
    RESIDUAL_NORM = 3,      /* void rowops_residual_norm(x, delta, weight, eps, out, post, post eps, rows, width,
                               threads) */
    ROTATE = 4,             /* void rowops_rotate(qkv, 4 counts, cos, stride, sin, stride, bias, norm, eps, threads) */
    GATED = 5,              /* void rowops_gated(gate_up, out, rows, inner, activation, threads) */
    ATTENTION = 6,          /* int  attention_rows(17 pointers and counts, scale among them, threads) */
    COPY = 7,               /* void copy_columns(source, out, rows, columns, out_stride, threads) (below) */
};

#define INTEGERS 18

typedef struct {
    int64_t kind, threaded;
    void *function;
    int64_t integers[INTEGERS];
    float floats[2];
} call_record;

typedef void *P;
typedef int64_t I;

int64_t call_record_bytes(void) { return (int64_t)sizeof(call_record); }
int64_t call_record_integers(void) { return INTEGERS; }

/* Rows (rows, columns) of `source` into the first `columns` of each row of `out`, whose rows are `out_stride`
 * floats apart: a product of several weight kinds side by side writes each kind's outputs into its columns. */
void copy_columns(const float *source, float *out, int64_t rows, int64_t columns, int64_t out_stride, int threads)
{
    (void)threads;
    for (int64_t r = 0; r < rows; r++)
        memcpy(out + r * out_stride, source + r * columns, sizeof(float) * (size_t)columns);
}

/* Runs calls[0 .. count - 1] in order. Returns 0, or 1 + the index of the first call that returned a status
 * other than 0 (a kernel that could not allocate its buffers), after which nothing more runs; -1 for a kind
 * this file does not know (nothing after it runs). */
int64_t run_calls(const call_record *calls, int64_t count, int threads)
{
    for (int64_t i = 0; i < count; i++) {
        const call_record *call = calls + i;
        const I *a = call->integers;
        const float *f = call->floats;
        const int t = call->threaded ? threads : 1;
        int status = 0;
        switch (call->kind) {
        case PRODUCT_STATUS:
            status = ((int (*)(P, I, I, P, I, P, int))call->function)((P)a[0], a[1], a[2], (P)a[3], a[4], (P)a[5], t);
            break;
        case PRODUCT:
            ((void (*)(P, I, I, P, I, P, int))call->function)((P)a[0], a[1], a[2], (P)a[3], a[4], (P)a[5], t);
            break;
        case NORM:
            ((void (*)(P, P, float, P, I, I, int))call->function)((P)a[0], (P)a[1], f[0], (P)a[2], a[3], a[4], t);
            break;
        case RESIDUAL_NORM:
            ((void (*)(P, P, P, float, P, P, float, I, I, int))call->function)(
                (P)a[0], (P)a[1], (P)a[2], f[0], (P)a[3], (P)a[4], f[1], a[5], a[6], t);
            break;
        case ROTATE:
            ((void (*)(P, I, I, I, I, P, I, P, I, P, P, float, int))call->function)(
                (P)a[0], a[1], a[2], a[3], a[4], (P)a[5], a[6], (P)a[7], a[8], (P)a[9], (P)a[10], f[0], t);
            break;
        case GATED:
            ((void (*)(P, P, I, I, int, int))call->function)((P)a[0], (P)a[1], a[2], a[3], (int)a[4], t);
            break;
        case ATTENTION:
            status = ((int (*)(I, I, I, I, P, I, P, P, I, P, P, P, float, P, P, P, I, int))call->function)(
                a[0], a[1], a[2], a[3], (P)a[4], a[5], (P)a[6], (P)a[7], a[8], (P)a[9], (P)a[10], (P)a[11], f[0],
                (P)a[12], (P)a[13], (P)a[14], a[15], t);
            break;
        case COPY:
            ((void (*)(P, P, I, I, I, int))call->function)((P)a[0], (P)a[1], a[2], a[3], a[4], t);
            break;
        default:
            return -1;
        }
        if (status) return i + 1;
    }
    return 0;
}
