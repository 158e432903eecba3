"""The LLM judge: an LLM that decides whether an answer gives the gold answer's key facts, through litellm.

Owns: the judge's prompt, its request and the parsing of its reply, its verdict cache (in memory and on disk), the
probe a run makes before any real work, and what a failed call becomes: a verdict of the offline matcher that
carries the error and whether waiting may cure it (`JudgeFailed`, never raised out of `verdict`). Which verdict an
episode gets, and when it is asked again, is `grading`'s; how a call is retried is `model_api`'s.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from email_agent import model_api
from email_agent.agent.matcher import Verdict, is_i_dont_know, offline_verdict
from email_agent.errors import UserError
from email_agent.redact import redact

JUDGE_PROMPT = """You grade answers to questions about a person's email inbox.
Decide whether the AI's answer gives the same key facts as the reference answer. Extra detail is fine;
a missing, different or contradicting key fact (a name, number, date, place) is not. "I don't know" is
never correct.
Reply with JSON only: {"reasoning": "<one sentence>", "accept": true|false}"""

JUDGE_PROBE = ("What is the meeting room?", "Room 4B", "It is in room 4B.")  # question, gold, answer


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
        return model_api.endpoint_params(self.api_base, self.api_key, self.timeout)

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
        litellm = model_api.import_litellm()
        messages = [{"role": "system", "content": JUDGE_PROMPT},
                    {"role": "user", "content": judge_request(question, gold, answer)}]
        retrying = model_api.retrying(self.retries, first_wait=0.5, retry_if=model_api.worth_retrying)
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
                              f"({type(exc).__name__}: {redact(str(exc)[:200])})",
                              model_api.worth_waiting_for(exc)) from exc


def judge_request(question: str, gold: str, answer: str) -> str:
    return f"Question: {question}\nReference answer: {gold}\nAI answer: {answer}"


class JudgeFailed(Exception):
    """The judge gave no usable verdict (its message is safe to show: secrets redacted). `transient`: the
    failure may pass if one waits (`model_api.worth_waiting_for`)."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


def parse_judge_reply(text: str, judge: str) -> Verdict:
    """The judge's JSON reply -> Verdict (ValueError if it has no usable verdict, so the call is retried)."""
    match = re.search(r"\{.*\}", text, re.S)
    if match is None:
        raise ValueError(f"judge reply has no JSON: {text[:80]!r}")
    reply = json.loads(match.group(0))
    if not isinstance(reply.get("accept"), bool):
        raise ValueError(f"judge reply has no boolean 'accept': {text[:80]!r}")
    return Verdict(reply["accept"], judge, str(reply.get("reasoning", ""))[:500])
