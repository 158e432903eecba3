"""Benchmark: the environment's overhead per agent turn, against an instant scripted policy.

    python bench/bench_rollout.py            # 500 rollouts on the 30k Enron sample, concurrency 16

Each rollout searches, reads and answers (3 turns) through the real rollout code and a local
OpenAI-compatible scripted server that answers instantly, so everything measured besides the HTTP round
trip is the environment: tools (SQLite), argument checks, bookkeeping. Target (issue 3): under 5 ms of
environment time per turn, so the model is always the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from openai import AsyncOpenAI

from email_agent.data.build import build_database
from email_agent.data.email_db import EmailDB
from email_agent.data.sources import read_emails
from email_agent.data.questions import Question
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from scripted_server import ScriptedServer, call

SAMPLE = ROOT.parent / "shared" / "data" / "enron" / "emails.jsonl.gz"


def make_questions(db: EmailDB, n: int, seed: int) -> tuple[list[Question], dict]:
    """Questions about random emails, answered by their subject; scripts that search, read and answer."""
    rng = random.Random(seed)
    max_id = db.conn.execute("SELECT MAX(id) FROM emails").fetchone()[0]
    questions, scripts = [], {}
    while len(questions) < n:
        row = db.conn.execute("SELECT id, message_id, subject, date FROM emails WHERE id = ?",
                              (rng.randint(1, max_id),)).fetchone()
        words = re.findall(r"[A-Za-z]{4,}", row[2])
        members = [a for (a,) in db.conn.execute("SELECT address FROM mailbox WHERE email_id = ?", (row[0],))]
        if not words or not members:
            continue
        q = Question(len(questions), f"q{len(questions)}: what was the email about {' '.join(words[:2])}?", row[2],
                     [row[1]], 1.0, rng.choice(members), row[3][:10], "bench")
        questions.append(q)
        scripts[q.question] = [call("search_inbox", {"keywords": words[:2]}),
                               call("read_email", {"message_id": row[1]}),
                               call("return_final_answer", {"answer": row[2], "sources": [row[1]]})]
    return questions, scripts


async def run(db: EmailDB, questions, scripts, concurrency: int):
    async with ScriptedServer(scripts) as server:
        client = AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=0)
        policy = Policy(client, "scripted", max_concurrency=concurrency)
        started = time.perf_counter()
        trajs = await asyncio.gather(*(rollout(policy, q, db, Episode()) for q in questions))
        wall = time.perf_counter() - started
        await client.close()
    return trajs, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emails", type=Path, default=SAMPLE)
    parser.add_argument("--rollouts", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    if not args.emails.exists():
        sys.exit(f"no corpus at {args.emails} (the Enron sample lives in ../shared/data/enron beside the checkout)")
    with tempfile.TemporaryDirectory() as tmp:
        build_database(read_emails(args.emails), [], Path(tmp) / "e.db", source="bench", progress=False)
        db = EmailDB(Path(tmp) / "e.db")
        questions, scripts = make_questions(db, args.rollouts, seed=0)
        trajs, wall = asyncio.run(run(db, questions, scripts, args.concurrency))
    turns = sum(t.metrics["num_turns"] for t in trajs)
    env = sum(t.metrics["env_s"] for t in trajs)
    correct = sum(t.metrics["answer_correct"] for t in trajs)
    print(f"rollouts {len(trajs)} ({correct} answered correctly), turns {turns}, concurrency {args.concurrency}")
    print(f"throughput        {len(trajs) / wall:8.1f} rollouts/s   ({wall:.2f} s wall)")
    print(f"environment       {env / turns * 1000:8.2f} ms per turn   (target < 5 ms)")
    print(f"environment share {env / wall:8.1%} of wall time "
          "(the rest: HTTP to the instant policy, client, event loop)")


if __name__ == "__main__":
    main()
