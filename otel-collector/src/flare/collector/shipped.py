"""The collector configurations and the Grafana dashboard shipped inside the package.

`flare collector --config tempo` runs `configs/tempo.yaml` of the installed package; a
value that names an existing file (or has a path separator or a .yaml/.yml suffix) is
that file.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from flare.collector.errors import ConfigError

NAMES = ("embedded", "secure", "jaeger", "tempo", "loadbalancing", "clickhouse")
DASHBOARD = "flare-dashboard.json"


def folder() -> Path:
    return Path(str(resources.files("flare.collector") / "configs"))


# For the upstream OpenTelemetry Collector (otelcol-contrib), not for `flare collector`.
UPSTREAM = ("loadbalancing", "clickhouse")


def resolve(value: str, printing: bool = False) -> Path:
    """The configuration file `--config value` means (`printing`: for --print-config,
    which also serves the upstream collector's)."""
    path = Path(value)
    if path.exists() or "/" in value or path.suffix in (".yaml", ".yml"):
        return path
    if value in UPSTREAM and not printing:
        raise ConfigError(f"the {value} configuration is for the upstream otelcol-contrib in "
                          f"front of Flare collectors: flare collector --config {value} "
                          f"--print-config > {value}.yaml; otelcol-contrib --config {value}.yaml")
    if value in NAMES:
        return folder() / f"{value}.yaml"
    raise ConfigError(f"--config {value!r} is neither a file nor a shipped configuration "
                      f"({', '.join(NAMES)})")


def dashboard() -> Path:
    return folder() / DASHBOARD
