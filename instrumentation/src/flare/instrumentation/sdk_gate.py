"""The version gate on Flare's use of OpenTelemetry SDK internals.

Where the SDK has no public API for what the always-on path needs, Flare reaches into
it: the tracer's span processors (`finished_span.py`: step spans handed to them as
built, the batch processors' schedules held, a flush hook put first), the provider's
resource (`torch_training._adopt_flare_resource`), the exporters behind them
(`flush_deadline.py`), the OTLP exporters' encoder and request limit
(`otlp_encoding.matches_sdk`, `otlp_http`). Each of those places asks `internals_ok()`
first, and outside the SDK versions the compatibility check runs
(`tests/compat/check_versions.py`: the declared floor and the newest release) takes the
public path instead:

- step spans made with `Tracer.start_span` / `end` (measured ~170 µs per step span in
  situ, against ~35 µs handed over as built: `docs/benchmark-history.md`);
- spans encoded by the SDK's OTLP encoder (58.7–65.9 µs per `train.step` span, against
  12.8–13.2 µs with Flare's writer);
- Flare's resource attributes on every span instead of the resource (when the `flare`
  resource detector is not configured);
- no export deadline on a flush at exit, and the batch processors on their own schedule.

One warning line says so, once per process. Torch outside `instruments` (`torch>=2.1`)
is said the same way by the resource detector, since the auto-instrumentation then skips
the instrumentor without a word.
"""

from __future__ import annotations

import functools
import logging
import re

_log = logging.getLogger(__name__)

# The SDK minor versions the compatibility check runs (1.28 floor, 1.45 newest).
TESTED = ((1, 28), (1, 45))
TORCH_FLOOR = (2, 1)


def major_minor(text: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def sdk_version() -> tuple[int, int] | None:
    try:
        from opentelemetry.sdk.version import __version__
    except ImportError:
        return None
    return major_minor(__version__)


@functools.cache
def internals_ok() -> bool:
    """Whether this SDK is one Flare's uses of its internals were tested with; outside,
    one warning and the public API everywhere."""
    version = sdk_version()
    if version is not None and TESTED[0] <= version <= TESTED[1]:
        return True
    shown = "unknown" if version is None else f"{version[0]}.{version[1]}"
    _log.warning("flare: opentelemetry-sdk %s is outside the versions Flare is tested with "
                 "(%d.%d to %d.%d); it uses the SDK's public API only (slower step spans "
                 "and encoding, same data)", shown, *TESTED[0], *TESTED[1])
    return False


@functools.cache
def torch_supported() -> bool:
    """False, with one warning, when the installed torch is older than the instrumentor's
    `instruments` requirement (the auto-instrumentation then skips it silently)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return True
    try:
        installed = major_minor(version("torch"))
    except PackageNotFoundError:
        return True  # no torch: nothing to instrument, nothing to say
    if installed is None or installed >= TORCH_FLOOR:
        return True
    _log.warning("flare: torch %d.%d is older than %d.%d, which Flare needs: the ranks are "
                 "not instrumented and send no steps", *installed, *TORCH_FLOOR)
    return False
