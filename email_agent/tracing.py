"""Optional W&B Weave tracing of rollouts and judge calls (`--wandb`): off by default, never required.

ART 0.5.18 does not start Weave itself (its examples call `weave.init(project)` and decorate the rollout
with `@weave.op`), so this does the same: `traced_rollout` initialises Weave for the project and returns the
rollout function wrapped as an op, with the judge's verdict call wrapped too, so each episode and each
judgement shows up as a trace. If Weave cannot start (no key, no network), the run goes on untraced and
the log says why.
"""

from __future__ import annotations

import logging

from email_agent.redact import redact

log = logging.getLogger(__name__)


def traced_rollout(project: str, rollout, judge=None):
    """`rollout` wrapped for Weave in `project` (and `judge.verdict`), or `rollout` itself if Weave fails."""
    try:
        # here, not at the top: weave takes ~1 s to import, and only --wandb traces
        import weave

        weave.init(project)
    except Exception as exc:  # weave raises many kinds (auth, network, config); tracing is a nicety
        log.warning("W&B Weave tracing is off: %s: %s", type(exc).__name__, redact(str(exc)[:200]))
        return rollout
    if judge is not None:
        judge.verdict = weave.op(judge.verdict, name="judge")
    log.info("tracing rollouts%s with W&B Weave in project %s", " and judge calls" if judge else "", project)
    return weave.op(rollout, name="rollout")
