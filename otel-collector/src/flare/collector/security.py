"""Transport security for the collector's endpoints: TLS, mutual TLS, bearer tokens.

Configuration, on any OTLP receiver protocol and on the HTTP extensions, has
the shape of upstream `otelcol`'s `configtls` / bearer-token settings:

    tls:  {cert_file: server.pem, key_file: server.key, client_ca_file: ca.pem}
    auth: {bearer_token: ${env:FLARE_TOKEN}}          # or bearer_token_file: path

`client_ca_file` turns on mutual TLS: a client must present a certificate signed by
that CA. Endpoints bind to loopback by default; `exposure_problem()` names the
configurations that would put an unauthenticated endpoint on the network.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "ca_file", "min_version"}
_AUTH_KEYS = {"bearer_token", "bearer_token_file"}


class SecurityConfigError(ValueError):
    """A TLS or auth setting that cannot work; the message is one sentence."""


def _read(path_value: Any, what: str) -> bytes:
    if not path_value:
        raise SecurityConfigError(f"tls.{what} is required")
    path = Path(os.path.expanduser(str(path_value)))
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read tls.{what} {path}: {exc.strerror}") from None


def _check_keys(cfg: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise SecurityConfigError(
            f"unknown key {unknown[0]!r} in {where} (allowed: {', '.join(sorted(allowed))})"
        )


def _client_ca(tls_cfg: Mapping[str, Any]) -> Any:
    # upstream otelcol calls it client_ca_file; accept ca_file as its alias
    return tls_cfg.get("client_ca_file") or tls_cfg.get("ca_file")


def server_credentials(tls_cfg: Mapping[str, Any]) -> grpc.ServerCredentials:
    """gRPC server credentials; with a client CA, clients must present a certificate."""
    _check_keys(tls_cfg, _TLS_KEYS, "tls")
    cert = _read(tls_cfg.get("cert_file"), "cert_file")
    key = _read(tls_cfg.get("key_file"), "key_file")
    ca_path = _client_ca(tls_cfg)
    client_ca = _read(ca_path, "client_ca_file") if ca_path else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def ssl_context(tls_cfg: Mapping[str, Any]) -> ssl.SSLContext:
    """A server-side SSLContext for the HTTP receiver and the query endpoint."""
    _check_keys(tls_cfg, _TLS_KEYS, "tls")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = (
        ssl.TLSVersion.TLSv1_3 if str(tls_cfg.get("min_version", "1.2")) == "1.3"
        else ssl.TLSVersion.TLSv1_2
    )
    cert, key = tls_cfg.get("cert_file"), tls_cfg.get("key_file")
    _read(cert, "cert_file")
    _read(key, "key_file")
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        raise SecurityConfigError(
            f"tls.cert_file {cert} and tls.key_file {key} do not form a certificate chain: "
            f"{exc.reason or exc}"
        ) from None
    ca_path = _client_ca(tls_cfg)
    if ca_path:
        _read(ca_path, "client_ca_file")
        try:
            context.load_verify_locations(cafile=str(ca_path))
        except ssl.SSLError as exc:
            raise SecurityConfigError(
                f"tls.client_ca_file {ca_path} is not a CA certificate: {exc.reason or exc}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class BearerAuth:
    """Checks `Authorization: Bearer <token>`; counts what it turns away.

    The comparison is constant-time, so the token cannot be guessed byte by byte
    from response timing. `rejected` is read by the collector's self-metrics.
    """

    def __init__(self, token: str | None = None, *, token_file: str | None = None) -> None:
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise SecurityConfigError(
                    f"cannot read auth.bearer_token_file {token_file}: {exc.strerror}"
                ) from None
        if not token:
            raise SecurityConfigError("auth.bearer_token is empty")
        self._expected = f"Bearer {token}".encode()
        self._lock = threading.Lock()
        self.rejected = 0
        self.accepted = 0

    @classmethod
    def from_config(cls, auth_cfg: Mapping[str, Any]) -> BearerAuth:
        _check_keys(auth_cfg, _AUTH_KEYS, "auth")
        return cls(auth_cfg.get("bearer_token"), token_file=auth_cfg.get("bearer_token_file"))

    def check(self, *header_values: str | bytes | None) -> bool:
        """True for exactly one `Authorization` value carrying the token.

        Pass every `Authorization` header of the request: more than one is refused,
        over HTTP and gRPC alike, rather than trusting the first or the last.
        """
        values = [v for v in header_values if v is not None]
        ok = len(values) <= 1
        if ok:
            given = values[0] if values else b""
            given = (given if isinstance(given, bytes) else given.encode("utf-8", "replace")).strip()
            # "bearer" is case-insensitive in RFC 6750; normalise the scheme only.
            if given[:7].lower() == b"bearer ":
                given = b"Bearer " + given[7:].strip()
            ok = hmac.compare_digest(given, self._expected)
        with self._lock:
            if ok:
                self.accepted += 1
            else:
                self.rejected += 1
        return ok

    def check_metadata(self, metadata: Any) -> bool:
        """`check` on a gRPC call's invocation metadata (every `authorization` entry)."""
        return self.check(*(value for key, value in metadata or () if key == "authorization"))


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Rejects gRPC calls without the token (UNAUTHENTICATED) before any handler runs."""

    def __init__(self, auth: BearerAuth) -> None:
        self.auth = auth

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if self.auth.check_metadata(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        return self._deny


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(
    endpoint: str, tls_cfg: Mapping[str, Any] | None, auth_cfg: Mapping[str, Any] | None
) -> str | None:
    """A sentence when `endpoint` is reachable off-host with neither TLS nor a token."""
    host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
    if _is_loopback(host) or tls_cfg or auth_cfg:
        return None
    return (
        f"endpoint {endpoint} is reachable from other hosts with neither TLS nor a bearer token; "
        "bind it to 127.0.0.1 or add tls/auth settings"
    )
