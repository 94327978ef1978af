#include "otlp_read.h"

/* ------------------------------------------------------------------ id check
 * What the receivers' check (flare.collector.validate.check_traces) tests on every
 * span, on the wire: a trace id of 16 bytes, not all zero; a span id of 8, not all
 * zero; a parent id of 0 or 8 bytes (the last occurrence of a field counts, as when
 * parsing). */
static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static int span_ids_bad(const uint8_t *p, size_t n) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    size_t trace_len = 0, span_len = 0, parent_len = 0;
    const uint8_t *trace = NULL, *span = NULL;
    while ((rc = next_field(&r, &f)) == 0) {
        if ((f.num != 1 && f.num != 2 && f.num != 4) || f.wt != 2) continue;
        if (f.num == 1) { trace = f.data; trace_len = f.len; }
        else if (f.num == 2) { span = f.data; span_len = f.len; }
        else parent_len = f.len;
    }
    if (rc < 0) return -1;
    return trace_len != 16 || span_len != 8 || all_zero(trace, 16) || all_zero(span, 8) ||
           (parent_len != 0 && parent_len != 8);
}

/* Spans and spans with unusable ids of a serialized ExportTraceServiceRequest; -1 when
 * the bytes are not one. */
static int count_span_ids(const uint8_t *p, size_t n, long long *spans, long long *bad) {
    Reader r = {p, p + n};
    Field rs, ss, sp;
    int rc, rc2 = 0, rc3 = 0;
    *spans = *bad = 0;
    while ((rc = next_field(&r, &rs)) == 0) {
        if (rs.num != 1 || rs.wt != 2) continue;
        Reader rr = {rs.data, rs.data + rs.len};
        while ((rc2 = next_field(&rr, &ss)) == 0) {
            if (ss.num != 2 || ss.wt != 2) continue;
            Reader sr = {ss.data, ss.data + ss.len};
            while ((rc3 = next_field(&sr, &sp)) == 0) {
                if (sp.num != 2 || sp.wt != 2) continue;
                int b = span_ids_bad(sp.data, sp.len);
                if (b < 0) return -1;
                (*spans)++;
                *bad += b;
            }
            if (rc3 < 0) return -1;
        }
        if (rc2 < 0) return -1;
    }
    return rc < 0 ? -1 : 0;
}

PyObject *check_span_ids(PyObject *self, PyObject *arg) {
    Py_buffer payload;
    if (PyObject_GetBuffer(arg, &payload, PyBUF_SIMPLE)) return NULL;
    long long spans, bad;
    int rc = count_span_ids(payload.buf, (size_t)payload.len, &spans, &bad);
    PyBuffer_Release(&payload);
    if (rc < 0) {
        PyErr_SetString(PyExc_ValueError, "malformed OTLP ExportTraceServiceRequest");
        return NULL;
    }
    return Py_BuildValue("(LL)", spans, bad);
}

/* ------------------------------------------------------------------ strict check
 * Whether protobuf would certainly parse the bytes as the message a schema describes,
 * told without building it (the receivers' check of every request). The schema, built
 * in Python from the message descriptors (flare.collector.validate), is a tuple with
 * one bytes object per message type, indexed by field number: 0 a field the check does
 * not know, 1 varint, 2 fixed64, 3 fixed32, 4 string (UTF-8), 5 bytes, 6 + i a message
 * of type i. Only the plain case passes: known fields with their own wire type,
 * varints and tags of canonical range, valid UTF-8 (what proto3 requires of strings),
 * nesting under STRICT_DEPTH. Anything else (unknown fields, groups, packed or
 * mistyped fields, deep nesting, malformed bytes) is "not sure", and the caller parses
 * with protobuf, which then accepts or names the error as before. */
#define STRICT_DEPTH 64

typedef struct {
    const uint8_t *codes[256];
    uint64_t ncodes[256];
    Py_ssize_t types;
    Py_ssize_t span_type;
    long long spans, bad;
} Strict;

static inline int strict_varint(Reader *r, int max_bytes, uint64_t *out) {
    if (r->p < r->end && !(*r->p & 0x80)) { /* one byte: nearly every tag and length */
        *out = *r->p++;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < max_bytes && r->p < r->end; i++) {
        uint8_t b = *r->p++;
        if (i == 9 && b > 1) return -1; /* beyond 64 bits */
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF). */
static int utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL) break;
            i += 8;
        }
        if (i >= n) break;
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && s[i + 1] < 0xA0) return 0; /* overlong */
            if (c == 0xED && s[i + 1] > 0x9F) return 0; /* surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 ||
                (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && s[i + 1] < 0x90) return 0; /* overlong */
            if (c == 0xF4 && s[i + 1] > 0x8F) return 0; /* above U+10FFFF */
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* 0: certainly valid; -1: not sure (see above). A message of the span type also has
 * its ids checked, as span_ids_bad does. */
static int strict_message(const uint8_t *p, size_t n, Strict *st, Py_ssize_t type, int depth) {
    if (depth >= STRICT_DEPTH || type >= st->types) return -1;
    const uint8_t *codes = st->codes[type];
    uint64_t ncodes = st->ncodes[type];
    int is_span = type == st->span_type;
    const uint8_t *trace = NULL, *span = NULL;
    size_t trace_len = 0, span_len = 0, parent_len = 0;
    Reader r = {p, p + n};
    while (r.p < r.end) {
        uint64_t key, v, len;
        if (strict_varint(&r, 5, &key) || key > 0xFFFFFFFFULL) return -1;
        uint64_t num = key >> 3;
        int wt = (int)(key & 7);
        uint8_t code = num < ncodes ? codes[num] : 0;
        switch (code) {
        case 0:
            return -1;
        case 1:
            if (wt != 0 || strict_varint(&r, 10, &v)) return -1;
            break;
        case 2:
            if (wt != 1 || r.end - r.p < 8) return -1;
            r.p += 8;
            break;
        case 3:
            if (wt != 5 || r.end - r.p < 4) return -1;
            r.p += 4;
            break;
        default:
            if (wt != 2 || strict_varint(&r, 10, &len) || len > (uint64_t)(r.end - r.p) ||
                len > 0x7FFFFFFFULL)
                return -1;
            if (code == 4) {
                if (!utf8_valid(r.p, (size_t)len)) return -1;
            } else if (code >= 6) {
                if (strict_message(r.p, (size_t)len, st, code - 6, depth + 1)) return -1;
            } else if (is_span) {
                if (num == 1) { trace = r.p; trace_len = (size_t)len; }
                else if (num == 2) { span = r.p; span_len = (size_t)len; }
                else if (num == 4) parent_len = (size_t)len;
            }
            r.p += len;
        }
    }
    if (is_span) {
        st->spans++;
        st->bad += trace_len != 16 || span_len != 8 || all_zero(trace, 16) || all_zero(span, 8) ||
                   (parent_len != 0 && parent_len != 8);
    }
    return 0;
}

PyObject *check_traces_strict(PyObject *self, PyObject *args) {
    Py_buffer payload;
    PyObject *schema;
    Py_ssize_t span_type;
    if (!PyArg_ParseTuple(args, "y*O!n", &payload, &PyTuple_Type, &schema, &span_type)) return NULL;
    Strict st;
    st.types = PyTuple_GET_SIZE(schema);
    st.span_type = span_type;
    st.spans = st.bad = 0;
    int rc = st.types > 256 ? -1 : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < st.types; i++) {
        PyObject *codes = PyTuple_GET_ITEM(schema, i);
        if (!PyBytes_Check(codes)) {
            rc = -1;
            break;
        }
        st.codes[i] = (const uint8_t *)PyBytes_AS_STRING(codes);
        st.ncodes[i] = (uint64_t)PyBytes_GET_SIZE(codes);
    }
    if (rc == 0) rc = strict_message(payload.buf, (size_t)payload.len, &st, 0, 0);
    PyBuffer_Release(&payload);
    if (rc < 0) Py_RETURN_NONE;
    return Py_BuildValue("(LL)", st.spans, st.bad);
}
