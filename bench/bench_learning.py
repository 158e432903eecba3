"""Benchmark: does the agent learn? Base -> supervised warm start -> GRPO, on the demo inbox, CPU, offline.

    python bench/bench_learning.py --demo-preset --seeds 0 1 2   # make demo's training, three seeds (issue 55)
    python bench/bench_learning.py                               # issue 12's longer training (targets below)
    python bench/bench_learning.py --quick                       # a smoke run of the same pipeline, a few minutes

Runs the real commands, as a user would: build-db --demo; train --sft-only (the warm start from the scripted
demo expert on the *train* split); train again (the same run resumes with GRPO); then one evaluation of the
warm-started checkpoint and the final checkpoint (and the base model with --with-base) on held-out *test*
questions, which writes the usual report. Prints, per seed, the table, exact paired tests of final vs. warm
start on the same questions (McNemar on right answers; a sign test on the score, right +1 and hallucinated
-1), the validation curve and the wall time of each phase; then both tests pooled over the seeds.

--demo-preset trains exactly as `make demo` does (config.DEMO_PRESET: every expert episode once, {max_steps} GRPO
steps of {groups_per_step} groups x {rollouts_per_group} rollouts (6 steps until run S4), a wrong answer costing
{hallucination_penalty:g} (1.5 until run F125), sampled at {temperature:g} (1.0 until run T08), validation on {val_size}
questions; the training flags below are then ignored), on
--test-questions 100 by default, and prints the two checkpoints on make demo's own 50 questions (the first 50)
against issue 55's targets for the main job too;
--groups-per-step N and --hallucination-penalty X change the preset's step width and what a wrong answer costs
(runs Y0-Y2: 2 and 2; g6: 6 and 2; H1: 6 and 1; P15: 6 and 1.5; F125: 6 and 1.25, the preset's penalty since).
--warm-start-from W begins each seed from W's warm start of the same seed (its checkpoints copied) when only
GRPO's settings differ.
Issue 55's targets: pooled over at least 3 seeds, the score higher with
p < 0.05, right answers not fewer. The pooled tests treat each (seed, question) pair as one: the seeds train
independently, but one question's difficulty is shared by its three pairs.

Without it, issue 12's bench: two warm-start epochs, 10 GRPO steps of 6 groups, all 144 test questions.
Targets (issue 12): final accuracy >= 60%, hallucination <= 15%, valid tool calls >= 95% (turns without a
call count as invalid), GRPO beats the warm start with p < 0.05, within 45 minutes on 2 cores.

The evaluation uses the grounding check (--grounded-answers; runs F-W did not): the table's hallucination
counts an answer naming something in nothing the agent saw as "I don't know", and the figures without the
check follow it. A seed whose report exists is not run again, and one whose run stopped resumes it (delete
seed-N/ to start it over; another --work for other settings). Report every run, not the best one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import add_training_flags, final_vs_warm, print_pooled, print_table, run

from email_agent.config import DEMO_PRESET
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import select_questions
from email_agent.evaluation.scores import mcnemar_exact, summarize
from email_agent.results_file import read_results

DEMO_QUESTIONS = 50  # make demo's --limit


def main() -> None:
    args = parse_args()
    work = args.work.resolve()
    db = work / "demo.db"
    started = time.perf_counter()
    build = run("build", "train_email_search_agent.py", "build-db", "--demo", "--db", str(db), "--quiet")
    pairs = {}
    for seed in args.seeds:
        pairs[seed] = bench_seed(args, seed, db, work / f"seed-{seed}")
    if len(pairs) > 1:
        print_pooled(pairs)
    print(f"\nbuild {build / 60:.1f} min; all {time.perf_counter() - started:.0f} s in this invocation")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.format(**DEMO_PRESET),  # the preset's own figures
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "eval" / "learning", help="output folder")
    parser.add_argument("--demo-preset", action="store_true",
                        help="train as make demo does (the demo preset); the training flags below are ignored but "
                             "--groups-per-step and --hallucination-penalty, when given")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="training seeds, one run each (validation split, warm-start order, LoRA init, "
                             "sampling; the test questions stay), pooled at the end")
    add_training_flags(parser, test_questions=None, sft_limit=0, sft_epochs=2, rl_steps=10)
    parser.add_argument("--advantage-balance", type=float, default=0.5,
                        help="ART's advantage_balance: negative advantages weigh 1 - this "
                             "(run I, at 0, learned to abstain)")
    parser.add_argument("--scale-rewards", action=argparse.BooleanOptionalAction, default=False,
                        help="divide advantages by each group's reward std (ART's default; run J); "
                             "off: Dr. GRPO (run K)")
    parser.add_argument("--scaled-steps", type=int, default=0,
                        help="end with this many of the --rl-steps std-scaled (ART's default), "
                             "after the others (runs M, N)")
    parser.add_argument("--hallucination-penalty", type=float, default=None,
                        help="what a wrong answer costs in the reward (default: 1 as in ART·E, runs K, K2; "
                             f"with --demo-preset the preset's {DEMO_PRESET['hallucination_penalty']:g}, run F125; "
                             "P15: 1.5; H1: 1; Y0-Y2 and g6: 2)")
    parser.add_argument("--unanswerable-share", type=float, default=0.0,
                        help="share of GRPO questions asked before their gold email arrived (run O)")
    parser.add_argument("--groups-per-step", type=int, default=None,
                        help="GRPO groups of 4 rollouts a step (default 6, issue 12's bench; with --demo-preset "
                             f"the preset's {DEMO_PRESET['groups_per_step']} groups of "
                             f"{DEMO_PRESET['rollouts_per_group']}; runs Y0-Y2 with --demo-preset: 2)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="GRPO rollouts' sampling temperature (at 0.7, runs F-S, the two-epoch warm start played "
                             "most questions alike four times in four: only a third of the groups had reward variance)")
    parser.add_argument("--eval-every", type=int, default=14, help="RL steps between validations (and after the last)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="rollouts decoded as one batch (training; the evaluation plays 48 at once)")
    parser.add_argument("--cpu-train-threads", type=int, default=0,
                        help="training threads (default: all cores; 1 when other jobs share the machine)")
    parser.add_argument("--grounded-answers", action=argparse.BooleanOptionalAction, default=True,
                        help="evaluate with the grounding check: answers naming something in no email or search "
                             "result the agent saw count as \"I don't know\" (runs F-W: without; the bench prints "
                             "both)")
    parser.add_argument("--warm-start-from", type=Path, default=None,
                        help="another --work of the same seeds and warm start: each seed begins from its warm-start "
                             "checkpoint there (copied) instead of training it again, so settings that change only "
                             "GRPO are compared on one warm start, 12 minutes a seed sooner")
    parser.add_argument("--base-model", default="",
                        help="the model to train: a local transformers folder, or a Hugging Face name on a GPU "
                             "(default: train's, SmolLM2-135M-Instruct on CPU)")
    parser.add_argument("--backend", default="auto", help="train's --backend (auto: local with CUDA, else cpu)")
    parser.add_argument("--with-base", action="store_true", help="evaluate the untrained base model too (0%% so far)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: checks the pipeline, not the targets")
    args = parser.parse_args()
    args.test_questions = args.test_questions or (100 if args.demo_preset else 144)
    if args.quick:
        args.test_questions, args.sft_limit, args.sft_epochs, args.rl_steps = 8, 8, 1, 1
    return args


def train_commands(args, seed: int, db: Path, art_dir: Path) -> tuple[list[str], list[list[str]]]:
    """(the warm start's train command, the GRPO phase's commands): the same run, resumed."""
    common = ["train_email_search_agent.py", "train", "--demo", "--db", str(db), "--art-dir", str(art_dir),
              "--name", "learn", "--keep-checkpoints", "all", "--seed", str(seed), "--backend", args.backend,
              "--cpu-train-threads", str(args.cpu_train_threads),
              *(["--base-model", args.base_model] if args.base_model else [])]
    if args.demo_preset and not args.quick:  # another step width plays its groups at once, as the preset's 6 x 4 are
        flags = (["--groups-per-step", str(args.groups_per_step), "--concurrency", str(4 * args.groups_per_step)]
                 if args.groups_per_step else [])
        if args.hallucination_penalty is not None:
            flags += ["--hallucination-penalty", str(args.hallucination_penalty)]
        # the warm start takes them too: a resumed seed (GRPO begun) must keep its batch size (runs.GRPO_KEEPS)
        return [*common, *flags, "--sft-only"], [[*common, *flags]]
    penalty = 1.0 if args.hallucination_penalty is None else args.hallucination_penalty  # ART·E's
    limit_flags = ["--max-turns", "4", "--max-tokens", "64", "--max-body-chars", "600", "--search-results", "3"]
    train = [*common, "--val-size", "16", *limit_flags, "--sft-limit", str(args.sft_limit),
             "--sft-epochs", str(args.sft_epochs), "--sft-learning-rate", str(args.sft_learning_rate)]
    grpo = [*train, "--groups-per-step", str(args.groups_per_step or 6), "--rollouts-per-group", "4",
            "--eval-every", str(args.eval_every), "--learning-rate", str(args.rl_learning_rate),
            "--advantage-balance", str(args.advantage_balance), "--temperature", str(args.temperature),
            "--hallucination-penalty", str(penalty), "--concurrency", str(args.concurrency),
            "--unanswerable-share", str(args.unanswerable_share)]
    first_steps = args.rl_steps - args.scaled_steps
    scaled = "--scale-rewards" if args.scale_rewards else "--no-scale-rewards"
    phases = [[*grpo, "--max-steps", str(first_steps), scaled]]
    if args.scaled_steps:  # the run resumes where the first phase stopped
        phases.append([*grpo, "--max-steps", str(args.rl_steps), "--scale-rewards"])
    return [*train, "--sft-only"], phases


def bench_seed(args, seed: int, db: Path, work: Path) -> dict:
    """One seed's warm start, GRPO and evaluation (or its report, if one was written); its final-vs-warm pair."""
    report, art_dir = work / "report", work / "art"
    run_dir = art_dir / "email-agent" / "models" / "learn"
    print(f"\n===== seed {seed}: {work}", flush=True)
    if not (report / "summary.json").exists():
        warm_start, phases = train_commands(args, seed, db, art_dir)
        if args.warm_start_from and not run_dir.exists():
            copy_warm_start(args.warm_start_from.resolve() / f"seed-{seed}" / run_dir.relative_to(work), run_dir, db)
        times = {"sft": run(f"warm start, seed {seed}", *warm_start)}
        times["rl"] = sum(run(f"GRPO, seed {seed}", *phase) for phase in phases)
        sft_step = json.loads((run_dir / "state.json").read_text())["sft_steps"]
        models = (["--model", "base", *(["--base-model", args.base_model] if args.base_model else [])]
                  if args.with_base else []) + ["--model", f"learn@{sft_step}", "--model", "learn@latest"]
        times["evaluate"] = run("evaluate", "test_email_search_agent.py", "--db", str(db), "--art-dir", str(art_dir),
                                *models, "--limit", str(args.test_questions), "--output", str(report),
                                "--concurrency", "48", *(["--grounded-answers"] if args.grounded_answers else []))
        print("wall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items()))
    else:
        print(f"(its report exists: not run again; delete {work} to start it over)")
    summary = json.loads((report / "summary.json").read_text())
    print_table(summary["models"], f"seed {seed}: held-out test questions (demo inbox), offline grading")
    if summary["models"] and next(iter(summary["models"].values()))["grounded_answers"]:
        print("\nwithout the grounding check (each withheld answer graded as the agent gave it):")
        for label, s in summary["models"].items():
            counts, right = s["outcomes"], s["withheld_right"]
            wrong = counts["wrong_read"] + counts["wrong_listed"] + counts["wrong_unseen"] + counts["withheld"] - right
            print(f"  {label}: {counts['withheld']} answers withheld, {right} of them right; accuracy "
                  f"{(counts['right'] + right) / s['n']:.1%}, hallucination {wrong / s['n_scored']:.1%}")
    warm = f"learn@{json.loads((run_dir / 'state.json').read_text())['sft_steps']}"
    final = next(m for m in summary["models"] if m.startswith("learn@") and m != warm)
    pair = final_vs_warm(summary, warm, final)
    print(f"\n{final} vs. {warm} on the same {pair['n']} questions: {final} alone right on {pair['right_final']}, "
          f"{warm} alone right on {pair['right_warm']}; exact McNemar p = "
          f"{mcnemar_exact(pair['right_final'], pair['right_warm']):.3g} (target: final better)")
    print(f"score (right +1, hallucinated -1): warm start {pair['score_warm']:+.2f}, final {pair['score_final']:+.2f}; "
          f"final higher on {pair['higher_final']} questions, lower on {pair['higher_warm']}, "
          f"sign test p = {mcnemar_exact(pair['higher_final'], pair['higher_warm']):.3g}")
    if args.demo_preset and args.test_questions > DEMO_QUESTIONS:
        print_demo_targets(report, db, warm, final)
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    val = [(row["step"], row["val/reward"], row.get("val/answer_correct")) for row in history if "val/reward" in row]
    print("validation (step, val/reward, val/answer_correct): "
          + ", ".join(f"({s}, {r:+.3f}, {a:.0%})" for s, r, a in val))
    print(f"report: {report / 'report.html'}")
    return pair


def copy_warm_start(source: Path, run_dir: Path, db: Path) -> None:
    """`source`'s run as it stood when its warm start ended: its checkpoints up to the warm start's last, its
    history up to that step (the warm start's validation included), its state without ART's cumulative metrics
    (they counted the GRPO steps), its config pointing at this work's database (built alike: build-db --demo).
    ART writes model.json anew when the run registers."""
    state = json.loads((source / "state.json").read_text())
    if not state.get("sft_done"):
        raise SystemExit(f"{source}: its warm start has not finished; nothing to begin from")
    last = state["sft_steps"]
    run_dir.mkdir(parents=True)
    for checkpoint in sorted((source / "checkpoints").iterdir()):
        if checkpoint.name.isdigit() and int(checkpoint.name) <= last:
            shutil.copytree(checkpoint, run_dir / "checkpoints" / checkpoint.name)
    rows = [line for line in (source / "history.jsonl").read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last]
    (run_dir / "history.jsonl").write_text("".join(row + "\n" for row in rows))
    state.pop("_metrics_builder_state", None)
    (run_dir / "state.json").write_text(json.dumps(state, indent=2))
    config = json.loads((source / "run_config.json").read_text())
    (run_dir / "run_config.json").write_text(json.dumps({**config, "db": str(db)}, indent=2))
    print(f"warm start (steps 0-{last}) copied from {source}")


def print_demo_targets(report: Path, db: Path, warm: str, final: str) -> None:
    """The same two checkpoints on `make demo`'s own 50 questions (the evaluation's first 50 after its seeded
    shuffle, which the bench's first 100 begin with), against issue 55's targets for the main job."""
    with closing(EmailDB(str(db))) as email_db:
        ids = {q.id for q in select_questions(email_db, "test", seed=0, limit=DEMO_QUESTIONS)}
    records, _ = read_results(report / "results.jsonl")
    figures = summarize([r for r in records if r["question_id"] in ids and r["model"] in (warm, final)])
    w, f = figures["models"][warm], figures["models"][final]
    pair = final_vs_warm(figures, warm, final)
    higher, lower = pair["higher_final"], pair["higher_warm"]
    right_w, right_f = w["outcomes"]["right"], f["outcomes"]["right"]
    print(f"\nmake demo's {w['n']} questions: warm start {w['accuracy']:.0%} right / {w['hallucination_rate']:.0%} "
          f"hallucinated / {w['idk_rate']:.0%} \"I don't know\", score {w['score']:+.2f}; final {f['accuracy']:.0%} / "
          f"{f['hallucination_rate']:.0%} / {f['idk_rate']:.0%}, score {f['score']:+.2f} (higher on {higher} "
          f"questions, lower on {lower}, p = {mcnemar_exact(higher, lower):.3g})")
    checks = [("score higher", f["score"] > w["score"]), (f"at most 2 fewer right ({right_w} -> {right_f})",
              right_f >= right_w - 2), (f"hallucination <= 15% ({f['hallucination_rate']:.0%})",
              f["hallucination_rate"] <= 0.15)]
    print("issue 55's targets for the main job: " + "; ".join(f"{name} {'met' if ok else 'MISSED'}"
                                                               for name, ok in checks))


if __name__ == "__main__":
    main()
