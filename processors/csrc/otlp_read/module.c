#include "otlp_read.h"

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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_otlp_read", .m_doc = "The OTLP wire format read in C (otlp_read.h).",
    .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__otlp_read(void) {
    if (PyType_Ready(&ChunkType) < 0 || PyType_Ready(&SpanBuilderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "SpanBuilder", (PyObject *)&SpanBuilderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
