"""The collector's own metrics, rendered in the Prometheus text exposition format.

Counters are plain attributes bumped under the GIL by the thread that owns them
(receivers, the pipeline worker); a scrape reads them without locking, which can be
one increment stale and never torn. Components add themselves as *sources*:
callables returning either `{name: value}` or `[(name, {label: value}, value)]`, read
at scrape time, so nothing is computed unless someone looks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

Sample = tuple[str, Mapping[str, str], float]
SourceResult = Mapping[str, float] | Iterable[Sample]
Source = Callable[[], SourceResult]

PREFIX = "flare_collector_"
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(name: str) -> str:
    """A Prometheus-safe name: dots and dashes become underscores."""
    cleaned = _INVALID.sub("_", name)
    return cleaned if not cleaned[:1].isdigit() else "_" + cleaned


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1 << 53:
        return str(int(value))
    return repr(float(value))


class Counters:
    """Monotonic counters keyed by (name, labels) with a one-line description each."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._help: dict[str, str] = {}
        self._lock = threading.Lock()

    def describe(self, name: str, text: str) -> None:
        self._help[name] = text

    def add(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def get(self, name: str, **labels: str) -> float:
        return self._values.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in list(self._values.items()) if n == name)

    def samples(self) -> list[Sample]:
        with self._lock:
            items = list(self._values.items())
        return [(name, dict(labels), value) for (name, labels), value in items]

    def help_text(self, name: str) -> str | None:
        return self._help.get(name)


class Refusals:
    """What a listener turns away, counted by cause and logged at most once per `every_s`
    per cause (with how many there were since the last line), so a flood of hostile
    clients costs one log line a minute, not one per connection."""

    def __init__(self, counters: Counters, every_s: float = 60.0) -> None:
        self.counters = counters
        self.every_s = every_s
        self._next: dict[tuple[str, str], float] = {}
        self._unsaid: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def add(self, name: str, cause: str, message: str, *args: object, **labels: str) -> None:
        self.counters.add(name, cause=cause, **labels)
        key = (name, cause)
        now = time.monotonic()
        with self._lock:
            unsaid = self._unsaid.get(key, 0) + 1
            if now < self._next.get(key, 0.0):
                self._unsaid[key] = unsaid
                return
            self._next[key], self._unsaid[key] = now + self.every_s, 0
        more = f" ({unsaid - 1} more since the last such line)" if unsaid > 1 else ""
        log.warning(message + more, *args)


@dataclasses.dataclass
class Family:
    """One metric of a Prometheus page: its type, its (labels, value) points, its help."""

    kind: str  # "counter" or "gauge"
    points: list[tuple[Mapping[str, str], float]]
    help: str | None = None


def render(families: Mapping[str, Family]) -> str:
    """The Prometheus text exposition of `families`, by name: the one writer behind
    every Flare `/metrics` (the collector's, the follow service's)."""
    lines: list[str] = []
    for name in sorted(families):
        family = families[name]
        if family.help:
            lines.append(f"# HELP {name} {family.help}")
        lines.append(f"# TYPE {name} {family.kind}")
        for labels, value in family.points:
            if labels:
                rendered = ",".join(
                    f'{metric_name(k)}="{_escape(str(v))}"' for k, v in sorted(labels.items())
                )
                lines.append(f"{name}{{{rendered}}} {_format_value(value)}")
            else:
                lines.append(f"{name} {_format_value(value)}")
    return "\n".join(lines) + "\n"


class Registry:
    """Counters plus gauge sources, exposed as one Prometheus text page."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._sources: list[tuple[str, Source]] = []
        self._lock = threading.Lock()
        self.source_errors = 0

    def register_gauge_source(self, source: Source, prefix: str = "") -> None:
        with self._lock:
            self._sources.append((prefix, source))

    def unregister_gauge_source(self, source: Source) -> None:
        with self._lock:
            self._sources = [(p, s) for p, s in self._sources if s is not source]

    def gauges(self) -> list[Sample]:
        out: list[Sample] = []
        with self._lock:
            sources = list(self._sources)
        for prefix, source in sources:
            try:
                result = source()
            except Exception as exc:  # one broken source must not break the scrape
                self.source_errors += 1
                log.warning("metrics source %r failed: %s", source, exc)
                continue
            if isinstance(result, Mapping):
                out.extend((prefix + name, {}, float(v)) for name, v in result.items())
            else:
                out.extend((prefix + name, labels, float(v)) for name, labels, v in result)
        return out

    def render(self) -> str:
        families: dict[str, Family] = {}
        for name, labels, value in self.counters.samples():
            full = PREFIX + metric_name(name) + "_total"
            if full not in families:
                families[full] = Family("counter", [], self.counters.help_text(name))
            families[full].points.append((labels, value))
        for name, labels, value in self.gauges():
            full = metric_name(name if name.startswith("flare_") else PREFIX + metric_name(name))
            families.setdefault(full, Family("gauge", [])).points.append((labels, value))
        return render(families)
