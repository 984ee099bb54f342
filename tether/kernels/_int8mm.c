/*
 * Weight-only int8 matmul for CPU float32: out[m, n] = scale[n] * sum_k x[m, k] * q[n, k] + bias[n].
 *
 * Decoding reads every weight once per step for a handful of rows, so a float32 projection is bound by
 * moving 4 bytes per weight; this kernel moves 1 and widens it in registers (int8 -> int32 -> float32),
 * then multiplies in float32, so its result is the dequantized float matmul up to summation order. The
 * weight is packed ahead of time (tether/kernels/int8_gemm.py) as panels of 32 output channels, k-major:
 * panel p holds q[32p .. 32p+31, k] at bytes [p][k][0..31], zero rows padding the last panel, and the
 * scales and biases padded to the same 32p width. A k step then loads 32 weights of 32 outputs, each
 * broadcast row value of x feeds two 16-wide FMAs (AVX-512) or two 8-wide ones (AVX2, one half panel at a
 * time), and no horizontal sum is needed: any K works, no padding of x.
 *
 * Each output's sum runs over k in order with one FMA per term on both vector paths, so the AVX-512 and
 * AVX2 paths give the same bits, and a row's result does not depend on how many rows share the call (the
 * tile sizes change which outputs are computed together, never the order of a sum); the file is built
 * with -ffp-contract=off so that the scale and bias stay a multiply then an add on every path. Few rows leave too
 * few independent sums to hide the FMA latency, so small row tiles take several panels at once.
 *
 * Paths: AVX-512F, AVX2+FMA and portable C; the caller picks (`int8_kernel`, from the CPU's features) so
 * every path runs and is tested on any CPU that has it; asking for one this CPU lacks is a ValueError.
 * Panels are split over threads of torch's own OpenMP runtime, as in _paged.c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define PANEL 32
#define MAX_THREADS 64

enum { PORTABLE = 0, AVX2_PATH = 1, AVX512_PATH = 2 };

typedef struct {
    const float *x;      /* [m, k] */
    const int8_t *w;     /* [panels, k, 32] */
    const float *scale;  /* [panels * 32] */
    const float *bias;   /* [panels * 32] or NULL */
    float *out;          /* [m, n] */
    int64_t m, n, k, panels;
} Problem;

/* Writes one row's outputs of panel p from a 32-float buffer: only the columns below n exist. */
static inline void store_row(const Problem *p, int64_t row, int64_t panel, const float *values) {
    const int64_t first = panel * PANEL, width = p->n - first < PANEL ? p->n - first : PANEL;
    float *dst = p->out + row * p->n + first;
    for (int64_t c = 0; c < width; c++) dst[c] = values[c];
}

/* Portable path: any CPU. */
static void panels_scalar(const Problem *p, int64_t first, int64_t last) {
    float acc[PANEL];
    for (int64_t panel = first; panel < last; panel++) {
        const int8_t *w = p->w + panel * p->k * PANEL;
        for (int64_t row = 0; row < p->m; row++) {
            const float *x = p->x + row * p->k;
            for (int c = 0; c < PANEL; c++) acc[c] = 0;
            for (int64_t k = 0; k < p->k; k++)
                for (int c = 0; c < PANEL; c++) acc[c] += x[k] * (float)w[k * PANEL + c];
            for (int c = 0; c < PANEL; c++) {
                const int64_t col = panel * PANEL + c;
                acc[c] = acc[c] * p->scale[col] + (p->bias ? p->bias[col] : 0.0f);
            }
            store_row(p, row, panel, acc);
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))

/* AVX-512: `panes` panels x `rows` rows from row m0, 2 * panes * rows accumulators in registers. */
AVX512 INLINE void tile512(const Problem *p, int64_t panel, int64_t m0, const int panes, const int rows) {
    __m512 acc[4][12][2];
    const int8_t *w[4];
#pragma GCC unroll 4
    for (int q = 0; q < panes; q++) {
        w[q] = p->w + (panel + q) * p->k * PANEL;
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) acc[q][r][0] = acc[q][r][1] = _mm512_setzero_ps();
    }
    const float *x = p->x + m0 * p->k;
    for (int64_t k = 0; k < p->k; k++) {
#pragma GCC unroll 4
        for (int q = 0; q < panes; q++) {
            const int8_t *src = w[q] + k * PANEL;
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
            const __m512 hi =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
#pragma GCC unroll 12
            for (int r = 0; r < rows; r++) {
                const __m512 xr = _mm512_set1_ps(x[r * p->k + k]);
                acc[q][r][0] = _mm512_fmadd_ps(xr, lo, acc[q][r][0]);
                acc[q][r][1] = _mm512_fmadd_ps(xr, hi, acc[q][r][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < panes; q++) {
        const int64_t col = (panel + q) * PANEL;
        const __m512 s0 = _mm512_loadu_ps(p->scale + col), s1 = _mm512_loadu_ps(p->scale + col + 16);
        const __m512 b0 = p->bias ? _mm512_loadu_ps(p->bias + col) : _mm512_setzero_ps();
        const __m512 b1 = p->bias ? _mm512_loadu_ps(p->bias + col + 16) : _mm512_setzero_ps();
        const int64_t width = p->n - col < PANEL ? p->n - col : PANEL;
        const __mmask16 m_lo = width >= 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
        const __mmask16 m_hi = width >= PANEL ? 0xFFFF : width <= 16 ? 0 : (__mmask16)((1u << (width - 16)) - 1);
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            float *dst = p->out + (m0 + r) * p->n + col;
            _mm512_mask_storeu_ps(dst, m_lo, _mm512_add_ps(_mm512_mul_ps(acc[q][r][0], s0), b0));
            _mm512_mask_storeu_ps(dst + 16, m_hi, _mm512_add_ps(_mm512_mul_ps(acc[q][r][1], s1), b1));
        }
    }
}

AVX512 static void panels_avx512(const Problem *p, int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < p->m; m0 += 12) {
        const int64_t rows = p->m - m0 < 12 ? p->m - m0 : 12;
        /* fewer than 4 rows: several panels per tile, so at least 8 sums are in flight */
        const int panes = rows == 1 ? 4 : rows < 4 ? 2 : 1;
        int64_t panel = first;
        for (; panes > 1 && panel + panes <= last; panel += panes) {
            if (rows == 1) tile512(p, panel, m0, 4, 1);
            else if (rows == 2) tile512(p, panel, m0, 2, 2);
            else tile512(p, panel, m0, 2, 3);
        }
        for (; panel < last; panel++) switch (rows) {
            case 1: tile512(p, panel, m0, 1, 1); break;
            case 2: tile512(p, panel, m0, 1, 2); break;
            case 3: tile512(p, panel, m0, 1, 3); break;
            case 4: tile512(p, panel, m0, 1, 4); break;
            case 5: tile512(p, panel, m0, 1, 5); break;
            case 6: tile512(p, panel, m0, 1, 6); break;
            case 7: tile512(p, panel, m0, 1, 7); break;
            case 8: tile512(p, panel, m0, 1, 8); break;
            case 9: tile512(p, panel, m0, 1, 9); break;
            case 10: tile512(p, panel, m0, 1, 10); break;
            case 11: tile512(p, panel, m0, 1, 11); break;
            default: tile512(p, panel, m0, 1, 12); break;
        }
    }
}

/* AVX2: `halves` half panels (16 outputs each, half h of panel h / 2) x `rows` rows, 2 * halves * rows
   accumulators. */
AVX2 INLINE void tile256(const Problem *p, int64_t half, int64_t m0, const int halves, const int rows) {
    __m256 acc[4][6][2];
    const int8_t *w[4];
#pragma GCC unroll 4
    for (int q = 0; q < halves; q++) {
        const int64_t h = half + q;
        w[q] = p->w + (h / 2) * p->k * PANEL + (h % 2) * 16;
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) acc[q][r][0] = acc[q][r][1] = _mm256_setzero_ps();
    }
    const float *x = p->x + m0 * p->k;
    for (int64_t k = 0; k < p->k; k++) {
#pragma GCC unroll 4
        for (int q = 0; q < halves; q++) {
            const int8_t *src = w[q] + k * PANEL;
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
            const __m256 hi =
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8))));
#pragma GCC unroll 6
            for (int r = 0; r < rows; r++) {
                const __m256 xr = _mm256_broadcast_ss(x + r * p->k + k);
                acc[q][r][0] = _mm256_fmadd_ps(xr, lo, acc[q][r][0]);
                acc[q][r][1] = _mm256_fmadd_ps(xr, hi, acc[q][r][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < halves; q++) {
        const int64_t col = (half + q) * 16;
        const __m256 s0 = _mm256_loadu_ps(p->scale + col), s1 = _mm256_loadu_ps(p->scale + col + 8);
        const __m256 b0 = p->bias ? _mm256_loadu_ps(p->bias + col) : _mm256_setzero_ps();
        const __m256 b1 = p->bias ? _mm256_loadu_ps(p->bias + col + 8) : _mm256_setzero_ps();
        const int64_t width = p->n - col < 16 ? p->n - col : 16;
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            float *dst = p->out + (m0 + r) * p->n + col;
            const __m256 v0 = _mm256_add_ps(_mm256_mul_ps(acc[q][r][0], s0), b0);
            const __m256 v1 = _mm256_add_ps(_mm256_mul_ps(acc[q][r][1], s1), b1);
            if (width == 16) {
                _mm256_storeu_ps(dst, v0);
                _mm256_storeu_ps(dst + 8, v1);
            } else if (width > 0) {
                float values[16];
                _mm256_storeu_ps(values, v0);
                _mm256_storeu_ps(values + 8, v1);
                for (int64_t c = 0; c < width; c++) dst[c] = values[c];
            }
        }
    }
}

AVX2 static void panels_avx2(const Problem *p, int64_t first, int64_t last) {
    const int64_t end = 2 * last;
    for (int64_t m0 = 0; m0 < p->m; m0 += 6) {
        const int64_t rows = p->m - m0 < 6 ? p->m - m0 : 6;
        const int halves = rows == 1 ? 4 : rows < 4 ? 2 : 1;
        int64_t half = 2 * first;
        for (; halves > 1 && half + halves <= end; half += halves) {
            if (rows == 1) tile256(p, half, m0, 4, 1);
            else if (rows == 2) tile256(p, half, m0, 2, 2);
            else tile256(p, half, m0, 2, 3);
        }
        for (; half < end; half++) switch (rows) {
            case 1: tile256(p, half, m0, 1, 1); break;
            case 2: tile256(p, half, m0, 1, 2); break;
            case 3: tile256(p, half, m0, 1, 3); break;
            case 4: tile256(p, half, m0, 1, 4); break;
            case 5: tile256(p, half, m0, 1, 5); break;
            default: tile256(p, half, m0, 1, 6); break;
        }
    }
}
#endif

/* Whether this CPU can take the path. */
static int path_supported(int path) {
    if (path == PORTABLE) return 1;
#if defined(__x86_64__)
    if (path == AVX2_PATH) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (path == AVX512_PATH) return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

static void run_panels(const Problem *p, int path, int64_t first, int64_t last) {
#if defined(__x86_64__)
    if (path == AVX512_PATH) {
        panels_avx512(p, first, last);
        return;
    }
    if (path == AVX2_PATH) {
        panels_avx2(p, first, last);
        return;
    }
#endif
    (void)path;
    panels_scalar(p, first, last);
}

static PyObject *matmul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, scale, bias, out;
    long long m, n, k;
    int threads, path;
    if (!PyArg_ParseTuple(args, "KKKKKLLLii", &x, &w, &scale, &bias, &out, &m, &n, &k, &threads, &path))
        return NULL;
    if (m < 1 || n < 1 || k < 1) {
        PyErr_SetString(PyExc_ValueError, "int8 matmul: m, n and k must be positive");
        return NULL;
    }
    if (!path_supported(path)) {
        PyErr_Format(PyExc_ValueError, "int8 matmul: this CPU cannot take path %d; use the portable path (0)",
                     path);
        return NULL;
    }
    const Problem p = {(const float *)(uintptr_t)x, (const int8_t *)(uintptr_t)w, (const float *)(uintptr_t)scale,
                       (const float *)(uintptr_t)bias, (float *)(uintptr_t)out, m, n, k,
                       (n + PANEL - 1) / PANEL};
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > p.panels) threads = (int)p.panels;
    Py_BEGIN_ALLOW_THREADS;
    if (threads == 1) {
        run_panels(&p, path, 0, p.panels);
    } else {
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int i = 0; i < threads; i++) run_panels(&p, path, p.panels * i / threads, p.panels * (i + 1) / threads);
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *supports(PyObject *self, PyObject *args) {
    (void)self;
    int path;
    if (!PyArg_ParseTuple(args, "i", &path)) return NULL;
    return PyBool_FromLong(path_supported(path));
}

static PyMethodDef methods[] = {
    {"matmul", matmul, METH_VARARGS,
     "matmul(x, w, scale, bias, out, m, n, k, threads, path): out[m, n] = x[m, k] @ dequantized weight.T + "
     "bias, from raw pointers to float32 x, the packed int8 panels, padded scales and biases (0: none) and a "
     "float32 out (validated by tether.kernels.int8_gemm); path 0 portable, 1 AVX2, 2 AVX-512."},
    {"supports", supports, METH_VARARGS, "supports(path): whether this CPU can take the path."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8mm",
                                    "Weight-only int8 matmul for CPU float32.", -1, methods};

PyMODINIT_FUNC PyInit__int8mm(void) { return PyModule_Create(&module); }
