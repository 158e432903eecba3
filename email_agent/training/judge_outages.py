"""A step's groups, judged before they are trained on: a judge that is down is waited for, one that stays down
stops the run at that step.

Rollouts are expensive and a judge's outage is usually short. When the judge (RULER, or the answer judge of
`--reward judge` / `shaped`) fails on a group, the rollouts are kept and the group is judged again, with
growing waits, for up to `--judge-patience` seconds. Then, if more than half of the step's groups are still
unjudged, the run stops before it trains: no checkpoint is written and no question of the step is used up,
so running the same command again resumes at that step. A failure waiting cannot cure (a wrong key, an
unknown model: HTTP 400/401/403/404, a reply that never parses) stops at once. A step with a few unjudged
groups trains on the others. It owns no judging itself: `grading` asks the judge, `loop.judge` asks again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from art import TrajectoryGroup

from email_agent.errors import UserError
from email_agent.agent.grading import VERDICT_ERROR, VERDICT_TRANSIENT
from email_agent.agent.rewards import JUDGE_TRANSIENT, RULER_ERROR

FIRST_WAIT_S = 5.0  # then doubled after each try, up to MAX_WAIT_S
MAX_WAIT_S = 60.0


class JudgeDown(UserError):
    """The judge could not grade the step: one sentence, with which judge, what error and how to resume."""


def failure(group: TrajectoryGroup, reward_mode: str) -> tuple[str, bool] | None:
    """(error, may pass by waiting) if the judge that decides this group's rewards failed on it, else None.
    RULER decides a whole group; the answer judge decides each answer (under `ruler` it only grades metrics)."""
    for t in group.trajectories:
        if t.metadata.get(RULER_ERROR):
            return t.metadata[RULER_ERROR], bool(t.metadata.get(JUDGE_TRANSIENT))
        if reward_mode in ("judge", "shaped") and t.metadata.get(VERDICT_ERROR):
            return t.metadata[VERDICT_ERROR], bool(t.metadata.get(VERDICT_TRANSIENT))
    return None


async def settle(groups: list[TrajectoryGroup], rejudge: Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]],
                 *, reward_mode: str, patience: float, step: int, notify: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> list[TrajectoryGroup]:
    """The step's groups the judge graded, after waiting out a judge that fails for a while; raises JudgeDown
    when it fails for good (or for longer than `patience` on more than half of the groups)."""
    groups = list(groups)
    started, wait = clock(), FIRST_WAIT_S
    while True:
        failed = {i: f for i, g in enumerate(groups) if (f := failure(g, reward_mode))}
        if not failed:
            return groups
        error, _ = next(iter(failed.values()))
        permanent = next((e for e, transient in failed.values() if not transient), None)
        if permanent:
            raise JudgeDown(f"the judge cannot grade step {step} ({permanent}), and waiting will not change that: "
                            f"fix the judge's model, key or URL (--judge-model, --ruler-model, --judge-base-url, "
                            f"JUDGE_API_KEY or the provider's own key), then run the same command again to resume "
                            f"at step {step}; nothing of this step was trained")
        if clock() - started + wait > patience:
            break
        notify(f"judge: {len(failed)} of {len(groups)} groups of step {step} unjudged ({error}); trying again in "
               f"{wait:.0f}s (waits up to --judge-patience {patience:g}s)")
        await asyncio.sleep(wait)
        for i in failed:
            groups[i] = await rejudge(groups[i])
        wait = min(2 * wait, MAX_WAIT_S)
    if 2 * len(failed) > len(groups):
        raise JudgeDown(f"the judge failed on {len(failed)} of {len(groups)} groups of step {step} for "
                        f"{clock() - started:.0f}s ({error}); nothing of this step was trained and its questions "
                        f"come next: once the judge is back, run the same command again to resume at step {step}")
    notify(f"judge: training step {step} on the {len(groups) - len(failed)} of {len(groups)} groups it graded; "
           f"{len(failed)} stayed unjudged ({error})")
    return [g for i, g in enumerate(groups) if i not in failed]
