/* Float32 products of a few input rows with a row-major weight: y = x W^T (+ b).
 *
 * Why: at one to three rows a decode step's linears only stream their weight, and on the project's AMD
 * host oneDNN (packed or not), MKL and OpenBLAS read it at 9-22 GB/s where a plain sum reads 20-27 GB/s.
 * This kernel reads each weight row once, front to back, which is what the hardware prefetcher follows
 * best (engine/model/rowdot.py, benchmarks/results/engine_throughput.md).
 *
 * Every dot product is summed in one order whatever the row count: two 16-lane partial sums (the even
 * and the odd 16-float chunks of the input), added, reduced across lanes by the compiler's fixed
 * sequence, then the scalar tail. So a row computed alone is bitwise the same row computed in a pair.
 *
 * Built at first use by engine/model/rowdot.py with the host's C compiler; the AVX-512 code is
 * compiled for that target only and runs only where rowdot_supported() says the CPU has it.
 */
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,fma")))

int rowdot_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}

/* y[q * ldy] = dot(w, x + q * n) + bias for q < rows (rows is 1 or 2, a constant after inlining) */
AVX512 static inline void dots(const float *w, const float *x, long n, int rows, float bias, float *y, long ldy) {
    const long n32 = n & ~31L, n16 = n & ~15L;
    __m512 even[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 odd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    long i = 0;
    for (; i < n32; i += 32) {
        const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + i + 16);
        for (int q = 0; q < rows; q++) {
            even[q] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + q * n + i), even[q]);
            odd[q] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + q * n + i + 16), odd[q]);
        }
    }
    if (i < n16) {
        const __m512 w0 = _mm512_loadu_ps(w + i);
        for (int q = 0; q < rows; q++)
            even[q] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + q * n + i), even[q]);
    }
    for (int q = 0; q < rows; q++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(even[q], odd[q]));
        for (long j = n16; j < n; j++)
            s += w[j] * x[q * n + j];
        y[q * ldy] = s + bias;
    }
}

AVX512 static void one_row(const float *w, const float *x, long n, float bias, float *y, long ldy) {
    dots(w, x, n, 1, bias, y, ldy);
}

AVX512 static void two_rows(const float *w, const float *x, long n, float bias, float *y, long ldy) {
    dots(w, x, n, 2, bias, y, ldy);
}

/* weight [out, n] row-major, x [rows, n], bias [out] or NULL, y [rows, out]; all contiguous float32 */
AVX512 void rowdot(const float *weight, const float *x, const float *bias, float *y, long out, long n, long rows) {
    for (long o = 0; o < out; o++) {
        const float *w = weight + o * n;
        const float b = bias ? bias[o] : 0.0f;
        long r = 0;
        for (; r + 2 <= rows; r += 2)
            two_rows(w, x + r * n, n, b, y + r * out + o, out);
        if (r < rows)
            one_row(w, x + r * n, n, b, y + r * out + o, out);
    }
}

/* Several products of one shape in one call (a MoE layer's chosen experts): for j < jobs,
 * y_j = x_j W_j^T with W_j [out, n], x_j [rows_j, n], y_j [rows_j, out], each as `rowdot` computes it,
 * so bitwise the same as one `rowdot` call per job. The pointers come as integers (one ctypes array each). */
AVX512 void rowdot_jobs(long jobs, const long *weights, const long *xs, const long *ys, const long *rows,
                        long out, long n) {
    for (long j = 0; j < jobs; j++)
        rowdot((const float *)weights[j], (const float *)xs[j], 0, (float *)ys[j], out, n, rows[j]);
}
