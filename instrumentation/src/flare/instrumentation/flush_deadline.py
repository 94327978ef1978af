"""Flushes with a deadline, for a collector that may be unreachable.

The SDK ignores the timeout of `force_flush` (it exports everything queued, each batch
retrying for up to OTEL_EXPORTER_OTLP_TIMEOUT, 10 s), and at interpreter exit its
shutdown waits up to 30 s for the batch worker and then the exporter: with a dead
endpoint a rank that finished training hung on for ~30-45 s. Two bounds:

- `flush(timeout_s)`: Flare's own flushes (hang, error, signal) run the SDK's flush on a
  helper thread and wait at most `timeout_s`; a flush still running is not started twice.
- `arm_exit_deadline(timeout_s)`: at exit, after `timeout_s` the exporters are shut
  down. Shutting an OTLP exporter down is the SDK's own way to end a retry: it wakes the
  backoff sleep, closes the channel (cancelling the call in flight) and fails any later
  batch at once, so the SDK's exit shutdown returns promptly. With a live collector the
  exit flush ends long before the deadline and nothing changes.
"""

from __future__ import annotations

import logging
import threading

from flare.wire import sdk_adapter as sdk

_log = logging.getLogger(__name__)


def _drop_export_errors(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Exception while exporting")


def _span_exporters(tracer_provider) -> list:
    """The exporters behind a TracerProvider's processors (SDK internals, version-gated;
    [] if unknown)."""
    if not sdk.internals_ok():
        return []
    exporters = [sdk.span_exporter(p) for p in sdk.provider_span_processors(tracer_provider)]
    return [exporter for exporter in exporters if exporter is not None]


def _metric_exporters(meter_provider) -> list:
    return sdk.metric_exporters(meter_provider)


class FlushDeadline:
    def __init__(self, tracer_provider, meter_provider=None):
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._flushing: threading.Thread | None = None
        self._exit_timer: threading.Timer | None = None
        self.exporters_stopped = False

    def flush(self, timeout_s: float) -> bool:
        """Flush the tracer provider, waiting at most `timeout_s`; True if it finished."""
        force_flush = getattr(self.tracer_provider, "force_flush", None)
        if force_flush is None:
            return True
        running = self._flushing
        if running is not None and running.is_alive():
            running.join(timeout_s)  # the one already under way is this flush too
            return not running.is_alive()

        def run() -> None:
            try:
                force_flush(int(timeout_s * 1000))
            except Exception as error:
                _log.warning("flare: flushing spans failed: %r", error)

        thread = threading.Thread(target=run, name="flare-flush", daemon=True)
        self._flushing = thread
        thread.start()
        thread.join(timeout_s)
        return not thread.is_alive()

    def arm_exit_deadline(self, timeout_s: float) -> None:
        """From now on the exit flush has `timeout_s`; then the exporters are stopped."""
        if self._exit_timer is not None or timeout_s <= 0:
            return
        timer = threading.Timer(timeout_s, self.stop_exporters)
        timer.name = "flare-exit-deadline"
        timer.daemon = True
        self._exit_timer = timer
        timer.start()

    def disarm(self) -> None:
        if self._exit_timer is not None:
            self._exit_timer.cancel()
            self._exit_timer = None

    def stop_exporters(self) -> None:
        """The collector did not take the last spans in time: stop retrying."""
        exporters = _span_exporters(self.tracer_provider)
        exporters += _metric_exporters(self.meter_provider)
        if not exporters:
            return
        _log.warning("flare: the exit flush did not finish in time; stopping %d exporter(s) "
                     "(unsent telemetry is dropped)", len(exporters))
        self.exporters_stopped = True
        # Closing the channel under a call in flight can make that export raise (e.g. a
        # retry that starts on the closed channel); the batch worker would log it with a
        # traceback. It is the stop just announced, not news.
        for name in sdk.EXPORT_LOGGERS:
            logging.getLogger(name).addFilter(_drop_export_errors)
        for exporter in exporters:
            try:
                exporter.shutdown()
            except Exception as error:
                _log.info("flare: stopping exporter %r failed: %r", exporter, error)
