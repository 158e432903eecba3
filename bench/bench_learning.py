"""Benchmark: does the agent learn? Base -> supervised warm start -> GRPO, on the demo inbox, CPU, offline.

    python bench/bench_learning.py                 # the full run (targets below)
    python bench/bench_learning.py --quick         # a smoke run of the same pipeline, a few minutes

Runs the real commands, as a user would: build-db --demo; train --sft-only (warm start from the scripted
demo expert on the *train* split); train again (the same run resumes with GRPO); then one evaluation of
the base model, the warm-started checkpoint and the final checkpoint on held-out *test* questions, which
writes the usual report (before/after table with 95% CIs, learning curve). Prints the table, the RL
phase's validation reward per step, and the wall time of each phase.
Targets (issue 5): after SFT+RL accuracy >= 50%, valid tool calls >= 95%, hallucination lower than after
SFT alone, val reward trending up during RL, all within 45 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(label: str, *args: str) -> float:
    print(f"--- {label}: {' '.join(args)}", flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "eval" / "learning", help="output folder")
    parser.add_argument("--test-questions", type=int, default=100)
    parser.add_argument("--sft-limit", type=int, default=64)
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--rl-learning-rate", type=float, default=1e-4)
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, not the targets")
    args = parser.parse_args()
    if args.quick:
        args.test_questions, args.sft_limit, args.sft_epochs, args.rl_steps = 8, 8, 1, 1
    work = args.work.resolve()
    db, art_dir = work / "demo.db", work / "art"
    shape = ["--max-turns", "4", "--max-tokens", "64", "--max-body-chars", "600", "--search-results", "3"]
    train = ["train_email_search_agent.py", "train", "--demo", "--db", str(db), "--art-dir", str(art_dir),
             "--name", "learn", "--keep-checkpoints", "all", "--val-size", "16", *shape,
             "--sft-limit", str(args.sft_limit), "--sft-epochs", str(args.sft_epochs)]
    times = {}
    started = time.perf_counter()
    times["build"] = run("build", "train_email_search_agent.py", "build-db", "--demo", "--db", str(db), "--quiet")
    times["sft"] = run("warm start", *train, "--fresh", "--sft-only")
    run_dir = art_dir / "email-agent" / "models" / "learn"
    sft_step = max(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    times["rl"] = run("GRPO", *train, "--max-steps", str(args.rl_steps), "--groups-per-step", "4",
                      "--rollouts-per-group", "4", "--eval-every", "1", "--learning-rate", str(args.rl_learning_rate))
    times["evaluate"] = run("evaluate", "test_email_search_agent.py", "--db", str(db), "--art-dir", str(art_dir),
                            "--model", "base", "--model", f"learn@{sft_step}", "--model", "learn@latest",
                            "--limit", str(args.test_questions), "--output", str(work / "report"), *shape)
    total = time.perf_counter() - started

    summary = json.loads((work / "report" / "summary.json").read_text())["models"]
    print("\nheld-out test questions (demo inbox), offline grading")
    print(f"{'model':<22}{'n':>5}{'accuracy [95% CI]':>24}{'valid calls':>13}{'halluc.':>9}{'turns':>7}")
    for label, s in summary.items():
        acc = "n/a" if s["accuracy"] is None else \
            f"{s['accuracy']:.1%} [{s['accuracy_ci'][0]:.1%}-{s['accuracy_ci'][1]:.1%}]"
        valid = "n/a" if s["valid_tool_call_rate"] is None else f"{s['valid_tool_call_rate']:.1%}"
        print(f"{label:<22}{s['n']:>5}{acc:>24}{valid:>13}{s['hallucination_rate']:>9.1%}{s['avg_turns']:>7.2f}")
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    val = [(row["step"], row["val/reward"], row.get("val/answer_correct")) for row in history
           if "val/reward" in row and row["step"] >= sft_step]
    print("\nvalidation during RL (step, val/reward, val/answer_correct): "
          + ", ".join(f"({s}, {r:+.3f}, {a:.0%})" for s, r, a in val))
    print("wall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items())
          + f", total {total / 60:.1f} min (target <= 45)")
    print(f"report: {work / 'report' / 'report.html'}")


if __name__ == "__main__":
    main()
