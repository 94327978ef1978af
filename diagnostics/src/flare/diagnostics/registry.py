"""Finds every detector: each module of `flare.diagnostics.detectors` with `detect`."""

from __future__ import annotations

import importlib
import pkgutil

from flare.diagnostics import detectors as detectors_package
from flare.diagnostics.model import Detector


def discover() -> dict[str, Detector]:
    found: dict[str, Detector] = {}
    for info in sorted(pkgutil.iter_modules(detectors_package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{detectors_package.__name__}.{info.name}")
        detect = getattr(module, "detect", None)
        if callable(detect):
            found[info.name] = detect
    return found
