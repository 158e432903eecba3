"""Grading: whether an answer is right, asked of a matcher or a model, and an episode's answer graded.

Owns: the metadata keys a graded trajectory carries its verdict under, the LLM judge (litellm; cached,
retried, failures recorded) and its configuration, the grounding check (`ungrounded_terms`, `withhold_ungrounded`),
RULER's call to its judge, and grading one episode's answer: when the rollout ends (`grade_answer`) and again later
(`regrade`: the train loop once a judge that was down is back, the evaluation's `--rejudge`). It fills in a
`Rubric`'s outcome fields; `rewards` turns the rubric into a number and calls no model. It never calls the policy
and never touches the database. The offline matcher (`Verdict`, `offline_verdict`) is `matcher`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import tenacity

from email_agent.agent import rewards
from email_agent.agent.matcher import (GRADER, Verdict, is_i_dont_know,  # noqa: F401  (the matcher's names are
                                       normalize_answer, offline_verdict)  # grading's too, for its callers)
from email_agent.agent.rewards import REWARD_MODES, Rubric
from email_agent.errors import UserError
from email_agent.redact import redact

if TYPE_CHECKING:  # annotations only: episode imports this module's judge for its own
    from email_agent.agent.episode import Episode
    from email_agent.data.questions import Question

log = logging.getLogger(__name__)

# Keys of a graded trajectory's metadata: written by `record_verdict`, read by the training loop's outage handling
# (training.judge_outages), each step's health and the evaluation's records. RULER's keys are `rewards`'.
VERDICT_REASONING = "verdict_reasoning"  # the judge's reasons, when it gives them
VERDICT_ERROR = "verdict_error"  # why the judge gave no verdict (the episode was then graded offline)
VERDICT_TRANSIENT = "verdict_transient"  # that error may pass (5xx, 429, timeout): worth waiting for
IDK = "I don't know"

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


JUDGE_PROMPT = """You grade answers to questions about a person's email inbox.
Decide whether the AI's answer gives the same key facts as the reference answer. Extra detail is fine;
a missing, different or contradicting key fact (a name, number, date, place) is not. "I don't know" is
never correct.
Reply with JSON only: {"reasoning": "<one sentence>", "accept": true|false}"""


@dataclass
class LLMJudge:
    """An LLM that decides whether an answer matches the gold answer, through litellm.

    `model` is a litellm name (e.g. "openai/gpt-4.1-mini", "hosted_vllm/qwen" with api_base). Verdicts are
    cached in memory and, with cache_path, on disk, so re-judging the same answer costs nothing.
    """

    model: str
    api_base: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never shown
    retries: int = 3
    timeout: float = 60.0
    cache_path: Path | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.cache_path and Path(self.cache_path).exists():
            text = Path(self.cache_path).read_text()
            if text and not text.endswith("\n"):  # a line a killed run cut off: gone, or the next verdict joins it
                with open(self.cache_path, "r+") as f:
                    f.truncate(len(text[:text.rfind("\n") + 1].encode()))
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                    self._cache[row["key"]] = Verdict(**row["verdict"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn line from an interrupted run

    def litellm_params(self) -> dict:
        return endpoint_params(self.api_base, self.api_key, self.timeout)

    async def verdict(self, question: str, gold: str, answer: str) -> Verdict:
        if is_i_dont_know(answer):
            return Verdict(False, self.model, "answered I don't know")
        key = hashlib.sha256(json.dumps([self.model, question, gold, answer]).encode()).hexdigest()
        if key in self._cache:
            return self._cache[key]
        try:
            verdict = await self._ask(question, gold, answer)
        except JudgeFailed as exc:  # recorded on the verdict, never raised: one bad call must not end a run
            fallback = offline_verdict(answer, gold, question)
            return Verdict(fallback.correct, "offline", fallback.reasoning, error=str(exc), transient=exc.transient)
        self._cache[key] = verdict
        if self.cache_path:
            with open(self.cache_path, "a") as f:
                f.write(json.dumps({"key": key, "verdict": asdict(verdict)}) + "\n")
        return verdict


    async def probe(self) -> None:
        """One uncached verdict before any real work. A judge that cannot run (no key, an unknown model, a dead
        --judge-base-url) would otherwise grade every answer offline, each after its retries, and the summary
        would look like a judge's; raises UserError instead."""
        try:
            await self._ask(*JUDGE_PROBE)
        except JudgeFailed as exc:
            raise UserError(f"{exc}; check --judge-model, --judge-base-url and the judge's API key "
                            "(JUDGE_API_KEY, or the provider's own variable such as OPENAI_API_KEY)") from None

    async def _ask(self, question: str, gold: str, answer: str) -> Verdict:
        # here, not at the top: litellm takes ~1.5 s to import (openai, pydantic), and offline grading never calls it
        import litellm

        litellm.suppress_debug_info = True  # failures are reported by the caller, not printed as banners
        messages = [{"role": "system", "content": JUDGE_PROMPT},
                    {"role": "user", "content": judge_request(question, gold, answer)}]
        retrying = tenacity.AsyncRetrying(stop=tenacity.stop_after_attempt(self.retries), reraise=True,
                                          wait=tenacity.wait_exponential(multiplier=0.5, max=10),
                                          retry=tenacity.retry_if_exception(is_transient))
        try:
            async for attempt in retrying:
                with attempt:
                    response = await litellm.acompletion(model=self.model, messages=messages, temperature=0,
                                                         max_tokens=300, num_retries=0, max_retries=0,
                                                         **self.litellm_params())
                    return parse_judge_reply(response.choices[0].message.content or "", self.model)
        except Exception as exc:  # after retries, or at once when retrying cannot help
            tries = retrying.statistics.get("attempt_number", 1)
            raise JudgeFailed(f"judge {self.model} failed after {tries} {'try' if tries == 1 else 'tries'} "
                              f"({type(exc).__name__}: {redact(str(exc)[:200])})", may_pass(exc)) from exc


JUDGE_PROBE = ("What is the meeting room?", "Room 4B", "It is in room 4B.")  # question, gold, answer


def judge_request(question: str, gold: str, answer: str) -> str:
    return f"Question: {question}\nReference answer: {gold}\nAI answer: {answer}"


class JudgeFailed(Exception):
    """The judge gave no usable verdict (its message is safe to show: secrets redacted). `transient`: the
    failure may pass if one waits (`may_pass`)."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


def is_transient(error: BaseException) -> bool:
    """Worth another try: rate limits, timeouts, server and connection errors, and a malformed reply.
    A bad request, a wrong key or an unknown model (4xx) fails the same way every time."""
    if isinstance(error, ValueError):  # parse_judge_reply: the judge may answer properly next time
        return True
    status = getattr(error, "status_code", None)
    return isinstance(status, int) and (status in (408, 409, 429) or status >= 500)


def may_pass(error: BaseException) -> bool:
    """A judge failure that waiting may cure: a transient one, but not a reply that does not parse (retried
    already: that judge answers in another format, every time)."""
    return is_transient(error) and not isinstance(error, ValueError)


def parse_judge_reply(text: str, judge: str) -> Verdict:
    """The judge's JSON reply -> Verdict (ValueError if it has no usable verdict, so the call is retried)."""
    match = re.search(r"\{.*\}", text, re.S)
    if match is None:
        raise ValueError(f"judge reply has no JSON: {text[:80]!r}")
    reply = json.loads(match.group(0))
    if not isinstance(reply.get("accept"), bool):
        raise ValueError(f"judge reply has no boolean 'accept': {text[:80]!r}")
    return Verdict(reply["accept"], judge, str(reply.get("reasoning", ""))[:500])


def endpoint_params(api_base: str | None, api_key: str | None, timeout: float | None = None) -> dict:
    """litellm's arguments for a judge endpoint. A local OpenAI-compatible judge often needs no key, but the
    client refuses to send none."""
    params = {"api_base": api_base, "api_key": api_key or ("none" if api_base else None), "timeout": timeout}
    return {k: v for k, v in params.items() if v is not None}


def ruler_params(judge: LLMJudge | None, judge_base_url: str | None) -> dict:
    """Where RULER's requests go: the judge's endpoint, else --judge-base-url / JUDGE_API_BASE (RULER needs
    no --judge-model of its own, only --ruler-model)."""
    if judge:
        return judge.litellm_params()
    return endpoint_params(judge_base_url or os.environ.get("JUDGE_API_BASE"), os.environ.get("JUDGE_API_KEY"))


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


# ----------------------------------------------------------------------------------------------
# RULER's judge (the group's rewards from its scores are `rewards`')
# ----------------------------------------------------------------------------------------------

async def ruler_group(group, judge_model: str, extra_litellm_params: dict | None = None, attempts: int = 2):
    """RULER over one group (for `gather_trajectory_groups(after_each=...)`), with the scores checked.

    ART 0.5.18's `ruler_score_group` pairs the judge's scores with trajectories by position, so a judge that
    reorders or drops entries gives rewards to the wrong rollouts without a word. Here the scores are
    re-keyed by the trajectory ids the judge returns, and a reply that fails (an API error, no or
    incomplete scores, unknown ids) is retried; after `attempts` tries the group is kept but marked
    (`rewards.ruler_failed`), so GRPO trains nothing on it and the train loop counts it as a judge error
    instead of a silent 0.
    """
    # here, not at the top: ART imports torch and transformers (seconds); only --reward ruler gets here
    import litellm
    from art.rewards.ruler import ruler

    litellm.suppress_debug_info = True  # failures are recorded on the trajectories, not printed as banners
    trajectories = group.trajectories
    if not trajectories:
        return group
    expected = [str(i) for i in range(1, len(trajectories) + 1)]  # the ids RULER's prompt gives them
    error, transient = "", False
    for _ in range(attempts):
        try:
            scores = await ruler([t.messages() for t in trajectories], judge_model,
                                 extra_litellm_params=extra_litellm_params, tools=trajectories[0].tools)
            by_id = {_trajectory_id(s.trajectory_id): s for s in scores}
            if set(by_id) != set(expected) or len(scores) != len(expected):
                raise ValueError(f"judge scored trajectories {[s.trajectory_id for s in scores]}, "
                                 f"not each of {expected} once")
            break
        except Exception as exc:  # network, malformed or incomplete reply: retried, then recorded
            error = f"RULER judge {judge_model}: {type(exc).__name__}: {redact(str(exc)[:200])}"
            transient = may_pass(exc)
    else:
        rewards.ruler_failed(trajectories, error, transient)
        return group
    rewards.ruler_rewards(trajectories, [by_id[key] for key in expected])
    return group


def _trajectory_id(text: str) -> str:
    """RULER's id as the judge wrote it ("2", "trajectory 2", "#2") -> "2"."""
    digits = re.findall(r"\d+", str(text))
    return digits[0] if len(digits) == 1 else str(text)
