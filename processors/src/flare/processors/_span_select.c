/* The few spans and attributes the rank correlator reads, straight from OTLP bytes.
 *
 * Why this exists: the correlator sees every span the collector receives, and through
 * the protobuf Python API each attribute access allocates wrapper objects (~15 us per
 * collective span). Scanning the wire format and materialising only the wanted spans
 * and keys costs a small fraction of that. span_select.py holds the Python reference
 * this must match (tests/processors/test_span_select.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
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

/* Protobuf's recursion limit, as the store's reader (_otlp_fast.c): the receivers refuse
 * anything deeper, so nothing they accept is left to the Python fallback for depth. */
#define MAX_DEPTH 100

static PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth);

static PyObject *kvlist_py(const uint8_t *p, size_t n, int depth) {
    Reader r = {p, p + n};
    Field f;
    int rc;
    PyObject *dict = PyDict_New();
    if (!dict) return NULL;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 1) continue;
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
    PyErr_SetString(PyExc_ValueError, "malformed OTLP attributes");
fail:
    Py_DECREF(dict);
    return NULL;
}

/* otlp_values.plain(): scalars as themselves, arrays as tuples, maps as dicts. */
static PyObject *anyvalue_py(const uint8_t *p, size_t n, int depth) {
    Field f = {0};
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
        /* Counted first, then built as the tuple itself (no list in between). */
        Reader r = {f.data, f.data + f.len};
        Field item;
        int rc;
        Py_ssize_t count = 0;
        while ((rc = next_field(&r, &item)) == 0) {
            if (item.num != 1) continue;
            if (item.wt != 2) {
                rc = -1;
                break;
            }
            count++;
        }
        if (rc < 0) {
            PyErr_SetString(PyExc_ValueError, "malformed OTLP ArrayValue");
            return NULL;
        }
        PyObject *tuple = PyTuple_New(count);
        if (!tuple) return NULL;
        r.p = f.data;
        Py_ssize_t i = 0;
        while (i < count && next_field(&r, &item) == 0) {
            if (item.num != 1) continue;
            PyObject *v = anyvalue_py(item.data, item.len, depth + 1);
            if (!v) {
                Py_DECREF(tuple);
                return NULL;
            }
            PyTuple_SET_ITEM(tuple, i++, v);
        }
        return tuple;
    }
    case 6: return kvlist_py(f.data, f.len, depth + 1);
    case 7: return PyBytes_FromStringAndSize((const char *)f.data, (Py_ssize_t)f.len);
    }
    PyErr_SetString(PyExc_ValueError, "malformed OTLP AnyValue");
    return NULL;
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
        PyObject *v = k ? (has_value ? anyvalue_py(value.data, value.len, 0) : Py_NewRef(Py_None)) : NULL;
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
        case 1: if (f.wt == 2) trace = f; else rc = -1; break;
        case 2: if (f.wt == 2) span_id = f; else rc = -1; break;
        case 5: if (f.wt == 2) name = f; else rc = -1; break;
        case 7: if (f.wt == 1) start = f.v; else rc = -1; break;
        case 8: if (f.wt == 1) end = f.v; else rc = -1; break;
        default: break;
        }
        if (rc < 0) break;
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

static int scope_is_skipped(const Selection *sel, const uint8_t *p, size_t n) {
    Reader r = {p, p + n};
    Field f;
    while (next_field(&r, &f) == 0)
        if (f.num == 1 && f.wt == 2)
            return f.len == (size_t)sel->skip_scope_len && memcmp(f.data, sel->skip_scope, f.len) == 0;
    return 0;
}

static int select_resource(const Selection *sel, const uint8_t *p, size_t n, PyObject *result) {
    Reader r = {p, p + n};
    Field f, resource = {0};
    int rc;
    resource.data = (const uint8_t *)"";
    while ((rc = next_field(&r, &f)) == 0)
        if (f.num == 1 && f.wt == 2) resource = f;
    if (rc < 0) goto malformed;
    PyObject *spans = PyList_New(0);
    if (!spans) return -1;
    r.p = p;
    while ((rc = next_field(&r, &f)) == 0) {
        if (f.num != 2) continue;
        if (f.wt != 2) {
            rc = -1;
            break;
        }
        Reader sr = {f.data, f.data + f.len};
        Field sf;
        int skip = 0;
        while ((rc = next_field(&sr, &sf)) == 0)
            if (sf.num == 1 && sf.wt == 2) skip = scope_is_skipped(sel, sf.data, sf.len);
        if (rc < 0) break;
        if (skip) continue;
        sr.p = f.data;
        while ((rc = next_field(&sr, &sf)) == 0) {
            if (sf.num != 2) continue;
            if (sf.wt != 2) {
                rc = -1;
                break;
            }
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
        if (f.num != 1) continue;
        if (f.wt != 2 || select_resource(&sel, f.data, f.len, result)) {
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
typedef struct {
    char *buf;
    size_t len, cap;
} Out;

static int out_reserve(Out *o, size_t n) {
    if (o->len + n <= o->cap) return 0;
    size_t cap = o->cap ? o->cap : 1024;
    while (cap < o->len + n) cap *= 2;
    char *grown = PyMem_Realloc(o->buf, cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = grown;
    o->cap = cap;
    return 0;
}

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
    Out o = {0};
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
        if (out_reserve(&o, 1 + 10 + link_len)) {
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
 * otlp_values.key_values() as wire bytes: one repeated-KeyValue field (`field_num`,
 * 9 = Span.attributes) per non-None entry of a dict, in dict order. AnyValue as
 * otlp_values.any_value() builds it: bool, int (int64), float, list/tuple (array,
 * recursively), anything else str(). Merged into the span, the same message the
 * KeyValue objects made. Values that protobuf would refuse (an int beyond int64, a
 * str that is not UTF-8) raise, and the caller takes the protobuf path. */
static int put_bytes(Out *o, const void *p, size_t n) {
    if (out_reserve(o, n)) return -1;
    memcpy(o->buf + o->len, p, n);
    o->len += n;
    return 0;
}

static int put_tag_varint(Out *o, uint8_t tag, uint64_t v) {
    if (out_reserve(o, 11)) return -1;
    o->buf[o->len++] = (char)tag;
    o->len += put_varint(o->buf + o->len, v);
    return 0;
}

static int put_tag_bytes(Out *o, uint8_t tag, const void *p, size_t n) {
    if (put_tag_varint(o, tag, n)) return -1;
    return put_bytes(o, p, n);
}

static int put_str_field(Out *o, uint8_t tag, PyObject *str) {
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(str, &n);
    if (!text) return -1;
    return put_tag_bytes(o, tag, text, (size_t)n);
}

/* The body of AnyValue for `v` (no tag or length of its own). */
static int anyvalue_wire(Out *o, PyObject *v, int depth) {
    if (depth > MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "attribute nested too deeply");
        return -1;
    }
    if (PyBool_Check(v)) return put_tag_varint(o, 0x10, v == Py_True);
    if (PyLong_Check(v)) {
        long long i = PyLong_AsLongLong(v);
        if (i == -1 && PyErr_Occurred()) return -1;
        return put_tag_varint(o, 0x18, (uint64_t)i);
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        if (out_reserve(o, 9)) return -1;
        o->buf[o->len++] = 0x21;
        for (int i = 0; i < 8; i++) o->buf[o->len++] = (char)(bits >> (8 * i)); /* fixed64, LE */
        return 0;
    }
    if (PyList_Check(v) || PyTuple_Check(v)) {
        Out arr = {0}, item = {0};
        PyObject *seq = PySequence_Fast(v, "not a sequence");
        if (!seq) return -1;
        int rc = 0;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && !rc; i++) {
            item.len = 0;
            rc = anyvalue_wire(&item, PySequence_Fast_GET_ITEM(seq, i), depth + 1);
            if (!rc) rc = put_tag_bytes(&arr, 0x0a, item.buf ? item.buf : "", item.len);
        }
        Py_DECREF(seq);
        if (!rc) rc = put_tag_bytes(o, 0x2a, arr.buf ? arr.buf : "", arr.len);
        PyMem_Free(arr.buf);
        PyMem_Free(item.buf);
        return rc;
    }
    PyObject *text = PyObject_Str(v);
    if (!text) return -1;
    int rc = put_str_field(o, 0x0a, text);
    Py_DECREF(text);
    return rc;
}

static PyObject *attributes_wire(PyObject *self, PyObject *args) {
    PyObject *attrs;
    unsigned int field_num;
    if (!PyArg_ParseTuple(args, "O!I", &PyDict_Type, &attrs, &field_num)) return NULL;
    if (field_num < 1 || field_num > 15) {
        PyErr_SetString(PyExc_ValueError, "field_num must be 1..15");
        return NULL;
    }
    Out o = {0}, kv = {0}, value = {0};
    PyObject *key, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(attrs, &pos, &key, &v)) {
        if (v == Py_None) continue;
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "attribute keys must be str");
            goto fail;
        }
        kv.len = value.len = 0;
        Py_ssize_t key_len;
        const char *key_text = PyUnicode_AsUTF8AndSize(key, &key_len);
        if (!key_text) goto fail;
        if (key_len && put_tag_bytes(&kv, 0x0a, key_text, (size_t)key_len)) goto fail;
        if (anyvalue_wire(&value, v, 0)) goto fail;
        if (put_tag_bytes(&kv, 0x12, value.buf ? value.buf : "", value.len)) goto fail;
        if (put_tag_bytes(&o, (uint8_t)((field_num << 3) | 2), kv.buf ? kv.buf : "", kv.len)) goto fail;
    }
    PyObject *result = PyBytes_FromStringAndSize(o.buf ? o.buf : "", (Py_ssize_t)o.len);
    PyMem_Free(o.buf);
    PyMem_Free(kv.buf);
    PyMem_Free(value.buf);
    return result;
fail:
    PyMem_Free(o.buf);
    PyMem_Free(kv.buf);
    PyMem_Free(value.buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"rank_links", rank_links, METH_VARARGS,
     "rank_links(ranks, rank_key) -> bytes: a Span's `links` field with one Link per rank "
     "of `ranks` ({rank: entry with trace_id and span_id bytes}), in rank order, each "
     "carrying the attribute rank_key = rank."},
    {"attributes_wire", attributes_wire, METH_VARARGS,
     "attributes_wire(attrs, field_num) -> bytes: otlp_values.key_values(attrs) as the wire "
     "bytes of a repeated KeyValue field `field_num` (9: Span.attributes)."},
    {"select_spans", select_spans, METH_VARARGS,
     "select_spans(payload, names, prefix, excluded, skip_scope, span_keys, resource_keys[, step])\n"
     "-> [(resource_attrs, [(name, trace_id, span_id, start_ns, end_ns, attrs), ...]), ...]\n"
     "With step = (name, rank, step, wait, pg names, pg waits, pg seqs keys), such spans\n"
     "come as (name, trace_id, span_id, start_ns, end_ns, rank, step, wait, names, waits,\n"
     "seqs) where their values allow (span_select.compact_step)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_span_select", "OTLP bytes to the spans the correlator reads.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__span_select(void) { return PyModule_Create(&module); }
