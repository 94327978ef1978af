"""Jaeger as a diagnosis backend: the `api_v3` HTTP API, the internal `/api` as fallback.

`api_v3` (Jaeger ≥ 1.35, and the Flare collector's read endpoint) answers trace searches
with OTLP JSON under `result`; older deployments only have the UI's internal `/api`,
which answers in Jaeger's own JSON model. Both become rows in the store's span schema.

Filters are pushed down where Jaeger can apply them (service = job, operation = span
name, an attribute filter for a single rank or step, a time window learnt from the steps
already seen) and always re-applied here, so a backend that ignores one never widens
the answer. Jaeger has no cursor for searches; completeness comes from splitting a time
window in two whenever a search comes back full (`search_depth` traces).

This module also holds the pieces Tempo reuses (HTTP client, OTLP JSON → rows).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from flare.diagnostics.backends.base import BackendError
from flare.exporters import store
from flare.instrumentation import http_client
from flare.instrumentation import semconv as sc

# ---------------------------------------------------------------- HTTP


class HttpClient:
    """JSON over HTTP(S) with TLS, mTLS and a bearer token, on Flare's HTTP client
    (`flare.instrumentation.http_client`).

    One connection is reused across requests (a diagnosis makes hundreds); a dropped
    connection is reopened once before the error reaches the user.
    """

    def __init__(
        self,
        base_url: str,
        product: str,
        *,
        timeout_s: float = 10.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        bearer_token: str | None = None,
    ) -> None:
        try:
            parsed = urllib.parse.urlsplit(base_url)
            _ = parsed.port  # raises on a port that is not a number in 0-65535
        except ValueError as exc:
            raise BackendError(f"{product} URL {base_url!r} is not http(s)://HOST:PORT "
                               f"({str(exc).lower()})") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise BackendError(f"{product} URL {base_url!r} is not http(s)://HOST:PORT")
        # Unset options fall back to the FLARE_BACKEND_* environment variables, so a
        # token never has to appear on a command line.
        ca_file = ca_file or os.environ.get(sc.ENV_BACKEND_CA_FILE) or None
        cert_file = cert_file or os.environ.get(sc.ENV_BACKEND_CERT_FILE) or None
        key_file = key_file or os.environ.get(sc.ENV_BACKEND_KEY_FILE) or None
        token_from = "the bearer token" if bearer_token else sc.ENV_BACKEND_TOKEN
        bearer_token = bearer_token or os.environ.get(sc.ENV_BACKEND_TOKEN) or None
        if (cert_file is None) != (key_file is None):
            raise BackendError("a client certificate needs both cert_file and key_file")
        self.product = product
        self.base_url = base_url.rstrip("/")
        self._headers = {"Accept": "application/json", "User-Agent": "flare-diagnostics"}
        if bearer_token:
            self._headers["Authorization"] = f"Bearer {header_token(bearer_token, token_from)}"
        context: ssl.SSLContext | None = None
        if parsed.scheme == "https":
            try:
                context = http_client.tls_context(ca_file or True, cert_file, key_file)
            except (OSError, ssl.SSLError) as exc:
                raise BackendError(f"cannot load TLS files for {product}: {exc}") from exc
        elif ca_file or cert_file:
            raise BackendError(f"TLS options given for {product}, but its URL {base_url!r} "
                               "is not https://")
        self._conn = http_client.HttpClient(base_url, timeout_s, context)
        self.requests = 0

    def close(self) -> None:
        self._conn.close()

    def get(self, path: str, params: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
        """GET `path`; returns (status, body). Transport failures are BackendErrors."""
        target = self._conn.prefix + path
        if params:
            target += "?" + urllib.parse.urlencode(
                {k: v for k, v in params.items() if v is not None}
            )
        return self._send("GET", target)

    def _send(self, method: str, target: str, body: bytes | None = None,
              headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        try:
            reply = self._conn.request(method, target, body=body, headers={**self._headers, **(headers or {})})
        except http_client.TransportError as exc:
            where = f"{self.product} at {self.base_url}"
            if exc.kind == "tls":
                raise BackendError(f"TLS handshake with {where} failed: {exc.reason}") from None
            if exc.kind == "timeout":
                raise BackendError(f"{where} did not answer within "
                                   f"{self._conn.timeout_s:g} s") from None
            if exc.kind == "reply":
                raise BackendError(f"{where} sent an answer that is cut off or not HTTP: "
                                   f"{exc.reason}") from None
            raise BackendError(f"cannot reach {where}: {exc.reason}") from None
        self.requests += 1
        return reply.status, reply.body

    def get_json(
        self, path: str, params: Mapping[str, Any] | None = None, *, allow: Iterable[int] = ()
    ) -> tuple[int, Any]:
        """GET and decode JSON. Statuses other than 200 and `allow` are BackendErrors."""
        status, body = self.get(path, params)
        return status, self._json(path, status, body, allow)

    def post_json(self, path: str, payload: Any, headers: Mapping[str, str] | None = None) -> Any:
        """POST `payload` as JSON and decode the JSON answer (a status other than 200 is
        a BackendError naming it and the answer's first line)."""
        status, body = self._send("POST", self._conn.prefix + path, json.dumps(payload).encode(),
                                  {"Content-Type": "application/json", **(headers or {})})
        return self._json(path, status, body, ())

    def _json(self, path: str, status: int, body: bytes, allow: Iterable[int]) -> Any:
        if status in (401, 403):
            # (a plain-text answer says why: the collector's control channel names the
            # token it wants; a protobuf or HTML one is not quoted)
            said = _first_line(body) if body[:1].isalpha() and body.isascii() else ""
            raise BackendError(
                f"{self.product} at {self.base_url} refused the request (HTTP {status}): "
                + (said if status == 403 and said else "check the bearer token or client certificate")
            )
        if status != 200 and status not in allow:
            raise BackendError(
                f"{self.product} at {self.base_url} answered HTTP {status} to {path}: "
                f"{_first_line(body)}"
            )
        if status == 204 or not body.strip():
            return None
        try:
            return json.loads(body)
        except ValueError:
            if status != 200:  # an allowed error status may come with a plain-text body
                return None
            raise BackendError(
                f"{self.product} at {self.base_url} answered {path} with something that is "
                f"not JSON: {_first_line(body)}"
            ) from None


def header_token(value: str, setting: str) -> str:
    """`value` as an HTTP header may carry it (visible ASCII only: a line break or a
    non-ASCII letter would fail in the send, ValueError or UnicodeEncodeError), or a
    BackendError naming `setting`; the token itself is never quoted back."""
    if not all("!" <= c <= "~" for c in value):
        raise BackendError(f"{setting} holds characters a bearer token cannot have (spaces, line "
                           "breaks or non-ASCII); only visible ASCII characters can be sent")
    return value


def _first_line(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    return (text.splitlines()[0] if text else "(empty body)")[:200]


# ---------------------------------------------------------------- ids and values


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


# ---------------------------------------------------------------- time windows


# Allowance for clocks of different nodes disagreeing (NTP keeps them within ~1 s).
_SKEW_NS = 10_000_000_000


class StepClock:
    """What time each step happened at, learnt from the spans already fetched.

    Jaeger and Tempo search by time, diagnosis asks by step; once a step has been seen,
    later questions about nearby steps get a narrow time window instead of the whole
    look-back period.
    """

    def __init__(self) -> None:
        self._start_ns: dict[int, int] = {}

    def learn(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        for step, start in zip(
            table.column("step").to_pylist(), table.column("start_ns").to_pylist(), strict=True
        ):
            if step is not None and start is not None:
                known = self._start_ns.get(step)
                if known is None or start < known:
                    self._start_ns[step] = start

    def window(
        self, first_step: int | None, last_step: int | None, default: tuple[int, int]
    ) -> tuple[int, int]:
        """A [min, max] start-time window (ns) certain to hold steps first..last."""
        lo, hi = default
        if not self._start_ns:
            return lo, hi
        steps = sorted(self._start_ns)
        if first_step is not None:
            before = [s for s in steps if s <= first_step]
            if before:
                # Spans of a step start no earlier than the skew allowance before any
                # rank's step span seen for an earlier step (clocks of nodes differ).
                lo = max(lo, self._start_ns[before[-1]] - _SKEW_NS)
        if last_step is not None:
            after = [s for s in steps if s > last_step]
            if after:
                hi = min(hi, self._start_ns[after[0]] + _SKEW_NS)
        return lo, max(hi, lo + 1_000_000)


def rfc3339(ns: int) -> str:
    seconds, rest = divmod(ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{rest:09d}Z"


def split_window(lo: int, hi: int) -> list[tuple[int, int]]:
    mid = lo + (hi - lo) // 2
    return [(lo, mid), (mid, hi)]


# ---------------------------------------------------------------- the backend


_JAEGER_OWN_SERVICES = {"jaeger-query", "jaeger-all-in-one", "jaeger", "jaeger-collector"}
_MIN_WINDOW_NS = 1_000_000  # below 1 ms a full answer cannot be split further
MAX_SERVICES_READ = 50  # services whose job ids jobs() reads; the rest are jobs by name
JOB_PROBE_TRACES = 20  # recent step traces read per service to learn its job ids
JOB_DISCOVERY_S = 60.0  # an unknown job sends fetch back to jobs() at most this often


class JaegerBackend:
    """`jaeger+http(s)://HOST:16686`: jobs are the `flare.job.id` values of each service's
    recent steps (a service holding no Flare spans is a job by its name): the store's
    job names, also when several jobs share one `service.name`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        bearer_token: str | None = None,
        lookback_s: float = 7 * 86400.0,
        search_depth: int = 200,
        **_ignored: Any,
    ) -> None:
        self.name = f"jaeger+{url.rstrip('/')}"
        self.http = HttpClient(
            url, "Jaeger", timeout_s=timeout_s, ca_file=ca_file, cert_file=cert_file,
            key_file=key_file, bearer_token=bearer_token,
        )
        self.lookback_s = lookback_s
        self.search_depth = max(1, int(search_depth))
        self._api_v3: bool | None = None
        self._clocks: dict[str, StepClock] = {}
        # job -> (service, attributes that select it there), learned by jobs()
        self._where: dict[str, tuple[str, dict[str, str]]] = {}
        self._where_at = -float("inf")  # when jobs() last learned them (monotonic)

    # -- discovery

    def api_v3(self) -> bool:
        """Whether the server has api_v3 (probed once; a 404 route means the old UI API)."""
        if self._api_v3 is None:
            status, _ = self.http.get_json("/api/v3/services", allow=(404,))
            self._api_v3 = status != 404
        return self._api_v3

    def jobs(self) -> list[str]:
        if self.api_v3():
            _, doc = self.http.get_json("/api/v3/services")
            services = _expect_list(doc, "services", "Jaeger /api/v3/services")
        else:
            _, doc = self.http.get_json("/api/services")
            services = _expect_list(doc, "data", "Jaeger /api/services")
        # Jaeger's own services, and the anomaly spans written back: not jobs
        services = sorted(str(s) for s in services
                          if s not in _JAEGER_OWN_SERVICES and s != sc.DIAGNOSTICS_SERVICE)
        where: dict[str, tuple[str, dict[str, str]]] = {}
        for service in services[:MAX_SERVICES_READ]:
            ids = self._job_ids(service)
            for job in ids:
                where.setdefault(job, (service, {} if job == service else {sc.JOB_ID: job}))
            if not ids:
                where.setdefault(service, (service, {}))
        for service in services[MAX_SERVICES_READ:]:
            where.setdefault(service, (service, {}))
        self._where, self._where_at = where, time.monotonic()
        return sorted(where)

    def _job_ids(self, service: str) -> list[str]:
        """The `flare.job.id` of the service's recent steps (one search, a few traces)."""
        now = time.time_ns()
        rows = SpanRows()
        self._search_once(service, sc.SPAN_STEP, {}, (now - int(self.lookback_s * 1e9), now), rows,
                          depth=JOB_PROBE_TRACES)
        table = rows.table()
        if "job" not in table.column_names:
            return []
        return sorted({str(j) for j in table.column("job").to_pylist() if j})

    def operations(self, service: str) -> list[str]:
        if self.api_v3():
            _, doc = self.http.get_json("/api/v3/operations", {"service": service})
            ops = _expect_list(doc, "operations", "Jaeger /api/v3/operations")
            return sorted({str(op.get("name")) for op in ops if isinstance(op, dict)})
        _, doc = self.http.get_json(f"/api/services/{urllib.parse.quote(service, safe='')}/operations")
        return sorted(str(op) for op in _expect_list(doc, "data", "Jaeger /api/.../operations"))

    # -- traces

    def trace(self, trace_id: str) -> pa.Table:
        """One trace by id (hex or base64) as span rows; empty when Jaeger has none."""
        tid = hex_id(trace_id, 16)
        rows = SpanRows()
        if self.api_v3():
            status, doc = self.http.get_json(f"/api/v3/traces/{tid}", allow=(404,))
            if status != 404:
                add_otlp_json(rows, _v3_result(doc))
        else:
            status, doc = self.http.get_json(f"/api/traces/{tid}", allow=(404,))
            if status != 404:
                add_jaeger_json(rows, _expect_list(doc, "data", "Jaeger /api/traces/{id}"))
        return rows.table()

    def search(
        self,
        service: str,
        operation: str | None,
        attributes: Mapping[str, str],
        window_ns: tuple[int, int],
        rows: SpanRows,
    ) -> None:
        """Every trace of `service` matching the filters in the window, into `rows`.

        A full answer (search_depth traces) may hide more: the window is then split in
        two and each half searched again, so nothing is lost to the limit.
        """
        pending = [window_ns]
        while pending:
            lo, hi = pending.pop()
            found = self._search_once(service, operation, attributes, (lo, hi), rows)
            if found >= self.search_depth and hi - lo > _MIN_WINDOW_NS:
                pending.extend(split_window(lo, hi))

    def _search_once(
        self,
        service: str,
        operation: str | None,
        attributes: Mapping[str, str],
        window_ns: tuple[int, int],
        rows: SpanRows,
        depth: int | None = None,
    ) -> int:
        lo, hi = window_ns
        depth = self.search_depth if depth is None else depth
        if self.api_v3():
            params: dict[str, Any] = {
                "query.service_name": service,
                "query.operation_name": operation,
                "query.start_time_min": rfc3339(lo),
                "query.start_time_max": rfc3339(hi),
                "query.search_depth": depth,
            }
            if attributes:
                params["query.attributes"] = json.dumps(dict(attributes))
            status, doc = self.http.get_json("/api/v3/traces", params, allow=(404,))
            if status == 404:  # api_v3 answers "no traces found" with 404
                return 0
            result = _v3_result(doc)
            add_otlp_json(rows, result)
            return _count_traces(result)
        params = {
            "service": service,
            "operation": operation,
            "start": lo // 1000,
            "end": hi // 1000,
            "limit": depth,
        }
        if attributes:
            params["tags"] = json.dumps(dict(attributes))
        _, doc = self.http.get_json("/api/traces", params)
        traces = _expect_list(doc, "data", "Jaeger /api/traces")
        add_jaeger_json(rows, traces)
        return len(traces)

    def fetch(
        self,
        job: str,
        names: Sequence[str],
        first_step: int | None = None,
        last_step: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> pa.Table:
        """Spans of `job` with these names/steps/ranks, as a SPAN_SCHEMA table."""
        clock = self._clocks.setdefault(job, StepClock())
        now = time.time_ns()
        window = clock.window(
            first_step, last_step, (now - int(self.lookback_s * 1e9), now + 60_000_000_000)
        )
        if job not in self._where and time.monotonic() - self._where_at > JOB_DISCOVERY_S:
            self.jobs()  # a job not seen yet: learn the services' jobs again, not per fetch
        service, attributes = self._where.get(job, (job, {}))
        attributes = dict(attributes)
        if first_step is not None and first_step == last_step:
            attributes[sc.STEP] = str(first_step)
        if ranks is not None and len(ranks) == 1:
            attributes[sc.RANK] = str(ranks[0])
        rows = SpanRows()
        for operation in operations_to_search(names):
            self.search(service, operation, attributes, window, rows)
        table = rows.table(names or None, first_step, last_step, ranks)
        clock.learn(table)
        return table

    def job_data(self, job: str) -> Any:
        from flare.diagnostics.backends.arrow import ArrowJobData

        def fetch(
            names: Sequence[str],
            first_step: int | None,
            last_step: int | None,
            ranks: Sequence[int] | None,
        ) -> pa.Table:
            return self.fetch(job, names, first_step, last_step, ranks)

        return ArrowJobData(job, self.name, fetch)

    def close(self) -> None:
        self.http.close()


def operations_to_search(names: Sequence[str] | None) -> list[str | None]:
    """One search per exact span name; a prefix ('collective.*') or no name at all
    needs one search over every operation instead (Jaeger matches names exactly)."""
    if not names or any(n.endswith("*") for n in names):
        return [None]
    return list(dict.fromkeys(names))


def _v3_result(doc: Any) -> list[Any]:
    if not isinstance(doc, dict):
        raise BackendError("Jaeger api_v3 answered without a JSON object")
    if "error" in doc and "result" not in doc:
        message = (doc.get("error") or {}).get("message", "unknown error")
        raise BackendError(f"Jaeger api_v3 reported an error: {message}")
    result = doc.get("result")
    if result is None:
        return []
    if not isinstance(result, dict):
        raise BackendError("Jaeger api_v3 answered a 'result' that is not OTLP JSON")
    return result.get("resourceSpans") or []


def _count_traces(resource_spans: list[Any]) -> int:
    ids = set()
    for rs in resource_spans:
        for scope in rs.get("scopeSpans") or ():
            for span in scope.get("spans") or ():
                ids.add(span.get("traceId"))
    return len(ids)


def _expect_list(doc: Any, key: str, what: str) -> list[Any]:
    if not isinstance(doc, dict):
        raise BackendError(f"{what} answered without a JSON object")
    value = doc.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise BackendError(f"{what} answered a {key!r} that is not a list")
    return value
