/* Bulk decoding of protobuf varints for the store's Submit path (rollbook.store.prepare).
 *
 * packed(request, spec) walks a serialized SubmitRequest and decodes the packed arrays of every
 * trajectory straight into one flat buffer per array, with each trajectory's offsets into it:
 * `spec` names the Trajectory fields to take and how, as (field number, kind) pairs, kind 0 a
 * varint kept as int32 (its low 32 bits, as protobuf does), 1 a varint kept as int64, 2 a float32.
 * It returns (number of trajectories, [(values bytes, int64 offsets bytes), ...] in spec order),
 * or None for anything it does not take exactly (the caller then reads the request the slower
 * ways, which either agree or word the error): a field sent unpacked, a record cut inside a value,
 * a float32 array of a length not a multiple of 4, a varint longer than ten bytes or with bits
 * above 64, a group, a malformed tag or length. Each packed record decodes on its own, as protobuf
 * decodes it; a field sent in several records is their concatenation. The GIL is released while
 * it runs.
 *
 * decode(src, dst) reads the base-128 varints packed back to back in the bytes-like `src` into the
 * writable buffer `dst` (int64, native order) and returns how many it wrote. It returns -1, writing
 * nothing the caller may use, for anything it does not take exactly: a varint cut off at the end,
 * one longer than ten bytes or with bits above 64, or more values than `dst` holds; the caller then
 * decodes through upb, which either agrees or words the error. The GIL is released while it runs.
 *
 * Optional: when it is not built, rollbook.store.prepare decodes through upb alone (same results,
 * slower). Build: `pip install -e .` compiles it with the platform's C compiler.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static Py_ssize_t decode_all(const uint8_t *p, const uint8_t *end, int64_t *out, Py_ssize_t capacity) {
    Py_ssize_t n = 0;
    while (p < end) {
        if (n == capacity) return -1;
        uint64_t value = 0;
        int shift = 0;
        for (;;) {
            if (p == end) return -1;          /* cut off */
            uint8_t byte = *p++;
            if (shift == 63 && byte > 1) return -1;  /* bits above 64, or an 11th byte */
            value |= (uint64_t)(byte & 0x7F) << shift;
            if (byte < 0x80) break;
            shift += 7;
        }
        out[n++] = (int64_t)value;
    }
    return n;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    Py_ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    n = decode_all((const uint8_t *)src.buf, (const uint8_t *)src.buf + src.len, (int64_t *)dst.buf,
                   dst.len / (Py_ssize_t)sizeof(int64_t));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromSsize_t(n);
}

/* ---- packed(request, spec) ------------------------------------------------------------------ */

#define MAX_FIELDS 8
#define TRAJECTORIES 1 /* SubmitRequest.trajectories */

typedef struct {
    int number, kind;          /* kind: 0 int32 varint, 1 int64 varint, 2 float32 */
    Py_ssize_t count;          /* values over the whole request (pass 1) */
    char *values;              /* pass 2: the output buffer, filled up to `at` */
    int64_t *offsets;          /* pass 2: rows + 1 */
    Py_ssize_t at;
} Field;

/* A varint at *p (before end); -1 if cut off, longer than ten bytes or with bits above 64. */
static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *value) {
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
        if (*p == end) return -1;
        uint8_t byte = *(*p)++;
        if (shift == 63 && byte > 1) return -1;
        v |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) break;
        shift += 7;
    }
    *value = v;
    return 0;
}

/* Skip one field's value of wire type `wt` at *p; -1 on a group, an unknown type or a cut. */
static int skip_value(const uint8_t **p, const uint8_t *end, int wt) {
    uint64_t n;
    switch (wt) {
    case 0: return read_varint(p, end, &n);
    case 1: if (end - *p < 8) return -1; *p += 8; return 0;
    case 5: if (end - *p < 4) return -1; *p += 4; return 0;
    case 2:
        if (read_varint(p, end, &n) < 0 || n > (uint64_t)(end - *p)) return -1;
        *p += n;
        return 0;
    default: return -1;
    }
}

/* Count (fill == 0) or decode (fill == 1) one packed record of field f. */
static int take_record(Field *f, const uint8_t *p, const uint8_t *end, int fill) {
    if (f->kind == 2) {
        Py_ssize_t n = end - p;
        if (n % 4) return -1;
        if (fill) memcpy(f->values + f->at * 4, p, (size_t)n);
        f->at += n / 4;
        return 0;
    }
    if (!fill) {
        if (p < end && end[-1] >= 0x80) return -1; /* the record ends inside a value */
        Py_ssize_t k = 0;
        for (const uint8_t *q = p; q < end; q++) k += *q < 0x80;
        f->at += k;
        return 0;
    }
    while (p < end) {
        uint64_t v;
        if (read_varint(&p, end, &v) < 0) return -1;
        if (f->kind == 0) ((int32_t *)f->values)[f->at++] = (int32_t)(uint32_t)v;
        else ((int64_t *)f->values)[f->at++] = (int64_t)v;
    }
    return 0;
}

/* One pass over the request: count the values (fill == 0), or decode them and set each row's
 * offsets (fill == 1). Returns the number of trajectories, or -1 for anything not taken exactly. */
static Py_ssize_t walk(const uint8_t *p, const uint8_t *end, Field *fields, int nfields, int fill) {
    Py_ssize_t rows = 0;
    for (int i = 0; i < nfields; i++) fields[i].at = 0;
    while (p < end) {
        uint64_t tag, len;
        if (read_varint(&p, end, &tag) < 0 || tag >> 3 == 0 || tag >> 3 > 0x1FFFFFFF) return -1;
        if ((tag >> 3) != TRAJECTORIES) {
            if (skip_value(&p, end, (int)(tag & 7)) < 0) return -1;
            continue;
        }
        if ((tag & 7) != 2 || read_varint(&p, end, &len) < 0 || len > (uint64_t)(end - p)) return -1;
        const uint8_t *q = p, *stop = p + len;
        p = stop;
        if (fill)
            for (int i = 0; i < nfields; i++) fields[i].offsets[rows] = fields[i].at;
        while (q < stop) {
            uint64_t t;
            if (read_varint(&q, stop, &t) < 0 || t >> 3 == 0 || t >> 3 > 0x1FFFFFFF) return -1;
            int wt = (int)(t & 7), which = -1;
            for (int i = 0; i < nfields; i++)
                if ((uint64_t)fields[i].number == t >> 3) which = i;
            if (which < 0) {
                if (skip_value(&q, stop, wt) < 0) return -1;
                continue;
            }
            uint64_t n;
            if (wt != 2 || read_varint(&q, stop, &n) < 0 || n > (uint64_t)(stop - q)) return -1; /* unpacked, or cut */
            if (take_record(&fields[which], q, q + n, fill) < 0) return -1;
            q += n;
        }
        rows++;
    }
    if (fill)
        for (int i = 0; i < nfields; i++) fields[i].offsets[rows] = fields[i].at;
    return rows;
}

static PyObject *packed(PyObject *self, PyObject *args) {
    Py_buffer src;
    PyObject *spec;
    if (!PyArg_ParseTuple(args, "y*O", &src, &spec)) return NULL;
    Field fields[MAX_FIELDS];
    PyObject *out[MAX_FIELDS][2] = {{NULL}};
    PyObject *result = NULL, *columns = NULL;
    const uint8_t *p = (const uint8_t *)src.buf, *end = p + src.len;
    Py_ssize_t rows, again, nfields = PySequence_Length(spec);
    if (nfields < 0 || nfields > MAX_FIELDS) {
        if (nfields >= 0) PyErr_SetString(PyExc_ValueError, "packed: at most 8 fields");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nfields; i++) {
        PyObject *item = PySequence_GetItem(spec, i);
        int ok = item && PyArg_ParseTuple(item, "ii", &fields[i].number, &fields[i].kind);
        Py_XDECREF(item);
        if (!ok) goto done;
        if (fields[i].kind < 0 || fields[i].kind > 2) {
            PyErr_SetString(PyExc_ValueError, "packed: kind must be 0 (int32), 1 (int64) or 2 (float32)");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rows = walk(p, end, fields, (int)nfields, 0);
    Py_END_ALLOW_THREADS
    if (rows < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nfields; i++) {
        Py_ssize_t size = fields[i].at * (fields[i].kind == 1 ? 8 : 4);
        out[i][0] = PyBytes_FromStringAndSize(NULL, size);
        out[i][1] = PyBytes_FromStringAndSize(NULL, (rows + 1) * (Py_ssize_t)sizeof(int64_t));
        if (!out[i][0] || !out[i][1]) goto done;
        fields[i].count = fields[i].at;
        fields[i].values = PyBytes_AS_STRING(out[i][0]);
        fields[i].offsets = (int64_t *)PyBytes_AS_STRING(out[i][1]);
    }
    Py_BEGIN_ALLOW_THREADS
    again = walk(p, end, fields, (int)nfields, 1);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nfields && again == rows; i++)
        if (fields[i].at != fields[i].count) again = -1;
    if (again != rows) { /* the count pass and the decoding pass disagree: not taken */
        result = Py_NewRef(Py_None);
        goto done;
    }
    columns = PyList_New(nfields);
    if (!columns) goto done;
    for (Py_ssize_t i = 0; i < nfields; i++) {
        PyList_SET_ITEM(columns, i, Py_BuildValue("(OO)", out[i][0], out[i][1]));
        if (!PyList_GET_ITEM(columns, i)) {
            Py_DECREF(columns);
            goto done;
        }
    }
    result = Py_BuildValue("(nN)", rows, columns);
done:
    for (int i = 0; i < MAX_FIELDS; i++) {
        Py_XDECREF(out[i][0]);
        Py_XDECREF(out[i][1]);
    }
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"packed", packed, METH_VARARGS,
     "packed(request, spec) -> (rows, [(values, offsets), ...]) or None: a SubmitRequest's packed arrays, decoded."},
    {"decode", decode, METH_VARARGS,
     "decode(src, dst) -> count: the varints packed in src into the int64 buffer dst; -1 if not exact."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_varint", "Bulk protobuf varint decoding.", -1, methods};

PyMODINIT_FUNC PyInit__varint(void) { return PyModule_Create(&module); }
