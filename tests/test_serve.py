"""`train_email_search_agent.py serve`: the agent and its tools over MCP, driven by the SDK's own clients (stdio and
streamable HTTP) against the demo inbox, with a scripted policy standing in for the model (and one slow test with
the real CPU model)."""

import contextlib
import json
import re
import socket
import subprocess
import sys
import time

import anyio
import httpx
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from conftest import ROOT
from email_agent.data import questions as qmod
from scripted_server import call, expert_script, serve_in_thread

import train_email_search_agent as cli

TOKEN = "s3cret-test-token"


@pytest.fixture(scope="module")
def q(demo_db):
    return qmod.select_questions(demo_db, "test", seed=0, limit=1)[0]


@pytest.fixture(scope="module")
def other_inbox_email(demo_db, q):
    """An email neither sent nor received by q's inbox."""
    row = demo_db.conn.execute("SELECT e.message_id FROM emails e WHERE NOT EXISTS (SELECT 1 FROM mailbox m WHERE "
                               "m.email_id = e.id AND m.address = ?) LIMIT 1", (q.inbox_address,)).fetchone()
    return row[0]


def serve_argv(db, inbox, base_url, art_dir, *more):
    return [sys.executable, "train_email_search_agent.py", "serve", "--db", str(db), "--model", "hosted_vllm/x",
            "--base-url", base_url, "--art-dir", str(art_dir), *(["--inbox", inbox] if inbox else []), *more]


@contextlib.asynccontextmanager
async def over_stdio(argv, stderr_path):
    params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(ROOT))
    with open(stderr_path, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


@contextlib.asynccontextmanager
async def over_http(url, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=60)) as http, \
            streamable_http_client(url, http_client=http) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def result_json(result):
    assert not result.is_error, result.content[0].text
    assert result.structured_content == json.loads(result.content[0].text)  # structured, and as text for older clients
    return result.structured_content


def error_text(result) -> str:
    """The message of a tool error, after the SDK's "Error executing tool NAME: "."""
    assert result.is_error, result
    return re.sub(r"^Error executing tool \w+: ", "", result.content[0].text)


@pytest.fixture(scope="module")
def scripts(q):
    """The scripted policy: the expert for q, an invented answer, and two slow questions to see requests overlap."""
    arrived = {}

    def slow(name):
        def reply(body):
            arrived[name] = time.monotonic()
            return {"sleep": 2.0, **call("return_final_answer", {"answer": name, "sources": []})}
        return reply

    return {q.question: expert_script(q), "Who won the bake-off?": expert_script(q, answer="Bittern 77Z"),
            "slow one?": slow("one"), "slow two?": slow("two"), "_arrived": arrived}


@pytest.fixture(scope="module")
def policy(scripts):
    with serve_in_thread(scripts) as server:
        yield server


@pytest.fixture(scope="module")
def http_server(demo_db_path, q, policy, tmp_path_factory):
    """The server over HTTP on loopback, with a token, allowed q's inbox only."""
    port = free_port()
    argv = serve_argv(demo_db_path, q.inbox_address, policy.base_url, tmp_path_factory.mktemp("art"),
                      "--http", f"127.0.0.1:{port}", "--token", TOKEN)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp", log
    finally:
        process.terminate()
        process.wait(20)
    assert TOKEN not in log.read_text()  # the token is never logged


def test_over_stdio_list_ask_search_read(demo_db, demo_db_path, q, policy, tmp_path):
    gold = demo_db.read(q.message_ids[0])

    async def session_calls():
        argv = serve_argv(demo_db_path, q.inbox_address, policy.base_url, tmp_path)
        async with over_stdio(argv, tmp_path / "stderr.log") as session:
            listed = await session.list_tools()
            answer = await session.call_tool("ask_inbox", {"question": q.question, "as_of": q.query_date})
            found = await session.call_tool("search_inbox", {"keywords": gold.subject.split()[:2]})
            read = await session.call_tool("read_email", {"message_id": gold.message_id})
            return listed, answer, found, read

    listed, answer, found, read = anyio.run(session_calls)
    assert sorted(t.name for t in listed.tools) == ["ask_inbox", "read_email", "search_inbox"]
    assert "withheld" in next(t for t in listed.tools if t.name == "ask_inbox").description  # grounding is on
    schema = next(t for t in listed.tools if t.name == "search_inbox").input_schema
    assert {"keywords", "inbox", "from_address", "sent_after", "max_results"} <= set(schema["properties"])
    answer = result_json(answer)
    # the inbox defaulted to the only allowed one; the rollout is ask's: same answer, cited email and turns
    assert answer["answer"] == q.answer and answer["inbox"] == q.inbox_address and answer["turns"] == 3
    assert answer["cited"] == [{"message_id": gold.message_id, "date": gold.date, "from": gold.from_address,
                                "subject": gold.subject}]
    assert gold.message_id in [r["message_id"] for r in result_json(found)["results"]]
    email = result_json(read)
    assert email["message_id"] == gold.message_id and email["body"].startswith(gold.body[:50])


def test_ask_inbox_checks_grounding_by_default(http_server, q):
    async def ask_invented():
        async with over_http(http_server[0]) as session:
            return await session.call_tool("ask_inbox", {"question": "Who won the bake-off?",
                                                         "inbox": q.inbox_address})

    answer = result_json(anyio.run(ask_invented))
    assert answer["answer"] == "I don't know" and answer["cited"] == []
    assert answer["withheld"]["answer"] == "Bittern 77Z" and answer["withheld"]["unseen"] == ["77Z"]


def test_refused_inbox_and_another_inboxs_email(http_server, q, other_inbox_email, demo_db):
    other = demo_db.largest_inboxes(6)
    elsewhere = next(address for address, _ in other if address != q.inbox_address)

    async def calls():
        async with over_http(http_server[0]) as session:
            return [await session.call_tool("ask_inbox", {"question": q.question, "inbox": elsewhere}),
                    await session.call_tool("search_inbox", {"keywords": ["review"], "inbox": elsewhere}),
                    await session.call_tool("read_email", {"message_id": other_inbox_email, "inbox": elsewhere}),
                    await session.call_tool("read_email", {"message_id": other_inbox_email}),
                    await session.call_tool("read_email", {"message_id": "<no-such@x>"})]

    ask, search, read_elsewhere, read_other, read_missing = anyio.run(calls)
    for refused in (ask, search, read_elsewhere):
        assert error_text(refused) == (f"inbox {elsewhere!r} is not one this server may use; it allows "
                                       f"{q.inbox_address}.")
    # another inbox's email and no email at all read the same: the refusal tells nothing of other inboxes
    assert error_text(read_other).startswith(f"no email with message_id {other_inbox_email!r} in {q.inbox_address}'s")
    assert error_text(read_missing).startswith(f"no email with message_id '<no-such@x>' in {q.inbox_address}'s")
    assert demo_db.read(other_inbox_email) is not None


def test_malformed_calls_and_an_oversize_question_are_tool_errors(http_server, q):
    async def calls():
        async with over_http(http_server[0]) as session:
            results = [await session.call_tool("search_inbox", {"keywords": "not a list"}),
                       await session.call_tool("search_inbox", {"keywords": [" "]}),
                       await session.call_tool("search_inbox", {"keywords": ["x"], "sent_after": "May 1st"}),
                       await session.call_tool("read_email", {}),
                       await session.call_tool("ask_inbox", {"question": "x" * 2001}),
                       await session.call_tool("ask_inbox", {"question": "Where?", "as_of": "yesterday"}),
                       await session.call_tool("ask_inbox", {"question": "  "})]
            # the server is still there and serves the next request
            results.append(await session.call_tool("search_inbox", {"keywords": ["review"]}))
            return results

    *errors, after = anyio.run(calls)
    texts = [error_text(r) for r in errors]
    assert "keywords" in texts[0] and "list" in texts[0].lower()
    assert texts[1] == "search_inbox needs at least one non-empty keyword."
    assert texts[2] == "search_inbox: 'sent_after' must be a date like 2001-05-31, not 'May 1st'."
    assert "message_id" in texts[3]
    assert texts[4] == "the question is 2001 characters; ask one of at most 2000."
    assert texts[5].startswith("as_of must be a date")
    assert texts[6] == "the question is empty."
    assert not after.is_error


def test_two_clients_at_once_are_answered_concurrently(http_server, scripts):
    """Each scripted reply stalls 2 s: had the server taken them one after the other, the second request would
    have reached the model only after the first reply."""
    answers = {}

    async def one(question):
        async with over_http(http_server[0]) as session:
            answers[question] = await session.call_tool("ask_inbox", {"question": question})

    async def both():
        async with anyio.create_task_group() as group:
            group.start_soon(one, "slow one?")
            group.start_soon(one, "slow two?")

    anyio.run(both)
    assert result_json(answers["slow one?"])["answer"] == "one" and result_json(answers["slow two?"])["answer"] == "two"
    arrived = scripts["_arrived"]
    assert abs(arrived["one"] - arrived["two"]) < 2.0


def test_a_missing_or_wrong_token_gets_401(http_server):
    url = http_server[0]
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = httpx.post(url, json=initialize, headers={**accept, **headers})
        assert response.status_code == 401 and "bearer token" in response.text
    assert httpx.post(url, json=initialize, headers={**accept, "Authorization": f"Bearer {TOKEN}"}).status_code == 200

    async def with_wrong_token():
        async with over_http(url, token="wrong"):
            pass

    with pytest.raises(BaseExceptionGroup) as refused:  # the SDK's client: the server answered with an error
        anyio.run(with_wrong_token)
    assert refused.group_contains(MCPError, match="error response")


@pytest.mark.parametrize("argv, message", [
    (["--http", "0.0.0.0:8765"], "--http 0.0.0.0:8765 is reachable from other machines: give --token"),
    (["--http", "192.168.1.5:8765"], "is reachable from other machines"),
    (["--token", "abc"], "--token guards the HTTP transport; give --http HOST:PORT too"),
    (["--http", "localhost:http"], "--http takes HOST:PORT such as 127.0.0.1:8765, not 'localhost:http'"),
    (["--inbox", "nobody@nowhere.example"], "has no mail sent or received by 'nobody@nowhere.example'"),
    (["--concurrency", "0"], "--concurrency must be at least 1, not 0"),
])
def test_refused_at_start_with_one_clear_error(demo_db_path, q, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.delenv("EMAIL_AGENT_MCP_TOKEN", raising=False)
    rc = cli.main(["serve", "--db", str(demo_db_path), "--model", "hosted_vllm/x", "--base-url",
                   "http://127.0.0.1:9/v1", "--art-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_port_in_use_is_one_clear_error_before_the_model_loads(demo_db_path, tmp_path, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        rc = cli.main(["serve", "--db", str(demo_db_path), "--model", "base", "--art-dir", str(tmp_path),
                       "--http", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert rc == 1 and f"Error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "Traceback" not in err and "SmolLM2" not in err


def test_a_model_that_is_down_is_a_tool_error_and_the_tools_still_work(demo_db_path, q, tmp_path):
    async def calls():
        argv = serve_argv(demo_db_path, None, "http://127.0.0.1:9/v1", tmp_path, "--no-grounded-answers")
        async with over_stdio(argv, tmp_path / "stderr.log") as session:
            listed = await session.list_tools()
            return [next(t for t in listed.tools if t.name == "ask_inbox"),
                    await session.call_tool("ask_inbox", {"question": q.question, "inbox": q.inbox_address}),
                    await session.call_tool("ask_inbox", {"question": q.question}),
                    await session.call_tool("search_inbox", {"keywords": ["review"], "inbox": q.inbox_address})]

    ask_tool, down, no_inbox, search = anyio.run(calls)
    assert "withheld" not in ask_tool.description  # --no-grounded-answers
    assert "cannot reach http://127.0.0.1:9/v1" in error_text(down)
    # no --inbox: every inbox is allowed, and each request names its own
    assert error_text(no_inbox) == "give `inbox`: the email address whose mail to use."
    assert result_json(search)["results"]
    logged = (tmp_path / "stderr.log").read_text()
    assert "no --inbox given: any client may search and read every inbox" in logged


@pytest.mark.slow
def test_the_real_base_model_answers_over_stdio(demo_db_path, q, tmp_path):
    """SmolLM2-135M, untrained, on the CPU backend, one short turn: served once, asked over MCP."""
    argv = [sys.executable, "train_email_search_agent.py", "serve", "--db", str(demo_db_path), "--model", "base",
            "--inbox", q.inbox_address, "--max-turns", "1", "--max-tokens", "16", "--art-dir", str(tmp_path)]

    async def ask():
        async with over_stdio(argv, tmp_path / "stderr.log") as session:
            return await session.call_tool("ask_inbox", {"question": q.question}, read_timeout_seconds=300)

    answer = result_json(anyio.run(ask))
    assert answer["model"] == "base:SmolLM2-135M-Instruct" and answer["turns"] == 1 and answer["tool_calls"]
    assert answer["ran_out_of_turns"] == (answer["answer"] is None)
