"""Trace backends diagnosis reads from: the embedded store, Jaeger, Tempo, ClickHouse.

`open_backend(spec)` turns a user's `--store`/`--backend` value into a `Backend`;
each backend hands out one `JobData` per job, and detectors never see which backend
filled it. Jaeger and Tempo adapters are imported lazily so the store path needs no
HTTP stack.
"""

from __future__ import annotations

import os
import re
from typing import Any

from flare.diagnostics.backends.base import Backend, BackendError

__all__ = ["Backend", "BackendError", "open_backend"]


_HTTP_SCHEMES = {
    "jaeger": ("flare.diagnostics.backends.jaeger", "JaegerBackend"),
    "tempo": ("flare.diagnostics.backends.tempo", "TempoBackend"),
}
_FORMS = ("store:PATH, jaeger+http(s)://HOST:PORT, tempo+http(s)://HOST:PORT, "
          "clickhouse+http(s)://HOST:PORT/DB or chdb:PATH")
_KNOWN_SCHEMES = ("store", "jaeger", "tempo", "clickhouse", "chdb")
# `NAME:` or `NAME+TRANSPORT:` at the start of a spec (two letters at least: not a
# drive letter).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9.-]+)(\+[A-Za-z0-9.-]*)?:")


def open_backend(spec: str, **opts: Any) -> Backend:
    """`store:PATH` or a bare path → the DuckDB store; `jaeger+http(s)://…`,
    `tempo+http(s)://…` → the HTTP adapters (options passed through);
    `clickhouse+http(s)://HOST:PORT/DB` and `chdb:PATH` → ClickHouse's traces table."""
    if not spec:
        raise BackendError("no backend given (use --store PATH or --backend URL)")
    prefix, sep, rest = spec.partition("+")
    if sep and prefix in _HTTP_SCHEMES and rest.startswith(("http://", "https://")):
        module_name, class_name = _HTTP_SCHEMES[prefix]
        import importlib

        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise BackendError(f"the {prefix} backend is not available: {exc}") from exc
        return getattr(module, class_name)(rest, **opts)
    if spec.startswith("chdb:") or (prefix == "clickhouse" and rest.startswith(("http://", "https://"))):
        from flare.diagnostics.backends.clickhouse import ClickHouseBackend

        return ClickHouseBackend(spec, **opts)
    scheme = _SCHEME.match(spec)
    # A spec with a scheme that is not store's, unless it is a file that exists (a bare
    # path may hold a colon): `bogus:xyz` was read as a store path and said "store
    # bogus:xyz does not exist", hiding that the scheme was wrong.
    if (scheme and scheme.group(1) != "store" and not os.path.exists(spec)) or "://" in spec:
        name = scheme.group(1) if scheme else spec.split("://")[0]
        if name in _KNOWN_SCHEMES:
            raise BackendError(f"backend {spec!r} is not one Flare reads: use {_FORMS}")
        raise BackendError(f"unknown backend scheme {name!r} in {spec!r} (known: "
                           f"{', '.join(_KNOWN_SCHEMES)}): use {_FORMS}")
    from flare.diagnostics.backends.store import StoreBackend

    path = spec[len("store:"):] if spec.startswith("store:") else spec
    if not path:
        raise BackendError(f"backend {spec!r} names no store file (use store:PATH)")
    return StoreBackend(path, **opts)
