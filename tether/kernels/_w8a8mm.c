/*
 * Dynamic int8 matmul for CPU float32 rows: int8 weights (one scale per output channel) times int8
 * activations quantized on the fly in blocks of 32 along k (one scale per row and block, as llama.cpp's
 * q8 activations for its quantized dot products):
 *
 *   out[m, n] = wscale[n] * sum_b xscale[m, b] * sum_{k in b} xq[m, k] * q[n, k] + bias[n]
 *
 * Each block's dot product is an exact int32 sum, so every path (AVX-512 VNNI, AVX2, portable C) gives
 * the same integers; the float steps after it (add each block's scaled sum in order, then multiply by
 * the channel's scale and add the bias; -ffp-contract=off keeps each a multiply then an add) are the
 * same operations in the same order on every path, so all paths give the same bits, and a row's result
 * does not depend on the rows sharing the call. The activations are quantized once per call (scale =
 * max |x| of the block / 127, round half to even), as `tether.kernels.w8a8_gemm.reference` does in torch.
 *
 * Packed weights (tether/kernels/w8a8_gemm.py): panels of 32 output channels, k in quads, stored as
 * unsigned bytes q + 128: byte [p][k / 4][c][k % 4] holds q[32p + c, k] + 128, zero weights padding the
 * last panel. VNNI's vpdpbusd multiplies unsigned by signed bytes: sum (q + 128) x = sum q x + 128 sum x,
 * so each block's sum starts at -128 * sum x (computed with the quantized row). AVX2 has no such
 * instruction: it recovers the signed q and multiplies |q| by x with q's sign (pmaddubsw cannot
 * saturate: |q|, |x| <= 127), then widens the pairs to int32. Panels are split over threads of torch's
 * OpenMP runtime, as in _int8mm.c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#define BLOCK 32
#define MAX_THREADS 64
#define ROWS 6

enum { PORTABLE = 0, AVX2_PATH = 1, VNNI_PATH = 2 };

typedef struct {
    const int8_t *xq;    /* [m, k] quantized rows */
    const float *xs;     /* [m, k / 32] block scales */
    const int32_t *xsum; /* [m, k / 32] sums of each block's quantized values */
    const uint8_t *w;    /* [panels, k / 4, 32, 4] q + 128 */
    const float *scale;  /* [panels * 32] */
    const float *bias;   /* [panels * 32] or NULL */
    float *out;          /* [m, n] */
    int64_t m, n, k, blocks, panels;
} Problem;

/* Quantizes every row of x in blocks of 32: scale = max |x| / 127 (1 for an all-zero block). */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *xs, int32_t *xsum) {
    const int64_t blocks = k / BLOCK;
    for (int64_t row = 0; row < m; row++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *src = x + row * k + b * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(src[i]));
            float s = amax / 127.0f;
            if (!(s > 0.0f)) s = 1.0f;
            int32_t sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                float v = nearbyintf(src[i] / s);
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                xq[row * k + b * BLOCK + i] = (int8_t)v;
                sum += (int32_t)v;
            }
            xs[row * blocks + b] = s;
            xsum[row * blocks + b] = sum;
        }
    }
}

/* Writes one row's outputs of panel p from a 32-float buffer: only the columns below n exist. */
static inline void store_row(const Problem *p, int64_t row, int64_t panel, const float *values) {
    const int64_t first = panel * PANEL, width = p->n - first < PANEL ? p->n - first : PANEL;
    memcpy(p->out + row * p->n + first, values, (size_t)width * sizeof(float));
}

/* Portable path: any CPU. */
static void panels_scalar(const Problem *p, int64_t first, int64_t last) {
    float acc[PANEL];
    int32_t dot[PANEL];
    for (int64_t panel = first; panel < last; panel++) {
        const uint8_t *w = p->w + panel * p->k * PANEL;
        for (int64_t row = 0; row < p->m; row++) {
            for (int c = 0; c < PANEL; c++) acc[c] = 0.0f;
            for (int64_t b = 0; b < p->blocks; b++) {
                const int8_t *x = p->xq + row * p->k + b * BLOCK;
                for (int c = 0; c < PANEL; c++) dot[c] = 0;
                for (int64_t kk = 0; kk < BLOCK; kk++) {
                    const int64_t k = b * BLOCK + kk;
                    const uint8_t *wq = w + (k / 4) * PANEL * 4 + k % 4;
                    for (int c = 0; c < PANEL; c++) dot[c] += ((int32_t)wq[c * 4] - 128) * (int32_t)x[kk];
                }
                const float s = p->xs[row * p->blocks + b];
                for (int c = 0; c < PANEL; c++) acc[c] = acc[c] + (float)dot[c] * s;
            }
            for (int c = 0; c < PANEL; c++) {
                const int64_t col = panel * PANEL + c;
                acc[c] = acc[c] * p->scale[col] + (p->bias ? p->bias[col] : 0.0f);
            }
            store_row(p, row, panel, acc);
        }
    }
}

static inline int32_t load_quad(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, sizeof quad);
    return quad;
}

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
#define VNNI __attribute__((target("avx512f,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))

/* AVX-512 VNNI: one panel (two 16-lane halves) x `rows` rows from row m0. */
VNNI INLINE void tile_vnni(const Problem *p, int64_t panel, int64_t m0, const int rows) {
    __m512 acc[ROWS][2];
    const uint8_t *w = p->w + panel * p->k * PANEL;
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p->blocks; b++) {
        __m512i dot[ROWS][2];
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++)
            dot[r][0] = dot[r][1] = _mm512_set1_epi32(-128 * p->xsum[(m0 + r) * p->blocks + b]);
#pragma GCC unroll 8
        for (int quad = 0; quad < BLOCK / 4; quad++) {
            const uint8_t *wq = w + (b * (BLOCK / 4) + quad) * PANEL * 4;
            const __m512i w0 = _mm512_loadu_si512((const void *)wq);
            const __m512i w1 = _mm512_loadu_si512((const void *)(wq + 64));
#pragma GCC unroll 6
            for (int r = 0; r < rows; r++) {
                const __m512i xb = _mm512_set1_epi32(load_quad(p->xq + (m0 + r) * p->k + b * BLOCK + quad * 4));
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xb);
                dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xb);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const __m512 s = _mm512_set1_ps(p->xs[(m0 + r) * p->blocks + b]);
            acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][0]), s));
            acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][1]), s));
        }
    }
    const int64_t col = panel * PANEL;
    const __m512 s0 = _mm512_loadu_ps(p->scale + col), s1 = _mm512_loadu_ps(p->scale + col + 16);
    const __m512 b0 = p->bias ? _mm512_loadu_ps(p->bias + col) : _mm512_setzero_ps();
    const __m512 b1 = p->bias ? _mm512_loadu_ps(p->bias + col + 16) : _mm512_setzero_ps();
    float values[PANEL];
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(values, _mm512_add_ps(_mm512_mul_ps(acc[r][0], s0), b0));
        _mm512_storeu_ps(values + 16, _mm512_add_ps(_mm512_mul_ps(acc[r][1], s1), b1));
        store_row(p, m0 + r, panel, values);
    }
}

VNNI static void panels_vnni(const Problem *p, int64_t first, int64_t last) {
    for (int64_t panel = first; panel < last; panel++) {
        for (int64_t m0 = 0; m0 < p->m; m0 += ROWS) {
            switch (p->m - m0 < ROWS ? p->m - m0 : ROWS) {
                case 1: tile_vnni(p, panel, m0, 1); break;
                case 2: tile_vnni(p, panel, m0, 2); break;
                case 3: tile_vnni(p, panel, m0, 3); break;
                case 4: tile_vnni(p, panel, m0, 4); break;
                case 5: tile_vnni(p, panel, m0, 5); break;
                default: tile_vnni(p, panel, m0, 6); break;
            }
        }
    }
}

/* AVX2: a quarter panel (8 outputs, one register) at a time, for up to two rows. */
AVX2 INLINE void tile_avx2(const Problem *p, int64_t panel, int64_t m0, const int rows) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const uint8_t *w = p->w + panel * p->k * PANEL;
    float values[2][PANEL];
    for (int part = 0; part < 4; part++) {
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < p->blocks; b++) {
            __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int quad = 0; quad < BLOCK / 4; quad++) {
                const uint8_t *wq = w + (b * (BLOCK / 4) + quad) * PANEL * 4 + part * 32;
                const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wq), flip);
                const __m256i magnitude = _mm256_abs_epi8(q);
                for (int r = 0; r < rows; r++) {
                    const __m256i xb =
                        _mm256_set1_epi32(load_quad(p->xq + (m0 + r) * p->k + b * BLOCK + quad * 4));
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xb, q));
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            for (int r = 0; r < rows; r++) {
                const __m256 s = _mm256_set1_ps(p->xs[(m0 + r) * p->blocks + b]);
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), s));
            }
        }
        const int64_t col = panel * PANEL + part * 8;
        const __m256 s = _mm256_loadu_ps(p->scale + col);
        const __m256 bias = p->bias ? _mm256_loadu_ps(p->bias + col) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(values[r] + part * 8, _mm256_add_ps(_mm256_mul_ps(acc[r], s), bias));
    }
    for (int r = 0; r < rows; r++) store_row(p, m0 + r, panel, values[r]);
}

AVX2 static void panels_avx2(const Problem *p, int64_t first, int64_t last) {
    for (int64_t panel = first; panel < last; panel++) {
        for (int64_t m0 = 0; m0 < p->m; m0 += 2) {
            if (p->m - m0 >= 2) tile_avx2(p, panel, m0, 2);
            else tile_avx2(p, panel, m0, 1);
        }
    }
}
#endif

/* Whether this CPU can take the path. */
static int path_supported(int path) {
    if (path == PORTABLE) return 1;
#if defined(__x86_64__)
    if (path == AVX2_PATH) return __builtin_cpu_supports("avx2");
    if (path == VNNI_PATH) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

static void run_panels(const Problem *p, int path, int64_t first, int64_t last) {
#if defined(__x86_64__)
    if (path == VNNI_PATH) {
        panels_vnni(p, first, last);
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
    if (m < 1 || n < 1 || k < 1 || k % BLOCK != 0) {
        PyErr_SetString(PyExc_ValueError, "w8a8 matmul: m, n and k must be positive and k a multiple of 32");
        return NULL;
    }
    if (!path_supported(path)) {
        PyErr_Format(PyExc_ValueError, "w8a8 matmul: this CPU cannot take path %d; use the portable path (0)",
                     path);
        return NULL;
    }
    const int64_t blocks = k / BLOCK;
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc((size_t)(m * blocks) * sizeof(float));
    int32_t *xsum = malloc((size_t)(m * blocks) * sizeof(int32_t));
    if (!xq || !xs || !xsum) {
        free(xq);
        free(xs);
        free(xsum);
        return PyErr_NoMemory();
    }
    const Problem p = {xq, xs, xsum, (const uint8_t *)(uintptr_t)w, (const float *)(uintptr_t)scale,
                       (const float *)(uintptr_t)bias, (float *)(uintptr_t)out, m, n, k, blocks,
                       (n + PANEL - 1) / PANEL};
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > p.panels) threads = (int)p.panels;
    Py_BEGIN_ALLOW_THREADS;
    quantize_rows((const float *)(uintptr_t)x, m, k, xq, xs, xsum);
    if (threads == 1) {
        run_panels(&p, path, 0, p.panels);
    } else {
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int i = 0; i < threads; i++) run_panels(&p, path, p.panels * i / threads, p.panels * (i + 1) / threads);
    }
    Py_END_ALLOW_THREADS;
    free(xq);
    free(xs);
    free(xsum);
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
     "matmul(x, w, scale, bias, out, m, n, k, threads, path): out[m, n] = int8-quantized x[m, k] @ the "
     "int8 weight.T, rescaled, + bias, from raw pointers to float32 x, the packed q + 128 panels, padded "
     "scales and biases (0: none) and a float32 out (validated by tether.kernels.w8a8_gemm); path 0 "
     "portable, 1 AVX2, 2 AVX-512 VNNI."},
    {"supports", supports, METH_VARARGS, "supports(path): whether this CPU can take the path."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_w8a8mm",
                                    "Dynamic int8 (weights and activations) matmul for CPU float32.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__w8a8mm(void) { return PyModule_Create(&module); }
