"""Asking a Flare collector over its control channel: the credentials, and a
capture of some ranks' next steps (`flare capture`, `flare diagnose --follow --collector`).
"""

from __future__ import annotations

import os

from flare.wire import semconv as sc


def control_headers() -> dict[str, str]:
    """The control channel's credentials from the environment: the job's token
    (FLARE_JOB_TOKEN: that job only) and the operator's (FLARE_OPERATOR_TOKEN: any job)."""
    from flare.diagnostics.backends.http_json import header_token

    headers = {}
    for env, header in ((sc.ENV_JOB_TOKEN, sc.HEADER_JOB_TOKEN),
                        (sc.ENV_OPERATOR_TOKEN, sc.HEADER_OPERATOR_TOKEN)):
        value = os.environ.get(env)
        if value:
            headers[header] = header_token(value, env)
    return headers


def collector_asker(url: str):
    """`ask(job, ranks, steps, stacks=True)` → the answer of a Flare collector's
    /flare/v1/capture (token and TLS from the FLARE_BACKEND_* settings, as for the
    backends, and the control channel's from `control_headers`); transport and HTTP
    failures are BackendErrors."""
    from flare.diagnostics.backends.http_json import JsonClient

    client = JsonClient(url, "the collector")
    headers = control_headers()

    def ask(job_id: str | None, ranks: list[int], steps: int, stacks: bool = True) -> dict:
        return client.post_json("/flare/v1/capture",
                                {"job": job_id, "ranks": ranks, "steps": steps, "stacks": stacks},
                                headers)

    ask.close = client.close
    return ask
