"""A training run's start-up checks, in the order a user meets them, and the `Plan` they resolve: backend, base
model, questions, the episode, the judge, what resumes, all plain data the loop (`training.loop`) follows.

    flags      values no run can use, names no folder can take, a run that could not learn (`check_flags`: the
               `train` command asks before it locks the run and ART loads, so they are told in a second)
    data       the inbox (`--demo`'s built when missing), its validation, warm-start and GRPO questions
    machine    the backend can start here (`backends.check_machine`), W&B's key
    resume     a run of this name can go on with these flags, its saved state reads
    grader     the judge answers (asked after every local check: it is a call over the network), and the warm
               start's episodes are there to learn from (a teacher folder may hold none)

Each refuses in one sentence (UserError) before the run is saved or a model loads; `resolve` asks all but the
flags, in this order, then starts W&B's traces (with --wandb), which refuse nothing. Each step calls down into
the module that owns it, and none calls back up: follow `cfg` from `loop.train` and it goes down the house once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from email_agent import backends, cli, config, runs
from email_agent.agent import grading, rewards
from email_agent.agent.ruler import Ruler
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from email_agent.config import DEMO_DB, TrainConfig
from email_agent.data import build
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import Question, training_questions
from email_agent.errors import UserError

if TYPE_CHECKING:  # ART takes seconds to import; the flags are checked before it loads
    import art


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
    episode: Episode  # the episode's limits and how it is scored (reward mode, judge, penalty)
    ruler: Ruler | None  # --reward ruler's judge, which scores each group as it completes
    # a group the judge failed on (while it was down), graded again: by RULER, or each failed answer by the judge
    regrade: Callable[[art.TrajectoryGroup], Awaitable[art.TrajectoryGroup]]
    reward_line: str  # the reward in use, in one line for the run's opening (rewards.describe)
    rl_steps: int  # GRPO steps the run will take in all (--max-steps, or its epochs' batches)
    run_folder: Path  # <art-dir>/<project>/models/<name>
    run_config: dict  # what run_config.json holds (runs.saved_config)
    state: dict = field(default_factory=dict)  # what a resumed run saved (empty for a fresh one)
    sft_episodes: list | None = None  # the warm start's episodes, when one is still to run
    # agent.rollout.rollout, or it wrapped as a Weave op (--wandb)
    rollout: Callable[[Policy, Question, EmailDB, Episode], Awaitable[art.Trajectory]] = rollout


def build_demo_inbox(db_path: str) -> None:
    """`build-db --demo`, as `train --demo` does it when the demo inbox is not built yet."""
    build.check_target(db_path, [], brings_questions=True, overwrite=False)
    emails, question_rows, source, total = build.open_sources(demo=True)
    cli.print_progress(f"building {db_path} from {source}", to_stderr=True)
    print("\n".join(build.build_database(emails, question_rows, db_path, source=source, total=total,
                                         progress=False).lines()))


def check_flags(cfg: TrainConfig) -> None:
    """Flags, the first of the start-up checks: refused in a second, before the run's lock file is made and ART
    loads (whatever config.check holds: what `--help`'s declared ranges do not say)."""
    config.check(cfg)


async def resolve(cfg: TrainConfig) -> Plan:
    """The run `cfg` (its flags checked) asks for, checked in the order data, machine, resume, grader, and resolved
    (or refused in one sentence); nothing is saved and no model loads."""
    # ---- data: the inbox and its questions
    if cfg.demo and cfg.db == DEMO_DB and not Path(cfg.db).exists():  # elsewhere a missing --db is a typo
        build_demo_inbox(cfg.db)
    db = EmailDB(cfg.db)
    # validation, warm-start and GRPO questions, all from the train split (GRPO's with unanswerable replays)
    val_questions, train_questions, rl_questions = training_questions(db, cfg)
    # ---- machine: the backend can start here (told in seconds, before anything loads), with its base model
    backend, cfg, settings = backends.check_machine(
        cfg, say=lambda line: cli.print_progress(line, to_stderr=not cfg.preflight))
    # ---- resume: before the run is saved and the model loads (minutes on a GPU), a run that cannot go on with
    # these flags or a damaged state fails first
    folder, run_config = runs.run_path(cfg.art_dir, cfg.project, cfg.name), runs.saved_config(cfg, backend.name)
    state = {}
    if not cfg.fresh:
        runs.check_resumable(folder, run_config)
        state = runs.read_state(folder)
    # ---- grader: the judge answers, and the warm start has episodes to learn from
    judge_base_url = cfg.judge_base_url or os.environ.get("JUDGE_API_BASE")  # RULER's endpoint too
    reward_mode, judge = grading.configure(cfg.reward or None, cfg.judge_model or None, judge_base_url, cfg.art_dir)
    if judge:
        await judge.probe()
    ruler_model = cfg.ruler_model or (judge.model if judge else "")
    if reward_mode == "ruler" and not ruler_model:
        raise UserError("--reward ruler needs --ruler-model or --judge-model.")
    episode = replace(Episode.with_limits_of(cfg), reward=reward_mode, judge=judge,
                      hallucination_penalty=cfg.hallucination_penalty)
    reward_line = rewards.describe(reward_mode, judge, ruler_model, judge_base_url, cfg.hallucination_penalty)
    ruler = Ruler(ruler_model, judge_base_url, judge.timeout if judge else None) if reward_mode == "ruler" else None
    regrade = ruler.score if ruler else partial(grading.regrade_judge_failures,
                                                questions={q.id: q for q in rl_questions}, episode=episode)
    sft_episodes = None
    if cfg.sft_from and not state.get("sft_done") and not cfg.preflight:
        # here, not at the top: demonstrations imports ART (seconds), and the command asks `check_flags` first
        from email_agent.agent import demonstrations

        sft_episodes = await demonstrations.warm_start_episodes(cfg.sft_from, cfg.sft_limit, db, train_questions,
                                                                val_questions, episode)
    # ---- set up, not checked: W&B traces start once nothing is left to refuse the run
    played = rollout
    if cfg.wandb:  # Weave traces of every rollout and judge call, beside ART's W&B metrics
        # here, not at the top: tests patch tracing.traced_rollout, so it is looked up at each call
        from email_agent.tracing import traced_rollout

        played = traced_rollout(cfg.project, rollout, judge)
    rl_steps = cfg.max_steps or cfg.num_epochs * -(-len(rl_questions) // cfg.groups_per_step)
    return Plan(cfg, backend, settings, db, val_questions, train_questions, rl_questions, episode, ruler, regrade,
                reward_line, rl_steps, folder, run_config, state, sft_episodes, played)
