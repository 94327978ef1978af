"""The one HTTP(S) client Flare's own processes send with: the collector's OTLP/HTTP
forwarder (`otlp.py`) and the Jaeger and Tempo backends of the diagnosis.

One keep-alive connection to one origin (both send many small requests in a row from
one thread), TLS with a given `ssl.SSLContext` (CA, client certificate), a timeout, and
one reconnect when the server had already closed the kept connection. Failures are one
`TransportError` with a kind the caller turns into its own sentence. The standard
library's `http.client` underneath: both callers' needs are this small, and no third-
party client is a dependency of the collector (the ranks' exporter has its own path,
`flare.instrumentation.otlp_http`).
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from collections.abc import Mapping


class TransportError(Exception):
    """The request did not get an answer: `kind` is "tls", "timeout" or "connect"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class HttpConnection:
    def __init__(self, url: str, timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> None:
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
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.https:
                self._conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s, context=self._ssl)
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return self._conn

    def request(self, method: str, target: str, body: bytes | None = None,
                headers: Mapping[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        """(status, headers, body) of one request; `target` is the path and query."""
        last: Exception | None = None
        for attempt in range(2):
            conn = self._connection()
            try:
                conn.request(method, target, body=body, headers=dict(headers or {}))
                response = conn.getresponse()
                data = response.read()
            except ssl.SSLError as exc:
                self.close()
                raise TransportError("tls", str(exc.reason or exc)) from None
            except TimeoutError:
                self.close()
                raise TransportError("timeout", f"no answer within {self.timeout_s:g} s") from None
            except (OSError, http.client.HTTPException) as exc:
                self.close()  # reopened on the next request
                last = exc
                if attempt == 0 and isinstance(exc, (http.client.RemoteDisconnected,
                                                     ConnectionResetError, BrokenPipeError)):
                    continue  # the kept connection was closed by the server: once more
                break
            if response.will_close:
                self.close()
            return response.status, response.headers, data
        reason = getattr(last, "strerror", None) or str(last) or type(last).__name__
        raise TransportError("connect", reason)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
