"""Grafana Tempo as a diagnosis backend: TraceQL search, then full traces by id.

Tempo's search answers name the matching traces and at most `spss` spans of each,
carrying only the attributes the query mentioned; detectors need every attribute, so
each matching trace is then fetched whole (`/api/v2/traces/<id>`, falling back to the
older `/api/traces/<id>`). Since all ranks' spans of one step share one trace id, that
is one request per step.

Filters pushed down in TraceQL (typed: `flare.step` and `flare.rank` are integers):

    { resource.service.name = "job" && (name = "train.step") &&
      span.flare.step >= 10 && span.flare.step <= 20 && resource.flare.rank = 3 }

and re-applied here. Like Jaeger, Tempo caps search results (`limit`) with no cursor;
a full answer splits its time window in two.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from flare.diagnostics.backends.base import BackendError
from flare.diagnostics.backends.http_json import JsonClient
from flare.diagnostics.backends.json_rows import SpanRows, add_otlp_json, hex_id
from flare.diagnostics.backends.time_windows import StepClock, split_window
from flare.wire import semconv as sc

_MIN_WINDOW_NS = 2_000_000_000  # Tempo's search window is in whole seconds
_MAX_LIMIT = 20_000
# Past this many ranks a TraceQL rank filter gets longer than it saves.
_MAX_PUSHED_RANKS = 32


def traceql_string(value: str) -> str:
    return json.dumps(value)  # TraceQL string literals use JSON's escapes


def _regex_prefix(prefix: str) -> str:
    special = set(".^$*+?()[]{}|\\")
    return "".join("\\" + c if c in special else c for c in prefix) + ".*"


def traceql_filter(
    job: str,
    names: Sequence[str] | None,
    first_step: int | None,
    last_step: int | None,
    ranks: Sequence[int] | None,
) -> str:
    """One TraceQL spanset filter selecting the spans diagnosis asked for."""
    # A job is its `flare.job.id`; spans that carry none (not Flare's) by service name
    terms = [f"(resource.{sc.JOB_ID} = {traceql_string(job)} || "
             f"resource.service.name = {traceql_string(job)})"]
    if names:
        alternatives = [
            f"name =~ {traceql_string(_regex_prefix(n[:-1]))}" if n.endswith("*")
            else f"name = {traceql_string(n)}"
            for n in dict.fromkeys(names)
        ]
        terms.append("(" + " || ".join(alternatives) + ")")
    if first_step is not None:
        terms.append(f"span.{sc.STEP} >= {int(first_step)}")
    if last_step is not None:
        terms.append(f"span.{sc.STEP} <= {int(last_step)}")
    if ranks is not None and 0 < len(ranks) <= _MAX_PUSHED_RANKS:
        terms.append(
            "(" + " || ".join(f"resource.{sc.RANK} = {int(r)}" for r in sorted(set(ranks))) + ")"
        )
    return "{ " + " && ".join(terms) + " }"


def search_trace_ids(doc: Any) -> list[str]:
    """Trace ids from a search answer (hex, leading zeros possibly dropped)."""
    if not isinstance(doc, dict):
        raise BackendError("Tempo /api/search answered without a JSON object")
    traces = doc.get("traces") or []
    if not isinstance(traces, list):
        raise BackendError("Tempo /api/search answered a 'traces' that is not a list")
    ids = []
    for trace in traces:
        if not isinstance(trace, dict) or not trace.get("traceID"):
            raise BackendError("Tempo /api/search answered a trace without a traceID")
        ids.append(hex_id(trace["traceID"], 16))
    return ids


def trace_resource_spans(doc: Any) -> list[Any]:
    """The OTLP resource spans of a trace-by-id answer, whichever Tempo printed it:
    v2 `{"trace": {"resourceSpans": …}}`, v1 `{"resourceSpans": …}` or `{"batches": …}`."""
    if doc is None:
        return []
    if not isinstance(doc, dict):
        raise BackendError("Tempo answered a trace that is not a JSON object")
    body = doc.get("trace", doc)
    if body is None:
        return []
    if not isinstance(body, dict):
        raise BackendError("Tempo answered a 'trace' that is not OTLP JSON")
    spans = body.get("resourceSpans", body.get("batches"))
    if spans is None:
        return []
    if not isinstance(spans, list):
        raise BackendError("Tempo answered resource spans that are not a list")
    return spans


class TempoBackend:
    """`tempo+http(s)://HOST:3200`: jobs are `service.name` values."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        bearer_token: str | None = None,
        lookback_s: float = 7 * 86400.0,
        limit: int = 500,
        spss: int = 1,
        **_ignored: Any,
    ) -> None:
        self.name = f"tempo+{url.rstrip('/')}"
        self.http = JsonClient(
            url, "Tempo", timeout_s=timeout_s, ca_file=ca_file, cert_file=cert_file,
            key_file=key_file, bearer_token=bearer_token,
        )
        self.lookback_s = lookback_s
        self.limit = max(1, int(limit))
        self.spss = max(1, int(spss))
        self._trace_api_v2: bool | None = None
        self._clocks: dict[str, StepClock] = {}

    # -- discovery

    def jobs(self) -> list[str]:
        """The `flare.job.id` values Tempo holds (the store's job names); where it holds
        none (spans not made by Flare), the service names."""
        jobs = self._tag_values(sc.JOB_ID)
        return jobs if jobs else self._tag_values("service.name")

    def _tag_values(self, tag: str) -> list[str]:
        status, doc = self.http.get_json(f"/api/v2/search/tag/resource.{tag}/values", allow=(404,))
        if status == 404:
            status, doc = self.http.get_json(f"/api/search/tag/{tag}/values",
                                             allow=(404,) if tag == sc.JOB_ID else ())
            if status == 404:
                return []
        if not isinstance(doc, dict) or not isinstance(doc.get("tagValues", []), list):
            raise BackendError("Tempo answered tag values that are not a list")
        values = [v.get("value") if isinstance(v, dict) else v for v in doc.get("tagValues", [])]
        # the anomaly spans written back are not a job
        return sorted({str(v) for v in values if v and v != sc.DIAGNOSTICS_SERVICE})

    # -- traces

    def trace(self, trace_id: str, query: str | None = None) -> pa.Table:
        """One trace by id (hex or base64) as span rows; empty when Tempo has none."""
        rows = SpanRows()
        self._add_trace(rows, hex_id(trace_id, 16), query)
        return rows.table()

    def _add_trace(self, rows: SpanRows, trace_id: str, query: str | None) -> None:
        if self._trace_api_v2 is not False:
            params = {"q": query, "keep_hierarchy": "false"} if query else None
            status, doc = self.http.get_json(f"/api/v2/traces/{trace_id}", params, allow=(404,))
            if status != 404:
                self._trace_api_v2 = True
                add_otlp_json(rows, trace_resource_spans(doc))
                return
            if self._trace_api_v2:
                return  # the v2 route exists: this trace is simply not there
        status, doc = self.http.get_json(f"/api/traces/{trace_id}", allow=(404,))
        if status == 404:
            return
        # v1 answered where v2 did not: this Tempo predates /api/v2/traces.
        self._trace_api_v2 = False
        add_otlp_json(rows, trace_resource_spans(doc))

    def search(self, query: str, window_ns: tuple[int, int]) -> list[str]:
        """Every trace id matching `query` in the window, splitting full answers."""
        found: dict[str, None] = {}
        pending = [(window_ns, self.limit)]
        while pending:
            (lo, hi), limit = pending.pop()
            _, doc = self.http.get_json(
                "/api/search",
                {
                    "q": query,
                    "start": lo // 1_000_000_000,
                    "end": -(-hi // 1_000_000_000),
                    "limit": limit,
                    "spss": self.spss,
                },
            )
            ids = search_trace_ids(doc)
            found.update(dict.fromkeys(ids))
            if len(ids) < limit:
                continue
            if hi - lo > _MIN_WINDOW_NS:
                pending.extend((w, limit) for w in split_window(lo, hi))
            elif limit < _MAX_LIMIT:
                # More matching traces in a second than `limit`: ask for more at once,
                # since Tempo's window cannot be narrower than a second.
                pending.append(((lo, hi), min(limit * 4, _MAX_LIMIT)))
            else:
                raise BackendError(
                    f"Tempo holds more than {_MAX_LIMIT} matching traces within one second; "
                    "narrow the query (steps or ranks)"
                )
        return list(found)

    def fetch(
        self,
        job: str,
        names: Sequence[str],
        first_step: int | None = None,
        last_step: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> pa.Table:
        clock = self._clocks.setdefault(job, StepClock())
        now = time.time_ns()
        window = clock.window(
            first_step, last_step, (now - int(self.lookback_s * 1e9), now + 60_000_000_000)
        )
        query = traceql_filter(job, names, first_step, last_step, ranks)
        rows = SpanRows()
        for trace_id in self.search(query, window):
            self._add_trace(rows, trace_id, query)
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
