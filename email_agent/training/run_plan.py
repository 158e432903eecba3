"""A training run resolved before anything loads: `resolve(cfg)` returns the `Plan` the loop (`training.loop`)
follows: backend, base model, questions, the episode, the judge, what resumes, all plain data.

Everything that can refuse a run once its flags are checked (`config.check`) refuses here, in one sentence, before
the run is saved or a model loads: a backend that cannot start, a judge that does not answer, a run that cannot
resume, a teacher folder with nothing to learn from.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from email_agent import backends, runs
from email_agent.agent import grading
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import rollout
from email_agent.config import DEMO_DB, TrainConfig, run_dir, saved_config
from email_agent.data import build
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import Question, training_questions
from email_agent.errors import UserError
from email_agent.training import warm_start


@dataclass(frozen=True)
class Plan:
    """What a run will do, resolved once: plain data the loop reads."""

    config: TrainConfig  # the flags, with the base model resolved; never changed after `resolve`
    backend: backends.Backend  # where it trains and is served (backends.BACKENDS)
    backend_settings: backends.BackendSettings  # what the backend and ART's model settings read of the run
    db: EmailDB
    val_questions: list[Question]
    train_questions: list[Question]  # the warm start's
    rl_questions: list[Question]  # GRPO's: the train questions, with any unanswerable replays
    episode: Episode  # the episode's shape and how it is scored (reward mode, judge, penalty)
    ruler_model: str
    ruler_params: dict
    rl_steps: int  # GRPO steps the run will take in all (--max-steps, or its epochs' batches)
    state: dict = field(default_factory=dict)  # what a resumed run saved (empty for a fresh one)
    sft_episodes: list | None = None  # the warm start's episodes, when one is still to run
    rollout: object = rollout  # the rollout function (traced with --wandb)


def build_demo_inbox(db_path: str) -> None:
    """`build-db --demo`, as `train --demo` does it when the demo inbox is not built yet."""
    build.check_target(db_path, [], brings_questions=True, overwrite=False)
    emails, question_rows, source, total = build.open_sources(demo=True)
    note(f"building {db_path} from {source}")
    print("\n".join(build.build_database(emails, question_rows, db_path, source=source, total=total,
                                         progress=False).lines()))


def note(line: str) -> None:
    """A line for the person at the terminal, on stderr (stdout carries the run's figures)."""
    print(line, file=sys.stderr, flush=True)


async def resolve(cfg: TrainConfig) -> Plan:
    """The run `cfg` asks for, resolved (or refused in one sentence); nothing is saved and no model loads."""
    backend = backends.get(cfg.backend)
    gpu = backend.find_gpu()
    base_model = cfg.base_model or backend.default_base_model(backends.BackendSettings.of(cfg), gpu)
    if base_model == "smollm2":  # the CPU backend's short name: one run, one spelling in its config
        base_model = backends.CPU_BASE_MODEL
    cfg = replace(cfg, base_model=base_model)
    settings = backends.BackendSettings.of(cfg)
    ready = backend.readiness(settings, gpu)  # what an ART backend needs, told in seconds, before anything loads
    if ready is not None:
        print("\n".join(ready.report()), file=sys.stdout if cfg.preflight else sys.stderr, flush=True)
        if not ready.ok:
            raise UserError(f"--backend {backend.name} cannot start here; missing: " + "; ".join(ready.missing))
    if cfg.demo and cfg.db == DEMO_DB and not Path(cfg.db).exists():  # elsewhere a missing --db is a typo
        build_demo_inbox(cfg.db)
    db = EmailDB(cfg.db)
    # validation, warm-start and GRPO questions, all from the train split (GRPO's with unanswerable replays)
    val_questions, train_questions, rl_questions = training_questions(db, cfg)
    reward_mode, judge = grading.configure(cfg.reward or None, cfg.judge_model or None, cfg.judge_base_url or None,
                                           cfg.art_dir)
    if judge:
        await judge.probe()
    ruler_model = cfg.ruler_model or (judge.model if judge else "")
    if reward_mode == "ruler" and not ruler_model:
        raise UserError("--reward ruler needs --ruler-model or --judge-model.")
    episode = replace(Episode.shaped_as(cfg), reward=reward_mode, judge=judge,
                      hallucination_penalty=cfg.hallucination_penalty)
    if backends.hide_wandb_key(backend.name, cfg.wandb):
        note("W&B: off (no --wandb): WANDB_API_KEY is hidden from ART for this run")
    # The run's state and the warm start's episodes are checked before the run is saved and the model loads
    # (minutes on a GPU): a damaged state or a teacher folder with nothing to learn from fails first.
    state = {}
    if not cfg.fresh:
        runs.check_resumable(run_dir(cfg), saved_config(cfg, backend.name))
        state = runs.read_state(run_dir(cfg))
    sft_episodes = (await warm_start.warm_start_episodes(cfg, db, train_questions, val_questions, episode)
                    if cfg.sft_from and not state.get("sft_done") and not cfg.preflight else None)
    played = rollout
    if cfg.wandb:  # Weave traces of every rollout and judge call, beside ART's W&B metrics
        # here, not at the top: tests patch tracing.traced_rollout, so it is looked up at each call
        from email_agent.tracing import traced_rollout

        played = traced_rollout(cfg.project, rollout, judge)
    rl_steps = cfg.max_steps or cfg.num_epochs * -(-len(rl_questions) // cfg.groups_per_step)
    return Plan(cfg, backend, settings, db, val_questions, train_questions, rl_questions, episode, ruler_model,
                grading.ruler_params(judge, cfg.judge_base_url), rl_steps, state, sft_episodes, played)

