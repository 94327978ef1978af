"""The one HTTP(S) client Flare sends with: the ranks' OTLP/HTTP span exporter
(`otlp_http`), the collector's OTLP/HTTP forwarder and the Jaeger and Tempo backends of
the diagnosis.

urllib3 underneath (a keep-alive connection pool per origin; requests and the SDK's own
HTTP transports ride it too). What is Flare's here is small: one origin per client, a
timeout, TLS from a given `ssl.SSLContext`, failures as one `TransportError` whose kind
the caller turns into its own sentence, one more connection when the server had closed
the kept one, and `close()` ending a request in flight. That last one is what urllib3
has no call for: a rank's exit deadline stops its exporter, and a collector that
accepted the connection and never answers must not hold the rank for the request
timeout. The connections a pool opens are tracked (its public `ConnectionCls`), and
`close()` shuts their sockets down, which wakes a thread blocked sending or waiting for
the reply at once (closing a socket alone would not).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import NamedTuple

import urllib3
from urllib3 import exceptions as _errors


def tls_context(verify: bool | str = True, cert_file: str | None = None,
                key_file: str | None = None) -> ssl.SSLContext:
    """The client TLS context every Flare client uses: the system's trust store, or
    `verify` as a CA file; no verification where `verify` is False (a user's explicit
    insecure choice); a client certificate (and its key) where given. Raises OSError or
    ssl.SSLError for a file that cannot be read."""
    context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if verify is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


def otlp_tls_from_env(certificate_file: str | None = None, client_key_file: str | None = None,
                      client_certificate_file: str | None = None) -> tuple[bool | str, str | None, str | None]:
    """(verify, client certificate, client key) as the OTLP exporter's settings give
    them: the arguments, then the traces and the generic environment variables
    (OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE, …_CLIENT_CERTIFICATE, …_CLIENT_KEY); the
    span exporter and the OpAMP agent read them here, once each."""
    def first(given: str | None, name: str) -> str | None:
        return (given or os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
                or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}") or None)

    return (first(certificate_file, "CERTIFICATE") or True,
            first(client_certificate_file, "CLIENT_CERTIFICATE"), first(client_key_file, "CLIENT_KEY"))


class TransportError(Exception):
    """The request got no complete answer. `kind`:

    - "connect": it did not reach the server (refused, unreachable, the kept connection
      closed under it twice, the client closed);
    - "tls": the TLS handshake failed;
    - "timeout": no answer within the timeout;
    - "reply": the answer was cut off or is not HTTP (the request may have been
      processed).
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class Reply(NamedTuple):
    status: int
    reason: str
    headers: Mapping[str, str]  # case-insensitive; repeated names joined with ", "
    body: bytes


class _Connections:
    """The connections of one pool, so that `close()` can end the requests in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: weakref.WeakSet = weakref.WeakSet()
        self.aborted = False

    def opened(self, connection) -> None:
        with self.lock:
            if not self.aborted:
                self.open.add(connection)
                return
        _shut(connection.sock)  # connected while the client closed: end it as well

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            connections = list(self.open)
        for connection in connections:
            _shut(connection.sock)


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _tracked(connection_class: type, connections: _Connections) -> type:
    class TrackedConnection(connection_class):
        def connect(self) -> None:
            super().connect()
            connections.opened(self)

    return TrackedConnection


class _Pool(NamedTuple):
    pool: urllib3.HTTPConnectionPool
    connections: _Connections


_URLLIB3_1 = urllib3.__version__.startswith("1.")
_STALE = (ConnectionResetError, BrokenPipeError)  # (http.client.RemoteDisconnected is one)


class HttpClient:
    """Requests to one origin (`url`'s scheme, host and port; its path is `prefix`) on
    kept-alive connections, from any number of threads."""

    def __init__(self, url: str, timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port  # ValueError on a port that is not a number in 0-65535
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL")
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname
        self.port = port or (443 if self.https else 80)
        self.origin = f"{parsed.scheme}://{parsed.netloc}"
        self.prefix = parsed.path.rstrip("/")
        self.timeout_s = timeout_s
        self._ssl = ssl_context if self.https else None
        if self._ssl is not None and _URLLIB3_1:
            # urllib3 1.x sends no server name to an IP address, which a context that
            # checks the host name refuses; it checks the name itself after the handshake
            self._ssl.check_hostname = False
        self._lock = threading.Lock()
        self._current: _Pool | None = None

    def _pool(self) -> _Pool:
        with self._lock:
            if self._current is None:
                options = {"timeout": self.timeout_s, "maxsize": 1, "block": False,
                           "retries": False}
                if self.https:
                    pool = urllib3.HTTPSConnectionPool(self.host, self.port,
                                                       ssl_context=self._ssl, **options)
                else:
                    pool = urllib3.HTTPConnectionPool(self.host, self.port, **options)
                connections = _Connections()
                pool.ConnectionCls = _tracked(pool.ConnectionCls, connections)
                self._current = _Pool(pool, connections)
            return self._current

    def request(self, method: str, target: str, body: bytes | None = None,
                headers: Mapping[str, str] | None = None,
                timeout_s: float | None = None) -> Reply:
        """One request; `target` is the path and query. Raises `TransportError`."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        retried = False
        while True:
            current = self._pool()
            try:
                response = current.pool.urlopen(
                    method, target, body=body, headers=dict(headers or {}), retries=False,
                    redirect=False, timeout=timeout, preload_content=True,
                    enforce_content_length=True)
            except (_errors.HTTPError, OSError) as exc:
                if current.connections.aborted:
                    raise TransportError("connect", "the client was closed") from None
                kind, cause = _classify(exc)
                if kind == "stale":
                    if not retried:  # the server had closed the kept connection: once more
                        retried = True
                        continue
                    kind = "connect"
                if kind == "timeout":
                    raise TransportError(kind, f"no answer within {timeout:g} s") from None
                raise TransportError(kind, _reason(cause)) from None
            return Reply(response.status, response.reason or "", response.headers,
                         response.data or b"")

    def close(self) -> None:
        """Close the connections and end the requests in flight (they fail with
        "connect"); a later request opens a new connection."""
        with self._lock:
            current, self._current = self._current, None
        if current is not None:
            current.connections.abort()
            current.pool.close()


def _classify(exc: BaseException) -> tuple[str, BaseException]:
    """(kind, the error underneath urllib3's wrapping)."""
    cause = exc
    while isinstance(cause, _errors.HTTPError):
        inner = next((arg for arg in reversed(cause.args) if isinstance(arg, BaseException)),
                     None) or cause.__cause__ or cause.__context__
        if inner is None:
            break
        cause = inner
    if isinstance(exc, _errors.SSLError) or isinstance(cause, ssl.SSLError):
        return "tls", cause
    if isinstance(exc, _errors.NewConnectionError):  # (a ConnectTimeoutError subclass)
        return "connect", cause
    if isinstance(exc, _errors.TimeoutError) or isinstance(cause, TimeoutError):
        return "timeout", cause
    if isinstance(cause, _STALE):
        return "stale", cause
    if isinstance(exc, _errors.ProtocolError) and isinstance(cause, OSError):
        return "connect", cause
    return "reply", cause


def _reason(cause: BaseException) -> str:
    if isinstance(cause, ssl.SSLError):  # the verifier's sentence, else OpenSSL's code
        reason = getattr(cause, "verify_message", None) or getattr(cause, "reason", None)
        if reason:
            return str(reason)
    return getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
