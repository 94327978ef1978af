"""`flare collector --config FILE` / `python -m flare.collector --config FILE`.

Runs until SIGTERM or SIGINT, then drains what it holds into the store within the
configuration's `service.drain_timeout`. Exit status: 0 after a clean stop, 1 when
a component cannot start or the drain ran out of time (nothing is lost: the
write-ahead log keeps it for the next start), 2 for a bad command line or
configuration. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading

from flare.collector import shipped
from flare.collector.errors import ConfigError, StartError

PROG = "flare collector"


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, never a usage dump
        raise ConfigError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=PROG,
        description="Run the Flare OTLP collector (receivers, rank correlation, store, forwarding).",
    )
    parser.add_argument("--config", required=True, metavar="FILE|NAME",
                        help="collector configuration in the otelcol shape: a file, or one "
                             f"shipped with Flare by name ({', '.join(shipped.NAMES)}; "
                             "`flare collector --config NAME --print-config` shows it)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the configuration --config names and exit")
    parser.add_argument("--insecure-expose", action="store_true",
                        help="serve endpoints that listen off loopback with neither TLS nor a "
                             "bearer token (refused without it; logged as a warning with it)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="log verbosity on stderr (default: info)")
    return parser


def _tune_gc() -> None:
    """Collect young objects every 50,000 allocations instead of CPython's 700.

    Every request makes thousands of short-lived containers (the correlator's picked
    spans and their attribute dicts) and nearly none form cycles, so the default
    threshold ran a young collection every few hundred spans: 7-8 % of the
    collector's CPU in `benchmarks/collector_e2e_ingest.py`. What the start-up made
    (modules, config, pipeline objects) lives as long as the process: frozen, later
    full collections skip it. Cycles are still collected, just in larger batches.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s flare-collector %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # Import after argument parsing so `--help` stays fast.
    from flare.collector.service import Collector

    try:
        path = shipped.resolve(args.config, printing=args.print_config)
        if args.print_config:
            sys.stdout.write(path.read_text())
            return 0
        collector = Collector.from_config_file(str(path))
        if args.insecure_expose:
            collector.config.insecure_expose = True
        collector.start()
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # e.g. a store that is not a Flare store
        print(f"{PROG}: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 1
    _tune_gc()

    stop = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parts = [f"OTLP/gRPC {collector.grpc_endpoint}" if collector.grpc_endpoint else "",
             f"OTLP/HTTP {collector.http_endpoint}" if collector.http_endpoint else "",
             f"store {collector.store_path}" if collector.store_path else "",
             f"metrics {collector.metrics_url}" if collector.metrics_url else "",
             f"query {collector.query_url}" if collector.query_url else ""]
    logging.getLogger("flare.collector").info("ready: %s", ", ".join(p for p in parts if p))
    while not stop.wait(1.0):
        pass
    deadline = collector.config.drain_timeout_s
    logging.getLogger("flare.collector").info("stopping: draining within %.1f s", deadline)
    drained = collector.stop(deadline)
    if not drained:
        print(f"{PROG}: drain did not finish within {deadline:.1f} s; "
              "the rest stays in the write-ahead log for the next start", file=sys.stderr)
        return 1
    logging.getLogger("flare.collector").info("stopped: drained")
    return 0


if __name__ == "__main__":
    sys.exit(main())
