"""Flare's collector processors: pure logic over OTLP requests (no sockets, no files).

The collector builds each configured processor as `REGISTRY[type](**options)`.
"""

from __future__ import annotations

from flare.processors.base import Processor
from flare.processors.batch import BatchProcessor
from flare.processors.memory_limiter import MemoryLimiter
from flare.processors.rank_correlation import RankCorrelation

REGISTRY: dict[str, type[Processor]] = {
    "memory_limiter": MemoryLimiter,
    "batch": BatchProcessor,
    "rank_correlation": RankCorrelation,
}

__all__ = ["REGISTRY", "BatchProcessor", "MemoryLimiter", "Processor", "RankCorrelation"]
