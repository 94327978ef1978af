"""Collector configuration in the shape of an `otelcol` file.

    receivers:  {otlp: {protocols: {grpc: {endpoint}, http: {endpoint}}}}
    processors: {<type>[/<name>]: {...}}     types from flare.processors.REGISTRY
    exporters:  {<type>[/<name>]: {...}}     types from flare.exporters.REGISTRY
    extensions: {flare_wal: {...}, flare_metrics: {...}, flare_query: {...}}
    service:
      extensions: [...]
      pipelines:  {traces[/<name>]: {receivers, processors, exporters}, metrics…}
      flush_interval, drain_timeout, queue_max_size      (Flare additions)

`${env:VAR}` and `${env:VAR:-default}` are substituted in every string value (the
default may itself be one `${env:…}` reference; a value
that is only a reference takes the type its text reads as, so ports stay integers);
`$$` is a literal `$`. Everything is checked before anything starts: an unknown
component, option or bad value is one `ConfigError` sentence naming where it is.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flare.collector.config_values import (
    Endpoint,
    parse_bool,
    parse_duration,
    parse_endpoint,
    parse_size,
)
from flare.collector.errors import ConfigError

log = logging.getLogger(__name__)

SIGNALS = ("traces", "metrics")
RECEIVER_TYPES = ("otlp",)
EXTENSION_TYPES = ("flare_wal", "flare_metrics", "flare_query", "flare_opamp")
DEFAULT_MAX_BODY = 64 << 20
DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318

# A default may itself be one reference: ${env:FLARE_METRICS_HOST:-${env:FLARE_HOST:-127.0.0.1}}
_ENV_REF = re.compile(r"\$\$|\$\{env:([A-Za-z_][A-Za-z0-9_]*)"
                      r"(?::-((?:[^}$]|\$\{env:[A-Za-z_][A-Za-z0-9_]*(?::-[^}$]*)?\})*))?\}")

# ---------------------------------------------------------------- typed configuration
@dataclass
class Limits:
    """What one listener gives a client before it is cut off (otelcol's confighttp names):
    a TLS handshake, a request's headers and its body each have a deadline, a kept-alive
    connection its idle time; connections (and, on gRPC, calls in flight) have a cap.
    Refusals and timeouts are counted in /metrics (`refused_connections`,
    `timed_out_requests`)."""

    handshake_timeout_s: float = 10.0
    read_header_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    idle_timeout_s: float = 120.0
    max_connections: int = 1024
    max_concurrent_calls: int = 256  # gRPC: calls admitted and not yet answered


_LIMIT_KEYS = {"handshake_timeout": "handshake_timeout_s", "read_header_timeout": "read_header_timeout_s",
               "read_timeout": "read_timeout_s", "idle_timeout": "idle_timeout_s",
               "max_connections": "max_connections", "max_concurrent_calls": "max_concurrent_calls"}


@dataclass
class ProtocolConfig:
    endpoint: Endpoint
    max_body_bytes: int = DEFAULT_MAX_BODY
    tls: dict[str, Any] | None = None
    auth: dict[str, Any] | None = None
    limits: Limits = field(default_factory=Limits)


@dataclass
class ReceiverConfig:
    id: str
    grpc: ProtocolConfig | None
    http: ProtocolConfig | None


@dataclass
class PipelineConfig:
    id: str
    signal: str
    receivers: list[str]
    processors: list[str]
    exporters: list[str]


@dataclass
class WalConfig:
    directory: Path
    fsync: bool = False
    max_bytes: int = 1 << 30
    segment_bytes: int = 64 << 20


@dataclass
class HttpExtensionConfig:
    endpoint: Endpoint
    tls: dict[str, Any] | None = None
    auth: dict[str, Any] | None = None
    store: str | None = None  # flare_query only
    health_open: bool = False  # flare_metrics only: GET /health without the token


@dataclass
class OpampConfig:
    """The control channel's credentials and bounds (`extensions.flare_opamp`; the OpAMP
    endpoint itself is served on the OTLP/HTTP receiver): see docs/collector.md."""

    operator_token: str | None = None  # lists agents' uids, asks captures of any job
    job_secret: bytes | None = None  # job tokens are HMAC-SHA256(job_secret, job id)
    max_agents: int = 20_000
    forget_after_s: float = 600.0  # a gone agent is forgotten this long after it went


@dataclass
class ServiceConfig:
    receivers: dict[str, ReceiverConfig]
    processors: dict[str, tuple[str, dict[str, Any]]]  # id -> (type, options)
    exporters: dict[str, tuple[str, dict[str, Any]]]
    pipelines: list[PipelineConfig]
    wal: WalConfig | None = None
    metrics_endpoint: HttpExtensionConfig | None = None
    query_endpoint: HttpExtensionConfig | None = None
    flush_interval_s: float = 0.5
    drain_timeout_s: float = 10.0
    queue_max_bytes: int = 256 << 20
    opamp: OpampConfig = field(default_factory=OpampConfig)
    insecure_expose: bool = False  # serve off loopback without TLS or a token (warned)
    raw: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- loading
def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML configuration and substitute `${env:…}` references."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}")
    if doc is None:
        raise ConfigError(f"config file {path} is empty")
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must be a YAML mapping at the top level")
    return substitute_env(doc)


def substitute_env(value: Any, environ: dict[str, str] | None = None,
                   _unset: set[str] | None = None) -> Any:
    env = os.environ if environ is None else environ
    unset = set() if _unset is None else _unset  # each unset variable is warned about once
    if isinstance(value, dict):
        return {k: substitute_env(v, env, unset) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_env(v, env, unset) for v in value]
    if not isinstance(value, str) or "$" not in value:
        return value
    whole = _ENV_REF.fullmatch(value)
    text = _ENV_REF.sub(lambda m: _expand(m, env, unset), value)
    if whole is not None and whole.group(0) != "$$":
        # A value that is only a reference is typed like YAML would type the text.
        try:
            typed = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            return text
        return typed if isinstance(typed, (int, float, bool, str)) else text
    return text


def _expand(match: re.Match[str], env, unset: set[str]) -> str:
    if match.group(0) == "$$":
        return "$"
    name, default = match.group(1), match.group(2)
    value = env.get(name)
    if value is None or (value == "" and default is not None):
        if default is None:
            if name not in unset:
                unset.add(name)
                log.warning("environment variable %s is not set; using an empty value", name)
            return ""
        return _ENV_REF.sub(lambda m: _expand(m, env, unset), default) if "$" in default else default
    return value


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _names(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of component names")
    return value


def _reject_unknown(options: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in options:
        if key not in known:
            raise ConfigError(
                f"{where}: unknown option {key!r} (known: {', '.join(known)})"
            )


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


# ---------------------------------------------------------------- validation
def _security_options(options: dict[str, Any], where: str) -> tuple[dict | None, dict | None]:
    tls = options.get("tls")
    auth = options.get("auth")
    if tls is not None:
        tls = _mapping(tls, f"{where}.tls")
        _reject_unknown(tls, ("cert_file", "key_file", "client_ca_file", "ca_file", "min_version"), f"{where}.tls")
        if not tls.get("cert_file") or not tls.get("key_file"):
            raise ConfigError(f"{where}.tls needs both cert_file and key_file")
    if auth is not None:
        auth = _mapping(auth, f"{where}.auth")
        _reject_unknown(auth, ("bearer_token", "bearer_token_file"), f"{where}.auth")
        if not auth.get("bearer_token") and not auth.get("bearer_token_file"):
            raise ConfigError(f"{where}.auth needs bearer_token or bearer_token_file")
    return tls, auth


def _limits(options: dict[str, Any], where: str) -> Limits:
    limits = Limits()
    for key, attr in _LIMIT_KEYS.items():
        if key not in options:
            continue
        value = options[key]
        if attr.endswith("_s"):
            seconds = parse_duration(value, f"{where}.{key}")
            if not 0 < seconds <= 86400:
                raise ConfigError(f"{where}.{key}: expected a duration between 0 and 24h, got {value!r}")
            setattr(limits, attr, seconds)
        else:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
                raise ConfigError(f"{where}.{key}: expected a whole number from 1 to 1000000, got {value!r}")
            setattr(limits, attr, value)
    return limits


def _receiver(component_id: str, options: dict[str, Any]) -> ReceiverConfig:
    where = f"receivers.{component_id}"
    if component_type(component_id) not in RECEIVER_TYPES:
        raise ConfigError(
            f"{where}: unknown receiver type {component_type(component_id)!r} "
            f"(known: {', '.join(RECEIVER_TYPES)})"
        )
    _reject_unknown(options, ("protocols",), where)
    protocols = _mapping(options.get("protocols"), f"{where}.protocols")
    _reject_unknown(protocols, ("grpc", "http"), f"{where}.protocols")
    if not protocols:
        raise ConfigError(f"{where}.protocols must enable grpc, http or both")
    parsed: dict[str, ProtocolConfig | None] = {"grpc": None, "http": None}
    for name, default_port, size_key in (
        ("grpc", DEFAULT_GRPC_PORT, "max_recv_msg_size_mib"),
        ("http", DEFAULT_HTTP_PORT, "max_request_body_size"),
    ):
        if name not in protocols:
            continue
        pwhere = f"{where}.protocols.{name}"
        popts = _mapping(protocols[name], pwhere)
        _reject_unknown(popts, ("endpoint", size_key, "tls", "auth", *_LIMIT_KEYS), pwhere)
        endpoint = parse_endpoint(popts.get("endpoint"), f"{pwhere}.endpoint", default_port)
        if size_key in popts:
            if name == "grpc":
                mib = popts[size_key]
                if isinstance(mib, bool) or not isinstance(mib, int) or mib <= 0:
                    raise ConfigError(f"{pwhere}.{size_key}: expected a positive integer, got {mib!r}")
                max_body = mib << 20
            else:
                max_body = parse_size(popts[size_key], f"{pwhere}.{size_key}")
        else:
            max_body = DEFAULT_MAX_BODY
        tls, auth = _security_options(popts, pwhere)
        parsed[name] = ProtocolConfig(endpoint, max_body, tls, auth, _limits(popts, pwhere))
    return ReceiverConfig(component_id, parsed["grpc"], parsed["http"])


def _registry(kind: str) -> dict[str, type]:
    if kind == "processors":
        from flare import processors as module
    else:
        from flare import exporters as module
    registry = getattr(module, "REGISTRY", None)
    if not isinstance(registry, dict):
        raise ConfigError(f"flare.{kind} provides no component registry; reinstall Flare")
    return registry


def _components(doc: dict[str, Any], kind: str) -> dict[str, tuple[str, dict[str, Any]]]:
    section = _mapping(doc.get(kind), kind)
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for component_id, options in section.items():
        ctype = component_type(str(component_id))
        registry = _registry(kind)
        if ctype not in registry:
            raise ConfigError(
                f"{kind}.{component_id}: unknown {kind[:-1]} type {ctype!r} "
                f"(known: {', '.join(sorted(registry))})"
            )
        out[str(component_id)] = (ctype, _mapping(options, f"{kind}.{component_id}"))
    return out


def _pipelines(service: dict[str, Any], cfg: dict[str, Any]) -> list[PipelineConfig]:
    pipelines = _mapping(service.get("pipelines"), "service.pipelines")
    if not pipelines:
        raise ConfigError("service.pipelines is empty: define a traces or metrics pipeline")
    out = []
    for pipeline_id, options in pipelines.items():
        where = f"service.pipelines.{pipeline_id}"
        signal = component_type(str(pipeline_id))
        if signal not in SIGNALS:
            raise ConfigError(f"{where}: unsupported signal {signal!r} (supported: traces, metrics)")
        options = _mapping(options, where)
        _reject_unknown(options, ("receivers", "processors", "exporters"), where)
        receivers = _names(options.get("receivers"), f"{where}.receivers")
        processors = _names(options.get("processors"), f"{where}.processors")
        exporters = _names(options.get("exporters"), f"{where}.exporters")
        if not receivers:
            raise ConfigError(f"{where} has no receivers")
        if not exporters:
            raise ConfigError(f"{where} has no exporters")
        for kind, names in (("receivers", receivers), ("processors", processors), ("exporters", exporters)):
            for name in names:
                if name not in cfg[kind]:
                    raise ConfigError(f"{where} uses {kind[:-1]} {name!r}, which {kind} does not define")
            if len(set(names)) != len(names):
                raise ConfigError(f"{where}.{kind} lists a component twice")
        out.append(PipelineConfig(str(pipeline_id), signal, receivers, processors, exporters))
    return out


def _http_extension(component_id: str, options: dict[str, Any], default_port: int) -> HttpExtensionConfig:
    where = f"extensions.{component_id}"
    known = ("endpoint", "tls", "auth") + (("store",) if component_id == "flare_query" else ("health_open",))
    _reject_unknown(options, known, where)
    tls, auth = _security_options(options, where)
    store = options.get("store")
    return HttpExtensionConfig(
        parse_endpoint(options.get("endpoint"), f"{where}.endpoint", default_port),
        tls, auth, str(store) if store else None,
        parse_bool(options.get("health_open", False), f"{where}.health_open"),
    )


def _secret(options: dict[str, Any], key: str, where: str) -> str | None:
    value, path = options.get(key), options.get(f"{key}_file")
    if value is not None and path is not None:
        raise ConfigError(f"{where}: give {key} or {key}_file, not both")
    if path is not None:
        try:
            value = Path(os.path.expanduser(str(path))).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.{key}_file: cannot read {path}: {exc.strerror}") from None
    if value is None:
        return None
    text = str(value)
    if len(text) < 16 or not text.isascii() or not text.isprintable():
        raise ConfigError(f"{where}.{key}: expected at least 16 printable ASCII characters")
    return text


def _opamp(options: dict[str, Any]) -> OpampConfig:
    where = "extensions.flare_opamp"
    _reject_unknown(options, ("operator_token", "operator_token_file", "job_secret", "job_secret_file",
                              "max_agents", "forget_after"), where)
    cfg = OpampConfig(operator_token=_secret(options, "operator_token", where))
    job_secret = _secret(options, "job_secret", where)
    cfg.job_secret = job_secret.encode() if job_secret else None
    if "max_agents" in options:
        value = options["max_agents"]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
            raise ConfigError(f"{where}.max_agents: expected a whole number from 1 to 1000000, got {value!r}")
        cfg.max_agents = value
    if "forget_after" in options:
        cfg.forget_after_s = parse_duration(options["forget_after"], f"{where}.forget_after")
        if cfg.forget_after_s < 0:
            raise ConfigError(f"{where}.forget_after must not be negative")
    return cfg


def _wal(options: dict[str, Any]) -> WalConfig:
    where = "extensions.flare_wal"
    _reject_unknown(options, ("directory", "fsync", "max_size", "segment_size"), where)
    if not options.get("directory"):
        raise ConfigError(f"{where}.directory is required")
    wal = WalConfig(Path(str(options["directory"])))
    if "fsync" in options:
        wal.fsync = parse_bool(options["fsync"], f"{where}.fsync")
    if "max_size" in options:
        wal.max_bytes = parse_size(options["max_size"], f"{where}.max_size")
    if "segment_size" in options:
        wal.segment_bytes = parse_size(options["segment_size"], f"{where}.segment_size")
    if wal.segment_bytes <= 0 or wal.max_bytes < wal.segment_bytes:
        raise ConfigError(f"{where}: max_size must be at least segment_size (and both positive)")
    return wal


def parse(doc: dict[str, Any]) -> ServiceConfig:
    """Check a configuration mapping and return its typed form."""
    if not isinstance(doc, dict):
        raise ConfigError("the configuration must be a mapping")
    _reject_unknown(doc, ("receivers", "processors", "exporters", "extensions", "service", "connectors"), "top level")
    if doc.get("connectors"):
        raise ConfigError("connectors are not supported by the Flare collector")
    receivers = {
        str(rid): _receiver(str(rid), _mapping(opts, f"receivers.{rid}"))
        for rid, opts in _mapping(doc.get("receivers"), "receivers").items()
    }
    processors = _components(doc, "processors")
    exporters = _components(doc, "exporters")
    extensions = _mapping(doc.get("extensions"), "extensions")
    for ext_id in extensions:
        if component_type(str(ext_id)) not in EXTENSION_TYPES or "/" in str(ext_id):
            raise ConfigError(
                f"extensions.{ext_id}: unknown extension (known: {', '.join(EXTENSION_TYPES)})"
            )
    service = _mapping(doc.get("service"), "service")
    _reject_unknown(
        service,
        ("extensions", "pipelines", "telemetry", "flush_interval", "drain_timeout", "queue_max_size",
         "insecure_expose"),
        "service",
    )
    defined = {"receivers": receivers, "processors": processors, "exporters": exporters}
    pipelines = _pipelines(service, defined)
    cfg = ServiceConfig(receivers, processors, exporters, pipelines, raw=doc)
    for ext_id in _names(service.get("extensions"), "service.extensions"):
        if ext_id not in extensions:
            raise ConfigError(f"service.extensions enables {ext_id!r}, which extensions does not define")
        options = _mapping(extensions[ext_id], f"extensions.{ext_id}")
        if ext_id == "flare_wal":
            cfg.wal = _wal(options)
        elif ext_id == "flare_metrics":
            cfg.metrics_endpoint = _http_extension(ext_id, options, 8888)
        elif ext_id == "flare_opamp":
            cfg.opamp = _opamp(options)
        else:
            cfg.query_endpoint = _http_extension(ext_id, options, 16686)
    if "flush_interval" in service:
        cfg.flush_interval_s = parse_duration(service["flush_interval"], "service.flush_interval")
        if cfg.flush_interval_s <= 0:
            raise ConfigError("service.flush_interval must be positive")
    if "drain_timeout" in service:
        cfg.drain_timeout_s = parse_duration(service["drain_timeout"], "service.drain_timeout")
    if service.get("telemetry"):
        log.warning("service.telemetry is ignored; the flare_metrics extension serves self-metrics")
    if "insecure_expose" in service:
        cfg.insecure_expose = parse_bool(service["insecure_expose"], "service.insecure_expose")
    if "queue_max_size" in service:
        cfg.queue_max_bytes = parse_size(service["queue_max_size"], "service.queue_max_size")
    used = {r for p in pipelines for r in p.receivers}
    for rid in receivers:
        if rid not in used:
            log.warning("receiver %s is defined but no pipeline uses it", rid)
    return cfg


def embedded_config(
    store_path: str | os.PathLike[str],
    grpc_port: int = 0,
    http_port: int = 0,
    forward_endpoint: str | None = None,
    forward_protocol: str = "grpc",
    metrics_port: int | None = None,
    job_secret: str | None = None,
) -> dict[str, Any]:
    """The configuration `flare run` starts: loopback receivers, the store, a WAL.

    Port 0 binds a free port (read it back from `Collector.grpc_endpoint`). With
    `forward_endpoint`, traces and metrics are also forwarded over OTLP. With
    `job_secret`, only agents that show their job's token register (`flare_opamp`).
    """
    store_path = os.fspath(store_path)
    exporters: dict[str, Any] = {"flare_store": {"path": store_path}}
    if forward_endpoint:
        if forward_protocol not in ("grpc", "http", "http/protobuf"):
            raise ConfigError(f"forward protocol must be grpc or http, got {forward_protocol!r}")
        exporters["otlp/forward"] = {"endpoint": forward_endpoint, "protocol": forward_protocol}
    exporter_ids = list(exporters)
    extensions: dict[str, Any] = {"flare_wal": {"directory": store_path + ".ingest-wal"}}
    if metrics_port is not None:
        extensions["flare_metrics"] = {"endpoint": f"127.0.0.1:{metrics_port}"}
    if job_secret:
        extensions["flare_opamp"] = {"job_secret": job_secret}
    return {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                    "http": {"endpoint": f"127.0.0.1:{http_port}"},
                }
            }
        },
        "processors": {"memory_limiter": {}, "rank_correlation": {}},
        "exporters": exporters,
        "extensions": extensions,
        "service": {
            "extensions": list(extensions),
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["memory_limiter", "rank_correlation"],
                    "exporters": exporter_ids,
                },
                "metrics": {
                    "receivers": ["otlp"],
                    "processors": ["memory_limiter"],
                    "exporters": exporter_ids,
                },
            },
        },
    }
