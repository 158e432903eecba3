"""`serve`: a trained agent, and its own search and read tools, as an MCP server for assistants.

Owns: which inboxes a client may touch (`Scope`), the three MCP tools (`ask_inbox`, answered by one rollout
as `ask` plays it; `search_inbox` and `read_email`, the agent's tools for a model that prefers to search
itself), and the transports: stdio, or streamable HTTP on loopback unless a bearer token guards it. The model
is served once at start and shared by every request; the CPU backend batches concurrent requests.
Every bad request is a tool error (an isError result), never a crash.
"""

import argparse
import contextlib
import hmac
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Annotated, Any

from email_agent.apps import ask
from email_agent.models import opened
from email_agent.models.servers import Servers
from email_agent.agent import tools
from email_agent.runs import ART_DIR
from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB

log = logging.getLogger(__name__)

MAX_QUESTION_CHARS = 2000  # a question, not a document: longer ones are refused before the model sees them
TOKEN_ENV = "EMAIL_AGENT_MCP_TOKEN"  # --token's default: a token on a command line is visible in `ps`


@dataclass
class Settings:
    """What `serve` serves and how; the CLI fills it from its flags."""

    model: str | None  # --model (None: the most recent run)
    db: str | None  # None: the run's own database, else default_db
    default_db: str
    inboxes: list[str]  # empty: every inbox of the database
    options: opened.Options
    grounded_answers: bool = True
    http: str | None = None  # HOST:PORT for streamable HTTP; None: stdio
    token: str | None = None


@dataclass
class Scope:
    """The inboxes a client may touch: a request for any other is refused, not served."""

    db: EmailDB
    allowed: tuple[str, ...]  # lowercased addresses; empty: every inbox of the database

    def inbox(self, requested: str | None) -> str:
        """The inbox a tool call may use, or a ToolError that says which it may."""
        # here, not at the top: mcp takes ~0.5 s to import (pydantic, starlette), and this module loads for --help
        from mcp.server.mcpserver.exceptions import ToolError

        if requested is None or not requested.strip():
            if len(self.allowed) == 1:
                return self.allowed[0]
            raise ToolError("give `inbox`: the email address whose mail to use" +
                            (f" (one of {', '.join(self.allowed)})" if self.allowed else "") + ".")
        address = requested.strip().lower()
        if self.allowed and address not in self.allowed:
            raise ToolError(f"inbox {address!r} is not one this server may use; it allows {', '.join(self.allowed)}.")
        try:
            self.db.require_inbox(address)
        except UserError as exc:
            raise ToolError(str(exc)) from None
        return address


def parse_http(value: str) -> tuple[str, int]:
    """--http HOST:PORT (PORT alone: 127.0.0.1; [::1]:PORT for IPv6) -> (host, port), or a UserError."""
    host, colon, port = value.rpartition(":")
    host = host.strip("[]") if colon else ""
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--http takes HOST:PORT such as 127.0.0.1:8765, not {value!r}")
    return host or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_settings(settings: Settings) -> None:
    """What can be refused before the model loads: a bind others can reach without a token, a stray token."""
    if settings.http is None:
        if settings.token:
            raise UserError("--token guards the HTTP transport; give --http HOST:PORT too (stdio needs no token)")
        return
    host, _ = parse_http(settings.http)
    if not is_loopback(host) and not settings.token:
        raise UserError(f"--http {settings.http} is reachable from other machines: give --token (or set {TOKEN_ENV}) "
                        f"so that only clients with it are served, or bind 127.0.0.1")


def make_server(opened_model: opened.OpenedModel, scope: Scope, grounded_answers: bool, ready: bool = True):
    """The MCP server with its three tools. `ready`: the model answered the probe at start (else each
    ask_inbox probes it again first, so a model that is down is one clear tool error per request)."""
    # here, not at the top: mcp takes ~0.5 s to import (pydantic, starlette), and this module loads for --help
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("email-search-agent", instructions=(
        "Answers questions about an email inbox. ask_inbox: a trained agent searches the inbox and answers with "
        "the emails it cites. search_inbox and read_email: search and read the inbox yourself."))
    add_ask_tool(server, opened_model, scope, grounded_answers, ready)
    add_inbox_tools(server, scope, opened_model.limits)
    return server


def tool_arguments():
    """The tools' shared arguments, as the client's model reads them: (inbox, as_of)."""
    # here, not at the top: pydantic, for the schemas; annotations are evaluated here, at definition (this module
    # has no `from __future__ import annotations`), so the CLI need not import pydantic to start
    from pydantic import Field

    inbox = Annotated[str | None, Field(description="the email address whose mail (sent or received) to use; may "
                                                    "be left out when the server allows one inbox only")]
    as_of = Annotated[str | None, Field(description="YYYY-MM-DD: the day it is asked; mail sent later is hidden "
                                                    "(default: today)")]
    return inbox, as_of


def add_ask_tool(server, opened_model: opened.OpenedModel, scope: Scope, grounded_answers: bool, ready: bool) -> None:
    """`ask_inbox`: one rollout of the served agent, as `ask` plays it."""
    # here, not at the top: mcp takes ~0.5 s to import (pydantic, starlette), and this module loads for --help
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import Field

    InboxArg, AsOfArg = tool_arguments()

    @server.tool(description="Ask the trained email agent a question about one inbox. It searches and reads the "
                             "mail itself and returns its answer, the emails it cites (message_id, date, from, "
                             "subject) and the turns it took." + (" An answer that names something found in no email "
                                                                  "it saw is withheld (\"I don't know\")."
                                                                  if grounded_answers else ""))
    async def ask_inbox(question: Annotated[str, Field(description="the question, in plain words")],
                        inbox: InboxArg = None, as_of: AsOfArg = None) -> dict[str, Any]:
        if len(question) > MAX_QUESTION_CHARS:
            raise ToolError(f"the question is {len(question)} characters; ask one of at most {MAX_QUESTION_CHARS}.")
        nonlocal ready
        try:
            asked = ask.adhoc_question(scope.db, question, scope.inbox(inbox), tool_day(as_of))
            if not ready:
                await opened.probe(opened_model)
                ready = True
            result = await ask.answer_question(opened_model, asked, scope.db, grounded_answers)
        except UserError as exc:
            raise ToolError(str(exc)) from None
        return result.to_json()


def add_inbox_tools(server, scope: Scope, limits) -> None:
    """`search_inbox` and `read_email`: the agent's own tools, on the inbox and day a client asks for."""
    # here, not at the top: mcp takes ~0.5 s to import (pydantic, starlette), and this module loads for --help
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import Field

    InboxArg, AsOfArg = tool_arguments()

    def tool_inbox(inbox: str | None, as_of: str | None) -> tools.Inbox:
        return tools.Inbox(scope.db, scope.inbox(inbox), tool_day(as_of), limits.max_body_chars, limits.search_results)

    @server.tool()
    async def search_inbox(
            keywords: Annotated[list[str], Field(description='all must match, e.g. ["budget", "review"]')],
            inbox: InboxArg = None,
            from_address: Annotated[str | None, Field(description="only emails from this address")] = None,
            to_address: Annotated[str | None, Field(description="only emails to/cc/bcc this address")] = None,
            sent_after: Annotated[str | None, Field(description="YYYY-MM-DD, inclusive")] = None,
            sent_before: Annotated[str | None, Field(description="YYYY-MM-DD, exclusive")] = None,
            max_results: Annotated[int | None, Field(description="1-20 (default: as the agent searches)")] = None,
            as_of: AsOfArg = None) -> dict[str, Any]:
        """Search one inbox for emails containing ALL the keywords, best match first: the agent's own search.
        Returns {"results": [...]}: message_id, subject, from_address, date and a snippet of each."""
        arguments = dict(keywords=keywords, from_address=from_address, to_address=to_address,
                         sent_after=sent_after, sent_before=sent_before, max_results=max_results)
        outcome = tools.call_tool(tool_inbox(inbox, as_of), "search_inbox", arguments)
        if outcome.error:
            raise ToolError(outcome.content.removeprefix("Error: "))
        return {"results": outcome.result}

    @server.tool()
    async def read_email(message_id: Annotated[str, Field(description="a message_id from search_inbox")],
                         inbox: InboxArg = None, as_of: AsOfArg = None) -> dict[str, Any]:
        """Read one email of the inbox in full (headers, recipients, body): the agent's own read."""
        mailbox = tool_inbox(inbox, as_of)
        outcome = tools.call_tool(mailbox, "read_email", {"message_id": message_id})
        if outcome.error:
            raise ToolError(outcome.content.removeprefix("Error: "))
        if outcome.result is None:  # the same words whether it is another inbox's or no email at all
            raise ToolError(f"no email with message_id {message_id!r} in {mailbox.address}'s inbox as of "
                            f"{mailbox.query_date}; use an id from search_inbox.")
        return outcome.result


def tool_day(as_of: str | None) -> str:
    """The day a tool call is asked, as `ask` reads --as-of; a ToolError if malformed."""
    # here, not at the top: mcp takes ~0.5 s to import (pydantic, starlette), and this module loads for --help
    from mcp.server.mcpserver.exceptions import ToolError

    try:
        return ask.query_day(as_of, "as_of")
    except UserError as exc:
        raise ToolError(str(exc)) from None


def bearer_guard(app, token: str):
    """ASGI middleware: an HTTP request without `Authorization: Bearer <token>` gets 401 (compared in constant
    time; the token is never logged)."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body",
                            "body": b'{"error": "missing or wrong bearer token (Authorization: Bearer ...)"}'})
                return
        await app(scope, receive, send)

    return guarded


def log_libraries() -> None:
    """The SDK's and uvicorn's warnings as `[logger] message` lines on stderr. Without a root handler the SDK
    installs its own at INFO, which repeats the package's lines and adds one per HTTP request and session."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.addFilter(lambda record: not record.name.startswith("email_agent"))  # the package has its own
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        root.addHandler(handler)


async def serve(settings: Settings) -> None:
    """Open the model once, then serve MCP requests until interrupted."""
    check_settings(settings)
    log_libraries()
    spec, db = ask.model_and_db(settings.model, settings.db, settings.options.art_dir, settings.default_db)
    allowed = tuple(dict.fromkeys(address.strip().lower() for address in settings.inboxes))
    for address in allowed:
        db.require_inbox(address)
    if not allowed:
        log.warning("no --inbox given: any client may search and read every inbox of %s; pass --inbox ADDRESS "
                    "(repeatable) to allow only those", db.path)
    scope = Scope(db, allowed)
    async with contextlib.AsyncExitStack() as stack:
        listening = None if settings.http is None else stack.enter_context(listen(*parse_http(settings.http)))
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the stdio transport's: nothing else may write there
            opened_model = await opened.open_model(spec, Servers(settings.options, stack))
        ready = True
        try:
            await opened.probe(opened_model)
        except UserError as exc:
            ready = False
            log.warning("%s (ask_inbox fails until it answers; search_inbox and read_email work)", exc)
        server = make_server(opened_model, scope, settings.grounded_answers, ready)
        log.info("serving %s (%s) for %s of %s", opened_model.label, opened_model.limits.describe(),
                 ", ".join(allowed) or "every inbox", db.path)
        if settings.http is None:
            await server.run_stdio_async()
        else:
            await serve_http(server, listening, settings.token)


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the model loads: a port in use is a one-sentence error at once."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def serve_http(server, sock: socket.socket, token: str | None) -> None:
    # here, not at the top: a third-party server for --http alone, and this module loads for --help
    import uvicorn

    host, port = sock.getsockname()[:2]
    log.info("streamable HTTP at http://%s:%d/mcp%s", f"[{host}]" if ":" in host else host, port,
             " (bearer token required)" if token else "")
    app = server.streamable_http_app(host=host)
    if token:
        app = bearer_guard(app, token)
    # log_config=None: uvicorn's errors go through the handler of `log_libraries`, not a format of its own
    await uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning")).serve(sockets=[sock])


def add_arguments(p, default_db: str) -> None:
    """The serve subcommand's flags."""
    p.add_argument("--inbox", action="append", default=[], metavar="ADDRESS",
                   help="an inbox clients may use (repeatable); any other is refused. Default: every inbox of the "
                        "database, with a warning")
    ask.add_model_arguments(p, default_db)
    p.add_argument("--grounded-answers", action=argparse.BooleanOptionalAction, default=True,
                   help="withhold an answer that names something in no email or search result the agent saw "
                        "(default: on)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N",
                   help="questions answered at once (the CPU server's batch; default 8)")
    p.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP at http://HOST:PORT/mcp instead of "
                                                       "stdio; a HOST other than loopback needs --token")
    p.add_argument("--token", help=f"bearer token HTTP clients must send (default: ${TOKEN_ENV})")
    p.add_argument("--art-dir", default=ART_DIR, help=f"where runs live (default {ART_DIR})")


def settings_from_args(args, default_db: str) -> Settings:
    for flag in ("max_turns", "max_tokens", "concurrency"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    options = opened.Options(art_dir=args.art_dir, base_url=args.base_url, api_key=args.api_key,
                                 concurrency=args.concurrency,
                                 limits={"max_turns": args.max_turns, "max_tokens": args.max_tokens})
    return Settings(args.model, args.db, default_db, args.inbox, options, args.grounded_answers, args.http,
                    args.token or os.environ.get(TOKEN_ENV) or None)
