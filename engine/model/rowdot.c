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

/* Products of 2 to 16 rows, where `rowdot` re-reads each weight row once per pair of input rows and
 * falls behind from three rows on. The weight is first laid out in panels of PANEL outputs (`panel_pack`): panel p holds
 * W[p*PANEL + j, i] at [i][j], so for each input index i the PANEL weights it meets are contiguous, and a
 * pass over a panel streams it front to back while each input value is broadcast against them. Up to
 * eight rows share one pass (16 accumulators); more rows take more passes over the same panel, which
 * is then in L2.
 *
 * Every output is one fused multiply-add chain over i = 0 .. n-1 from zero, then + bias: the same for
 * any row count, so a row is bitwise the same in any batch these panels run. */
#define PANEL 32

long panel_width(void) { return PANEL; }     /* what rowdot.py sizes a packed weight by */

/* w [out, n] row-major -> packed [ceil(out / PANEL)][n][PANEL], outputs past `out` zero */
void panel_pack(const float *w, float *packed, long out, long n) {
    const long panels = (out + PANEL - 1) / PANEL;
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < n; i++)
            for (long j = 0; j < PANEL; j++) {
                const long o = p * PANEL + j;
                packed[(p * n + i) * PANEL + j] = o < out ? w[o * n + i] : 0.0f;
            }
}

/* y[q * ldy + j] = sum_i panel[i][j] * x[q * n + i] for q < rows (rows <= 8, a constant after inlining) */
AVX512 static inline void panel_rows(const float *panel, const float *x, long n, int rows, float *y, long ldy) {
    __m512 lo[8], hi[8];
    for (int q = 0; q < 8; q++)
        lo[q] = hi[q] = _mm512_setzero_ps();
    for (long i = 0; i < n; i++) {
        const __m512 w0 = _mm512_loadu_ps(panel + i * PANEL), w1 = _mm512_loadu_ps(panel + i * PANEL + 16);
        for (int q = 0; q < rows; q++) {
            const __m512 xq = _mm512_set1_ps(x[q * n + i]);
            lo[q] = _mm512_fmadd_ps(w0, xq, lo[q]);
            hi[q] = _mm512_fmadd_ps(w1, xq, hi[q]);
        }
    }
    for (int q = 0; q < rows; q++) {
        _mm512_storeu_ps(y + q * ldy, lo[q]);
        _mm512_storeu_ps(y + q * ldy + 16, hi[q]);
    }
}

#define PANEL_ROWS(R) \
    AVX512 static void panel_##R(const float *panel, const float *x, long n, float *y, long ldy) { \
        panel_rows(panel, x, n, R, y, ldy); \
    }
PANEL_ROWS(1) PANEL_ROWS(2) PANEL_ROWS(3) PANEL_ROWS(4) PANEL_ROWS(5) PANEL_ROWS(6) PANEL_ROWS(7) PANEL_ROWS(8)

typedef void (*panel_fn)(const float *, const float *, long, float *, long);
static const panel_fn PANEL_FNS[9] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6, panel_7, panel_8};

/* packed from panel_pack, x [rows, n], bias [out] or NULL, y [rows, out]; all contiguous float32 */
AVX512 void paneldot(const float *packed, const float *x, const float *bias, float *y, long out, long n, long rows) {
    const long panels = (out + PANEL - 1) / PANEL;
    float tail[8 * PANEL];
    for (long p = 0; p < panels; p++) {
        const float *panel = packed + p * n * PANEL;
        const long o0 = p * PANEL, width = out - o0 < PANEL ? out - o0 : PANEL;
        for (long r = 0; r < rows; r += 8) {
            const long take = rows - r < 8 ? rows - r : 8;
            float *dst = width == PANEL ? y + r * out + o0 : tail;
            const long ld = width == PANEL ? out : PANEL;
            PANEL_FNS[take](panel, x + r * n, n, dst, ld);
            for (long q = 0; q < take; q++)
                for (long j = 0; j < width; j++) {
                    float *cell = y + (r + q) * out + o0 + j;
                    if (width < PANEL)
                        *cell = tail[q * PANEL + j];
                    if (bias)
                        *cell += bias[o0 + j];
                }
        }
    }
}
