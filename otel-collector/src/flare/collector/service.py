"""The collector as an object: build from a configuration, start, flush, stop.

    collector = Collector.from_config_file(str(shipped.resolve("embedded")))
    collector.start()            # replays the write-ahead log tail, then listens
    collector.grpc_endpoint      # "127.0.0.1:4317" (the bound port when 0 was asked)
    collector.flush()            # everything acknowledged so far is in the store
    collector.stop(deadline_s=10)

`flare collector` (`__main__`) and `flare run` both drive this class.

What an OK reply guarantees: the request is in the write-ahead log (page cache; on
disk too with `flare_wal.fsync: true`). After a `kill -9` of the collector, the next
start replays every logged request the store has not committed, exactly once: the
store records the committed log position in the same transaction as the rows.
Without a `flare_wal` extension an OK means only "queued in memory".
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from flare.collector import config as config_mod
from flare.collector.config import ServiceConfig
from flare.collector.errors import ConfigError
from flare.collector.extensions import HttpExtension, metrics_responder, query_responder
from flare.collector.grpc_receiver import GrpcReceiver
from flare.collector.http_receiver import HttpReceiver
from flare.collector.ingest import Ingest, ItemQueue
from flare.collector.opamp import OpampServer
from flare.collector.pipeline import Pipeline, Stage
from flare.collector.query_api import RankGauges
from flare.collector.receiver import Acceptor
from flare.collector.security_hooks import bearer_auth, load_security
from flare.collector.telemetry import Registry, Source
from flare.collector.wal import SIGNAL_METRICS, SIGNAL_TRACES, WriteAheadLog
from flare.collector.worker import Worker, is_durable, parse_record

log = logging.getLogger(__name__)
# Counters the dashboard plots, exported from the start: Prometheus's rate() and
# increase() over a series that does not exist yet return nothing at all.
_ZERO_FROM_START = ("accepted_spans", "refused_spans", "unauthenticated_requests")

STORE_EXPORTER_TYPE = "flare_store"
_COUNTER_HELP = {
    "accepted_requests": "OTLP requests acknowledged with OK (logged and queued)",
    "accepted_spans": "spans in acknowledged requests",
    "accepted_metric_points": "metric data points in acknowledged requests",
    "accepted_bytes": "encoded bytes of acknowledged requests",
    "refused_requests": "requests refused with a retry delay (backpressure)",
    "refused_spans": "spans in refused requests (the client retries them)",
    "refused_metric_points": "metric data points in refused requests",
    "rejected_spans": "spans rejected as invalid (partial success)",
    "rejected_metric_points": "metric data points rejected as invalid (partial success)",
    "malformed_requests": "requests whose body is not OTLP: bad framing, bad or unsupported "
                          "Content-Encoding, or not decodable (400 / INVALID_ARGUMENT)",
    "unsupported_requests": "OTLP/HTTP requests to no endpoint (404), not a POST (405), or "
                            "of an unsupported Content-Type (415): a misconfigured sender",
    "too_large_requests": "requests over the body size cap (413)",
    "unauthenticated_requests": "requests without a valid bearer token",
    "flush_errors": "exporter flushes that failed (data stays in the write-ahead log)",
    "export_errors": "batches an exporter refused to take",
    "dead_letter_requests": "acknowledged batches the store refused on every retry (or log "
                            "records that no longer parse), kept in <wal>/dead-letter/",
    "dead_letter_spans": "spans in those batches",
    "dead_letter_metric_points": "metric data points in those batches",
    "dropped_spans": "spans of refused batches dropped for want of a write-ahead log",
    "dropped_metric_points": "metric points of refused batches dropped for want of a "
                             "write-ahead log",
    "pipeline_errors": "requests or ticks a processor failed on",
    "processor_dropped_requests": "requests a processor dropped on purpose",
    "replayed_requests": "write-ahead log records replayed at start",
    "opamp_messages": "OpAMP messages from the ranks' agents (heartbeats, status, effective config)",
    "opamp_malformed": "OpAMP bodies that were not an AgentToServer (answered with a BadRequest "
                       "error response)",
    "opamp_requests_dropped": "capture requests dropped because their agent went away first",
    "opamp_refused": "control-channel messages and requests refused, by cause: no or another "
                     "agent's key, a rank held by a live agent, a changed identity, no job token, "
                     "an oversized field, the agent cap, a caller without the job's or the "
                     "operator's token",
    "opamp_forgotten": "gone agents forgotten (after flare_opamp.forget_after, or to make room)",
    "refused_connections": "connections (HTTP) or calls (gRPC) refused by a cap, by cause",
    "timed_out_requests": "connections ended because a TLS handshake, a request's headers or "
                          "its body did not arrive in time, by cause",
}


def _build(kind: str, component_id: str, cls: type, options: dict[str, Any]) -> Any:
    """Instantiate `cls(**options)`, turning a bad option into one ConfigError."""
    where = f"{kind}.{component_id}"
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for key in options:
            if key not in params:
                known = ", ".join(n for n in params if n != "self") or "none"
                raise ConfigError(f"{where}: unknown option {key!r} (known: {known})")
    try:
        return cls(**options)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


# Each read of the per-rank gauges queries the store (and holds it against a flush for
# that long): frequent scrapes, such as benchmarks polling the WAL position, reuse the
# last answer.
RANK_GAUGES_EVERY_S = 10.0


class _Throttled:
    """A gauge source read at most once per `every_s`; the last answer in between."""

    def __init__(self, source: RankGauges, every_s: float) -> None:
        self.source = source
        self.every_s = every_s
        self._next = 0.0
        self._last: list[tuple[str, dict[str, str], float]] = []

    def __call__(self) -> list[tuple[str, dict[str, str], float]]:
        now = time.monotonic()
        if now >= self._next:
            self._last = self.source()
            self._next = now + self.every_s
        return self._last


class Collector:
    def __init__(self, config: dict[str, Any] | ServiceConfig) -> None:
        self.config = config if isinstance(config, ServiceConfig) else config_mod.parse(config)
        cfg = self.config
        self.registry = Registry()
        self.counters = self.registry.counters
        for name, text in _COUNTER_HELP.items():
            self.counters.describe(name, text)
        for name in _ZERO_FROM_START:  # a panel shows 0, not "No data", until it happens
            self.counters.add(name, 0.0)
        from flare import exporters as exporter_pkg
        from flare import processors as processor_pkg

        # Processors first: they are pure, so a bad option fails before any exporter
        # has started a sender thread or touched a file.
        staged: list[tuple[Any, list[Stage]]] = []
        limiters: dict[int, list[Any]] = {SIGNAL_TRACES: [], SIGNAL_METRICS: []}
        for pipe in cfg.pipelines:
            stages = []
            for processor_id in pipe.processors:
                ptype, options = cfg.processors[processor_id]
                processor = _build("processors", processor_id, processor_pkg.REGISTRY[ptype], options)
                stages.append(Stage(processor_id, ptype, processor))
                if callable(getattr(processor, "admit", None)):
                    code = SIGNAL_TRACES if pipe.signal == "traces" else SIGNAL_METRICS
                    limiters[code].append(processor)
            staged.append((pipe, stages))
        used_exporters = {e for p in cfg.pipelines for e in p.exporters}
        self.exporters: dict[str, Any] = {}
        try:
            for exporter_id, (etype, options) in cfg.exporters.items():
                if exporter_id in used_exporters:
                    self.exporters[exporter_id] = _build(
                        "exporters", exporter_id, exporter_pkg.REGISTRY[etype], options
                    )
        except ConfigError:
            for exporter in self.exporters.values():
                if not is_durable(exporter):  # nothing is buffered yet; stop their threads
                    exporter.shutdown()
            raise
        self.pipelines: list[Pipeline] = [
            Pipeline(pipe.id, pipe.signal, stages,
                     [(e, self.exporters[e]) for e in pipe.exporters], self.counters)
            for pipe, stages in staged
        ]
        self.wal = (
            WriteAheadLog(cfg.wal.directory, cfg.wal.fsync, cfg.wal.max_bytes, cfg.wal.segment_bytes)
            if cfg.wal else None
        )
        self.queue = ItemQueue(cfg.queue_max_bytes)
        self.ingest = Ingest(self.queue, self.wal, limiters, self.counters)
        self.acceptor = Acceptor(self.ingest, self.counters)
        self.worker: Worker | None = None
        self._receivers: list[Any] = []
        self._extensions: dict[str, HttpExtension] = {}
        self._auths: list[tuple[str, Any]] = []
        self._started = False
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.opamp = OpampServer(self.counters, policy=cfg.opamp)  # the ranks' agents, on OTLP/HTTP
        self.registry.register_gauge_source(self._gauges)
        self._rank_gauges: _Throttled | None = None  # the store's per-rank gauges, when served

    @classmethod
    def from_config_file(cls, path: str | os.PathLike[str]) -> Collector:
        return cls(config_mod.load_file(path))

    # ------------------------------------------------------------------ endpoints
    def _endpoint(self, kind: type) -> str | None:
        for receiver in self._receivers:
            if isinstance(receiver, kind):
                return receiver.endpoint
        return None

    @property
    def grpc_endpoint(self) -> str | None:
        return self._endpoint(GrpcReceiver)

    @property
    def http_endpoint(self) -> str | None:
        return self._endpoint(HttpReceiver)

    @property
    def metrics_endpoint(self) -> str | None:
        ext = self._extensions.get("flare_metrics")
        return ext.endpoint if ext else None

    @property
    def query_endpoint(self) -> str | None:
        ext = self._extensions.get("flare_query")
        return ext.endpoint if ext else None

    @property
    def metrics_url(self) -> str | None:
        return _extension_url(self._extensions.get("flare_metrics"), "/metrics")

    @property
    def query_url(self) -> str | None:
        return _extension_url(self._extensions.get("flare_query"), "")

    @property
    def store_path(self) -> str | None:
        for exporter_id, (etype, options) in self.config.exporters.items():
            if etype == STORE_EXPORTER_TYPE and exporter_id in self.exporters:
                return str(options.get("path"))
        return None

    def register_gauge_source(self, source: Source) -> None:
        """Add a callable read at each scrape: `{name: value}` or `[(name, labels, value)]`."""
        auto = self._rank_gauges
        if isinstance(source, RankGauges) and auto is not None and source.store_path == auto.source.store_path:
            # The caller's own gauges of the same store replace the built-in ones:
            # Prometheus refuses a scrape that repeats a series.
            self.registry.unregister_gauge_source(auto)
            self._rank_gauges = None
        self.registry.register_gauge_source(source)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._started:
            raise RuntimeError("collector already started")
        self._started = True
        cfg = self.config
        try:
            # first: a start refused for exposure creates no write-ahead log directory
            # (seen: `<store>.ingest-wal/` left behind by every refused start)
            self._check_exposure()
            marker_key = "collector.wal.committed_lsn"
            if self.wal is not None:
                marker_key = f"collector.wal.{self.wal.load_identity()}.committed_lsn"
            self.worker = Worker(
                self.queue, self.pipelines, self.exporters, self.wal, marker_key,
                self.counters, cfg.flush_interval_s,
            )
            self._recover()
            self.worker.start()
            self._start_receivers()
            self._start_extensions()
        except BaseException:
            self._abort_start()
            raise

    def _recover(self) -> None:
        assert self.worker is not None
        start_lsn = self.worker.load_markers()
        if self.wal is None:
            return
        self.wal.open(committed_lsn=start_lsn)
        started = time.monotonic()
        count = self.worker.replay(lambda: self.wal.replay(start_lsn), parse_record)
        if count:
            self.counters.add("replayed_requests", count)
            log.info("replayed %d request(s) from the write-ahead log in %.2f s",
                     count, time.monotonic() - started)

    def _check_exposure(self) -> None:
        """Refuse to serve off loopback with neither TLS nor a token, unless told to
        (`service.insecure_expose`, `flare collector --insecure-expose`): then warn."""
        exposure_problem = load_security().exposure_problem
        cfg = self.config
        used = {r for p in cfg.pipelines for r in p.receivers}
        listeners = [(f"receivers.{rid}.protocols.{name}", proto)
                     for rid, rcfg in cfg.receivers.items() if rid in used
                     for name, proto in (("grpc", rcfg.grpc), ("http", rcfg.http)) if proto is not None]
        listeners += [(f"extensions.{name}", ext) for name, ext in
                      (("flare_metrics", cfg.metrics_endpoint), ("flare_query", cfg.query_endpoint))
                      if ext is not None]
        for where, listener in listeners:
            problem = exposure_problem(str(listener.endpoint), listener.tls, listener.auth)
            if problem is None:
                continue
            if not cfg.insecure_expose:
                raise ConfigError(f"{where}: {problem}, or pass --insecure-expose "
                                  "(service.insecure_expose: true) to serve it open anyway")
            log.warning("%s: %s; serving it open because insecure_expose is set", where, problem)

    def _start_receivers(self) -> None:
        used = {r for p in self.config.pipelines for r in p.receivers}
        for receiver_id, rcfg in self.config.receivers.items():
            if receiver_id not in used:
                continue
            if rcfg.grpc is not None:
                auth = bearer_auth(rcfg.grpc.auth)
                receiver = GrpcReceiver(receiver_id, rcfg.grpc, self.acceptor, self.counters, auth)
                receiver.start()
                self._receivers.append(receiver)
                if auth is not None:
                    self._auths.append((f"{receiver_id}/grpc", auth))
            if rcfg.http is not None:
                auth = bearer_auth(rcfg.http.auth)
                receiver = HttpReceiver(receiver_id, rcfg.http, self.acceptor, self.counters, auth,
                                        self.opamp)
                receiver.start()
                self._receivers.append(receiver)
                if auth is not None:
                    self._auths.append((f"{receiver_id}/http", auth))

    def _start_extensions(self) -> None:
        cfg = self.config
        if cfg.metrics_endpoint is not None:
            ext = HttpExtension("flare_metrics", cfg.metrics_endpoint,
                                metrics_responder(self.registry), self.counters)
            ext.start()
            self._extensions["flare_metrics"] = ext
            if self.store_path:
                # Per-rank step time, wait and culprit share for the Grafana dashboard
                # (the shipped dashboard, flare/collector/configs/flare-dashboard.json), read from the store per scrape.
                self._rank_gauges = _Throttled(RankGauges(self.store_path), RANK_GAUGES_EVERY_S)
                self.registry.register_gauge_source(self._rank_gauges)
        if cfg.query_endpoint is not None:
            store = cfg.query_endpoint.store or self.store_path
            if not store:
                raise ConfigError("extensions.flare_query needs `store` (no flare_store exporter to take it from)")
            ext = HttpExtension("flare_query", cfg.query_endpoint, query_responder(store), self.counters)
            ext.start()
            self._extensions["flare_query"] = ext

    def _abort_start(self) -> None:
        for receiver in self._receivers:
            receiver.stop(0) if isinstance(receiver, GrpcReceiver) else receiver.stop()
        for ext in self._extensions.values():
            ext.stop()
        self.ingest.close()
        if self.worker is not None and self.worker.running:
            self.worker.stop(2.0)  # drains what replay buffered, shuts exporters down
        else:
            # Only forwarders: a store exporter's buffer is still in the log, and
            # flushing it without its log position would duplicate it at the next start.
            for exporter in self.exporters.values():
                if is_durable(exporter):
                    continue
                try:
                    exporter.shutdown()
                except Exception as exc:  # already failing to start: just say so
                    log.warning("exporter shutdown after a failed start: %s", exc)
        if self.wal is not None:
            self.wal.close()
        self._stopped = True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Everything acknowledged before this call is in the store when it returns True."""
        if self.worker is None or self._stopped:
            return False
        return self.worker.flush(timeout_s)

    def stop(self, deadline_s: float = 10.0) -> bool:
        """Stop receiving, drain into the store within `deadline_s`; True if fully drained.

        What does not make it within the deadline stays in the write-ahead log and is
        replayed by the next start.
        """
        with self._stop_lock:
            if self._stopped or not self._started:
                return True
            self._stopped = True
        deadline = time.monotonic() + deadline_s
        grace = min(2.0, deadline_s / 4)
        for receiver in self._receivers:
            if isinstance(receiver, GrpcReceiver):
                receiver.stop(grace)
            else:
                receiver.stop()
        self.ingest.close()
        drained = True
        if self.worker is not None:
            drained = self.worker.stop(max(0.1, deadline - time.monotonic()))
        if self.wal is not None:
            self.wal.close()
        for ext in self._extensions.values():
            ext.stop()
        return drained

    # ------------------------------------------------------------------ self-metrics
    def _gauges(self) -> list[tuple[str, dict[str, str], float]]:
        out: list[tuple[str, dict[str, str], float]] = [
            ("queue_bytes", {}, self.queue.bytes),
            ("queue_requests", {}, len(self.queue)),
        ]
        if self.wal is not None:
            out += [
                ("wal_bytes", {}, self.wal.size_bytes),
                ("wal_segments", {}, self.wal.segment_count),
                ("wal_last_lsn", {}, self.wal.last_lsn),
                ("wal_committed_lsn", {}, self.wal.committed_lsn),
                ("wal_corrupt_records", {}, self.wal.corrupt_records),
            ]
        if self.worker is not None:
            out.append(("last_flush_seconds", {}, self.worker.flush_seconds_last))
        for pipeline in self.pipelines:
            for stage in pipeline.stages:
                out += _component_metrics(
                    "processor_", stage.processor, {"processor": stage.id, "pipeline": pipeline.id}
                )
        for exporter_id, exporter in self.exporters.items():
            out += _component_metrics("exporter_", exporter, {"exporter": exporter_id})
        for where, auth in self._auths:
            out.append(("auth_rejected", {"receiver": where}, float(getattr(auth, "rejected", 0))))
        return out + self.opamp.gauges()


def _component_metrics(prefix: str, component: Any, labels: dict[str, str]) -> list:
    method: Callable[[], dict[str, float]] | None = getattr(component, "metrics", None)
    if method is None:
        return []
    try:
        values = dict(method())
    except Exception as exc:  # a component's metrics must not break the whole scrape
        log.debug("metrics() of %s failed: %s", labels, exc)
        return []
    return [(prefix + name, labels, float(value)) for name, value in values.items()]


def _extension_url(ext: HttpExtension | None, path: str) -> str | None:
    """An HTTP extension's URL: https where it has `tls` (the start line said http:// for
    the `secure` configuration's TLS-only metrics and query endpoints)."""
    if ext is None:
        return None
    return f"{'https' if ext.options.tls else 'http'}://{ext.endpoint}{path}"
