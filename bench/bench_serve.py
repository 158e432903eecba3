"""What the MCP layer of `serve` costs (a script that prints figures; not a test).

Latency: the same held-out demo questions are asked twice each, alternately, of the same model: in-process
(`ask.answer_question` on a model opened once, what `ask` plays) and over MCP (`ask_inbox` through the
SDK's stdio client to `train_email_search_agent.py serve`, which opened the same model once at its start). Both
play the same greedy rollout with the grounding check on, so the work is the same; the answers are compared.
p50/p95 of each, and what MCP adds (target: under 5% of an answer's time).

Throughput: `serve --http` on loopback, the questions asked by 1 client one after the other, then by 8 clients
at once (each its own MCP session); the CPU server batches concurrent requests.

    .venv/bin/python bench/bench_serve.py                       # the most recent run under --art-dir, else base
    .venv/bin/python bench/bench_serve.py --model demo@4 --questions 4
    .venv/bin/python bench/bench_serve.py --scripted            # a scripted policy: MCP's own cost, in ms

The real CPU model is the default (a trained demo run when there is one, else the untrained base model, which
plays the same rollout but rarely calls a tool, so its answers are shorter). --scripted replaces the model with a
scripted OpenAI-compatible server that answers at once, so the figures are the MCP layer's own milliseconds.
Figures depend on what else runs on the machine; the load average is printed for that reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import httpx
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from email_agent.apps import ask
from email_agent.models import opened
from email_agent.models.servers import Servers
from email_agent import runs
from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import select_questions
from scripted_server import expert_script, serve_in_thread


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def serve_argv(args, spec: str, base_url: str | None, *more) -> list[str]:
    return [sys.executable, str(ROOT / "train_email_search_agent.py"), "serve", "--quiet", "--db", args.db,
            "--model", spec, "--art-dir", args.art_dir, *(["--base-url", base_url] if base_url else []), *more]


async def latency(args, spec, base_url, questions, db) -> None:
    options = opened.Options(art_dir=args.art_dir, base_url=base_url)
    params = StdioServerParameters(command=sys.executable, args=serve_argv(args, spec, base_url)[1:], cwd=str(ROOT))
    inproc, mcp, same = [], [], 0
    async with contextlib.AsyncExitStack() as stack:
        opened_model = await opened.open_model(spec, Servers(options, stack))
        await opened.probe(opened_model)
        read, write = await stack.enter_async_context(stdio_client(params))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        print(f"{opened_model.label} ({opened_model.limits.describe()}), {len(questions)} questions x {args.rounds} "
              f"round(s), in-process and over MCP (stdio) alternately", flush=True)
        first = questions[0]
        await ask.answer_question(opened_model, first, db, True)  # warm both (first-request costs are not MCP's)
        await session.call_tool("ask_inbox", {"question": first.question, "inbox": first.inbox_address,
                                              "as_of": first.query_date}, read_timeout_seconds=600)
        for _ in range(args.rounds):
            for q in questions:
                started = time.perf_counter()
                direct = await ask.answer_question(opened_model, q, db, True)
                inproc.append(time.perf_counter() - started)
                started = time.perf_counter()
                result = await session.call_tool("ask_inbox", {"question": q.question, "inbox": q.inbox_address,
                                                               "as_of": q.query_date}, read_timeout_seconds=600)
                mcp.append(time.perf_counter() - started)
                if result.is_error:
                    raise UserError(f"ask_inbox failed: {result.content[0].text}")
                same += result.structured_content["answer"] == direct.answer
    p50, p95 = percentile(inproc, 50), percentile(inproc, 95)
    m50, m95 = percentile(mcp, 50), percentile(mcp, 95)
    print(f"  in-process  p50 {p50 * 1000:8.1f} ms   p95 {p95 * 1000:8.1f} ms   "
          f"mean {statistics.mean(inproc) * 1000:8.1f} ms")
    print(f"  over MCP    p50 {m50 * 1000:8.1f} ms   p95 {m95 * 1000:8.1f} ms   "
          f"mean {statistics.mean(mcp) * 1000:8.1f} ms")
    added = statistics.mean(mcp) - statistics.mean(inproc)
    print(f"  MCP adds {added * 1000:+.1f} ms per answer on average ({added / statistics.mean(inproc):+.1%}; p50 "
          f"{m50 / p50 - 1:+.1%}); same answer both ways: {same}/{len(mcp)}", flush=True)


async def throughput(args, spec, base_url, questions) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(serve_argv(args, spec, base_url, "--http", f"127.0.0.1:{port}"), cwd=ROOT,
                              stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if server.poll() is not None:
                raise UserError("serve --http exited before it listened")
            await asyncio.sleep(0.2)

        async def client(queue: asyncio.Queue, connected: asyncio.Barrier) -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=600)) as http, \
                    streamable_http_client(url, http_client=http) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                await connected.wait()  # the clock starts once every client has its session
                while not queue.empty():
                    q = queue.get_nowait()
                    result = await session.call_tool("ask_inbox", {"question": q.question, "inbox": q.inbox_address,
                                                                   "as_of": q.query_date}, read_timeout_seconds=600)
                    if result.is_error:
                        raise UserError(f"ask_inbox failed: {result.content[0].text}")

        asked = questions * args.rounds
        seconds = {}
        for clients in (1, 8):
            queue = asyncio.Queue()
            for q in asked:
                queue.put_nowait(q)
            connected = asyncio.Barrier(clients + 1)
            tasks = [asyncio.create_task(client(queue, connected)) for _ in range(clients)]
            await connected.wait()
            started = time.perf_counter()
            await asyncio.gather(*tasks)
            seconds[clients] = time.perf_counter() - started
            print(f"  {clients} client(s): {len(asked)} answers in {seconds[clients]:6.1f} s = "
                  f"{len(asked) / seconds[clients] * 60:6.1f} answers/min", flush=True)
        print(f"  8 clients at once: {seconds[1] / seconds[8]:.2f}x the throughput of 1")
    finally:
        server.terminate()
        server.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="data/demo.db")
    parser.add_argument("--art-dir", default=".art")
    parser.add_argument("--model", help="RUN[@STEP] or base (default: the most recent run, else base)")
    parser.add_argument("--scripted", action="store_true", help="a scripted policy instead of the CPU model")
    parser.add_argument("--questions", type=int, default=8, help="held-out demo questions (default 8)")
    parser.add_argument("--rounds", type=int, default=1, help="times each is asked (default 1)")
    args = parser.parse_args()
    args.db, args.art_dir = str(Path(args.db).resolve()), str(Path(args.art_dir).resolve())
    if not Path(args.db).exists():
        subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "build-db", "--demo", "--db",
                        args.db, "--quiet"], check=True)
    db = EmailDB(args.db)
    held_out = select_questions(db, "test", seed=0, limit=args.questions)
    questions = [ask.adhoc_question(db, q.question, q.inbox_address, q.query_date) for q in held_out]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores", flush=True)
    with contextlib.ExitStack() as stack:
        if args.scripted:
            server = stack.enter_context(serve_in_thread({q.question: expert_script(q) for q in held_out}))
            spec, base_url = "hosted_vllm/scripted", server.base_url
        else:
            latest = runs.list_runs(args.art_dir)
            spec, base_url = args.model or (str(latest[0].path) if latest else "base"), None
        await latency(args, spec, base_url, questions, db)
        print("throughput over MCP (streamable HTTP):", flush=True)
        await throughput(args, spec, base_url, questions)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    asyncio.run(main())
