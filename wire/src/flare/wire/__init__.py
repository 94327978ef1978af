"""Flare's names and wire, the base every other Flare distribution depends on.

`semconv` (span, attribute and resource names: the one table), `kernel_taxonomy` and
`bandwidth` (what both sides compute alike), `otlp_values` (the one OTLP attribute
writer, in C as `_otlp_write` where built), `http_client` (the one HTTP client),
`sdk_adapter` (every private OpenTelemetry name Flare uses) and `pyspy_dump` (the
reader of py-spy's text). Stdlib and urllib3 only; nothing here imports the rank hooks
or the collector. Kept import-light: importing the package imports none of them.
"""
