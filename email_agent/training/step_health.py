"""Training health: can GRPO learn anything from a step's groups, and did it?

Owns: pure functions from trajectory groups (and a backend's train metrics) to health numbers, a verdict
on whether training would learn (with the likely fix, in one sentence) and the text the train command
prints. GRPO learns only from groups whose rollouts got different rewards and whose assistant turns carry
logprobs; everything else trains on nothing without failing, which is why this module exists.
It never calls the model, the judge or a backend: the train loop gathers, this module reads, asked once before
each update (`measure`; a fresh run's first step also gets the verdict) and once after it (`Watch.after_update`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from art.trajectories import TrajectoryGroup
from openai.types.chat.chat_completion import Choice

from email_agent.agent.grading import VERDICT_ERROR
from email_agent.agent.rewards import RULER_ERROR, valid_tool_call_rate

# A run below these lines learns nothing or little; warnings below `WARN_*` are printed but do not fail.
MIN_TRAINABLE_SHARE = 0.25  # share of groups with reward variance
MAX_JUDGE_ERROR_SHARE = 0.5  # share of judged answers (or RULER groups) the judge failed on
WARN_TRAINABLE_SHARE = 0.5
IDLE_STEPS_WARNING = 3  # this many steps in a row that trained on nothing print a warning
LOW_VARIANCE_STEPS = 5  # steps over which under WARN_TRAINABLE_SHARE of groups with reward variance warns


@dataclass
class Health:
    """What one step's groups offer GRPO. Shares are of rollouts unless named otherwise."""

    groups: int = 0
    trainable_groups: int = 0  # rewards spread at least `min_reward_std`, and scored: GRPO learns from these
    close_groups: int = 0  # rewards that differ, but by less than `min_reward_std`: judge noise, not trained on
    min_reward_std: float = 0.0
    ruler_errors: int = 0  # groups RULER could not score (left untrained)
    rollouts: int = 0
    mean_reward: float = 0.0  # over rollouts of scored groups
    reward_spread: float = 0.0  # mean within-group standard deviation: what GRPO's advantages are made of
    valid_call_rate: float = 0.0  # valid tool calls / (tool calls + turns that made no call)
    answered: float = 0.0  # gave an answer other than "I don't know"
    correct: float = 0.0
    i_dont_know: float = 0.0
    hallucinated: float = 0.0  # answered and wrong
    no_answer: float = 0.0  # ran out of turns or failed before answering
    assistant_turns: int = 0
    turns_without_logprobs: float = 0.0  # share of assistant turns
    judged: int = 0  # answers an LLM judge graded
    judge_errors: int = 0  # answers the judge failed on (the offline matcher decided instead)
    api_errors: int = 0  # rollouts the policy's API ended
    first_error: str = ""  # one judge/RULER error message, to show the user
    rollout_s: float = 0.0  # mean seconds one rollout spent waiting for the policy and in tools
    gather_s: float = 0.0  # wall-clock seconds to gather the step's groups

    @property
    def trainable_share(self) -> float:
        return self.trainable_groups / self.groups if self.groups else 0.0

    @property
    def judge_error_share(self) -> float:
        shares = [self.judge_errors / self.judged if self.judged else 0.0,
                  self.ruler_errors / self.groups if self.groups else 0.0]
        return max(shares)


def _ruler_failed(group: TrajectoryGroup) -> bool:
    return any(t.metrics.get(RULER_ERROR) for t in group.trajectories)


def _has_variance(group: TrajectoryGroup) -> bool:
    rewards = [t.reward for t in group.trajectories]
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9


def learnable(group: TrajectoryGroup, min_reward_std: float) -> bool:
    """Rewards that differ by more than noise: their standard deviation is at least `min_reward_std` (ART's
    std-scaled advantages would blow a 0.001 difference up to a full-size update)."""
    return _has_variance(group) and reward_std(group) >= min_reward_std and not _ruler_failed(group)


def reward_std(group: TrajectoryGroup) -> float:
    return _std([t.reward for t in group.trajectories])


def measure(groups: list[TrajectoryGroup], gather_s: float = 0.0, min_reward_std: float = 0.0) -> Health:
    """Health numbers of one step's groups (as `gather_trajectory_groups` returns them)."""
    trajs = [t for g in groups for t in g.trajectories]
    h = Health(groups=len(groups), rollouts=len(trajs), gather_s=gather_s, min_reward_std=min_reward_std)
    if not trajs:
        return h
    scored = [g for g in groups if not _ruler_failed(g)]
    h.ruler_errors = len(groups) - len(scored)
    h.trainable_groups = sum(learnable(g, min_reward_std) for g in scored)
    h.close_groups = sum(_has_variance(g) and not learnable(g, min_reward_std) for g in scored)
    rewards = [t.reward for g in scored for t in g.trajectories]
    h.mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    spreads = [_std([t.reward for t in g.trajectories]) for g in scored]
    h.reward_spread = sum(spreads) / len(spreads) if spreads else 0.0

    def total(key: str) -> float:
        return sum(t.metrics.get(key, 0) for t in trajs)

    h.valid_call_rate = valid_tool_call_rate(t.metrics for t in trajs) or 0.0
    h.answered = total("attempted_answer") / len(trajs)
    h.correct = total("answer_correct") / len(trajs)
    h.i_dont_know = total("returned_i_dont_know") / len(trajs)
    h.hallucinated = total("hallucinated") / len(trajs)
    h.no_answer = 1.0 - h.answered - h.i_dont_know
    choices = [item for t in trajs for item in t.messages_and_choices if isinstance(item, Choice)]
    h.assistant_turns = len(choices)
    h.turns_without_logprobs = (sum(not (c.logprobs and c.logprobs.content) for c in choices) / len(choices)
                                if choices else 0.0)
    h.judged = sum(1 for t in trajs if t.metrics.get("attempted_answer")
                   and t.metadata.get("verdict_judge") not in (None, "offline", "rule"))
    h.judged += total("judge_error")  # a failed judge leaves verdict_judge "offline"
    h.judge_errors = total("judge_error")
    h.api_errors = total("api_errors")
    errors = [t.metadata.get(RULER_ERROR) or t.metadata.get(VERDICT_ERROR) for t in trajs]
    h.first_error = next((e for e in errors if e), "")
    h.rollout_s = sum(t.metrics.get("latency_s", 0.0) + t.metrics.get("env_s", 0.0) for t in trajs) / len(trajs)
    return h


def sampled_tokens(groups: list[TrajectoryGroup]) -> int:
    """Tokens the policy sampled in these groups (what GRPO can train on), counted from the Choices themselves:
    ART's gather overwrites metrics["completion_tokens"] with a per-turn mean."""
    return sum(len(item.logprobs.content or []) for group in groups for t in group.trajectories
               for item in t.messages_and_choices if isinstance(item, Choice) and item.logprobs is not None)


def too_long(groups: list[TrajectoryGroup], max_seq_length: int) -> int:
    """Trajectories of groups GRPO learns from (rewards that differ) that are longer than `max_seq_length`: ART
    drops them from the update with a warning only, so the step line counts them."""
    return sum(t.metrics.get("sequence_tokens", 0) > max_seq_length for group in groups
               if len({t.reward for t in group.trajectories}) > 1 for t in group.trajectories)


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else 0.0


# ----------------------------------------------------------------------------------------------
# After a training step: did it learn?
# ----------------------------------------------------------------------------------------------

def step_metrics(h: Health, groups: list[TrajectoryGroup], train_metrics: dict, max_seq_length: int
                 ) -> dict[str, float]:
    """What the step trained on, for the step line and history.jsonl (logged as train/<key>).

    ART's LocalBackend and the CPU backend report `data/step_trainer_tokens`, the sampled tokens the update
    trained on (0 when it skipped the update); for a backend that does not (a remote one) the share is estimated
    from the groups: sampled tokens of the groups with reward variance. `too_long` counts the trajectories ART
    leaves out of the update for exceeding `max_seq_length` (it only warns).
    """
    sampled = sampled_tokens(groups)
    if "data/step_trainer_tokens" in train_metrics:
        trained = min(train_metrics["data/step_trainer_tokens"] / sampled, 1.0) if sampled else 0.0
    else:
        usable = sampled_tokens([g for g in groups if learnable(g, h.min_reward_std)])
        trained = usable / sampled if sampled else 0.0
    return {"trainable_group_share": h.trainable_share, "trained_token_share": trained,
            "ruler_errors": float(h.ruler_errors), "judge_errors": float(h.judge_errors),
            "close_groups": float(h.close_groups),
            "too_long": float(too_long(groups, max_seq_length))}


def idle_cause(h: Health) -> str:
    """Why a step trained on nothing, in words (the most fundamental cause first)."""
    if not h.rollouts:
        return "every rollout failed (see the errors above)"
    if h.assistant_turns and h.turns_without_logprobs == 1.0:
        return "the policy's replies carry no logprobs, which GRPO trains on"
    if h.groups and h.ruler_errors == h.groups:
        return f"RULER could not score any group ({h.first_error})"
    if h.valid_call_rate == 0.0:
        return (f"no rollout made a valid tool call, so every rollout of a question got the same reward "
                f"(mean {h.mean_reward:+.2f})")
    return f"every rollout of each question got the same reward (mean {h.mean_reward:+.2f})"


def low_variance_warning(trainable_shares: list[float], temperature: float | None) -> str | None:
    """A warning when, over the last `LOW_VARIANCE_STEPS` steps, under `WARN_TRAINABLE_SHARE` of the groups
    had reward variance: the policy plays most questions alike in every rollout, so most of each step's
    rollouts teach nothing. Run S of bench/RESULTS.md: a two-epoch warm start sampled at 0.7 gave 37%."""
    recent = trainable_shares[-LOW_VARIANCE_STEPS:]
    if len(recent) < LOW_VARIANCE_STEPS:
        return None
    share = sum(recent) / len(recent)
    if share >= WARN_TRAINABLE_SHARE:
        return None
    fix = ("raise --temperature (1.0 samples the policy as it is) or --rollouts-per-group"
           if temperature is not None and temperature < 1.0 else "raise --rollouts-per-group")
    return (f"only {share:.0%} of the groups of the last {len(recent)} steps had reward variance: "
            f"the policy answers most questions the same way in every rollout, and those groups teach nothing; {fix}")


@dataclass
class StepReport:
    """What one step's update learned from: `metrics` for history.jsonl, the step `line`, the `warnings`."""

    metrics: dict[str, float]
    line: str
    warnings: list[str]


class Watch:
    """The loop's one question after each update: what did it learn from (`StepReport`)? Warns of
    `IDLE_STEPS_WARNING` steps in a row that trained on nothing (each time), and of groups without reward variance
    over the last steps (once per run)."""

    def __init__(self, temperature: float | None, max_seq_length: int) -> None:
        self.temperature = temperature
        self.max_seq_length = max_seq_length
        self.idle_steps = 0  # steps in a row that trained on nothing
        self.trainable_shares: list[float] = []
        self.warned_low_variance = False

    def after_update(self, h: Health, groups: list[TrajectoryGroup], train_metrics: dict, step: int,
                     seconds: float) -> StepReport:
        learned = step_metrics(h, groups, train_metrics, self.max_seq_length)
        return StepReport(learned, step_line(step, groups, train_metrics, learned, seconds),
                          self._warnings(h, learned))

    def _warnings(self, h: Health, learned: dict) -> list[str]:
        warnings = []
        self.idle_steps = 0 if learned["trained_token_share"] else self.idle_steps + 1
        if self.idle_steps >= IDLE_STEPS_WARNING:
            warnings.append(f"{self.idle_steps} steps in a row trained on nothing: {idle_cause(h)}")
        self.trainable_shares.append(learned["trainable_group_share"])
        low_variance = low_variance_warning(self.trainable_shares, self.temperature)
        if low_variance and not self.warned_low_variance:
            warnings.append(low_variance)
            self.warned_low_variance = True
        return warnings


# ----------------------------------------------------------------------------------------------
# The preflight verdict
# ----------------------------------------------------------------------------------------------

@dataclass
class Diagnosis:
    ok: bool
    headline: str  # one plain sentence with the likely fix
    warnings: list[str] = field(default_factory=list)

    @property
    def cannot_learn(self) -> bool:
        """GRPO would train on nothing (not merely little): reason enough to stop a run before its first update."""
        return self.headline.startswith("cannot learn")


def diagnose(h: Health, *, reward_mode: str, sft_from: str = "", warm_start_pending: bool = False) -> Diagnosis:
    """Would training on groups like these learn? Every failing check is listed, the most fundamental first."""
    if warm_start_pending:
        warm = f"run the warm start first (the same command with --sft-only; --sft-from {sft_from} has not run yet)"
    elif sft_from:
        warm = ("warm-start longer (more --sft-epochs or --sft-limit) or from a stronger teacher's evaluation "
                "(--sft-from DIR)")
    else:
        warm = ("warm-start it first: --sft-from expert (a scripted expert plays the train questions), or "
                "--sft-from EVAL_DIR with a teacher model's evaluation")
    judge_flags = "--ruler-model" if reward_mode == "ruler" else "--judge-model"
    if not h.rollouts:
        return Diagnosis(False, "cannot learn: every rollout failed; check that the policy's server is up and the "
                              "model name is right.")
    failures = []  # all are shown; the first is the headline
    if h.assistant_turns and h.turns_without_logprobs == 1.0:
        failures.append("cannot learn: no assistant turn has logprobs, which GRPO trains on; serve the policy with "
                        "logprobs (ART's backends and the CPU backend do).")
    if h.judge_error_share >= MAX_JUDGE_ERROR_SHARE:
        what = "RULER" if h.ruler_errors else "the judge"
        failures.append(f"cannot learn: {what} failed on {h.judge_error_share:.0%} of its calls ({h.first_error}); "
                        f"check {judge_flags}, --judge-base-url and the key (JUDGE_API_KEY, or the provider's own "
                        f"variable such as OPENAI_API_KEY).")
    if h.valid_call_rate == 0.0:
        failures.append(f"cannot learn: no valid tool calls; {warm}.")
    elif h.trainable_share < MIN_TRAINABLE_SHARE and h.ruler_errors < h.groups:
        flat = h.groups - h.ruler_errors - h.trainable_groups - h.close_groups  # rewards all equal
        if h.close_groups and h.close_groups >= flat:
            failures.append(f"learns little: the judge's scores are too close to learn from: {h.close_groups} of "
                            f"{h.groups} groups spread less than --min-reward-std {h.min_reward_std:g}; ask the "
                            f"judge for scores that separate rollouts (a rubric), or lower --min-reward-std.")
        else:
            if reward_mode == "judge":
                fix = "use --reward shaped, whose partial credit separates rollouts the binary judge scores alike"
            elif h.correct == 0.0:
                fix = warm
            else:
                fix = "raise --rollouts-per-group or --temperature so rollouts of a question differ"
            failures.append(f"learns little: only {h.trainable_groups} of {h.groups} groups have reward variance; "
                            f"{fix}.")
    warnings = []
    if h.judge_errors and h.judge_error_share < MAX_JUDGE_ERROR_SHARE:
        warnings.append(f"the judge failed on {h.judge_errors} answers (graded offline instead): {h.first_error}")
    if h.ruler_errors and h.judge_error_share < MAX_JUDGE_ERROR_SHARE:
        warnings.append(f"RULER failed on {h.ruler_errors} groups (left untrained): {h.first_error}")
    if h.close_groups:
        warnings.append(f"{h.close_groups} groups' rewards differ by less than --min-reward-std "
                        f"{h.min_reward_std:g} (judge noise): not trained on")
    if 0 < h.turns_without_logprobs < 1.0:
        warnings.append(f"{h.turns_without_logprobs:.0%} of assistant turns have no logprobs and are not trained")
    if not failures and h.trainable_share < WARN_TRAINABLE_SHARE:
        warnings.append(f"only {h.trainable_share:.0%} of groups have reward variance; steps will learn slowly")
    if failures:
        return Diagnosis(False, failures[0], failures[1:] + warnings)
    return Diagnosis(True, f"can learn: {h.trainable_groups} of {h.groups} groups have reward variance.", warnings)


def report(h: Health, verdict: Diagnosis, groups_per_step: int, rollouts_per_group: int, concurrency: int) -> list[str]:
    """The preflight's numbers and warnings (the caller prints the verdict's headline)."""
    # Rollouts run `concurrency` at a time; the update itself comes on top and is not measured here.
    waves = math.ceil(groups_per_step * rollouts_per_group / max(concurrency, 1))
    estimate = h.gather_s if h.gather_s else waves * h.rollout_s
    lines = [
        f"preflight: {h.groups} groups x {rollouts_per_group} rollouts",
        f"  trainable groups     {h.trainable_groups}/{h.groups} ({h.trainable_share:.0%}) have reward variance"
        + (f" ({h.close_groups} more differ by less than --min-reward-std {h.min_reward_std:g})"
           if h.close_groups else ""),
        (f"  reward               mean {h.mean_reward:+.3f}, spread within groups {h.reward_spread:.3f}"
         if h.ruler_errors < h.groups else "  reward               none: no group was scored"),
        f"  valid tool calls     {h.valid_call_rate:.0%} of calls and call-less turns",
        f"  answers              {h.answered:.0%} answered ({h.correct:.0%} correct, "
        f"{h.hallucinated:.0%} hallucinated), "
        f"{h.i_dont_know:.0%} I don't know, {h.no_answer:.0%} none",
        f"  without logprobs     {h.turns_without_logprobs:.0%} of {h.assistant_turns} assistant turns",
        f"  judge errors         {h.judge_errors} of {h.judged} answers, RULER {h.ruler_errors} of {h.groups} groups",
        f"  policy API errors    {h.api_errors} rollouts",
        f"  time                 {h.rollout_s:.1f}s per rollout; about {estimate:.0f}s of rollouts per step "
        f"of {groups_per_step} groups, plus the update",
    ]
    return lines + [f"  warning: {w}" for w in verdict.warnings]


def step_line(step: int, groups: list[TrajectoryGroup], train_metrics: dict, learned: dict, seconds: float) -> str:
    """The train command's line for one step: how the rollouts did, and what the update learned from."""
    trajs = [t for g in groups for t in g.trajectories]

    def mean(key: str) -> float:
        return sum(t.metrics[key] for t in trajs) / max(len(trajs), 1)

    what = (f"trained on {learned['trainable_group_share']:.0%} of groups, {learned['trained_token_share']:.0%} of "
            f"tokens" + ("" if learned["trained_token_share"] > 0 else "  LEARNED NOTHING"))
    loss = f"loss {train_metrics['loss/train']:+.4f}" if "loss/train" in train_metrics else "loss -"  # no update
    errors = "".join(f"  {label} {learned[key]:.0f}" for key, label in
                     (("judge_errors", "judge errors"), ("ruler_errors", "RULER errors"),
                      ("close_groups", "groups too close (< --min-reward-std)"),
                      ("too_long", "too long for --max-seq-length (not trained)")) if learned.get(key))
    return (f"step {step:>4}  reward {sum(t.reward for t in trajs) / max(len(trajs), 1):+.3f}  "
            f"accuracy {mean('answer_correct'):.0%}  turns {mean('num_turns'):.1f}  "
            f"bad calls {mean('bad_tool_args') + mean('bad_tool_name') + mean('parse_errors'):.2f}  "
            f"tokens {sampled_tokens(groups) / max(len(trajs), 1):.0f}  {loss}  "
            f"{what}{errors}  {seconds:.0f}s")


def cpu_step_note(one_rollout_s: float, rollouts: int, at_once: int, preset_rollouts: int) -> str:
    """What a GPU-sized step will cost on the CPU backend, from one rollout timed before it starts."""
    preset_min = one_rollout_s * preset_rollouts / min(at_once, preset_rollouts) / 60
    return (f"note: one rollout took {one_rollout_s:.0f}s here, so a step of {rollouts} rollouts ({at_once} at a time) "
            f"takes about {one_rollout_s * rollouts / at_once / 60:.0f} min before its update; the CPU preset's "
            f"{preset_rollouts} take about {preset_min:.1f} min")
