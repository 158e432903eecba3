"""report.html: one self-contained page (inline CSS, SVG and JS only, so it opens offline from disk) with the
report's tables, bar charts of the figures, the learning curve of each trained run and every episode's trace,
filterable by text.

Everything rendered is untrusted (email bodies, model output), so every string goes through ``esc``, which
scrubs API-key-like tokens and HTML-escapes.
"""
from __future__ import annotations

import html
import json
import re

from email_agent.evaluation.report_tables import (CURVE_METRICS, DASH, NOTES, OUTCOME_NOTE, PAIR_NOTE, comparison_rows,
                                                  num, outcome_rows, pair_rows, pct, setup_rows, what_training_changed,
                                                  when_what)
from email_agent.evaluation.scores import is_number, question_key, warm_start_steps
from email_agent.redact import redact

TOOL_RESULT_LIMIT = 2000
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]


def esc(text) -> str:
    return html.escape(redact(text), quote=True)


# ---------------------------------------------------------------- SVG charts

def _bar_chart(title: str, bars: list[tuple[str, float | None]], fmt, vmax: float | None = None,
               whiskers: list | None = None) -> str:
    """Horizontal bars (model names can be long); whiskers are optional (lo, hi) pairs per bar."""
    known = [v for _, v in bars if v is not None]
    if not known:
        return ""
    top = vmax or max(max(known), 1e-9) * 1.15
    lw, bw, rh = 180, 260, 26

    def x(v):
        return lw + bw * min(max(v / top, 0.0), 1.0)

    out = [f'<svg class="chart" width="{lw + bw + 80}" height="{34 + rh * len(bars)}" role="img" '
           f'aria-label="{esc(title)}"><text x="0" y="16" class="ct">{esc(title)}</text>']
    for i, (label, v) in enumerate(bars):
        y = 28 + i * rh
        short = label if len(label) <= 26 else label[:25] + "…"
        out.append(f'<text x="{lw - 6}" y="{y + 14}" text-anchor="end">'
                   f'<title>{esc(label)}</title>{esc(short)}</text>')
        if v is None:
            out.append(f'<text x="{lw + 4}" y="{y + 14}">{DASH}</text>')
            continue
        end = x(v)
        out.append(f'<rect x="{lw}" y="{y}" width="{end - lw:.1f}" height="18" fill="{PALETTE[i % len(PALETTE)]}"/>')
        if whiskers and whiskers[i]:
            lo, hi = x(whiskers[i][0]), x(whiskers[i][1])
            out.append(f'<path d="M{lo:.1f},{y + 9}H{hi:.1f}M{lo:.1f},{y + 4}V{y + 14}M{hi:.1f},{y + 4}V{y + 14}" '
                       f'stroke="#222" fill="none"/>')
            end = max(end, hi)
        out.append(f'<text x="{end + 5:.1f}" y="{y + 14}">{esc(fmt(v))}</text>')
    return "".join(out) + "</svg>"


def _line_chart(metric: str, series: list[tuple[str, list[tuple[float, float]]]],
                shade: tuple[float, float] | None = None) -> str:
    """One metric of several runs against the step; `shade` greys a span of steps (the warm start)."""
    pts = [p for _, s in series for p in s]
    if not pts:
        return ""
    W, H, L, R, T, B = 520, 240, 56, 16, 30, 30
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    if shade:
        x0, x1 = min(x0, shade[0]), max(x1, shade[1])
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1 = x1 if x1 > x0 else x0 + 1
    if y1 == y0:  # a flat series: span it to 0, so a constant rate of 1.0 reads 0..1, not 1..2
        y0, y1 = min(y0, 0.0), max(y0, 0.0)
        y1 = y1 if y1 > y0 else y0 + 1

    def sx(s):
        return L + (s - x0) / (x1 - x0) * (W - L - R)

    def sy(v):
        return H - B - (v - y0) / (y1 - y0) * (H - T - B)

    out = [f'<svg class="chart" width="{W}" height="{H}" role="img" aria-label="{esc(metric)}">',
           f'<text x="0" y="16" class="ct">{esc(metric)} vs step</text>',
           f'<path d="M{L},{T}V{H - B}H{W - R}" stroke="#888" fill="none"/>',
           f'<text x="{L - 4}" y="{T + 4}" text-anchor="end">{y1:.3g}</text>',
           f'<text x="{L - 4}" y="{H - B}" text-anchor="end">{y0:.3g}</text>',
           f'<text x="{L}" y="{H - 12}">{x0:g}</text><text x="{W - R}" y="{H - 12}" text-anchor="end">{x1:g}</text>']
    if shade:
        a, b = sx(shade[0]), sx(shade[1])
        out.append(f'<rect class="warm" x="{a:.1f}" y="{T}" width="{max(b - a, 2):.1f}" height="{H - T - B}" '
                   f'fill="#999" fill-opacity="0.15"><title>warm start (supervised), steps {shade[0]:g}-{shade[1]:g}'
                   f'</title></rect><text x="{a + 3:.1f}" y="{T + 12}" fill="#666">warm start</text>')
    legend = []
    for i, (label, s) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in s)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="3" fill="{color}"><title>{esc(label)} step {a:g}: '
                f'{b:.4g}</title></circle>' for a, b in s]
        legend.append(f'<span style="color:{color}">■</span> {esc(label)}')
    return "".join(out) + '</svg><div class="legend">' + " &nbsp; ".join(legend) + "</div>"


# ---------------------------------------------------------------- traces

def _status(r: dict) -> tuple[str, str]:
    if r.get("error"):
        return "error", "error"
    if r.get("answer") is None:
        return "no answer", "noanswer"
    m = r.get("metrics") or {}
    if m.get("returned_i_dont_know"):
        return "I don't know", "idk"
    correct = m.get("answer_correct")
    if correct is None:
        correct = (r.get("verdict") or {}).get("correct")
    return ("correct", "correct") if correct else ("wrong", "wrong")


def _content_text(content) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _pretty_args(arguments) -> str:
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return str(arguments)  # models emit malformed JSON; show it as sent
    return json.dumps(parsed, indent=2, ensure_ascii=False)


def _message_html(m: dict) -> str:
    role = str(m.get("role", "?"))
    text = redact(_content_text(m.get("content")))
    if role == "tool" and len(text) > TOOL_RESULT_LIMIT:
        text = text[:TOOL_RESULT_LIMIT] + f"\n… [truncated {len(text) - TOOL_RESULT_LIMIT:,} more characters]"
    body = [f"<pre>{esc(text)}</pre>"] if text else []
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        body.append(f'<div class="call">tool call <code>{esc(fn.get("name"))}</code>'
                    f'<pre>{esc(_pretty_args(fn.get("arguments")))}</pre></div>')
    return (f'<div class="msg {re.sub("[^a-z]", "", role.lower())}"><div class="role">{esc(role)}</div>'
            + "".join(body) + "</div>")


def _attempt_html(r: dict) -> str:
    status, css = _status(r)
    v = r.get("verdict") or {}
    answer = r.get("answer")
    meta = [f"reward {num(r.get('reward'))}", f"turns {num((r.get('metrics') or {}).get('num_turns'), '{}')}",
            f"judge {v.get('judge') or DASH}"]
    notes = [f'<p class="meta">{esc(" · ".join(meta))}</p>']
    withheld = r.get("withheld")
    if withheld:
        right = "right" if (r.get("metrics") or {}).get("withheld_right") else "wrong"
        notes.append(f"<p><b>Withheld by the grounding check:</b> {esc(withheld['answer'])} ({right}; "
                     f"{esc(', '.join(withheld['unseen']))} in nothing the agent saw)</p>")
    for key, text in (("Judge", v.get("reasoning")), ("Judge error", v.get("error")), ("Rollout error", r.get("error")),
                      ("Sources", ", ".join(map(str, r.get("sources") or [])))):
        if text:
            notes.append(f"<p><b>{key}:</b> {esc(text)}</p>")
    conversation = "".join(_message_html(m) for m in r.get("messages") or [])
    return (f'<details class="attempt"><summary><span class="badge {css}">{esc(status)}</span> '
            f'<b>{esc(r.get("model", "?"))}</b>: {esc("(no answer)" if answer is None else answer)}</summary>'
            + "".join(notes) + conversation + "</details>")


def _question_html(rs: list[dict]) -> str:
    q = rs[0]
    has_wrong = any(_status(r)[1] != "correct" for r in rs)
    badges = " ".join(f'<span class="badge {_status(r)[1]}" title="{esc(r.get("model"))}">'
                      f'{esc(r.get("model"))}</span>'
                      for r in rs)
    facts = (f"<p><b>Gold answer:</b> {esc(q.get('gold_answer'))}</p><p class=\"meta\">inbox {esc(q.get('inbox'))} · "
             f"date {esc(q.get('query_date'))} · "
             f"gold messages {esc(', '.join(map(str, q.get('gold_message_ids') or [])))}</p>")
    return (f'<details class="question" data-haswrong="{int(has_wrong)}"><summary>#{esc(question_key(q))} '
            f'{esc(q.get("question"))} {badges}</summary>'
            + facts + "".join(_attempt_html(r) for r in rs) + "</details>")


# ---------------------------------------------------------------- page

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;font-size:14px}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}
.chart{margin:8px 16px 8px 0;font-size:12px}.ct{font-weight:bold;font-size:13px}\
.legend{font-size:12px;margin-bottom:12px}
details.question{border:1px solid #ddd;border-radius:4px;margin:6px 0;padding:4px 8px}
details.attempt{margin:6px 0 6px 16px}summary{cursor:pointer}
.badge{border-radius:3px;padding:0 5px;font-size:12px;color:#fff}.correct{background:#2e7d32}.wrong{background:#c62828}
.idk{background:#ef8f00}.noanswer{background:#757575}.error{background:#6a1b9a}
.msg{border-left:3px solid #ccc;margin:4px 0;padding:2px 8px}.msg.assistant{border-color:#4e79a7}
.msg.tool{border-color:#59a14f}.msg.system{border-color:#999}.role{font-size:11px;color:#666;text-transform:uppercase}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;font-size:13px}.meta{color:#666;font-size:13px}"""

# Controls stay hidden unless JS runs, so a JS-off page shows no dead widgets.
_FILTER_JS = """(function(){var c=document.getElementById('controls');c.hidden=false;
var f=document.getElementById('flt'),w=document.getElementById('onlywrong');
function run(){var t=f.value.toLowerCase();document.querySelectorAll('details.question').forEach(function(d){
var ok=(!t||d.textContent.toLowerCase().indexOf(t)>=0)&&(!w.checked||d.dataset.haswrong==='1');
d.style.display=ok?'':'none';});}f.addEventListener('input',run);w.addEventListener('change',run);})();"""


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    return ("<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows) + "</tbody></table>")


def page(title, records, summary, histories) -> str:
    """The whole page: the tables, the charts, each run's learning curve, then every question's traces."""
    header, rows = comparison_rows(summary)
    table = ("<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead><tbody>"
             + "".join('<tr class="model-row">' + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
             + "</tbody></table>")
    changed = what_training_changed(summary)
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{esc(title)}</h1><p>{esc(when_what(records, summary))}</p>",
             "<h2>Comparison</h2>", table,
             f"<p class=\"meta\">{esc(NOTES)}</p>", "<h2>How each model played</h2>",
             _html_table(*setup_rows(summary)),
             "<h2>Where answers went wrong</h2>", _html_table(*outcome_rows(summary)),
             f"<p class=\"meta\">{esc(OUTCOME_NOTE)}</p>",
             *(["<h2>What training changed</h2><ul>", *(f"<li>{esc(line)}</li>" for line in changed), "</ul>"]
               if changed else []),
             *(["<h2>Paired comparison</h2>", _html_table(*pair_rows(summary)),
                f"<p class=\"meta\">{esc(PAIR_NOTE)}</p>"]
               if summary.get("pairs") else []),
             "<h2>Charts</h2><div>", *_bar_charts(summary["models"]), "</div>"]
    if histories:
        parts += _learning_curves(histories)
    grouped: dict = {}
    for r in records:
        grouped.setdefault(question_key(r), []).append(r)
    parts += ["<h2>Per-question traces</h2>",
              '<div id="controls" hidden><input id="flt" placeholder="Filter by text…"> '
              '<label><input type="checkbox" id="onlywrong"> only questions with a non-correct attempt</label></div>',
              *(_question_html(rs) for rs in grouped.values()),
              f"<script>{_FILTER_JS}</script></body></html>"]
    return "\n".join(p for p in parts if p)


def _bar_charts(models: dict) -> list[str]:
    labels = list(models)

    def bars(key):
        return [(m, models[m][key]) for m in labels]

    return [
        _bar_chart("Accuracy (95% Wilson CI)", bars("accuracy"), pct, 1.0, [models[m]["accuracy_ci"] for m in labels]),
        _bar_chart("Hallucination rate", bars("hallucination_rate"), pct, 1.0),
        _bar_chart("I-don't-know rate", bars("idk_rate"), pct, 1.0),
        _bar_chart("Average turns", bars("avg_turns"), lambda v: f"{v:.2f}"),
        _bar_chart("Latency p50 (s)", bars("latency_p50_s"), lambda v: f"{v:.2f} s"),
        _bar_chart("Cost per 1,000 questions (USD)", bars("cost_per_1k_usd"), lambda v: f"${v:,.2f}"),
    ]


def _learning_curves(histories: dict[str, list[dict]]) -> list[str]:
    """One line chart per metric, every trained run on it, the warm start's steps shaded."""
    parts = ['<h2 id="learning-curve">Learning curve</h2><p class="meta">train/reward: the GRPO rollouts '
             '(sampled); val/*: greedy episodes on held-out train questions. Grey: the supervised warm '
             'start (its steps have no train reward).</p><div>']
    warm = sorted(set().union(*(warm_start_steps(rows) for rows in histories.values())))
    # The warm start begins from the checkpoint before its first epoch (the untrained LoRA).
    shade = (float(warm[0] - 1 if warm[0] > 0 else 0), float(warm[-1])) if warm else None
    for metric in CURVE_METRICS:
        series = [(label, sorted((float(r["step"]), float(r[metric])) for r in rows
                                 if is_number(r.get("step")) and is_number(r.get(metric))))
                  for label, rows in histories.items()]
        parts.append(_line_chart(metric, [s for s in series if s[1]], shade))
    return parts + ["</div>"]
