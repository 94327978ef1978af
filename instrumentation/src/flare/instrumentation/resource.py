"""Resource detector registered as `flare` under `opentelemetry_resource_detector`.

The SDK runs it when `OTEL_EXPERIMENTAL_RESOURCE_DETECTORS` lists `flare` (as `flare run`
does). Outside a training rank (the torchrun agent, tools) it contributes nothing.
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource, ResourceDetector

from flare.instrumentation.identity import current_identity, in_training_rank
from flare.wire import semconv
from flare.wire.sdk_adapter import torch_supported


class FlareResourceDetector(ResourceDetector):
    def detect(self) -> Resource:
        if not in_training_rank():
            torch_supported()  # said here: the instrumentor of an old torch never runs
            return Resource.get_empty()
        identity = current_identity()
        attributes = identity.resource_attributes()
        attributes[semconv.SERVICE_NAME] = identity.service_name
        return Resource(attributes)
