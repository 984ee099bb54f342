/*
 * Decode attention read straight from the paged KV cache, for CPU float32.
 *
 * The torch path gathers every decoding sequence's blocks into a padded copy per layer before
 * attending; over a rollout that copy moves more bytes than the weights do. This kernel walks each
 * sequence's block table instead, so K and V are read once and never copied. One work item is one
 * (sequence, KV head) pair: the query heads sharing that KV head (grouped-query attention) are scored
 * together, so each cached row is loaded once per group. A query attends to its rows starts[b] ..
 * lengths[b] - 1 (a sliding window starts past 0; the blocks before it are never read, and may have
 * been freed). Softmax is exact (max-subtracted, float32
 * accumulation), two passes over the scores. Paths: AVX2 (head_dim a multiple of 8) and portable C; an
 * AVX-512 variant measured no faster (decode attention is bound by reading the cache). The cache holds
 * float32 or IEEE float16 (`half`: half the bytes to read, converted to float32 on load, by F16C on the
 * AVX2 path; the queries, scores and accumulation stay float32). The caller picks
 * the path (`attention_kernel`, from the CPU's features), so the portable one runs and is tested on any
 * CPU; asking for AVX2 where the CPU lacks it or head_dim does not fit is a ValueError. The work items
 * are split over threads of torch's own OpenMP runtime (built with -fopenmp, the process's libgomp.so.1
 * is torch's): a second pool of threads competed with torch's spinning workers for the cores, which
 * made a 2-thread decode step of one sequence 60% slower than on 1 thread.
 *
 * The caller (tether/engine/attention.py) validates shapes, dtypes and contiguity; this file checks only
 * what could make it read out of bounds (block ids, lengths) and reports it as ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 64
#define MAX_HEAD_DIM 512

typedef struct {
    const float *q;         /* [batch, heads, head_dim] */
    const void *k;          /* [num_blocks, block_size, kv_heads, head_dim], float32 or float16 (half) */
    const void *v;          /* same layout and type as k */
    const int64_t *tables;  /* [batch, width] */
    const int64_t *lengths; /* [batch] */
    const int64_t *starts;  /* [batch]: first cached row each query sees (a sliding window), 0 for all */
    float *out;             /* [batch, heads, head_dim] */
    int64_t batch, heads, kv_heads, head_dim, block_size, width, num_blocks;
    float scale;
    int vector; /* take the AVX2 path (checked by decode_attention) */
    int half;   /* k and v hold IEEE float16 */
} Problem;

typedef struct {
    const Problem *p;
    int64_t first, last; /* work items [first, last) of batch * kv_heads */
    float *scores;       /* group * longest floats */
    int bad;             /* a block id or length out of range */
} Slice;

/* Every block the rows start..len-1 of the sequence touch exists (blocks before the start are never read:
   they may be freed); marks the slice bad otherwise. */
static int valid(const Problem *p, int64_t b, Slice *slice) {
    const int64_t len = p->lengths[b], start = p->starts[b];
    if (len < 1 || len > p->width * p->block_size || start < 0 || start >= len) {
        slice->bad = 1;
        return 0;
    }
    const int64_t *table = p->tables + b * p->width;
    for (int64_t i = start / p->block_size; i < (len + p->block_size - 1) / p->block_size; i++)
        if (table[i] < 0 || table[i] >= p->num_blocks) {
            slice->bad = 1;
            return 0;
        }
    return 1;
}

/* Index of the first element of row t of KV head h in a sequence's cache (k or v), through its block table. */
static inline int64_t cached_row(const Problem *p, const int64_t *table, int64_t t, int64_t h) {
    return (table[t / p->block_size] * p->block_size + t % p->block_size) * p->kv_heads * p->head_dim +
           h * p->head_dim;
}

/* IEEE float16 bits to float32, exactly (every half is a float), for the portable path. */
static inline float half_to_float(uint16_t bits) {
    const uint32_t sign = (uint32_t)(bits & 0x8000) << 16, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
    union {
        uint32_t u;
        float f;
    } out;
    if (exponent == 0x1f) {
        out.u = sign | 0x7f800000u | (mantissa << 13); /* infinity, NaN */
    } else if (exponent != 0) {
        out.u = sign | ((exponent + 112) << 23) | (mantissa << 13); /* normal: rebias 15 -> 127 */
    } else {
        out.f = (float)mantissa * 5.9604644775390625e-8f; /* zero, subnormal: mantissa * 2^-24 */
        out.u |= sign;
    }
    return out.f;
}

/* Element i of a cache, as float32. */
static inline float cached(const Problem *p, const void *cache, int64_t i) {
    return p->half ? half_to_float(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

static inline float largest(const float *row, int64_t len) {
    float top = row[0];
    for (int64_t t = 1; t < len; t++) top = row[t] > top ? row[t] : top;
    return top;
}

/* Portable path: any head_dim, any x86-64 or other CPU. */
static void attend_scalar(Slice *slice) {
    const Problem *p = slice->p;
    const int64_t group = p->heads / p->kv_heads, d = p->head_dim;
    float acc[MAX_HEAD_DIM];
    for (int64_t item = slice->first; item < slice->last; item++) {
        const int64_t b = item / p->kv_heads, h = item % p->kv_heads;
        if (!valid(p, b, slice)) return;
        /* Scores are indexed from the window's first row, so a query sees the same rows in the same
           order whether its table starts at position 0 or at its window. */
        const int64_t first = p->starts[b], len = p->lengths[b] - first;
        const int64_t *table = p->tables + b * p->width;
        const float *queries = p->q + (b * p->heads + h * group) * d;
        float *scores = slice->scores;
        for (int64_t t = 0; t < len; t++) {
            const int64_t key = cached_row(p, table, first + t, h);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0;
                for (int64_t i = 0; i < d; i++) dot += queries[g * d + i] * cached(p, p->k, key + i);
                scores[g * len + t] = dot * p->scale;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * len, top = largest(row, len), total = 0;
            for (int64_t t = 0; t < len; t++) total += row[t] = expf(row[t] - top);
            for (int64_t i = 0; i < d; i++) acc[i] = 0;
            for (int64_t t = 0; t < len; t++) {
                const int64_t value = cached_row(p, table, first + t, h);
                for (int64_t i = 0; i < d; i++) acc[i] += row[t] * cached(p, p->v, value + i);
            }
            float *out = p->out + (b * p->heads + h * group + g) * d;
            for (int64_t i = 0; i < d; i++) out[i] = acc[i] / total;
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
/* F16C too, for the float16 cache's loads: the float32 copy of the path holds none of its instructions, and
   the float16 copy runs only where the CPU has it (`avx2_fits`). */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline))

/* exp for x <= 0 (scores minus their maximum), Cephes' polynomial: within 2 ulp of expf. */
AVX2 static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

/* Eight cache elements from element i on, as float32. `half` is a constant in each caller's copy (see
   `attend_avx2`), so the branch is compiled away. */
AVX2_INLINE static inline __m256 load8(const void *cache, int64_t i, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)));
    return _mm256_loadu_ps((const float *)cache + i);
}

/* Four dot products at once, reduced together: [q.k0, q.k1, q.k2, q.k3] (k0..k3: element indices). */
AVX2_INLINE static inline __m128 dot4(const float *q, const void *k, const int64_t *rows, int64_t d, int half) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 query = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(query, load8(k, rows[0] + i, half), a0);
        a1 = _mm256_fmadd_ps(query, load8(k, rows[1] + i, half), a1);
        a2 = _mm256_fmadd_ps(query, load8(k, rows[2] + i, half), a2);
        a3 = _mm256_fmadd_ps(query, load8(k, rows[3] + i, half), a3);
    }
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

/* head_dim a multiple of 8: keys scored four at a time, exp and the weighted sum of V vectorised. Inlined
   into one copy per cache type (`attend_avx2_float`, `attend_avx2_half`). */
AVX2_INLINE static inline void attend_avx2(Slice *slice, int half) {
    const Problem *p = slice->p;
    const int64_t group = p->heads / p->kv_heads, d = p->head_dim;
    int64_t rows[4];
    for (int64_t item = slice->first; item < slice->last; item++) {
        const int64_t b = item / p->kv_heads, h = item % p->kv_heads;
        if (!valid(p, b, slice)) return;
        /* Scores are indexed from the window's first row, so a query sees the same rows in the same
           order whether its table starts at position 0 or at its window. */
        const int64_t first = p->starts[b], len = p->lengths[b] - first;
        const int64_t *table = p->tables + b * p->width;
        const float *queries = p->q + (b * p->heads + h * group) * d;
        float *scores = slice->scores;
        for (int64_t t = 0; t < len; t += 4) {
            for (int j = 0; j < 4; j++) {
                const int64_t u = t + j < len ? t + j : len - 1; /* past the end: repeat the last */
                rows[j] = cached_row(p, table, first + u, h);
            }
            for (int64_t g = 0; g < group; g++) {
                float four[4];
                _mm_storeu_ps(four, _mm_mul_ps(dot4(queries + g * d, p->k, rows, d, half), _mm_set1_ps(p->scale)));
                for (int j = 0; j < 4 && t + j < len; j++) scores[g * len + t + j] = four[j];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * len;
            const float top = largest(row, len);
            const __m256 peak = _mm256_set1_ps(top);
            __m256 sums = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= len; t += 8) {
                const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + t), peak));
                _mm256_storeu_ps(row + t, e);
                sums = _mm256_add_ps(sums, e);
            }
            float lanes[8], total = 0;
            _mm256_storeu_ps(lanes, sums);
            for (int j = 0; j < 8; j++) total += lanes[j];
            for (; t < len; t++) total += row[t] = expf(row[t] - top);
            const __m256 inverse = _mm256_set1_ps(1.0f / total);
            float *out = p->out + (b * p->heads + h * group + g) * d;
            for (int64_t c = 0; c < d; c += 64) { /* eight accumulators stay in registers */
                const int64_t width = d - c < 64 ? d - c : 64;
                __m256 acc[8];
                for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
                for (int64_t u = 0; u < len; u++) {
                    const int64_t value = cached_row(p, table, first + u, h) + c;
                    const __m256 weight = _mm256_set1_ps(row[u]);
                    for (int k = 0; k < width / 8; k++)
                        acc[k] = _mm256_fmadd_ps(weight, load8(p->v, value + 8 * k, half), acc[k]);
                }
                for (int k = 0; k < width / 8; k++) _mm256_storeu_ps(out + c + 8 * k, _mm256_mul_ps(acc[k], inverse));
            }
        }
    }
}

AVX2 static void attend_avx2_float(Slice *slice) { attend_avx2(slice, 0); }
AVX2 static void attend_avx2_half(Slice *slice) { attend_avx2(slice, 1); }
#endif

/* Whether the AVX2 path can serve a problem of this head_dim (and cache type: float16 needs F16C) here. */
static int avx2_fits(int64_t head_dim, int half) {
#if defined(__x86_64__)
    return head_dim % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           (!half || __builtin_cpu_supports("f16c"));
#else
    (void)head_dim;
    (void)half;
    return 0;
#endif
}

static void attend(Slice *slice) {
#if defined(__x86_64__)
    if (slice->p->vector) {
        if (slice->p->half)
            attend_avx2_half(slice);
        else
            attend_avx2_float(slice);
        return;
    }
#endif
    attend_scalar(slice);
}

static PyObject *decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, tables, lengths, starts, out;
    Problem p;
    long long batch, heads, kv_heads, head_dim, block_size, width, num_blocks, longest;
    int threads, vector, half = 0;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLLLLfip|p", &q, &k, &v, &tables, &lengths, &starts, &out, &batch,
                          &heads, &kv_heads, &head_dim, &block_size, &width, &num_blocks, &longest, &scale,
                          &threads, &vector, &half))
        return NULL;
    if (batch < 1 || kv_heads < 1 || heads % kv_heads != 0 || head_dim < 1 || head_dim > MAX_HEAD_DIM || block_size < 1 || width < 1 || num_blocks < 1 ||
        longest < 1 || longest > width * block_size) {
        PyErr_SetString(PyExc_ValueError, "decode_attention: shapes out of range");
        return NULL;
    }
    if (vector && !avx2_fits(head_dim, half)) {
        PyErr_Format(PyExc_ValueError,
                     "decode_attention: the AVX2 path needs a CPU with AVX2 and FMA (and F16C for a float16 "
                     "cache) and a head_dim that is a multiple of 8 (head_dim %lld); use the portable path",
                     head_dim);
        return NULL;
    }
    p = (Problem){(const float *)(uintptr_t)q, (const void *)(uintptr_t)k, (const void *)(uintptr_t)v,
                  (const int64_t *)(uintptr_t)tables, (const int64_t *)(uintptr_t)lengths,
                  (const int64_t *)(uintptr_t)starts, (float *)(uintptr_t)out, batch, heads, kv_heads,
                  head_dim, block_size, width,
                  num_blocks, scale, vector, half};
    const int64_t items = batch * kv_heads, group = heads / kv_heads;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > items) threads = (int)items;
    Slice slices[MAX_THREADS];
    float *scores = malloc(sizeof(float) * (size_t)(threads * group * longest));
    if (scores == NULL) return PyErr_NoMemory();
    for (int i = 0; i < threads; i++)
        slices[i] = (Slice){&p, items * i / threads, items * (i + 1) / threads,
                            scores + (int64_t)i * group * longest, 0};
    Py_BEGIN_ALLOW_THREADS;
    if (threads == 1) {
        attend(&slices[0]);
    } else {
        /* torch's own OpenMP runtime (the same libgomp.so.1, already loaded) runs the slices: its workers,
           spinning after the last matmul, take them at once, and no second pool competes for the cores. */
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int i = 0; i < threads; i++) attend(&slices[i]);
    }
    Py_END_ALLOW_THREADS;
    free(scores);
    for (int i = 0; i < threads; i++)
        if (slices[i].bad) {
            PyErr_SetString(PyExc_ValueError, "decode_attention: a block id or length is out of range");
            return NULL;
        }
    Py_RETURN_NONE;
}

static PyObject *avx2_fits_py(PyObject *self, PyObject *args) {
    (void)self;
    long long head_dim;
    int half = 0;
    if (!PyArg_ParseTuple(args, "L|p", &head_dim, &half)) return NULL;
    return PyBool_FromLong(avx2_fits(head_dim, half));
}

static PyMethodDef methods[] = {
    {"decode_attention", decode_attention, METH_VARARGS,
     "decode_attention(q, k, v, tables, lengths, starts, out, batch, heads, kv_heads, head_dim, block_size, "
     "width, num_blocks, longest, scale, threads, vector, half=False): attention of one query token per "
     "sequence over its paged K/V rows starts[b]..lengths[b]-1 (raw float32/int64 pointers, validated by "
     "tether.kernels.attention; half: K/V are float16); vector takes the AVX2 path, else the portable one."},
    {"avx2_fits", avx2_fits_py, METH_VARARGS,
     "avx2_fits(head_dim, half=False): whether this CPU can take the AVX2 path for heads of head_dim (over "
     "a float16 cache with half)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged",
                                    "Paged decode attention for CPU float32 queries over a float32 or float16 cache.", -1, methods};

PyMODINIT_FUNC PyInit__paged(void) { return PyModule_Create(&module); }
