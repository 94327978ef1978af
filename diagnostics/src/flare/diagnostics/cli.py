"""The `flare` command: run, diagnose, collector, import-kineto.

Every error a user can cause (a bad flag, a missing store, an unknown job, an
unreachable backend) ends as one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from flare.diagnostics.output import DEFAULT_STORE, UserError, check_output, emit, open_report

if TYPE_CHECKING:  # each command imports what it uses: import-kineto needs no diagnosis
    from flare.diagnostics.backends import Backend

EXIT_USAGE = 2
EXIT_FAILURE = 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except UserError as exc:
        print(f"flare: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("flare: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `flare diagnose | head`
        return 0
    except Exception as exc:
        # A store damaged past its header fails only when a query reaches the bad
        # block: one line, as for any other unreadable store.
        from flare.exporters import store as flare_store

        if flare_store.is_interrupt(exc):
            print("flare: interrupted", file=sys.stderr)
            return 130
        if not flare_store.is_store_error(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"flare: error: reading the store failed: {first}", file=sys.stderr)
        return EXIT_FAILURE


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "collector":
        from flare.collector.__main__ import main as collector_main

        return collector_main(argv[1:])
    if argv and argv[0] == "run":
        from flare.diagnostics import run

        return run.main(argv[1:])
    args, unknown = _parser().parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its own usage line
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flare", description="Flare: anomaly diagnosis for distributed PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("run", help="run CMD with an embedded collector, then diagnose it "
                   "(flare run [options] -- CMD …; flare run --help)")
    sub.add_parser("collector", help="run the OTLP collector (flare collector --config FILE)")

    diagnose = sub.add_parser(
        "diagnose", help="diagnose a job held in a store or trace backend",
        description="Diagnose a job held in a Flare store, Jaeger or Tempo: which rank, what "
                    "cause, from which step. --store PATH is short for --backend store:PATH.")
    add_diagnose_options(diagnose)
    diagnose.set_defaults(handler=diagnose_command, command_parser=diagnose)

    jobs = sub.add_parser(
        "jobs", help="list the jobs a store or trace backend holds, with their first and last steps",
        description="List the jobs a Flare store, Jaeger or Tempo holds (the names --job takes), "
                    "with their ranks and first and last step times.")
    add_source_options(jobs)
    jobs.add_argument("--format", choices=("text", "json"), default="text")
    jobs.set_defaults(handler=jobs_command, command_parser=jobs)

    nodes = sub.add_parser(
        "nodes", help="rank hosts by the time they cost jobs, across every job a backend holds",
        description="Diagnose every job of a store or trace backend (those whose steps ran within "
                    "--since) and rank hosts by the seconds jobs lost waiting on ranks they ran, "
                    "with how many jobs each ran and was a culprit in; the hosts that were "
                    "culprits in at least --min-jobs jobs make the exclude list (JSON: "
                    '{"nodes": [...], "exclude": [...]}).')
    add_source_options(nodes)
    nodes.add_argument("--since", metavar="AGE", help="only jobs with steps in the last AGE "
                       "(e.g. 7d, 12h, 30m; default: every job)")
    nodes.add_argument("--min-jobs", type=int, default=2, metavar="N",
                       help="a host on the exclude list was a culprit in at least N jobs (default 2)")
    nodes.add_argument("--format", choices=("text", "json"), default="text")
    nodes.set_defaults(handler=nodes_command, command_parser=nodes)

    capture = sub.add_parser(
        "capture", help="ask ranks of a running job for a targeted capture (their lines of code)",
        description="Ask ranks of a running job, through the collector's OpAMP endpoint, to "
                    "sample their training thread's stack for a few steps; a later flare "
                    "diagnose gives the labels of those ranks the lines their time goes to. "
                    "The token and TLS files come from FLARE_BACKEND_TOKEN, FLARE_BACKEND_CA_FILE, "
                    "FLARE_BACKEND_CERT_FILE and FLARE_BACKEND_KEY_FILE, as for flare diagnose; "
                    "where the collector scopes its control channel, FLARE_JOB_TOKEN (the job's) "
                    "or FLARE_OPERATOR_TOKEN (every job) is sent too.")
    capture.add_argument("--collector", metavar="URL",
                         help="the collector's OTLP/HTTP endpoint (default http://$FLARE_OTLP_HOST or "
                              "$FLARE_HOST or 127.0.0.1, port $FLARE_OTLP_HTTP_PORT or 4318)")
    capture.add_argument("--job", metavar="ID", help="the job (default: the only job with live ranks)")
    capture.add_argument("--ranks", required=True, metavar="R,R…", help="ranks to capture, e.g. 2,5")
    capture.add_argument("--steps", type=int, default=20, metavar="K",
                         help="steps to capture (default 20, at most 1000)")
    capture.add_argument("--no-stacks", action="store_true",
                         help="detail steps only (collectives, kernel windows), no stack sampling")
    capture.set_defaults(handler=capture_command, command_parser=capture)

    token = sub.add_parser(
        "job-token", help="print a job's control-channel token (for a collector with a job_secret)",
        description="Print the token that admits a job's ranks to a collector's control channel "
                    "and scopes flare capture to that job: HMAC-SHA256 of the collector's "
                    "flare_opamp.job_secret and the job id. Give it to the job's ranks as "
                    "FLARE_JOB_TOKEN (flare run does this by itself).")
    token.add_argument("job", metavar="JOB", help="the job id (the ranks' flare.job.id)")
    token.add_argument("--secret-file", required=True, metavar="PATH",
                       help="the file holding the collector's job_secret")
    token.set_defaults(handler=job_token_command, command_parser=token)

    kineto = sub.add_parser(
        "import-kineto", help="import PyTorch profiler (Kineto) traces into a store",
        description="Import PyTorch profiler (Kineto) traces, one rank per file, into a store "
                    "that flare diagnose reads.")
    kineto.add_argument("directory", metavar="DIR", help="a trace file or a folder of them")
    kineto.add_argument("--store", default=DEFAULT_STORE, metavar="PATH",
                        help=f"DuckDB store, created if missing (in an existing directory; default "
                             f"{DEFAULT_STORE}, whose directory is created too)")
    kineto.add_argument("--job", metavar="NAME", help="job name (default: the folder's name)")
    kineto.add_argument("--max-file-size", default="2G", metavar="SIZE",
                        help="skip a file holding more JSON than this, decompressed (default 2G)")
    kineto.add_argument("--max-string", default="1M", metavar="SIZE",
                        help="skip an event holding a longer string (default 1M); a file with "
                             "an event over 16 times this is skipped")
    kineto.set_defaults(handler=import_kineto_command, command_parser=kineto)
    return parser


def add_diagnose_options(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--store", metavar="PATH", help=f"DuckDB store (default {DEFAULT_STORE})")
    source.add_argument("--backend", metavar="SPEC",
                        help="store:PATH, jaeger+http(s)://HOST:PORT, tempo+http(s)://HOST:PORT, "
                             "clickhouse+http(s)://HOST:PORT/DB or chdb:PATH")
    parser.add_argument("--job", metavar="ID", help="job to diagnose (default: the only job)")
    parser.add_argument("--baseline-job", metavar="ID", help="compare against this earlier job; auto: "
                        "the most recent earlier job with the same script and world size")
    parser.add_argument("--format", choices=("text", "json", "html"), default="text")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report here, not stdout")
    parser.add_argument("--write-back", action="store_true",
                        help="also store each anomaly as a flare.anomaly span (store backend), "
                             "and send it to --otlp-endpoint when given")
    parser.add_argument("--otlp-endpoint", metavar="URL",
                        help="OTLP endpoint anomaly spans are sent to (with --write-back or --follow)")
    parser.add_argument("--follow", action="store_true",
                        help="keep diagnosing as new spans arrive (always-on service)")
    parser.add_argument("--interval", type=float, default=10.0, metavar="S",
                        help="seconds between passes with --follow (default 10)")
    parser.add_argument("--collector", metavar="URL",
                        help="with --follow: ask this Flare collector (its OTLP/HTTP endpoint) to "
                             "capture the ranks of each new label and a healthy peer, over OpAMP")


def add_source_options(parser: argparse.ArgumentParser) -> None:
    """--store PATH or --backend SPEC: where a command reads jobs from."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--store", metavar="PATH", help=f"DuckDB store (default {DEFAULT_STORE})")
    source.add_argument("--backend", metavar="SPEC",
                        help="store:PATH, jaeger+http(s)://HOST:PORT, tempo+http(s)://HOST:PORT, "
                             "clickhouse+http(s)://HOST:PORT/DB or chdb:PATH")


def backend_spec(args: argparse.Namespace) -> str:
    return args.backend or f"store:{args.store or DEFAULT_STORE}"


def open_user_backend(spec: str) -> Backend:
    from flare.diagnostics.backends import BackendError, open_backend

    try:
        return open_backend(spec)
    except BackendError as exc:
        raise UserError(str(exc)) from None


def pick_job(backend: Backend, job: str | None, what: str = "job") -> str:
    from flare.diagnostics.backends import BackendError

    try:
        jobs = backend.jobs()
    except BackendError as exc:
        raise UserError(str(exc)) from None
    if job is not None:
        if job not in jobs:
            known = ", ".join(jobs[:20]) or "none"
            raise UserError(f"{what} {job!r} is not in {backend.name} (jobs: {known})")
        return job
    if not jobs:
        raise UserError(f"{backend.name} holds no jobs yet")
    if len(jobs) > 1:
        raise UserError(f"{backend.name} holds {len(jobs)} jobs; choose one with --job: {', '.join(jobs[:20])}")
    return jobs[0]


def job_rows(backend: Backend) -> list[dict]:
    """Per job: ranks, first and last step numbers, and the UTC times they started and
    ended (from the train.step spans; a job with no step yet has None there)."""
    from flare.wire import semconv as sc

    rows = []
    for job in backend.jobs():
        data = backend.job_data(job)
        activity = data.rank_activity([sc.SPAN_STEP]).to_pylist()
        steps = data.steps_range()
        starts = [r["first_start_ns"] for r in activity if r.get("first_start_ns") is not None]
        ends = [r["last_end_ns"] for r in activity if r.get("last_end_ns") is not None]
        rows.append({"job": job, "ranks": len(activity),
                     "first_step": steps[0] if steps else None, "last_step": steps[1] if steps else None,
                     "first_step_time": _utc(min(starts)) if starts else None,
                     "last_step_time": _utc(max(ends)) if ends else None})
    return rows


def _utc(ns: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def jobs_command(args: argparse.Namespace) -> int:
    from flare.diagnostics.backends import BackendError

    backend = open_user_backend(backend_spec(args))
    try:
        rows = job_rows(backend)
    except BackendError as exc:
        raise UserError(str(exc)) from None
    finally:
        backend.close()
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"{backend.name} holds no jobs yet")
        return 0
    width = max(len("JOB"), *(len(r["job"]) for r in rows))
    print(f"{'JOB':<{width}}  {'RANKS':>5}  {'STEPS':<13}  {'FIRST STEP (UTC)':<20}  LAST STEP (UTC)")
    for r in rows:
        steps = "-" if r["first_step"] is None else f"{r['first_step']}-{r['last_step']}"
        print(f"{r['job']:<{width}}  {r['ranks']:>5}  {steps:<13}  {r['first_step_time'] or '-':<20}  "
              f"{r['last_step_time'] or '-'}")
    return 0


def nodes_command(args: argparse.Namespace) -> int:
    from flare.diagnostics import fleet
    from flare.diagnostics.backends import BackendError

    try:
        since_s = None if args.since is None else fleet.parse_since(args.since)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.min_jobs < 1:
        raise UserError(f"--min-jobs {args.min_jobs}: at least 1")
    backend = open_user_backend(backend_spec(args))
    try:
        result = fleet.fleet(backend, since_s=since_s, min_jobs=args.min_jobs)
    except BackendError as exc:
        raise UserError(str(exc)) from None
    finally:
        backend.close()
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(fleet.format_text(result, args.min_jobs))
    return 0


def job_token_command(args: argparse.Namespace) -> int:
    from flare.collector.opamp import job_token

    try:
        with open(args.secret_file, "rb") as file:
            secret = file.read().strip()
    except OSError as exc:
        raise UserError(f"cannot read --secret-file {args.secret_file}: {exc.strerror}") from None
    if len(secret) < 16:
        raise UserError(f"--secret-file {args.secret_file} holds fewer than 16 characters; "
                        "not a job secret")
    print(job_token(secret, args.job))
    return 0


def capture_command(args: argparse.Namespace) -> int:
    from flare.diagnostics.backends import BackendError
    from flare.diagnostics.collector_client import collector_asker

    try:
        ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
    except ValueError:
        raise UserError(f"--ranks {args.ranks!r} is not a comma-separated list of rank numbers") from None
    if not ranks or min(ranks) < 0:
        raise UserError("--ranks needs at least one rank number (0 or more)")
    if not 1 <= args.steps <= 1000:
        raise UserError("--steps must be 1 to 1000")
    url = args.collector or "http://{}:{}".format(
        os.environ.get("FLARE_OTLP_HOST") or os.environ.get("FLARE_HOST") or "127.0.0.1",
        os.environ.get("FLARE_OTLP_HTTP_PORT") or "4318")
    try:
        ask = collector_asker(url)
        try:
            result = ask(args.job, ranks, args.steps, stacks=not args.no_stacks)
        finally:
            ask.close()
    except BackendError as exc:
        raise UserError(str(exc)) from None
    if result["asked"]:
        print(f"flare: {result['id']}: asked job {result['job']} ranks "
              f"{', '.join(map(str, result['asked']))} for {result['steps']} "
              f"{'captured' if result.get('stacks', True) else 'detail'} steps; they "
              "start at their next poll (flare diagnose afterwards gives the labels their lines)")
    if result["unknown"]:
        print(f"flare: no live rank {', '.join(map(str, result['unknown']))} in job {result['job']} "
              f"(see {url.rstrip('/')}/flare/v1/agents)", file=sys.stderr)
    return 0 if result["asked"] else EXIT_FAILURE


def diagnose_command(args: argparse.Namespace) -> int:
    from flare.diagnostics import pipeline
    from flare.diagnostics.backends import BackendError
    from flare.diagnostics.model import DiagnosisConfig

    if args.interval <= 0:
        raise UserError("--interval must be positive")
    if args.baseline_job and args.baseline_job == args.job:
        raise UserError("--baseline-job is the job being diagnosed; name an earlier job")
    if args.baseline_job == "auto" and args.follow:
        raise UserError("--baseline-job auto picks by the finished job's spans; name the "
                        "baseline job with --follow")
    if args.collector and not args.follow:
        raise UserError("--collector is where --follow asks captures of new labels' ranks; add --follow")
    if args.otlp_endpoint and not (args.write_back or args.follow):
        raise UserError("--otlp-endpoint is where --write-back or --follow send anomaly spans; "
                        "add one of them")
    if args.output:  # before the diagnosis (and before --follow truncates it)
        check_output(args.output)
    spec = backend_spec(args)
    backend = open_user_backend(spec)
    try:
        if (args.write_back and not args.follow and not args.otlp_endpoint
                and getattr(backend, "path", None) is None):
            raise UserError(f"--write-back into {backend.name} needs --otlp-endpoint URL (a "
                            "trace backend is written through its OTLP receiver)")
        config = DiagnosisConfig()
        baseline = None
        if args.baseline_job == "auto" and not args.follow:
            from flare.diagnostics import fleet

            try:
                passed_over: list[str] = []
                name, found = fleet.auto_baseline(backend, pick_job(backend, args.job), passed_over)
            except BackendError as exc:
                raise UserError(str(exc)) from None
            if name is None:
                print(f"flare: no earlier job with the same signature ({fleet.describe_signature(found)}): "
                      "diagnosing without a baseline", file=sys.stderr)
            else:
                config.baseline = backend.job_data(name)
                baseline = {"job": name, "picked": "auto", "signature": found}
                if name in passed_over:  # every candidate carries labels: said in the report
                    baseline["labelled"] = True
                elif passed_over:
                    baseline["passed_over"] = passed_over
        elif args.baseline_job:
            config.baseline = backend.job_data(pick_job(backend, args.baseline_job, "baseline job"))
            baseline = {"job": config.baseline.job, "picked": "given"}
        if args.follow:  # the service waits for the job (or the only job) to appear
            from flare.diagnostics import follow

            if not args.output:
                return follow.main(spec, args.job, config, args.interval, args.otlp_endpoint, sys.stdout,
                                   collector=args.collector)
            with open_report(args.output) as out:
                return follow.main(spec, args.job, config, args.interval, args.otlp_endpoint, out,
                                   collector=args.collector)
        job = pick_job(backend, args.job)
        job_data = backend.job_data(job)
        try:
            diagnosis = pipeline.diagnose(job_data, config)
        except BackendError as exc:
            raise UserError(str(exc)) from None
        diagnosis.baseline = baseline
        emit(diagnosis, job_data, config, args.format, args.output)
        if args.write_back:
            from flare.diagnostics import writeback  # OTLP protos: only when writing back

            try:
                store_path = getattr(backend, "path", None)
                if store_path is not None:
                    backend.close()  # its read-only connection would hold the writer off
                    writeback.write_to_store(str(store_path), job, diagnosis.anomalies, diagnosis.evidence_links)
                if args.otlp_endpoint:
                    writeback.send_otlp(args.otlp_endpoint, writeback.anomaly_spans(
                        job, diagnosis.anomalies, diagnosis.evidence_links))
            except writeback.WritebackError as exc:
                raise UserError(str(exc)) from None
        if diagnosis.detector_errors:  # a partial report must not read as a clean one
            print(f"flare: error: the report is partial: {len(diagnosis.detector_errors)} "
                  f"detector(s) failed ({', '.join(sorted(diagnosis.detector_errors))})",
                  file=sys.stderr)
            return EXIT_FAILURE
        return 0
    finally:
        backend.close()


def import_kineto_command(args: argparse.Namespace) -> int:
    from flare.importers import kineto

    if args.job is not None and not args.job.strip():
        # (seen: `--job ""` imported under the directory's name, `--job " "` as a job
        # `flare jobs` lists with a blank name; `flare run` refuses both)
        raise UserError(f"--job {args.job!r} is empty: name the job, or leave --job out "
                        "for the directory's name")
    try:
        limits = kineto.Limits(max_bytes=kineto.parse_size(args.max_file_size),
                               max_string=kineto.parse_size(args.max_string))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        # Only the default store's directory (.flare) is made; a missing one named
        # by --store is more likely a mistyped path than a wish for new directories.
        result = kineto.import_directory(args.directory, args.store, job=args.job, limits=limits,
                                         create_directory=args.store == DEFAULT_STORE)
    except kineto.TraceError as exc:
        raise UserError(str(exc)) from None
    except Exception as exc:  # a store that is locked, newer, not a store, or a full disk
        from flare.exporters import store as flare_store

        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(str(flare_store.no_space(args.store, exc) or first)) from None
    for error in result.errors:
        print(f"flare: skipped {error}", file=sys.stderr)
    for warning in result.warnings:  # events left out of a file that imported
        print(f"flare: skipped {warning}", file=sys.stderr)
    if not result.files_imported:
        print("flare: error: no trace file imported", file=sys.stderr)
        return EXIT_FAILURE
    print(f"imported {result.files_imported} trace file(s) of {len(result.files)}, {result.spans} "
          f"spans, into job {result.job} of {result.store_path}")
    # what was imported stays; the status tells a script that some files were not
    return EXIT_FAILURE if result.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
