"""The one retry policy for a call to a model API (model_api.retrying): how many tries, which failures are tried
again, and the waits between them. The judge's, RULER's and generate-questions' own patience is tested with them
(tests/test_judge.py, tests/test_ruler.py, tests/test_generate.py)."""

import asyncio

from email_agent import model_api


def tried(policy, failures):
    """Calls that raise `failures` in turn (then succeed) under `policy`: (the outcome, tries, waits asked for)."""
    tries, waits, real_sleep = [], [], asyncio.sleep

    async def sleep(seconds):
        waits.append(seconds)
        await real_sleep(0)

    async def call():
        policy.sleep = sleep
        async for attempt in policy:
            with attempt:
                tries.append(1)
                if len(tries) <= len(failures):
                    raise failures[len(tries) - 1]
                return "answer"

    try:
        outcome = asyncio.run(call())
    except BaseException as exc:  # a cancellation is what one case raises
        outcome = exc
    return outcome, len(tries), [w for w in waits if w]


def test_waits_double_from_the_first_up_to_the_cap_and_the_last_failure_is_raised():
    error = RuntimeError("503")
    outcome, tries, waits = tried(model_api.retrying(7, first_wait=0.5), [error] * 7)
    assert outcome is error and tries == 7 and waits == [0.5, 1, 2, 4, 8, 10]
    outcome, tries, waits = tried(model_api.retrying(3), [error, error])  # no first wait: asked again at once
    assert outcome == "answer" and tries == 3 and waits == []


def test_only_what_the_caller_retries_is_tried_again_and_only_what_it_waits_for_is_waited_for():
    malformed, refused = ValueError("not JSON"), PermissionError("401")
    policy = model_api.retrying(4, first_wait=1.0, retry_if=lambda e: isinstance(e, (ValueError, TimeoutError)),
                                wait_if=lambda e: isinstance(e, TimeoutError))
    outcome, tries, waits = tried(policy, [TimeoutError(), malformed, TimeoutError()])
    assert outcome == "answer" and tries == 4 and waits == [1, 4]  # the wait doubles with each try, waited or not
    outcome, tries, _ = tried(model_api.retrying(4, retry_if=lambda e: isinstance(e, ValueError)), [refused])
    assert outcome is refused and tries == 1


def test_a_cancelled_call_is_never_tried_again():
    """Catches: tenacity's attempt catching BaseException, so a policy that retries every failure would keep
    calling a model after the run was stopped (a stopped task is cancelled)."""
    outcome, tries, _ = tried(model_api.retrying(3), [asyncio.CancelledError()])
    assert isinstance(outcome, asyncio.CancelledError) and tries == 1
