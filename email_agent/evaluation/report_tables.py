"""The report's figures as tables: plain-text cells from an evaluation's summary (and a trained run's history),
with the notes that say how to read them. report.md and report.html render the same tables; nothing here knows
either format.
"""
from __future__ import annotations

from datetime import datetime, timezone

from email_agent.evaluation.scores import OUTCOMES, is_number, warm_start_steps

VAL_METRICS = ["val/reward", "val/answer_correct", "val/valid_tool_call_rate", "val/hallucinated", "val/num_turns"]
# The learning curve: the training reward (the rollouts GRPO learned from) beside the greedy validation metrics.
CURVE_METRICS = ["train/reward", *VAL_METRICS]
DASH = "—"


def pct(v) -> str:
    return DASH if v is None else f"{100 * v:.1f}%"


def num(v, fmt: str = "{:.2f}") -> str:
    return DASH if v is None else fmt.format(v)


def comparison_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and plain-text cells shared by the Markdown and HTML tables."""
    header = ["Model", "n", "Errors", "Accuracy [95% CI]", "Accuracy of scored", "Sources", "Hallucination",
              "I don't know", "Score", "Valid tool calls", "Avg turns", "Latency p50 / p95", "Tokens in / out",
              "Cost / 1k q"]
    rows = []
    for label, s in summary["models"].items():
        acc = pct(s["accuracy"])
        if s["accuracy_ci"]:
            acc += " [{:.1f}–{:.1f}]".format(*(100 * x for x in s["accuracy_ci"]))
        rows.append([
            label, str(s["n"]), str(s["n_errors"]), acc, pct(s.get("accuracy_scored")), pct(s["sources_correct"]),
            pct(s["hallucination_rate"]),
            pct(s["idk_rate"]), num(s.get("score"), "{:+.2f}"), pct(s["valid_tool_call_rate"]), num(s["avg_turns"]),
            f"{num(s['latency_p50_s'], '{:.2f} s')} / {num(s['latency_p95_s'], '{:.2f} s')}",
            f"{num(s['mean_prompt_tokens'], '{:,.0f}')} / {num(s['mean_completion_tokens'], '{:,.0f}')}",
            num(s["cost_per_1k_usd"], "${:,.2f}"),
        ])
    return header, rows


def setup_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """How each model played: its backend, tool_choice and episode limits (they differ between models)."""
    header = ["Model", "Served by", "Requests in flight", "tool_choice", "Turns", "Tokens / reply", "Body chars",
              "Results / search"]
    rows = []
    for label, s in summary["models"].items():
        limits = s.get("episode") or {}
        rows.append([label, s.get("backend") or DASH, str(s.get("concurrency") or DASH), s.get("tool_choice") or DASH,
                     *(str(limits.get(k, DASH))
                       for k in ("max_turns", "max_tokens", "max_body_chars", "search_results"))])
    return header, rows


def outcome_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
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


def pair_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
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
            f"From {p['a']} to {p['b']}: right {pct(a['accuracy'])} -> {pct(b['accuracy'])}, hallucinated "
            f"{pct(a['hallucination_rate'])} -> {pct(b['hallucination_rate'])}, \"I don't know\" "
            f"{pct(a['idk_rate'])} -> {pct(b['idk_rate'])}, score (right minus hallucinated) "
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


def _curve_by_step(rows: list[dict]) -> dict[int, dict]:
    """One row per step: ART logs a step's training metrics and its validation in separate lines."""
    merged: dict[int, dict] = {}
    for r in rows:
        if is_number(r.get("step")):
            merged.setdefault(int(r["step"]), {}).update({m: r[m] for m in CURVE_METRICS if is_number(r.get(m))})
    return merged


def history_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    by_step, warm = _curve_by_step(rows), warm_start_steps(rows)
    metrics = [m for m in CURVE_METRICS if any(m in v for v in by_step.values())]
    body = [[str(step), "warm start" if step in warm else "GRPO" if "train/reward" in values else "",
             *(num(values.get(m), "{:.4g}") for m in metrics)]
            for step, values in sorted(by_step.items()) if values or step in warm]
    return ["step", "phase", *metrics], body


def when_what(records: list[dict], summary: dict) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    graded = summary.get("graded_by") or []
    return (f"Generated {now}: {summary['n_questions']} questions, {len(summary['models'])} models, "
            f"{len(records)} result records." + (f" Graded by: {'; '.join(graded)}." if graded else ""))
