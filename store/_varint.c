/* Bulk decoding of Submit requests and protobuf varints for the store (rollbook.store.prepare).
 *
 * packed(request, spec) walks a serialized SubmitRequest and decodes the named fields of every
 * trajectory straight into one flat buffer per field, without a Python object per row: `spec`
 * names the Trajectory fields to take and how, as (field number, kind) pairs. The packed kinds
 * give (values bytes, int64 offsets bytes: rows + 1, then each row's least value, greatest value
 * and a flag byte): 0 varints kept as int32 (their low 32 bits, as protobuf does), 1 varints kept
 * as int64 (least and greatest as int64, INT64_MAX and INT64_MIN for an empty row; the flag: a
 * value below the one before it), 2 float32 (least and greatest finite value as double, inf and
 * -inf for a row without one; the flag: a NaN or an infinity). The singular kinds give one value a row:
 * 3 a string or bytes field as (the rows' bytes back to back, int32 offsets: rows + 1, Arrow's
 * layout; an absent field is empty), and (values, one presence byte a row) for 4 a varint kept as
 * int64, 5 a double, 6 a float (an absent field reads 0 and is marked absent); and 7, for a
 * repeated message field such as a map, (each row's number of records as int64, unused). It
 * returns (number of trajectories, [buffers, ...] in spec order: five bytes objects for a packed
 * kind, two for the others), or None for anything it does not take
 * exactly (the caller then reads the request the slower ways, which either agree or word the
 * error): a field sent with another wire type than its kind (a packed array sent unpacked), a
 * singular field sent twice in a row (protobuf keeps the last), a record cut inside a value, a
 * float32 array of a length not a multiple of 4, a varint longer than ten bytes or with bits
 * above 64, a group, a malformed tag or length, strings past int32 offsets, a big-endian host.
 * Fields the spec does not name are skipped. Each packed record decodes on its own, as protobuf
 * decodes it; a field sent in several records is their concatenation. UTF-8 is not checked here
 * (the caller's parse of the same bytes does). The GIL is released while it runs.
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
#include <math.h>
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

#define MAX_FIELDS 32
#define MAX_NUMBER 64 /* field numbers the spec may name: 1..63 */
#define TRAJECTORIES 1 /* SubmitRequest.trajectories */

enum {
    K_INT32 = 0,   /* packed varints kept as int32 (their low 32 bits, as protobuf does) */
    K_INT64 = 1,   /* packed varints kept as int64 */
    K_FLOAT32 = 2, /* packed little-endian float32 */
    K_STRING = 3,  /* a singular length-delimited field: bytes, with int32 offsets (Arrow's layout) */
    K_VARINT = 4,  /* a singular varint, kept as int64, with presence */
    K_FIXED64 = 5, /* a singular double, with presence */
    K_FIXED32 = 6, /* a singular float, with presence */
    K_COUNT = 7,   /* a repeated message field (a map): how many records each row sends */
};

typedef struct {
    int number, kind;
    Py_ssize_t count;          /* pass 1: values (packed kinds) or bytes (strings) over the request */
    char *values;              /* pass 2: the output buffer */
    int64_t *offsets;          /* pass 2, packed kinds: rows + 1 */
    int32_t *str_offsets;      /* pass 2, strings: rows + 1 */
    uint8_t *present;          /* pass 2, singular scalars: one flag a row */
    Py_ssize_t at;
    /* pass 2, packed kinds, each row's statistics: the least and greatest value (int64 for the
     * varint kinds, double for float32, over its finite values; an empty row keeps the start
     * values) and a flag: a value below the one before it (varints), a NaN or infinity (float32) */
    char *mins, *maxs;
    uint8_t *flags;
    int64_t last;
    int has_last;
} Field;

/* a row's statistics before its first value */
static void start_row(Field *f, Py_ssize_t row) {
    if (f->kind == K_FLOAT32) {
        ((double *)f->mins)[row] = INFINITY;
        ((double *)f->maxs)[row] = -INFINITY;
    } else {
        ((int64_t *)f->mins)[row] = INT64_MAX;
        ((int64_t *)f->maxs)[row] = INT64_MIN;
    }
    f->flags[row] = 0;
    f->has_last = 0;
}

static int is_packed(int kind) { return kind <= K_FLOAT32; }

static int wire_type(int kind) {
    switch (kind) {
    case K_VARINT: return 0;
    case K_FIXED64: return 1;
    case K_FIXED32: return 5;
    default: return 2;
    }
}

static int value_size(int kind) {
    switch (kind) {
    case K_INT64: case K_VARINT: case K_FIXED64: case K_COUNT: return 8;
    case K_STRING: return 1;
    default: return 4;
    }
}

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

/* Count (fill == 0) or decode (fill == 1) one packed record of field f into row `row`. */
static int take_record(Field *f, const uint8_t *p, const uint8_t *end, Py_ssize_t row, int fill) {
    if (f->kind == K_FLOAT32) {
        Py_ssize_t n = end - p;
        if (n % 4) return -1;
        if (fill) {
            float *out = (float *)(f->values + f->at * 4);
            double lo = ((double *)f->mins)[row], hi = ((double *)f->maxs)[row];
            uint8_t flag = f->flags[row];
            memcpy(out, p, (size_t)n);
            for (Py_ssize_t i = 0; i < n / 4; i++) {
                double x = out[i];
                if (!isfinite(x)) flag = 1;
                else {
                    if (x < lo) lo = x;
                    if (x > hi) hi = x;
                }
            }
            ((double *)f->mins)[row] = lo;
            ((double *)f->maxs)[row] = hi;
            f->flags[row] = flag;
        }
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
    int64_t lo = ((int64_t *)f->mins)[row], hi = ((int64_t *)f->maxs)[row], last = f->last;
    int has_last = f->has_last;
    uint8_t flag = f->flags[row];
    while (p < end) {
        uint64_t v;
        if (read_varint(&p, end, &v) < 0) return -1;
        int64_t x;
        if (f->kind == K_INT32) ((int32_t *)f->values)[f->at++] = (int32_t)(x = (int32_t)(uint32_t)v);
        else ((int64_t *)f->values)[f->at++] = x = (int64_t)v;
        if (x < lo) lo = x;
        if (x > hi) hi = x;
        if (has_last && x < last) flag = 1;
        last = x;
        has_last = 1;
    }
    ((int64_t *)f->mins)[row] = lo;
    ((int64_t *)f->maxs)[row] = hi;
    f->flags[row] = flag;
    f->last = last;
    f->has_last = has_last;
    return 0;
}

/* Count (fill == 0) or store (fill == 1) row `row`'s value of the singular field f at *p. */
static int take_single(Field *f, const uint8_t **p, const uint8_t *end, Py_ssize_t row, int fill) {
    uint64_t v;
    switch (f->kind) {
    case K_STRING:
        if (read_varint(p, end, &v) < 0 || v > (uint64_t)(end - *p)) return -1;
        if (fill) memcpy(f->values + f->at, *p, (size_t)v);
        f->at += (Py_ssize_t)v;
        *p += v;
        return f->at > INT32_MAX ? -1 : 0; /* past int32 offsets: declined */
    case K_VARINT:
        if (read_varint(p, end, &v) < 0) return -1;
        if (fill) ((int64_t *)f->values)[row] = (int64_t)v;
        break;
    case K_FIXED64:
        if (end - *p < 8) return -1;
        if (fill) memcpy(f->values + row * 8, *p, 8);
        *p += 8;
        break;
    default: /* K_FIXED32 */
        if (end - *p < 4) return -1;
        if (fill) memcpy(f->values + row * 4, *p, 4);
        *p += 4;
    }
    if (fill) f->present[row] = 1;
    return 0;
}

/* One pass over the request: count the values (fill == 0), or decode them and set each row's
 * offsets and presence flags (fill == 1). Returns the number of trajectories, or -1 for anything
 * not taken exactly. `index[n]` is the spec position of field number n, or -1. */
static Py_ssize_t walk(const uint8_t *p, const uint8_t *end, Field *fields, int nfields, const int8_t *index, int fill) {
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
        uint32_t seen = 0;
        if (fill)
            for (int i = 0; i < nfields; i++) {
                if (is_packed(fields[i].kind)) {
                    fields[i].offsets[rows] = fields[i].at;
                    start_row(&fields[i], rows);
                } else if (fields[i].kind == K_STRING) fields[i].str_offsets[rows] = (int32_t)fields[i].at;
            }
        while (q < stop) {
            uint64_t t;
            if (read_varint(&q, stop, &t) < 0 || t >> 3 == 0 || t >> 3 > 0x1FFFFFFF) return -1;
            int wt = (int)(t & 7), which = (t >> 3) < MAX_NUMBER ? index[t >> 3] : -1;
            if (which < 0) {
                if (skip_value(&q, stop, wt) < 0) return -1;
                continue;
            }
            Field *f = &fields[which];
            if (wt != wire_type(f->kind)) return -1; /* unpacked, or the wrong wire type */
            if (f->kind == K_COUNT) {
                if (skip_value(&q, stop, wt) < 0) return -1;
                if (fill) ((int64_t *)f->values)[rows]++;
                continue;
            }
            if (!is_packed(f->kind)) {
                /* a singular field sent twice: protobuf keeps the last, the slower readings do that */
                if (seen & (1u << which)) return -1;
                seen |= 1u << which;
                if (take_single(f, &q, stop, rows, fill) < 0) return -1;
                continue;
            }
            uint64_t n;
            if (read_varint(&q, stop, &n) < 0 || n > (uint64_t)(stop - q)) return -1; /* cut */
            if (take_record(f, q, q + n, rows, fill) < 0) return -1;
            q += n;
        }
        rows++;
    }
    if (fill)
        for (int i = 0; i < nfields; i++) {
            if (is_packed(fields[i].kind)) fields[i].offsets[rows] = fields[i].at;
            else if (fields[i].kind == K_STRING) fields[i].str_offsets[rows] = (int32_t)fields[i].at;
        }
    return rows;
}

static PyObject *packed(PyObject *self, PyObject *args) {
    Py_buffer src;
    PyObject *spec;
    if (!PyArg_ParseTuple(args, "y*O", &src, &spec)) return NULL;
    Field fields[MAX_FIELDS];
    int8_t index[MAX_NUMBER];
    PyObject *out[MAX_FIELDS][5] = {{NULL}};
    PyObject *result = NULL, *columns = NULL;
    const uint8_t *p = (const uint8_t *)src.buf, *end = p + src.len;
    Py_ssize_t rows, again, nfields = PySequence_Length(spec);
    memset(index, -1, sizeof index);
    if (nfields < 0 || nfields > MAX_FIELDS) {
        if (nfields >= 0) PyErr_SetString(PyExc_ValueError, "packed: at most 32 fields");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nfields; i++) {
        PyObject *item = PySequence_GetItem(spec, i);
        int ok = item && PyArg_ParseTuple(item, "ii", &fields[i].number, &fields[i].kind);
        Py_XDECREF(item);
        if (!ok) goto done;
        if (fields[i].kind < K_INT32 || fields[i].kind > K_COUNT) {
            PyErr_SetString(PyExc_ValueError, "packed: kind must be 0 to 7");
            goto done;
        }
        if (fields[i].number < 1 || fields[i].number >= MAX_NUMBER || index[fields[i].number] >= 0) {
            PyErr_SetString(PyExc_ValueError, "packed: field numbers must be distinct, 1 to 63");
            goto done;
        }
        index[fields[i].number] = (int8_t)i;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    result = Py_NewRef(Py_None); /* fixed-width values are copied as they are: little-endian hosts only */
    goto done;
#endif
    Py_BEGIN_ALLOW_THREADS
    rows = walk(p, end, fields, (int)nfields, index, 0);
    Py_END_ALLOW_THREADS
    if (rows < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nfields; i++) {
        Field *f = &fields[i];
        int packed_kind = is_packed(f->kind);
        Py_ssize_t size = (packed_kind || f->kind == K_STRING ? f->at : rows) * value_size(f->kind);
        Py_ssize_t second = packed_kind ? (rows + 1) * (Py_ssize_t)sizeof(int64_t)
                            : f->kind == K_STRING ? (rows + 1) * (Py_ssize_t)sizeof(int32_t)
                                                  : rows;
        out[i][0] = PyBytes_FromStringAndSize(NULL, size);
        out[i][1] = PyBytes_FromStringAndSize(NULL, second);
        if (!out[i][0] || !out[i][1]) goto done;
        if (packed_kind) { /* each row's least and greatest value and its flag */
            out[i][2] = PyBytes_FromStringAndSize(NULL, rows * 8);
            out[i][3] = PyBytes_FromStringAndSize(NULL, rows * 8);
            out[i][4] = PyBytes_FromStringAndSize(NULL, rows);
            if (!out[i][2] || !out[i][3] || !out[i][4]) goto done;
            f->mins = PyBytes_AS_STRING(out[i][2]);
            f->maxs = PyBytes_AS_STRING(out[i][3]);
            f->flags = (uint8_t *)PyBytes_AS_STRING(out[i][4]);
        }
        f->count = f->at;
        f->values = PyBytes_AS_STRING(out[i][0]);
        f->offsets = packed_kind ? (int64_t *)PyBytes_AS_STRING(out[i][1]) : NULL;
        f->str_offsets = f->kind == K_STRING ? (int32_t *)PyBytes_AS_STRING(out[i][1]) : NULL;
        f->present = packed_kind || f->kind == K_STRING ? NULL : (uint8_t *)PyBytes_AS_STRING(out[i][1]);
        if (f->present) { /* a row that does not send the field: its default, absent */
            memset(f->values, 0, (size_t)size);
            memset(f->present, 0, (size_t)rows);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    again = walk(p, end, fields, (int)nfields, index, 1);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nfields && again == rows; i++)
        if ((is_packed(fields[i].kind) || fields[i].kind == K_STRING) && fields[i].at != fields[i].count) again = -1;
    if (again != rows) { /* the count pass and the decoding pass disagree: not taken */
        result = Py_NewRef(Py_None);
        goto done;
    }
    columns = PyList_New(nfields);
    if (!columns) goto done;
    for (Py_ssize_t i = 0; i < nfields; i++) {
        PyList_SET_ITEM(columns, i,
                        is_packed(fields[i].kind) ? Py_BuildValue("(OOOOO)", out[i][0], out[i][1], out[i][2], out[i][3], out[i][4])
                                                  : Py_BuildValue("(OO)", out[i][0], out[i][1]));
        if (!PyList_GET_ITEM(columns, i)) {
            Py_DECREF(columns);
            goto done;
        }
    }
    result = Py_BuildValue("(nN)", rows, columns);
done:
    for (int i = 0; i < MAX_FIELDS; i++)
        for (int j = 0; j < 5; j++) Py_XDECREF(out[i][j]);
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
