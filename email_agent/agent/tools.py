"""The agent's tools: what the model may call, their OpenAI schemas, and argument checking.

Owns: `Inbox` (one address's mail as of one day: the environment binds both, the model chooses neither),
the tools `search_inbox` / `read_email` / `return_final_answer` (each a `Tool`: its schema, an example and what
running it shows the model, side by side at the end of this module; adding one: docs/development.md), and all
dispatch of tool calls:
`call_tools` runs a turn's calls (the first; any more are refused), `call_tool` one call, turning anything a
model can emit (unknown name, non-JSON arguments, wrong or extra keys, wrong types) into either a result or a
one-sentence error the model can recover from. It never raises for model input. It knows nothing about
rewards or training; the rollout records what each call did.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable

from email_agent.data.email_db import MAX_SEARCH_RESULTS, EmailDB, day_after, day_start

DEFAULT_MAX_BODY_CHARS = 4000  # long bodies (up to 380k chars in Enron) would overflow the context
DEFAULT_SEARCH_RESULTS = 10  # results per search when the model does not ask for a number

@dataclass
class Inbox:
    """One user's mailbox as of the question's day: search and read never see other inboxes or later mail."""

    db: EmailDB
    address: str
    query_date: str  # 'YYYY-MM-DD'; mail dated after this day is invisible
    max_body_chars: int = DEFAULT_MAX_BODY_CHARS
    # when the model does not say; fewer results mean shorter contexts
    default_max_results: int = DEFAULT_SEARCH_RESULTS

    def __post_init__(self):
        self.visible_until = day_after(self.query_date)

    def search_inbox(self, keywords: list[str], from_address: str | None = None, to_address: str | None = None,
                     sent_after: str | None = None, sent_before: str | None = None,
                     max_results: int | None = None) -> list[dict]:
        results = self.db.search(self.address, keywords, from_address=from_address, to_address=to_address,
                                 sent_after=sent_after, sent_before=sent_before, visible_until=self.visible_until,
                                 max_results=max_results or self.default_max_results)
        return [asdict(r) for r in results]

    def read_email(self, message_id: str) -> dict | None:
        email = self.db.read(message_id, inbox=self.address, visible_until=self.visible_until)
        if email is None:
            return None
        # Empty cc/bcc lists and the source file name tell the model nothing and cost tokens in every read.
        record = {key: value for key, value in asdict(email).items() if key != "file_name" and value != []}
        body = record["body"]
        if len(body) > self.max_body_chars:
            record["body"] = (body[:self.max_body_chars]
                              + f"\n[... {len(body) - self.max_body_chars} more characters cut]")
        return record


@dataclass
class ToolOutcome:
    """What one tool call produced. `error` is the kind of mistake, None for a good call."""

    name: str
    content: str  # what the model is shown as the tool result
    error: str | None = None  # "bad_tool_name" | "bad_tool_args" | "extra_tool_call"
    arguments: dict | None = None  # parsed arguments of a good call
    result: object = None  # search results (list) or the email (dict or None) of a good call


def parse_arguments(name: str, raw: str | dict | None) -> dict:
    """Raw tool-call arguments -> a checked dict for tool `name`. ValueError with a helpful sentence otherwise."""
    if isinstance(raw, dict):
        args = raw
    else:
        try:
            args = json.loads(raw or "{}")
        except (json.JSONDecodeError, TypeError):
            raise ValueError(f"the arguments of {name} are not valid JSON; send a JSON object like "
                             f"{_example(name)}") from None
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of {name} must be a JSON object like {_example(name)}")
    spec = AGENT_TOOLS[name].parameters
    unknown = sorted(set(args) - set(spec["properties"]))
    if unknown:
        raise ValueError(f"{name} has no argument {', '.join(map(repr, unknown))}; its arguments are "
                         f"{', '.join(spec['properties'])}")
    missing = [key for key in spec["required"] if args.get(key) is None]
    if missing:
        raise ValueError(f"{name} needs {', '.join(map(repr, missing))}; e.g. {_example(name)}")
    for key, value in args.items():
        if value is None:
            continue
        kind = spec["properties"][key]["type"]
        ok = {"string": isinstance(value, str),
              "integer": isinstance(value, int) and not isinstance(value, bool),
              "array": isinstance(value, list) and all(isinstance(v, str) for v in value)}[kind]
        if not ok:
            wanted = {"string": "a string", "integer": "an integer", "array": "a list of strings"}[kind]
            raise ValueError(f"{name}: {key!r} must be {wanted}")
    for key in ("sent_after", "sent_before"):
        if args.get(key):
            try:
                day_start(args[key])
            except ValueError:
                raise ValueError(f"{name}: {key!r} must be a date like 2001-05-31, not {args[key]!r}") from None
    if name == "search_inbox" and not any(str(k).strip() for k in args["keywords"]):
        raise ValueError("search_inbox needs at least one non-empty keyword")
    return {k: v for k, v in args.items() if v is not None}


def _example(name: str) -> str:
    return AGENT_TOOLS[name].example


# What the model is told when it replies without a tool call, or makes more than one in a turn.
NO_TOOL_CALL = "Error: reply with a tool call (search_inbox, read_email or return_final_answer), not plain text."
EXTRA_TOOL_CALL = "Error: only the first tool call of a turn is run; make one call per turn."


def call_tools(inbox: Inbox, calls: list) -> list[ToolOutcome]:
    """A turn's tool calls (a reply's `tool_calls`), one outcome each: the first is run, any more are refused
    (one action per turn keeps episodes comparable; the model is told why)."""
    return [call_tool(inbox, call.function.name, call.function.arguments) if index == 0 else
            ToolOutcome(call.function.name, EXTRA_TOOL_CALL, "extra_tool_call") for index, call in enumerate(calls)]


def call_tool(inbox: Inbox, name: str, raw_arguments: str | dict | None) -> ToolOutcome:
    """Run one tool as the model asked. return_final_answer only checks its arguments: the answer is in the
    outcome's `arguments`, and the episode ends."""
    tool = AGENT_TOOLS.get(name)
    if tool is None:
        return ToolOutcome(name, f"Error: there is no tool {name!r}; the tools are {', '.join(AGENT_TOOLS)}.",
                           "bad_tool_name")
    try:
        args = parse_arguments(name, raw_arguments)
    except ValueError as exc:
        return ToolOutcome(name, f"Error: {exc}.", "bad_tool_args")
    content, result = tool.run(inbox, args)
    return ToolOutcome(name, content, None, args, result)


# ----------------------------------------------------------------------------------------------
# The tools: each one's schema (the model reads it in every prompt), an example of its arguments (told with an
# argument error) and what running it shows the model, with what the rollout records
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    name: str
    description: str  # terse on purpose: the schemas are in every prompt, and on a CPU every token costs
    parameters: dict  # JSON schema of its arguments (parse_arguments checks calls against it)
    example: str  # its arguments as the model should send them
    run: Callable[[Inbox, dict], tuple[str, object]]  # (inbox, checked arguments) -> (shown to the model, recorded)

    def schema(self) -> dict:
        """The OpenAI tool schema the model is given."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _search(inbox: Inbox, args: dict) -> tuple[str, list[dict]]:
    results = inbox.search_inbox(**args)
    if not results:
        return "No emails matched all the keywords. Try fewer, shorter or different keywords.", results
    return json.dumps(results, ensure_ascii=False), results


def _read(inbox: Inbox, args: dict) -> tuple[str, dict | None]:
    email = inbox.read_email(args["message_id"])
    if email is None:
        return (f"Error: no email with message_id {args['message_id']!r} in this inbox. Use an id from "
                f"search_inbox."), None
    return json.dumps(email, ensure_ascii=False), email


def _answer(inbox: Inbox, args: dict) -> tuple[str, None]:
    return "Answer recorded.", None  # the rollout ends the episode with `args` as the answer


AGENT_TOOLS = {tool.name: tool for tool in (
    Tool("search_inbox",
         "Search the user's inbox for emails containing ALL the keywords, best match first. "
         "Returns message_id, subject, from_address, date and a snippet of each.",
         {"type": "object", "properties": {
             "keywords": {"type": "array", "items": {"type": "string"}, "description": "e.g. [\"budget\", \"review\"]"},
             "from_address": {"type": "string", "description": "only emails from this address"},
             "to_address": {"type": "string", "description": "only emails to/cc/bcc this address"},
             "sent_after": {"type": "string", "description": "YYYY-MM-DD, inclusive"},
             "sent_before": {"type": "string", "description": "YYYY-MM-DD, exclusive"},
             "max_results": {"type": "integer", "description": f"1-{MAX_SEARCH_RESULTS}"},
         }, "required": ["keywords"]},
         '{"keywords": ["budget", "meeting"]}', _search),
    Tool("read_email", "Read one email in full by the message_id a search returned.",
         {"type": "object", "properties": {"message_id": {"type": "string"}}, "required": ["message_id"]},
         '{"message_id": "<id from search_inbox>"}', _read),
    Tool("return_final_answer",
         "Give the final, short answer and the message_ids it comes from. "
         "If the inbox does not say, answer \"I don't know\" with no sources.",
         {"type": "object", "properties": {"answer": {"type": "string"}, "sources": {"type": "array", "items": {
             "type": "string"}}}, "required": ["answer", "sources"]},
         '{"answer": "...", "sources": ["<message_id>"]}', _answer),
)}
TOOLS = [tool.schema() for tool in AGENT_TOOLS.values()]  # what every prompt offers, in this order
