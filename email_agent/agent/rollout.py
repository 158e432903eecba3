"""One episode: a policy answers one question with the tools, and the episode becomes an `art.Trajectory`.

Owns: the system prompt, the turn loop, what each turn and tool call did (recorded in a `Rubric`), and the
`Policy` (any OpenAI-compatible chat-completions endpoint: a LoRA served by vLLM or the CPU backend, or a
prompted model). `tools` dispatches the calls, `grading` grades the final answer, `rewards` turns the rubric
into a number. Training and evaluation both call `rollout`, so there is one copy of the agent loop.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

from email_agent.agent.episode import Episode
from email_agent.agent.grading import grade_answer
from email_agent.agent.rewards import Rubric
from email_agent.agent.tools import NO_TOOL_CALL, TOOLS, Inbox, ToolOutcome, call_tools
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import Question
from email_agent.redact import redact

if TYPE_CHECKING:  # ART is imported where an episode is played: the verifiers taskset (environments/email_inbox)
    import art     # imports this module, for the prompt and the rubric's bookkeeping, in a venv without ART

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
    import art  # here, not at the top: see TYPE_CHECKING above

    IN_FLIGHT.add(asyncio.current_task())
    inbox = Inbox(db, question.inbox_address, question.query_date, max_body_chars=episode.max_body_chars,
                  default_max_results=episode.search_results)
    gold = set(question.message_ids)
    rubric = Rubric()
    messages = first_messages(question, episode)
    traj = art.Trajectory(messages_and_choices=list(messages), tools=TOOLS, reward=0.0,
                          metadata={"question_id": question.id, "inbox": question.inbox_address,
                                    "split": question.split, "policy": policy.model})
    final, error = None, None  # final: return_final_answer's arguments

    while final is None and rubric.num_turns < episode.max_turns:
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
        record_reply(rubric, response.usage)
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        messages.append(assistant_message(choice))
        calls = choice.message.tool_calls or []
        if not calls:
            rubric.parse_errors += 1
            messages.append({"role": "user", "content": NO_TOOL_CALL})
            traj.messages_and_choices.append(messages[-1])
            if on_call is not None:
                on_call(None, choice.message.content, None)
        for call, outcome in zip(calls, call_tools(inbox, calls)):
            record_outcome(rubric, outcome, gold)
            if outcome.name == "return_final_answer" and outcome.error is None:
                final = outcome.arguments
            if on_call is not None:
                on_call(call.function.name, call.function.arguments, outcome)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome.content})
            traj.messages_and_choices.append(messages[-1])
        rubric.env_s += time.perf_counter() - env_started

    rubric.ran_out_of_turns = int(final is None and error is None and rubric.num_turns >= episode.max_turns)
    answer, sources = (final["answer"], final["sources"]) if final else (None, [])
    graded = await grade_answer(rubric, question, answer, sources, messages, episode)
    traj.reward, traj.metrics = graded.reward, asdict(rubric)
    traj.metadata.update({"error": error, **graded.metadata()})
    return traj.finish()


def first_messages(question: Question, episode: Episode) -> list[dict]:
    """The system prompt and the user's question: what every episode starts from."""
    system = SYSTEM_PROMPT.format(inbox=question.inbox_address, today=question.query_date, max_turns=episode.max_turns)
    return [{"role": "system", "content": system}, {"role": "user", "content": question.question}]


def record_reply(rubric: Rubric, usage) -> None:
    """A turn taken: the tokens the server counted for it."""
    rubric.num_turns += 1
    if usage:
        rubric.prompt_tokens += usage.prompt_tokens or 0
        rubric.completion_tokens += usage.completion_tokens or 0
        rubric.sequence_tokens = (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)


def record_outcome(rubric: Rubric, outcome: ToolOutcome, gold: set[str]) -> None:
    """What one tool call did, counted (`gold`: the message ids the answer comes from)."""
    rubric.tool_calls += 1
    if outcome.error == "extra_tool_call":
        rubric.extra_tool_calls += 1
    elif outcome.error == "bad_tool_name":
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
