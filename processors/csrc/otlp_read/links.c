#include "otlp_read.h"

/* ------------------------------------------------------------------ links
 * The per-rank links of an emitted train.step.ranks / collective.ranks span, as the
 * wire bytes of the Span's repeated `links` field (13): one Link per rank in rank
 * order, {trace_id, span_id, attributes: [flare.rank = rank]}. Merged into the span
 * (`MergeFromString`), they give the very message the three protobuf calls per link
 * built, for a fraction of the Python calls. */
static int bytes_attr(PyObject *obj, PyObject *name, PyObject **value, const char **data, Py_ssize_t *len) {
    *value = PyObject_GetAttr(obj, name);
    if (!*value) return -1;
    if (!PyBytes_Check(*value)) {
        PyErr_SetString(PyExc_TypeError, "trace_id and span_id must be bytes");
        Py_DECREF(*value);
        return -1;
    }
    *data = PyBytes_AS_STRING(*value);
    *len = PyBytes_GET_SIZE(*value);
    return 0;
}

PyObject *rank_links(PyObject *self, PyObject *args) {
    PyObject *ranks, *rank_key;
    if (!PyArg_ParseTuple(args, "O!U", &PyDict_Type, &ranks, &rank_key)) return NULL;
    Py_ssize_t key_len;
    const char *key = PyUnicode_AsUTF8AndSize(rank_key, &key_len);
    if (!key) return NULL;
    Buf o = {0};
    PyObject *order = PyDict_Keys(ranks);
    if (!order || PyList_Sort(order)) {
        Py_XDECREF(order);
        return NULL;
    }
    static PyObject *trace_name, *span_name;
    if (!trace_name && !(trace_name = PyUnicode_InternFromString("trace_id"))) goto fail;
    if (!span_name && !(span_name = PyUnicode_InternFromString("span_id"))) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(order); i++) {
        PyObject *rank_obj = PyList_GET_ITEM(order, i);
        long long rank = PyLong_AsLongLong(rank_obj);
        if (rank == -1 && PyErr_Occurred()) goto fail;
        PyObject *entry = PyDict_GetItemWithError(ranks, rank_obj);
        if (!entry) goto fail;
        PyObject *trace_obj, *span_obj;
        const char *trace, *span;
        Py_ssize_t trace_len, span_len;
        if (bytes_attr(entry, trace_name, &trace_obj, &trace, &trace_len)) goto fail;
        if (bytes_attr(entry, span_name, &span_obj, &span, &span_len)) {
            Py_DECREF(trace_obj);
            goto fail;
        }
        /* AnyValue{int_value: rank} in KeyValue{key, value} in Link.attributes (4). */
        uint64_t v = (uint64_t)rank;
        size_t any_len = 1 + varint_size(v);
        size_t kv_len = 1 + varint_size((uint64_t)key_len) + (size_t)key_len + 1 + varint_size(any_len) + any_len;
        size_t link_len = 1 + varint_size(kv_len) + kv_len;
        if (trace_len) link_len += 1 + varint_size((uint64_t)trace_len) + (size_t)trace_len;
        if (span_len) link_len += 1 + varint_size((uint64_t)span_len) + (size_t)span_len;
        if (buf_reserve(&o, 1 + 10 + link_len)) {
            Py_DECREF(trace_obj);
            Py_DECREF(span_obj);
            goto fail;
        }
        char *p = o.buf + o.len;
        *p++ = (char)0x6a; /* field 13, length-delimited */
        p += put_varint(p, link_len);
        if (trace_len) {
            *p++ = 0x0a;
            p += put_varint(p, (uint64_t)trace_len);
            memcpy(p, trace, (size_t)trace_len);
            p += trace_len;
        }
        if (span_len) {
            *p++ = 0x12;
            p += put_varint(p, (uint64_t)span_len);
            memcpy(p, span, (size_t)span_len);
            p += span_len;
        }
        Py_DECREF(trace_obj);
        Py_DECREF(span_obj);
        *p++ = 0x22;
        p += put_varint(p, kv_len);
        *p++ = 0x0a;
        p += put_varint(p, (uint64_t)key_len);
        memcpy(p, key, (size_t)key_len);
        p += key_len;
        *p++ = 0x12;
        p += put_varint(p, any_len);
        *p++ = 0x18;
        p += put_varint(p, v);
        o.len = (size_t)(p - o.buf);
    }
    Py_DECREF(order);
    PyObject *result = PyBytes_FromStringAndSize(o.buf ? o.buf : "", (Py_ssize_t)o.len);
    PyMem_Free(o.buf);
    return result;
fail:
    PyMem_Free(o.buf);
    Py_DECREF(order);
    return NULL;
}
