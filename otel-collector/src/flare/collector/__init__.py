"""The Flare OTLP collector: receivers, write-ahead log, pipelines, self-metrics.

Entry points: `flare.collector.service.Collector` (programmatic, used by `flare run`)
and `python -m flare.collector --config FILE` (`flare collector`). Nothing is imported
here so that `flare.collector.security` and friends load without the server stack.
"""
