"""Jaeger as a diagnosis backend: the `api_v3` HTTP API, the internal `/api` as fallback.

`api_v3` (Jaeger ≥ 1.35, and the Flare collector's read endpoint) answers trace searches
with OTLP JSON under `result`; older deployments only have the UI's internal `/api`,
which answers in Jaeger's own JSON model. Both become rows in the store's span schema.

Filters are pushed down where Jaeger can apply them (service = job, operation = span
name, an attribute filter for a single rank or step, a time window learnt from the steps
already seen) and always re-applied here, so a backend that ignores one never widens
the answer. Jaeger has no cursor for searches; completeness comes from splitting a time
window in two whenever a search comes back full (`search_depth` traces).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from flare.diagnostics.backends.base import BackendError
from flare.diagnostics.backends.http_json import JsonClient
from flare.diagnostics.backends.json_rows import SpanRows, add_jaeger_json, add_otlp_json, hex_id
from flare.diagnostics.backends.time_windows import StepClock, rfc3339, split_window
from flare.wire import semconv as sc

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
        self.http = JsonClient(
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
