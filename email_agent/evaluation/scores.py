"""What an evaluation's records add up to: per-model accuracy (with a 95% Wilson interval), hallucination,
"I don't know", valid tool calls, turns, latency and cost; each episode's outcome (how close the agent came to
the gold email); exact McNemar tests between every two models on the questions both played. Also reads what
these figures are made from: an evaluation's results.jsonl and a training run's history.jsonl.

`report` renders these figures; `bench/bench_learning.py` prints them.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from email_agent.agent.matcher import STRICT_GRADER
from email_agent.agent.rewards import valid_tool_call_rate


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% (by default) Wilson score interval for a binomial proportion.

    n == 0 returns (0.0, 0.0): there is no data, and a fixed tuple keeps the
    return type simple; ``summarize`` reports accuracy/CI as None in that case.
    """
    if n <= 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, center - half), min(1.0, center + half))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value for paired correctness: `only_a` questions that model A got right and
    B wrong, `only_b` the reverse (questions both got right or both wrong carry no information).

    Under "no difference" each discordant question is a fair coin, so the count is Binomial(n, 1/2).
    """
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _metric(records: list[dict], key: str) -> list[float]:
    # Missing / None metric values are absent, not zero.
    values = []
    for r in records:
        v = (r.get("metrics") or {}).get(key)
        if v is not None:
            values.append(float(v))
    return values


def _correct(r: dict) -> bool:
    return not r.get("error") and bool((r.get("metrics") or {}).get("answer_correct"))


def score(r: dict) -> int:
    """The task's own score of one episode, what the reward ranks: +1 right, -1 a wrong answer (hallucinated),
    0 "I don't know", no answer or an error."""
    if _correct(r):
        return 1
    return -1 if not r.get("error") and (r.get("metrics") or {}).get("hallucinated") else 0


# Where each episode ended, by how close the agent came to the gold email: "wrong after reading it" is a
# reading failure (the answer was in front of the agent), "never listed" a search failure.
OUTCOMES = {
    "right": "Right",
    "wrong_read": "Wrong, gold email read",
    "wrong_listed": "Wrong, gold email listed, not read",
    "wrong_unseen": "Wrong, gold email never listed",
    "withheld": "Withheld by the grounding check",
    "idk_seen": "\"I don't know\", gold email listed or read",
    "idk_unseen": "\"I don't know\", gold email never listed",
    "no_answer": "No answer (out of turns or error)",
}


def episode_outcome(r: dict) -> str:
    """The OUTCOMES key of one result record."""
    m = r.get("metrics") or {}
    seen = "read" if m.get("ever_read_right_email") else "listed" if m.get("ever_found_right_email") else "unseen"
    if _correct(r):
        return "right"
    if r.get("error") or not (m.get("attempted_answer") or m.get("returned_i_dont_know")):
        return "no_answer"
    if m.get("withheld_answer"):
        return "withheld"
    if m.get("attempted_answer"):
        return f"wrong_{seen}"
    return "idk_unseen" if seen == "unseen" else "idk_seen"


def _summarize_model(records: list[dict]) -> dict:
    # Accuracy counts an errored rollout (the model's API failed) as a wrong answer: a model that times out
    # on the hard questions must not look better for it. The scored-only accuracy stands beside it. Every
    # other mean, cost included, is over the scored rollouts.
    scored = [r for r in records if not r.get("error")]
    right = sum(map(_correct, records))
    latency = _metric(scored, "latency_s")
    costs = [r.get("cost_usd") for r in scored]
    known_cost = bool(scored) and all(c is not None for c in costs)
    first = records[0]  # summarize() makes one list per model seen: never empty
    outcomes = Counter(map(episode_outcome, records))
    return {
        "n": len(records),
        "n_errors": len(records) - len(scored),
        "n_scored": len(scored),
        "accuracy": right / len(records),
        "accuracy_ci": list(wilson_interval(right, len(records))),
        "accuracy_scored": right / len(scored) if scored else None,
        "score": sum(map(score, records)) / len(records),  # right minus hallucinated, as shares of all questions
        "tool_choice": first.get("tool_choice"),
        "episode": first.get("episode"),
        "backend": first.get("backend"),
        "concurrency": first.get("concurrency"),
        "sources_correct": _mean(_metric(scored, "sources_correct")),
        "hallucination_rate": _mean(_metric(scored, "hallucinated")),
        "idk_rate": _mean(_metric(scored, "returned_i_dont_know")),
        "valid_tool_call_rate": valid_tool_call_rate(r.get("metrics") or {} for r in scored),
        "avg_turns": _mean(_metric(scored, "num_turns")),
        "ran_out_of_turns_rate": _mean(_metric(scored, "ran_out_of_turns")),
        "latency_p50_s": _percentile(latency, 0.50),
        "latency_p95_s": _percentile(latency, 0.95),
        "mean_prompt_tokens": _mean(_metric(scored, "prompt_tokens")),
        "mean_completion_tokens": _mean(_metric(scored, "completion_tokens")),
        "mean_reward": _mean([float(r["reward"]) for r in scored if r.get("reward") is not None]),
        "cost_per_1k_usd": 1000 * sum(costs) / len(costs) if known_cost else None,
        "judge_errors": sum(1 for r in records if (r.get("verdict") or {}).get("error")),
        "outcomes": {key: outcomes[key] for key in OUTCOMES},
        "grounded_answers": any(r.get("grounded_answers") for r in records),
        "withheld_right": sum(int((r.get("metrics") or {}).get("withheld_right", 0)) for r in scored),
    }


def question_key(r: dict):
    return r.get("question_id", r.get("question"))


def paired_comparisons(by_model: dict[str, list[dict]]) -> list[dict]:
    """For every pair of models, on the questions both played: the exact McNemar test on correctness (errors count
    as wrong), and the exact sign test on the score (right +1, hallucinated -1, else 0): `higher_a` questions
    where A scored higher, `higher_b` where B did (the same binomial, over the questions whose scores differ)."""
    correct = {label: {question_key(r): _correct(r) for r in rs} for label, rs in by_model.items()}
    scores = {label: {question_key(r): score(r) for r in rs} for label, rs in by_model.items()}
    labels, pairs = list(by_model), []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            shared = correct[a].keys() & correct[b].keys()
            only_a = sum(correct[a][q] and not correct[b][q] for q in shared)
            only_b = sum(correct[b][q] and not correct[a][q] for q in shared)
            higher_a = sum(scores[a][q] > scores[b][q] for q in shared)
            higher_b = sum(scores[b][q] > scores[a][q] for q in shared)
            pairs.append({"a": a, "b": b, "n": len(shared), "only_a": only_a, "only_b": only_b,
                          "p_value": mcnemar_exact(only_a, only_b), "higher_a": higher_a, "higher_b": higher_b,
                          "score_p_value": mcnemar_exact(higher_a, higher_b)})
    return pairs


def summarize(records: list[dict]) -> dict:
    """Per-model statistics (models in order of first appearance; see ``_summarize_model`` for the keys) and
    a paired test for every pair of models (``paired_comparisons``)."""
    by_model: dict[str, list[dict]] = {}
    for r in records:
        by_model.setdefault(str(r.get("model", "?")), []).append(r)
    return {
        "models": {label: _summarize_model(rs) for label, rs in by_model.items()},
        "pairs": paired_comparisons(by_model),
        "n_questions": len({question_key(r) for r in records}),
        "n_records": len(records),
        "graded_by": graders(records),
    }




def graders(records: list[dict]) -> list[str]:
    """Who decided the verdicts: the LLM judge's name, or the offline matcher's (a judge that failed on an answer
    left it to the matcher); "I don't know" is wrong by rule and names no grader."""
    named = set()
    for r in records:
        verdict = r.get("verdict") or {}
        if verdict.get("judge") and verdict["judge"] != "rule":
            offline = verdict["judge"] == "offline" or verdict.get("error")
            named.add((verdict.get("grader") or STRICT_GRADER) if offline else verdict["judge"])
    return sorted(named)


def load_history(path, until_step: int | None = None) -> list[dict]:
    """Rows of an ART history.jsonl, up to `until_step` (the evaluated checkpoint) if given; blank, corrupt or
    non-object lines are skipped."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a blank line, or the truncated last line of a run killed mid-write
        if isinstance(row, dict) and not (until_step is not None and is_number(row.get("step"))
                                          and row["step"] > until_step):
            rows.append(row)
    return rows


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def warm_start_steps(rows: list[dict]) -> set[int]:
    """Steps produced by the supervised warm start: marked `train/sft_epoch` by the trainer, or (older runs)
    a training row without a reward (ART's train_sft logs a loss; GRPO steps always log train/reward)."""
    steps = set()
    for r in rows:
        if not is_number(r.get("step")):
            continue
        train_keys = [k for k in r if k.startswith("train/")]
        if "train/sft_epoch" in r or (train_keys and "train/reward" not in r):
            steps.add(int(r["step"]))
    return steps


def console_lines(figures: dict) -> list[str]:
    """The evaluation's summary for the terminal: a line per model, then each paired test."""
    def fmt(value, spec=".1%"):
        return "n/a" if value is None else format(value, spec)

    lines = []
    for label, s in figures["models"].items():
        limits = s.get("episode") or {}
        lines.append(f"{label:>32}  accuracy {fmt(s['accuracy'])}  hallucination {fmt(s['hallucination_rate'])}  "
                     f"score {fmt(s.get('score'), '+.2f')}  "
                     f"turns {fmt(s['avg_turns'], '.1f')}  n={s['n']}  errors {s['n_errors']}  "
                     f"tool_choice {s.get('tool_choice') or 'n/a'}  limits {limits.get('max_turns', '?')} turns/"
                     f"{limits.get('max_tokens', '?')} tokens")
    for pair in figures["pairs"]:
        leader = pair["a"] if pair["only_a"] >= pair["only_b"] else pair["b"]
        verdict = f"{leader} is better" if pair["p_value"] < 0.05 else "no significant difference"
        lines.append(f"{pair['a']} vs {pair['b']}: {pair['only_a']} vs {pair['only_b']} questions only one got "
                     f"right, McNemar p={pair['p_value']:.3g}: {verdict}")
        if "higher_a" in pair:
            leader = pair["a"] if pair["higher_a"] >= pair["higher_b"] else pair["b"]
            verdict = f"{leader} scores higher" if pair["score_p_value"] < 0.05 else "no significant difference"
            lines.append(f"{pair['a']} vs {pair['b']} on the score (right +1, hallucinated -1): higher on "
                         f"{pair['higher_a']} vs {pair['higher_b']} questions, sign test "
                         f"p={pair['score_p_value']:.3g}: {verdict}")
    return lines
