"""`ask`: one question of the user's own to an agent, about one inbox, outside any question set.

Owns: the ad-hoc question (whose inbox, and which day is "today"), the model to ask (the most recent run by
default) and its database, one rollout through the same `rollout` that training and evaluation play, the
one-line description of each tool call that the CLI shows as it happens, and the answer with its cited
emails. There is no gold answer, so nothing is graded.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from datetime import date
from typing import Callable

from email_agent.models import opened
from email_agent.models.servers import Servers
from email_agent.agent.episode import Episode
from email_agent import runs
from email_agent.cli import add_db_flags
from email_agent.runs import ART_DIR
from email_agent.errors import UserError
from email_agent.data.email_db import Email, EmailDB, check_day, day_after
from email_agent.data.questions import Question


def adhoc_question(db: EmailDB, text: str, inbox: str, as_of: str | None) -> Question:
    """A question asked with `ask`: no gold answer or emails, so the rollout grades nothing."""
    if not text.strip():
        raise UserError("the question is empty.")
    db.require_inbox(inbox)
    return Question("ask", text.strip(), "", [], None, inbox.strip().lower(), query_day(as_of), "ask")


def query_day(as_of: str | None, name: str = "--as-of") -> str:
    """The agent's today: `as_of`, else today. A malformed date (even '') is a one-sentence error naming `name`;
    a timestamp counts as its day, as the prompt says."""
    return date.today().isoformat() if as_of is None else check_day(name, as_of).strip()[:10]


def model_and_db(spec: str | None, db_path: str | None, art_dir: str, default_db: str) -> tuple[str, EmailDB]:
    """The --model to ask (the most recent run when none is given) and the database: --db, else the one the
    run was trained on, else the default."""
    spec = spec or str(runs.latest_run(art_dir).path)
    return spec, EmailDB(db_path or runs.trained_db([spec], art_dir) or default_db)


@dataclass
class Answer:
    model: str  # the opened model's label, e.g. demo@5
    limits: str  # the episode limits it played with, described
    question: Question
    answer: str | None  # None: no final answer within the turns
    sources: list[str]
    cited: list[tuple[str, Email | None]]  # None where the cited id is not an email of this inbox
    turns: int
    ran_out_of_turns: bool
    tool_calls: list[dict] = field(default_factory=list)
    withheld: dict | None = None  # the answer the grounding check withheld: answer, sources, unseen

    def to_json(self) -> dict:
        return {"model": self.model, "question": self.question.question, "inbox": self.question.inbox_address,
                "as_of": self.question.query_date, "answer": self.answer, "sources": self.sources,
                "cited": [{"message_id": mid, "date": e.date, "from": e.from_address, "subject": e.subject}
                          for mid, e in self.cited if e is not None],
                "turns": self.turns, "tool_calls": self.tool_calls, "ran_out_of_turns": self.ran_out_of_turns,
                "withheld": self.withheld}


async def ask(spec: str, question: Question, db: EmailDB, options: opened.Options,
              on_call: Callable | None = None, on_start: Callable | None = None,
              grounded_answers: bool = False) -> Answer:
    """Serve and probe the model, play one rollout; `on_call(name, arguments, outcome)` sees each tool call as
    it happens and `on_start(label, limits)` is called once the model answers the probe. `grounded_answers`:
    see `grading.withhold_ungrounded`."""
    async with contextlib.AsyncExitStack() as stack:
        opened_model = await opened.open_model(spec, Servers(options, stack))
        await opened.probe(opened_model)
        if on_start:
            on_start(opened_model.label, opened_model.limits.describe())
        return await answer_question(opened_model, question, db, grounded_answers, on_call)


async def answer_question(opened_model: opened.OpenedModel, question: Question, db: EmailDB,
                          grounded_answers: bool = False, on_call: Callable | None = None) -> Answer:
    """One rollout of an opened model (served once, asked many times by `serve`), with its episode limits."""
    # here, not at the top: rollout imports ART (torch, seconds), and this module loads for every subcommand and --help
    from email_agent.agent.rollout import rollout

    calls: list[dict] = []

    def record(name, arguments, outcome):
        calls.append({"tool": name, "arguments": arguments,
                      "error": outcome.content if outcome and outcome.error else None})
        if on_call:
            on_call(name, arguments, outcome)

    config = opened_model.episode(Episode(grounded_answers=grounded_answers))
    traj = await rollout(opened_model.policy, question, db, config, on_call=record)
    if traj.metadata.get("error"):
        raise UserError(f"{opened_model.label} failed: {traj.metadata['error']}")
    sources = json.loads(traj.metadata["sources"])
    visible = day_after(question.query_date)
    cited = [(mid, db.read(mid, inbox=question.inbox_address, visible_until=visible)) for mid in sources]
    return Answer(opened_model.label, opened_model.limits.describe(), question, traj.metadata.get("answer"), sources,
                  cited, traj.metrics["num_turns"], bool(traj.metrics["ran_out_of_turns"]), calls,
                  json.loads(traj.metadata["withheld"]) if traj.metadata.get("withheld") else None)


def describe_call(name, arguments, outcome) -> str:
    """One line per action of the agent (two with its result), as `ask` shows it live."""
    if name is None:
        return f"  (no tool call) {' '.join(str(arguments or '').split())[:100]}"
    shown = f"> {name} {' '.join(str(arguments).split())[:120]}"
    if outcome.error:
        return f"{shown}\n    {outcome.content[:160]}"
    if name == "search_inbox":
        hits = "; ".join(f"{r['date'][:10]} {r['subject'][:40]}" for r in outcome.result[:3])
        return f"{shown}\n    {len(outcome.result)} result(s){': ' + hits if hits else ''}"
    if name == "read_email":
        email = outcome.result
        return f"{shown}\n    " + (f"{email['date'][:16]}  {email['from_address']}  {email['subject'][:60]}"
                                    if email else "not found in this inbox")
    return shown


def answer_text(result: Answer) -> str:
    """The answer for a person: what it is, what it withheld, and each cited email (or that it made one up)."""
    if result.answer is None:
        return f"no answer after {result.turns} turns (raise --max-turns, or try another model)"
    lines = [f"\nanswer: {result.answer}"]
    if result.withheld:
        lines.append(f"  (withheld {result.withheld['answer']!r}: {', '.join(result.withheld['unseen'])} in no email "
                     f"or search result it saw)")
    lines += [f"  {email.date}  {email.from_address}  {email.subject}  {mid}" if email else
              f"  {mid}  (not an email in this inbox: the model made it up)" for mid, email in result.cited]
    return "\n".join(lines)


def add_arguments(p, default_db: str) -> None:
    """The ask subcommand's flags."""
    p.add_argument("question", metavar="QUESTION")
    p.add_argument("--inbox", required=True, metavar="ADDRESS", help="whose mail (sent or received) to search")
    p.add_argument("--as-of", metavar="DATE", help="the agent's today: mail dated later is hidden (default: today)")
    add_model_arguments(p, default_db)
    p.add_argument("--grounded-answers", action="store_true",
                   help="withhold an answer that names something (a word with a capital or a digit) in no email or "
                        "search result the agent saw: it says \"I don't know\" and shows what it withheld")
    p.add_argument("--art-dir", default=ART_DIR, help=f"where runs live (default {ART_DIR})")
    p.add_argument("--json", action="store_true", help="print one JSON object: answer, sources, turns, tool_calls, ...")


def add_model_arguments(p, default_db: str) -> None:
    """Which model answers, on which database, with which episode limits: the flags `ask` and `serve` share."""
    add_db_flags(p, None, f"database (default: the run's own, else {default_db})")
    p.add_argument("--model", metavar="SPEC", help="RUN[@STEP] (default: the most recent run), base, or a "
                                                   "provider/model such as openai/o4-mini or hosted_vllm/NAME")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for a provider/model")
    p.add_argument("--api-key", help="key for --base-url (default: OPENAI_API_KEY for openai/, else POLICY_API_KEY)")
    p.add_argument("--max-turns", type=int, metavar="N", help="agent turns (default: what the run was trained with)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="tokens per reply (default: what the run was trained "
                                                               "with)")
