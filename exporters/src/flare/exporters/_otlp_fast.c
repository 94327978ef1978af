/* Serialized OTLP ExportTraceServiceRequest -> the store's span columns, in C.
 *
 * Why this exists: through the protobuf Python API every field access allocates a
 * wrapper object, so turning a span's ~10 attributes into JSON text costs ~10 us in
 * Python, ten times the parse itself. Reading the wire format directly and writing
 * the JSON text in one pass keeps ingest near the parse-only ceiling.
 *
 * Output must match the pure-Python reference (otlp_columns.SpanColumns.add_request)
 * value for value; tests/exporters/test_otlp_fast.py checks that on realistic and
 * hostile input. Malformed input raises ValueError; nothing is appended for a request
 * that fails (the caller truncates the columns back).
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

/* 0 = read a field, 1 = end of message, -1 = malformed */
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
    default:
        return -1; /* groups are not used by OTLP */
    }
}

/* ------------------------------------------------------------------ output buffer */
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

static int buf_put(Buf *b, const char *s, size_t n) {
    if (buf_reserve(b, n)) return -1;
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, s) buf_put((b), (s), sizeof(s) - 1)

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

static int json_double(Buf *b, double d) {
    if (isnan(d)) return PUT_LIT(b, "null");
    if (isinf(d)) return d > 0 ? PUT_LIT(b, "\"Infinity\"") : PUT_LIT(b, "\"-Infinity\"");
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
#define MAX_DEPTH 32

/* The field of the AnyValue oneof that is set (the last one on the wire wins). */
static int anyvalue_field(const uint8_t *p, size_t n, Field *out) {
    Reader r = {p, p + n};
    Field f;
    int rc, have = 0;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num >= 1 && f.num <= 7) {
            int want = (f.num == 2 || f.num == 3) ? 0 : (f.num == 4 ? 1 : 2);
            if (f.wt != want) return -1;
            *out = f;
            have = 1;
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
            if (item.num != 1) continue;
            if (item.wt != 2) return -1;
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

/* One KeyValue: key and value slices. */
static int keyvalue_parts(const uint8_t *p, size_t n, Field *key, Field *value, int *has_value) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    key->data = (const uint8_t *)"";
    key->len = 0;
    *has_value = 0;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num == 1) {
            if (f.wt != 2) return -1;
            *key = f;
        } else if (f.num == 2) {
            if (f.wt != 2) return -1;
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
        if (f.num != field_num) continue;
        if (f.wt != 2) return -1;
        if (!first && PUT_LIT(b, ",")) return -1;
        first = 0;
        if (keyvalue_json(b, f.data, f.len, depth)) return -1;
    }
    if (rc < 0) return -1;
    return PUT_LIT(b, "}");
}

/* AnyValue -> Python object, as otlp_columns.any_value does (resource attributes). */
static PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth);

static PyObject *kvlist_py(const uint8_t *p, size_t n, uint32_t field_num, int depth) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    if (depth > MAX_DEPTH) return NULL;
    PyObject *dict = PyDict_New();
    if (!dict) return NULL;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != field_num) continue;
        Field key, value;
        int has_value;
        if (f.wt != 2 || keyvalue_parts(f.data, f.len, &key, &value, &has_value)) goto bad;
        PyObject *k = PyUnicode_DecodeUTF8((const char *)key.data, (Py_ssize_t)key.len, "replace");
        if (!k) goto fail;
        PyObject *v = has_value ? anyvalue_py(value.data, value.len, depth + 1) : Py_NewRef(Py_None);
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
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "malformed OTLP attributes");
fail:
    Py_DECREF(dict);
    return NULL;
}

static PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth) {
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
        Reader r = {f.data, f.data + f.len};
        Field item;
        int rc;
        PyObject *list = PyList_New(0);
        if (!list) return NULL;
        while ((rc = next_field(&r, &item)) == 0) {
            if (item.num != 1) continue;
            if (item.wt != 2) {
                rc = -1;
                break;
            }
            PyObject *v = anyvalue_py(item.data, item.len, depth + 1);
            if (!v || PyList_Append(list, v)) {
                Py_XDECREF(v);
                Py_DECREF(list);
                return NULL;
            }
            Py_DECREF(v);
        }
        if (rc < 0) {
            Py_DECREF(list);
            PyErr_SetString(PyExc_ValueError, "malformed OTLP ArrayValue");
            return NULL;
        }
        return list;
    }
    case 6: return kvlist_py(f.data, f.len, 1, depth + 1);
    case 7: {
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

/* ------------------------------------------------------------------ spans */
enum {
    C_TRACE_ID, C_SPAN_ID, C_PARENT, C_NAME, C_KIND, C_START, C_END, C_DURATION,
    C_STATUS_CODE, C_STATUS_MESSAGE, C_STEP, C_RANK, C_ATTRIBUTES, C_EVENTS, C_LINKS,
    N_COLUMNS
};

static PyObject *hex_str(const uint8_t *p, size_t n) {
    char stack[64];
    char *text = n * 2 <= sizeof stack ? stack : PyMem_Malloc(n * 2 + 1);
    if (!text) return PyErr_NoMemory();
    for (size_t i = 0; i < n; i++) {
        text[2 * i] = HEX[p[i] >> 4];
        text[2 * i + 1] = HEX[p[i] & 15];
    }
    PyObject *s = PyUnicode_DecodeASCII(text, (Py_ssize_t)(2 * n), "strict");
    if (text != stack) PyMem_Free(text);
    return s;
}

static int append_new(PyObject *list, PyObject *value) {
    if (!value) return -1;
    int rc = PyList_Append(list, value);
    Py_DECREF(value);
    return rc;
}

static PyObject *buf_str(Buf *b) {
    return PyUnicode_DecodeUTF8(b->buf, (Py_ssize_t)b->len, "replace");
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

static int decode_span(const uint8_t *p, size_t n, PyObject **cols, PyObject *resource_rank,
                       Buf *b, const uint8_t **items, size_t *lens) {
    Reader r = {p, p + n};
    Field f, trace = {0}, span_id = {0}, parent = {0}, name = {0}, status = {0};
    uint64_t kind = 0, start = 0, end = 0;
    size_t n_events = 0, n_links = 0;
    const uint8_t **events = items, **links = items + MAX_ITEMS;
    size_t *event_lens = lens, *link_lens = lens + MAX_ITEMS;
    int rc, has_status = 0;
    int has_step = 0, has_rank = 0, step_ok = 0, rank_ok = 0;
    long long step = 0, rank = 0;
    static const char STEP_KEY[] = "flare.step";
    static const char RANK_KEY[] = "flare.rank";

    trace.data = span_id.data = parent.data = name.data = (const uint8_t *)"";
    b->len = 0;
    if (PUT_LIT(b, "{")) return -1;
    int first_attr = 1;
    while ((rc = next_field(&r, &f)) == 0) {
        switch (f.num) {
        case 1: if (f.wt != 2) return -2; trace = f; break;
        case 2: if (f.wt != 2) return -2; span_id = f; break;
        case 4: if (f.wt != 2) return -2; parent = f; break;
        case 5: if (f.wt != 2) return -2; name = f; break;
        case 6: if (f.wt != 0) return -2; kind = f.v; break;
        case 7: if (f.wt != 1) return -2; start = f.v; break;
        case 8: if (f.wt != 1) return -2; end = f.v; break;
        case 9: {
            Field key, value;
            int has_value;
            if (f.wt != 2 || keyvalue_parts(f.data, f.len, &key, &value, &has_value)) return -2;
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
            if (f.wt != 2) return -2;
            if (n_events < MAX_ITEMS) { events[n_events] = f.data; event_lens[n_events++] = f.len; }
            break;
        case 13:
            if (f.wt != 2) return -2;
            if (n_links < MAX_ITEMS) { links[n_links] = f.data; link_lens[n_links++] = f.len; }
            break;
        case 15: if (f.wt != 2) return -2; status = f; has_status = 1; break;
        default: break;
        }
    }
    if (rc < 0) return -2;
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

    if (append_new(cols[C_TRACE_ID], hex_str(trace.data, trace.len))) return -1;
    if (append_new(cols[C_SPAN_ID], hex_str(span_id.data, span_id.len))) return -1;
    if (append_new(cols[C_PARENT], hex_str(parent.data, parent.len))) return -1;
    if (append_new(cols[C_NAME], PyUnicode_DecodeUTF8((const char *)name.data, (Py_ssize_t)name.len, "replace"))) return -1;
    if (append_new(cols[C_KIND], PyLong_FromLongLong((long long)(int32_t)kind))) return -1;
    if (append_new(cols[C_START], PyLong_FromUnsignedLongLong(start))) return -1;
    if (append_new(cols[C_END], PyLong_FromUnsignedLongLong(end))) return -1;
    if (append_new(cols[C_DURATION], PyLong_FromLongLong((long long)(end - start)))) return -1;
    if (append_new(cols[C_STATUS_CODE], PyLong_FromLongLong(status_code))) return -1;
    if (append_new(cols[C_STATUS_MESSAGE], PyUnicode_DecodeUTF8((const char *)status_message.data, (Py_ssize_t)status_message.len, "replace"))) return -1;
    if (append_new(cols[C_STEP], has_step && step_ok ? PyLong_FromLongLong(step) : Py_NewRef(Py_None))) return -1;
    PyObject *rank_value = has_rank ? (rank_ok ? PyLong_FromLongLong(rank) : Py_NewRef(Py_None))
                                    : Py_NewRef(resource_rank);
    if (append_new(cols[C_RANK], rank_value)) return -1;
    /* `{}` is what an empty attribute map encodes to in both implementations. */
    if (append_new(cols[C_ATTRIBUTES], buf_str(b))) return -1;
    if (n_events) {
        b->len = 0;
        if (events_json(b, events, event_lens, n_events, 0)) return PyErr_Occurred() ? -1 : -2;
        if (append_new(cols[C_EVENTS], buf_str(b))) return -1;
    } else if (append_new(cols[C_EVENTS], PyUnicode_FromString("[]"))) {
        return -1;
    }
    if (n_links) {
        b->len = 0;
        if (events_json(b, links, link_lens, n_links, 1)) return PyErr_Occurred() ? -1 : -2;
        if (append_new(cols[C_LINKS], buf_str(b))) return -1;
    } else if (append_new(cols[C_LINKS], PyUnicode_FromString("[]"))) {
        return -1;
    }
    return 0;
}

/* The flare.rank of a resource's attribute dict, with _as_int semantics. */
static PyObject *resource_rank_of(const uint8_t *p, size_t n) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    PyObject *result = Py_NewRef(Py_None);
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 1 || f.wt != 2) continue;
        Field key, value;
        int has_value;
        if (keyvalue_parts(f.data, f.len, &key, &value, &has_value)) break;
        if (key.len == 10 && !memcmp(key.data, "flare.rank", 10)) {
            long long rank;
            Py_DECREF(result);
            result = has_value && anyvalue_as_int(value.data, value.len, &rank)
                         ? PyLong_FromLongLong(rank) : Py_NewRef(Py_None);
            if (!result) return NULL;
        }
    }
    return result;
}

static void truncate_columns(PyObject **cols, Py_ssize_t size) {
    for (int i = 0; i < N_COLUMNS; i++)
        if (PyList_GET_SIZE(cols[i]) > size) PyList_SetSlice(cols[i], size, PyList_GET_SIZE(cols[i]), NULL);
}

static PyObject *decode_traces(PyObject *self, PyObject *args) {
    Py_buffer payload;
    PyObject *columns;
    if (!PyArg_ParseTuple(args, "y*O!", &payload, &PyTuple_Type, &columns)) return NULL;
    PyObject *cols[N_COLUMNS];
    if (PyTuple_GET_SIZE(columns) != N_COLUMNS) {
        PyBuffer_Release(&payload);
        return PyErr_Format(PyExc_TypeError, "expected %d column lists", N_COLUMNS);
    }
    for (int i = 0; i < N_COLUMNS; i++) {
        cols[i] = PyTuple_GET_ITEM(columns, i);
        if (!PyList_Check(cols[i])) {
            PyBuffer_Release(&payload);
            return PyErr_Format(PyExc_TypeError, "column %d is not a list", i);
        }
    }
    Py_ssize_t before = PyList_GET_SIZE(cols[0]);
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
        if (rs.num != 1) continue;
        if (rs.wt != 2) { malformed = 1; goto fail; }
        /* Resource first (it may come after the spans on the wire). */
        Reader rr = {rs.data, rs.data + rs.len};
        Field f, resource = {0};
        resource.data = (const uint8_t *)"";
        while ((rc = next_field(&rr, &f)) == 0)
            if (f.num == 1 && f.wt == 2) resource = f;
        if (rc < 0) { malformed = 1; goto fail; }
        PyObject *attrs = kvlist_py(resource.data, resource.len, 1, 0);
        if (!attrs) goto fail;
        PyObject *rank = resource_rank_of(resource.data, resource.len);
        if (!rank) { Py_DECREF(attrs); goto fail; }
        Py_ssize_t count = 0;
        rr.p = rs.data;
        while ((rc = next_field(&rr, &f)) == 0) {
            if (f.num != 2 || f.wt != 2) continue;
            Reader sr = {f.data, f.data + f.len};
            Field sf;
            while ((rc = next_field(&sr, &sf)) == 0) {
                if (sf.num != 2) continue;
                if (sf.wt != 2) { rc = -1; break; }
                int err = decode_span(sf.data, sf.len, cols, rank, &b, items, lens);
                if (err) {
                    Py_DECREF(attrs);
                    Py_DECREF(rank);
                    malformed = err == -2;
                    goto fail;
                }
                count++;
            }
            if (rc < 0) break;
        }
        Py_DECREF(rank);
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
    truncate_columns(cols, before);
    Py_XDECREF(resources);
    PyMem_Free(items);
    PyMem_Free(lens);
    PyMem_Free(b.buf);
    PyBuffer_Release(&payload);
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode_traces", decode_traces, METH_VARARGS,
     "decode_traces(payload, columns) -> [(resource_attributes, span_count), ...]\n\n"
     "Append every span of a serialized ExportTraceServiceRequest to the 15 column lists "
     "(trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, duration_ns, "
     "status_code, status_message, step, rank, attributes, events, links)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_otlp_fast", "OTLP wire format to Flare store columns.", -1, methods,
};

PyMODINIT_FUNC PyInit__otlp_fast(void) { return PyModule_Create(&module); }
