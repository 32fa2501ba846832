"""HTML of the viewer's pages: server-rendered, one small stylesheet, plots as inline SVG, no
script and nothing fetched from elsewhere (the viewer works offline and in a locked-down network).

Invariant: every value from a run (model output, observations, reasons, ids) is HTML-escaped
here, through ``esc``, and nowhere else; a page is a pure function of what it is given.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from shared.schemas import EvalEnd, GroupRecord, GroupRegistration
from shared.trajectory_lookup import FoundTrajectory

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px}header a{color:#9cc3ff;margin-right:14px}
main{padding:16px 20px;max-width:1200px}h1{font-size:20px;margin:6px 0 12px}h2{font-size:16px;margin:18px 0 8px}
table{border-collapse:collapse;background:#fff;width:100%}td,th{border-bottom:1px solid #e3e6eb;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}.num{text-align:right;font-variant-numeric:tabular-nums}
.card{background:#fff;border:1px solid #e3e6eb;border-radius:6px;padding:10px 14px;margin:10px 0}
.turn{border-left:4px solid #3d7be0}.obs{border-left:4px solid #d9a400}.prompt{border-left:4px solid #8a94a6}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:13px/1.4 ui-monospace,monospace}
.tok{font:13px/1.8 ui-monospace,monospace;white-space:pre-wrap;border-radius:2px}.m0{color:#8a94a6}
.m1{background:#d9f2dd;color:#10381a}.m1.lp-mid{background:#fff0c2}.m1.lp-low{background:#ffd6d6}
.pill{display:inline-block;padding:0 7px;border-radius:9px;background:#e3e6eb;font-size:12px}
.failed,.all_failed{background:#ffd6d6}.accepted{background:#d9f2dd}.filtered,.zero_variance,.stale{background:#fff0c2}
form.filters{display:flex;gap:10px;flex-wrap:wrap;align-items:end;margin:8px 0}form.filters label{display:flex;flex-direction:column;font-size:12px}
.plots{display:flex;gap:14px;flex-wrap:wrap}.muted{color:#6b7486}
"""


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}g}"


def page(title: str, body: str, run_id: str = "") -> str:
    nav = '<a href="/">runs</a>'
    if run_id:
        r = quote(run_id)
        nav += (f'<a href="/runs/{r}">{esc(run_id)}</a><a href="/runs/{r}/groups">groups</a>'
                f'<a href="/runs/{r}/trajectories">trajectories</a><a href="/runs/{r}/failures">failures</a>')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)} · Conveyor</title>"
            f"<style>{STYLE}</style></head><body><header><b>Conveyor</b> &nbsp; {nav}</header>"
            f"<main><h1>{esc(title)}</h1>{body}</main></body></html>")


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], css: str = "") -> str:
    """``headers`` empty: a table without a header row."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table class='{css}'>{f'<thead><tr>{head}</tr></thead>' if head else ''}<tbody>{body}</tbody></table>"


def _finite(points: Iterable[tuple[float, float | None]]) -> list[tuple[float, float]]:
    """The points with a finite y (a missing or NaN value is no point)."""
    return [(x, y) for x, y in points if y is not None and math.isfinite(y)]


def line_plot(title: str, series: Mapping[str, Sequence[tuple[float, float | None]]], x_label: str, width: int = 520, height: int = 220) -> str:
    """An SVG line chart of one or more series of (x, y) points."""
    points = [p for s in series.values() for p in _finite(s)]
    if not points:
        return f"<div class='card'><b>{esc(title)}</b><p class='muted'>no data yet</p></div>"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, bottom, pad = 46, 28, 10

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - pad)

    def sy(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - bottom - pad)

    colors = ["#3d7be0", "#d9534f", "#2e9b4f", "#d9a400", "#8a4fd9"]
    lines, legend = [], []
    for n, (name, pts) in enumerate(series.items()):
        finite = _finite(pts)
        color = colors[n % len(colors)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in finite)
        lines.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{path}'/>")
        lines += [f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='{color}'><title>{esc(name)} {fmt(x)}: {fmt(y, 4)}</title></circle>"
                  for x, y in finite]
        legend.append(f"<span style='color:{color}'>■ {esc(name)}</span>")
    axes = (f"<line x1='{left}' y1='{height - bottom}' x2='{width - pad}' y2='{height - bottom}' stroke='#8a94a6'/>"
            f"<line x1='{left}' y1='{pad}' x2='{left}' y2='{height - bottom}' stroke='#8a94a6'/>"
            f"<text x='{left - 4}' y='{sy(y1) + 4:.0f}' font-size='11' text-anchor='end'>{fmt(y1)}</text>"
            f"<text x='{left - 4}' y='{sy(y0) + 4:.0f}' font-size='11' text-anchor='end'>{fmt(y0)}</text>"
            f"<text x='{left}' y='{height - 8}' font-size='11'>{fmt(x0)}</text>"
            f"<text x='{width - pad}' y='{height - 8}' font-size='11' text-anchor='end'>{fmt(x1)} {esc(x_label)}</text>")
    return (f"<div class='card'><b>{esc(title)}</b> &nbsp; <small>{' &nbsp; '.join(legend)}</small>"
            f"<svg class='plot' width='{width}' height='{height}' style='display:block'>{axes}{''.join(lines)}</svg></div>")


def counts_table(counts: dict[str, int]) -> str:
    return table(counts.keys(), [[f"<span class='num'>{n}</span>" for n in counts.values()]])


def runs_page(runs: list[dict[str, Any]]) -> str:
    rows = [[f"<a href='/runs/{quote(r['run_id'])}'>{esc(r['run_id'])}</a>",
             *[f"<span class='num'>{r['counts'][s]}</span>" for s in r["counts"]]] for r in runs]
    states = list(runs[0]["counts"]) if runs else []
    return page("Runs", table(["run", *states], rows) if runs else "<p class='muted'>no run yet</p>")


def run_page(run_id: str, counts: dict[str, int], steps: list[dict[str, Any]], evals: list[EvalEnd],
             trainer_counters: dict[str, int]) -> str:
    reward = {"reward mean": [(s["step"], s.get("reward_mean")) for s in steps],
              "pass rate": [(s["step"], s.get("pass_rate")) for s in steps]}
    throughput: list[tuple[float, float]] = []
    for before, after in zip(steps, steps[1:]):
        wall = after["time"] - before["time"]
        if wall > 0 and after.get("sequences"):
            throughput.append((after["step"], after["sequences"] / wall))
    eval_series: dict[str, list[tuple[float, float]]] = {}
    for end in evals:
        for name, value in end.metrics.items():
            if name.startswith("eval_pass_at_") or name == "eval_reward_mean":
                eval_series.setdefault(name.removeprefix("eval_"), []).append((end.policy_version, value))
    # the off-policy mismatch of behaviour (vLLM) and trainer logprobs (services.trainer.loss)
    mismatch = {key.removeprefix("mismatch_"): [(s["step"], s.get(key)) for s in steps]
                for key in ("mismatch_ratio_p05", "mismatch_ratio_p50", "mismatch_ratio_p95")}
    correction = {key: [(s["step"], s.get(key)) for s in steps] for key in ("mismatch_kl", "correction_masked_frac")}
    plots = (line_plot("reward per step", reward, "step") + line_plot("trajectories / s", {"trained": throughput}, "step")
             + line_plot("evaluation (eval split)", eval_series, "version")
             + line_plot("proximal / behaviour ratio (quantiles)", mismatch, "step")
             + line_plot("mismatch KL and corrected share", correction, "step"))
    eval_rows = [[str(e.policy_version), str(e.served_version), str(e.tasks), str(e.trajectories), str(e.failed),
                  "yes" if e.timed_out else "no", esc(", ".join(f"{k.removeprefix('eval_')} {fmt(v)}" for k, v in sorted(e.metrics.items())
                                                             if "pass_at" in k or k.endswith("reward_mean")))] for e in evals]
    body = (f"<h2>Trajectories by state</h2>{counts_table(counts)}"
            f"<h2>Training</h2><div class='plots'>{plots}</div>"
            f"<h2>Trainer counters</h2>{counts_table(trainer_counters) if trainer_counters else '<p class=muted>none yet</p>'}"
            + (f"<h2>Eval passes</h2>{table(['version', 'served', 'tasks', 'trajectories', 'failed', 'timed out', 'metrics'], eval_rows)}"
               if evals else ""))
    return page(f"Run {run_id}", body, run_id)


def groups_page(run_id: str, rows: list[tuple[int, GroupRegistration | None, GroupRecord | None]], page_no: int,
                has_next: bool) -> str:
    r = quote(run_id)
    cells = []
    for group_id, registration, record in rows:
        status = record.status if record else "pending"
        cells.append([
            f"<a href='/runs/{r}/groups/{group_id}'>{group_id}</a>", esc(registration.task_id if registration else ""),
            esc(registration.env_name if registration else ""), f"<span class='pill {esc(status)}'>{esc(status)}</span>",
            fmt(record.reward_mean if record else None), fmt(record.reward_std if record else None),
            str(sum(m.reward is not None for m in record.members)) if record else "–", esc(record.filter_reason if record else ""),
        ])
    nav = (f"<p>{f'<a href=?page={page_no - 1}>← previous</a> ' if page_no else ''}page {page_no + 1}"
           f"{f' <a href=?page={page_no + 1}>next →</a>' if has_next else ''}</p>")
    return page(f"Groups of {run_id}", table(["group", "task", "environment", "status", "reward mean", "std", "scored",
                                              "filter decision"], cells) + nav, run_id)


def group_page(run_id: str, group_id: int, registration: GroupRegistration | None, record: GroupRecord | None) -> str:
    if record is None:
        return page(f"Group {group_id}", "<p class='muted'>not decided by the trainer yet</p>", run_id)
    rows = [[f"<a href='/t/{quote(m.trajectory_id)}'>{esc(m.trajectory_id)}</a>", fmt(m.reward), fmt(m.advantage),
             esc(m.failure_reason)] for m in record.members]
    head = (f"<div class='card'>status <span class='pill {esc(record.status)}'>{esc(record.status)}</span>"
            f" · task {esc(registration.task_id if registration else '')} · environment {esc(registration.env_name if registration else '')}"
            f" · reward mean {fmt(record.reward_mean)} ± {fmt(record.reward_std)}"
            + (f" · filter: {esc(record.filter_reason)}" if record.filter_reason else "") + "</div>")
    return page(f"Group {group_id} of {run_id}", head + table(["trajectory", "reward", "advantage", "failure"], rows), run_id)


def trajectories_page(run_id: str, rows: list[Any], query: dict[str, str], next_cursor: str | None, scanned: int) -> str:
    def field(name: str, label: str, width: int = 90) -> str:
        return f"<label>{esc(label)}<input name='{name}' value='{esc(query.get(name, ''))}' style='width:{width}px'></label>"

    kinds = "".join(f"<option value='{k}'{' selected' if query.get('kind', '') == k else ''}>{k or 'any'}</option>"
                    for k in ("", "scored", "failed"))
    form = (f"<form class='filters' method='get'>{field('min_reward', 'reward ≥')}{field('max_reward', 'reward ≤')}"
            f"{field('stop_reason', 'stop reason', 110)}{field('env', 'environment', 120)}"
            f"<label>kind<select name='kind'>{kinds}</select></label>{field('failure_class', 'failure class', 120)}"
            "<button type='submit'>filter</button></form>")
    cells = [[f"<a href='/t/{quote(t.trajectory_id)}'>{esc(t.trajectory_id)}</a>",
              f"<a href='/runs/{quote(run_id)}/groups/{t.group_id}'>{t.group_id}</a>", esc(t.env_name),
              f"<span class='pill {esc(t.kind)}'>{esc(t.kind)}</span>", fmt(t.reward), esc(t.stop_reason or ""), esc(t.failure or "")]
             for t in rows]
    more = ""
    if next_cursor:
        more = f"<p><a id='next' href='?{urlencode({**query, 'cursor': next_cursor})}'>next page →</a></p>"
    summary = f"<p class='muted'>{len(rows)} shown, {scanned} looked at</p>"
    return page(f"Trajectories of {run_id}", form + table(
        ["trajectory", "group", "environment", "kind", "reward", "stop reason", "failure"], cells, "trajectories") + summary + more, run_id)


def failures_page(run_id: str, rows: list[dict[str, Any]], failure_class: str, next_cursor: str | None,
                  rejected: list[dict[str, str]]) -> str:
    form = (f"<form class='filters' method='get'><label>failure class<input name='class' value='{esc(failure_class)}'>"
            "</label><button type='submit'>filter</button></form>")
    cells = [[f"<a href='/t/{quote(f['trajectory_id'])}'>{esc(f['trajectory_id'])}</a>", str(f["group_id"]),
              f"<span class='pill failed'>{esc(f['class'])}</span>", str(f["attempts"]), f"<pre>{esc(f['reason'][:2000])}</pre>"]
             for f in rows]
    more = f"<p><a href='?{urlencode({'class': failure_class, 'cursor': next_cursor})}'>next page →</a></p>" if next_cursor else ""
    rejected_table = table(["row", "reason"], [[esc(r.get("source")), esc(r.get("reason"))] for r in rejected])
    return page(f"Failures of {run_id}", form + table(["trajectory", "group", "class", "attempts", "reason"], cells) + more
                + "<h2>Rejected dataset rows</h2>" + (rejected_table if rejected else "<p class='muted'>none</p>"), run_id)


def token_spans(ids: list[int], mask: list[int], logprobs: list[float], decode: Callable[[int], str] | None) -> str:
    """One span per token: m1 (sampled, in the loss) or m0 (context); the title holds its id and logprob."""
    spans = []
    for token_id, m, logprob in zip(ids, mask, logprobs):
        text = decode(token_id) if decode else f"[{token_id}]"
        band = "" if not m else " lp-low" if logprob < -2.5 else " lp-mid" if logprob < -0.5 else ""
        title = f"id {token_id}" + (f" · logprob {logprob:.3f}" if m else " · not trained on")
        spans.append(f"<span class='tok m{m}{band}' title='{esc(title)}'>{esc(text)}</span>")
    return "".join(spans)


def trajectory_page(found: FoundTrajectory, decode: Callable[[int], str] | None) -> str:
    t, scored = found.trajectory, found.scored
    task = t.request.task
    facts = [("run / group", f"<a href='/runs/{quote(t.request.run_id)}/groups/{t.request.group_id}'>"
                             f"{esc(t.request.run_id)} / {t.request.group_id}</a>"),
             ("environment", esc(task.env_name)), ("task", esc(f"{task.task_id} {task.source}")),
             ("ledger", esc(found.state or "–") + (f" <pre>{esc(found.failure)}</pre>" if found.failure else "")),
             ("stop reason", f"<span class='pill' id='stop-reason'>{esc(t.stop_reason.value)}</span> {esc(t.error or '')}"),
             ("reward", "–" if scored is None else f"<b>{fmt(scored.reward, 4)}</b> " + esc(", ".join(
                 f"{c.name} {c.value:.3g}×{c.weight:g}" for c in scored.components))),
             ("attempt / worker", esc(f"{t.attempt} / {t.worker or '–'}")),
             ("timings", esc(f"episode {t.timings.episode_s:.2f}s · inference {t.timings.inference_s:.2f}s · env {t.timings.env_s:.2f}s"))]
    flags = t.env_info.get("diff_flags") or []
    if flags or t.env_info.get("verifier_error"):
        facts.append(("grader", ("<span class='pill' id='diff-flagged'>diff flagged</span> " if flags else "")
                      + f"<pre>{esc(chr(10).join([str(t.env_info.get('verifier_error') or ''), *map(str, flags)]))}</pre>"))
    parts = ["<div class='card'>" + table([], [[f"<b>{k}</b>", v] for k, v in facts]) + "</div>"]
    parts += [f"<div class='card prompt'><b>prompt · {esc(m['role'])}</b><pre>{esc(m['content'])}</pre></div>"
              for m in t.prompt_messages]
    for turn in t.turns:
        calls = "".join(f"<pre class='tool-call'>tool call {esc(c.name)}({esc(json.dumps(c.arguments))})</pre>" for c in turn.tool_calls)
        error = f"<pre class='muted'>malformed tool call: {esc(turn.tool_call_error)}</pre>" if turn.tool_call_error else ""
        ids = turn.prompt_token_ids + turn.sampled_token_ids
        mask = [0] * len(turn.prompt_token_ids) + [1] * len(turn.sampled_token_ids)
        logprobs = [0.0] * len(turn.prompt_token_ids) + turn.logprobs
        tokens = f"<details{' open' if turn is t.turns[0] else ''}><summary>tokens ({len(ids)}; green = trained on)</summary><div class='tokens'>{token_spans(ids, mask, logprobs, decode)}</div></details>"
        parts.append(
            f"<div class='card turn'><b>turn {turn.index}</b> <span class='pill'>policy v{turn.policy_version}</span> "
            f"<span class='pill'>{len(turn.sampled_token_ids)} tokens · {esc(turn.finish_reason)}</span> "
            f"<span class='pill'>reward {fmt(turn.reward)}</span>{' <span class=pill>new segment</span>' if turn.segment_start else ''}"
            f"<pre class='completion'>{esc(turn.completion_text)}</pre>{calls}{error}{tokens}</div>")
        if turn.observation is not None:
            parts.append(f"<div class='card obs'><b>observation · {esc(t.observation_role)}</b><pre>{esc(turn.observation)}</pre></div>")
    for name in ("diff", "test_output", "tests"):
        if name in t.env_info:
            parts.append(f"<div class='card'><b>{esc(name)}</b><pre>{esc(str(t.env_info[name])[:20000])}</pre></div>")
    return page(f"Trajectory {t.trajectory_id}", "".join(parts), t.request.run_id)
