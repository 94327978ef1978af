"""The `otlp` exporter: forward what the collector receives to any OTLP backend.

Jaeger, Tempo, another collector or a vendor: anything that speaks OTLP over gRPC
(`protocol: grpc`, endpoint `host:4317`) or HTTP/protobuf (`protocol: http/protobuf`,
endpoint `http://host:4318`, `/v1/traces` appended unless a path is given).

The caller never waits on the target. `export_*` serialises the request and puts it on
a bounded queue (full: the OLDEST request is dropped and counted — fresh data is worth
more to a person watching a live job); one background thread sends, retrying
retryable failures with exponential backoff, honouring the server's RetryInfo
(gRPC) or Retry-After (HTTP), for at most `retry_on_failure.max_elapsed_time` per
request. `flush` therefore returns at once: a dead forward target never stalls the
store. `shutdown` gives the queue `shutdown_timeout` to drain, then drops the rest.
"""

from __future__ import annotations

import collections
import email.utils
import gzip
import logging
import random
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from flare.processors import options
from flare.wire import http_client
from flare.wire.http_client import HttpClient, TransportError

log = logging.getLogger("flare.exporters.otlp")
FAILING_LOG_EVERY_S = 30.0  # a target that keeps failing is logged at most this often

_GRPC_METHODS = {
    "traces": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "metrics": "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
}
_HTTP_PATHS = {"traces": "/v1/traces", "metrics": "/v1/metrics"}
_RESPONSES = {"traces": ExportTraceServiceResponse, "metrics": ExportMetricsServiceResponse}
_RETRYABLE_HTTP = frozenset((429, 502, 503, 504))


@dataclass
class _Item:
    signal: str  # "traces" | "metrics"
    payload: bytes
    items: int  # spans or data points, for the drop counters


class SendError(Exception):
    def __init__(self, message: str, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class TlsFiles:
    """otelcol's client `tls:` block: `ca_file` (trust these CAs instead of the system's),
    `cert_file` + `key_file` (a client certificate, for servers that require one), and
    `insecure` (gRPC: plaintext even for an https endpoint). Files are read at start so a
    bad path is a configuration error, not a failure at the first send."""

    def __init__(self, tls: dict[str, Any]) -> None:
        self.insecure = tls.pop("insecure", None)
        self.ca_file, self.cert_file, self.key_file = (
            tls.pop(k, None) or None for k in ("ca_file", "cert_file", "key_file")
        )
        if tls:
            raise ValueError(
                f"otlp.tls: unknown option {next(iter(tls))!r} "
                "(known: ca_file, cert_file, key_file, insecure)"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("otlp.tls: cert_file and key_file go together")
        self.ca, self.cert, self.key = (
            _read_tls_file(f"otlp.tls.{k}", v)
            for k, v in (("ca_file", self.ca_file), ("cert_file", self.cert_file), ("key_file", self.key_file))
        )

    @property
    def configured(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def ssl_context(self) -> ssl.SSLContext:
        return http_client.tls_context(self.ca_file or True, self.cert_file, self.key_file)


def _read_tls_file(what: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None


class _GrpcSender:
    def __init__(self, target: str, secure: bool, headers: dict[str, str], timeout_s: float,
                 compression: str, tls: TlsFiles | None = None) -> None:
        import grpc  # only collectors that forward over gRPC pay for the import

        self._grpc = grpc
        if secure:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.ca if tls else None,
                private_key=tls.key if tls else None,
                certificate_chain=tls.cert if tls else None,
            )
            self._channel = grpc.secure_channel(target, credentials)
        else:
            self._channel = grpc.insecure_channel(target)
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._timeout_s = timeout_s
        self._compression = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
        # Payloads are already serialised: pass bytes through untouched.
        self._calls = {
            signal: self._channel.unary_unary(
                method, request_serializer=None, response_deserializer=_RESPONSES[signal].FromString
            )
            for signal, method in _GRPC_METHODS.items()
        }

    def send(self, item: _Item) -> int:
        grpc = self._grpc
        try:
            response = self._calls[item.signal](
                item.payload, timeout=self._timeout_s, metadata=self._metadata,
                compression=self._compression,
            )
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            retryable = code in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.DATA_LOSS,
            )
            # RESOURCE_EXHAUSTED is only retryable when the server says when (OTLP spec).
            delay = _grpc_retry_delay(exc)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and delay is None:
                retryable = False
            details = exc.details() if hasattr(exc, "details") else str(exc)
            name = code.name if code is not None else "error"
            raise SendError(f"gRPC {name}: {details}", retryable, delay) from None
        return _rejected(response)

    def close(self) -> None:
        self._channel.close()


def _grpc_retry_delay(exc: Any) -> float | None:
    """The RetryInfo delay in the `grpc-status-details-bin` trailer, if the server sent one."""
    try:
        trailers = exc.trailing_metadata() or ()
    except Exception:
        return None
    for key, value in trailers:
        if key != "grpc-status-details-bin":
            continue
        try:
            from google.rpc import error_details_pb2, status_pb2

            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
        except Exception:
            return None
    return None


def _rejected(response: Any) -> int:
    partial = response.partial_success
    return int(getattr(partial, "rejected_spans", 0) or getattr(partial, "rejected_data_points", 0) or 0)


class _HttpSender:
    """POSTs over one persistent connection (only the sender thread uses it)."""

    def __init__(self, endpoint: str, headers: dict[str, str], timeout_s: float,
                 compression: str, tls: TlsFiles | None = None) -> None:
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"otlp.endpoint {endpoint!r} is not an http(s) URL")
        path = parsed.path.rstrip("/")
        if path:
            # An explicit path is the traces URL (otelcol's traces_endpoint); metrics go
            # to its sibling.
            self._paths = {"traces": path, "metrics": path.rsplit("/", 1)[0] + "/metrics"}
        else:
            self._paths = dict(_HTTP_PATHS)
        self._https = parsed.scheme == "https"
        if tls is not None and tls.configured and not self._https:
            raise ValueError(f"otlp.tls is set but the endpoint {endpoint!r} is not https://")
        try:
            self._ssl = tls.ssl_context() if tls is not None and self._https else None
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"otlp.tls: cannot use the certificate files: {exc}") from None
        self._conn = HttpClient(endpoint, timeout_s, self._ssl)
        self._headers = {"Content-Type": "application/x-protobuf", **headers}
        self._gzip = compression == "gzip"

    def send(self, item: _Item) -> int:
        body = gzip.compress(item.payload, compresslevel=1) if self._gzip else item.payload
        headers = dict(self._headers)
        if self._gzip:
            headers["Content-Encoding"] = "gzip"
        url = self._conn.origin + self._paths[item.signal]
        try:
            reply = self._conn.request("POST", self._paths[item.signal], body=body,
                                       headers=headers)
        except TransportError as exc:
            raise SendError(f"cannot reach {url}: {exc.reason}", True) from None
        if not 200 <= reply.status < 300:
            raise SendError(
                f"HTTP {reply.status} from {url}", reply.status in _RETRYABLE_HTTP,
                _parse_retry_after(reply.headers.get("Retry-After")),
            )
        try:
            return _rejected(_RESPONSES[item.signal].FromString(reply.body)) if reply.body else 0
        except Exception:
            return 0  # a 2xx with an unreadable body still means accepted

    def close(self) -> None:
        self._conn.close()


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class OtlpExporter:
    def __init__(
        self,
        endpoint: str,
        protocol: str | None = None,
        headers: dict[str, str] | None = None,
        compression: str = "none",
        timeout: object = "10s",
        tls: dict[str, Any] | None = None,
        sending_queue: dict[str, Any] | None = None,
        retry_on_failure: dict[str, Any] | None = None,
        shutdown_timeout: object = "5s",
    ) -> None:
        if not endpoint or not isinstance(endpoint, str):
            raise ValueError("otlp.endpoint is required, e.g. localhost:4317 or http://host:4318")
        self.protocol = _protocol(endpoint, protocol)
        if compression not in ("none", "gzip", ""):
            raise ValueError(f"otlp.compression must be none or gzip, got {compression!r}")
        timeout_s = options.duration_s(timeout, "otlp.timeout")
        queue = dict(sending_queue or {})
        self.queue_size = options.count(queue.pop("queue_size", 1000), "otlp.sending_queue.queue_size", minimum=1)
        self.queue_max_bytes = options.size_bytes(queue.pop("max_size", "256MiB"), "otlp.sending_queue.max_size")
        queue.pop("enabled", None)
        queue.pop("num_consumers", None)  # one sender keeps batches in order
        if queue:
            raise ValueError(f"otlp.sending_queue: unknown option {next(iter(queue))!r}")
        retry = dict(retry_on_failure or {})
        self.retry_enabled = bool(retry.pop("enabled", True))
        self.initial_interval_s = options.duration_s(retry.pop("initial_interval", "1s"), "otlp.retry_on_failure.initial_interval")
        self.max_interval_s = options.duration_s(retry.pop("max_interval", "30s"), "otlp.retry_on_failure.max_interval")
        self.max_elapsed_s = options.duration_s(retry.pop("max_elapsed_time", "300s"), "otlp.retry_on_failure.max_elapsed_time")
        self.multiplier = float(retry.pop("multiplier", 1.5))
        self.randomization = float(retry.pop("randomization_factor", 0.5))
        if self.multiplier < 1 or not 0 <= self.randomization <= 1:
            raise ValueError("otlp.retry_on_failure: multiplier must be >= 1 and "
                             "randomization_factor between 0 and 1")
        if retry:
            raise ValueError(f"otlp.retry_on_failure: unknown option {next(iter(retry))!r}")
        self.shutdown_timeout_s = options.duration_s(shutdown_timeout, "otlp.shutdown_timeout")
        headers = {str(k): str(v) for k, v in (headers or {}).items()}
        tls_files = TlsFiles(dict(tls or {}))
        if self.protocol == "grpc":
            target, secure = _grpc_target(endpoint, tls_files)
            self._sender: _GrpcSender | _HttpSender = _GrpcSender(
                target, secure, headers, timeout_s, compression or "none", tls_files
            )
        else:
            url = endpoint if "://" in endpoint else "http://" + endpoint
            self._sender = _HttpSender(url, headers, timeout_s, compression or "none", tls_files)
        self.endpoint = endpoint
        self._queue: collections.deque[_Item] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._in_flight = False
        self._counters = dict.fromkeys((
            "sent_requests", "sent_items", "dropped_requests", "dropped_items",
            "failed_requests", "rejected_items", "retries",
        ), 0.0)
        self.last_error = ""
        # While the target fails: since when (monotonic), how many attempts, last log time
        self._failing_since: float | None = None
        self._failed_attempts = 0
        self._logged_at = 0.0
        self._thread = threading.Thread(target=self._run, name="flare-otlp-forward", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller side (never blocks)
    def export_traces(self, request: Any) -> None:
        items = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        self._enqueue(_Item("traces", request.SerializeToString(), items))

    def export_metrics(self, request: Any) -> None:
        items = sum(
            _data_points(m) for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        )
        self._enqueue(_Item("metrics", request.SerializeToString(), items))

    def _enqueue(self, item: _Item) -> None:
        with self._cond:
            if self._stopping:
                self._count_drop(item)
                return
            self._queue.append(item)
            self._queued_bytes += len(item.payload)
            while len(self._queue) > self.queue_size or (
                self._queued_bytes > self.queue_max_bytes and len(self._queue) > 1
            ):
                oldest = self._queue.popleft()
                self._queued_bytes -= len(oldest.payload)
                self._count_drop(oldest)
            self._cond.notify()

    def _count_drop(self, item: _Item) -> None:
        self._counters["dropped_requests"] += 1
        self._counters["dropped_items"] += item.items

    def flush(self) -> None:
        """Nothing to make durable here: forwarding is best effort, and waiting for the
        target would let a slow backend stall the store path."""

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the queue is empty and nothing is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def metrics(self) -> dict[str, float]:
        with self._cond:
            out = dict(self._counters)
            out["queue_requests"] = float(len(self._queue))
            out["queue_bytes"] = float(self._queued_bytes)
            out["failing"] = 1.0 if self._failing_since is not None else 0.0
        return out

    def failing_for_s(self) -> float | None:
        """Seconds the target has been failing, None while it takes what is sent."""
        since = self._failing_since
        return None if since is None else time.monotonic() - since

    def _note_failure(self, error: SendError) -> None:
        """A failed attempt: said at once the first time, then at most every 30 s while
        the target keeps failing (a forward target that is down must not stay silent,
        nor flood the log)."""
        now = time.monotonic()
        with self._cond:
            self._failed_attempts += 1
            first = self._failing_since is None
            if first:
                self._failing_since = now
            due = first or now - self._logged_at >= FAILING_LOG_EVERY_S
            if due:
                self._logged_at = now
            attempts, queued = self._failed_attempts, len(self._queue)
            since = now - self._failing_since
        if due:
            log.warning("forwarding to %s is failing%s: %s (%d attempts over %.0f s, %d requests "
                        "queued; the store keeps everything)", self.endpoint,
                        "" if error.retryable else " (not retryable)", error, attempts, since, queued)

    def _note_success(self) -> None:
        with self._cond:
            if self._failing_since is None:
                return
            attempts, since = self._failed_attempts, time.monotonic() - self._failing_since
            self._failing_since, self._failed_attempts = None, 0
        log.warning("forwarding to %s works again after %d failed attempts over %.0f s",
                    self.endpoint, attempts, since)

    def shutdown(self) -> None:
        self.wait_idle(self.shutdown_timeout_s)
        with self._cond:
            self._stopping = True
            while self._queue:
                item = self._queue.popleft()
                self._queued_bytes -= len(item.payload)
                self._count_drop(item)
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, self.shutdown_timeout_s))
        self._sender.close()

    # ------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                item = self._queue.popleft()
                self._queued_bytes -= len(item.payload)
                self._in_flight = True
            try:
                self._send_with_retry(item)
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()

    def _send_with_retry(self, item: _Item) -> None:
        started = time.monotonic()
        backoff = self.initial_interval_s
        while True:
            try:
                rejected = self._sender.send(item)
            except SendError as exc:
                self.last_error = str(exc)
                self._note_failure(exc)
                elapsed = time.monotonic() - started
                delay = exc.retry_after_s
                if delay is None:
                    # Jitter keeps many collectors from retrying in lock step (otelcol's
                    # defaults: x1.5 per attempt, +-50%).
                    delay = backoff * (1 + self.randomization * (2 * random.random() - 1))
                    backoff = min(backoff * self.multiplier, self.max_interval_s)
                if not exc.retryable or not self.retry_enabled or elapsed + delay > self.max_elapsed_s:
                    with self._cond:
                        self._counters["failed_requests"] += 1
                        self._counters["dropped_items"] += item.items
                    return
                with self._cond:
                    self._counters["retries"] += 1
                    if self._cond.wait_for(lambda: self._stopping, timeout=delay):
                        self._counters["failed_requests"] += 1
                        self._counters["dropped_items"] += item.items
                        return
                continue
            self._note_success()
            with self._cond:
                self._counters["sent_requests"] += 1
                self._counters["sent_items"] += item.items - rejected
                self._counters["rejected_items"] += rejected
            return


def _data_points(metric: Any) -> int:
    data = metric.WhichOneof("data")
    return len(getattr(metric, data).data_points) if data else 0


def _protocol(endpoint: str, protocol: str | None) -> str:
    if protocol is None or protocol == "":
        parsed = urllib.parse.urlsplit(endpoint if "://" in endpoint else "//" + endpoint)
        is_http = "://" in endpoint and (parsed.port == 4318 or parsed.path not in ("", "/"))
        return "http/protobuf" if is_http else "grpc"
    if protocol in ("http", "http/protobuf"):
        return "http/protobuf"
    if protocol == "grpc":
        return "grpc"
    raise ValueError(f"otlp.protocol must be grpc or http/protobuf, got {protocol!r}")


def _grpc_target(endpoint: str, tls: TlsFiles) -> tuple[str, bool]:
    insecure = tls.insecure
    if "://" in endpoint:
        parsed = urllib.parse.urlsplit(endpoint)
        if not parsed.hostname:
            raise ValueError(f"otlp.endpoint {endpoint!r} has no host")
        host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
        target = f"{host}:{parsed.port or 4317}"
        secure = parsed.scheme == "https"
    else:
        # host:port is plaintext unless certificate files ask for TLS.
        target, secure = endpoint, tls.configured
    if insecure is not None:
        secure = not bool(insecure)
    return target, secure


class OtlpHttpExporter(OtlpExporter):
    """otelcol's `otlphttp`: the same exporter with HTTP/protobuf."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        kwargs.setdefault("protocol", "http/protobuf")
        super().__init__(endpoint, **kwargs)
