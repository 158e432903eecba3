"""Grading: whether an episode's answer is right, and the episode graded: when the rollout ends and again later.

Owns: the metadata keys a graded trajectory carries its verdict under, the grounding check (`ungrounded_terms`,
`withhold_ungrounded`), the run's grading configured from flags and the environment (`configure`: the reward mode
and the judge), who decides a verdict (`answer_verdict`: the LLM judge, or the offline matcher without one), and
grading one episode's answer: when the rollout ends (`grade_answer`) and again later (`regrade`: the train loop
once a judge that was down is back, the evaluation's `--rejudge`). It fills in a `Rubric`'s outcome fields;
`rewards` turns the rubric into a number and calls no model. It never calls the policy and never touches the
database. The offline matcher is `matcher`'s, the LLM judge `llm_judge`'s, RULER's judge `ruler`'s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import unicodedata
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from email_agent.agent import rewards
from email_agent.agent.llm_judge import LLMJudge
from email_agent.agent.matcher import GRADER, Verdict, is_i_dont_know, offline_verdict
from email_agent.agent.rewards import REWARD_MODES, Rubric
from email_agent.errors import UserError

if TYPE_CHECKING:  # annotations only
    from email_agent.agent.episode import Episode
    from email_agent.data.questions import Question

log = logging.getLogger(__name__)

# Keys of a graded trajectory's metadata: written by `Graded.metadata`, read by the training loop's outage handling
# (training.judge_outages), each step's health and the evaluation's records. RULER's keys are `rewards`'.
VERDICT_REASONING = "verdict_reasoning"  # the judge's reasons, when it gives them
VERDICT_ERROR = "verdict_error"  # why the judge gave no verdict (the episode was then graded offline)
VERDICT_TRANSIENT = "verdict_transient"  # that error may pass (5xx, 429, timeout): worth waiting for
IDK = "I don't know"


def configure(mode: str | None, judge_model: str | None, judge_base_url: str | None,
              cache_dir: str | Path) -> tuple[str, LLMJudge | None]:
    """The reward mode and judge from flags or JUDGE_MODEL / JUDGE_API_BASE / JUDGE_API_KEY.

    Without a judge the mode defaults to offline, and says so loudly; judge/shaped without one is an error.
    """
    judge_model = judge_model or os.environ.get("JUDGE_MODEL")
    judge = None
    if judge_model:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        judge = LLMJudge(judge_model, api_base=judge_base_url or os.environ.get("JUDGE_API_BASE"),
                         api_key=os.environ.get("JUDGE_API_KEY"), cache_path=Path(cache_dir) / "judge_cache.jsonl")
    mode = mode or ("shaped" if judge else "offline")
    if mode not in REWARD_MODES:
        raise UserError(f"--reward must be one of {', '.join(REWARD_MODES)}, not {mode!r}")
    if mode in ("judge", "shaped") and judge is None:
        raise UserError(f"--reward {mode} needs a judge: pass --judge-model (or set JUDGE_MODEL), "
                        "or use --reward offline.")
    if judge is None and mode != "ruler":  # RULER's reward needs no answer judge (`describe` says what is used)
        log.warning(f"no judge configured: answers are graded OFFLINE by the {GRADER} against the gold answer "
                    "(pass --judge-model for an LLM judge).")
    return mode, judge


# Named from the dates the agent is shown (an email's ISO date gives its weekday), so never held against it.
CALENDAR_WORDS = set("""monday tuesday wednesday thursday friday saturday sunday mon tue tues wed thu thur thurs fri
sat sun january february march april may june july august september october november december jan feb mar apr
jun jul aug sep sept oct nov dec""".split())


def ungrounded_terms(answer: str, messages: list[dict]) -> list[str]:
    """The names and numbers of `answer` (its words that start with a capital or hold a digit) that appear, as
    whole words, in nothing the agent was shown: the user's messages (the question) and the tools' results.

    An empty list: the answer is grounded. A small model that misreads or invents a code, a room or a figure
    ("FXQ7R" for "2FXQ7R") names something no email holds; a right answer copies or restates what it read.
    Messages that start with "Error:" do not count (a tool's error repeats what the agent sent, the nudge after
    a reply without a tool call quotes the agent), nor do weekday and month names. Words compare case- and
    accent-insensitively, and JSON tool replies by their string values, so an escape like \\n never glues two
    words into one.
    """
    seen = set(CALENDAR_WORDS)
    for message in messages:
        content = message.get("content")
        if message.get("role") in ("user", "tool") and isinstance(content, str) and not content.startswith("Error:"):
            seen.update(_fold(word) for text in _strings(_json_or_text(content)) for word in re.findall(r"\w+", text))
    terms = [w for w in re.findall(r"\w+", answer) if w[:1].isupper() or any(c.isdigit() for c in w)]
    return list(dict.fromkeys(w for w in terms if _fold(w) not in seen))


def _fold(word: str) -> str:
    return unicodedata.normalize("NFKD", word).encode("ascii", "ignore").decode().lower()


def _json_or_text(content: str):
    try:
        return json.loads(content)
    except ValueError:
        return content


def _strings(value):
    """Every string (and number, as text) inside a JSON value."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif value is not None:
        yield str(value)


# ----------------------------------------------------------------------------------------------
# An episode's answer, graded
# ----------------------------------------------------------------------------------------------

def withhold_ungrounded(answer: str | None, sources: list[str], messages: list[dict], episode: Episode
                        ) -> tuple[str | None, list[str], dict | None]:
    """With `episode.grounded_answers`, an answer that names something (a word with a capital or a digit) found
    in no tool reply and not in the question stands as "I don't know": (answer, sources, what was withheld).

    It is the agent's last line against inventing: a code with a dropped character, a name no email holds.
    What the agent said is kept in the third element, and graded, so a report can say what the check cost.
    """
    if not episode.grounded_answers or answer is None or is_i_dont_know(answer):
        return answer, sources, None
    unseen = ungrounded_terms(answer, messages)
    if not unseen:
        return answer, sources, None
    return IDK, [], {"answer": answer, "sources": sources, "unseen": unseen}


async def grade(rubric: Rubric, question: Question, answer: str | None, sources: list[str],
                episode: Episode, withheld: dict | None = None) -> Verdict | None:
    """Fill in the outcome fields of the rubric; returns the verdict (None when there was no answer, or no
    gold answer to grade against: a question asked with `ask`). `withheld`: what `withhold_ungrounded` kept
    back (the answer given is then "I don't know"); it is graded too, into `withheld_right`."""
    rubric.withheld_answer = int(withheld is not None)
    if answer is None or not question.answer:
        return None
    if withheld is not None:
        cost = await answer_verdict(question, withheld["answer"], episode)
        rubric.withheld_right, rubric.judge_error = int(cost.correct), int(cost.error is not None)
    rubric.sources_correct = int(bool(sources) and set(question.message_ids) <= set(sources))
    if is_i_dont_know(answer):
        rubric.returned_i_dont_know = 1
        if withheld is not None:
            return Verdict(False, "rule", f"answer withheld: {', '.join(withheld['unseen'])} in nothing the agent saw")
        return Verdict(False, "rule", "answered I don't know")
    rubric.attempted_answer = 1
    verdict = await answer_verdict(question, answer, episode)
    rubric.judge_error = int(verdict.error is not None)
    rubric.answer_correct = int(verdict.correct)
    rubric.hallucinated = int(not verdict.correct)
    return verdict


async def answer_verdict(question: Question, answer: str, episode: Episode) -> Verdict:
    """The judge's verdict on an answer other than "I don't know", or the offline matcher's without a judge."""
    if episode.judge is not None:
        return await episode.judge.verdict(question.question, question.answer, answer)
    return offline_verdict(answer, question.answer, question.question)


@dataclass
class Graded:
    """An episode's answer, graded: what stands as its answer after the grounding check, what was withheld (the
    agent's own answer, or None), the verdict and the reward. The rubric's outcome fields are filled in."""

    answer: str | None
    sources: list[str]
    withheld: dict | None
    verdict: Verdict | None
    reward: float

    def metadata(self) -> dict:
        """The trajectory metadata the answer and its verdict are recorded under."""
        verdict = self.verdict
        return {"answer": self.answer, "sources": json.dumps(self.sources),
                "withheld": json.dumps(self.withheld) if self.withheld else None,
                "verdict_judge": verdict.judge if verdict else None,
                VERDICT_REASONING: verdict.reasoning if verdict else None,
                VERDICT_ERROR: verdict.error if verdict else None,
                VERDICT_TRANSIENT: verdict.transient if verdict and verdict.error else None}


async def grade_answer(rubric: Rubric, question: Question, answer: str | None, sources: list[str],
                       messages: list[dict], episode: Episode, max_turns: int | None = None) -> Graded:
    """The agent's final answer (None: it gave none) graded as `episode` says: withheld if ungrounded in
    `messages` (what the agent was shown), judged, and scored (`max_turns`: the episode's, unless given)."""
    answer, sources, withheld = withhold_ungrounded(answer, sources, messages, episode)
    verdict = await grade(rubric, question, answer, sources, episode, withheld)
    score = rewards.reward(episode.reward, rubric, max_turns or episode.max_turns, len(sources),
                           episode.hallucination_penalty)
    return Graded(answer, sources, withheld, verdict, score)


# What `grade` decides; the rest of a rubric is what the episode did, and stays when it is graded again.
OUTCOME = ("answer_correct", "sources_correct", "attempted_answer", "returned_i_dont_know", "hallucinated",
           "judge_error", "withheld_answer", "withheld_right")


async def regrade(metrics: dict, question: Question, answer: str | None, sources: list[str], withheld: dict | None,
                  messages: list[dict], episode: Episode, max_turns: int | None = None) -> tuple[Rubric, Graded]:
    """A finished episode graded again from its record: its metrics, the answer and sources that stood, what the
    grounding check withheld (then the agent's own answer is graded, and withheld again only if `episode` asks
    for the check) and the messages it was shown. The outcome fields start afresh; the rest is the episode's."""
    rubric = Rubric(**{k: v for k, v in metrics.items() if k in RUBRIC_FIELDS and k not in OUTCOME})
    given = withheld or {"answer": answer, "sources": sources}
    return rubric, await grade_answer(rubric, question, given["answer"], given["sources"], messages, episode,
                                      max_turns)


RUBRIC_FIELDS = {f.name for f in fields(Rubric)}


async def regrade_judge_failures(group, questions: dict, episode: Episode):
    """The trajectories of `group` the judge failed on, graded again (`questions`: by id): the train loop's once
    a judge that was down is back."""
    for traj in group.trajectories:
        meta = traj.metadata
        if meta.get(VERDICT_ERROR):
            withheld = json.loads(meta["withheld"]) if meta.get("withheld") else None
            rubric, graded = await regrade(traj.metrics, questions[meta["question_id"]], meta.get("answer"),
                                           json.loads(meta.get("sources") or "[]"), withheld, traj.messages(), episode)
            traj.reward = graded.reward
            traj.metrics.update(asdict(rubric))
            traj.metadata.update(graded.metadata())
    return group
