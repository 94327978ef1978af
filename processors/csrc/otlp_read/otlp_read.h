/* The OTLP wire format read in C: the collector's readers, one module (`_otlp_read`)
 * built from the files beside this header, one file per section:
 * - buffer.c: growable output buffers (pooled for the store's columns) and the JSON
 *   text of values;
 * - anyvalue.c: AnyValue and KeyValue lists, to JSON text or Python objects;
 * - columns.c: `SpanBuilder`, a request's spans straight into the store's Arrow-layout
 *   columns (flare.exporters.otlp_columns.SpanColumns.add_request_python is the
 *   reference);
 * - check.c: `check_span_ids` and `check_traces_strict`, the receivers' check of every
 *   request (flare.collector.validate);
 * - picker.c: `select_spans`, the few spans and keys the correlator reads
 *   (flare.processors.span_select.Selection.select_python);
 * - links.c: `rank_links`, the per-rank links of a span the correlator emits
 *   (flare.processors.correlation_output);
 * - module.c: the module.
 * Why C: through the protobuf Python API every field access allocates a wrapper
 * object; reading the wire directly keeps these paths near protobuf's own parse. Each
 * function must match its Python reference value for value (tests/exporters/
 * test_otlp_fast.py, tests/processors/test_span_select.py), tests/fuzz runs them under
 * ASan and UBSan. Malformed input raises ValueError and the caller's Python reference
 * decides. The ranks' attribute writer is apart, in flare-wire (flare/wire/_otlp_write.c):
 * a rank installs none of this.
 */
#ifndef FLARE_OTLP_READ_H
#define FLARE_OTLP_READ_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ wire reading */
typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

typedef struct {
    uint32_t num;
    int wt;
    uint64_t v;
    const uint8_t *data;
    size_t len;
} Field;

static inline int read_varint(Reader *r, uint64_t *out) {
    uint64_t v = 0;
    int shift = 0;
    while (r->p < r->end && shift < 64) {
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
        shift += 7;
    }
    return -1;
}

static inline uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Protobuf's recursion limit (upb's default, the Python runtime's): the receivers
 * refuse anything nested deeper, so every walker here accepts at least as much. */
#define MAX_DEPTH 100

/* Skip a group's fields up to its END_GROUP tag (protobuf keeps a group of a field it
 * does not know as an unknown field; OTLP declares none). 0 ok, -1 malformed. */
static inline int skip_group(Reader *r, uint32_t num, int depth) {
    uint64_t key, v;
    if (depth > MAX_DEPTH) return -1;
    while (r->p < r->end) {
        if (read_varint(r, &key)) return -1;
        uint32_t n = (uint32_t)(key >> 3);
        int wt = (int)(key & 7);
        if (n == 0) return -1;
        switch (wt) {
        case 0: if (read_varint(r, &v)) return -1; break;
        case 1: if (r->end - r->p < 8) return -1; r->p += 8; break;
        case 2:
            if (read_varint(r, &v) || (uint64_t)(r->end - r->p) < v) return -1;
            r->p += v;
            break;
        case 3: if (skip_group(r, n, depth + 1)) return -1; break;
        case 4: return n == num ? 0 : -1;
        case 5: if (r->end - r->p < 4) return -1; r->p += 4; break;
        default: return -1;
        }
    }
    return -1; /* no END_GROUP */
}

/* 0 = read a field, 1 = end of message, -1 = malformed. A field whose wire type is not
 * the one its number declares is an unknown field to protobuf, which keeps the value
 * read before: every caller checks `wt` and skips such a field, as protobuf does. A
 * group (wire type 3) is read whole and returned with wt 3, which no caller wants. */
static inline int next_field(Reader *r, Field *f) {
    uint64_t key, n;
    if (r->p >= r->end) return 1;
    if (read_varint(r, &key)) return -1;
    f->num = (uint32_t)(key >> 3);
    f->wt = (int)(key & 7);
    if (f->num == 0) return -1;
    switch (f->wt) {
    case 0:
        return read_varint(r, &f->v);
    case 1:
        if (r->end - r->p < 8) return -1;
        f->v = le64(r->p);
        r->p += 8;
        return 0;
    case 2:
        if (read_varint(r, &n)) return -1;
        if ((uint64_t)(r->end - r->p) < n) return -1;
        f->data = r->p;
        f->len = (size_t)n;
        r->p += n;
        return 0;
    case 5:
        if (r->end - r->p < 4) return -1;
        f->v = (uint64_t)r->p[0] | ((uint64_t)r->p[1] << 8) | ((uint64_t)r->p[2] << 16) |
               ((uint64_t)r->p[3] << 24);
        r->p += 4;
        return 0;
    case 3:
        return skip_group(r, f->num, 1);
    default:
        return -1; /* an END_GROUP without its start, or wire type 6/7 */
    }
}

/* ------------------------------------------------------------------ output buffer */
typedef struct {
    char *buf;
    size_t len;
    size_t cap;
} Buf;

int buf_grow(Buf *b, size_t extra);

static inline int buf_reserve(Buf *b, size_t extra) {
    return b->len + extra <= b->cap ? 0 : buf_grow(b, extra);
}

static inline int buf_put(Buf *b, const char *s, size_t n) {
    if (n == 0) return 0; /* an empty column's buffer may still be NULL: no memcpy to it */
    if (buf_reserve(b, n)) return -1;
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    return 0;
}

/* A varint at p (room for 10 bytes); returns its length. */
static inline size_t put_varint(char *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (char)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (char)v;
    return n;
}

static inline size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

#define PUT_LIT(b, s) buf_put((b), (s), sizeof(s) - 1)

/* ------------------------------------------------------------------ across the files */
extern const char HEX[]; /* lower-case hex digits */
extern PyTypeObject ChunkType;
extern PyTypeObject SpanBuilderType;
int anyvalue_as_int(const uint8_t *p, size_t n, long long *out);
int anyvalue_field(const uint8_t *p, size_t n, Field *out);
int anyvalue_json(Buf *b, const uint8_t *p, size_t n, int depth);
PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth, int json);
void buf_release(char *buf, size_t cap);
PyObject *check_span_ids(PyObject *self, PyObject *arg);
PyObject *check_traces_strict(PyObject *self, PyObject *args);
PyObject *double_json(PyObject *self, PyObject *arg);
int json_base64(Buf *b, const uint8_t *s, size_t n);
int json_double(Buf *b, double d);
int json_int(Buf *b, int64_t v);
int json_string(Buf *b, const uint8_t *s, size_t n);
int keyvalue_parts(const uint8_t *p, size_t n, Field *key, Field *value, int *has_value);
int kvlist_json(Buf *b, const uint8_t *p, size_t n, uint32_t field_num, int depth);
PyObject *kvlist_py(const uint8_t *p, size_t n, int depth, int json);
PyObject *rank_links(PyObject *self, PyObject *args);
PyObject *select_spans(PyObject *self, PyObject *args);

#endif
