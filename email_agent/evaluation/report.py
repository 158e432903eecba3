"""The evaluation's report: `write_report` writes the figures of `summary` as summary.json, report.md and one
self-contained report.html (inline CSS, SVG and JS only, so it opens offline from disk): the comparison
table, charts, outcomes, paired tests, the learning curve of each trained run (rows of `scores.load_history`) and
every episode's trace.

Everything rendered is untrusted (email bodies, model output), so every string goes through ``_esc``, which
scrubs API-key-like tokens and HTML-escapes.
"""
from __future__ import annotations

import html
import json
import logging
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from email_agent.errors import DataError
from email_agent.redact import redact
from email_agent.evaluation.scores import OUTCOMES, is_number, question_key, warm_start_steps

log = logging.getLogger(__name__)

VAL_METRICS = ["val/reward", "val/answer_correct", "val/valid_tool_call_rate", "val/hallucinated", "val/num_turns"]
# The learning curve: the training reward (the rollouts GRPO learned from) beside the greedy validation metrics.
CURVE_METRICS = ["train/reward", *VAL_METRICS]
TOOL_RESULT_LIMIT = 2000
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]
DASH = "—"


# ---------------------------------------------------------------- formatting

def _esc(text) -> str:
    return html.escape(redact(text), quote=True)


def _pct(v) -> str:
    return DASH if v is None else f"{100 * v:.1f}%"


def _num(v, fmt: str = "{:.2f}") -> str:
    return DASH if v is None else fmt.format(v)


def _comparison_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and plain-text cells shared by the Markdown and HTML tables."""
    header = ["Model", "n", "Errors", "Accuracy [95% CI]", "Accuracy of scored", "Sources", "Hallucination",
              "I don't know", "Score", "Valid tool calls", "Avg turns", "Latency p50 / p95", "Tokens in / out",
              "Cost / 1k q"]
    rows = []
    for label, s in summary["models"].items():
        acc = _pct(s["accuracy"])
        if s["accuracy_ci"]:
            acc += " [{:.1f}–{:.1f}]".format(*(100 * x for x in s["accuracy_ci"]))
        rows.append([
            label, str(s["n"]), str(s["n_errors"]), acc, _pct(s.get("accuracy_scored")), _pct(s["sources_correct"]),
            _pct(s["hallucination_rate"]),
            _pct(s["idk_rate"]), _num(s.get("score"), "{:+.2f}"), _pct(s["valid_tool_call_rate"]), _num(s["avg_turns"]),
            f"{_num(s['latency_p50_s'], '{:.2f} s')} / {_num(s['latency_p95_s'], '{:.2f} s')}",
            f"{_num(s['mean_prompt_tokens'], '{:,.0f}')} / {_num(s['mean_completion_tokens'], '{:,.0f}')}",
            _num(s["cost_per_1k_usd"], "${:,.2f}"),
        ])
    return header, rows


def _setup_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """How each model played: its backend, tool_choice and episode shape (they differ between models)."""
    header = ["Model", "Served by", "Requests in flight", "tool_choice", "Turns", "Tokens / reply", "Body chars",
              "Results / search"]
    rows = []
    for label, s in summary["models"].items():
        shape = s.get("episode") or {}
        rows.append([label, s.get("backend") or DASH, str(s.get("concurrency") or DASH), s.get("tool_choice") or DASH,
                     *(str(shape.get(k, DASH))
                       for k in ("max_turns", "max_tokens", "max_body_chars", "search_results"))])
    return header, rows


def _outcome_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    models = summary["models"]
    # The grounding check's column only where it was on (--grounded-answers).
    keys = [k for k in OUTCOMES if k != "withheld" or any(s.get("grounded_answers") for s in models.values())]

    def cell(s: dict, key: str) -> str:
        count = f"{s['outcomes'][key]} ({s['outcomes'][key] / s['n']:.0%})"
        return f"{count}, {s['withheld_right']} of them right" if key == "withheld" else count
    rows = [[label, *(cell(s, k) for k in keys)] for label, s in models.items()]
    return ["Model", *(OUTCOMES[k] for k in keys)], rows


def _verdict(a: str, b: str, count_a: int, count_b: int, p_value: float, better: str) -> str:
    return f"{a if count_a > count_b else b} {better} (p < 0.05)" if p_value < 0.05 else "no significant difference"


def _pair_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["A", "B", "Shared questions", "Only A right", "Only B right", "McNemar p", "Verdict on accuracy",
              "A scores higher", "B scores higher", "Sign-test p", "Verdict on the score"]
    rows = []
    for p in summary.get("pairs") or []:
        on_score = [DASH] * 4
        if "higher_a" in p:  # summaries written before the score have no score test
            on_score = [str(p["higher_a"]), str(p["higher_b"]), f"{p['score_p_value']:.3g}",
                        _verdict(p["a"], p["b"], p["higher_a"], p["higher_b"], p["score_p_value"], "scores higher")]
        rows.append([p["a"], p["b"], str(p["n"]), str(p["only_a"]), str(p["only_b"]), f"{p['p_value']:.3g}",
                     _verdict(p["a"], p["b"], p["only_a"], p["only_b"], p["p_value"], "is better"), *on_score])
    return header, rows


def run_of(label: str) -> str:
    """The run a model label names: "demo@7" and "demo" are checkpoints of run "demo"."""
    return label.split("@", 1)[0]


def what_training_changed(summary: dict) -> list[str]:
    """A sentence for every pair of checkpoints of one run in the evaluation (in the order they were listed, the
    earlier first, as `make demo` lists the warm start before the final agent): right, hallucinated, "I don't
    know" and the score, before and after, with the sign test on the score."""
    models, lines = summary["models"], []
    for p in summary.get("pairs") or []:
        a, b = models[p["a"]], models[p["b"]]
        if run_of(p["a"]) != run_of(p["b"]) or "higher_a" not in p or a.get("score") is None:
            continue
        lines.append(
            f"From {p['a']} to {p['b']}: right {_pct(a['accuracy'])} -> {_pct(b['accuracy'])}, hallucinated "
            f"{_pct(a['hallucination_rate'])} -> {_pct(b['hallucination_rate'])}, \"I don't know\" "
            f"{_pct(a['idk_rate'])} -> {_pct(b['idk_rate'])}, score (right minus hallucinated) "
            f"{a['score']:+.2f} -> {b['score']:+.2f}: higher on {p['higher_b']} questions, lower on {p['higher_a']} "
            f"(sign test p = {p['score_p_value']:.3g}).")
    return lines


NOTES = ("Accuracy counts errored rollouts (the model's API failed; see Errors) as wrong, with a 95% Wilson "
         "interval; \"Accuracy of scored\" leaves them out, as do the other means. Score = right minus "
         "hallucinated, as shares of all questions (an error counts 0): the task's own score. Valid tool calls = "
         "valid calls / (calls + turns that made no call). Prompted models are sent tool_choice=\"required\"; "
         "trained models choose (\"auto\"), as they were trained. Latency is a model's time per episode over all "
         "its turns, from each request's sending to its reply, at the requests in flight shown under \"How each "
         "model played\" (the CPU backend decodes them as one batch); waiting for a free slot is not counted. Cost "
         "is per 1,000 questions and shown only when every scored record has a price.")
OUTCOME_NOTE = ("Each episode by how close the agent came to the gold email (the one that holds the answer): "
                "wrong answers after reading it are reading failures, after a search listed it unread choosing "
                "failures, without it ever listed search failures. With --grounded-answers, an answer naming "
                "something (a word with a capital or a digit) in no email or search result the agent saw is "
                "withheld and counts as \"I don't know\"; \"of them right\" says what that cost.")
PAIR_NOTE = ("Exact McNemar test on correctness over the questions both models played: only the questions one "
             "got right and the other wrong count. The score is +1 for a right answer, -1 for a wrong one "
             "(hallucinated), 0 for \"I don't know\" or no answer, what the reward ranks; its exact sign test "
             "counts the questions where one model scored higher. p < 0.05: the difference is unlikely to be chance.")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(redact(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return [line(header), "|" + "---|" * len(header)] + [line(r) for r in rows]


def _curve_by_step(rows: list[dict]) -> dict[int, dict]:
    """One row per step: ART logs a step's training metrics and its validation in separate lines."""
    merged: dict[int, dict] = {}
    for r in rows:
        if is_number(r.get("step")):
            merged.setdefault(int(r["step"]), {}).update({m: r[m] for m in CURVE_METRICS if is_number(r.get(m))})
    return merged


def _history_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    by_step, warm = _curve_by_step(rows), warm_start_steps(rows)
    metrics = [m for m in CURVE_METRICS if any(m in v for v in by_step.values())]
    body = [[str(step), "warm start" if step in warm else "GRPO" if "train/reward" in values else "",
             *(_num(values.get(m), "{:.4g}") for m in metrics)]
            for step, values in sorted(by_step.items()) if values or step in warm]
    return ["step", "phase", *metrics], body


def _when_what(records: list[dict], summary: dict) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Generated {now}: {summary['n_questions']} questions, {len(summary['models'])} models, "
            f"{len(records)} result records.")


def _markdown(title, records, summary, histories) -> str:
    lines = [f"# {redact(title)}", "", _when_what(records, summary), "", "## Comparison", ""]
    lines += _md_table(*_comparison_rows(summary))
    lines += ["", NOTES, "", "## How each model played", ""] + _md_table(*_setup_rows(summary))
    lines += ["", "## Where answers went wrong", ""] + _md_table(*_outcome_rows(summary)) + ["", OUTCOME_NOTE]
    changed = what_training_changed(summary)
    if changed:
        lines += ["", "## What training changed", ""] + [f"- {redact(line)}" for line in changed]
    if summary.get("pairs"):
        lines += ["", "## Paired comparison", ""] + _md_table(*_pair_rows(summary)) + ["", PAIR_NOTE]
    if histories:
        lines += ["", "## Learning curve", "", "Per step: the GRPO rollouts' mean reward (train/reward, sampled) "
                  "and greedy validation on held-out train questions (val/*); phase \"warm start\" marks the "
                  "supervised steps before RL."]
        for label, rows in histories.items():
            lines += ["", f"### {redact(label)}", ""] + _md_table(*_history_table(rows))
    return "\n".join(lines) + "\n"


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
           f'aria-label="{_esc(title)}"><text x="0" y="16" class="ct">{_esc(title)}</text>']
    for i, (label, v) in enumerate(bars):
        y = 28 + i * rh
        short = label if len(label) <= 26 else label[:25] + "…"
        out.append(f'<text x="{lw - 6}" y="{y + 14}" text-anchor="end">'
                   f'<title>{_esc(label)}</title>{_esc(short)}</text>')
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
        out.append(f'<text x="{end + 5:.1f}" y="{y + 14}">{_esc(fmt(v))}</text>')
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

    out = [f'<svg class="chart" width="{W}" height="{H}" role="img" aria-label="{_esc(metric)}">',
           f'<text x="0" y="16" class="ct">{_esc(metric)} vs step</text>',
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
        out += [f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="3" fill="{color}"><title>{_esc(label)} step {a:g}: '
                f'{b:.4g}</title></circle>' for a, b in s]
        legend.append(f'<span style="color:{color}">■</span> {_esc(label)}')
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
    body = [f"<pre>{_esc(text)}</pre>"] if text else []
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        body.append(f'<div class="call">tool call <code>{_esc(fn.get("name"))}</code>'
                    f'<pre>{_esc(_pretty_args(fn.get("arguments")))}</pre></div>')
    return (f'<div class="msg {re.sub("[^a-z]", "", role.lower())}"><div class="role">{_esc(role)}</div>'
            + "".join(body) + "</div>")


def _attempt_html(r: dict) -> str:
    status, css = _status(r)
    v = r.get("verdict") or {}
    answer = r.get("answer")
    meta = [f"reward {_num(r.get('reward'))}", f"turns {_num((r.get('metrics') or {}).get('num_turns'), '{}')}",
            f"judge {v.get('judge') or DASH}"]
    notes = [f'<p class="meta">{_esc(" · ".join(meta))}</p>']
    withheld = r.get("withheld")
    if withheld:
        right = "right" if (r.get("metrics") or {}).get("withheld_right") else "wrong"
        notes.append(f"<p><b>Withheld by the grounding check:</b> {_esc(withheld['answer'])} ({right}; "
                     f"{_esc(', '.join(withheld['unseen']))} in nothing the agent saw)</p>")
    for key, text in (("Judge", v.get("reasoning")), ("Judge error", v.get("error")), ("Rollout error", r.get("error")),
                      ("Sources", ", ".join(map(str, r.get("sources") or [])))):
        if text:
            notes.append(f"<p><b>{key}:</b> {_esc(text)}</p>")
    conversation = "".join(_message_html(m) for m in r.get("messages") or [])
    return (f'<details class="attempt"><summary><span class="badge {css}">{_esc(status)}</span> '
            f'<b>{_esc(r.get("model", "?"))}</b>: {_esc("(no answer)" if answer is None else answer)}</summary>'
            + "".join(notes) + conversation + "</details>")


def _question_html(rs: list[dict]) -> str:
    q = rs[0]
    has_wrong = any(_status(r)[1] != "correct" for r in rs)
    badges = " ".join(f'<span class="badge {_status(r)[1]}" title="{_esc(r.get("model"))}">'
                      f'{_esc(r.get("model"))}</span>'
                      for r in rs)
    facts = (f"<p><b>Gold answer:</b> {_esc(q.get('gold_answer'))}</p><p class=\"meta\">inbox {_esc(q.get('inbox'))} · "
             f"date {_esc(q.get('query_date'))} · "
             f"gold messages {_esc(', '.join(map(str, q.get('gold_message_ids') or [])))}</p>")
    return (f'<details class="question" data-haswrong="{int(has_wrong)}"><summary>#{_esc(question_key(q))} '
            f'{_esc(q.get("question"))} {badges}</summary>'
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
    return ("<table><thead><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows) + "</tbody></table>")


def _html(title, records, summary, histories) -> str:
    header, rows = _comparison_rows(summary)
    table = ("<table><thead><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr></thead><tbody>"
             + "".join('<tr class="model-row">' + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
             + "</tbody></table>")
    models = summary["models"]
    labels = list(models)
    changed = what_training_changed(summary)

    def bars(key):
        return [(m, models[m][key]) for m in labels]

    charts = [
        _bar_chart("Accuracy (95% Wilson CI)", bars("accuracy"), _pct, 1.0, [models[m]["accuracy_ci"] for m in labels]),
        _bar_chart("Hallucination rate", bars("hallucination_rate"), _pct, 1.0),
        _bar_chart("I-don't-know rate", bars("idk_rate"), _pct, 1.0),
        _bar_chart("Average turns", bars("avg_turns"), lambda v: f"{v:.2f}"),
        _bar_chart("Latency p50 (s)", bars("latency_p50_s"), lambda v: f"{v:.2f} s"),
        _bar_chart("Cost per 1,000 questions (USD)", bars("cost_per_1k_usd"), lambda v: f"${v:,.2f}"),
    ]
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{_esc(title)}</h1><p>{_esc(_when_what(records, summary))}</p>",
             "<h2>Comparison</h2>", table,
             f"<p class=\"meta\">{_esc(NOTES)}</p>", "<h2>How each model played</h2>",
             _html_table(*_setup_rows(summary)),
             "<h2>Where answers went wrong</h2>", _html_table(*_outcome_rows(summary)),
             f"<p class=\"meta\">{_esc(OUTCOME_NOTE)}</p>",
             *(["<h2>What training changed</h2><ul>", *(f"<li>{_esc(line)}</li>" for line in changed), "</ul>"]
               if changed else []),
             *(["<h2>Paired comparison</h2>", _html_table(*_pair_rows(summary)),
                f"<p class=\"meta\">{_esc(PAIR_NOTE)}</p>"]
               if summary.get("pairs") else []),
             "<h2>Charts</h2><div>", *charts, "</div>"]
    if histories:
        parts.append('<h2 id="learning-curve">Learning curve</h2><p class="meta">train/reward: the GRPO rollouts '
                     '(sampled); val/*: greedy episodes on held-out train questions. Grey: the supervised warm '
                     'start (its steps have no train reward).</p><div>')
        warm = sorted(set().union(*(warm_start_steps(rows) for rows in histories.values())))
        # The warm start begins from the checkpoint before its first epoch (the untrained LoRA).
        shade = (float(warm[0] - 1 if warm[0] > 0 else 0), float(warm[-1])) if warm else None
        for metric in CURVE_METRICS:
            series = [(label, sorted((float(r["step"]), float(r[metric])) for r in rows
                                     if is_number(r.get("step")) and is_number(r.get(metric))))
                      for label, rows in histories.items()]
            parts.append(_line_chart(metric, [s for s in series if s[1]], shade))
        parts.append("</div>")
    grouped: dict = {}
    for r in records:
        grouped.setdefault(question_key(r), []).append(r)
    parts += ["<h2>Per-question traces</h2>",
              '<div id="controls" hidden><input id="flt" placeholder="Filter by text…"> '
              '<label><input type="checkbox" id="onlywrong"> only questions with a non-correct attempt</label></div>',
              *(_question_html(rs) for rs in grouped.values()),
              f"<script>{_FILTER_JS}</script></body></html>"]
    return "\n".join(p for p in parts if p)


def write_report(out_dir, records, summary, *, title="Email search agent evaluation",
                 histories: dict[str, list[dict]] | None = None) -> dict[str, Path]:
    """Write summary.json, report.md and report.html into out_dir (created if needed); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.json", "markdown": out / "report.md", "html": out / "report.html"}
    paths["summary"].write_text(json.dumps(summary, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    paths["markdown"].write_text(_markdown(title, records, summary, histories), encoding="utf-8")
    paths["html"].write_text(_html(title, records, summary, histories), encoding="utf-8")
    return paths


# ---- the output folder ---------------------------------------------------------------------------------

def check_output(out: Path) -> None:
    """Before any model is served: an --output that cannot become a folder is a one-line error."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    run = next((p for p in (out.resolve(), *out.resolve().parents) if (p / "run_config.json").is_file()), None)
    if run is not None:  # checkpoint pruning and --fresh delete what is in there
        raise DataError(f"--output {out} is {'in ' if run != out.resolve() else ''}a training run's folder; give a "
                        f"folder of its own, such as eval/NAME")
    if not existing.is_dir():
        raise DataError(f"--output {out}: {existing} is a file; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"--output {out}: cannot write in {existing}")
    beside = out.resolve().parent
    if (out / "results.jsonl").exists() and not os.access(beside, os.W_OK | os.X_OK):
        raise DataError(f"--output {out} holds an evaluation, which would move aside into {beside}, where this "
                        f"user cannot write; give another --output")


OUTPUT_FILES = ("results.jsonl", "summary.json", "report.md", "report.html")  # what an evaluation writes


def keep_previous(out: Path) -> None:
    """Create `out`; an evaluation already there moves aside to OUT-<its time>/ rather than being overwritten
    (its results.jsonl is what --rejudge needs). Only the evaluation's own files move: whatever else the
    folder holds stays where it is."""
    if (out / "results.jsonl").exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((out / "results.jsonl").stat().st_mtime))
        where = out.resolve()
        kept = where.parent / f"{where.name or 'eval'}-{stamp}"
        n = 1
        while kept.exists():
            n += 1
            kept = where.parent / f"{where.name or 'eval'}-{stamp}-{n}"
        kept.mkdir()
        for file in OUTPUT_FILES:
            if (out / file).exists():
                (out / file).rename(kept / file)
        log.info("the previous evaluation in %s is now in %s", out, kept)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--output {out}: {exc.strerror or exc}") from None
