"""A training run resolved before anything loads: `resolve(cfg)` returns the frozen `Plan` the loop in
train_email_search_agent.py reads (backend, base model, questions, the episode, the judge, what resumes), and
`Steps` gathers and judges a step's groups of rollouts for it.

Everything that can refuse a run refuses here, in one sentence, before the run is saved or a model loads:
values no run can use, a backend that cannot start, a judge that does not answer, a run that cannot resume, a
teacher folder with nothing to learn from.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import art

from email_agent import backends, config, runs
from email_agent.agent import rewards
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, regrade, rollout
from email_agent.config import DEMO_DB, TrainConfig, check, run_dir, saved_config
from email_agent.data import build
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import Question, training_questions
from email_agent.errors import DataError
from email_agent.training import judge_outages, warm_start


@dataclass(frozen=True)
class Plan:
    config: TrainConfig  # the flags, with the base model resolved; never changed after `resolve`
    backend: str  # cpu | local | serverless | tinker
    db: EmailDB
    val_questions: list[Question]
    train_questions: list[Question]  # the warm start's
    rl_questions: list[Question]  # GRPO's: the train questions, with any unanswerable replays
    episode: Episode  # the episode's shape and how it is scored (reward mode, judge, penalty)
    ruler_model: str
    ruler_params: dict
    state: dict = field(default_factory=dict)  # what a resumed run saved (empty for a fresh one)
    sft_episodes: list | None = None  # the warm start's episodes, when one is still to run
    rollout: object = rollout  # the rollout function (traced with --wandb)

    @property
    def steps(self) -> int:
        cfg = self.config
        return cfg.max_steps or cfg.num_epochs * -(-len(self.rl_questions) // cfg.groups_per_step)

    def opening_lines(self) -> list[str]:
        """What the run is about to do, for a person, at its start."""
        return config.opening_lines(self.config, self.backend, len(self.train_questions),
                                    len(self.rl_questions) - len(self.train_questions), len(self.val_questions),
                                    self.steps, rewards.describe(self.episode.reward, self.episode.judge,
                                                                 self.ruler_model, self.ruler_params.get("api_base"),
                                                                 self.episode.hallucination_penalty),
                                    warm_start_done=bool(self.state.get("sft_done")))

    def trainable_model(self) -> art.TrainableModel:
        cfg = self.config
        return art.TrainableModel(name=cfg.name, project=cfg.project, base_model=cfg.base_model,
                                  base_path=cfg.art_dir, report_metrics=["wandb"] if cfg.wandb else [],
                                  _internal_config=backends.internal_config(cfg) if self.backend == "local" else None)

    def policy(self, model: art.TrainableModel) -> Policy:
        cfg = self.config
        return Policy.for_model(model, temperature=cfg.temperature, max_concurrency=cfg.concurrency)


def build_demo_inbox(db_path: str) -> None:
    """`build-db --demo`, as `train --demo` does it when the demo inbox is not built yet."""
    build.check_target(db_path, [], brings_questions=True, overwrite=False)
    emails, question_rows, source, total = build.open_sources(demo=True)
    say(f"building {db_path} from {source}")
    print("\n".join(build.build_database(emails, question_rows, db_path, source=source, total=total,
                                         progress=False).lines()))


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def resolve(cfg: TrainConfig) -> Plan:
    """The run `cfg` asks for, checked and resolved; nothing is saved and no model loads."""
    check(cfg)  # values no run can use, before anything loads
    config.check_warm_start(cfg)
    backend = backends.resolve_backend(cfg.backend)
    gpu = backends.gpu_checks.find_gpu() if backend == "local" else None
    base_model = cfg.base_model or backends.default_base_model(backend, cfg, gpu)
    if base_model == "smollm2":  # the CPU backend's short name: one run, one spelling in its config
        base_model = backends.CPU_BASE_MODEL
    cfg = replace(cfg, base_model=base_model)
    if backend != "cpu":  # what an ART backend needs, told in seconds, before anything loads
        ready = backends.gpu_checks.readiness(backend, cfg, gpu)
        print("\n".join(ready.report()), file=sys.stdout if cfg.preflight else sys.stderr, flush=True)
        if not ready.ok:
            raise DataError(f"--backend {backend} cannot start here; missing: " + "; ".join(ready.missing))
    if cfg.demo and cfg.db == DEMO_DB and not Path(cfg.db).exists():  # elsewhere a missing --db is a typo
        build_demo_inbox(cfg.db)
    db = EmailDB(cfg.db)
    # validation, warm-start and GRPO questions, all from the train split (GRPO's with unanswerable replays)
    val_questions, train_questions, rl_questions = training_questions(db, cfg)
    reward_mode, judge = rewards.configure(cfg.reward or None, cfg.judge_model or None, cfg.judge_base_url or None,
                                           cfg.art_dir)
    if judge:
        await judge.probe()
    ruler_model = cfg.ruler_model or (judge.model if judge else "")
    if reward_mode == "ruler" and not ruler_model:
        raise DataError("--reward ruler needs --ruler-model or --judge-model.")
    episode = replace(Episode.from_run_config(asdict(cfg)), reward=reward_mode, judge=judge,
                      hallucination_penalty=cfg.hallucination_penalty)
    if backends.hide_wandb_key(backend, cfg.wandb):
        say("W&B: off (no --wandb): WANDB_API_KEY is hidden from ART for this run")
    # The run's state and the warm start's episodes are checked before the run is saved and the model loads
    # (minutes on a GPU): a damaged state or a teacher folder with nothing to learn from fails first.
    state = {}
    if not cfg.fresh:
        runs.check_resumable(run_dir(cfg), saved_config(cfg, backend))
        state = runs.read_state(run_dir(cfg))
    sft_episodes = (await warm_start.warm_start_episodes(cfg, db, train_questions, val_questions, episode)
                    if cfg.sft_from and not state.get("sft_done") and not cfg.preflight else None)
    played = rollout
    if cfg.wandb:  # Weave traces of every rollout and judge call, beside ART's W&B metrics
        # here, not at the top: tests patch tracing.traced_rollout, so it is looked up at each call
        from email_agent.tracing import traced_rollout

        played = traced_rollout(cfg.project, rollout, judge)
    return Plan(cfg, backend, db, val_questions, train_questions, rl_questions, episode, ruler_model,
                rewards.ruler_params(judge, cfg.judge_base_url), state, sft_episodes, played)


class Steps:
    """A step's groups of rollouts (`gather`), then judged (`settle`): a judge that is down is waited for while
    the rollouts are kept, one that stays down stops the run at that step."""

    def __init__(self, plan: Plan, policy: Policy) -> None:
        self.plan, self.policy = plan, policy
        self._by_id = {q.id: q for q in plan.rl_questions}

    def _ruler(self, group: art.TrajectoryGroup):
        return rewards.ruler_group(group, self.plan.ruler_model, self.plan.ruler_params)

    async def gather(self, questions: list[Question], step: int) -> list[art.TrajectoryGroup]:
        plan, cfg = self.plan, self.plan.config
        return await art.gather_trajectory_groups(
            (art.TrajectoryGroup(plan.rollout(self.policy, q, plan.db, plan.episode)
                                 for _ in range(cfg.rollouts_per_group)) for q in questions),
            pbar_desc=f"step {step}", max_exceptions=0.5, max_metrics=4,
            after_each=self._ruler if plan.episode.reward == "ruler" else None)

    async def settle(self, groups: list[art.TrajectoryGroup], step: int) -> list[art.TrajectoryGroup]:
        async def rejudge(group):  # a group the judge failed on, judged again
            return await (self._ruler(group) if self.plan.episode.reward == "ruler"
                          else regrade(group, self._by_id, self.plan.episode))

        return await judge_outages.settle(groups, rejudge, reward_mode=self.plan.episode.reward,
                                          patience=self.plan.config.judge_patience,
                                          step=step + 1,  # the number of the checkpoint it would make
                                          notify=say)
