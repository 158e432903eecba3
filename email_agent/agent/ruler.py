"""RULER's judge: a group of trajectories scored against each other by a judge model (ART's RULER), scores checked.

Owns: asking its judge for one group's scores (`ruler_group`), each score matched to its trajectory by id. The
group's rewards from those scores, and the mark on a group it could not score, are `rewards`'; where its requests
go (the judge's endpoint, `judge_endpoint`) and how a call is retried are `model_api`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from email_agent import model_api
from email_agent.agent import rewards
from email_agent.redact import redact


@dataclass(frozen=True)
class Ruler:
    """A run's RULER: its judge model and endpoint; `score` is the reward of each group of rollouts as it
    completes (`gather_trajectory_groups(after_each=...)`), and of a group again after the judge was down."""

    model: str
    api_base: str | None = None  # the judge's endpoint: --judge-base-url, else JUDGE_API_BASE
    timeout: float | None = None

    async def score(self, group):
        return await ruler_group(group, self.model, model_api.judge_endpoint(self.api_base, self.timeout))


async def ruler_group(group, judge_model: str, extra_litellm_params: dict | None = None, attempts: int = 2):
    """RULER over one group (for `gather_trajectory_groups(after_each=...)`), with the scores checked.

    ART 0.5.18's `ruler_score_group` pairs the judge's scores with trajectories by position, so a judge that
    reorders or drops entries gives rewards to the wrong rollouts without a word. Here the scores are
    re-keyed by the trajectory ids the judge returns, and a reply that fails (an API error, no or
    incomplete scores, unknown ids) is asked again at once; after `attempts` tries the group is kept but marked
    (`rewards.ruler_failed`), so GRPO trains nothing on it and the train loop counts it as a judge error
    instead of a silent 0.
    """
    model_api.import_litellm()  # RULER calls litellm: its failures are recorded on the trajectories, not printed
    # here, not at the top: ART imports torch and transformers (seconds); only --reward ruler gets here
    from art.rewards.ruler import ruler

    trajectories = group.trajectories
    if not trajectories:
        return group
    expected = [str(i) for i in range(1, len(trajectories) + 1)]  # the ids RULER's prompt gives them
    try:
        async for attempt in model_api.retrying(attempts):  # network, malformed or incomplete reply: retried
            with attempt:
                scores = await ruler([t.messages() for t in trajectories], judge_model,
                                     extra_litellm_params=extra_litellm_params, tools=trajectories[0].tools)
                by_id = {_trajectory_id(s.trajectory_id): s for s in scores}
                if set(by_id) != set(expected) or len(scores) != len(expected):
                    raise ValueError(f"judge scored trajectories {[s.trajectory_id for s in scores]}, "
                                     f"not each of {expected} once")
    except Exception as exc:  # after `attempts` tries: recorded
        rewards.ruler_failed(trajectories, f"RULER judge {judge_model}: {type(exc).__name__}: "
                                           f"{redact(str(exc)[:200])}", model_api.worth_waiting_for(exc))
        return group
    rewards.ruler_rewards(trajectories, [by_id[key] for key in expected])
    return group


def _trajectory_id(text: str) -> str:
    """RULER's id as the judge wrote it ("2", "trajectory 2", "#2") -> "2"."""
    digits = re.findall(r"\d+", str(text))
    return digits[0] if len(digits) == 1 else str(text)
