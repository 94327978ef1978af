"""OTLP/HTTP receiver: POST /v1/traces and /v1/metrics, protobuf or JSON; and the
OpAMP endpoint and its capture requests (`opamp.py`) behind the same TLS and token.

Served by `http_server` (the server the extensions use too: framing, caps, the token
before the body): OTLP clients send few, large requests per connection, so
per-request overhead is small next to decoding (`benchmarks/collector_e2e_ingest.py`
measures it). Status codes per the OTLP spec: 400 malformed (with a google.rpc.Status
body), 413 over the body cap (compressed or decompressed), 415 unknown content type
or encoding, 429 (full memory or queue budget) and 503 (cannot persist) with
Retry-After, 401 without a valid bearer token.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from google.rpc import code_pb2, status_pb2

from flare.collector import opamp, otlp_json
from flare.collector.config import ProtocolConfig
from flare.collector.errors import MalformedPayload, PayloadTooLarge, Refused
from flare.collector.http_server import Handler, HttpService, Response, Server
from flare.collector.receiver import METRICS, TRACES, Acceptor
from flare.collector.telemetry import Counters

_PATHS = {"/v1/traces": TRACES, "/v1/metrics": METRICS}
_AGENTS = "/flare/v1/agents"
_CONTROL = (opamp.PATH, "/flare/v1/capture", _AGENTS)
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo Content-Encoding, refusing output over `limit` bytes (zip bombs included)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    else:
        raise MalformedPayload(f"unsupported Content-Encoding {encoding!r} (use gzip, deflate or none)")
    try:
        out = decoder.decompress(body, limit + 1)
        if len(out) > limit:
            raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes")
        if not decoder.eof:
            raise MalformedPayload(f"truncated {encoding} body")
    except zlib.error as exc:
        raise MalformedPayload(f"body is not valid {encoding}: {exc}") from None
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def capture_request(body: bytes) -> tuple[str | None, list[int], int, bool]:
    """(job, ranks, steps, stacks) of a capture request's JSON; ValueError names what is
    wrong (types are checked, not coerced: `"job": ["a"]` is refused, not read as "['a']")."""
    try:
        asked = json.loads(body or b"{}", parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(asked, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(asked) - {"job", "ranks", "steps", "stacks"})
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}")
    job = asked.get("job")
    if job is not None and (not isinstance(job, str) or not job or len(job) > opamp.MAX_FIELD_CHARS):
        raise ValueError(f"job must be a string of 1-{opamp.MAX_FIELD_CHARS} characters")
    ranks = asked.get("ranks")
    if not isinstance(ranks, list) or not ranks or len(ranks) > 65536 or not all(
            type(r) is int and 0 <= r < 1 << 31 for r in ranks):
        raise ValueError("ranks must be a list of 1-65536 ranks (whole numbers from 0)")
    steps = asked.get("steps", opamp.DEFAULT_STEPS)
    if type(steps) is not int or not 0 < steps <= opamp.MAX_STEPS:
        raise ValueError(f"steps must be a whole number from 1 to {opamp.MAX_STEPS}")
    stacks = asked.get("stacks", True)
    if not isinstance(stacks, bool):
        raise ValueError("stacks must be true or false")
    return job, ranks, steps, stacks


_RPC_CODES = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED, 413: code_pb2.INVALID_ARGUMENT,
              429: code_pb2.RESOURCE_EXHAUSTED, 500: code_pb2.INTERNAL, 503: code_pb2.UNAVAILABLE}


class _Handler(Handler):
    server: Server

    def respond(self, method: str, path: str) -> Response:
        receiver: HttpReceiver = self.server.owner  # type: ignore[assignment]
        if receiver.opamp is not None and path in _CONTROL:
            return self._control(receiver, method, path)
        if method != "POST":
            receiver.counters.add("unsupported_requests", transport="http")
            return 405, {"Content-Type": "text/plain"}, b"OTLP/HTTP takes POST requests\n"
        kind = _PATHS.get(path)
        if kind is None:
            receiver.counters.add("unsupported_requests", transport="http")
            return 404, {"Content-Type": "text/plain"}, \
                f"no OTLP endpoint at {self.path}; use /v1/traces or /v1/metrics\n".encode()
        content_type = self._content_type()
        if content_type not in (_PROTOBUF, _JSON):
            receiver.counters.add("unsupported_requests", transport="http")
            return 415, {"Content-Type": "text/plain"}, \
                f"unsupported Content-Type {content_type or '(none)'!r}; use {_PROTOBUF} or {_JSON}\n".encode()
        is_json = content_type == _JSON
        limit = receiver.max_body_bytes
        try:
            if self.body_length is None:
                raise MalformedPayload("Content-Length or chunked Transfer-Encoding is required")
            body = decompress(self.read_body(), self.headers.get("Content-Encoding") or "", limit)
        except MalformedPayload:  # a body that is not one (framing, encoding): counted
            receiver.counters.add("malformed_requests", transport="http")  # here, as the
            raise  # acceptor counts what does not decode as OTLP
        try:
            response = receiver.acceptor.accept(kind, body, "http", is_json=is_json)
        except Refused as refused:
            return self.error(429 if refused.overloaded else 503, refused.reason, refused.retry_after_s)
        if is_json:
            return 200, {"Content-Type": _JSON}, otlp_json.dumps(response)
        return 200, {"Content-Type": _PROTOBUF}, response.SerializeToString()

    def _control(self, receiver: HttpReceiver, method: str, path: str) -> Response:
        """OpAMP (POST /v1/opamp), a capture request (POST /flare/v1/capture, JSON
        `{"job", "ranks", "steps", "stacks"}`) and the agents (GET /flare/v1/agents?job=),
        each within the credentials `opamp` checks (its docstring: who is who)."""
        server = receiver.opamp
        wanted = "GET" if path == _AGENTS else "POST"
        if method != wanted:
            receiver.counters.add("unsupported_requests", transport="http")
            return 405, {"Content-Type": "text/plain"}, f"{path} takes {wanted} requests\n".encode()
        headers = self.headers
        try:
            if path == _AGENTS:
                from urllib.parse import parse_qs, urlsplit

                job = (parse_qs(urlsplit(self.path).query).get("job") or [None])[0]
                server.check_control(headers, job)
                rows = server.agents(job, with_uids=server.is_operator(headers))
                return 200, {"Content-Type": _JSON}, json.dumps({"agents": rows}).encode()
            if self.body_length is None:
                raise MalformedPayload("Content-Length or chunked Transfer-Encoding is required")
            body = self.read_body(opamp.MAX_MESSAGE_BYTES)
            if path == opamp.PATH:
                status, answer = server.handle(body, headers)
                return status, {"Content-Type": opamp.CONTENT_TYPE}, answer
            try:
                job, ranks, steps, stacks = capture_request(body)
            except ValueError as exc:
                return 400, {"Content-Type": "text/plain"}, f"capture request refused: {exc}\n".encode()
            server.check_control(headers, job)
            try:
                result = server.request_capture(job, ranks, steps, stacks=stacks)
            except ValueError as exc:
                return 400, {"Content-Type": "text/plain"}, f"capture request refused: {exc}\n".encode()
        except opamp.Denied as denied:
            server.refused(denied)
            return denied.status, {"Content-Type": "text/plain"}, f"{denied}\n".encode()
        return 200, {"Content-Type": _JSON}, json.dumps(result).encode()

    def _content_type(self) -> str:
        return (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()

    def error(self, status: int, message: str, retry_after_s: float | None = None) -> Response:
        """A google.rpc.Status in the request's content type (protobuf unless JSON)."""
        if status not in _RPC_CODES:
            return super().error(status, message)
        headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else {}
        if self._content_type() == _JSON:
            headers["Content-Type"] = _JSON
            return status, headers, json.dumps({"code": _RPC_CODES[status], "message": message}).encode()
        headers["Content-Type"] = _PROTOBUF
        return status, headers, status_pb2.Status(code=_RPC_CODES[status], message=message).SerializeToString()


class HttpReceiver(HttpService):
    handler = _Handler

    def __init__(
        self,
        receiver_id: str,
        options: ProtocolConfig,
        acceptor: Acceptor,
        counters: Counters,
        auth: Any | None = None,
        opamp_server: opamp.OpampServer | None = None,
    ) -> None:
        super().__init__("OTLP/HTTP", "http", f"http-{receiver_id}", options.endpoint, options.tls, counters, options.max_body_bytes,
                         options.limits)
        self.id = receiver_id
        self.options = options
        self.acceptor = acceptor
        self.auth = auth
        self.opamp = opamp_server
