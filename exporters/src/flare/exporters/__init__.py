"""Flare's collector exporters. The collector builds each as `REGISTRY[type](**options)`.

`store` (the DuckDB schema) is imported by readers too; importing this package stays
light because the gRPC client is loaded only by an exporter that forwards over gRPC.
"""

from __future__ import annotations

from flare.exporters.flare_store import FlareStoreExporter
from flare.exporters.otlp import OtlpExporter, OtlpHttpExporter

REGISTRY: dict[str, type] = {
    "flare_store": FlareStoreExporter,
    "otlp": OtlpExporter,
    "otlphttp": OtlpHttpExporter,
}

__all__ = ["REGISTRY", "FlareStoreExporter", "OtlpExporter", "OtlpHttpExporter"]
