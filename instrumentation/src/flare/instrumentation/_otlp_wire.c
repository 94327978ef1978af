/* The OTLP wire format, read and written in C: every protobuf walk of Flare's hot paths.
 *
 * Why this exists: through the protobuf Python API every field access allocates a
 * wrapper object, and building a message allocates one per key and value. Reading and
 * writing the wire format directly keeps those paths near protobuf's own parse:
 * - writing (the ranks' span exporter): `attributes`, a span's KeyValue fields
 *   (otlp_encoding._py_attributes is the reference); `rank_links`, the per-rank links
 *   of a span the correlator emits (rank_correlation._add_rank_links);
 * - reading, in the collector: `SpanBuilder`, a request's spans straight into the
 *   store's Arrow-layout columns (otlp_columns.SpanColumns.add_request_python);
 *   `select_spans`, the few spans and keys the correlator reads (span_select.
 *   Selection.select_python); `check_span_ids` and `check_traces_strict`, the
 *   receivers' check of every request (flare.collector.validate).
 * Each function must match its Python reference value for value: tests/exporters/
 * test_otlp_fast.py, tests/processors/test_span_select.py and tests/instrumentation/
 * test_otlp_encoding.py check that, tests/fuzz the readers under ASan and UBSan.
 * Malformed input raises ValueError and the caller's Python reference decides.
 */
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

static int read_varint(Reader *r, uint64_t *out) {
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

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Protobuf's recursion limit (upb's default, the Python runtime's): the receivers
 * refuse anything nested deeper, so every walker here accepts at least as much. */
#define MAX_DEPTH 100

/* Skip a group's fields up to its END_GROUP tag (protobuf keeps a group of a field it
 * does not know as an unknown field; OTLP declares none). 0 ok, -1 malformed. */
static int skip_group(Reader *r, uint32_t num, int depth) {
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
static int next_field(Reader *r, Field *f) {
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

/* Column buffers come back here when Arrow lets go of them (after the store's flush)
 * and the next batch's columns grow into them: memory the process already touched,
 * where fresh memory costs a page fault per 4 KiB (a fifth of the collector's kernel
 * time went to page faults, about an eighth of them on these buffers). Bounded: at
 * most POOL_SLOTS buffers of POOL_MIN_BYTES or more, POOL_MAX_BYTES in all; beyond
 * that they are freed as before. All callers hold the GIL. */
#define POOL_SLOTS 32
#define POOL_MIN_BYTES ((size_t)64 << 10)
#define POOL_MAX_BYTES ((size_t)64 << 20)
static struct {
    char *buf;
    size_t cap;
} pool[POOL_SLOTS];
static int pool_count;
static size_t pool_bytes;

/* Keep `buf` for reuse; 0 when it does not fit the pool (the caller frees it). */
static int pool_put(char *buf, size_t cap) {
    if (!buf || cap < POOL_MIN_BYTES || pool_count == POOL_SLOTS || pool_bytes + cap > POOL_MAX_BYTES)
        return 0;
    pool[pool_count].buf = buf;
    pool[pool_count].cap = cap;
    pool_count++;
    pool_bytes += cap;
    return 1;
}

static void buf_release(char *buf, size_t cap) {
    if (!pool_put(buf, cap)) PyMem_Free(buf);
}

/* The smallest pooled buffer of `need` to 4 * `need` bytes (a small column leaves the
 * large buffers to the large ones), or NULL. */
static char *pool_take(size_t need, size_t *cap) {
    int best = -1;
    for (int i = 0; i < pool_count; i++)
        if (pool[i].cap >= need && pool[i].cap / 4 <= need && (best < 0 || pool[i].cap < pool[best].cap))
            best = i;
    if (best < 0) return NULL;
    char *buf = pool[best].buf;
    *cap = pool[best].cap;
    pool_bytes -= *cap;
    pool[best] = pool[--pool_count];
    return buf;
}

static int buf_reserve(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    if (cap >= POOL_MIN_BYTES && pool_count) {
        size_t got;
        char *pooled = pool_take(cap, &got);
        if (pooled) {
            if (b->len) memcpy(pooled, b->buf, b->len);
            buf_release(b->buf, b->cap);
            b->buf = pooled;
            b->cap = got;
            return 0;
        }
    }
    char *grown = PyMem_Realloc(b->buf, cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    b->buf = grown;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, size_t n) {
    if (n == 0) return 0; /* an empty column's buffer may still be NULL: no memcpy to it */
    if (buf_reserve(b, n)) return -1;
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, s) buf_put((b), (s), sizeof(s) - 1)

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
    return buf_tag_varint(b, tag, n) || buf_put(b, p, n) ? -1 : 0;
}
static const char HEX[] = "0123456789abcdef";

/* JSON string the way Python's json (ensure_ascii=False) writes it. Room for the worst
 * case (every byte a \u00XX escape) is reserved once; most keys and values need no
 * escape at all and are copied whole. */
static int json_string(Buf *b, const uint8_t *s, size_t n) {
    if (buf_reserve(b, 6 * n + 2)) return -1;
    char *o = b->buf + b->len;
    *o++ = '"';
    size_t plain = 0;
    while (plain < n && s[plain] >= 0x20 && s[plain] != '"' && s[plain] != '\\') plain++;
    memcpy(o, s, plain);
    o += plain;
    for (size_t i = plain; i < n; i++) {
        uint8_t c = s[i];
        switch (c) {
        case '"': *o++ = '\\'; *o++ = '"'; break;
        case '\\': *o++ = '\\'; *o++ = '\\'; break;
        case '\n': *o++ = '\\'; *o++ = 'n'; break;
        case '\r': *o++ = '\\'; *o++ = 'r'; break;
        case '\t': *o++ = '\\'; *o++ = 't'; break;
        case '\b': *o++ = '\\'; *o++ = 'b'; break;
        case '\f': *o++ = '\\'; *o++ = 'f'; break;
        default:
            if (c < 0x20) {
                *o++ = '\\'; *o++ = 'u'; *o++ = '0'; *o++ = '0';
                *o++ = HEX[c >> 4]; *o++ = HEX[c & 15];
            } else {
                *o++ = (char)c;
            }
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->buf);
    return 0;
}

/* repr(d) for the doubles senders mostly have, a few decimals between 1e-4 and 1e15
 * (3.5, 0.125, 742.318): the fewest decimals j <= 7 whose k / 10**j converts back to
 * exactly d are the shortest round-tripping digits repr picks (a decimal with fewer
 * digits would have fewer decimals, and was tried first), written the way repr writes
 * numbers of that size (fixed notation, ".0" for integral values). 0 when it does not
 * apply; the caller then asks Python's own repr. */
static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7};

static int json_double_short(Buf *b, double d) {
    double a = fabs(d);
    if (!(a >= 1e-4 && a < 1e15)) return 0;
    for (int j = 0; j < 8; j++) {
        double scaled = a * POW10[j];
        if (scaled >= 1e15) return 0;
        double k = nearbyint(scaled);
        if (k / POW10[j] != a) continue;
        uint64_t digits = (uint64_t)k;
        char text[40];
        char *end = text + sizeof text, *o = end;
        if (j == 0) {
            *--o = '0';
            *--o = '.';
        }
        for (int i = 0; i < j; i++) {
            *--o = (char)('0' + digits % 10);
            digits /= 10;
        }
        if (j) *--o = '.';
        do {
            *--o = (char)('0' + digits % 10);
            digits /= 10;
        } while (digits);
        if (d < 0) *--o = '-';
        return buf_put(b, o, (size_t)(end - o)) ? -1 : 1;
    }
    return 0;
}

static int json_double(Buf *b, double d) {
    if (isnan(d)) return PUT_LIT(b, "null");
    if (isinf(d)) return d > 0 ? PUT_LIT(b, "\"Infinity\"") : PUT_LIT(b, "\"-Infinity\"");
    int fast = json_double_short(b, d);
    if (fast) return fast < 0 ? -1 : 0;
    char *text = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!text) return -1;
    int rc = buf_put(b, text, strlen(text));
    PyMem_Free(text);
    return rc;
}

/* Decimal digits by hand: snprintf's format parsing was a visible share of the profile. */
static int json_int(Buf *b, int64_t v) {
    char text[24];
    char *end = text + sizeof text, *o = end;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        *--o = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *--o = '-';
    return buf_put(b, o, (size_t)(end - o));
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int json_base64(Buf *b, const uint8_t *s, size_t n) {
    if (buf_reserve(b, 4 * ((n + 2) / 3) + 2)) return -1;
    char *o = b->buf + b->len;
    *o++ = '"';
    size_t i = 0;
    for (; i + 2 < n; i += 3) {
        uint32_t v = ((uint32_t)s[i] << 16) | ((uint32_t)s[i + 1] << 8) | s[i + 2];
        *o++ = B64[v >> 18];
        *o++ = B64[(v >> 12) & 63];
        *o++ = B64[(v >> 6) & 63];
        *o++ = B64[v & 63];
    }
    if (i < n) {
        uint32_t v = (uint32_t)s[i] << 16;
        if (i + 1 < n) v |= (uint32_t)s[i + 1] << 8;
        *o++ = B64[v >> 18];
        *o++ = B64[(v >> 12) & 63];
        *o++ = i + 1 < n ? B64[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    *o++ = '"';
    b->len = (size_t)(o - b->buf);
    return 0;
}

/* ------------------------------------------------------------------ AnyValue */

/* The field of the AnyValue oneof that is set (the last one on the wire wins). The
 * same array or kvlist twice in a row is merged by protobuf (their items joined): that
 * rare case is -1 here, and the caller's Python reference reads it. */
static int anyvalue_field(const uint8_t *p, size_t n, Field *out) {
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

static int kvlist_json(Buf *b, const uint8_t *p, size_t n, uint32_t field_num, int depth);

static int anyvalue_json(Buf *b, const uint8_t *p, size_t n, int depth) {
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
static int keyvalue_parts(const uint8_t *p, size_t n, Field *key, Field *value, int *has_value) {
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
static int kvlist_json(Buf *b, const uint8_t *p, size_t n, uint32_t field_num, int depth) {
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
static PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth, int json);

/* {key: value} of the KeyValues in field 1 (a KeyValueList's, or a Resource's). */
static PyObject *kvlist_py(const uint8_t *p, size_t n, int depth, int json) {
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

static PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth, int json) {
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
static int anyvalue_as_int(const uint8_t *p, size_t n, long long *out) {
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

/* ------------------------------------------------------------------ span columns
 * The spans are appended to Arrow-layout buffers (int32 offsets + UTF-8 data for
 * text, little-endian values, validity bitmaps for the nullable step and rank), so
 * the store builds its Arrow table from them without one Python object per value. */
enum {
    S_TRACE_ID, S_SPAN_ID, S_PARENT, S_NAME, S_STATUS_MESSAGE, S_ATTRIBUTES, S_EVENTS,
    S_LINKS, N_STRINGS
};
static const char *STRING_NAMES[N_STRINGS] = {
    "trace_id", "span_id", "parent_span_id", "name", "status_message", "attributes",
    "events", "links",
};
enum { F_KIND, F_STATUS_CODE, F_START, F_END, F_DURATION, F_STEP, F_RANK, N_FIXED };
static const char *FIXED_NAMES[N_FIXED] = {
    "kind", "status_code", "start_ns", "end_ns", "duration_ns", "step", "rank",
};
static const int FIXED_WIDTH[N_FIXED] = {1, 1, 8, 8, 8, 8, 4};
/* kind and status_code are TINYINT: a value outside int8 (a broken sender) is NULL. */
static const int FIXED_NULLABLE[N_FIXED] = {1, 1, 0, 0, 0, 1, 1};

typedef struct {
    Buf data;
    Buf offsets; /* int32, one more than rows */
} StrCol;

typedef struct {
    PyObject_HEAD
    Py_ssize_t rows;
    StrCol str[N_STRINGS];
    Buf fixed[N_FIXED];
    Buf valid[N_FIXED]; /* bitmaps, used for the nullable columns */
} SpanBuilder;

static int str_put(StrCol *c, const char *s, size_t n) {
    size_t end = c->data.len + n;
    if (end > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "spans too large for one store batch (2 GiB of text in a column)");
        return -1;
    }
    if (buf_put(&c->data, s, n) || buf_reserve(&c->offsets, 4)) return -1;
    int32_t off = (int32_t)end;
    memcpy(c->offsets.buf + c->offsets.len, &off, 4);
    c->offsets.len += 4;
    return 0;
}

/* Text as Python's UTF-8 decoder with errors="replace" leaves it: ASCII (nearly all of
 * it) is copied as is, anything else goes through that very decoder. */
static int str_put_text(StrCol *c, const char *s, size_t n) {
    size_t i = 0;
    while (i < n && !((uint8_t)s[i] & 0x80)) i++;
    if (i == n) return str_put(c, s, n);
    PyObject *u = PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "replace");
    if (!u) return -1;
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(u, &len);
    int rc = utf8 ? str_put(c, utf8, (size_t)len) : -1;
    Py_DECREF(u);
    return rc;
}

static int str_put_hex(StrCol *c, const uint8_t *p, size_t n) {
    if (n == 0) return str_put(c, "", 0);
    char stack[64];
    char *text = n * 2 <= sizeof stack ? stack : PyMem_Malloc(n * 2 + 1);
    if (!text) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        text[2 * i] = HEX[p[i] >> 4];
        text[2 * i + 1] = HEX[p[i] & 15];
    }
    int rc = str_put(c, text, 2 * n);
    if (text != stack) PyMem_Free(text);
    return rc;
}

static int set_bit(Buf *bits, Py_ssize_t row, int on) {
    size_t need = (size_t)(row >> 3) + 1;
    if (bits->len < need) {
        if (buf_reserve(bits, need - bits->len)) return -1;
        memset(bits->buf + bits->len, 0, need - bits->len);
        bits->len = need;
    }
    if (on) bits->buf[row >> 3] |= (char)(1 << (row & 7));
    else bits->buf[row >> 3] &= (char)~(1 << (row & 7));
    return 0;
}

/* One value of fixed column `col` for row `rows`; `present` 0 stores NULL. */
static int fixed_put(SpanBuilder *sb, int col, int present, int64_t v) {
    Buf *b = &sb->fixed[col];
    int w = FIXED_WIDTH[col];
    if (buf_reserve(b, (size_t)w)) return -1;
    if (w == 1 && (v < -128 || v > 127)) present = 0;
    if (w == 4 && (v < INT32_MIN || v > INT32_MAX)) present = 0;
    if (!present) v = 0;
    if (w == 1) {
        int8_t x = (int8_t)v;
        memcpy(b->buf + b->len, &x, 1);
    } else if (w == 4) {
        int32_t x = (int32_t)v;
        memcpy(b->buf + b->len, &x, 4);
    } else {
        memcpy(b->buf + b->len, &v, 8);
    }
    b->len += (size_t)w;
    if (FIXED_NULLABLE[col]) return set_bit(&sb->valid[col], sb->rows, present);
    return 0;
}

/* Back to `rows` rows (a request that failed half-way leaves nothing behind). */
static void builder_truncate(SpanBuilder *sb, Py_ssize_t rows) {
    for (int i = 0; i < N_STRINGS; i++) {
        StrCol *c = &sb->str[i];
        c->offsets.len = 4 * (size_t)(rows + 1);
        int32_t end;
        memcpy(&end, c->offsets.buf + 4 * rows, 4);
        c->data.len = (size_t)end;
    }
    for (int i = 0; i < N_FIXED; i++) {
        sb->fixed[i].len = (size_t)rows * (size_t)FIXED_WIDTH[i];
        if (FIXED_NULLABLE[i] && sb->valid[i].len > (size_t)((rows + 7) >> 3))
            sb->valid[i].len = (size_t)((rows + 7) >> 3);
    }
    sb->rows = rows;
}

/* Events: [{"name":..,"time_ns":..,"attributes":{..}}]; links alike. */
static int events_json(Buf *b, const uint8_t **items, const size_t *lens, size_t count, int links) {
    if (PUT_LIT(b, "[")) return -1;
    for (size_t i = 0; i < count; i++) {
        Reader r = {items[i], items[i] + lens[i]};
        Field f, name = {0}, trace = {0}, span = {0};
        uint64_t time_ns = 0;
        int rc;
        name.data = trace.data = span.data = (const uint8_t *)"";
        while ((rc = next_field(&r, &f)) == 0) {
            if (!links && f.num == 1 && f.wt == 1) time_ns = f.v;
            else if (!links && f.num == 2 && f.wt == 2) name = f;
            else if (links && f.num == 1 && f.wt == 2) trace = f;
            else if (links && f.num == 2 && f.wt == 2) span = f;
        }
        if (rc < 0) return -1;
        if (i && PUT_LIT(b, ",")) return -1;
        if (links) {
            if (PUT_LIT(b, "{\"trace_id\":\"")) return -1;
            if (buf_reserve(b, 2 * trace.len + 2 * span.len + 16)) return -1;
            for (size_t k = 0; k < trace.len; k++) {
                b->buf[b->len++] = HEX[trace.data[k] >> 4];
                b->buf[b->len++] = HEX[trace.data[k] & 15];
            }
            if (PUT_LIT(b, "\",\"span_id\":\"")) return -1;
            if (buf_reserve(b, 2 * span.len)) return -1;
            for (size_t k = 0; k < span.len; k++) {
                b->buf[b->len++] = HEX[span.data[k] >> 4];
                b->buf[b->len++] = HEX[span.data[k] & 15];
            }
            if (PUT_LIT(b, "\",\"attributes\":")) return -1;
            if (kvlist_json(b, items[i], lens[i], 4, 0)) return -1;
        } else {
            char text[96];
            if (PUT_LIT(b, "{\"name\":") || json_string(b, name.data, name.len)) return -1;
            int n = snprintf(text, sizeof text, ",\"time_ns\":%llu,\"attributes\":", (unsigned long long)time_ns);
            if (buf_put(b, text, (size_t)n)) return -1;
            if (kvlist_json(b, items[i], lens[i], 3, 0)) return -1;
        }
        if (PUT_LIT(b, "}")) return -1;
    }
    return PUT_LIT(b, "]");
}

#define MAX_ITEMS 4096 /* events or links per span kept; more is a broken sender */
/* The counts written into a span's attributes when the sender or this cap dropped some
 * (otlp_columns.DROPPED_KEYS, in the same order). */
static const char *DROPPED_KEYS[3] = {
    "flare.dropped_attributes", "flare.dropped_events", "flare.dropped_links",
};

/* 0 ok, -1 Python error set, -2 malformed. */
static int decode_span(const uint8_t *p, size_t n, SpanBuilder *sb, int has_resource_rank,
                       long long resource_rank, Buf *b, const uint8_t **items, size_t *lens) {
    Reader r = {p, p + n};
    Field f, trace = {0}, span_id = {0}, parent = {0}, name = {0}, status = {0};
    uint64_t kind = 0, start = 0, end = 0;
    size_t n_events = 0, n_links = 0;
    const uint8_t **events = items, **links = items + MAX_ITEMS;
    size_t *event_lens = lens, *link_lens = lens + MAX_ITEMS;
    int rc, has_status = 0;
    int has_step = 0, has_rank = 0, step_ok = 0, rank_ok = 0;
    long long step = 0, rank = 0;
    uint32_t dropped[3] = {0, 0, 0}; /* attributes, events, links */
    uint64_t cut[3] = {0, 0, 0};
    static const char STEP_KEY[] = "flare.step";
    static const char RANK_KEY[] = "flare.rank";

    trace.data = span_id.data = parent.data = name.data = (const uint8_t *)"";
    b->len = 0;
    if (PUT_LIT(b, "{")) return -1;
    int first_attr = 1;
    while ((rc = next_field(&r, &f)) == 0) {
        switch (f.num) {
        /* A field of the wrong wire type is unknown to protobuf: skipped (see next_field). */
        case 1: if (f.wt == 2) trace = f; break;
        case 2: if (f.wt == 2) span_id = f; break;
        case 4: if (f.wt == 2) parent = f; break;
        case 5: if (f.wt == 2) name = f; break;
        case 6: if (f.wt == 0) kind = f.v; break;
        case 7: if (f.wt == 1) start = f.v; break;
        case 8: if (f.wt == 1) end = f.v; break;
        case 10: if (f.wt == 0) dropped[0] = (uint32_t)f.v; break;
        case 12: if (f.wt == 0) dropped[1] = (uint32_t)f.v; break;
        case 14: if (f.wt == 0) dropped[2] = (uint32_t)f.v; break;
        case 9: {
            Field key, value;
            int has_value;
            if (f.wt != 2) break;
            if (keyvalue_parts(f.data, f.len, &key, &value, &has_value)) return -2;
            if (!first_attr && PUT_LIT(b, ",")) return -1;
            first_attr = 0;
            if (json_string(b, key.data, key.len) || PUT_LIT(b, ":")) return -1;
            if (has_value) {
                if (anyvalue_json(b, value.data, value.len, 0)) return PyErr_Occurred() ? -1 : -2;
            } else if (PUT_LIT(b, "null")) {
                return -1;
            }
            if (key.len == sizeof STEP_KEY - 1 && !memcmp(key.data, STEP_KEY, key.len)) {
                has_step = 1;
                step_ok = has_value && anyvalue_as_int(value.data, value.len, &step);
            } else if (key.len == sizeof RANK_KEY - 1 && !memcmp(key.data, RANK_KEY, key.len)) {
                /* An empty value counts as absent: the resource's rank applies. */
                Field set;
                has_rank = has_value && anyvalue_field(value.data, value.len, &set) == 1;
                rank_ok = has_rank && anyvalue_as_int(value.data, value.len, &rank);
            }
            break;
        }
        case 11:
            if (f.wt != 2) break;
            if (n_events < MAX_ITEMS) { events[n_events] = f.data; event_lens[n_events++] = f.len; }
            else cut[1]++;
            break;
        case 13:
            if (f.wt != 2) break;
            if (n_links < MAX_ITEMS) { links[n_links] = f.data; link_lens[n_links++] = f.len; }
            else cut[2]++;
            break;
        case 15:
            if (f.wt != 2) break;
            if (has_status) return -2; /* merged by protobuf: the reference reads it */
            status = f;
            has_status = 1;
            break;
        default: break;
        }
    }
    if (rc < 0) return -2;
    /* What the sender dropped (the OTLP dropped_*_count fields) plus what is cut here. */
    for (int i = 0; i < 3; i++) {
        uint64_t total = (uint64_t)dropped[i] + cut[i];
        if (!total) continue;
        char text[64];
        int len = snprintf(text, sizeof text, "%s\"%s\":%llu", first_attr ? "" : ",",
                           DROPPED_KEYS[i], (unsigned long long)total);
        if (buf_put(b, text, (size_t)len)) return -1;
        first_attr = 0;
    }
    if (PUT_LIT(b, "}")) return -1;

    long long status_code = 0;
    Field status_message = {0};
    status_message.data = (const uint8_t *)"";
    if (has_status) {
        Reader sr = {status.data, status.data + status.len};
        Field sf;
        while ((rc = next_field(&sr, &sf)) == 0) {
            if (sf.num == 2 && sf.wt == 2) status_message = sf;
            else if (sf.num == 3 && sf.wt == 0) status_code = (long long)(int32_t)sf.v;
        }
        if (rc < 0) return -2;
    }

    StrCol *s = sb->str;
    if (str_put_hex(&s[S_TRACE_ID], trace.data, trace.len)) return -1;
    if (str_put_hex(&s[S_SPAN_ID], span_id.data, span_id.len)) return -1;
    if (str_put_hex(&s[S_PARENT], parent.data, parent.len)) return -1;
    if (str_put_text(&s[S_NAME], (const char *)name.data, name.len)) return -1;
    if (str_put_text(&s[S_STATUS_MESSAGE], (const char *)status_message.data, status_message.len)) return -1;
    /* `{}` is what an empty attribute map encodes to in both implementations. */
    if (str_put_text(&s[S_ATTRIBUTES], b->buf, b->len)) return -1;
    if (n_events) {
        b->len = 0;
        if (events_json(b, events, event_lens, n_events, 0)) return PyErr_Occurred() ? -1 : -2;
        if (str_put_text(&s[S_EVENTS], b->buf, b->len)) return -1;
    } else if (str_put(&s[S_EVENTS], "[]", 2)) {
        return -1;
    }
    if (n_links) {
        b->len = 0;
        if (events_json(b, links, link_lens, n_links, 1)) return PyErr_Occurred() ? -1 : -2;
        if (str_put_text(&s[S_LINKS], b->buf, b->len)) return -1;
    } else if (str_put(&s[S_LINKS], "[]", 2)) {
        return -1;
    }
    if (fixed_put(sb, F_KIND, 1, (int64_t)(int32_t)kind)) return -1;
    if (fixed_put(sb, F_STATUS_CODE, 1, status_code)) return -1;
    /* Nanoseconds past 2**63 (year 2262) wrap, as the int64 column can only hold them. */
    if (fixed_put(sb, F_START, 1, (int64_t)start)) return -1;
    if (fixed_put(sb, F_END, 1, (int64_t)end)) return -1;
    if (fixed_put(sb, F_DURATION, 1, (int64_t)(end - start))) return -1;
    if (fixed_put(sb, F_STEP, has_step && step_ok, step)) return -1;
    if (has_rank) {
        if (fixed_put(sb, F_RANK, rank_ok, rank)) return -1;
    } else if (fixed_put(sb, F_RANK, has_resource_rank, resource_rank)) {
        return -1;
    }
    sb->rows++;
    return 0;
}

/* The flare.rank of a resource's attributes, with _as_int semantics: 1 and *out set,
 * 0 for None (absent, or not an integer). The last one on the wire wins. */
static int resource_rank_of(const uint8_t *p, size_t n, long long *out) {
    Reader r = {p, p + n};
    Field f;
    int result = 0;
    while (next_field(&r, &f) == 0) {
        if (f.num != 1 || f.wt != 2) continue;
        Field key, value;
        int has_value;
        if (keyvalue_parts(f.data, f.len, &key, &value, &has_value)) break;
        if (key.len == 10 && !memcmp(key.data, "flare.rank", 10))
            result = has_value && anyvalue_as_int(value.data, value.len, out);
    }
    return result;
}

static PyObject *builder_decode(SpanBuilder *sb, PyObject *arg) {
    Py_buffer payload;
    if (PyObject_GetBuffer(arg, &payload, PyBUF_SIMPLE)) return NULL;
    Py_ssize_t before = sb->rows;
    PyObject *resources = PyList_New(0);
    const uint8_t **items = PyMem_Malloc(2 * MAX_ITEMS * sizeof *items);
    size_t *lens = PyMem_Malloc(2 * MAX_ITEMS * sizeof *lens);
    Buf b = {0};
    int malformed = 0;
    if (!resources || !items || !lens) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    Reader r = {payload.buf, (const uint8_t *)payload.buf + payload.len};
    Field rs;
    int rc;
    while ((rc = next_field(&r, &rs)) == 0) {
        if (rs.num != 1 || rs.wt != 2) continue;
        /* Resource first (it may come after the spans on the wire). */
        Reader rr = {rs.data, rs.data + rs.len};
        Field f, resource = {0};
        int resources_seen = 0;
        resource.data = (const uint8_t *)"";
        while ((rc = next_field(&rr, &f)) == 0)
            if (f.num == 1 && f.wt == 2) { resource = f; resources_seen++; }
        /* Two resources are merged by protobuf: the reference reads that. */
        if (rc < 0 || resources_seen > 1) { malformed = 1; goto fail; }
        PyObject *attrs = kvlist_py(resource.data, resource.len, 0, 1);
        if (!attrs) goto fail;
        long long rank = 0;
        int has_rank = resource_rank_of(resource.data, resource.len, &rank);
        Py_ssize_t count = 0;
        rr.p = rs.data;
        while ((rc = next_field(&rr, &f)) == 0) {
            if (f.num != 2 || f.wt != 2) continue;
            Reader sr = {f.data, f.data + f.len};
            Field sf;
            while ((rc = next_field(&sr, &sf)) == 0) {
                if (sf.num != 2 || sf.wt != 2) continue;
                int err = decode_span(sf.data, sf.len, sb, has_rank, rank, &b, items, lens);
                if (err) {
                    Py_DECREF(attrs);
                    malformed = err == -2;
                    goto fail;
                }
                count++;
            }
            if (rc < 0) break;
        }
        if (rc < 0) { Py_DECREF(attrs); malformed = 1; goto fail; }
        PyObject *entry = Py_BuildValue("(Nn)", attrs, count);
        if (!entry || PyList_Append(resources, entry)) { Py_XDECREF(entry); goto fail; }
        Py_DECREF(entry);
    }
    if (rc < 0) { malformed = 1; goto fail; }
    PyMem_Free(items);
    PyMem_Free(lens);
    PyMem_Free(b.buf);
    PyBuffer_Release(&payload);
    return resources;
fail:
    if (malformed && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "malformed OTLP ExportTraceServiceRequest");
    builder_truncate(sb, before);
    Py_XDECREF(resources);
    PyMem_Free(items);
    PyMem_Free(lens);
    PyMem_Free(b.buf);
    PyBuffer_Release(&payload);
    return NULL;
}

/* ------------------------------------------------------------------ Chunk
 * Memory handed to Arrow without a copy: a read-only buffer that owns it. */
typedef struct {
    PyObject_HEAD
    char *buf;
    Py_ssize_t len;
    size_t cap;
} Chunk;

static void chunk_dealloc(Chunk *c) {
    buf_release(c->buf, c->cap);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int chunk_getbuffer(Chunk *c, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)c, c->buf ? c->buf : (char *)"", c->len, 1, flags);
}

static PyBufferProcs chunk_as_buffer = {(getbufferproc)chunk_getbuffer, NULL};

static PyTypeObject ChunkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flare.instrumentation._otlp_wire.Chunk",
    .tp_basicsize = sizeof(Chunk),
    .tp_dealloc = (destructor)chunk_dealloc,
    .tp_as_buffer = &chunk_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Read-only memory of one column buffer (kept alive by whoever views it).",
};

/* The Buf's memory moves into a Chunk; the Buf is left empty. */
static PyObject *chunk_from(Buf *b) {
    Chunk *c = PyObject_New(Chunk, &ChunkType);
    if (!c) return NULL;
    c->buf = b->buf;
    c->len = (Py_ssize_t)b->len;
    c->cap = b->cap;
    b->buf = NULL;
    b->len = b->cap = 0;
    return (PyObject *)c;
}

/* ------------------------------------------------------------------ SpanBuilder */
static int builder_reset(SpanBuilder *sb) {
    sb->rows = 0;
    for (int i = 0; i < N_STRINGS; i++) {
        sb->str[i].data.len = 0;
        sb->str[i].offsets.len = 0;
        int32_t zero = 0;
        if (buf_put(&sb->str[i].offsets, (const char *)&zero, 4)) return -1;
    }
    for (int i = 0; i < N_FIXED; i++) sb->fixed[i].len = sb->valid[i].len = 0;
    return 0;
}

static PyObject *builder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "SpanBuilder() takes no arguments");
        return NULL;
    }
    SpanBuilder *sb = (SpanBuilder *)type->tp_alloc(type, 0);
    if (!sb) return NULL;
    if (builder_reset(sb)) {
        Py_DECREF(sb);
        return NULL;
    }
    return (PyObject *)sb;
}

static void builder_dealloc(SpanBuilder *sb) {
    for (int i = 0; i < N_STRINGS; i++) {
        buf_release(sb->str[i].data.buf, sb->str[i].data.cap);
        buf_release(sb->str[i].offsets.buf, sb->str[i].offsets.cap);
    }
    for (int i = 0; i < N_FIXED; i++) {
        buf_release(sb->fixed[i].buf, sb->fixed[i].cap);
        buf_release(sb->valid[i].buf, sb->valid[i].cap);
    }
    Py_TYPE(sb)->tp_free((PyObject *)sb);
}

static Py_ssize_t builder_len(SpanBuilder *sb) { return sb->rows; }

static PyObject *builder_nbytes(SpanBuilder *sb, PyObject *unused) {
    size_t most = 0;
    for (int i = 0; i < N_STRINGS; i++)
        if (sb->str[i].data.len > most) most = sb->str[i].data.len;
    return PyLong_FromSize_t(most);
}

/* {column: (validity or None, offsets or None, values)}; the builder is empty after. */
static PyObject *builder_take(SpanBuilder *sb, PyObject *unused) {
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (int i = 0; i < N_STRINGS; i++) {
        PyObject *entry = Py_BuildValue("(ONN)", Py_None, chunk_from(&sb->str[i].offsets),
                                        chunk_from(&sb->str[i].data));
        if (!entry || PyDict_SetItemString(out, STRING_NAMES[i], entry)) {
            Py_XDECREF(entry);
            goto fail;
        }
        Py_DECREF(entry);
    }
    for (int i = 0; i < N_FIXED; i++) {
        PyObject *valid = FIXED_NULLABLE[i] ? chunk_from(&sb->valid[i]) : Py_NewRef(Py_None);
        PyObject *entry = Py_BuildValue("(NON)", valid, Py_None, chunk_from(&sb->fixed[i]));
        if (!entry || PyDict_SetItemString(out, FIXED_NAMES[i], entry)) {
            Py_XDECREF(entry);
            goto fail;
        }
        Py_DECREF(entry);
    }
    if (builder_reset(sb)) goto fail;
    return out;
fail:
    Py_DECREF(out);
    builder_reset(sb);
    return NULL;
}

/* The JSON text of a double as the decoder writes it (tests compare it with repr). */
static PyObject *double_json(PyObject *self, PyObject *arg) {
    double d = PyFloat_AsDouble(arg);
    if (d == -1.0 && PyErr_Occurred()) return NULL;
    Buf b = {0};
    if (json_double(&b, d)) {
        PyMem_Free(b.buf);
        return NULL;
    }
    PyObject *s = PyUnicode_DecodeASCII(b.buf, (Py_ssize_t)b.len, "strict");
    PyMem_Free(b.buf);
    return s;
}

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

static PyObject *check_span_ids(PyObject *self, PyObject *arg) {
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

static PyObject *check_traces_strict(PyObject *self, PyObject *args) {
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

/* ------------------------------------------------------------------ selection */
typedef struct {
    const char *text;
    Py_ssize_t len;
    PyObject *obj; /* the str itself (borrowed from the caller's tuple): a matching key or
                      name is returned as this object rather than decoded again */
} Str;

#define MAX_STRS 64

static int strs_from_tuple(PyObject *tuple, Str *out, Py_ssize_t *count, const char *what) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > MAX_STRS) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of at most %d str", what, MAX_STRS);
        return -1;
    }
    *count = PyTuple_GET_SIZE(tuple);
    for (Py_ssize_t i = 0; i < *count; i++) {
        out[i].obj = PyTuple_GET_ITEM(tuple, i);
        out[i].text = PyUnicode_AsUTF8AndSize(out[i].obj, &out[i].len);
        if (!out[i].text) return -1;
    }
    return 0;
}

/* The entry of `set` equal to the UTF-8 bytes p[0:n], or NULL. */
static const Str *str_find(const Str *set, Py_ssize_t count, const uint8_t *p, size_t n) {
    for (Py_ssize_t i = 0; i < count; i++)
        if ((size_t)set[i].len == n && memcmp(set[i].text, p, n) == 0) return &set[i];
    return NULL;
}

static int str_in(const Str *set, Py_ssize_t count, const uint8_t *p, size_t n) {
    return str_find(set, count, p, n) != NULL;
}

/* {key: value} of the wanted keys among the KeyValues in field `field_num` (last wins). */
static PyObject *pick(const uint8_t *p, size_t n, uint32_t field_num, const Str *keys,
                      Py_ssize_t n_keys) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    PyObject *dict = PyDict_New();
    if (!dict) return NULL;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != field_num || f.wt != 2) continue;
        Field key, value;
        int has_value;
        if (keyvalue_parts(f.data, f.len, &key, &value, &has_value)) {
            rc = -1;
            break;
        }
        const Str *wanted = str_find(keys, n_keys, key.data, key.len);
        if (!wanted) continue;
        PyObject *k = Py_NewRef(wanted->obj);
        PyObject *v = k ? (has_value ? anyvalue_py(value.data, value.len, 0, 0) : Py_NewRef(Py_None)) : NULL;
        if (!v || PyDict_SetItem(dict, k, v)) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    if (rc < 0) {
        Py_DECREF(dict);
        PyErr_SetString(PyExc_ValueError, "malformed OTLP attributes");
        return NULL;
    }
    return dict;
}

/* The compact form of a train.step span (see step_record below): its name and the six
 * keys it is read by, in this order. */
enum { SK_NAME, SK_RANK, SK_STEP, SK_WAIT, SK_NAMES, SK_WAITS, SK_SEQS, SK_COUNT };

typedef struct {
    Str exact[MAX_STRS], excluded[MAX_STRS], span_keys[MAX_STRS], resource_keys[MAX_STRS];
    Py_ssize_t n_exact, n_excluded, n_span_keys, n_resource_keys;
    const char *prefix, *skip_scope;
    Py_ssize_t prefix_len, skip_scope_len;
    int compact;         /* step spans in the compact form when they qualify */
    Str step[SK_COUNT];  /* the step span's name and keys, when compact */
} Selection;

static int wanted_name(const Selection *sel, const uint8_t *p, size_t n) {
    if (str_in(sel->exact, sel->n_exact, p, n)) return 1;
    return n >= (size_t)sel->prefix_len && memcmp(p, sel->prefix, (size_t)sel->prefix_len) == 0 &&
           !str_in(sel->excluded, sel->n_excluded, p, n);
}

/* ------------------------------------------------------------------ compact steps
 * A train.step span is read for six keys only, once per rank per step. When each of
 * them is absent or of the type Flare's instrumentation sends (rank, step: int; wait:
 * double; the per-PG arrays: strings, doubles, ints, the latter two as long as the
 * names), the span is returned as
 *     (name, trace_id, span_id, start, end, rank, step, wait, names, waits, seqs)
 * with None for an absent scalar and ((), (), ()) without PG names: the values the
 * correlator would derive from the attribute dict, without building it (span_select.
 * compact_step is the reference). Anything else (another type, a value without a
 * type, a length mismatch, any other wanted key, anything malformed) returns 0 and
 * the span takes the dict form, which decides on errors as before. */

/* Items of an ArrayValue AnyValue slice that all carry AnyValue field `want_num`
 * (1 string, 3 int, 4 double) as their set value; -1 otherwise. Fills `items`
 * (up to `cap`) with the values' fields. */
static Py_ssize_t typed_array(const uint8_t *p, size_t n, uint32_t want_num, Field *items, Py_ssize_t cap) {
    Field f;
    if (anyvalue_field(p, n, &f) != 1 || f.num != 5) return -1;
    Reader r = {f.data, f.data + f.len};
    Field item;
    int rc;
    Py_ssize_t count = 0;
    while ((rc = next_field(&r, &item)) == 0) {
        if (item.num != 1) continue;
        if (item.wt != 2 || count >= cap) return -1;
        Field v;
        if (anyvalue_field(item.data, item.len, &v) != 1 || v.num != want_num) return -1;
        items[count++] = v;
    }
    return rc < 0 ? -1 : count;
}

#define MAX_PGS 64

/* 1: the compact record is in *out; 0: the span does not qualify; -1: error set. */
static int step_record(const Selection *sel, const uint8_t *p, size_t n, PyObject **out) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    Field last[SK_COUNT];
    int have[SK_COUNT] = {0};
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 9 || f.wt != 2) continue;
        Field key, value;
        int has_value;
        if (keyvalue_parts(f.data, f.len, &key, &value, &has_value)) return 0;
        const Str *k = str_find(sel->step + 1, SK_COUNT - 1, key.data, key.len);
        if (!k) {
            if (str_in(sel->span_keys, sel->n_span_keys, key.data, key.len)) return 0;
            continue;
        }
        int slot = (int)(k - sel->step);
        last[slot] = value;
        have[slot] = has_value ? 1 : -1; /* the last one counts, as in the dict */
    }
    if (rc < 0) return 0;
    for (int slot = SK_RANK; slot < SK_COUNT; slot++)
        if (have[slot] < 0) return 0;
    static const uint32_t scalar_num[SK_COUNT] = {0, 3, 3, 4};
    uint64_t scalar[SK_COUNT] = {0};
    for (int slot = SK_RANK; slot <= SK_WAIT; slot++) {
        if (!have[slot]) continue;
        Field v;
        if (anyvalue_field(last[slot].data, last[slot].len, &v) != 1 || v.num != scalar_num[slot]) return 0;
        scalar[slot] = v.v;
    }
    Field names[MAX_PGS], waits[MAX_PGS], seqs[MAX_PGS];
    Py_ssize_t n_names = 0, n_waits = 0, n_seqs = 0;
    if (have[SK_NAMES] && (n_names = typed_array(last[SK_NAMES].data, last[SK_NAMES].len, 1, names, MAX_PGS)) < 0)
        return 0;
    if (have[SK_WAITS] && (n_waits = typed_array(last[SK_WAITS].data, last[SK_WAITS].len, 4, waits, MAX_PGS)) < 0)
        return 0;
    if (have[SK_SEQS] && (n_seqs = typed_array(last[SK_SEQS].data, last[SK_SEQS].len, 3, seqs, MAX_PGS)) < 0)
        return 0;
    if (n_names && (n_waits != n_names || n_seqs != n_names)) return 0;
    PyObject *t_names = PyTuple_New(n_names), *t_waits = PyTuple_New(n_names), *t_seqs = PyTuple_New(n_names);
    PyObject *rank = NULL, *step = NULL, *wait = NULL;
    if (!t_names || !t_waits || !t_seqs) goto fail;
    for (Py_ssize_t i = 0; i < n_names; i++) {
        PyObject *name = PyUnicode_DecodeUTF8((const char *)names[i].data, (Py_ssize_t)names[i].len, "replace");
        if (!name) goto fail;
        PyTuple_SET_ITEM(t_names, i, name);
        double d;
        memcpy(&d, &waits[i].v, 8);
        PyObject *w = PyFloat_FromDouble(d);
        if (!w) goto fail;
        PyTuple_SET_ITEM(t_waits, i, w);
        PyObject *q = PyLong_FromLongLong((long long)(int64_t)seqs[i].v);
        if (!q) goto fail;
        PyTuple_SET_ITEM(t_seqs, i, q);
    }
    rank = have[SK_RANK] ? PyLong_FromLongLong((long long)(int64_t)scalar[SK_RANK]) : Py_NewRef(Py_None);
    step = have[SK_STEP] ? PyLong_FromLongLong((long long)(int64_t)scalar[SK_STEP]) : Py_NewRef(Py_None);
    if (have[SK_WAIT]) {
        double d;
        memcpy(&d, &scalar[SK_WAIT], 8);
        wait = PyFloat_FromDouble(d);
    } else {
        wait = Py_NewRef(Py_None);
    }
    if (!rank || !step || !wait) goto fail;
    PyObject *record = PyTuple_New(11);
    if (!record) goto fail;
    PyTuple_SET_ITEM(record, 5, rank);
    PyTuple_SET_ITEM(record, 6, step);
    PyTuple_SET_ITEM(record, 7, wait);
    PyTuple_SET_ITEM(record, 8, t_names);
    PyTuple_SET_ITEM(record, 9, t_waits);
    PyTuple_SET_ITEM(record, 10, t_seqs);
    *out = record;
    return 1;
fail:
    Py_XDECREF(t_names);
    Py_XDECREF(t_waits);
    Py_XDECREF(t_seqs);
    Py_XDECREF(rank);
    Py_XDECREF(step);
    Py_XDECREF(wait);
    return -1;
}

/* Append (name, trace_id, span_id, start, end, attrs) when the span is wanted. 0 ok, -1 error */
static int select_span(const Selection *sel, const uint8_t *p, size_t n, PyObject *out) {
    Reader r = {p, p + n};
    Field f, trace = {0}, span_id = {0}, name = {0};
    uint64_t start = 0, end = 0;
    int rc;
    trace.data = span_id.data = name.data = (const uint8_t *)"";
    while ((rc = next_field(&r, &f)) == 0) {
        switch (f.num) {
        /* A field of the wrong wire type is unknown to protobuf: skipped (see next_field). */
        case 1: if (f.wt == 2) trace = f; break;
        case 2: if (f.wt == 2) span_id = f; break;
        case 5: if (f.wt == 2) name = f; break;
        case 7: if (f.wt == 1) start = f.v; break;
        case 8: if (f.wt == 1) end = f.v; break;
        default: break;
        }
    }
    if (rc < 0) {
        PyErr_SetString(PyExc_ValueError, "malformed OTLP span");
        return -1;
    }
    const Str *exact = str_find(sel->exact, sel->n_exact, name.data, name.len);
    if (!exact && !wanted_name(sel, name.data, name.len)) return 0;
    PyObject *record = NULL;
    int compact = 0;
    if (sel->compact && name.len == (size_t)sel->step[SK_NAME].len &&
        memcmp(name.data, sel->step[SK_NAME].text, name.len) == 0) {
        compact = step_record(sel, p, n, &record);
        if (compact < 0) return -1;
    }
    if (!compact) {
        PyObject *attrs = pick(p, n, 9, sel->span_keys, sel->n_span_keys);
        if (!attrs) return -1;
        record = PyTuple_New(6);
        if (!record) {
            Py_DECREF(attrs);
            return -1;
        }
        PyTuple_SET_ITEM(record, 5, attrs);
    }
    PyObject *items[5] = {
        exact ? Py_NewRef(exact->obj)
              : PyUnicode_DecodeUTF8((const char *)name.data, (Py_ssize_t)name.len, "replace"),
        PyBytes_FromStringAndSize((const char *)trace.data, (Py_ssize_t)trace.len),
        PyBytes_FromStringAndSize((const char *)span_id.data, (Py_ssize_t)span_id.len),
        PyLong_FromUnsignedLongLong((unsigned long long)start),
        PyLong_FromUnsignedLongLong((unsigned long long)end),
    };
    int failed = 0;
    for (int i = 0; i < 5; i++) {
        if (!items[i]) failed = 1;
        else PyTuple_SET_ITEM(record, i, items[i]);
    }
    if (failed) { /* the slots left NULL are skipped by the tuple's dealloc */
        Py_DECREF(record);
        return -1;
    }
    int err = PyList_Append(out, record);
    Py_DECREF(record);
    return err;
}

/* 1 when a ScopeSpans' scope is named skip_scope, 0 when not, -1 malformed. A scope
 * given twice is merged by protobuf: the last name on the wire counts. */
static int scope_is_skipped(const Selection *sel, const uint8_t *p, size_t n) {
    Reader r = {p, p + n};
    Field f, name = {0};
    int rc;
    name.data = (const uint8_t *)"";
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 1 || f.wt != 2) continue;
        Reader sr = {f.data, f.data + f.len};
        Field sf;
        while ((rc = next_field(&sr, &sf)) == 0)
            if (sf.num == 1 && sf.wt == 2) name = sf;
        if (rc < 0) return -1;
    }
    if (rc < 0) return -1;
    return name.len == (size_t)sel->skip_scope_len && memcmp(name.data, sel->skip_scope, name.len) == 0;
}

static int select_resource(const Selection *sel, const uint8_t *p, size_t n, PyObject *result) {
    Reader r = {p, p + n};
    Field f, resource = {0};
    int rc, resources_seen = 0;
    resource.data = (const uint8_t *)"";
    while ((rc = next_field(&r, &f)) == 0)
        if (f.num == 1 && f.wt == 2) {
            resource = f;
            resources_seen++;
        }
    /* Two resources are merged by protobuf: the reference reads that. */
    if (rc < 0 || resources_seen > 1) goto malformed;
    PyObject *spans = PyList_New(0);
    if (!spans) return -1;
    r.p = p;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 2 || f.wt != 2) continue;
        int skip = scope_is_skipped(sel, f.data, f.len);
        if (skip < 0) {
            rc = -1;
            break;
        }
        if (skip) continue;
        Reader sr = {f.data, f.data + f.len};
        Field sf;
        while ((rc = next_field(&sr, &sf)) == 0) {
            if (sf.num != 2 || sf.wt != 2) continue;
            if (select_span(sel, sf.data, sf.len, spans)) {
                Py_DECREF(spans);
                return -1;
            }
        }
        if (rc < 0) break;
    }
    if (rc < 0) {
        Py_DECREF(spans);
        goto malformed;
    }
    PyObject *attrs = pick(resource.data, resource.len, 1, sel->resource_keys, sel->n_resource_keys);
    if (!attrs) {
        Py_DECREF(spans);
        return -1;
    }
    PyObject *entry = Py_BuildValue("(NN)", attrs, spans);
    if (!entry) return -1;
    int err = PyList_Append(result, entry);
    Py_DECREF(entry);
    return err;
malformed:
    PyErr_SetString(PyExc_ValueError, "malformed OTLP ResourceSpans");
    return -1;
}

static PyObject *select_spans(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer payload;
    PyObject *exact, *excluded, *span_keys, *resource_keys, *prefix, *skip_scope, *step = NULL;
    Selection sel;
    if (!PyArg_ParseTuple(args, "y*O!UO!UO!O!|O!", &payload, &PyTuple_Type, &exact, &prefix,
                          &PyTuple_Type, &excluded, &skip_scope, &PyTuple_Type, &span_keys,
                          &PyTuple_Type, &resource_keys, &PyTuple_Type, &step))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_step = 0;
    sel.compact = step != NULL;
    if (sel.compact) {
        if (PyTuple_GET_SIZE(step) != SK_COUNT) {
            PyErr_Format(PyExc_TypeError, "step must be a tuple of %d str", SK_COUNT);
            goto done;
        }
        if (strs_from_tuple(step, sel.step, &n_step, "step")) goto done;
    }
    if (strs_from_tuple(exact, sel.exact, &sel.n_exact, "names") ||
        strs_from_tuple(excluded, sel.excluded, &sel.n_excluded, "excluded") ||
        strs_from_tuple(span_keys, sel.span_keys, &sel.n_span_keys, "span_keys") ||
        strs_from_tuple(resource_keys, sel.resource_keys, &sel.n_resource_keys, "resource_keys") ||
        !(sel.prefix = PyUnicode_AsUTF8AndSize(prefix, &sel.prefix_len)) ||
        !(sel.skip_scope = PyUnicode_AsUTF8AndSize(skip_scope, &sel.skip_scope_len)))
        goto done;
    result = PyList_New(0);
    if (!result) goto done;
    Reader r = {payload.buf, (const uint8_t *)payload.buf + payload.len};
    Field f;
    int rc;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 1 || f.wt != 2) continue;
        if (select_resource(&sel, f.data, f.len, result)) {
            rc = -1;
            break;
        }
    }
    if (rc < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "malformed OTLP ExportTraceServiceRequest");
        Py_CLEAR(result);
    }
done:
    PyBuffer_Release(&payload);
    return result;
}

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

static PyObject *rank_links(PyObject *self, PyObject *args) {
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


/* ------------------------------------------------------------------ attributes
 * `attributes(mapping, tag)` returns the bytes `otlp_encoding._py_attributes` returns:
 * for every (key, value) item, in iteration order, `tag` + length + KeyValue{key = 1,
 * value = 2: AnyValue}. Value kinds, by exact type as the Python writer checks them:
 * float (double_value), bool (bool_value), int within int64 (int_value), str
 * (string_value), bytes (bytes_value), None (an empty AnyValue), list and tuple
 * (array_value of the same, nested). Anything else raises the exception class given
 * to `init()` (the Python writer's `Unsupported`: the caller then takes protobuf's
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
        PyErr_SetString(PyExc_RuntimeError, "_otlp_wire.init() was not called");
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
    {"check_span_ids", check_span_ids, METH_O,
     "check_span_ids(payload) -> (spans, spans with unusable ids) of a serialized "
     "ExportTraceServiceRequest; ValueError if it is not one."},
    {"check_traces_strict", check_traces_strict, METH_VARARGS,
     "check_traces_strict(payload, schema, span_type) -> (spans, spans with unusable ids) when "
     "protobuf would certainly parse `payload` as the message `schema` describes (spans are "
     "the messages of type `span_type`); None when not sure."},
    {"double_json", double_json, METH_O, "double_json(x) -> the JSON text the decoder writes for float x."},
    {"select_spans", select_spans, METH_VARARGS,
     "select_spans(payload, names, prefix, excluded, skip_scope, span_keys, resource_keys[, step])\n"
     "-> [(resource_attrs, [(name, trace_id, span_id, start_ns, end_ns, attrs), ...]), ...]\n"
     "With step = (name, rank, step, wait, pg names, pg waits, pg seqs keys), such spans\n"
     "come as (name, trace_id, span_id, start_ns, end_ns, rank, step, wait, names, waits,\n"
     "seqs) where their values allow (span_select.compact_step)."},
    {"rank_links", rank_links, METH_VARARGS,
     "rank_links(ranks, rank_key) -> bytes: a Span's `links` field with one Link per rank "
     "of `ranks` ({rank: entry with trace_id and span_id bytes}), in rank order, each "
     "carrying the attribute rank_key = rank."},
    {"attributes", attributes, METH_VARARGS,
     "attributes(mapping, tag) -> bytes: the repeated KeyValue fields of `mapping`."},
    {"init", init, METH_O, "init(exception_class): what unsupported attribute values raise."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef builder_methods[] = {
    {"decode", (PyCFunction)builder_decode, METH_O,
     "decode(payload) -> [(resource_attributes, span_count), ...]\n\n"
     "Append every span of a serialized ExportTraceServiceRequest. Raises ValueError for "
     "bytes that are not one; nothing is appended then."},
    {"take", (PyCFunction)builder_take, METH_NOARGS,
     "take() -> {column: (validity, offsets, values)}: the Arrow buffers of the spans so "
     "far (validity None where the column has no NULLs, offsets None for fixed-width "
     "columns); the builder starts empty again."},
    {"nbytes", (PyCFunction)builder_nbytes, METH_NOARGS,
     "nbytes() -> bytes of the largest text column (its int32 offsets end at 2 GiB)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods builder_as_sequence = {.sq_length = (lenfunc)builder_len};

static PyTypeObject SpanBuilderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flare.instrumentation._otlp_wire.SpanBuilder",
    .tp_basicsize = sizeof(SpanBuilder),
    .tp_dealloc = (destructor)builder_dealloc,
    .tp_as_sequence = &builder_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Spans of serialized OTLP requests as Arrow buffers of the store's span columns "
              "(all but the per-resource job, service, host, pid and resource).",
    .tp_methods = builder_methods,
    .tp_new = builder_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_otlp_wire", .m_doc = "The OTLP wire format read and written in C.",
    .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__otlp_wire(void) {
    if (PyType_Ready(&ChunkType) < 0 || PyType_Ready(&SpanBuilderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "SpanBuilder", (PyObject *)&SpanBuilderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
