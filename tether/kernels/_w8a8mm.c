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
 * max |x| of the block / 127, round half to even), as `tether.kernels.w8a8_gemm.reference` does in torch,
 * on the path's vectors and by every thread, a share of the rows each (with the tiles below, SmolLM2's int8
 * matmuls of a 32-row decode step went from 24.6 to 14.2 ms on 2 AVX-512 cores: scalar quantization by
 * one thread had left the other idle).
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

/* Quantizes one block of 32: scale = max |x| / 127 (1 for an all-zero block), q = x / scale rounded half
 * to even, clamped to +-127. The vector versions below do the same IEEE operations (max is exact in any
 * order; a division and a rounding per value), so on finite inputs every path gives the same bytes,
 * scales and sums. */
static void quantize_block(const float *src, int8_t *xq, float *xs, int32_t *xsum) {
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(src[i]));
    float s = amax / 127.0f;
    if (!(s > 0.0f)) s = 1.0f;
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        float v = nearbyintf(src[i] / s);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        xq[i] = (int8_t)v;
        sum += (int32_t)v;
    }
    *xs = s;
    *xsum = sum;
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
#define AVX512 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))

/* `quantize_block` on AVX-512: the block in two registers. */
AVX512 static void quantize_block_avx512(const float *src, int8_t *xq, float *xs, int32_t *xsum) {
    const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
    float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(hi), _mm512_abs_ps(lo))) / 127.0f;
    if (!(s > 0.0f)) s = 1.0f;
    const __m512 scale = _mm512_set1_ps(s), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i qlo = _mm512_cvtps_epi32(
        _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(lo, scale), round), bottom), top));
    const __m512i qhi = _mm512_cvtps_epi32(
        _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(hi, scale), round), bottom), top));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(qhi));
    *xs = s;
    *xsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
}

/* `quantize_block` on AVX2: the block in four registers. */
AVX2 static void quantize_block_avx2(const float *src, int8_t *xq, float *xs, int32_t *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), amax);
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
    float s = _mm_cvtss_f32(half) / 127.0f;
    if (!(s > 0.0f)) s = 1.0f;
    const __m256 scale = _mm256_set1_ps(s), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
    int32_t values[BLOCK], sum = 0;
    for (int i = 0; i < 4; i++) {
        const __m256 v = _mm256_round_ps(_mm256_div_ps(x[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256((__m256i *)(values + 8 * i), _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, bottom), top)));
    }
    for (int i = 0; i < BLOCK; i++) {
        xq[i] = (int8_t)values[i];
        sum += values[i];
    }
    *xs = s;
    *xsum = sum;
}

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
    /* The rows in tiles of as equal sizes as ROWS allows (32 rows: 5 or 6 each, not five 6s and a 2):
       each tile reads the panel's weights once. */
    const int64_t tiles = (p->m + ROWS - 1) / ROWS;
    for (int64_t panel = first; panel < last; panel++) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = p->m * t / tiles, rows = p->m * (t + 1) / tiles - m0;
            switch (rows) {
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

/* Quantizes rows [first, last) of x [m, k] into the problem's xq, xs and xsum on the path's vectors. */
static void quantize_rows(const Problem *p, const float *x, int path, int64_t first, int64_t last) {
    void (*block)(const float *, int8_t *, float *, int32_t *) = quantize_block;
#if defined(__x86_64__)
    if (path == VNNI_PATH) block = quantize_block_avx512;
    else if (path == AVX2_PATH) block = quantize_block_avx2;
#endif
    (void)path;
    for (int64_t row = first; row < last; row++)
        for (int64_t b = 0; b < p->blocks; b++) {
            const int64_t at = row * p->blocks + b;
            block(x + row * p->k + b * BLOCK, (int8_t *)p->xq + at * BLOCK, (float *)p->xs + at,
                  (int32_t *)p->xsum + at);
        }
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
    const float *rows = (const float *)(uintptr_t)x;
    Py_BEGIN_ALLOW_THREADS;
    if (threads == 1) {
        quantize_rows(&p, rows, path, 0, m);
        run_panels(&p, path, 0, p.panels);
    } else {
        /* The rows are quantized by all threads, then (after the loop's barrier) the panels split. */
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int i = 0; i < threads; i++) quantize_rows(&p, rows, path, m * i / threads, m * (i + 1) / threads);
#pragma omp for schedule(static)
            for (int i = 0; i < threads; i++) run_panels(&p, path, p.panels * i / threads, p.panels * (i + 1) / threads);
        }
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
