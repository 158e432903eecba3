"""The inbox task for verifiers: each task one question of a database this tool built, played as the project plays it.

Owns the translation, not the task: a task's prompt is the project's system prompt and the question
(email_agent.agent.rollout.first_messages); its tools are the project's three, scoped to the question's inbox and
day (email_inbox.tools); it ends as the project's episode does (a valid return_final_answer, or the turn limit),
and it is graded by the project's grading (email_agent.agent.grading: the offline matcher, or the LLM judge when
one is configured), importing each of those rather than copying it. verifiers plays it with any harness; the Env
below picks the plain-chat `null` one, on this machine, with the episode's token limit per reply.

Where verifiers' loop differs from the project's (docs/verifiers.md lists each): a reply with no tool call ends
the episode (the project tells the model to call a tool and goes on), and verifiers streams replies, so the
server's streaming tool-call parser reads them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

from pydantic import model_validator

import verifiers.v1 as vf
from email_agent.agent import grading
from email_agent.agent.episode import Episode
from email_agent.agent.rewards import Rubric
from email_agent.agent.rollout import first_messages, record_outcome, record_reply
from email_agent.agent.tools import AGENT_TOOLS, EXTRA_TOOL_CALL, NO_TOOL_CALL, Inbox, call_tool, call_tools
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import Question, question_counts, select_questions
from email_agent.errors import UserError
from email_agent.runs import find_run
from email_inbox.tools import InboxToolset

# Grading modes that score one episode on its own (RULER ranks a group: a trainer's business, not a task's).
REWARD_MODES = ("offline", "shaped", "judge")
JUDGE_CACHE = Path.home() / ".cache" / "email-agent" / "verifiers-judge"  # verdicts kept across runs


class EmailTaskConfig(vf.TaskConfig):
    """How an episode is scored (`--env.taskset.task.*`)."""

    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    reward: str | None = None
    """offline (the offline matcher's verdict, shaped reward), shaped (the judge's verdict), judge (1 if the judge
    accepts, else 0); default: shaped with a judge, else offline."""
    judge_model: str | None = None
    """litellm name of the LLM judge (or JUDGE_MODEL); none: the offline matcher grades."""
    judge_base_url: str | None = None
    """api_base of the judge (or JUDGE_API_BASE; its key from JUDGE_API_KEY)."""
    grounded_answers: bool = False
    """An answer naming what the agent never saw stands as "I don't know" (the evaluation's --grounded-answers)."""
    hallucination_penalty: float = 1.0
    """What a wrong answer costs in the shaped reward."""

    @model_validator(mode="after")
    def _known_mode(self) -> EmailTaskConfig:
        if self.reward is not None and self.reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {', '.join(REWARD_MODES)}, not {self.reward!r}")
        if self.reward in ("judge", "shaped") and not (self.judge_model or os.environ.get("JUDGE_MODEL")):
            raise ValueError(f"reward {self.reward} needs a judge: set judge-model (or JUDGE_MODEL), or use reward "
                             "offline")
        return self


class EmailTaskData(vf.TaskData):
    """One question, and what the tool server and the grader need to play it without the taskset."""

    question_id: int | str
    question: str
    answer: str
    message_ids: list[str]
    inbox_address: str
    query_date: str
    split: str
    db: str  # the database, absolute: the tool server opens it in its own process
    max_turns: int
    max_body_chars: int
    search_results: int

    def as_question(self) -> Question:
        return Question(self.question_id, self.question, self.answer, self.message_ids, None, self.inbox_address,
                        self.query_date, self.split)


class EmailTask(vf.Task[EmailTaskData, vf.State, EmailTaskConfig]):
    @classmethod
    def toolsets(cls, config: EmailTaskConfig) -> list[vf.Toolset]:
        return [InboxToolset(config.tools)]

    # ---- when the episode ends: as the project's rollout loop ends it --------------------------------
    @vf.stop
    def answered(self, response: vf.Response) -> bool:
        """The reply's first call (the only one run) is a return_final_answer whose arguments check out."""
        calls = response.message.tool_calls or []
        return bool(calls) and calls[0].name == "return_final_answer" and \
            call_tool(None, calls[0].name, calls[0].arguments).error is None  # checks only, never reads the inbox

    @vf.stop
    def out_of_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= self.data.max_turns

    @vf.intercept
    def project_tool_errors(self, request: vf.Request) -> vf.Request | None:
        """The results of the calls the harness would answer in its own words, in the project's: a turn's second
        and later calls (refused: one action per turn), a tool that does not exist, arguments that are not a
        JSON object. Asked before each call runs, so those never reach the tool server."""
        issued = {call.id: (message, index) for message in request.messages if isinstance(message, vf.AssistantMessage)
                  for index, call in enumerate(message.tool_calls or [])}
        messages, changed = list(request.messages), False
        for position, message in enumerate(messages):
            if not isinstance(message, vf.ToolMessage) or message.tool_call_id not in issued:
                continue
            assistant, index = issued[message.tool_call_id]
            call = assistant.tool_calls[index]
            if index > 0:
                content = EXTRA_TOOL_CALL
            elif call.name not in AGENT_TOOLS or not _json_object(call.arguments):
                content = call_tool(None, call.name, call.arguments).content  # fails before it reads the inbox
            else:
                continue
            if message.content != content:
                messages[position], changed = message.model_copy(update={"content": content}), True
        return request.model_copy(update={"messages": messages}) if changed else None

    # ---- the score: the project's grading of what happened ---------------------------------------------
    @vf.metric
    async def outcome(self, trace: vf.Trace) -> dict[str, float]:
        """The project's rubric of the episode (answer_correct is its accuracy, hallucinated its wrong answers)."""
        rubric, graded = await self.graded(trace)
        return {f.name: float(getattr(rubric, f.name)) for f in fields(Rubric)
                if f.name not in ("latency_s", "env_s", "prompt_tokens", "completion_tokens", "sequence_tokens")}

    @vf.reward
    async def reward(self, trace: vf.Trace) -> float:
        """The project's reward in the configured mode (offline: the shaped reward, graded offline)."""
        return (await self.graded(trace))[1].reward

    async def graded(self, trace: vf.Trace) -> tuple[Rubric, grading.Graded]:
        """The episode replayed through the project's tools and graded. The tools are read-only and
        deterministic, so the replay's outcomes are the ones the tool server returned; the rubric counts what the
        rollout loop counts. Kept on the trace (`info`), with the answer and verdict, for the second caller."""
        kept = trace.info.get("email_inbox")
        if kept is not None:
            verdict = kept["graded"]["verdict"]
            return Rubric(**kept["rubric"]), grading.Graded(**{**kept["graded"], "verdict": verdict and
                                                               grading.Verdict(**verdict)})
        data, episode = self.data, self.episode()
        question = data.as_question()
        db = EmailDB(data.db)
        try:
            rubric, answer, sources, messages = self.replay(trace, Inbox(
                db, data.inbox_address, data.query_date, max_body_chars=data.max_body_chars,
                default_max_results=data.search_results), episode)
        finally:
            db.close()  # one per scored episode: a training run scores thousands
        result = await grading.grade_answer(rubric, question, answer, sources, messages, episode)
        trace.info["email_inbox"] = {"rubric": asdict(rubric), "graded": asdict(result)}
        return rubric, result

    def replay(self, trace: vf.Trace, inbox: Inbox, episode: Episode) -> tuple[Rubric, str | None, list, list]:
        """The trace's replies through the project's tools, counted as the rollout loop counts them: (rubric,
        answer, sources, the messages the agent was shown)."""
        data = self.data
        rubric, gold = Rubric(), set(data.message_ids)
        messages = first_messages(data.as_question(), episode)
        final = None
        for reply in trace.assistant_messages:
            record_reply(rubric, None)
            calls = reply.tool_calls or []
            messages.append({"role": "assistant", "content": reply.content,
                             "tool_calls": [{"id": c.id, "type": "function",
                                             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
            if not calls:
                rubric.parse_errors += 1
                messages.append({"role": "user", "content": NO_TOOL_CALL})
            as_sent = [SimpleNamespace(function=SimpleNamespace(name=c.name, arguments=c.arguments)) for c in calls]
            for call, outcome in zip(calls, call_tools(inbox, as_sent)):
                record_outcome(rubric, outcome, gold)
                if outcome.name == "return_final_answer" and outcome.error is None:
                    final = outcome.arguments
                messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome.content})
            if final is not None:
                break
        rubric.ran_out_of_turns = int(final is None and rubric.num_turns >= data.max_turns)
        answer, sources = (final["answer"], final["sources"]) if final else (None, [])
        return rubric, answer, sources, messages

    def episode(self) -> Episode:
        """The project's Episode: this task's limits, scored as the config says (one judge per task object)."""
        if getattr(self, "_episode", None) is None:
            config = self.config
            mode, judge = grading.configure(config.reward, config.judge_model, config.judge_base_url, JUDGE_CACHE)
            self._episode = Episode(max_turns=self.data.max_turns, max_body_chars=self.data.max_body_chars,
                                    search_results=self.data.search_results, reward=mode, judge=judge,
                                    hallucination_penalty=config.hallucination_penalty,
                                    grounded_answers=config.grounded_answers)
        return self._episode


def _json_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments or "{}"), dict)
    except ValueError:
        return False


class EmailInboxConfig(vf.TasksetConfig):
    """Which questions, and the episode's limits (`--env.taskset.*`). A limit left unset is the trained
    run's (`run`), else the project's default."""

    db: str = "data/demo.db"
    """The database (build-db builds it; generate-questions writes questions into it)."""
    split: str = "test"
    """The question split."""
    seed: int | None = 0
    """Question order: shuffled with this seed as the evaluation's --seed does (None: by id), so `-n 50` plays
    the questions `test_email_search_agent.py --limit 50` plays."""
    single_source: bool = False
    """Only questions with one gold email."""
    run: str | None = None
    """A trained run (its name under .art, or its folder): the episode limits it was trained with."""
    max_turns: int | None = None
    """Agent turns per question (default 10)."""
    max_tokens: int | None = None
    """Tokens per model reply (default 1024); EmailInboxEnv sets the agent's sampling to it."""
    max_body_chars: int | None = None
    """read_email cuts longer bodies (default 4000)."""
    search_results: int | None = None
    """Results per search when the model does not ask for a number (default 10)."""
    task: EmailTaskConfig = EmailTaskConfig()

    @model_validator(mode="after")
    def _questions_to_play(self) -> EmailInboxConfig:
        """A database, a split or a run that is not there: one sentence when the config is read, as verifiers
        shows a bad config, not a traceback when the tasks are loaded. verifiers also builds this config with
        its id alone, as the default of its CLI's field, before the flags are applied: that one is left unchecked,
        or a missing data/demo.db would refuse `--env.taskset.db` pointing elsewhere."""
        if not self.model_fields_set - {"id"}:
            return self
        try:
            self.questions()[0].close()
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return self

    def questions(self) -> tuple[EmailDB, list[Question], Episode]:
        """The database, the questions to play and the episode's limits; a UserError if there are none."""
        limits = self.limits()
        db = EmailDB(self.db)  # one sentence if there is none: build it with build-db
        questions = select_questions(db, self.split, single_source=self.single_source, seed=self.seed)
        if not questions:
            raise UserError(no_questions(db, self.split))
        return db, questions, limits

    def limits(self) -> Episode:
        """The episode's limits: these fields over the run's over the project's defaults."""
        base = Episode()
        if self.run:
            run = find_run(self.run)
            if run is None:
                raise UserError(f"no trained run {self.run!r} (a name under .art, or a run's folder)")
            base = run.limits
        return base.override(max_turns=self.max_turns, max_tokens=self.max_tokens,
                             max_body_chars=self.max_body_chars, search_results=self.search_results)


class EmailInboxTaskset(vf.Taskset[EmailTask, EmailInboxConfig]):
    def load(self) -> list[EmailTask]:
        config = self.config
        try:
            db, questions, limits = config.questions()
        except UserError as exc:  # the config left unchecked above (no flag given): still one sentence
            raise SystemExit(f"error: {exc}") from None
        db.close()
        task_config = config.task
        grading.configure(task_config.reward, task_config.judge_model, task_config.judge_base_url, JUDGE_CACHE)
        return [EmailTask(EmailTaskData(
            id=str(q.id), name=f"{q.inbox_address} {q.query_date}", prompt=q.question,
            system_prompt=first_messages(q, limits)[0]["content"],
            question_id=q.id, question=q.question, answer=q.answer, message_ids=q.message_ids,
            inbox_address=q.inbox_address, query_date=q.query_date, split=q.split, db=str(db.path.resolve()),
            max_turns=limits.max_turns, max_body_chars=limits.max_body_chars, search_results=limits.search_results),
            task_config) for q in questions]


def no_questions(db: EmailDB, split: str) -> str:
    """Why a database has no question to play in `split`, and the command that writes some."""
    counts = question_counts(db)
    if counts and split not in counts:
        return f"{db.path} has no {split!r} questions; its splits are {', '.join(sorted(counts))}"
    return (f"{db.path} has no answerable {split!r} questions; write some with `python train_email_search_agent.py "
            f"generate-questions --db {db.path} --model MODEL`")


# ---- the environment: the taskset played with the plain-chat harness, here, within the episode's limits ----
class EmailInboxEnvConfig(vf.SingleAgentEnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig())
    """The one seat: verifiers' plain-chat harness (the model's replies and the tools, nothing else), in a
    process on this machine; its reply length is the episode's (`--env.taskset.max-tokens`)."""

    @model_validator(mode="after")
    def _episode_reply_length(self) -> EmailInboxEnvConfig:
        taskset = self.taskset
        if isinstance(taskset, EmailInboxConfig):
            max_tokens = taskset.limits().max_tokens
            sampling = (self.agent.sampling or vf.SamplingConfig()).model_copy(update={"max_tokens": max_tokens})
            self.agent = self.agent.model_copy(update={"sampling": sampling})
        return self


class EmailInboxEnv(vf.Env[EmailInboxEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)
