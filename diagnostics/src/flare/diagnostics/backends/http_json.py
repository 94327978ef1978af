"""JSON over HTTP(S) for the diagnosis backends (Jaeger, Tempo, the collector's control
channel): TLS, mTLS and a bearer token from the `FLARE_BACKEND_*` settings, on Flare's one
HTTP client (`flare.wire.http_client`), every failure a BackendError."""

from __future__ import annotations

import json
import os
import ssl
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from flare.diagnostics.backends.base import BackendError
from flare.wire import http_client
from flare.wire import semconv as sc


class JsonClient:
    """JSON over HTTP(S) with TLS, mTLS and a bearer token, on Flare's HTTP client
    (`flare.wire.http_client`).

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
