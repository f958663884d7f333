/*
 * sparkgpu._native: batch gathers from memory-mapped MDS shards.
 *
 * Three copies numpy cannot do in one pass:
 *   gather_rows   fixed-size rows from several shards, in the batch's order, into one
 *                 preallocated (possibly pinned) buffer;
 *   gather_spans  variable-size byte spans from several shards into one buffer, at
 *                 offsets the caller chose (so values stay aligned for their dtype);
 *   gather_fields chosen byte ranges of fixed-size rows (the feature columns, the target)
 *                 straight into their own dense buffers, e.g. a (batch, n_features) matrix.
 *
 * Every index is checked against its source before the GIL is released, so a bad index
 * raises IndexError instead of reading out of bounds. Large batches are split across
 * POSIX threads; small ones are copied on the calling thread, where starting threads
 * would cost more than the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* Below this many bytes a batch is copied by one thread. */
#define PARALLEL_MIN_BYTES (1 << 20)
#define MAX_THREADS 64

typedef struct {
    char *dst;
    const char **src;        /* base pointer of each source */
    const int32_t *source_ids; /* NULL: every row comes from source 0 */
    const int64_t *starts;   /* row index (rows mode) or byte offset (spans mode) */
    const int64_t *lengths;  /* NULL in rows mode */
    const int64_t *dst_offsets; /* NULL in rows mode */
    Py_ssize_t row_bytes;
    Py_ssize_t begin, end;   /* half-open range of items this worker copies */
    /* Fields mode (fields != NULL): per field f, fields[5f .. 5f+4] = source offset in the row,
     * length, destination index, offset in the destination row, destination row bytes. */
    const int64_t *fields;
    Py_ssize_t nfields;
    char **dsts;
} CopyJob;

/* Rows asked of the memory system ahead of the one being copied. Rows drawn at random miss
 * the caches; without asking ahead the copy waits on each miss in turn (3.3x slower in a
 * micro-benchmark: batches of 4096 random rows of 136 bytes, 33 fields, from four 64k-row groups). */
#define PREFETCH_ROWS 16

/* Fields set up at once by copy_fields (on the stack); more are copied in further passes. */
#define FIELDS_AT_ONCE 64

static void copy_fields(const CopyJob *job) {
    /* Row by row: each source row's cache lines are fetched once and every field is copied out
     * of them, while the rows PREFETCH_ROWS ahead are on their way. (Field by field, each row
     * was fetched once per field, each first fetch a wait.) */
    const char **src = job->src;
    const int32_t *sid = job->source_ids;
    const int64_t *st = job->starts;
    const Py_ssize_t rb = job->row_bytes;
    char *out[FIELDS_AT_ONCE];
    int64_t from[FIELDS_AT_ONCE], len[FIELDS_AT_ONCE], step[FIELDS_AT_ONCE];
    for (Py_ssize_t f0 = 0; f0 < job->nfields; f0 += FIELDS_AT_ONCE) {
        Py_ssize_t nf = job->nfields - f0 < FIELDS_AT_ONCE ? job->nfields - f0 : FIELDS_AT_ONCE;
        for (Py_ssize_t f = 0; f < nf; f++) {
            /* source offset in the row, length, destination, offset in its row, its row bytes */
            const int64_t *e = job->fields + 5 * (f0 + f);
            from[f] = e[0];
            len[f] = e[1];
            step[f] = e[4];
            out[f] = job->dsts[e[2]] + e[3];
        }
        for (Py_ssize_t i = job->begin; i < job->end; i++) {
            if (i + PREFETCH_ROWS < job->end) {
                Py_ssize_t j = i + PREFETCH_ROWS;
                const char *next = (sid ? src[sid[j]] : src[0]) + st[j] * rb;
                for (Py_ssize_t b = 0; b < rb; b += 64) __builtin_prefetch(next + b);
            }
            const char *row = (sid ? src[sid[i]] : src[0]) + st[i] * rb;
            for (Py_ssize_t f = 0; f < nf; f++) {
                char *to = out[f] + i * step[f];
                if (len[f] == 4)
                    memcpy(to, row + from[f], 4);
                else if (len[f] == 8)
                    memcpy(to, row + from[f], 8);
                else
                    memcpy(to, row + from[f], (size_t)len[f]);
            }
        }
    }
}

static void copy_range(const CopyJob *job) {
    if (job->fields) {
        copy_fields(job);
        return;
    }
    /* Four specialised loops keep the per-item work to one memcpy (no branches per row). */
    char *dst = job->dst;
    const char **src = job->src;
    const int32_t *sid = job->source_ids;
    const int64_t *st = job->starts;
    if (job->lengths) {
        const int64_t *ln = job->lengths, *of = job->dst_offsets;
        if (sid) {
            for (Py_ssize_t i = job->begin; i < job->end; i++)
                memcpy(dst + of[i], src[sid[i]] + st[i], (size_t)ln[i]);
        } else {
            const char *base = src[0];
            for (Py_ssize_t i = job->begin; i < job->end; i++)
                memcpy(dst + of[i], base + st[i], (size_t)ln[i]);
        }
        return;
    }
    const Py_ssize_t rb = job->row_bytes;
    char *out = dst + job->begin * rb;
    if (sid) {
        for (Py_ssize_t i = job->begin; i < job->end; i++, out += rb)
            memcpy(out, src[sid[i]] + st[i] * rb, (size_t)rb);
    } else {
        const char *base = src[0];
        for (Py_ssize_t i = job->begin; i < job->end; i++, out += rb)
            memcpy(out, base + st[i] * rb, (size_t)rb);
    }
}

static void *copy_range_thread(void *arg) {
    copy_range((const CopyJob *)arg);
    return NULL;
}

/* Copies items [0, n) with up to `threads` threads. A thread that fails to start has its share
 * copied on the calling thread, so the result is complete either way. */
static void run_copy(CopyJob base, Py_ssize_t n, Py_ssize_t total_bytes, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || total_bytes < PARALLEL_MIN_BYTES || n < threads) {
        base.begin = 0;
        base.end = n;
        copy_range(&base);
        return;
    }
    CopyJob jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].begin = n * t / threads;
        jobs[t].end = n * (t + 1) / threads;
        started[t] = 0;
    }
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&tids[t], NULL, copy_range_thread, &jobs[t]) == 0;
        if (!started[t]) copy_range(&jobs[t]);
    }
    copy_range(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
    }
}

typedef struct {
    Py_buffer *views;
    const char **ptrs;
    Py_ssize_t *lens;
    Py_ssize_t count;
} Sources;

static void release_sources(Sources *s) {
    for (Py_ssize_t i = 0; i < s->count; i++) PyBuffer_Release(&s->views[i]);
    PyMem_Free(s->views);
    PyMem_Free(s->ptrs);
    PyMem_Free(s->lens);
    s->views = NULL;
    s->count = 0;
}

static int acquire_sources(PyObject *seq, Sources *s) {
    memset(s, 0, sizeof(*s));
    PyObject *fast = PySequence_Fast(seq, "sources must be a sequence of buffers");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n == 0) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "sources is empty");
        return -1;
    }
    s->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    s->ptrs = PyMem_Calloc((size_t)n, sizeof(char *));
    s->lens = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    if (!s->views || !s->ptrs || !s->lens) {
        Py_DECREF(fast);
        release_sources(s);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &s->views[i], PyBUF_SIMPLE) < 0) {
            Py_DECREF(fast);
            release_sources(s);
            return -1;
        }
        s->count = i + 1;
        s->ptrs[i] = (const char *)s->views[i].buf;
        s->lens[i] = s->views[i].len;
    }
    Py_DECREF(fast);
    return 0;
}

/* Gets a contiguous buffer of n items of `itemsize` bytes; n < 0 means "infer n". */
static int get_index_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t *n,
                            const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % itemsize != 0 || (*n >= 0 && view->len != *n * itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd-byte integers, one per item", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    *n = view->len / itemsize;
    return 0;
}

/* Every item's source id and row lie inside its source; else an IndexError naming the item. */
static int check_rows(const int64_t *r, const int32_t *sid, Py_ssize_t n, Py_ssize_t row_bytes, const Sources *src) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = sid ? sid[i] : 0;
        if (s < 0 || s >= src->count) {
            PyErr_Format(PyExc_IndexError, "source id %d of item %zd is out of range", s, i);
            return -1;
        }
        if (r[i] < 0 || (r[i] + 1) * row_bytes > src->lens[s]) {
            PyErr_Format(PyExc_IndexError, "row %lld of item %zd is outside its source", (long long)r[i], i);
            return -1;
        }
    }
    return 0;
}

static PyObject *gather_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "sources", "source_ids", "rows", "row_bytes", "threads", NULL};
    PyObject *dst_obj, *sources_obj, *ids_obj, *rows_obj;
    Py_ssize_t row_bytes;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOn|i", kwlist, &dst_obj, &sources_obj,
                                     &ids_obj, &rows_obj, &row_bytes, &threads))
        return NULL;
    if (row_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "row_bytes must be positive");
        return NULL;
    }
    Py_buffer dst = {0}, rows = {0}, ids = {0};
    Sources src;
    int have_ids = ids_obj != Py_None;
    Py_ssize_t n = -1;
    PyObject *result = NULL;
    if (get_index_buffer(rows_obj, &rows, 8, &n, "rows") < 0) return NULL;
    if (have_ids && get_index_buffer(ids_obj, &ids, 4, &n, "source_ids") < 0) goto done_rows;
    if (acquire_sources(sources_obj, &src) < 0) goto done_ids;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done_src;
    if (dst.len < n * row_bytes) {
        PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, the batch needs %zd", dst.len, n * row_bytes);
        goto done_all;
    }
    const int64_t *r = (const int64_t *)rows.buf;
    const int32_t *sid = have_ids ? (const int32_t *)ids.buf : NULL;
    if (check_rows(r, sid, n, row_bytes, &src) < 0) goto done_all;
    CopyJob job = {(char *)dst.buf, src.ptrs, sid, r, NULL, NULL, row_bytes, 0, 0, NULL, 0, NULL};
    Py_BEGIN_ALLOW_THREADS
    run_copy(job, n, n * row_bytes, threads);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done_all:
    PyBuffer_Release(&dst);
done_src:
    release_sources(&src);
done_ids:
    if (have_ids) PyBuffer_Release(&ids);
done_rows:
    PyBuffer_Release(&rows);
    return result;
}

static PyObject *gather_spans(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "dst_offsets", "sources", "source_ids", "starts", "lengths",
                             "threads", NULL};
    PyObject *dst_obj, *offs_obj, *sources_obj, *ids_obj, *starts_obj, *lens_obj;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO|i", kwlist, &dst_obj, &offs_obj,
                                     &sources_obj, &ids_obj, &starts_obj, &lens_obj, &threads))
        return NULL;
    Py_buffer dst = {0}, offs = {0}, starts = {0}, lens = {0}, ids = {0};
    Sources src;
    int have_ids = ids_obj != Py_None;
    Py_ssize_t n = -1;
    PyObject *result = NULL;
    if (get_index_buffer(starts_obj, &starts, 8, &n, "starts") < 0) return NULL;
    if (get_index_buffer(lens_obj, &lens, 8, &n, "lengths") < 0) goto done_starts;
    if (get_index_buffer(offs_obj, &offs, 8, &n, "dst_offsets") < 0) goto done_lens;
    if (have_ids && get_index_buffer(ids_obj, &ids, 4, &n, "source_ids") < 0) goto done_offs;
    if (acquire_sources(sources_obj, &src) < 0) goto done_ids;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done_src;
    const int64_t *st = (const int64_t *)starts.buf;
    const int64_t *ln = (const int64_t *)lens.buf;
    const int64_t *of = (const int64_t *)offs.buf;
    const int32_t *sid = have_ids ? (const int32_t *)ids.buf : NULL;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = sid ? sid[i] : 0;
        if (s < 0 || s >= src.count) {
            PyErr_Format(PyExc_IndexError, "source id %d of span %zd is out of range", s, i);
            goto done_all;
        }
        if (st[i] < 0 || ln[i] < 0 || st[i] + ln[i] > src.lens[s]) {
            PyErr_Format(PyExc_IndexError, "span %zd [%lld, +%lld) is outside its source", i,
                         (long long)st[i], (long long)ln[i]);
            goto done_all;
        }
        if (of[i] < 0 || of[i] + ln[i] > dst.len) {
            PyErr_Format(PyExc_IndexError, "span %zd does not fit in dst at offset %lld", i,
                         (long long)of[i]);
            goto done_all;
        }
        total += ln[i];
    }
    CopyJob job = {(char *)dst.buf, src.ptrs, sid, st, ln, of, 0, 0, 0, NULL, 0, NULL};
    Py_BEGIN_ALLOW_THREADS
    run_copy(job, n, total, threads);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done_all:
    PyBuffer_Release(&dst);
done_src:
    release_sources(&src);
done_ids:
    if (have_ids) PyBuffer_Release(&ids);
done_offs:
    PyBuffer_Release(&offs);
done_lens:
    PyBuffer_Release(&lens);
done_starts:
    PyBuffer_Release(&starts);
    return result;
}

static PyObject *gather_fields(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dsts", "sources", "source_ids", "rows", "row_bytes", "fields", "threads", NULL};
    PyObject *dsts_obj, *sources_obj, *ids_obj, *rows_obj, *fields_obj;
    Py_ssize_t row_bytes;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOnO|i", kwlist, &dsts_obj, &sources_obj, &ids_obj,
                                     &rows_obj, &row_bytes, &fields_obj, &threads))
        return NULL;
    if (row_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "row_bytes must be positive");
        return NULL;
    }
    Py_buffer rows = {0}, ids = {0}, fields = {0};
    Sources src, dst;
    int have_ids = ids_obj != Py_None;
    Py_ssize_t n = -1, nvalues = -1;
    PyObject *result = NULL;
    char **dst_ptrs = NULL;
    if (get_index_buffer(rows_obj, &rows, 8, &n, "rows") < 0) return NULL;
    if (have_ids && get_index_buffer(ids_obj, &ids, 4, &n, "source_ids") < 0) goto done_rows;
    if (get_index_buffer(fields_obj, &fields, 8, &nvalues, "fields") < 0) goto done_ids;
    if (nvalues % 5 != 0) {
        PyErr_SetString(PyExc_ValueError, "fields must hold 5 integers per field");
        goto done_fields;
    }
    if (acquire_sources(sources_obj, &src) < 0) goto done_fields;
    if (acquire_sources(dsts_obj, &dst) < 0) goto done_src;
    dst_ptrs = PyMem_Calloc((size_t)dst.count, sizeof(char *));
    if (!dst_ptrs) {
        PyErr_NoMemory();
        goto done_all;
    }
    for (Py_ssize_t d = 0; d < dst.count; d++) {
        if (dst.views[d].readonly) {
            PyErr_Format(PyExc_ValueError, "destination %zd is read-only", d);
            goto done_all;
        }
        dst_ptrs[d] = (char *)dst.views[d].buf;
    }
    const int64_t *fl = (const int64_t *)fields.buf;
    Py_ssize_t nfields = nvalues / 5, field_bytes = 0;
    for (Py_ssize_t f = 0; f < nfields; f++) {
        const int64_t *e = fl + 5 * f;
        if (e[0] < 0 || e[1] <= 0 || e[0] + e[1] > row_bytes || e[2] < 0 || e[2] >= dst.count || e[3] < 0 ||
            e[4] <= 0 || e[3] + e[1] > e[4] || n * e[4] > dst.lens[e[2]]) {
            PyErr_Format(PyExc_IndexError, "field %zd does not fit its row or its destination", f);
            goto done_all;
        }
        field_bytes += e[1];
    }
    const int64_t *r = (const int64_t *)rows.buf;
    const int32_t *sid = have_ids ? (const int32_t *)ids.buf : NULL;
    if (check_rows(r, sid, n, row_bytes, &src) < 0) goto done_all;
    CopyJob job = {NULL, src.ptrs, sid, r, NULL, NULL, row_bytes, 0, 0, fl, nfields, dst_ptrs};
    Py_BEGIN_ALLOW_THREADS
    run_copy(job, n, n * field_bytes, threads);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done_all:
    PyMem_Free(dst_ptrs);
    release_sources(&dst);
done_src:
    release_sources(&src);
done_fields:
    PyBuffer_Release(&fields);
done_ids:
    if (have_ids) PyBuffer_Release(&ids);
done_rows:
    PyBuffer_Release(&rows);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_rows", (PyCFunction)(void (*)(void))gather_rows, METH_VARARGS | METH_KEYWORDS,
     "gather_rows(dst, sources, source_ids, rows, row_bytes, threads=1)\n\n"
     "Copies row rows[i] of sources[source_ids[i]] (rows of row_bytes bytes) to row i of dst.\n"
     "source_ids may be None when every row comes from sources[0]."},
    {"gather_spans", (PyCFunction)(void (*)(void))gather_spans, METH_VARARGS | METH_KEYWORDS,
     "gather_spans(dst, dst_offsets, sources, source_ids, starts, lengths, threads=1)\n\n"
     "Copies bytes [starts[i], starts[i] + lengths[i]) of sources[source_ids[i]] to dst at\n"
     "dst_offsets[i]."},
    {"gather_fields", (PyCFunction)(void (*)(void))gather_fields, METH_VARARGS | METH_KEYWORDS,
     "gather_fields(dsts, sources, source_ids, rows, row_bytes, fields, threads=1)\n\n"
     "For each field (src_offset, length, dst_index, dst_offset, dst_row_bytes) of the int64\n"
     "array fields, copies bytes [src_offset, src_offset + length) of row rows[i] of\n"
     "sources[source_ids[i]] to dsts[dst_index] at i * dst_row_bytes + dst_offset."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sparkgpu._native",
    "Multi-source batch gathers from memory-mapped shards (GIL released, threaded).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
