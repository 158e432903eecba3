"""Warm-start speed of the CPU backend: seconds per expert episode of `train_sft`, with the trainer's merged
copy brought up to date in place after each optimizer step (the code as it is) beside the same training with
the merged copy rebuilt from scratch after each step (a copy of the LoRA model and a merge, as before
2026-11-25), in the same process on the same episodes (a script that prints figures; not a test).

The episodes are the demo expert's on the demo inbox's train questions with the demo preset's limits (4 turns,
600 body characters, 3 results per search), in batches of 4 at the preset's learning rate; each variant starts
from the same new LoRA. The variants alternate over --rounds, so a machine whose speed drifts affects both.

    .venv/bin/python bench/bench_warm_start.py [--episodes 24] [--rounds 2]     (~5 minutes on 2 AVX2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from email_agent.backends.cpu import CPUBackend  # (sets the offline litellm default first)
from email_agent.backends.cpu.model import inference_dtype
from email_agent.data.build import build_database, open_sources
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import select_questions
from email_agent.agent.episode import Episode
from email_agent.agent.demonstrations import expert_trajectories

import art


async def seconds_per_episode(trajectories: list[art.Trajectory], art_dir: str, rebuild: bool) -> tuple[float, float]:
    """(wall seconds per episode, seconds per episode spent building or updating the merged copy)."""
    backend = CPUBackend(path=art_dir)
    model = art.TrainableModel(name="rebuild" if rebuild else "in-place", project="bench",
                               base_model="smollm2", report_metrics=[])
    await model.register(backend)
    trainer = backend.trainer
    if rebuild:  # the previous behaviour: drop the merged copy after every optimizer step
        step = trainer._optimizer_step

        def step_and_drop(max_grad_norm: float) -> float:
            norm = step(max_grad_norm)
            trainer._context = None
            return norm
        trainer._optimizer_step = step_and_drop
    merging = 0.0
    context_model = trainer.context_model

    def timed_context_model():
        nonlocal merging
        started = time.perf_counter()
        merged = context_model()
        merging += time.perf_counter() - started
        return merged
    trainer.context_model = timed_context_model
    started = time.perf_counter()
    await model.train_sft(trajectories, art.TrainSFTConfig(learning_rate=1e-3, batch_size=4))
    elapsed = time.perf_counter() - started
    await backend.close()
    return elapsed / len(trajectories), merging / len(trajectories)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=24, help="demo-expert episodes per configuration and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both configurations")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as work:
        db_path = Path(work) / "demo.db"
        emails, questions, _, _ = open_sources(demo=True)
        build_database(emails, questions, db_path, source="demo", progress=False)
        db = EmailDB(str(db_path))
        train = select_questions(db, "train", single_source=True, seed=0)
        config = Episode(max_turns=4, max_body_chars=600, search_results=3)
        trajectories = (await expert_trajectories(db, train, config))[:args.episodes]
        print(f"{len(trajectories)} demo-expert episodes, batches of 4, inference dtype {inference_dtype()}, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
        results: dict[str, list[tuple[float, float]]] = {"in place": [], "rebuilt": []}
        for round_ in range(args.rounds):
            for name, rebuild in (("rebuilt", True), ("in place", False)):
                seconds, merging = await seconds_per_episode(trajectories, str(Path(work) / f"art-{round_}-{name}"),
                                                             rebuild)
                results[name].append((seconds, merging))
                print(f"round {round_ + 1}  merged copy {name:8}  {seconds:.2f} s per episode, "
                      f"{merging:.3f} s of it merging", flush=True)
    (in_place, in_place_merging), (rebuilt, rebuilt_merging) = (
        [sum(column) / len(column) for column in zip(*results[name])] for name in ("in place", "rebuilt"))
    print(f"\nmean over {args.rounds} rounds, per episode: in place {in_place:.2f} s "
          f"({in_place_merging:.3f} s merging), "
          f"rebuilt {rebuilt:.2f} s ({rebuilt_merging:.3f} s merging): in place takes {in_place / rebuilt:.2f}x the "
          f"time, and {in_place_merging / rebuilt_merging:.2f}x the merging. The wall-time ratio is only as steady as "
          f"the machine: compare it with the merging saved, {rebuilt_merging - in_place_merging:.3f} s per episode.")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
