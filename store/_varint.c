/* Bulk decoding of protobuf varints for the store's Submit path (rollbook.store.prepare).
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

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(src, dst) -> count: the varints packed in src into the int64 buffer dst; -1 if not exact."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_varint", "Bulk protobuf varint decoding.", -1, methods};

PyMODINIT_FUNC PyInit__varint(void) { return PyModule_Create(&module); }
