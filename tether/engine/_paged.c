/*
 * Decode attention read straight from the paged KV cache, for CPU float32.
 *
 * The torch path gathers every decoding sequence's blocks into a padded copy per layer before
 * attending; over a rollout that copy moves more bytes than the weights do. This kernel walks each
 * sequence's block table instead, so K and V are read once and never copied. One work item is one
 * (sequence, KV head) pair: the query heads sharing that KV head (grouped-query attention) are scored
 * together, so each cached row is loaded once per group. Softmax is exact (max-subtracted, float32
 * accumulation), two passes over the scores.
 *
 * The caller (tether/engine/paged.py) validates shapes, dtypes and contiguity; this file checks only
 * what could make it read out of bounds (block ids, lengths) and reports it as ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 64
#define MAX_GROUP 64
#define MAX_HEAD_DIM 512

typedef struct {
    const float *q;         /* [batch, heads, head_dim] */
    const float *k;         /* [num_blocks, block_size, kv_heads, head_dim] */
    const float *v;         /* same layout as k */
    const int64_t *tables;  /* [batch, width] */
    const int64_t *lengths; /* [batch] */
    float *out;             /* [batch, heads, head_dim] */
    int64_t batch, heads, kv_heads, head_dim, block_size, width, num_blocks;
    float scale;
} Problem;

typedef struct {
    const Problem *p;
    int64_t first, last; /* work items [first, last) of batch * kv_heads */
    float *scores;       /* group * longest floats */
    int bad;             /* a block id or length out of range */
} Slice;

__attribute__((target_clones("arch=haswell", "default"))) static void attend(Slice *slice) {
    const Problem *p = slice->p;
    const int64_t group = p->heads / p->kv_heads, d = p->head_dim;
    const int64_t row_stride = p->kv_heads * d;
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    for (int64_t item = slice->first; item < slice->last; item++) {
        const int64_t b = item / p->kv_heads, h = item % p->kv_heads;
        const int64_t len = p->lengths[b];
        if (len < 1 || len > p->width * p->block_size) {
            slice->bad = 1;
            return;
        }
        const int64_t *table = p->tables + b * p->width;
        const float *queries = p->q + (b * p->heads + h * group) * d;
        float *scores = slice->scores;
        for (int64_t t = 0; t < len; t++) {
            const int64_t block = table[t / p->block_size];
            if (block < 0 || block >= p->num_blocks) {
                slice->bad = 1;
                return;
            }
            const float *key = p->k + (block * p->block_size + t % p->block_size) * row_stride + h * d;
            for (int64_t g = 0; g < group; g++) {
                const float *query = queries + g * d;
                float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int64_t i = 0;
                for (; i + 8 <= d; i += 8)
                    for (int j = 0; j < 8; j++) lanes[j] += query[i + j] * key[i + j];
                float dot = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                            ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
                for (; i < d; i++) dot += query[i] * key[i];
                scores[g * len + t] = dot * p->scale;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * len;
            float top = row[0];
            for (int64_t t = 1; t < len; t++) top = row[t] > top ? row[t] : top;
            float total = 0;
            for (int64_t t = 0; t < len; t++) {
                row[t] = expf(row[t] - top);
                total += row[t];
            }
            const float inverse = 1.0f / total;
            for (int64_t t = 0; t < len; t++) row[t] *= inverse;
            for (int64_t i = 0; i < d; i++) acc[g][i] = 0;
        }
        for (int64_t t = 0; t < len; t++) {
            const int64_t block = table[t / p->block_size];
            const float *value = p->v + (block * p->block_size + t % p->block_size) * row_stride + h * d;
            for (int64_t g = 0; g < group; g++) {
                const float weight = scores[g * len + t];
                for (int64_t i = 0; i < d; i++) acc[g][i] += weight * value[i];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *out = p->out + (b * p->heads + h * group + g) * d;
            for (int64_t i = 0; i < d; i++) out[i] = acc[g][i];
        }
    }
}

static void *run_slice(void *arg) {
    attend((Slice *)arg);
    return NULL;
}

static PyObject *decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, tables, lengths, out;
    Problem p;
    long long batch, heads, kv_heads, head_dim, block_size, width, num_blocks, longest;
    int threads;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLLLLfi", &q, &k, &v, &tables, &lengths, &out, &batch, &heads,
                          &kv_heads, &head_dim, &block_size, &width, &num_blocks, &longest, &scale,
                          &threads))
        return NULL;
    if (batch < 1 || kv_heads < 1 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP ||
        head_dim < 1 || head_dim > MAX_HEAD_DIM || block_size < 1 || width < 1 || num_blocks < 1 ||
        longest < 1 || longest > width * block_size) {
        PyErr_SetString(PyExc_ValueError, "decode_attention: shapes out of range");
        return NULL;
    }
    p = (Problem){(const float *)(uintptr_t)q, (const float *)(uintptr_t)k, (const float *)(uintptr_t)v,
                  (const int64_t *)(uintptr_t)tables, (const int64_t *)(uintptr_t)lengths,
                  (float *)(uintptr_t)out, batch, heads, kv_heads, head_dim, block_size, width,
                  num_blocks, scale};
    const int64_t items = batch * kv_heads, group = heads / kv_heads;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > items) threads = (int)items;
    Slice slices[MAX_THREADS];
    pthread_t workers[MAX_THREADS];
    float *scores = malloc(sizeof(float) * (size_t)(threads * group * longest));
    if (scores == NULL) return PyErr_NoMemory();
    for (int i = 0; i < threads; i++)
        slices[i] = (Slice){&p, items * i / threads, items * (i + 1) / threads,
                            scores + (int64_t)i * group * longest, 0};
    int started = 1;
    Py_BEGIN_ALLOW_THREADS;
    for (; started < threads; started++)
        if (pthread_create(&workers[started], NULL, run_slice, &slices[started]) != 0) break;
    attend(&slices[0]);
    for (int i = started; i < threads; i++) attend(&slices[i]); /* threads that failed to start */
    for (int i = 1; i < started; i++) pthread_join(workers[i], NULL);
    Py_END_ALLOW_THREADS;
    free(scores);
    for (int i = 0; i < threads; i++)
        if (slices[i].bad) {
            PyErr_SetString(PyExc_ValueError, "decode_attention: a block id or length is out of range");
            return NULL;
        }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_attention", decode_attention, METH_VARARGS,
     "decode_attention(q, k, v, tables, lengths, out, batch, heads, kv_heads, head_dim, block_size, "
     "width, num_blocks, longest, scale, threads): attention of one query token per sequence over its "
     "paged K/V (raw float32/int64 pointers, validated by tether.engine.paged)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged",
                                    "Paged decode attention for CPU float32.", -1, methods};

PyMODINIT_FUNC PyInit__paged(void) { return PyModule_Create(&module); }
