"""The store's span rows as the JSON Jaeger's two query APIs answer with: OTLP JSON
(`api_v3`, as Jaeger's gateway prints it) and Jaeger's own model (the internal `/api`
the Jaeger UI and Grafana's Jaeger data source call). Pure functions of the rows."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

KIND_NAMES = {0: "", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def json_field(text: str | None, default: Any) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


def otlp_any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # protojson prints int64 as a string
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [otlp_any_value(v) for v in value]}}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": otlp_key_values(value)}}
    return {"stringValue": "" if value is None else str(value)}


def otlp_key_values(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": otlp_any_value(v)} for k, v in attributes.items()]


def otlp_resource_spans(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows grouped by resource, in the OTLP JSON shape Jaeger's api_v3 prints."""
    by_resource: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        span: dict[str, Any] = {
            "traceId": row["trace_id"],
            "spanId": row["span_id"],
            "name": row["name"],
            "kind": int(row["kind"] or 0),
            "startTimeUnixNano": str(row["start_ns"]),
            "endTimeUnixNano": str(row["end_ns"]),
        }
        if row["parent_span_id"]:
            span["parentSpanId"] = row["parent_span_id"]
        attributes = json_field(row["attributes"], {})
        if attributes:
            span["attributes"] = otlp_key_values(attributes)
        events = json_field(row["events"], [])
        if events:
            span["events"] = [
                {
                    "timeUnixNano": str(ev.get("time_ns", 0)),
                    "name": ev.get("name", ""),
                    "attributes": otlp_key_values(ev.get("attributes") or {}),
                }
                for ev in events
            ]
        links = json_field(row["links"], [])
        if links:
            span["links"] = [
                {
                    "traceId": ln.get("trace_id", ""),
                    "spanId": ln.get("span_id", ""),
                    "attributes": otlp_key_values(ln.get("attributes") or {}),
                }
                for ln in links
            ]
        status: dict[str, Any] = {}
        if row["status_code"]:
            status["code"] = int(row["status_code"])
        if row["status_message"]:
            status["message"] = row["status_message"]
        span["status"] = status
        by_resource.setdefault(row["resource"] or "{}", []).append(span)
    return [
        {
            "resource": {"attributes": otlp_key_values(json_field(resource, {}))},
            "scopeSpans": [{"scope": {}, "spans": spans}],
        }
        for resource, spans in by_resource.items()
    ]


def _jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, (list, dict)):
        return {"key": key, "type": "string", "value": json.dumps(value)}
    return {"key": key, "type": "string", "value": "" if value is None else str(value)}


def jaeger_model_traces(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows as Jaeger UI traces (the shape of Jaeger's OTLP→model translation)."""
    traces: dict[str, dict[str, Any]] = {}
    for row in rows:
        trace = traces.setdefault(
            row["trace_id"],
            {"traceID": row["trace_id"], "spans": [], "processes": {}, "warnings": None,
             "_by_resource": {}},
        )
        resource_text = row["resource"] or "{}"
        process_id = trace["_by_resource"].get(resource_text)
        if process_id is None:
            process_id = f"p{len(trace['_by_resource']) + 1}"
            trace["_by_resource"][resource_text] = process_id
            resource = json_field(resource_text, {})
            trace["processes"][process_id] = {
                "serviceName": resource.pop("service.name", row["service"] or ""),
                "tags": [_jaeger_tag(k, v) for k, v in resource.items()],
            }
        tags = [_jaeger_tag(k, v) for k, v in json_field(row["attributes"], {}).items()]
        kind = KIND_NAMES.get(int(row["kind"] or 0), "")
        if kind:
            tags.append(_jaeger_tag("span.kind", kind))
        if row["status_code"] == 2:
            tags.append(_jaeger_tag("otel.status_code", "ERROR"))
            tags.append(_jaeger_tag("error", True))
        elif row["status_code"] == 1:
            tags.append(_jaeger_tag("otel.status_code", "OK"))
        if row["status_message"]:
            tags.append(_jaeger_tag("otel.status_description", row["status_message"]))
        references = []
        if row["parent_span_id"]:
            references.append(
                {"refType": "CHILD_OF", "traceID": row["trace_id"], "spanID": row["parent_span_id"]}
            )
        for link in json_field(row["links"], []):
            references.append(
                {"refType": "FOLLOWS_FROM", "traceID": link.get("trace_id", ""),
                 "spanID": link.get("span_id", "")}
            )
        logs = []
        for ev in json_field(row["events"], []):
            fields = [_jaeger_tag("event", ev.get("name", ""))]
            fields += [_jaeger_tag(k, v) for k, v in (ev.get("attributes") or {}).items()]
            logs.append({"timestamp": int(ev.get("time_ns", 0)) // 1000, "fields": fields})
        trace["spans"].append(
            {
                "traceID": row["trace_id"],
                "spanID": row["span_id"],
                "operationName": row["name"],
                "references": references,
                "startTime": int(row["start_ns"]) // 1000,
                "duration": (int(row["end_ns"]) - int(row["start_ns"])) // 1000,
                "tags": tags,
                "logs": logs,
                "processID": process_id,
                "warnings": None,
            }
        )
    for trace in traces.values():
        del trace["_by_resource"]
    return list(traces.values())
