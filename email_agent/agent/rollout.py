"""One episode: a policy answers one question with the tools, and the episode becomes an `art.Trajectory`.

Owns: the system prompt, the turn loop, how tool calls are dispatched and mistakes recorded, and the
`Policy` (any OpenAI-compatible chat-completions endpoint: a LoRA served by vLLM or the CPU backend, or a
prompted model). It records facts in a `Rubric`; `rewards` turns them into a number. Training and
evaluation both call `rollout`, so there is one copy of the agent loop.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable

import art
import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

from email_agent.agent import rewards
from email_agent.data.email_db import EmailDB
from email_agent.agent.episode import Episode
from email_agent.data.questions import Question
from email_agent.redact import redact
from email_agent.agent.rewards import Rubric
from email_agent.agent.tools import TOOLS, Inbox, ToolOutcome, call_tool, parse_arguments

# ---- ALGO LOGIC: the prompt the agent starts from (a place to tune) ----------------------------------
# What changes per question comes last, so every prompt of a run starts with the same instructions: the CPU
# backend computes a shared start once (its prefix cache, the trainer's shared prefix), vLLM caches it too.
SYSTEM_PROMPT = """You are an email search agent. Answer the user's question by searching their inbox with the tools.
You have up to {max_turns} turns. Search with a few specific keywords from the question, read the most
promising email, and try other keywords if a search finds nothing. When you find the answer, call
return_final_answer with a short answer and the message_id of the email it comes from. If the inbox does
not contain the answer, call return_final_answer with "I don't know" and no sources.
The user's email address is {inbox}. Today's date is {today}."""


@dataclass
class Policy:
    """Who plays the agent: a model behind an OpenAI-compatible chat-completions API.

    Timeouts and retries of transient errors (connection, 429, 5xx) are the client's (`AsyncOpenAI(timeout=...,
    max_retries=...)`); a call that still fails ends the episode and is recorded, never raised.
    """

    client: AsyncOpenAI
    model: str
    temperature: float | None = 1.0  # None: the server's default (o-series models accept no other)
    logprobs: bool = True  # what ART trains on; prompted OpenAI reasoning models reject it
    tool_choice: str | None = None  # e.g. "required" for prompted models; trainable ones learn to call tools
    max_concurrency: int = 16
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    @classmethod
    def for_model(cls, model: art.Model, **kwargs) -> "Policy":
        """The current checkpoint of a registered ART model (served as name@step)."""
        client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key or "none",
                             timeout=kwargs.pop("timeout", 300.0), max_retries=kwargs.pop("max_retries", 2))
        return cls(client, model.get_inference_name(), **kwargs)

    async def complete(self, messages: list[dict], max_tokens: int) -> tuple[ChatCompletion, float]:
        """The reply (at most `max_tokens` long), and the seconds from sending the request to the reply. At most
        `max_concurrency` requests are in flight; time spent waiting for one of those slots is not counted (it
        measures how many episodes were started at once, not the model)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrency)
        request = {"model": self.model, "messages": messages, "tools": TOOLS,
                   "max_completion_tokens": max_tokens}
        if self.temperature is not None:
            request["temperature"] = self.temperature
        if self.logprobs:
            request["logprobs"] = True
        if self.tool_choice:
            request["tool_choice"] = self.tool_choice
        async with self._slots:
            started = time.perf_counter()
            response = await self.client.chat.completions.create(**request)
            return response, time.perf_counter() - started


# Called as each turn's action is handled: (tool name, arguments as sent, outcome); for a reply without a
# tool call, (None, the reply's text, None). For watching an episode live (`ask`); training passes none.
OnCall = Callable[[str | None, str | None, ToolOutcome | None], None]


def assistant_message(choice) -> dict:
    """A response Choice as the next request's assistant message (arguments passed back exactly as sent)."""
    message = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in choice.message.tool_calls]
    return message


# The tasks playing an episode: Ctrl-C cancels them with the run (`cli.run_cancellable`), since ART's gather would
# otherwise play out every rollout of the step before the run could stop.
IN_FLIGHT: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()


async def rollout(policy: Policy, question: Question, db: EmailDB, episode: Episode,
                  on_call: OnCall | None = None) -> art.Trajectory:
    IN_FLIGHT.add(asyncio.current_task())
    inbox = Inbox(db, question.inbox_address, question.query_date, max_body_chars=episode.max_body_chars,
                  default_max_results=episode.search_results)
    gold = set(question.message_ids)
    rubric = Rubric()
    system = SYSTEM_PROMPT.format(inbox=question.inbox_address, today=question.query_date, max_turns=episode.max_turns)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question.question}]
    traj = art.Trajectory(messages_and_choices=list(messages), tools=TOOLS, reward=0.0,
                          metadata={"question_id": question.id, "inbox": question.inbox_address,
                                    "split": question.split, "policy": policy.model})
    answer, sources, error = None, [], None

    while answer is None and rubric.num_turns < episode.max_turns:
        try:
            response, seconds = await policy.complete(messages, episode.max_tokens)
        except openai.APIError as exc:  # after the client's own retries: timeouts, 4xx/5xx, refused connections
            rubric.api_errors += 1
            error = f"policy API error: {type(exc).__name__}: {redact(str(exc)[:300])}"
            break
        rubric.latency_s += seconds
        if not response.choices:  # a server may answer 200 with nothing in it: the episode ends as an API error
            rubric.api_errors += 1
            error = "policy API error: the reply had no choices"
            break
        env_started = time.perf_counter()
        rubric.num_turns += 1
        if response.usage:
            rubric.prompt_tokens += response.usage.prompt_tokens or 0
            rubric.completion_tokens += response.usage.completion_tokens or 0
            rubric.sequence_tokens = (response.usage.prompt_tokens or 0) + (response.usage.completion_tokens or 0)
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        messages.append(assistant_message(choice))
        calls = choice.message.tool_calls or []
        if not calls:
            rubric.parse_errors += 1
            nudge = "Error: reply with a tool call (search_inbox, read_email or return_final_answer), not plain text."
            messages.append({"role": "user", "content": nudge})
            traj.messages_and_choices.append(messages[-1])
            if on_call is not None:
                on_call(None, choice.message.content, None)
        for index, call in enumerate(calls):
            rubric.tool_calls += 1
            if index > 0:  # one action per turn keeps episodes comparable; the model is told why
                rubric.extra_tool_calls += 1
                outcome = ToolOutcome(call.function.name, "Error: only the first tool call of a turn is run; "
                                                          "make one call per turn.", "extra_tool_call")
            elif call.function.name == "return_final_answer":
                try:
                    args = parse_arguments("return_final_answer", call.function.arguments)
                    answer, sources = args["answer"], args["sources"]
                    outcome = ToolOutcome(call.function.name, "Answer recorded.", None, args)
                except ValueError as exc:
                    outcome = ToolOutcome(call.function.name, f"Error: {exc}.", "bad_tool_args")
            else:
                outcome = call_tool(inbox, call.function.name, call.function.arguments)
            record_outcome(rubric, outcome, gold)
            if on_call is not None:
                on_call(call.function.name, call.function.arguments, outcome)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome.content})
            traj.messages_and_choices.append(messages[-1])
        rubric.env_s += time.perf_counter() - env_started

    if answer is None and error is None and rubric.num_turns >= episode.max_turns:
        rubric.ran_out_of_turns = 1
    answer, sources, withheld = withhold_ungrounded(answer, sources, messages, episode)
    verdict = await grade(rubric, question, answer, sources, episode, withheld)
    traj.reward = rewards.reward(episode.reward, rubric, episode.max_turns, len(sources), episode.hallucination_penalty)
    traj.metrics = asdict(rubric)
    traj.metadata.update({"answer": answer, "sources": json.dumps(sources), "error": error,
                          "withheld": json.dumps(withheld) if withheld else None})
    record_verdict(traj, verdict)
    return traj.finish()


def record_verdict(traj: art.Trajectory, verdict: rewards.Verdict | None) -> None:
    traj.metadata.update({"verdict_judge": verdict.judge if verdict else None,
                          rewards.VERDICT_REASONING: verdict.reasoning if verdict else None,
                          rewards.VERDICT_ERROR: verdict.error if verdict else None,
                          rewards.VERDICT_TRANSIENT: verdict.transient if verdict and verdict.error else None})


async def regrade(group: art.TrajectoryGroup, questions: dict, episode: Episode) -> art.TrajectoryGroup:
    """Grade again the episodes of `group` the judge failed on (`questions`: by id)."""
    for traj in group.trajectories:
        if traj.metadata.get(rewards.VERDICT_ERROR):
            await regrade_episode(traj, questions[traj.metadata["question_id"]], episode)
    return group


async def regrade_episode(traj: art.Trajectory, question: Question, episode: Episode) -> art.Trajectory:
    """Grade a finished episode again (its judge failed the first time): the rubric's outcome and the reward."""
    fields = Rubric.__dataclass_fields__
    # `grade` writes again every outcome field the same answer reached the first time; the rest is the episode's
    rubric = Rubric(**{k: v for k, v in traj.metrics.items() if k in fields})
    sources = json.loads(traj.metadata.get("sources") or "[]")
    withheld = json.loads(traj.metadata["withheld"]) if traj.metadata.get("withheld") else None
    verdict = await grade(rubric, question, traj.metadata.get("answer"), sources, episode, withheld)
    traj.reward = rewards.reward(episode.reward, rubric, episode.max_turns, len(sources), episode.hallucination_penalty)
    traj.metrics.update(asdict(rubric))
    record_verdict(traj, verdict)
    return traj


def record_outcome(rubric: Rubric, outcome: ToolOutcome, gold: set[str]) -> None:
    if outcome.error == "bad_tool_name":
        rubric.bad_tool_name += 1
    elif outcome.error == "bad_tool_args":
        rubric.bad_tool_args += 1
    elif outcome.error is None:
        rubric.valid_tool_calls += 1
        if outcome.name == "search_inbox":
            rubric.searches += 1
            if gold & {r["message_id"] for r in outcome.result}:
                rubric.ever_found_right_email = 1
        elif outcome.name == "read_email":
            if outcome.result is None:
                rubric.ever_read_invalid_email = 1
            elif outcome.result["message_id"] in gold:
                rubric.ever_read_right_email = 1


def withhold_ungrounded(answer: str | None, sources: list[str], messages: list[dict], episode: Episode
                        ) -> tuple[str | None, list[str], dict | None]:
    """With `episode.grounded_answers`, an answer that names something (a word with a capital or a digit) found
    in no tool reply and not in the question stands as "I don't know": (answer, sources, what was withheld).

    It is the agent's last line against inventing: a code with a dropped character, a name no email holds.
    What the agent said is kept in the third element, and graded, so a report can say what the check cost.
    """
    if not episode.grounded_answers or answer is None or rewards.is_i_dont_know(answer):
        return answer, sources, None
    unseen = rewards.ungrounded_terms(answer, messages)
    if not unseen:
        return answer, sources, None
    return rewards.IDK, [], {"answer": answer, "sources": sources, "unseen": unseen}


async def grade(rubric: Rubric, question: Question, answer: str | None, sources: list[str],
                episode: Episode, withheld: dict | None = None) -> rewards.Verdict | None:
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
    if rewards.is_i_dont_know(answer):
        rubric.returned_i_dont_know = 1
        if withheld is not None:
            return rewards.Verdict(False, "rule", f"answer withheld: {', '.join(withheld['unseen'])} in nothing "
                                                  f"the agent saw")
        return rewards.Verdict(False, "rule", "answered I don't know")
    rubric.attempted_answer = 1
    verdict = await answer_verdict(question, answer, episode)
    rubric.judge_error = int(verdict.error is not None)
    rubric.answer_correct = int(verdict.correct)
    rubric.hallucinated = int(not verdict.correct)
    return verdict


async def answer_verdict(question: Question, answer: str, episode: Episode) -> rewards.Verdict:
    """The judge's verdict on an answer other than "I don't know", or the offline matcher's without a judge."""
    if episode.judge is not None:
        return await episode.judge.verdict(question.question, question.answer, answer)
    return rewards.offline_verdict(answer, question.answer, question.question)
