"""Lazy access to the optional security and query modules (written separately).

`flare.collector.security` (TLS credentials, bearer-token auth) and
`flare.collector.query_api` (the read-only Jaeger api_v3 endpoint) are imported only
when a configuration asks for them, so a collector without them still runs; asking
for TLS, auth or flare_query without them is one clear start error.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from flare.collector.errors import ConfigError, StartError


def _load(module: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise StartError(f"{purpose} needs {module}, which cannot be imported: {exc}") from None


def load_security() -> ModuleType:
    return _load("flare.collector.security", "TLS or bearer-token authentication")


def load_query_api() -> ModuleType:
    return _load("flare.collector.query_api", "the flare_query extension")


def bearer_auth(auth_options: dict[str, Any] | None) -> Any | None:
    """A `security.BearerAuth` for an `auth: {bearer_token}` block, or None."""
    if not auth_options:
        return None
    security = load_security()
    try:
        return security.BearerAuth.from_config(auth_options)
    except ValueError as exc:  # security.SecurityConfigError: unreadable token file, …
        raise ConfigError(str(exc)) from None


def ssl_context(tls_options: dict[str, Any] | None) -> Any | None:
    if not tls_options:
        return None
    try:
        return load_security().ssl_context(tls_options)
    except StartError:
        raise
    except ValueError as exc:  # security.SecurityConfigError names the bad file
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # unreadable or mismatched certificate files
        raise StartError(f"cannot load TLS certificate {tls_options.get('cert_file')}: {exc}") from None


def grpc_credentials(tls_options: dict[str, Any]) -> Any:
    try:
        return load_security().server_credentials(tls_options)
    except StartError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:
        raise StartError(f"cannot load TLS certificate {tls_options.get('cert_file')}: {exc}") from None
