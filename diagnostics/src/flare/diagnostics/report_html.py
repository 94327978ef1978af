"""The HTML report: one self-contained file (inline CSS, SVG and PNG data URIs).

Heat maps are drawn as tiny PNGs (one pixel per rank-group × step-bucket, scaled by
the browser), so a thousand ranks by an hour of steps stays a few hundred kilobytes;
the timeline of the worst steps is SVG.
"""

from __future__ import annotations

import base64
import html
import json
import struct
import warnings
import zlib

import numpy as np

from flare.diagnostics import frame as frames
from flare.diagnostics.model import DiagnosisConfig, JobData
from flare.diagnostics.pipeline import Diagnosis
from flare.diagnostics.stats import nanmedian
from flare.wire import semconv as sc

_MAX_ROWS = 256
_MAX_COLS = 600
_TIMELINE_RANKS = 32
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse}td,th{padding:4px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}
.k-hang,.k-error,.k-rank_missing{color:#b00020;font-weight:600}.k-straggler,.k-fail_slow{color:#a15c00;font-weight:600}
.heat{image-rendering:pixelated;width:100%;height:260px;border:1px solid #ccc}
.legend{font-size:12px;color:#555}pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:12px}
details{margin:4px 0}.ok{color:#1b7f3b;font-weight:600}.bad{color:#b3261e}
"""


def render(diagnosis: Diagnosis, job: JobData, config: DiagnosisConfig) -> str:
    frame = frames.load(job, config)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Flare: {_e(diagnosis.job)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Flare diagnosis of job {_e(diagnosis.job)}</h1>",
             f"<p>Backend {_e(diagnosis.backend)}; "
             + (f"steps {diagnosis.steps[0]}–{diagnosis.steps[1]}" if diagnosis.steps else "no steps")
             + (f"; {len(frame.ranks)} ranks" if frame is not None else "") + "</p>",
             "<h2>Anomalies</h2>", _steps_unseen(diagnosis), _anomalies(diagnosis), _wait_unknown(diagnosis),
             _contention_unknown(diagnosis), _time_lost(diagnosis),
             _withdrawn(diagnosis), _flame_graphs(diagnosis, job)]
    if frame is not None:
        parts += ["<h2>Step time, rank × step</h2>", _heat(frame.duration, frame, "ms per step"),
                  "<h2>Collective wait, rank × step</h2>",
                  "<p class='legend'>Dark = long wait. The culprit of a straggling step is the rank with the "
                  "<em>least</em> wait: the light row among dark ones.</p>",
                  _heat(frame.wait, frame, "ms waiting in collectives"),
                  "<h2>Worst steps across ranks</h2>", _timelines(job, frame)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _e(text: object) -> str:
    return html.escape(str(text))


def _anomalies(diagnosis: Diagnosis) -> str:
    partial = ""
    if diagnosis.detector_errors:  # before any verdict: "no anomalies" would be false
        partial = f"<p class='bad'><b>Partial report</b>: {_e(diagnosis.partial_text())}</p>"
    if not diagnosis.anomalies:
        return partial + ("<p>No anomalies found by the detectors that ran.</p>"
                          if partial else "<p class='ok'>No anomalies found.</p>")
    return partial + _anomaly_table(diagnosis)


def _time_lost(diagnosis: Diagnosis) -> str:
    rows = diagnosis.time_lost
    if not rows or not any(r["seconds"] > 0 for r in rows):
        return ""
    body = "".join(f"<tr><td>{_e(r['who'])}</td><td>{_e(r['cause'])}</td><td>{r['seconds']:.2f}</td>"
                   f"<td>{r['share']:.1%}</td></tr>" for r in rows)
    return ("<h2>Where the time went</h2><table><tr><th>who</th><th>cause</th><th>seconds</th>"
            f"<th>share of the run</th></tr>{body}</table>")


def _unknown(title: str, row: dict | None, said: str) -> str:
    """One line for what the diagnosis could not tell on some ranks (said once)."""
    if not row:
        return ""
    return (f"<p class='bad'><b>{title}</b>: ranks {_e(', '.join(map(str, row['ranks'])))} "
            f"{said}{_e(row['note'])}.</p>")


def _wait_unknown(diagnosis: Diagnosis) -> str:
    row = diagnosis.wait_unknown
    return _unknown("Wait unknown", row, f"ran {row['collectives_per_step']:g} " if row else "")


def _steps_unseen(diagnosis: Diagnosis) -> str:
    row = diagnosis.steps_unseen
    return _unknown("Steps unseen", row, f"trained for {row['trained_s']:g} s ({row['batches']} batches) "
                    "and " if row else "")


def _contention_unknown(diagnosis: Diagnosis) -> str:
    return _unknown("Host contention unknown", diagnosis.contention_unknown, "")


def _withdrawn(diagnosis: Diagnosis) -> str:
    live = diagnosis.live_alerts
    said = (f"<p>Live alerts: {len(live)} said while the job ran, "
            f"{sum(1 for a in live if a['kept'])} kept in this report.</p>") if live else ""
    if not diagnosis.withdrawn:
        return said
    items = "".join(f"<li>[{_e(w['kind'])}] ranks {_e(', '.join(map(str, w['ranks'])))} cause "
                    f"{_e(w['cause'])}: {_e(w['reason'])}</li>" for w in diagnosis.withdrawn)
    return f"{said}<h2>Withdrawn live alerts</h2><ul>{items}</ul>"


def _anomaly_table(diagnosis: Diagnosis) -> str:
    rows = ["<table><tr><th>kind</th><th>ranks</th><th>cause</th><th>steps</th><th>impact</th>"
            "<th>confidence</th><th>what happened</th></tr>"]
    for a in diagnosis.anomalies:
        steps = "" if a.first_step is None else f"{a.first_step}–{'' if a.last_step is None else a.last_step}"
        evidence = json.dumps(a.to_json()["evidence"], indent=2)
        extra = ""
        if a.callsite:  # (a line waited on reads "waiting in …", not "at waiting in …")
            waited = a.callsite.startswith(sc.CAPTURE_WAITING)
            line = a.callsite[len(sc.CAPTURE_WAITING):] if waited else a.callsite
            extra = f"<br>{'waiting in' if waited else 'at'} <code>{_e(line)}</code>"
        elif a.evidence.get("capture"):
            from flare.diagnostics.report_text import unanswered_capture

            extra = f"<br>{_e(unanswered_capture(a.evidence['capture']))}"
        traces = "".join(f"<li><code>{_e(t)}</code></li>" for t in a.trace_ids)
        rows.append(
            f"<tr><td class='k-{_e(a.kind)}'>{_e(a.kind)}</td><td>{_e(', '.join(map(str, a.ranks)) or 'all')}</td>"
            f"<td>{_e(a.cause)}</td><td>{_e(steps)}</td><td>{a.impact:.0%}</td><td>{a.confidence:.2f}</td>"
            f"<td>{_e(a.summary)}{extra}<details><summary>evidence</summary><pre>{_e(evidence)}</pre>"
            + (f"<p>traces:</p><ul>{traces}</ul>" if traces else "") + "</details></td></tr>")
    rows.append("</table>")
    return "".join(rows)


_FLAME_WIDTH, _FLAME_ROW, _FLAME_DEPTH = 560, 16, 24


def _flame_graphs(diagnosis: Diagnosis, job: JobData) -> str:
    """Per label with a capture: the culprit's and the peer's stacks side by side, on one
    scale (ms per captured step); a frame the culprit spends more on than the peer is red."""
    from flare.diagnostics import hotspots

    out = []
    drawn: set[tuple] = set()
    for a in diagnosis.anomalies:
        key = (tuple(a.ranks), a.first_step, a.last_step)
        if key in drawn:  # (a straggler and its fail-slow: the same captured steps)
            continue
        trees = hotspots.flames(job, a)
        if trees is None:
            continue
        drawn.add(key)
        kinds = ", ".join(b.kind for b in diagnosis.anomalies
                          if (tuple(b.ranks), b.first_step, b.last_step) == key and b.evidence.get("hotspots"))
        culprit, peer = trees
        scale = _FLAME_WIDTH / max(culprit["ms"], peer["ms"], 1e-9)
        peer_ms = _flat_ms(peer)
        ranks = ", ".join(map(str, a.ranks))
        out.append(f"<h3>[{_e(kinds)}] ranks {_e(ranks)}: where the captured steps' time went</h3>"
                   "<div style='display:flex;gap:16px'>"
                   + _flame_svg(culprit, scale, f"culprit (ranks {ranks}): {culprit['ms']:.0f} ms per step", peer_ms)
                   + _flame_svg(peer, scale, f"peer: {peer['ms']:.0f} ms per step", None) + "</div>")
    if not out:
        return ""
    return ("<h2>From the label to the line: culprit vs peer</h2><p class='legend'>Sampled Python stacks of "
            "the captured steps, root at the top; width is ms per step on one scale for both sides. Red: "
            "a frame the culprit spends more than 1 ms per step longer on than the peer.</p>" + "".join(out))


def _flat_ms(tree: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for child in tree["children"]:
        path = prefix + ";" + child["name"]
        out[path] = out.get(path, 0.0) + child["ms"]
        out.update(_flat_ms(child, path))
    return out


def _flame_svg(tree: dict, scale: float, title: str, peer_ms: dict[str, float] | None) -> str:
    items: list[str] = []
    depth_seen = [0]

    def draw(node: dict, x: float, depth: int, path: str) -> None:
        for child in node["children"]:
            width = child["ms"] * scale
            if width < 1 or depth >= _FLAME_DEPTH:
                continue
            child_path = path + ";" + child["name"]
            hot = peer_ms is not None and child["ms"] - peer_ms.get(child_path, 0.0) > 1.0
            y = 20 + depth * _FLAME_ROW
            label = child["name"].rsplit("/", 1)[-1]
            chars = int(width / 6.5)
            items.append(
                f"<g><title>{_e(child['name'])}: {child['ms']:.1f} ms/step</title>"
                f"<rect x='{x:.1f}' y='{y}' width='{width:.1f}' height='{_FLAME_ROW - 1}' "
                f"fill='{'#e0533d' if hot else '#e8b04a'}'/>"
                + (f"<text x='{x + 2:.1f}' y='{y + 12}' font-size='11'>{_e(label[:chars])}</text>"
                   if chars >= 4 else "") + "</g>")
            depth_seen[0] = max(depth_seen[0], depth + 1)
            draw(child, x, depth + 1, child_path)
            x += width

    draw(tree, 0.0, 0, "")
    height = 26 + depth_seen[0] * _FLAME_ROW
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{_FLAME_WIDTH}' height='{height}'>"
            f"<text x='0' y='13' font-size='12'>{_e(title)}</text>{''.join(items)}</svg>")


def _downsample(matrix: np.ndarray) -> np.ndarray:
    rows, cols = matrix.shape
    row_group = max(1, -(-rows // _MAX_ROWS))
    col_group = max(1, -(-cols // _MAX_COLS))
    padded = np.full((-(-rows // row_group) * row_group, -(-cols // col_group) * col_group), np.nan)
    padded[:rows, :cols] = matrix
    shaped = padded.reshape(padded.shape[0] // row_group, row_group, padded.shape[1] // col_group, col_group)
    # The max keeps one slow rank visible inside a group of healthy ones. A group with no
    # value at all stays NaN (numpy warns about those groups rather than raising).
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.where(np.all(np.isnan(shaped), axis=(1, 3)), np.nan, np.nanmax(shaped, axis=(1, 3)))


def _heat(matrix: np.ndarray, frame: frames.StepFrame, unit: str) -> str:
    small = _downsample(matrix.astype(np.float64))
    finite = small[np.isfinite(small)]
    lo, hi = (float(np.percentile(finite, 1)), float(np.percentile(finite, 99))) if finite.size else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    norm = np.clip((small - lo) / (hi - lo), 0, 1)
    # White → orange → dark red; missing = light grey.
    r = np.where(np.isnan(norm), 235, 255 - 120 * np.nan_to_num(norm))
    g = np.where(np.isnan(norm), 235, 250 - 220 * np.nan_to_num(norm))
    b = np.where(np.isnan(norm), 235, 240 - 230 * np.nan_to_num(norm))
    pixels = np.stack([r, g, b], axis=-1).astype(np.uint8)
    ranks = f"ranks {int(frame.ranks[0])}–{int(frame.ranks[-1])} (top to bottom)"
    steps = f"steps {int(frame.steps[0])}–{frame.last_step_of(len(frame.steps) - 1)} (left to right)"
    return (f"<img class='heat' alt='heat map' src='data:image/png;base64,{_png(pixels)}'>"
            f"<p class='legend'>{_e(ranks)}; {_e(steps)}; colour scale {lo:.1f} (white) to "
            f"{hi:.1f} (dark) {_e(unit)}.</p>")


def _png(pixels: np.ndarray) -> str:
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    return base64.b64encode(png).decode()


def _timelines(job: JobData, frame: frames.StepFrame, count: int = 3) -> str:
    if frame.bucket != 1:
        worst_cols = np.argsort(-np.nan_to_num(nanmedian(frame.duration.astype(np.float64), axis=0)))[:count]
    else:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # steps no rank reported
            spread = np.nanmax(frame.duration, axis=0) if frame.duration.size else np.array([])
        worst_cols = np.argsort(-np.nan_to_num(spread.astype(np.float64)))[:count]
    out = []
    for col in sorted(int(c) for c in worst_cols):
        step = frame.step_of(col)
        rows = job.spans(["train.step"], ["flare.step.collective_wait_ms"], first_step=step,
                         last_step=step, columns=["rank", "start_ns", "end_ns"])
        out.append(_timeline_svg(step, rows.to_pylist()))
    return "".join(out) or "<p>No step spans.</p>"


def _timeline_svg(step: int, rows: list[dict]) -> str:
    rows = [r for r in rows if r["rank"] is not None and r["start_ns"] is not None][: 4 * _TIMELINE_RANKS]
    by_rank: dict[int, dict] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], row)
    ordered = [by_rank[r] for r in sorted(by_rank)][:_TIMELINE_RANKS]
    if not ordered:
        return ""
    t0 = min(r["start_ns"] for r in ordered)
    t1 = max(r["end_ns"] for r in ordered)
    span = max(t1 - t0, 1)
    width, bar, left = 900, 14, 60
    height = bar * len(ordered) + 30
    items = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width + left + 10}' height='{height}'>"]
    for i, r in enumerate(ordered):
        y = 10 + i * bar
        x0 = left + width * (r["start_ns"] - t0) / span
        x1 = left + width * (r["end_ns"] - t0) / span
        wait_ms = r.get("flare.step.collective_wait_ms") or 0.0
        xw = max(x0, x1 - width * wait_ms * 1e6 / span)
        items.append(f"<text x='0' y='{y + 10}' font-size='11'>rank {r['rank']}</text>")
        items.append(f"<rect x='{x0:.1f}' y='{y}' width='{max(xw - x0, 0.5):.1f}' height='{bar - 3}' fill='#3b73b9'/>")
        items.append(f"<rect x='{xw:.1f}' y='{y}' width='{max(x1 - xw, 0):.1f}' height='{bar - 3}' fill='#e8a33d'/>")
    items.append(f"<text x='{left}' y='{height - 4}' font-size='11'>step {step}: {span / 1e6:.1f} ms across ranks; "
                 "blue = own work, orange = waiting in collectives</text></svg>")
    return "<div>" + "".join(items) + "</div>"
