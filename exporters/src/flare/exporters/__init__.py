"""Flare's collector exporters. The collector builds each as `REGISTRY[type](**options)`.

The package is lazy (PEP 562): `from flare.exporters import store` or `kineto` loads only
that module, so `flare import-kineto` and the diagnosis's store backend do not load the
exporters' Arrow, protobuf and HTTP stacks; `REGISTRY` and the exporter classes load
them on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flare.exporters.flare_store import FlareStoreExporter
    from flare.exporters.otlp import OtlpExporter, OtlpHttpExporter

_CLASSES = {
    "FlareStoreExporter": "flare.exporters.flare_store",
    "OtlpExporter": "flare.exporters.otlp",
    "OtlpHttpExporter": "flare.exporters.otlp",
}

__all__ = ["REGISTRY", "FlareStoreExporter", "OtlpExporter", "OtlpHttpExporter"]


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        value = getattr(importlib.import_module(_CLASSES[name]), name)
    elif name == "REGISTRY":
        value = {
            "flare_store": __getattr__("FlareStoreExporter"),
            "otlp": __getattr__("OtlpExporter"),
            "otlphttp": __getattr__("OtlpHttpExporter"),
        }
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
