"""Benchmark: does the agent learn? Base -> supervised warm start -> GRPO, on the demo inbox, CPU, offline.

    python bench/bench_learning.py                 # the full run (targets below)
    python bench/bench_learning.py --quick         # a smoke run of the same pipeline, a few minutes

Runs the real commands, as a user would: build-db --demo; train --sft-only (warm start from the scripted
demo expert on the *train* split: its successful episodes and its abstentions, two epochs at the demo preset's
constant 1e-3, as in runs Q and Q1); train again (the same run resumes with GRPO, sampled at temperature
1.0 as in run T1); then one evaluation of the warm-started checkpoint and the final checkpoint (and the
base model with --with-base) on held-out *test* questions (all 144 of the demo inbox's), which writes the
usual report (before/after table with 95% CIs, learning curve). Prints the table, an exact McNemar test of
final vs. warm start on the same questions, the validation curve, and the wall time of each phase.
Targets (issue 12): final accuracy >= 60%, hallucination <= 15%, valid tool calls >= 95% (turns without a
call count as invalid), GRPO beats the warm start with p < 0.05, within 45 minutes on 2 cores. The evaluation
uses the grounding check (--grounded-answers; runs F-W did not): the table's hallucination counts an answer
naming something in nothing the agent saw as "I don't know", and the figures without the check follow it.
Report every run, not the best one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import add_training_flags, answers_by_model, paired_test, print_table, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "eval" / "learning", help="output folder")
    add_training_flags(parser, test_questions=144, sft_limit=0, sft_epochs=2, rl_steps=10)
    parser.add_argument("--advantage-balance", type=float, default=0.5,
                        help="ART's advantage_balance: negative advantages weigh 1 - this "
                             "(run I, at 0, learned to abstain)")
    parser.add_argument("--scale-rewards", action=argparse.BooleanOptionalAction, default=False,
                        help="divide advantages by each group's reward std (ART's default; run J); "
                             "off: Dr. GRPO (run K)")
    parser.add_argument("--scaled-steps", type=int, default=0,
                        help="end with this many of the --rl-steps std-scaled (ART's default), "
                             "after the others (runs M, N)")
    parser.add_argument("--hallucination-penalty", type=float, default=1.0,
                        help="what a wrong answer costs in the reward (1 as in ART·E; runs K, K2)")
    parser.add_argument("--unanswerable-share", type=float, default=0.0,
                        help="share of GRPO questions asked before their gold email arrived (run O)")
    parser.add_argument("--groups-per-step", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="GRPO rollouts' sampling temperature (at 0.7, runs F-S, the two-epoch warm start played "
                             "most questions alike four times in four: only a third of the groups had reward variance)")
    parser.add_argument("--eval-every", type=int, default=14, help="RL steps between validations (and after the last)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="rollouts decoded as one batch (training and evaluation)")
    parser.add_argument("--cpu-train-threads", type=int, default=0,
                        help="training threads (default: all cores; 1 when other jobs share the machine)")
    parser.add_argument("--seed", type=int, default=0,
                        help="training seed: validation split, warm-start order, LoRA init, sampling "
                             "(test questions stay)")
    parser.add_argument("--grounded-answers", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate with the grounding check: answers naming something in no email or search "
                             "result the agent saw count as \"I don't know\" (runs F-W: without; the bench prints "
                             "both)")
    parser.add_argument("--base-model", default="",
                        help="the model to train: a local transformers folder, or a Hugging Face name on a GPU "
                             "(default: train's, SmolLM2-135M-Instruct on CPU)")
    parser.add_argument("--backend", default="auto", help="train's --backend (auto: local with CUDA, else cpu)")
    parser.add_argument("--with-base", action="store_true", help="evaluate the untrained base model too (0%% so far)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, not the targets")
    args = parser.parse_args()
    if args.quick:
        args.test_questions, args.sft_limit, args.sft_epochs, args.rl_steps = 8, 8, 1, 1
    work = args.work.resolve()
    db, art_dir = work / "demo.db", work / "art"
    shape = ["--max-turns", "4", "--max-tokens", "64", "--max-body-chars", "600", "--search-results", "3"]
    train = ["train_email_search_agent.py", "train", "--demo", "--db", str(db), "--art-dir", str(art_dir),
             "--name", "learn", "--keep-checkpoints", "all", "--val-size", "16", *shape,
             "--sft-limit", str(args.sft_limit), "--sft-epochs", str(args.sft_epochs),
             "--sft-learning-rate", str(args.sft_learning_rate),
             "--cpu-train-threads", str(args.cpu_train_threads), "--seed", str(args.seed), "--backend", args.backend,
             *(["--base-model", args.base_model] if args.base_model else [])]
    times = {}
    started = time.perf_counter()
    times["build"] = run("build", "train_email_search_agent.py", "build-db", "--demo", "--db", str(db), "--quiet")
    times["sft"] = run("warm start", *train, "--fresh", "--sft-only")
    run_dir = art_dir / "email-agent" / "models" / "learn"
    sft_step = max(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    grpo = [*train, "--groups-per-step", str(args.groups_per_step), "--rollouts-per-group", "4",
            "--eval-every", str(args.eval_every), "--learning-rate", str(args.rl_learning_rate),
            "--advantage-balance", str(args.advantage_balance), "--temperature", str(args.temperature),
            "--hallucination-penalty", str(args.hallucination_penalty), "--concurrency", str(args.concurrency),
            "--unanswerable-share", str(args.unanswerable_share)]
    first_steps = args.rl_steps - args.scaled_steps
    times["rl"] = run("GRPO", *grpo, "--max-steps", str(first_steps),
                      "--scale-rewards" if args.scale_rewards else "--no-scale-rewards")
    if args.scaled_steps:  # the run resumes where the first phase stopped
        times["rl"] += run("GRPO, std-scaled", *grpo, "--max-steps", str(args.rl_steps), "--scale-rewards")
    models = (["--model", "base", *(["--base-model", args.base_model] if args.base_model else [])] if args.with_base
              else []) + ["--model", f"learn@{sft_step}", "--model", "learn@latest"]
    times["evaluate"] = run("evaluate", "test_email_search_agent.py", "--db", str(db), "--art-dir", str(art_dir),
                            *models, "--limit", str(args.test_questions), "--output", str(work / "report"),
                            "--concurrency", str(args.concurrency), *shape,
                            *(["--grounded-answers"] if args.grounded_answers else []))
    total = time.perf_counter() - started

    summary = json.loads((work / "report" / "summary.json").read_text())["models"]
    print_table(summary, "held-out test questions (demo inbox), offline grading")
    if args.grounded_answers:
        print("\nwithout the grounding check (each withheld answer graded as the agent gave it):")
        for label, s in summary.items():
            counts, right = s["outcomes"], s["withheld_right"]
            wrong = counts["wrong_read"] + counts["wrong_listed"] + counts["wrong_unseen"] + counts["withheld"] - right
            print(f"  {label}: {counts['withheld']} answers withheld, {right} of them right; accuracy "
                  f"{(counts['right'] + right) / s['n']:.1%}, hallucination {wrong / s['n_scored']:.1%}")
    correct, warm = answers_by_model(work / "report" / "results.jsonl"), f"learn@{sft_step}"
    final = next((m for m in correct if m.startswith("learn@") and m != warm), None)
    print(paired_test(correct, final, warm) + " (target < 0.05, final better)")
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    val = [(row["step"], row["val/reward"], row.get("val/answer_correct")) for row in history if "val/reward" in row]
    print(f"\nvalidation (step, val/reward, val/answer_correct; warm start ends at step {sft_step}): "
          + ", ".join(f"({s}, {r:+.3f}, {a:.0%})" for s, r, a in val))
    print("wall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items())
          + f", total {total / 60:.1f} min (target <= 45)")
    print(f"report: {work / 'report' / 'report.html'}")


if __name__ == "__main__":
    main()
