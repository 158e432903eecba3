"""What the learning benchmarks share: running the tool's own commands, the evaluation's table, and exact McNemar
tests of one checkpoint against another on the questions both answered (bench_learning.py, bench_enron.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from email_agent.evaluation.scores import OUTCOMES, mcnemar_exact


def run(label: str, *args: str) -> float:
    """Run `python ARGS` in the checkout, as a user would; the seconds it took."""
    print(f"--- {label}: {' '.join(args)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=ROOT)
    if done.returncode != 0:  # the command said why, above; what was done so far is kept
        raise SystemExit(f"--- {label} stopped (exit {done.returncode}): the reason is above; the work done so far "
                         f"is kept, and the same command resumes it")
    return time.perf_counter() - started


def add_training_flags(parser, test_questions: int, sft_limit: int, sft_epochs: int, rl_steps: int) -> None:
    """The flags both learning benchmarks take, with each one's defaults."""
    parser.add_argument("--test-questions", type=int, default=test_questions, help="held-out test questions evaluated")
    parser.add_argument("--sft-limit", type=int, default=sft_limit, help="warm-start episodes (0: all the expert's)")
    parser.add_argument("--sft-epochs", type=int, default=sft_epochs, help="warm-start epochs")
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3,
                        help="warm-start learning rate, constant (the demo preset's 1e-3)")
    parser.add_argument("--rl-steps", type=int, default=rl_steps, help="GRPO steps")
    parser.add_argument("--rl-learning-rate", type=float, default=1e-4)


def print_table(summary: dict, title: str) -> None:
    """The evaluation's figures per model, then where its answers went wrong."""
    print(f"\n{title}; valid calls count turns without a call as invalid")
    width = max(22, *(len(label) + 2 for label in summary))
    print(f"{'model':<{width}}{'n':>5}{'accuracy [95% CI]':>24}{'valid calls':>13}{'halluc.':>9}{'turns':>7}")
    for label, s in summary.items():
        acc = "n/a" if s["accuracy"] is None else \
            f"{s['accuracy']:.1%} [{s['accuracy_ci'][0]:.1%}-{s['accuracy_ci'][1]:.1%}]"
        valid = "n/a" if s["valid_tool_call_rate"] is None else f"{s['valid_tool_call_rate']:.1%}"
        print(f"{label:<{width}}{s['n']:>5}{acc:>24}{valid:>13}{s['hallucination_rate']:>9.1%}{s['avg_turns']:>7.2f}")
    print("\nwhere answers went wrong (episodes):")
    for label, s in summary.items():
        print(f"  {label}: " + "; ".join(f"{OUTCOMES[k]} {s['outcomes'][k]}" for k in OUTCOMES))


def answers_by_model(results_path: Path) -> dict[str, dict]:
    """model -> question id -> answered right, from an evaluation's results.jsonl (episodes with errors left out)."""
    correct: dict[str, dict] = {}
    for line in results_path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if not r.get("error"):
                correct.setdefault(r["model"], {})[r["question_id"]] = bool(
                    (r.get("metrics") or {}).get("answer_correct"))
    return correct


def paired_test(correct: dict[str, dict], model: str | None, other: str | None) -> str:
    """Exact McNemar test of `model` against `other` on the questions both answered."""
    if model not in correct or other not in correct:
        return f"\npaired test {model} vs. {other}: no results for both"
    both = sorted(correct[model].keys() & correct[other].keys(), key=str)
    only_model = sum(correct[model][q] and not correct[other][q] for q in both)
    only_other = sum(correct[other][q] and not correct[model][q] for q in both)
    return (f"\n{model} vs. {other} on the same {len(both)} questions: {model} alone right on {only_model}, "
            f"{other} alone right on {only_other}; exact McNemar p = {mcnemar_exact(only_model, only_other):.3g}")


def final_vs_warm(summary: dict, warm: str, final: str) -> dict:
    """The evaluation's pair of the two checkpoints, its counts named for which checkpoint they favour."""
    pair = next(p for p in summary["pairs"] if {p["a"], p["b"]} == {warm, final})
    final_first = pair["a"] == final
    return {"n": pair["n"], "right_final": pair["only_a" if final_first else "only_b"],
            "right_warm": pair["only_b" if final_first else "only_a"],
            "higher_final": pair["higher_a" if final_first else "higher_b"],
            "higher_warm": pair["higher_b" if final_first else "higher_a"],
            "score_final": summary["models"][final]["score"], "score_warm": summary["models"][warm]["score"]}


def print_pooled(pairs: dict[int, dict], against: str = "the warm start") -> None:
    """The final checkpoint vs. `against` over all seeds' (seed, question) pairs: the exact tests on the summed
    counts (`pairs`: final_vs_warm's per seed)."""
    total = {key: sum(p[key] for p in pairs.values()) for key in ("n", "right_final", "right_warm", "higher_final",
                                                                  "higher_warm")}
    print(f"\n===== final vs. {against}, pooled over seeds {', '.join(map(str, pairs))} ({total['n']} question pairs)")
    print(f"score higher in the final agent on {total['higher_final']}, lower on {total['higher_warm']}: sign test "
          f"p = {mcnemar_exact(total['higher_final'], total['higher_warm']):.3g} (target < 0.05, final higher)")
    print(f"right only in the final agent on {total['right_final']}, only in {against} on {total['right_warm']}: "
          f"McNemar p = {mcnemar_exact(total['right_final'], total['right_warm']):.3g} (target: right answers not "
          f"fewer)")
    mean = sum(p["score_final"] - p["score_warm"] for p in pairs.values()) / len(pairs)
    print("score change per seed: " + ", ".join(f"seed {s} {p['score_warm']:+.2f} -> {p['score_final']:+.2f}"
                                                 for s, p in pairs.items()) + f" (mean {mean:+.3f})")
