#include "otlp_read.h"

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

PyObject *select_spans(PyObject *self, PyObject *args) {
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
