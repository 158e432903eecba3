"""Calls to a model API through litellm: the LLM judge's, RULER's judge's and the question writer's (`generate`).

Owns: litellm, imported where a call is made; an endpoint's arguments; which failures another try may cure
(`worth_retrying`) and which waiting may cure (`worth_waiting_for`); and the one retry policy every such call
goes through (`retrying`). Each caller says how patient it is (tries, first wait, what it retries) and what a
failure becomes (a verdict graded offline, a group marked, a batch counted). The policy model is not called
here: the rollout reaches it through the OpenAI client, which retries by itself (`max_retries`).
"""

from __future__ import annotations

import os
from typing import Callable

import tenacity

MAX_WAIT_S = 10.0  # between two tries: a provider still failing after that is down, and the caller records it


def import_litellm():
    """litellm, told to print no banners: every failure is reported by the caller, in one line."""
    # here, not at the top: litellm takes ~1.5 s to import (openai, pydantic), and offline grading and --help
    # never call a model
    import litellm

    litellm.suppress_debug_info = True
    return litellm


def endpoint_params(api_base: str | None, api_key: str | None, timeout: float | None = None) -> dict:
    """litellm's arguments for an endpoint. A local OpenAI-compatible server often needs no key, but the client
    refuses to send none."""
    params = {"api_base": api_base, "api_key": api_key or ("none" if api_base else None), "timeout": timeout}
    return {k: v for k, v in params.items() if v is not None}


def judge_endpoint(api_base: str | None, timeout: float | None = None) -> dict:
    """litellm's arguments for the judge's endpoint (the LLM judge's and RULER's): --judge-base-url, else
    JUDGE_API_BASE, with JUDGE_API_KEY."""
    return endpoint_params(api_base or os.environ.get("JUDGE_API_BASE"), os.environ.get("JUDGE_API_KEY"), timeout)


def worth_retrying(error: BaseException) -> bool:
    """Worth another try: rate limits, timeouts, server and connection errors, and a malformed reply (ValueError:
    the model may answer properly next time). A bad request, a wrong key or an unknown model (4xx) fails the same
    way every time."""
    if isinstance(error, ValueError):
        return True
    status = getattr(error, "status_code", None)
    return isinstance(status, int) and (status in (408, 409, 429) or status >= 500)


def worth_waiting_for(error: BaseException) -> bool:
    """A failure that waiting may cure (recorded as `transient`): one worth retrying, but not a reply that does not
    parse (retried already: that model answers in another format, every time)."""
    return worth_retrying(error) and not isinstance(error, ValueError)


def any_failure(error: BaseException) -> bool:
    """Every error, never a cancellation or Ctrl-C (tenacity sees those too)."""
    return isinstance(error, Exception)


def retrying(attempts: int, *, first_wait: float = 0.0, retry_if: Callable[[BaseException], bool] = any_failure,
             wait_if: Callable[[BaseException], bool] = any_failure) -> tenacity.AsyncRetrying:
    """The one retry policy for a call to a model API (`async for attempt in retrying(...): with attempt: ...`):
    up to `attempts` tries while `retry_if(error)` says another may help; between two tries, after a failure that
    `wait_if` accepts, a wait that doubles from `first_wait` seconds up to MAX_WAIT_S (0: none); the last failure
    raised. `statistics["attempt_number"]` is the number of tries made."""
    backoff = tenacity.wait_exponential(multiplier=first_wait, max=MAX_WAIT_S)

    def wait(state: tenacity.RetryCallState) -> float:
        return backoff(state) if wait_if(state.outcome.exception()) else 0.0

    return tenacity.AsyncRetrying(stop=tenacity.stop_after_attempt(attempts), wait=wait, reraise=True,
                                  retry=tenacity.retry_if_exception(retry_if))
