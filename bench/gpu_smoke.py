"""GPU smoke run: the whole pipeline on one CUDA GPU with ART's LocalBackend (not yet run on a GPU, so not timed).

    make gpu-smoke                                    # = .venv-gpu/bin/python bench/gpu_smoke.py
    python bench/gpu_smoke.py --base-model Qwen/Qwen2.5-1.5B-Instruct --questions 50

Runs the real commands, as a user would, on the bundled demo inbox: build-db --demo; train --backend local
--demo on Qwen2.5-0.5B-Instruct (the demo preset: a warm start on the scripted expert's episodes, then GRPO steps
of the preset's groups and rollouts, here 2 steps, vLLM serving the LoRA between them); then one evaluation of step 0
(the untrained LoRA: the base model) and the last step on held-out test questions, both steps served by one
LocalBackend. Prints what it checks and what each phase took, then the before/after table with the paired test.

The stack (unsloth's trainer and ART's vLLM) starts twice, once per command: ART 0.5.18 serves a run only through
a LocalBackend that loads the trainer too, and a backend lives in one process. There is no separate preflight
phase: `train` prints the readiness check before anything loads and says after its first GRPO step's rollouts
whether the run can learn, so a `--preflight` run would only start the stack a third time.

It needs a GPU: here (no GPU) `train --backend local --preflight` shows what is missing, and tests/test_backends.py
checks that every command below parses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NAME = "gpu-smoke"

from email_agent.config import DEMO_PRESET  # noqa: E402  (light: what `train --help` imports)


def commands(base_model: str, questions: int, steps: int, art_dir: str, db: str, out: str) -> list[tuple[str, list]]:
    """(phase, argv) of each command, for the two scripts' own parsers."""
    train = ["train", "--backend", "local", "--demo", "--db", db, "--art-dir", art_dir, "--name", NAME,
             "--base-model", base_model, "--max-steps", str(steps), "--keep-checkpoints", "all"]
    return [
        ("build the demo inbox", ["train_email_search_agent.py", "build-db", "--demo", "--db", db]),
        ("warm start + GRPO", ["train_email_search_agent.py", *train, "--fresh"]),
        ("evaluate", ["test_email_search_agent.py", "--demo", "--db", db, "--art-dir", art_dir,
                      "--model", f"{NAME}@0", "--model", NAME, "--limit", str(questions), "--grounded-answers",
                      "--output", out]),
    ]


# What the run checks. Not timed: no GPU has run it yet. It starts the stack (unsloth's trainer and ART's vLLM) twice;
# a first start builds ART's vLLM runtime (uv sync: ~3.6 GiB from PyPI, PyTorch's and vLLM's wheel hosts, once per
# machine) and downloads the weights (0.5B: ~1 GiB in bf16 and ~0.5 GiB in 4-bit). The warm start trains the demo
# expert's ~200 episodes; each GRPO step plays the preset's groups x rollouts (all at once) of up to its turns, then
# one update; the evaluation plays the two checkpoints on the test questions. (An earlier estimate, ~13 minutes,
# assumed 8 rollouts a step; the preset has played 24 since a8f78a9.)
PLAN = """GPU smoke run: {model}, a warm start, {steps} GRPO steps of {groups} groups x {rollouts} rollouts
(up to {turns} turns each), {questions} test questions.
It checks, in order: the readiness check (the card, the memory estimate, the first start's runtime and weights);
the warm start through ART's LocalBackend (unsloth's SFT); GRPO steps with vLLM serving each new LoRA as name@step;
the evaluation of step 0 and the last step, served by one LocalBackend, with the paired test.
Not timed yet (no GPU has run it): the stack starts twice (train, evaluate), and a first run also builds ART's vLLM
runtime and downloads the weights; it prints each phase's time at the end."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--questions", type=int, default=30, help="test questions to evaluate on (default 30)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps after the warm start (default 2)")
    parser.add_argument("--workdir", default="runs/gpu-smoke", help="where the database, run and report go")
    args = parser.parse_args()
    work = ROOT / args.workdir
    work.mkdir(parents=True, exist_ok=True)
    db, art_dir, out = str(work / "demo.db"), str(work / "art"), str(work / "eval")
    print(PLAN.format(model=args.base_model, steps=args.steps, questions=args.questions,
                      groups=DEMO_PRESET["groups_per_step"], rollouts=DEMO_PRESET["rollouts_per_group"],
                      turns=DEMO_PRESET["max_turns"]), flush=True)
    timings = []
    for phase, argv in commands(args.base_model, args.questions, args.steps, art_dir, db, out):
        if phase == "build the demo inbox" and Path(db).exists():
            continue
        print(f"\n==> {phase}: {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        code = subprocess.call([sys.executable, str(ROOT / argv[0]), *argv[1:]], cwd=ROOT)
        timings.append((phase, time.perf_counter() - started))
        if code != 0:
            print(f"\n{phase} failed (exit {code}); see above", file=sys.stderr)
            return code
    summary = json.loads((Path(out) / "summary.json").read_text())
    print(f"\nGPU smoke run, {args.base_model}, {args.steps} GRPO steps, {args.questions} test questions:")
    for phase, seconds in timings:
        print(f"  {phase:<22} {seconds:7.0f} s")
    print(f"  {'total':<22} {sum(s for _, s in timings):7.0f} s")
    print(f"\n  {'model':<16} {'right':>6} {'hallucinated':>13} {'I dont know':>12} {'valid calls':>12}")
    for label, m in summary["models"].items():
        print(f"  {label:<16} {m['accuracy'] or 0:>6.0%} {m['hallucination_rate'] or 0:>13.0%} "
              f"{m['idk_rate'] or 0:>12.0%} {m['valid_tool_call_rate'] or 0:>12.0%}")
    for pair in summary.get("pairs", []):
        print(f"  {pair['b']} vs {pair['a']}: {pair['only_b']} vs {pair['only_a']} questions only one got right, "
              f"McNemar p = {pair['p_value']:.2g}")
    print(f"\n  report: {out}/report.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
