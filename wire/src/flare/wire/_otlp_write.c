/* The ranks' OTLP attribute writer in C: `attributes(mapping, tag)`, the bytes of
 * `flare.wire.otlp_values.py_attributes` (its reference, value for value:
 * tests/instrumentation/test_otlp_encoding.py), ~5x faster. Every span a rank exports
 * goes through it (flare.instrumentation.otlp_encoding), and the collector's correlator
 * writes its spans' attributes with it too. The collector's readers are apart, in
 * flare-processors (csrc/otlp_read): a rank builds and loads only this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ output buffer
 * Grown by doubling; freed, never pooled: in a rank nothing should stay allocated. */
typedef struct {
    char *buf;
    size_t len;
    size_t cap;
} Buf;

static int buf_reserve(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    char *grown = PyMem_Realloc(b->buf, cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    b->buf = grown;
    b->cap = cap;
    return 0;
}

/* A varint at p (room for 10 bytes); returns its length. */
static size_t put_varint(char *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (char)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (char)v;
    return n;
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static int buf_tag_varint(Buf *b, uint8_t tag, uint64_t v) {
    if (buf_reserve(b, 11)) return -1;
    b->buf[b->len++] = (char)tag;
    b->len += put_varint(b->buf + b->len, v);
    return 0;
}

/* A length-delimited field: tag, length, bytes. */
static int buf_tag_bytes(Buf *b, uint8_t tag, const void *p, size_t n) {
    if (buf_tag_varint(b, tag, n) || buf_reserve(b, n)) return -1;
    if (n) memcpy(b->buf + b->len, p, n);
    b->len += n;
    return 0;
}

/* ------------------------------------------------------------------ attributes
 * `attributes(mapping, tag)` returns the bytes `otlp_values.py_attributes` returns:
 * for every (key, value) item, in iteration order, `tag` + length + KeyValue{key = 1,
 * value = 2: AnyValue}. Value kinds, by exact type as the Python writer checks them:
 * float (double_value), bool (bool_value), int within int64 (int_value), str
 * (string_value), bytes (bytes_value), None (an empty AnyValue), list and tuple
 * (array_value of the same, nested). Anything else raises the exception class given
 * to `init()` (`otlp_values.Unsupported`: the caller then takes protobuf's
 * path); a str that is not valid UTF-8 raises UnicodeEncodeError, as `.encode()` does.
 * Writer buffers are freed, never pooled: in a rank nothing should stay allocated. */
static PyObject *unsupported = NULL; /* set by init() */

/* A length-delimited field whose payload was written at b[start:]: the payload moves
 * right to make room for tag + length, written in front of it. */
static int close_field(Buf *b, size_t start, uint8_t tag) {
    size_t length = b->len - start;
    size_t head = 1 + varint_size(length);
    if (buf_reserve(b, head)) return -1;
    memmove(b->buf + start + head, b->buf + start, length);
    b->buf[start] = (char)tag;
    put_varint(b->buf + start + 1, length);
    b->len += head;
    return 0;
}

static int write_str(Buf *b, uint8_t tag, PyObject *text) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
    if (!utf8) return -1; /* UnicodeEncodeError for lone surrogates, as str.encode() */
    return buf_tag_bytes(b, tag, utf8, (size_t)n);
}

/* The AnyValue message body of `value` (without its own tag and length). */
static int write_any_value(Buf *b, PyObject *value, int depth) {
    if (depth > 64) {
        PyErr_SetString(unsupported, "attribute value nested too deeply");
        return -1;
    }
    if (PyFloat_CheckExact(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        if (buf_reserve(b, 9)) return -1;
        b->buf[b->len++] = 0x21;
        for (int i = 0; i < 8; i++) b->buf[b->len++] = (char)(bits >> (8 * i)); /* fixed64, LE */
        return 0;
    }
    if (PyBool_Check(value)) return buf_tag_varint(b, 0x10, value == Py_True);
    if (PyLong_CheckExact(value)) {
        int overflow = 0;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow) {
            PyErr_SetString(unsupported, "int outside int64");
            return -1;
        }
        if (number == -1 && PyErr_Occurred()) return -1;
        return buf_tag_varint(b, 0x18, (uint64_t)number); /* two's complement, as int64 */
    }
    if (PyUnicode_CheckExact(value)) return write_str(b, 0x0a, value);
    if (value == Py_None) return 0;
    if (PyBytes_CheckExact(value))
        return buf_tag_bytes(b, 0x3a, PyBytes_AS_STRING(value), (size_t)PyBytes_GET_SIZE(value));
    if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
        PyObject *items = PySequence_Fast(value, "attribute sequence");
        if (!items) return -1;
        size_t array_start = b->len;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
            size_t item_start = b->len;
            if (write_any_value(b, PySequence_Fast_GET_ITEM(items, i), depth + 1) ||
                close_field(b, item_start, 0x0a)) {
                Py_DECREF(items);
                return -1;
            }
        }
        Py_DECREF(items);
        return close_field(b, array_start, 0x2a);
    }
    PyErr_Format(unsupported, "attribute value of type %s", Py_TYPE(value)->tp_name);
    return -1;
}

static int write_key_value(Buf *b, uint8_t tag, PyObject *key, PyObject *value) {
    if (!PyUnicode_CheckExact(key)) {
        PyErr_SetString(unsupported, "attribute key is not a str");
        return -1;
    }
    size_t start = b->len;
    if (PyUnicode_GET_LENGTH(key) > 0 && write_str(b, 0x0a, key)) return -1;
    size_t value_start = b->len;
    if (write_any_value(b, value, 0) || close_field(b, value_start, 0x12)) return -1;
    return close_field(b, start, tag);
}

static PyObject *attributes(PyObject *self, PyObject *args) {
    PyObject *mapping;
    int tag;
    if (!PyArg_ParseTuple(args, "Oi", &mapping, &tag)) return NULL;
    if (unsupported == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_otlp_write.init() was not called");
        return NULL;
    }
    if (tag < 0 || tag > 0x7F) {
        PyErr_SetString(PyExc_ValueError, "tag must be a one-byte field tag");
        return NULL;
    }
    Buf b = {0};
    int failed = 0;
    if (PyDict_CheckExact(mapping)) {
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (!failed && PyDict_Next(mapping, &position, &key, &value)) {
            Py_INCREF(key);
            Py_INCREF(value);
            failed = write_key_value(&b, (uint8_t)tag, key, value) < 0;
            Py_DECREF(key);
            Py_DECREF(value);
        }
    } else {
        PyObject *items = PyMapping_Items(mapping);
        failed = items == NULL;
        for (Py_ssize_t i = 0; !failed && i < PyList_GET_SIZE(items); i++) {
            PyObject *pair = PyList_GET_ITEM(items, i);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                PyErr_SetString(unsupported, "mapping items are not pairs");
                failed = 1;
            } else {
                failed = write_key_value(&b, (uint8_t)tag, PyTuple_GET_ITEM(pair, 0),
                                         PyTuple_GET_ITEM(pair, 1)) < 0;
            }
        }
        Py_XDECREF(items);
    }
    PyObject *result = failed ? NULL : PyBytes_FromStringAndSize(b.buf ? b.buf : "", (Py_ssize_t)b.len);
    PyMem_Free(b.buf);
    return result;
}

static PyObject *init(PyObject *self, PyObject *exception_class) {
    if (!PyType_Check(exception_class) ||
        !PyType_IsSubtype((PyTypeObject *)exception_class, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "init() takes an Exception subclass");
        return NULL;
    }
    Py_INCREF(exception_class);
    Py_XSETREF(unsupported, exception_class);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"attributes", attributes, METH_VARARGS,
     "attributes(mapping, tag) -> bytes: the repeated KeyValue fields of `mapping`."},
    {"init", init, METH_O, "init(exception_class): what unsupported attribute values raise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_otlp_write", .m_doc = "The OTLP attribute writer in C.",
    .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__otlp_write(void) { return PyModule_Create(&module); }
