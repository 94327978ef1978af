#include "otlp_read.h"

/* ------------------------------------------------------------------ AnyValue */

/* The field of the AnyValue oneof that is set (the last one on the wire wins). The
 * same array or kvlist twice in a row is merged by protobuf (their items joined): that
 * rare case is -1 here, and the caller's Python reference reads it. */
int anyvalue_field(const uint8_t *p, size_t n, Field *out) {
    Reader r = {p, p + n};
    Field f;
    int rc, have = 0;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num >= 1 && f.num <= 7) {
            int want = (f.num == 2 || f.num == 3) ? 0 : (f.num == 4 ? 1 : 2);
            if (f.wt != want) continue;
            if (have && (f.num == 5 || f.num == 6) && out->num == f.num) return -1;
            *out = f;
            have = 1;
        } else if (f.num == 8) {
            /* string_value_strindex, newer OTLP's (profiles) member of the oneof: whether
             * it is one depends on the protobuf schema installed, which the reference
             * reads with. */
            return -1;
        }
    }
    if (rc < 0) return -1;
    return have; /* 0: no value (JSON null) */
}

int kvlist_json(Buf *b, const uint8_t *p, size_t n, uint32_t field_num, int depth);

int anyvalue_json(Buf *b, const uint8_t *p, size_t n, int depth) {
    Field f;
    if (depth > MAX_DEPTH) return -1;
    int have = anyvalue_field(p, n, &f);
    if (have < 0) return -1;
    if (!have) return PUT_LIT(b, "null");
    switch (f.num) {
    case 1: return json_string(b, f.data, f.len);
    case 2: return f.v ? PUT_LIT(b, "true") : PUT_LIT(b, "false");
    case 3: return json_int(b, (int64_t)f.v);
    case 4: {
        double d;
        memcpy(&d, &f.v, 8);
        return json_double(b, d);
    }
    case 5: {
        Reader r = {f.data, f.data + f.len};
        Field item;
        int rc, first = 1;
        if (PUT_LIT(b, "[")) return -1;
        while ((rc = next_field(&r, &item)) == 0) {
            if (item.num != 1 || item.wt != 2) continue;
            if (!first && PUT_LIT(b, ",")) return -1;
            first = 0;
            if (anyvalue_json(b, item.data, item.len, depth + 1)) return -1;
        }
        if (rc < 0) return -1;
        return PUT_LIT(b, "]");
    }
    case 6: return kvlist_json(b, f.data, f.len, 1, depth + 1);
    case 7: return json_base64(b, f.data, f.len);
    }
    return -1;
}

/* One KeyValue: key and value slices. A value given twice is merged by protobuf: -1,
 * for the caller's Python reference (as every message field read once below). */
int keyvalue_parts(const uint8_t *p, size_t n, Field *key, Field *value, int *has_value) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    key->data = (const uint8_t *)"";
    key->len = 0;
    *has_value = 0;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.wt != 2) continue;
        if (f.num == 1) {
            *key = f;
        } else if (f.num == 2) {
            if (*has_value) return -1;
            *value = f;
            *has_value = 1;
        }
    }
    return rc < 0 ? -1 : 0;
}

static int keyvalue_json(Buf *b, const uint8_t *p, size_t n, int depth) {
    Field key, value;
    int has_value;
    if (keyvalue_parts(p, n, &key, &value, &has_value)) return -1;
    if (json_string(b, key.data, key.len) || PUT_LIT(b, ":")) return -1;
    if (!has_value) return PUT_LIT(b, "null");
    return anyvalue_json(b, value.data, value.len, depth);
}

/* A JSON object of the repeated KeyValue field `field_num` of a message. */
int kvlist_json(Buf *b, const uint8_t *p, size_t n, uint32_t field_num, int depth) {
    Reader r = {p, p + n};
    Field f;
    int rc, first = 1;
    if (depth > MAX_DEPTH) return -1;
    if (PUT_LIT(b, "{")) return -1;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != field_num || f.wt != 2) continue;
        if (!first && PUT_LIT(b, ",")) return -1;
        first = 0;
        if (keyvalue_json(b, f.data, f.len, depth)) return -1;
    }
    if (rc < 0) return -1;
    return PUT_LIT(b, "}");
}

/* AnyValue -> Python object, in one of two shapes: as otlp_values.plain reads it
 * (arrays as tuples, bytes as bytes: the correlator's picks) or, with `json`, as JSON
 * carries it (arrays as lists, bytes as base64 text: the store's resource attributes). */
PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth, int json);

/* {key: value} of the KeyValues in field 1 (a KeyValueList's, or a Resource's). */
PyObject *kvlist_py(const uint8_t *p, size_t n, int depth, int json) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    if (depth > MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "OTLP attribute nested too deeply");
        return NULL;
    }
    PyObject *dict = PyDict_New();
    if (!dict) return NULL;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 1 || f.wt != 2) continue;
        Field key, value;
        int has_value;
        if (keyvalue_parts(f.data, f.len, &key, &value, &has_value)) goto bad;
        PyObject *k = PyUnicode_DecodeUTF8((const char *)key.data, (Py_ssize_t)key.len, "replace");
        if (!k) goto fail;
        PyObject *v = has_value ? anyvalue_py(value.data, value.len, depth + 1, json) : Py_NewRef(Py_None);
        if (!v) {
            Py_DECREF(k);
            goto fail;
        }
        int err = PyDict_SetItem(dict, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (err) goto fail;
    }
    if (rc < 0) goto bad;
    return dict;
bad:
    PyErr_SetString(PyExc_ValueError, "malformed OTLP attributes");
fail:
    Py_DECREF(dict);
    return NULL;
}

PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth, int json) {
    Field f;
    if (depth > MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "OTLP attribute nested too deeply");
        return NULL;
    }
    int have = anyvalue_field(p, n, &f);
    if (have < 0) {
        PyErr_SetString(PyExc_ValueError, "malformed OTLP AnyValue");
        return NULL;
    }
    if (!have) return Py_NewRef(Py_None);
    switch (f.num) {
    case 1: return PyUnicode_DecodeUTF8((const char *)f.data, (Py_ssize_t)f.len, "replace");
    case 2: return PyBool_FromLong(f.v != 0);
    case 3: return PyLong_FromLongLong((long long)(int64_t)f.v);
    case 4: {
        double d;
        memcpy(&d, &f.v, 8);
        return PyFloat_FromDouble(d);
    }
    case 5: {
        /* Counted first, then built as the tuple or list itself. */
        Reader r = {f.data, f.data + f.len};
        Field item;
        int rc;
        Py_ssize_t count = 0;
        while ((rc = next_field(&r, &item)) == 0)
            if (item.num == 1 && item.wt == 2) count++;
        if (rc < 0) {
            PyErr_SetString(PyExc_ValueError, "malformed OTLP ArrayValue");
            return NULL;
        }
        PyObject *items = json ? PyList_New(count) : PyTuple_New(count);
        if (!items) return NULL;
        r.p = f.data;
        for (Py_ssize_t i = 0; i < count && next_field(&r, &item) == 0;) {
            if (item.num != 1 || item.wt != 2) continue;
            PyObject *v = anyvalue_py(item.data, item.len, depth + 1, json);
            if (!v) {
                Py_DECREF(items); /* the slots left NULL are skipped by its dealloc */
                return NULL;
            }
            if (json) PyList_SET_ITEM(items, i++, v);
            else PyTuple_SET_ITEM(items, i++, v);
        }
        return items;
    }
    case 6: return kvlist_py(f.data, f.len, depth + 1, json);
    case 7: {
        if (!json) return PyBytes_FromStringAndSize((const char *)f.data, (Py_ssize_t)f.len);
        Buf b = {0};
        if (json_base64(&b, f.data, f.len)) {
            PyMem_Free(b.buf);
            return NULL;
        }
        PyObject *s = PyUnicode_DecodeASCII(b.buf + 1, (Py_ssize_t)b.len - 2, "strict");
        PyMem_Free(b.buf);
        return s;
    }
    }
    PyErr_SetString(PyExc_ValueError, "malformed OTLP AnyValue");
    return NULL;
}

/* otlp_columns._as_int on an AnyValue: 1 and *out set, or 0 for None. */
int anyvalue_as_int(const uint8_t *p, size_t n, long long *out) {
    Field f;
    if (anyvalue_field(p, n, &f) != 1) return 0;
    switch (f.num) {
    case 2: *out = f.v != 0; return 1;
    case 3: *out = (long long)(int64_t)f.v; return 1;
    case 4: {
        double d;
        memcpy(&d, &f.v, 8);
        if (!isfinite(d) || d >= 9.2e18 || d <= -9.2e18) return 0;
        *out = (long long)d; /* int() truncates toward zero */
        return 1;
    }
    case 1: {
        char text[32];
        size_t len = f.len;
        const uint8_t *s = f.data;
        while (len && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')) { s++; len--; }
        while (len && (s[len - 1] == ' ' || s[len - 1] == '\t' || s[len - 1] == '\n' || s[len - 1] == '\r')) len--;
        if (len == 0 || len >= sizeof text) return 0;
        memcpy(text, s, len);
        text[len] = 0;
        size_t i = (text[0] == '-' || text[0] == '+') ? 1 : 0;
        if (i == len) return 0;
        for (; i < len; i++)
            if (text[i] < '0' || text[i] > '9') return 0;
        char *end;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (errno || *end) return 0;
        *out = v;
        return 1;
    }
    }
    return 0;
}
