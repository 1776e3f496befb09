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
 * Built at first use by engine/model/rowdot.py with the host's C compiler. Each kernel comes twice, for
 * AVX-512 and for AVX2 (the AMD and older Intel hosts without AVX-512), each compiled for its target only;
 * the exported functions pick one on first call, AVX-512 where the CPU has it, and rowdot_supported()
 * says whether either runs. The AVX2 code keeps the AVX-512 code's arithmetic lane for lane: a 16-lane
 * sum is two 8-lane halves, reduced in the sequence GCC's _mm512_reduce_add_ps uses, and a panel output
 * is the same single multiply-add chain (three rows a pass instead of eight). So both give the same bits (tests/engine/model/test_rowdot.py).
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define AVX512 __attribute__((target("avx512f,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

static int has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
}

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* 512 or 256 (the vector width the kernels run at here), 0 where neither runs; read once per process.
 * KIMI_PD_ROWDOT_ISA=avx2 takes the AVX2 code on an AVX-512 host (to compare the two there). */
static int isa_width(void) {
    static int width = -1;
    if (width < 0) {
        const char *forced = getenv("KIMI_PD_ROWDOT_ISA");
        const int avx2_only = forced != NULL && strcmp(forced, "avx2") == 0;
        width = has_avx512() && !avx2_only ? 512 : (has_avx2() ? 256 : 0);
    }
    return width;
}

int rowdot_supported(void) {
    return isa_width() != 0;
}

/* 512 or 256: which code the exported functions run (for the tests and the benchmarks' records) */
int rowdot_width(void) {
    return isa_width();
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

/* rowdot's loop over the outputs, two input rows at a time, for one ISA's ONE/TWO row functions */
#define ROWDOT_OVER_OUTPUTS(ATTR, NAME, ONE, TWO) \
    ATTR static void NAME(const float *weight, const float *x, const float *bias, float *y, long out, long n, \
                          long rows) { \
        for (long o = 0; o < out; o++) { \
            const float *w = weight + o * n; \
            const float b = bias ? bias[o] : 0.0f; \
            long r = 0; \
            for (; r + 2 <= rows; r += 2) \
                TWO(w, x + r * n, n, b, y + r * out + o, out); \
            if (r < rows) \
                ONE(w, x + r * n, n, b, y + r * out + o, out); \
        } \
    }
ROWDOT_OVER_OUTPUTS(AVX512, rowdot_512, one_row, two_rows)

/* ---- the same kernels on AVX2 -------------------------------------------------------------------- */

/* _mm512_reduce_add_ps of the 16 lanes (lo = lanes 0-7, hi = lanes 8-15), in GCC's sequence: the two
 * 256-bit halves added, then the two 128-bit halves of that, then lanes (0,2) and (1,3), then those two. */
AVX2 static inline float reduce16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}

/* `dots` with each 16-lane accumulator as two 8-lane halves: the same multiply-adds lane for lane */
AVX2 static inline void dots_256(const float *w, const float *x, long n, int rows, float bias, float *y, long ldy) {
    const long n32 = n & ~31L, n16 = n & ~15L;
    __m256 even_lo[2], even_hi[2], odd_lo[2], odd_hi[2];
    for (int q = 0; q < 2; q++)
        even_lo[q] = even_hi[q] = odd_lo[q] = odd_hi[q] = _mm256_setzero_ps();
    long i = 0;
    for (; i < n32; i += 32) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        const __m256 w2 = _mm256_loadu_ps(w + i + 16), w3 = _mm256_loadu_ps(w + i + 24);
        for (int q = 0; q < rows; q++) {
            const float *xq = x + q * n + i;
            even_lo[q] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xq), even_lo[q]);
            even_hi[q] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xq + 8), even_hi[q]);
            odd_lo[q] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xq + 16), odd_lo[q]);
            odd_hi[q] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xq + 24), odd_hi[q]);
        }
    }
    if (i < n16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int q = 0; q < rows; q++) {
            even_lo[q] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + q * n + i), even_lo[q]);
            even_hi[q] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + q * n + i + 8), even_hi[q]);
        }
    }
    for (int q = 0; q < rows; q++) {
        float s = reduce16(_mm256_add_ps(even_lo[q], odd_lo[q]), _mm256_add_ps(even_hi[q], odd_hi[q]));
        for (long j = n16; j < n; j++)
            s += w[j] * x[q * n + j];
        y[q * ldy] = s + bias;
    }
}

AVX2 static void one_row_256(const float *w, const float *x, long n, float bias, float *y, long ldy) {
    dots_256(w, x, n, 1, bias, y, ldy);
}

AVX2 static void two_rows_256(const float *w, const float *x, long n, float bias, float *y, long ldy) {
    dots_256(w, x, n, 2, bias, y, ldy);
}

ROWDOT_OVER_OUTPUTS(AVX2, rowdot_256, one_row_256, two_rows_256)

/* weight [out, n] row-major, x [rows, n], bias [out] or NULL, y [rows, out]; all contiguous float32 */
void rowdot(const float *weight, const float *x, const float *bias, float *y, long out, long n, long rows) {
    if (isa_width() == 512)
        rowdot_512(weight, x, bias, y, out, n, rows);
    else
        rowdot_256(weight, x, bias, y, out, n, rows);
}

/* Several products of one shape in one call (a MoE layer's chosen experts): for j < jobs,
 * y_j = x_j W_j^T with W_j [out, n], x_j [rows_j, n], y_j [rows_j, out], each as `rowdot` computes it,
 * so bitwise the same as one `rowdot` call per job. The pointers come as integers (one ctypes array each). */
void rowdot_jobs(long jobs, const long *weights, const long *xs, const long *ys, const long *rows,
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

/* up to 8 rows of one panel into dst (ld apart) */
AVX512 static void panel_rows_512(const float *panel, const float *x, long n, long rows, float *dst, long ld) {
    PANEL_FNS[rows](panel, x, n, dst, ld);
}

/* paneldot over the panels, eight rows at a time, for one ISA's ROWS function (panel_rows_512 / _256); a
 * panel past `out` goes through `tail`, and the bias is added after the products */
#define PANELDOT_OVER_PANELS(ATTR, NAME, ROWS) \
    ATTR static void NAME(const float *packed, const float *x, const float *bias, float *y, long out, long n, \
                          long rows) { \
        const long panels = (out + PANEL - 1) / PANEL; \
        float tail[8 * PANEL]; \
        for (long p = 0; p < panels; p++) { \
            const float *panel = packed + p * n * PANEL; \
            const long o0 = p * PANEL, width = out - o0 < PANEL ? out - o0 : PANEL; \
            for (long r = 0; r < rows; r += 8) { \
                const long take = rows - r < 8 ? rows - r : 8; \
                float *dst = width == PANEL ? y + r * out + o0 : tail; \
                const long ld = width == PANEL ? out : PANEL; \
                ROWS(panel, x + r * n, n, take, dst, ld); \
                for (long q = 0; q < take; q++) \
                    for (long j = 0; j < width; j++) { \
                        float *cell = y + (r + q) * out + o0 + j; \
                        if (width < PANEL) \
                            *cell = tail[q * PANEL + j]; \
                        if (bias) \
                            *cell += bias[o0 + j]; \
                    } \
            } \
        } \
    }
PANELDOT_OVER_PANELS(AVX512, paneldot_512, panel_rows_512)

/* The panels on AVX2: a whole panel row (32 outputs, four 8-lane accumulators a row) for up to three rows
 * a pass, so the twelve accumulators, four weights and the broadcast fit the sixteen registers; each output
 * is the same single multiply-add chain over i as on AVX-512. Read as half panels of four rows it streamed
 * 6-35 % slower at two to eight rows on an AVX2 EPYC (every other cache line per pass). */
AVX2 static inline void panel_rows3(const float *panel, const float *x, long n, int rows, float *y, long ldy) {
    __m256 a0[3], a1[3], a2[3], a3[3];
    for (int q = 0; q < 3; q++)
        a0[q] = a1[q] = a2[q] = a3[q] = _mm256_setzero_ps();
    for (long i = 0; i < n; i++) {
        const float *p = panel + i * PANEL;
        const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
        const __m256 w2 = _mm256_loadu_ps(p + 16), w3 = _mm256_loadu_ps(p + 24);
        for (int q = 0; q < rows; q++) {
            const __m256 xq = _mm256_set1_ps(x[q * n + i]);
            a0[q] = _mm256_fmadd_ps(w0, xq, a0[q]);
            a1[q] = _mm256_fmadd_ps(w1, xq, a1[q]);
            a2[q] = _mm256_fmadd_ps(w2, xq, a2[q]);
            a3[q] = _mm256_fmadd_ps(w3, xq, a3[q]);
        }
    }
    for (int q = 0; q < rows; q++) {
        _mm256_storeu_ps(y + q * ldy, a0[q]);
        _mm256_storeu_ps(y + q * ldy + 8, a1[q]);
        _mm256_storeu_ps(y + q * ldy + 16, a2[q]);
        _mm256_storeu_ps(y + q * ldy + 24, a3[q]);
    }
}

#define PANEL_ROWS3(R) \
    AVX2 static void panel3_##R(const float *panel, const float *x, long n, float *y, long ldy) { \
        panel_rows3(panel, x, n, R, y, ldy); \
    }
PANEL_ROWS3(1) PANEL_ROWS3(2) PANEL_ROWS3(3)

static const panel_fn PANEL3_FNS[4] = {0, panel3_1, panel3_2, panel3_3};

/* up to 8 rows of one panel into dst (ld apart), as panel_rows does on AVX-512 */
AVX2 static void panel_rows_256(const float *panel, const float *x, long n, long rows, float *dst, long ld) {
    for (long r = 0; r < rows; r += 3) {
        const long take = rows - r < 3 ? rows - r : 3;
        PANEL3_FNS[take](panel, x + r * n, n, dst + r * ld, ld);
    }
}

PANELDOT_OVER_PANELS(AVX2, paneldot_256, panel_rows_256)

/* packed from panel_pack, x [rows, n], bias [out] or NULL, y [rows, out]; all contiguous float32 */
void paneldot(const float *packed, const float *x, const float *bias, float *y, long out, long n, long rows) {
    if (isa_width() == 512)
        paneldot_512(packed, x, bias, y, out, n, rows);
    else
        paneldot_256(packed, x, bias, y, out, n, rows);
}
