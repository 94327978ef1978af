"""A read-only Jaeger-compatible query endpoint over the embedded store.

Serves the two APIs Jaeger clients speak, straight from the DuckDB file:

- `api_v3` HTTP (`/api/v3/services`, `/api/v3/operations`, `/api/v3/traces`,
  `/api/v3/traces/{id}`): OTLP JSON under `result`, as Jaeger's own gateway prints it;
- the internal `/api` the Jaeger UI and Grafana's Jaeger data source call
  (`/api/services`, `/api/services/{s}/operations`, `/api/traces`, `/api/traces/{id}`):
  Jaeger's JSON model.

`handle()` is transport-free (method, path, query → status, headers, body): the
collector's `flare_query` extension hosts it behind its HTTP(S) server, which applies
the extension's TLS and bearer-token settings first. Every request opens the store
read-only for its own duration, so the collector's flushes are never blocked for long
and nothing here can write.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from flare.collector import rank_gauges
from flare.collector.trace_json import (
    KIND_NAMES,
    jaeger_model_traces,
    json_field,
    otlp_resource_spans,
)
from flare.exporters import store

Response = tuple[int, dict[str, str], bytes]

_JSON = {"Content-Type": "application/json"}
_KIND_NUMBERS = {v: k for k, v in KIND_NAMES.items() if v}
DEFAULT_SEARCH_DEPTH = 100
# One answer never carries more spans than this; a client narrows its window instead.
MAX_SPANS_PER_ANSWER = 500_000


class _BadRequest(Exception):
    pass


class _NotFound(Exception):
    pass


# ---------------------------------------------------------------- entry point


def handle(
    store_path: str,
    method: str,
    path: str,
    query: Mapping[str, Sequence[str]],
    headers: Mapping[str, str] | None = None,
) -> Response:
    """Answer one request; never raises (errors become Jaeger-shaped error bodies)."""
    if method not in ("GET", "HEAD"):
        return _error(405, f"method {method} not allowed: this endpoint is read-only")
    params = {k: v[-1] for k, v in query.items() if v}
    try:
        route = _route(path)
        if route is None:
            return 404, {"Content-Type": "text/plain"}, b"404 page not found\n"
        name, arg = route
        con = store.open_reader(store_path)
        try:
            body = _ROUTES[name](con, arg, params, query)
        finally:
            con.close()
    except _BadRequest as exc:
        return _error(400, str(exc))
    except _NotFound as exc:
        return _error(404, str(exc))
    except store.StoreError as exc:
        return _error(503, str(exc))
    return 200, dict(_JSON), json.dumps(body, separators=(",", ":")).encode()


def _error(status: int, message: str) -> Response:
    body = {"error": {"httpCode": status, "message": message}}
    return status, dict(_JSON), json.dumps(body).encode()


_PATTERNS = [
    (re.compile(r"^/api/v3/services/?$"), "v3_services"),
    (re.compile(r"^/api/v3/operations/?$"), "v3_operations"),
    (re.compile(r"^/api/v3/traces/?$"), "v3_find"),
    (re.compile(r"^/api/v3/traces/([^/]+)$"), "v3_trace"),
    (re.compile(r"^/api/services/?$"), "ui_services"),
    (re.compile(r"^/api/services/([^/]+)/operations/?$"), "ui_service_operations"),
    (re.compile(r"^/api/operations/?$"), "ui_operations"),
    (re.compile(r"^/api/traces/?$"), "ui_find"),
    (re.compile(r"^/api/traces/([^/]+)$"), "ui_trace"),
]


def _route(path: str) -> tuple[str, str | None] | None:
    for pattern, name in _PATTERNS:
        match = pattern.match(path)
        if match:
            return name, unquote(match.group(1)) if match.groups() else None
    return None


# ---------------------------------------------------------------- parameter parsing

_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|z|[+-]\d{2}:\d{2})$"
)


def parse_rfc3339_ns(text: str, name: str) -> int:
    """RFC 3339 with nanoseconds (Go's RFC3339Nano), which datetime cannot parse alone."""
    match = _RFC3339.match(text.strip())
    if not match:
        raise _BadRequest(f"malformed parameter {name}: {text!r} is not an RFC 3339 time")
    year, month, day, hour, minute, second, frac, zone = match.groups()
    offset = 0
    if zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        offset = sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    base = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                    tzinfo=timezone.utc)
    seconds = int(base.timestamp()) - offset
    return seconds * 1_000_000_000 + int((frac or "0").ljust(9, "0"))


def rfc3339_ns_text(ns: int) -> str:
    """The inverse of `parse_rfc3339_ns`: UTC with nine fractional digits."""
    seconds, rest = divmod(int(ns), 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{rest:09d}Z"


_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000,
            "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000}


def parse_go_duration_ns(text: str, name: str) -> int:
    text = text.strip()
    if not text or _GO_DURATION.sub("", text) != "":
        raise _BadRequest(f"malformed parameter {name}: {text!r} is not a duration like 100ms")
    return int(sum(float(n) * _UNIT_NS[u] for n, u in _GO_DURATION.findall(text)))


def _param(params: Mapping[str, str], *names: str) -> tuple[str | None, str]:
    """The first of the aliases present (Jaeger accepts snake_case and camelCase)."""
    for name in names:
        if params.get(name):
            return params[name], name
    return None, names[0]


def _int_param(params: Mapping[str, str], *names: str, default: int) -> int:
    value, name = _param(params, *names)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise _BadRequest(f"malformed parameter {name}: {value!r} is not an integer") from None
    if number <= 0:
        raise _BadRequest(f"malformed parameter {name}: must be positive")
    return number


# ---------------------------------------------------------------- search


class _Search:
    """The parts of a trace search both APIs share, turned into SQL."""

    def __init__(self) -> None:
        self.where: list[str] = []
        self.args: list[Any] = []

    def eq(self, column: str, value: Any) -> None:
        self.where.append(f"{column} = ?")
        self.args.append(value)

    def attribute(self, key: str, value: str) -> None:
        # A tag filter matches a span attribute or a resource attribute, as Jaeger's
        # stores match span tags and process tags.
        path = "$." + json.dumps(key)
        self.where.append(
            "(json_extract_string(attributes, ?) = ? OR json_extract_string(resource, ?) = ?)"
        )
        self.args.extend([path, value, path, value])

    def range(self, column: str, lo: int | None, hi: int | None) -> None:
        if lo is not None:
            self.where.append(f"{column} >= ?")
            self.args.append(lo)
        if hi is not None:
            self.where.append(f"{column} <= ?")
            self.args.append(hi)

    def trace_ids(self, con: Any, limit: int) -> list[str]:
        sql = "SELECT trace_id, max(start_ns) AS latest FROM spans"
        if self.where:
            sql += " WHERE " + " AND ".join(self.where)
        sql += " GROUP BY trace_id ORDER BY latest DESC LIMIT ?"
        return [r[0] for r in con.execute(sql, [*self.args, limit]).fetchall()]


def _attribute_filters(search: _Search, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        text = value if isinstance(value, str) else json.dumps(value)
        if key == "flare.step" and text.lstrip("-").isdigit():
            search.eq("step", int(text))  # promoted column: uses zone maps
        elif key == "flare.rank" and text.lstrip("-").isdigit():
            search.eq("rank", int(text))
        else:
            search.attribute(key, text)


def _span_rows(con: Any, trace_ids: Sequence[str]) -> list[dict[str, Any]]:
    if not trace_ids:
        return []
    placeholders = ", ".join("?" for _ in trace_ids)
    cur = con.execute(
        "SELECT trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, "
        "status_code, status_message, attributes, resource, events, links, service "
        f"FROM spans WHERE trace_id IN ({placeholders}) ORDER BY start_ns LIMIT ?",
        [*trace_ids, MAX_SPANS_PER_ANSWER],
    )
    columns = [d[0] for d in cur.description]
    return [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]


# ---------------------------------------------------------------- api_v3 routes


def _v3_services(con: Any, _arg: Any, _params: Any, _query: Any) -> dict[str, Any]:
    rows = con.execute(
        "SELECT DISTINCT service FROM spans WHERE service IS NOT NULL ORDER BY service"
    ).fetchall()
    return {"services": [r[0] for r in rows]}


def _operations(con: Any, service: str | None, span_kind: str | None) -> list[tuple[str, int]]:
    if not service:
        raise _BadRequest("parameter service is required")
    sql = "SELECT DISTINCT name, kind FROM spans WHERE service = ?"
    args: list[Any] = [service]
    if span_kind:
        if span_kind not in _KIND_NUMBERS:
            raise _BadRequest(f"malformed parameter span_kind: {span_kind!r}")
        sql += " AND kind = ?"
        args.append(_KIND_NUMBERS[span_kind])
    return [(r[0], int(r[1] or 0)) for r in con.execute(sql + " ORDER BY name", args).fetchall()]


def _v3_operations(con: Any, _arg: Any, params: Mapping[str, str], _query: Any) -> dict[str, Any]:
    service, _ = _param(params, "service")
    kind, _ = _param(params, "span_kind", "spanKind")
    ops = _operations(con, service, kind)
    return {"operations": [{"name": n, "spanKind": KIND_NAMES.get(k, "")} for n, k in ops]}


def _v3_find(con: Any, _arg: Any, params: Mapping[str, str], _query: Any) -> dict[str, Any]:
    search = _Search()
    service, _ = _param(params, "query.service_name", "query.serviceName")
    if not service:
        raise _BadRequest("parameter query.service_name is required")
    search.eq("service", service)
    operation, _ = _param(params, "query.operation_name", "query.operationName")
    if operation:
        search.eq("name", operation)
    lo_text, lo_name = _param(params, "query.start_time_min", "query.startTimeMin")
    hi_text, hi_name = _param(params, "query.start_time_max", "query.startTimeMax")
    if lo_text is None or hi_text is None:
        raise _BadRequest("query.start_time_min and query.start_time_max are required")
    lo, hi = parse_rfc3339_ns(lo_text, lo_name), parse_rfc3339_ns(hi_text, hi_name)
    if lo >= hi:
        raise _BadRequest("query.start_time_min must be before query.start_time_max")
    search.range("start_ns", lo, hi)
    dmin, dmin_name = _param(params, "query.duration_min", "query.durationMin")
    dmax, dmax_name = _param(params, "query.duration_max", "query.durationMax")
    search.range(
        "duration_ns",
        parse_go_duration_ns(dmin, dmin_name) if dmin else None,
        parse_go_duration_ns(dmax, dmax_name) if dmax else None,
    )
    attrs_text, _ = _param(params, "query.attributes")
    if attrs_text:
        try:
            attributes = json.loads(attrs_text)
        except ValueError:
            attributes = None
        if not isinstance(attributes, dict):
            raise _BadRequest("malformed parameter query.attributes: expected a JSON object")
        _attribute_filters(search, attributes)
    depth = _int_param(
        params, "query.search_depth", "query.searchDepth", "query.num_traces",
        default=DEFAULT_SEARCH_DEPTH,
    )
    trace_ids = search.trace_ids(con, depth)
    if not trace_ids:
        raise _NotFound("trace not found")
    return {"result": {"resourceSpans": otlp_resource_spans(_span_rows(con, trace_ids))}}


def _normalise_trace_id(text: str | None) -> str:
    value = (text or "").strip().lower()
    if not value or len(value) > 32 or any(c not in "0123456789abcdef" for c in value):
        raise _BadRequest(f"malformed parameter trace_id: {text!r}")
    return value.rjust(32, "0")


def _v3_trace(con: Any, arg: str | None, _params: Any, _query: Any) -> dict[str, Any]:
    rows = _span_rows(con, [_normalise_trace_id(arg)])
    if not rows:
        raise _NotFound("trace not found")
    return {"result": {"resourceSpans": otlp_resource_spans(rows)}}


# ---------------------------------------------------------------- internal /api routes


def _ui_envelope(data: Any) -> dict[str, Any]:
    return {"data": data, "total": len(data), "limit": 0, "offset": 0, "errors": None}


def _ui_services(con: Any, arg: Any, params: Any, query: Any) -> dict[str, Any]:
    return _ui_envelope(_v3_services(con, arg, params, query)["services"])


def _ui_service_operations(con: Any, arg: str | None, _params: Any, _query: Any) -> dict[str, Any]:
    return _ui_envelope([n for n, _ in _operations(con, arg, None)])


def _ui_operations(con: Any, _arg: Any, params: Mapping[str, str], _query: Any) -> dict[str, Any]:
    service, _ = _param(params, "service")
    kind, _ = _param(params, "spanKind", "span_kind")
    ops = _operations(con, service, kind)
    return _ui_envelope([{"name": n, "spanKind": KIND_NAMES.get(k, "")} for n, k in ops])


def _micros(params: Mapping[str, str], name: str) -> int | None:
    value = params.get(name)
    if not value:
        return None
    try:
        return int(value) * 1000
    except ValueError:
        raise _BadRequest(f"malformed parameter {name}: {value!r} is not microseconds") from None


def _ui_find(
    con: Any, _arg: Any, params: Mapping[str, str], query: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    search = _Search()
    service = params.get("service")
    if not service:
        raise _BadRequest("parameter service is required")
    search.eq("service", service)
    if params.get("operation"):
        search.eq("name", params["operation"])
    search.range("start_ns", _micros(params, "start"), _micros(params, "end"))
    for name in ("minDuration", "maxDuration"):
        if params.get(name):
            bound = parse_go_duration_ns(params[name], name)
            search.range("duration_ns", *((bound, None) if name == "minDuration" else (None, bound)))
    attributes: dict[str, Any] = {}
    if params.get("tags"):
        try:
            attributes = json.loads(params["tags"])
        except ValueError:
            attributes = None  # type: ignore[assignment]
        if not isinstance(attributes, dict):
            raise _BadRequest("malformed parameter tags: expected a JSON object")
    for tag in query.get("tag", []):
        key, sep, value = tag.partition(":")
        if not sep:
            raise _BadRequest(f"malformed parameter tag: {tag!r} is not key:value")
        attributes[key] = value
    _attribute_filters(search, attributes)
    limit = _int_param(params, "limit", default=20)
    rows = _span_rows(con, search.trace_ids(con, limit))
    return _ui_envelope(jaeger_model_traces(rows))


def _ui_trace(con: Any, arg: str | None, _params: Any, _query: Any) -> dict[str, Any]:
    rows = _span_rows(con, [_normalise_trace_id(arg)])
    if not rows:
        raise _NotFound("trace not found")
    return _ui_envelope(jaeger_model_traces(rows))


_ROUTES = {
    "v3_services": _v3_services,
    "v3_operations": _v3_operations,
    "v3_find": _v3_find,
    "v3_trace": _v3_trace,
    "ui_services": _ui_services,
    "ui_service_operations": _ui_service_operations,
    "ui_operations": _ui_operations,
    "ui_find": _ui_find,
    "ui_trace": _ui_trace,
}


# ---------------------------------------------------------------- dashboard gauges


class RankGauges:
    """Per-rank gauges for Prometheus and the Grafana dashboard, read from the store.

    A gauge source for `Collector.register_gauge_source`. What the gauges are (names,
    labels, windows, arithmetic) is `flare.collector.rank_gauges`, shared with the
    follow service; this is the part that fetches the store's rows for it: per job and
    rank, the totals of the last `recent_steps` complete steps (summed in SQL), the
    culprits the correlator named in `train.step.ranks` spans (`flare.ranks.culprit`)
    over the last `culprit_steps` steps, counted in SQL, and the write-back anomalies.

    A scrape that finds the store held by a flush answers the previous values rather
    than waiting.
    """

    def __init__(self, store_path: str, recent_steps: int = rank_gauges.RECENT_STEPS,
                 culprit_steps: int = rank_gauges.CULPRIT_STEPS,
                 lookback_s: float = 900.0) -> None:
        self.store_path = store_path
        self.recent_steps = recent_steps
        self.culprit_steps = culprit_steps
        self.lookback_s = lookback_s
        self._last: list[rank_gauges.Sample] = []

    def __call__(self) -> list[rank_gauges.Sample]:
        try:
            con = store.open_reader(self.store_path, timeout_s=0.5)
        except store.StoreError:
            return self._last
        try:
            since = int((time.time() - self.lookback_s) * 1e9)
            samples = rank_gauges.samples(self._steps(con, since), self._culprits(con, since),
                                          self._anomalies(con))
        finally:
            con.close()
        self._last = samples
        return samples

    def _steps(self, con: Any, since: int) -> list[rank_gauges.RankSteps]:
        # The last complete step is the one before the newest: a later rank may still
        # send the newest.
        wait = "TRY_CAST(json_extract(attributes, '$.\"flare.step.collective_wait_ms\"') AS DOUBLE)"
        rows = con.execute(
            f"""
            WITH latest AS (
                SELECT job, max(step) AS last FROM spans
                WHERE name = 'train.step' AND start_ns >= ? AND step IS NOT NULL GROUP BY job)
            SELECT s.job, s.rank, count(s.duration_ns), sum(s.duration_ns) / 1e6, count({wait}), sum({wait})
            FROM spans s JOIN latest l ON s.job = l.job
            WHERE s.name = 'train.step' AND s.start_ns >= ? AND s.rank IS NOT NULL
              AND s.step BETWEEN l.last - ? AND l.last - 1
            GROUP BY s.job, s.rank
            """,
            [since, since, self.recent_steps],
        ).fetchall()
        return [rank_gauges.RankSteps(str(job), int(rank), int(steps), float(step_ms or 0.0),
                                      int(waits), float(wait_ms or 0.0))
                for job, rank, steps, step_ms, waits, wait_ms in rows]

    def _culprits(self, con: Any, since: int) -> list[rank_gauges.StepCulprits]:
        culprit = "TRY_CAST(json_extract(attributes, '$.\"flare.ranks.culprit\"') AS INTEGER)"
        rows = con.execute(
            f"""
            WITH recent AS (
                SELECT job, {culprit} AS culprit,
                       row_number() OVER (PARTITION BY job ORDER BY step DESC) AS age
                FROM spans WHERE name = 'train.step.ranks' AND start_ns >= ?)
            SELECT job, culprit, count(*) FROM recent WHERE age <= ? GROUP BY job, culprit
            """,
            [since, self.culprit_steps],
        ).fetchall()
        return [rank_gauges.StepCulprits(str(job), None if rank is None else int(rank), int(n))
                for job, rank, n in rows]

    def _anomalies(self, con: Any) -> list[rank_gauges.AnomalyCount]:
        out = []
        for job, text in con.execute(
            "SELECT job, attributes FROM spans WHERE name = 'flare.anomaly'"
        ).fetchall():
            attrs = json_field(text, {})
            out.append(rank_gauges.AnomalyCount(str(job), str(attrs.get("flare.anomaly.kind", "unknown")),
                                                attrs.get("flare.anomaly.ranks") or ()))
        return out
