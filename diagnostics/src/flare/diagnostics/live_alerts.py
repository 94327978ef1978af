"""The live alerts (`flare run`, `--follow`) against the final diagnosis: which it
keeps, and why it withdraws the others."""

from __future__ import annotations

from collections.abc import Sequence

from flare.diagnostics.merging import nests
from flare.diagnostics.model import Anomaly, DiagnosisConfig, JobData


def live_alerts(alerted: Sequence[Anomaly], final: list[Anomaly]) -> list[dict]:
    """What the live monitor said, in order, each with whether this report keeps it
    (a label of its kind on the same ranks): the final report lists all of them."""
    return [{"kind": a.kind, "ranks": sorted(a.ranks), "cause": a.cause, "first_step": a.first_step,
             "kept": _kept(a, final)}
            for a in alerted]


def _kept(alert: Anomaly, final: list[Anomaly]) -> bool:
    """A label of the alert's kind on the same ranks, or one that carries it nested."""
    ranks = set(alert.ranks)
    return any((f.kind == alert.kind and set(f.ranks) == ranks) or nests(f, alert.kind, ranks)
               for f in final)


def _measured(job: JobData | None, config: DiagnosisConfig, ranks: set[int], first_step: int | None) -> str:
    """The figures behind "not confirmed": over the alert's steps to the end, the ranks'
    work (step time less collective wait) against their peers', and the peers' wait."""
    import numpy as np

    from flare.diagnostics import frame as frames

    frame = frames.load(job, config) if job is not None else None
    if frame is None or not ranks or len(frame.ranks) < 2:
        return ""
    mine = np.isin(frame.ranks, sorted(ranks))
    if not mine.any() or mine.all():
        return ""
    cols = frame.steps >= (first_step if first_step is not None else frame.steps.min())
    if not cols.any():
        return ""
    work = frame.duration - np.nan_to_num(frame.wait, nan=0.0)
    with np.errstate(all="ignore"):
        subject = float(np.nanmean(np.nanmedian(work[mine][:, cols], axis=0)))
        peers = float(np.nanmean(np.nanmedian(work[~mine][:, cols], axis=0)))
        waited = float(np.nanmean(np.nanmedian(frame.wait[~mine][:, cols], axis=0)))
    if not all(np.isfinite(v) for v in (subject, peers, waited)):
        return ""
    last = int(frame.steps[cols].max() + frame.bucket - 1)
    return (f" (steps {int(frame.steps[cols].min())}-{last}: its work {subject:.1f} ms/step against "
            f"its peers' {peers:.1f} ({subject - peers:+.1f}), the peers waiting {waited:.1f} ms/step)")


def withdrawn(alerted: Sequence[Anomaly], final: list[Anomaly], job: JobData | None = None,
              config: DiagnosisConfig | None = None, blips: Sequence[Anomaly] = ()) -> list[dict]:
    """The live alerts the final report does not keep, each with one line of why.

    An alert is kept when the final report has a label of its kind on the same ranks
    (its steps or figures may have moved as more steps came in), or carries it nested
    (a fail-slow inside the straggler behind it); one that a label of
    another kind or cause on the same ranks replaced says which; the rest were not
    confirmed once every step was in (a pass sees only the steps every rank has sent:
    a short burst can look persistent there)."""
    out = []
    for alert in alerted:
        ranks = set(alert.ranks)
        if _kept(alert, final):
            continue
        instead = next((a for a in final if ranks and ranks & set(a.ranks)), None)
        blip = next((b for b in blips if b.kind == alert.kind and set(b.ranks) == ranks), None)
        if blip is not None:
            why = (f"a short episode: steps {blip.first_step}-{blip.last_step} cost "
                   f"{blip.impact:.1%} of the run's time, under the "
                   f"{(config or DiagnosisConfig()).straggler_min_run_share:.0%} a label needs")
        elif instead is not None:
            why = (f"superseded by [{instead.kind}] ranks {','.join(map(str, instead.ranks))} "
                   f"cause {instead.cause} from step {instead.first_step}")
        else:
            why = ("not confirmed over the whole run: it did not persist once every step "
                   "was in" + _measured(job, config or DiagnosisConfig(), ranks, alert.first_step))
        out.append({"kind": alert.kind, "ranks": sorted(alert.ranks), "cause": alert.cause,
                    "first_step": alert.first_step, "reason": why})
    return out
