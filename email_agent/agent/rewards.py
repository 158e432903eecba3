"""Rewards: deciding whether an answer is right (the verdict) and turning recorded facts into a number.

Owns: the offline answer matcher, the grounding test of an answer (`ungrounded_terms`), the LLM judge
(litellm; cached, retried, failures recorded), the reward formulas (`shaped`, `judge` = binary), and RULER
group scoring. It never calls the policy and never touches the database; the rollout records facts (a
`Rubric`), this module scores them.

Reward modes (`--reward`):
  offline  shaped formula, verdict from the offline matcher (no network; the default with no judge)
  shaped   shaped formula, verdict from the LLM judge (the default when a judge model is configured)
  judge    1 if the LLM judge accepts the answer, else 0
  ruler    RULER ranks each group's trajectories with a judge model (ART's RULER; scores checked by id)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tenacity

from email_agent.errors import DataError
from email_agent.redact import redact

log = logging.getLogger(__name__)

REWARD_MODES = ("offline", "shaped", "judge", "ruler")
# Keys of a graded trajectory's metadata (and RULER's metric): written by `rollout` and `ruler_group`, read by the
# training loop's outage handling (training.judge_outages), each step's health and the evaluation's records.
VERDICT_REASONING = "verdict_reasoning"  # the judge's reasons, when it gives them
VERDICT_ERROR = "verdict_error"  # why the judge gave no verdict (the episode was then graded offline)
VERDICT_TRANSIENT = "verdict_transient"  # that error may pass (5xx, 429, timeout): worth waiting for
RULER_ERROR = "ruler_error"  # why RULER could not score the group (metadata: the message; metrics: 1 or 0)
JUDGE_TRANSIENT = "judge_transient"  # RULER's error may pass
IDK = "I don't know"


@dataclass
class Rubric:
    """What happened in one episode. Recorded by the rollout; doubles as the trajectory's metrics."""

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


@dataclass
class Verdict:
    correct: bool
    judge: str  # "offline" or the judge model's name
    reasoning: str = ""
    error: str | None = None  # set when the judge failed and the offline matcher decided
    transient: bool = False  # ... and the failure may pass (a timeout, 429, 5xx, a refused connection)


# ----------------------------------------------------------------------------------------------
# Verdicts
# ----------------------------------------------------------------------------------------------

def normalize_answer(text: str) -> str:
    """Lower-case; accents, punctuation and symbols dropped (digit groups like 4,000 or 2.4 joined); no articles."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"(?<=\d)[.,](?=\d)", "", text)  # 4,000 -> 4000 ; 2.4 -> 24 on both sides alike
    text = re.sub(r"[^a-z0-9]+", " ", text)  # "$2.4 million" and "2.4 million" normalise alike
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def is_i_dont_know(answer: str) -> bool:
    return normalize_answer(answer) in ("i don t know", "i dont know", "i do not know")


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


def offline_verdict(answer: str, gold: str, question: str = "") -> Verdict:
    """Correct when the normalised gold answer appears, as whole words, in a reasonably short answer.

    Closing words of the gold answer that only restate the question may be left out ("How many FTEs were
    approved?" is answered by "21" as well as by the gold "21 FTEs"), as a judge would allow. Not when the
    question offers a choice ("morning or afternoon?" "Friday morning"): the restated word is then the answer;
    nor opening words ("Jeff approved it"); and a gold answer made only of the question's words must appear
    whole. The length cap stops an agent from being right by pasting a whole email as its answer.
    """
    got, want = normalize_answer(answer), normalize_answer(gold)
    if not want or is_i_dont_know(answer):
        return Verdict(False, "offline", "empty gold answer" if not want else "answered I don't know")
    asked, words = normalize_answer(question).split(), want.split()
    core = words
    if "or" not in asked:
        while core and core[-1] in asked:
            core = core[:-1]
    forms = [want] + ([" ".join(core)] if core and len(core) < len(words) else [])
    found = next((form for form in forms if f" {form} " in f" {got} "), None)
    if found is None and not same_words(got, want):
        return Verdict(False, "offline", "gold answer not in the answer")
    if len(got) > max(3 * len(found or want), len(found or want) + 60):
        return Verdict(False, "offline", "gold answer buried in an over-long answer")
    if found is None:
        return Verdict(True, "offline", "every word of the gold answer in the answer, in another order or with "
                                        "words between them")
    return Verdict(True, "offline", "gold answer found in the answer" if found == want
                   else f"gold answer found in the answer, less the question's own words ({found!r})")


def same_words(got: str, want: str) -> bool:
    """Real answers reword: "Brad Holmes and Everett Plante" for "Everett Plante and Brad Holmes", "December 20,
    2001 at 11:00 a.m." for "December 20, 2001, 11:00 a.m.". Every word of a gold answer of two words or more
    in the (normalised) answer, and no number the gold answer lacks ("Boardroom 3 or 7" does not answer
    "Boardroom 7")."""
    wanted, given = want.split(), got.split()
    numbers = {w for w in wanted if any(c.isdigit() for c in w)}
    return len(wanted) >= 2 and set(wanted) <= set(given) and \
        all(w in numbers for w in given if any(c.isdigit() for c in w))


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
        would look like a judge's; raises DataError instead."""
        try:
            await self._ask(*JUDGE_PROBE)
        except JudgeFailed as exc:
            raise DataError(f"{exc}; check --judge-model, --judge-base-url and the judge's API key "
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
        raise DataError(f"--reward must be one of {', '.join(REWARD_MODES)}, not {mode!r}")
    if mode in ("judge", "shaped") and judge is None:
        raise DataError(f"--reward {mode} needs a judge: pass --judge-model (or set JUDGE_MODEL), "
                        "or use --reward offline.")
    if judge is None and mode != "ruler":  # RULER's reward needs no answer judge (`describe` says what is used)
        log.warning("no judge configured: answers are graded OFFLINE by normalised match against the gold answer "
                    "(pass --judge-model for an LLM judge).")
    return mode, judge


def describe(mode: str, judge: LLMJudge | None, ruler_model: str = "", ruler_base_url: str | None = None,
             hallucination_penalty: float = 1.0) -> str:
    """The reward in use, in one line for the start of a run."""
    def where(base_url: str | None) -> str:
        return f" at {base_url}" if base_url else ""

    graded = (f"answers graded by the judge {judge.model}{where(judge.api_base)}" if judge else
              "answers graded offline (normalised match against the gold answer; no judge)")
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


async def ruler_group(group, judge_model: str, extra_litellm_params: dict | None = None, attempts: int = 2):
    """RULER over one group (for `gather_trajectory_groups(after_each=...)`), with the scores checked.

    ART 0.5.18's `ruler_score_group` pairs the judge's scores with trajectories by position, so a judge that
    reorders or drops entries gives rewards to the wrong rollouts without a word. Here the scores are
    re-keyed by the trajectory ids the judge returns, and a reply that fails (an API error, no or
    incomplete scores, unknown ids) is retried; after `attempts` tries the group is kept but marked
    (metrics ruler_error=1, metadata ruler_error=message) with equal rewards of 0, so GRPO trains nothing on
    it and the train loop counts it as a judge error instead of a silent 0.
    """
    # here, not at the top: ART imports torch and transformers (seconds); only --reward ruler gets here
    import litellm
    from art.rewards.ruler import ruler

    litellm.suppress_debug_info = True  # failures are recorded on the trajectories, not printed as banners
    trajectories = group.trajectories
    if not trajectories:
        return group
    for t in trajectories:  # a group RULER failed on before (the train loop tries again): its own rewards back
        if "independent_reward" in t.metrics:
            t.reward = t.metrics["independent_reward"]
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
        for t in trajectories:
            t.metrics.update({"independent_reward": t.reward, RULER_ERROR: 1})
            t.metadata.update({RULER_ERROR: error, JUDGE_TRANSIENT: transient})
            t.reward = 0.0
        return group
    for key, t in zip(expected, trajectories):
        t.metadata.pop(RULER_ERROR, None)
        t.metadata.pop(JUDGE_TRANSIENT, None)
        t.metrics.update({"independent_reward": t.reward, "ruler_score": by_id[key].score, RULER_ERROR: 0})
        t.reward = by_id[key].score
        t.log(f"RULER explanation: {by_id[key].explanation}")
    return group


def _trajectory_id(text: str) -> str:
    """RULER's id as the judge wrote it ("2", "trajectory 2", "#2") -> "2"."""
    digits = re.findall(r"\d+", str(text))
    return digits[0] if len(digits) == 1 else str(text)
