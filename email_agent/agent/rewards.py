"""Rewards: recorded facts turned into a number. Calls no model.

Owns: the `Rubric` (what happened in one episode: recorded by the rollout, its outcome fields filled in by
`grading`, and doubling as the trajectory's metrics), the reward modes and their formulas (`shaped`, `judge` =
binary), and RULER's relative scores applied to a group (`ruler_rewards`, `ruler_failed`; asking RULER's judge
is `ruler.ruler_group`'s). Whether an answer is right is `grading`'s to decide.

Reward modes (`--reward`):
  offline  shaped formula, verdict from the offline matcher (no network; the default with no judge)
  shaped   shaped formula, verdict from the LLM judge (the default when a judge model is configured)
  judge    1 if the LLM judge accepts the answer, else 0
  ruler    RULER ranks each group's trajectories with a judge model (ART's RULER; scores checked by id)
"""

from __future__ import annotations

from dataclasses import dataclass

from email_agent.agent.matcher import GRADER

REWARD_MODES = ("offline", "shaped", "judge", "ruler")
# Keys RULER's outcome is recorded under (`ruler_failed`, `ruler_rewards`), read by the training loop's outage
# handling (training.judge_outages) and each step's health. The verdict's keys are `grading`'s.
RULER_ERROR = "ruler_error"  # why RULER could not score the group (metadata: the message; metrics: 1 or 0)
JUDGE_TRANSIENT = "judge_transient"  # RULER's error may pass


@dataclass
class Rubric:
    """What happened in one episode. Recorded by the rollout, its outcome graded (`grading.grade`); doubles as
    the trajectory's metrics."""

    answer_correct: int = 0
    sources_correct: int = 0
    attempted_answer: int = 0  # gave a final answer other than "I don't know"
    returned_i_dont_know: int = 0
    hallucinated: int = 0  # attempted and wrong
    num_turns: int = 0
    ran_out_of_turns: int = 0
    ever_found_right_email: int = 0  # a gold message_id appeared in search results
    ever_read_right_email: int = 0
    ever_read_invalid_email: int = 0  # read_email answered "not found"
    searches: int = 0  # valid search_inbox calls
    tool_calls: int = 0
    valid_tool_calls: int = 0
    bad_tool_name: int = 0
    bad_tool_args: int = 0
    parse_errors: int = 0  # a reply with no tool call at all
    extra_tool_calls: int = 0  # more than one call in a turn (only the first runs)
    api_errors: int = 0  # the policy's API failed after retries (the episode ends)
    judge_error: int = 0  # the judge failed; the offline matcher decided instead
    withheld_answer: int = 0  # the grounding check replaced the answer with "I don't know" (`ungrounded_terms`)
    withheld_right: int = 0  # ... and the answer it withheld was right (what the check cost)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sequence_tokens: int = 0  # the last request's prompt + reply: the trained sequence's length, as the server counted
    latency_s: float = 0.0  # seconds the policy took to reply, summed over turns (not waits for a request slot)
    env_s: float = 0.0  # time in tools and bookkeeping

    @property
    def bad_calls(self) -> int:
        return self.bad_tool_name + self.bad_tool_args + self.parse_errors + self.extra_tool_calls


def valid_tool_call_rate(metrics) -> float | None:
    """Valid calls / (calls + turns that made no call at all), over episodes' metrics dicts; None if no turn.

    A turn of plain text is a failed attempt to act: leaving it out would give a model that rarely calls a
    tool, but calls it well, a near-perfect rate.
    """
    metrics = list(metrics)
    attempts = sum(m.get("tool_calls", 0) + m.get("parse_errors", 0) for m in metrics)
    return sum(m.get("valid_tool_calls", 0) for m in metrics) / attempts if attempts else None


def describe(mode: str, judge, ruler_model: str = "", ruler_base_url: str | None = None,
             hallucination_penalty: float = 1.0) -> str:
    """The reward in use, in one line for the start of a run (`judge`: an `llm_judge.LLMJudge`, or None)."""
    def where(base_url: str | None) -> str:
        return f" at {base_url}" if base_url else ""

    graded = (f"answers graded by the judge {judge.model}{where(judge.api_base)}" if judge else
              f"answers graded offline by the {GRADER}; no judge")
    if mode == "ruler":
        return f"RULER {ruler_model}{where(ruler_base_url)} ranks each group; {graded}, for the metrics"
    if mode == "judge":
        return f"judge {judge.model}{where(judge.api_base)}: 1 for a right answer, 0 otherwise"
    return (f"{mode} (right > \"I don't know\" > wrong, a wrong answer costing {hallucination_penalty:g}, with "
            f"partial credit); {graded}")


# ----------------------------------------------------------------------------------------------
# Reward formulas  (the place to tune: keep correct > "I don't know" > wrong, tests/test_rollout.py pins it)
# ----------------------------------------------------------------------------------------------

def shaped_reward(r: Rubric, max_turns: int, num_sources: int, hallucination_penalty: float = 1.0) -> float:
    """ART·E's bands, with its dead 1/num_sources bonus made live, a small format penalty, and two steps that
    keep GRPO from learning to stop answering.

      correct            1 + 0.3 sources_correct + 0.1/num_sources (precise citing) + 0.1 (1 - turns/max_turns)
      I don't know       0 + partial credit      when the right email never showed up in a search that ran: a sound
                                                 abstention
                         -0.5 + partial credit   when a search showed it or the agent read it (the answer was there),
                                                 or no search ran (it never looked)
      out of turns       -0.5 + partial credit   (no decision made; an episode the policy's API ended scores as
                                                 a sound abstention: not the policy's doing)
      wrong answer       -hallucination_penalty + partial credit  (>= 1; 1 as in ART·E)
      partial credit     +0.1 each: found the right email in a search, read it, cited it      (<= 0.3)
      every branch       -0.1 per bad call (unknown tool, bad arguments, no tool call, extra calls), at most -0.5
    So a correct answer scores in [0.5, 1.5] and, at the default penalty, a wrong one in [-1.5, -0.7]; "I don't
    know" is always hallucination_penalty - 0.5 above a wrong answer with the same partial credit and penalties,
    and a sound one, in [-0.5, 0], above any wrong one.
    The penalty sets how sure an agent must be to answer: after reading and citing the right email an answer
    beats "I don't know" (-0.3 there) in expectation when it is right with p > (penalty - 0.5) / (penalty + 1.2)
    or so: 0.23 at 1, 0.46 at 2.
    Why the steps: a policy that is wrong on most attempts learns whatever ends an episode without an answer if it
    scores like a sound abstention (running out of turns, abstaining after reading the answer, abstaining without
    a search): bench_learning runs G, H and P in bench/RESULTS.md.
    """
    penalty = min(0.1 * r.bad_calls, 0.5)
    if r.answer_correct:
        precision = 0.1 / num_sources if r.sources_correct and num_sources else 0.0
        return 1 + 0.3 * r.sources_correct + precision + 0.1 * (1 - r.num_turns / max_turns) - penalty
    partial = 0.1 * (r.ever_found_right_email + r.ever_read_right_email + r.sources_correct)
    if r.attempted_answer:
        return -hallucination_penalty + partial - penalty
    answer_was_there = r.returned_i_dont_know and (r.ever_found_right_email or r.ever_read_right_email)
    never_looked = r.returned_i_dont_know and not r.searches
    if r.ran_out_of_turns or answer_was_there or never_looked:
        return -0.5 + partial - penalty
    return partial - penalty


def reward(mode: str, r: Rubric, max_turns: int, num_sources: int, hallucination_penalty: float = 1.0) -> float:
    if mode == "judge":
        return float(r.answer_correct)
    # "ruler" trajectories keep the shaped value as their independent reward until RULER rescales the group.
    return shaped_reward(r, max_turns, num_sources, hallucination_penalty)


# ----------------------------------------------------------------------------------------------
# RULER's scores as a group's rewards (its judge is asked by `ruler.ruler_group`)
# ----------------------------------------------------------------------------------------------

def ruler_rewards(trajectories, scores) -> None:
    """RULER's scores (one per trajectory, in order) as the group's rewards. Each trajectory's own reward stays
    in its metrics (`independent_reward`), and comes back if the group is scored again."""
    for t, score in zip(trajectories, scores):
        own = t.metrics.get("independent_reward", t.reward)
        t.metadata.pop(RULER_ERROR, None)
        t.metadata.pop(JUDGE_TRANSIENT, None)
        t.metrics.update({"independent_reward": own, "ruler_score": score.score, RULER_ERROR: 0})
        t.reward = score.score
        t.log(f"RULER explanation: {score.explanation}")


def ruler_failed(trajectories, error: str, transient: bool) -> None:
    """A group RULER could not score: kept, but marked (metrics ruler_error=1, metadata ruler_error=`error`) with
    equal rewards of 0, so GRPO trains nothing on it and the train loop counts it as a judge error."""
    for t in trajectories:
        own = t.metrics.get("independent_reward", t.reward)
        t.metrics.update({"independent_reward": own, RULER_ERROR: 1})
        t.metadata.update({RULER_ERROR: error, JUDGE_TRANSIENT: transient})
        t.reward = 0.0
