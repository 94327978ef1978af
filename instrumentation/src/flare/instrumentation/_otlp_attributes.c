/* OTLP KeyValue fields of one span's attributes, written in C for Flare's span exporter.
 *
 * `attributes(mapping, tag)` returns the bytes `otlp_encoding._py_attributes` returns:
 * for every (key, value) item, in iteration order, `tag` + length + KeyValue{key = 1,
 * value = 2: AnyValue}. Value kinds, by exact type as the Python writer checks them:
 * float (double_value), bool (bool_value), int within int64 (int_value), str
 * (string_value), bytes (bytes_value), None (an empty AnyValue), list and tuple
 * (array_value of the same, nested). Anything else raises the exception class given
 * to `init()` (the Python writer's `Unsupported`: the span then goes through the SDK's
 * encoder); a str that is not valid UTF-8 raises UnicodeEncodeError, as `.encode()` does.
 *
 * The Python writer stays the reference: the tests compare both with the SDK encoder.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *unsupported = NULL; /* set by init() */

typedef struct {
    char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
} Buffer;

static int buffer_reserve(Buffer *buffer, Py_ssize_t extra) {
    if (buffer->size + extra <= buffer->capacity)
        return 0;
    Py_ssize_t capacity = buffer->capacity ? buffer->capacity : 256;
    while (capacity < buffer->size + extra)
        capacity *= 2;
    char *data = PyMem_Realloc(buffer->data, (size_t)capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buffer->data = data;
    buffer->capacity = capacity;
    return 0;
}

static int buffer_write(Buffer *buffer, const void *bytes, Py_ssize_t n) {
    if (buffer_reserve(buffer, n) < 0)
        return -1;
    memcpy(buffer->data + buffer->size, bytes, (size_t)n);
    buffer->size += n;
    return 0;
}

static int buffer_byte(Buffer *buffer, unsigned char byte) {
    return buffer_write(buffer, &byte, 1);
}

static int buffer_varint(Buffer *buffer, uint64_t value) {
    unsigned char out[10];
    int n = 0;
    while (value >= 0x80) {
        out[n++] = (unsigned char)((value & 0x7F) | 0x80);
        value >>= 7;
    }
    out[n++] = (unsigned char)value;
    return buffer_write(buffer, out, n);
}

static int varint_size(uint64_t value) {
    int n = 1;
    while (value >= 0x80) {
        value >>= 7;
        n++;
    }
    return n;
}

/* A length-delimited field whose payload was written at buffer[start:]: move the
 * payload right to make room for tag + length, then write them in front of it. */
static int close_field(Buffer *buffer, Py_ssize_t start, unsigned char tag) {
    Py_ssize_t length = buffer->size - start;
    int head = 1 + varint_size((uint64_t)length);
    if (buffer_reserve(buffer, head) < 0)
        return -1;
    memmove(buffer->data + start + head, buffer->data + start, (size_t)length);
    Py_ssize_t end = buffer->size + head;
    buffer->size = start;
    if (buffer_byte(buffer, tag) < 0 || buffer_varint(buffer, (uint64_t)length) < 0)
        return -1;
    buffer->size = end;
    return 0;
}

static int write_string(Buffer *buffer, unsigned char tag, PyObject *text) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
    if (utf8 == NULL)
        return -1; /* UnicodeEncodeError for lone surrogates, as str.encode() */
    if (buffer_byte(buffer, tag) < 0 || buffer_varint(buffer, (uint64_t)n) < 0)
        return -1;
    return buffer_write(buffer, utf8, n);
}

static int write_double(Buffer *buffer, double value) {
    unsigned char out[9];
    uint64_t bits;
    memcpy(&bits, &value, 8);
    out[0] = 0x21;
    for (int i = 0; i < 8; i++)
        out[1 + i] = (unsigned char)(bits >> (8 * i)); /* little-endian, as struct "<d" */
    return buffer_write(buffer, out, 9);
}

/* The AnyValue message body of `value` (without its own tag and length). */
static int write_any_value(Buffer *buffer, PyObject *value, int depth) {
    if (depth > 64) {
        PyErr_SetString(unsupported, "attribute value nested too deeply");
        return -1;
    }
    if (PyFloat_CheckExact(value))
        return write_double(buffer, PyFloat_AS_DOUBLE(value));
    if (PyBool_Check(value)) {
        unsigned char out[2] = {0x10, value == Py_True ? 1 : 0};
        return buffer_write(buffer, out, 2);
    }
    if (PyLong_CheckExact(value)) {
        int overflow = 0;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow) {
            PyErr_SetString(unsupported, "int outside int64");
            return -1;
        }
        if (number == -1 && PyErr_Occurred())
            return -1;
        if (buffer_byte(buffer, 0x18) < 0)
            return -1;
        return buffer_varint(buffer, (uint64_t)number); /* two's complement, as int64 */
    }
    if (PyUnicode_CheckExact(value))
        return write_string(buffer, 0x0a, value);
    if (value == Py_None)
        return 0;
    if (PyBytes_CheckExact(value)) {
        Py_ssize_t n = PyBytes_GET_SIZE(value);
        if (buffer_byte(buffer, 0x3a) < 0 || buffer_varint(buffer, (uint64_t)n) < 0)
            return -1;
        return buffer_write(buffer, PyBytes_AS_STRING(value), n);
    }
    if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
        PyObject *items = PySequence_Fast(value, "attribute sequence");
        if (items == NULL)
            return -1;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
        Py_ssize_t array_start = buffer->size;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t item_start = buffer->size;
            if (write_any_value(buffer, PySequence_Fast_GET_ITEM(items, i), depth + 1) < 0 ||
                close_field(buffer, item_start, 0x0a) < 0) {
                Py_DECREF(items);
                return -1;
            }
        }
        Py_DECREF(items);
        return close_field(buffer, array_start, 0x2a);
    }
    PyErr_Format(unsupported, "attribute value of type %s", Py_TYPE(value)->tp_name);
    return -1;
}

static int write_key_value(Buffer *buffer, unsigned char tag, PyObject *key, PyObject *value) {
    if (!PyUnicode_CheckExact(key)) {
        PyErr_SetString(unsupported, "attribute key is not a str");
        return -1;
    }
    Py_ssize_t start = buffer->size;
    if (PyUnicode_GET_LENGTH(key) > 0 && write_string(buffer, 0x0a, key) < 0)
        return -1;
    Py_ssize_t value_start = buffer->size;
    if (write_any_value(buffer, value, 0) < 0 || close_field(buffer, value_start, 0x12) < 0)
        return -1;
    return close_field(buffer, start, tag);
}

static PyObject *attributes(PyObject *self, PyObject *args) {
    PyObject *mapping;
    int tag;
    if (!PyArg_ParseTuple(args, "Oi", &mapping, &tag))
        return NULL;
    if (unsupported == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_otlp_attributes.init() was not called");
        return NULL;
    }
    if (tag < 0 || tag > 0x7F) {
        PyErr_SetString(PyExc_ValueError, "tag must be a one-byte field tag");
        return NULL;
    }
    Buffer buffer = {NULL, 0, 0};
    int failed = 0;
    if (PyDict_CheckExact(mapping)) {
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(mapping, &position, &key, &value)) {
            Py_INCREF(key);
            Py_INCREF(value);
            failed = write_key_value(&buffer, (unsigned char)tag, key, value) < 0;
            Py_DECREF(key);
            Py_DECREF(value);
            if (failed)
                break;
        }
    } else {
        PyObject *items = PyMapping_Items(mapping);
        if (items == NULL) {
            failed = 1;
        } else {
            Py_ssize_t count = PyList_GET_SIZE(items);
            for (Py_ssize_t i = 0; i < count && !failed; i++) {
                PyObject *pair = PyList_GET_ITEM(items, i);
                if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                    PyErr_SetString(unsupported, "mapping items are not pairs");
                    failed = 1;
                    break;
                }
                failed = write_key_value(&buffer, (unsigned char)tag, PyTuple_GET_ITEM(pair, 0),
                                         PyTuple_GET_ITEM(pair, 1)) < 0;
            }
            Py_DECREF(items);
        }
    }
    PyObject *result = failed ? NULL : PyBytes_FromStringAndSize(buffer.data ? buffer.data : "",
                                                                 buffer.size);
    PyMem_Free(buffer.data);
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

static PyMethodDef methods[] = {
    {"attributes", attributes, METH_VARARGS,
     "attributes(mapping, tag) -> bytes: the repeated KeyValue fields of `mapping`."},
    {"init", init, METH_O, "init(exception_class): what unsupported values raise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_otlp_attributes", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__otlp_attributes(void) { return PyModule_Create(&module); }
