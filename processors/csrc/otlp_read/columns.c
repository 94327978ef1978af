#include "otlp_read.h"

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

PyTypeObject ChunkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flare.processors._otlp_read.Chunk",
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
PyObject *double_json(PyObject *self, PyObject *arg) {
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

PyTypeObject SpanBuilderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flare.processors._otlp_read.SpanBuilder",
    .tp_basicsize = sizeof(SpanBuilder),
    .tp_dealloc = (destructor)builder_dealloc,
    .tp_as_sequence = &builder_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Spans of serialized OTLP requests as Arrow buffers of the store's span columns "
              "(all but the per-resource job, service, host, pid and resource).",
    .tp_methods = builder_methods,
    .tp_new = builder_new,
};
