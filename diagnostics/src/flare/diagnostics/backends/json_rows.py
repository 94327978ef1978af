"""Trace answers as JSON → rows in the store's span schema: OTLP JSON (Jaeger's
`api_v3`, Tempo, the collector's read endpoint) and Jaeger's own JSON model (its UI's
internal `/api`)."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from flare.diagnostics.backends.base import BackendError
from flare.exporters import store
from flare.wire import semconv as sc


def hex_id(value: Any, nbytes: int) -> str:
    """A trace/span id as lowercase hex, from hex (any case, leading zeros dropped, as
    Tempo's search prints them) or base64 (as Tempo's trace-by-id JSON prints them)."""
    if not value:
        return ""
    text = str(value).strip()
    width = 2 * nbytes
    is_hex = all(c in "0123456789abcdefABCDEF" for c in text)
    if is_hex and len(text) <= width and not text.endswith("="):
        # A base64 id without padding could look like hex only if its length is a
        # multiple of 4 and shorter than the hex width; real ids (24/12 chars with
        # '=' padding) never do, so hex wins.
        return text.lower().rjust(width, "0")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise BackendError(f"malformed id {text!r} in the backend's answer") from None
    return raw.hex().rjust(width, "0")[-width:]


def otlp_value(value: Mapping[str, Any] | None) -> Any:
    """An OTLP JSON AnyValue as a plain Python value (ints may arrive as strings)."""
    if not value:
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [otlp_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        return otlp_attributes((value["kvlistValue"] or {}).get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def otlp_attributes(items: Iterable[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: otlp_value(kv.get("value")) for kv in items or () if "key" in kv}


_KIND_NAMES = {
    "SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2,
    "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5,
}
_JAEGER_KINDS = {"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _enum(value: Any, names: Mapping[str, int]) -> int:
    if value is None or value == "":
        return 0
    if isinstance(value, int):
        return value
    text = str(value)
    return int(text) if text.isdigit() else names.get(text, 0)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None and value != "" else None
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------- rows


class SpanRows:
    """Accumulates spans as columns of the store's span schema, deduplicated by id."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name, _, _ in store.SPAN_COLUMNS}
        self._seen: set[tuple[str, str]] = set()

    def __len__(self) -> int:
        return len(self.columns["span_id"])

    def add(
        self,
        *,
        trace_id: str,
        span_id: str,
        parent_span_id: str,
        name: str,
        kind: int,
        start_ns: int,
        end_ns: int,
        status_code: int,
        status_message: str,
        attributes: dict[str, Any],
        resource: dict[str, Any],
        events: list[dict[str, Any]],
        links: list[dict[str, Any]],
    ) -> None:
        key = (trace_id, span_id)
        if key in self._seen:
            return
        self._seen.add(key)
        service = resource.get(sc.SERVICE_NAME)
        job = resource.get(sc.JOB_ID) or service
        c = self.columns
        c["job"].append(None if job is None else str(job))
        c["service"].append(None if service is None else str(service))
        c["trace_id"].append(trace_id)
        c["span_id"].append(span_id)
        c["parent_span_id"].append(parent_span_id)
        c["name"].append(name)
        c["kind"].append(kind)
        c["start_ns"].append(start_ns)
        c["end_ns"].append(end_ns)
        c["duration_ns"].append(end_ns - start_ns)
        c["status_code"].append(status_code)
        c["status_message"].append(status_message)
        rank = resource.get(sc.RANK, attributes.get(sc.RANK))
        c["rank"].append(_int_or_none(rank))
        c["step"].append(_int_or_none(attributes.get(sc.STEP)))
        c["host"].append(resource.get(sc.HOST_NAME))
        c["pid"].append(_int_or_none(resource.get(sc.PROCESS_PID)))
        c["attributes"].append(json.dumps(attributes, separators=(",", ":")))
        c["resource"].append(json.dumps(resource, separators=(",", ":")))
        c["events"].append(json.dumps(events, separators=(",", ":")))
        c["links"].append(json.dumps(links, separators=(",", ":")))

    def table(
        self,
        names: Sequence[str] | None = None,
        first_step: int | None = None,
        last_step: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> pa.Table:
        """The accumulated rows that pass the filters, as a SPAN_SCHEMA table
        (names ending in '*' are prefixes, as in `ArrowJobData`)."""
        c = self.columns
        exact = {n for n in names or () if not n.endswith("*")}
        prefixes = tuple(n[:-1] for n in names or () if n.endswith("*"))
        wanted_ranks = set(ranks) if ranks is not None else None
        keep = []
        for i in range(len(self)):
            name = c["name"][i]
            if names and name not in exact and not (prefixes and name.startswith(prefixes)):
                continue
            step = c["step"][i]
            if first_step is not None and (step is None or step < first_step):
                continue
            if last_step is not None and (step is None or step > last_step):
                continue
            if wanted_ranks is not None and c["rank"][i] not in wanted_ranks:
                continue
            keep.append(i)
        return store.spans_table({k: [v[i] for i in keep] for k, v in c.items()})


def add_otlp_json(rows: SpanRows, resource_spans: Iterable[Mapping[str, Any]] | None) -> int:
    """Add OTLP JSON `resourceSpans` (Jaeger api_v3, Tempo, hex or base64 ids)."""
    added = len(rows)
    try:
        for rs in resource_spans or ():
            resource = otlp_attributes((rs.get("resource") or {}).get("attributes"))
            scopes = rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ()
            for scope in scopes:
                for span in scope.get("spans") or ():
                    start_ns = int(span.get("startTimeUnixNano") or 0)
                    end_ns = int(span.get("endTimeUnixNano") or start_ns)
                    status = span.get("status") or {}
                    rows.add(
                        trace_id=hex_id(span.get("traceId"), 16),
                        span_id=hex_id(span.get("spanId"), 8),
                        parent_span_id=hex_id(span.get("parentSpanId"), 8),
                        name=str(span.get("name", "")),
                        kind=_enum(span.get("kind"), _KIND_NAMES),
                        start_ns=start_ns,
                        end_ns=end_ns,
                        status_code=_enum(status.get("code"), _STATUS_NAMES),
                        status_message=str(status.get("message", "")),
                        attributes=otlp_attributes(span.get("attributes")),
                        resource=resource,
                        events=[
                            {
                                "name": ev.get("name", ""),
                                "time_ns": int(ev.get("timeUnixNano") or 0),
                                "attributes": otlp_attributes(ev.get("attributes")),
                            }
                            for ev in span.get("events") or ()
                        ],
                        links=[
                            {
                                "trace_id": hex_id(ln.get("traceId"), 16),
                                "span_id": hex_id(ln.get("spanId"), 8),
                                "attributes": otlp_attributes(ln.get("attributes")),
                            }
                            for ln in span.get("links") or ()
                        ],
                    )
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise BackendError(f"the backend answered OTLP JSON that cannot be read ({exc})") from None
    return len(rows) - added


# Tags Jaeger's OTLP→model translation adds for fields OTLP keeps outside attributes.
_JAEGER_SYNTHETIC_TAGS = {
    "span.kind", "otel.status_code", "otel.status_description", "otel.scope.name",
    "otel.scope.version", "otel.library.name", "otel.library.version", "error",
    "internal.span.format", "w3c.tracestate",
}


def _jaeger_tags(tags: Iterable[Mapping[str, Any]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tag in tags or ():
        value = tag.get("value")
        kind = tag.get("type", "string")
        if kind == "int64":
            value = int(value)
        elif kind == "float64":
            value = float(value)
        elif kind == "bool":
            value = value if isinstance(value, bool) else str(value).lower() == "true"
        elif isinstance(value, str) and value[:1] in "[{":
            # Jaeger flattens OTLP arrays to their JSON text; undo it for arrays.
            try:
                decoded = json.loads(value)
                value = decoded if isinstance(decoded, list) else value
            except ValueError:
                pass
        out[tag["key"]] = value
    return out


def add_jaeger_json(rows: SpanRows, traces: Iterable[Mapping[str, Any]] | None) -> int:
    """Add traces in Jaeger's internal JSON model (`/api/traces` answers)."""
    added = len(rows)
    try:
        for trace in traces or ():
            processes = trace.get("processes") or {}
            for span in trace.get("spans") or ():
                process = processes.get(span.get("processID")) or span.get("process") or {}
                resource = _jaeger_tags(process.get("tags"))
                if process.get("serviceName"):
                    resource[sc.SERVICE_NAME] = process["serviceName"]
                tags = _jaeger_tags(span.get("tags"))
                trace_id = hex_id(span.get("traceID"), 16)
                parent = ""
                links = []
                for ref in span.get("references") or ():
                    ref_trace = hex_id(ref.get("traceID"), 16)
                    ref_span = hex_id(ref.get("spanID"), 8)
                    if not parent and ref.get("refType") == "CHILD_OF" and ref_trace == trace_id:
                        parent = ref_span
                    else:
                        links.append({"trace_id": ref_trace, "span_id": ref_span, "attributes": {}})
                status_code = {"OK": 1, "ERROR": 2}.get(str(tags.get("otel.status_code", "")), 0)
                if status_code == 0 and tags.get("error") is True:
                    status_code = 2
                start_ns = int(span.get("startTime", 0)) * 1000
                events = []
                for log in span.get("logs") or ():
                    fields = _jaeger_tags(log.get("fields"))
                    events.append(
                        {
                            "name": str(fields.pop("event", "")),
                            "time_ns": int(log.get("timestamp", 0)) * 1000,
                            "attributes": fields,
                        }
                    )
                rows.add(
                    trace_id=trace_id,
                    span_id=hex_id(span.get("spanID"), 8),
                    parent_span_id=parent,
                    name=str(span.get("operationName", "")),
                    kind=_JAEGER_KINDS.get(str(tags.get("span.kind", "")), 0),
                    start_ns=start_ns,
                    end_ns=start_ns + int(span.get("duration", 0)) * 1000,
                    status_code=status_code,
                    status_message=str(tags.get("otel.status_description", "")),
                    attributes={k: v for k, v in tags.items() if k not in _JAEGER_SYNTHETIC_TAGS},
                    resource=resource,
                    events=events,
                    links=links,
                )
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise BackendError(f"Jaeger answered trace JSON that cannot be read ({exc})") from None
    return len(rows) - added
