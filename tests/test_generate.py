"""generate-questions: an LLM (the scripted server) writes questions; every candidate is checked before it is stored."""

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import date, timedelta

import pytest

from conftest import ROOT
from email_agent.data import generate, question_checks
from email_agent.data.build import build_database
from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.data.questions import select_questions
from scripted_server import serve_in_thread

ALICE, BOB = "alice@x.com", "bob@y.com"


def email(i, sender, to, day, body):
    return {"message_id": f"<m{i}@x>", "date": f"2024-01-{day:02d}T09:00:00Z", "subject": f"note {i}",
            "from_address": sender, "to_addresses": [to], "body": body}


@pytest.fixture()
def db_path(tmp_path):
    """Alice's inbox: 12 emails over 12 days (3 batches of 4); Bob's: 3 emails Alice never saw."""
    emails = [email(i, f"friend{i % 3}@z.com", ALICE, i + 1, f"The code word for project {i} is word{i}.")
              for i in range(12)]
    emails += [email(100 + i, BOB, "carol@y.com", 5, f"Bob's secret number {i}.") for i in range(3)]
    emails.append(email(200, ALICE, "dave@z.com", 20, ""))  # no body: never shown to the model
    path = tmp_path / "inbox.db"
    build_database(emails, [], path, source="test", progress=False)
    return path


def shown_ids(body):
    return re.findall(r'<email id="([^"]+)">', body["messages"][-1]["content"])


def good_and_bad(body):
    """For each batch: 2 good questions and one of every kind of bad candidate."""
    ids = shown_ids(body)
    n = [int(m[2:-3]) for m in ids]
    outside = next(f"<m{i}@x>" for i in range(12) if f"<m{i}@x>" not in ids)
    questions = [
        {"question": f"What is the code word for project {n[0]}?", "answer": f"word{n[0]}", "message_ids": [ids[0]],
         "how_realistic": 0.9},
        {"question": f"Which code words were set for projects {n[1]} and {n[2]}?", "answer": f"word{n[1]}, word{n[2]}",
         "message_ids": [ids[1], ids[2]], "how_realistic": 0.7},
        {"question": "What did the fabricated email say?", "answer": "x", "message_ids": ["<made-up@x>"],
         "how_realistic": 0.9},
        {"question": "What is Bob's secret number?", "answer": "0", "message_ids": ["<m100@x>"], "how_realistic": 0.9},
        {"question": "What is in an email not shown?", "answer": "y", "message_ids": [outside], "how_realistic": 0.9},
        {"question": f"Asked before project {n[3]} mail arrived?", "answer": "z", "message_ids": [ids[3]],
         "how_realistic": 0.9, "query_date": "2023-12-31"},
        {"question": "", "answer": "empty question", "message_ids": [ids[0]], "how_realistic": 0.9},
        {"question": f"what is the CODE word for project {n[0]}", "answer": f"word{n[0]}", "message_ids": [ids[0]],
         "how_realistic": 0.9},  # a near-duplicate of the first
        {"question": f"Is project {n[3]} real?", "answer": "yes", "message_ids": [ids[3]], "how_realistic": 1.5},
        "not an object",
    ]
    return {"text": "```json\n" + json.dumps({"questions": questions}) + "\n```"}


def config(base_url, **over):
    return generate.GenerateConfig(**{"model": "hosted_vllm/gen", "base_url": base_url, "inboxes": [ALICE],
                                      "batch_size": 4, "test_fraction": 0.34, "retries": 2, **over})


def stored(path):
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT id, question, message_ids, inbox_address, query_date, split, model, temperature, "
                            "gold_in_db FROM questions ORDER BY id").fetchall()
    finally:
        conn.close()
    return [dict(zip(("id", "question", "message_ids", "inbox", "query_date", "split", "model", "temperature",
                      "gold_in_db"), r[:2] + (json.loads(r[2]),) + r[3:])) for r in rows]


def test_only_valid_candidates_are_stored_and_rejections_are_counted(db_path):
    reader = EmailDB(db_path)  # a reader (a training run) open while questions are written
    calls: dict[str, int] = {}

    def flaky(body):  # each batch's first reply is not JSON: it is retried
        key = shown_ids(body)[0]
        calls[key] = calls.get(key, 0) + 1
        return {"text": "Sure! Here are some questions:"} if calls[key] == 1 else good_and_bad(body)

    with serve_in_thread({"gen": flaky}) as server:
        summary = generate.generate_questions(db_path, config(server.base_url), progress=False)
    assert len(server.requests) == 6 and summary.batches == 3 and not summary.failed_batches
    assert server.requests[0]["temperature"] == 0.5
    assert summary.candidates == 30 and sum(summary.added.values()) == 6
    assert summary.rejected == {
        "cites an email that does not exist (fabricated id)": 3, "cites an email outside the inbox": 3,
        "cites an email the model was not shown": 3, "query_date before a cited email": 3,
        "empty or missing question/answer": 3, "near-duplicate of another question": 3,
        "how_realistic missing or not in 0..1": 3, "not a JSON object": 3}
    text = "\n".join(summary.lines())
    assert "fabricated id)  (e.g. 'What did the fabricated email say?')" in text
    rows = stored(db_path)
    assert len(rows) == 6 and all(r["model"] == "hosted_vllm/gen" and r["temperature"] == 0.5 for r in rows)
    for r in rows:
        assert r["inbox"] == ALICE and r["gold_in_db"] == 1
        for mid in r["message_ids"]:
            email_date = reader.read(mid, inbox=ALICE).date[:10]
            assert r["query_date"] >= email_date  # asked on or after every cited email
        latest = max(date.fromisoformat(reader.read(m).date[:10]) for m in r["message_ids"])
        assert latest < date.fromisoformat(r["query_date"]) <= latest + timedelta(days=30)  # ART·E's 1-30 days
    assert len(select_questions(reader, "train")) + len(select_questions(reader, "test")) == 6  # the reader sees them
    reader.close()


def test_cost_is_counted_where_litellm_knows_the_price(db_path):
    with serve_in_thread({"gpt-4o-mini": good_and_bad}) as server:
        summary = generate.generate_questions(db_path, config(server.base_url, model="openai/gpt-4o-mini"),
                                              progress=False)
        assert summary.cost_usd > 0 and "cost        $" in "\n".join(summary.lines())
        again = generate.generate_questions(db_path, config(server.base_url, model="openai/gpt-4o-mini"),
                                            progress=False)
    assert again.cached == 3 and again.cost_usd == 0 and sum(again.added.values()) == 0
    assert again.rejected["already in the database"] == 9  # the 6 stored and their 3 rephrasings


def test_max_questions_stops_early_and_leftovers_come_next_time(db_path):
    with serve_in_thread({"gen": good_and_bad}) as server:
        first = generate.generate_questions(db_path, config(server.base_url, max_questions=4, concurrency=2),
                                            progress=False)
        assert first.batches == 2 and sum(first.added.values()) == 4 and first.beyond_limit == 0
        second = generate.generate_questions(db_path, config(server.base_url, max_questions=1, concurrency=1),
                                             progress=False)
        assert sum(second.added.values()) == 1 and second.beyond_limit == 1
        assert "1 left over past --max-questions" in "\n".join(second.lines())
    assert len(server.requests) == 3 and len(stored(db_path)) == 5  # every batch asked once


def test_split_never_shares_an_email_between_train_and_test():
    import random

    for seed in range(40):
        rng = random.Random(seed)
        ids = [f"<{i}>" for i in range(25)]
        stored_qs = [{"message_ids": rng.sample(ids[:10], rng.randint(1, 2)), "split": rng.choice(["train", "test"])}
                     for _ in range(3)]
        new = [{"message_ids": rng.sample(ids, rng.randint(1, 3))} for _ in range(20)]
        placed = question_checks.assign_splits(new, stored_qs, 0.3, seed)
        everything = [q for q in placed if q["split"]] + stored_qs
        train = {m for q in everything if q["split"] == "train" for m in q["message_ids"]}
        test = {m for q in everything if q["split"] == "test" for m in q["message_ids"]}
        if not any(set(a["message_ids"]) & set(b["message_ids"]) for a in stored_qs for b in stored_qs
                   if a["split"] != b["split"]):
            assert not train & test, seed
    # separate emails: the test share is met
    placed = question_checks.assign_splits([{"message_ids": [f"<{i}>"]} for i in range(10)], [], 0.3, 0)
    assert sum(q["split"] == "test" for q in placed) == 3


def test_replies_that_never_parse_are_counted_and_all_failures_are_one_error(db_path, capsys):
    with serve_in_thread({"gen": lambda body: {"text": '{"answers": []}'}}) as server:
        with pytest.raises(UserError, match='no usable reply for any of the first 3 batches '
                                            '\\(reply has no "questions" list\\)'):
            generate.generate_questions(db_path, config(server.base_url), progress=False)
    assert len(server.requests) == 6 and stored(db_path) == []


@pytest.mark.parametrize("reply, reason", [
    ({"raw": {"id": "x", "object": "chat.completion", "created": 0, "model": "gen", "choices": []}},
     "reply has no choices"),
    ({"text": '{"questions": ' + "[" * 50_000 + "]" * 50_000 + "}"}, "reply is not JSON"),
])
def test_odd_replies_of_a_server_are_retried_and_counted(db_path, reply, reason):
    with serve_in_thread({"gen": lambda body: reply}) as server:
        with pytest.raises(UserError, match=f"no usable reply for any of the first 3 batches \\({reason}\\)"):
            generate.generate_questions(db_path, config(server.base_url), progress=False)
    assert len(server.requests) == 6 and stored(db_path) == []


def test_a_model_that_cannot_answer_stops_the_run_after_the_first_window(db_path):
    """A missing key or a wrong model name shows in the first replies: not after every batch has failed."""
    with serve_in_thread({"gen": lambda body: {"status": 401}}) as server:
        with pytest.raises(UserError, match="for the first batch \\(API error: AuthenticationError\\)"):
            generate.generate_questions(db_path, config(server.base_url, concurrency=1), progress=False)
    assert len(server.requests) == 2  # one batch, its two tries; the other two batches never asked


def test_a_failed_call_is_asked_again_after_a_doubling_wait_and_a_malformed_reply_at_once(db_path, monkeypatch):
    """Catches: a failing API hammered without waiting, waits that grow otherwise than 1 s, 2 s ..., or a wait
    after a reply that only did not parse (the model answered: asking again at once is fine). The waits are
    recorded, not slept."""
    import asyncio

    import tenacity.asyncio  # noqa: F401  (sleeps through asyncio.sleep, looked up at each wait)

    waits, real_sleep = [], asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda seconds: waits.append(seconds) or real_sleep(0))
    calls: dict[str, int] = {}

    def flaky(body):  # each batch: a bad key twice, a reply that is not JSON, then a good reply
        key = shown_ids(body)[0]
        calls[key] = calls.get(key, 0) + 1
        return [{"status": 401}, {"status": 400}, {"text": "Sure!"}][calls[key] - 1] if calls[key] <= 3 \
            else good_and_bad(body)

    with serve_in_thread({"gen": flaky}) as server:
        summary = generate.generate_questions(db_path, config(server.base_url, retries=4, concurrency=1),
                                              progress=False)
    assert len(server.requests) == 12 and summary.batches == 3 and not summary.failed_batches
    assert [w for w in waits if w] == [1, 2] * 3


def test_a_model_that_fails_for_some_batches_loses_only_those(db_path):
    def some(body):
        return {"status": 500} if "<m0@x>" in shown_ids(body) else good_and_bad(body)

    with serve_in_thread({"gen": some}) as server:
        summary = generate.generate_questions(db_path, config(server.base_url), progress=False)
    assert list(summary.failed_batches.items()) == [("API error: InternalServerError", 1)]
    assert sum(summary.added.values()) == 4  # two batches' good questions


def run_cli(*args, env=None):
    return subprocess.Popen([sys.executable, str(ROOT / "train_email_search_agent.py"), "generate-questions",
                             *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)  # asks nothing


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_stores_nothing_and_rerun_adds_only_new(db_path, sig):
    cache = generate.cache_path(db_path)
    slow = {"on": True, "calls": 0}

    def reply(body):  # the third request stalls while slow["on"]: the run is killed waiting for it
        slow["calls"] += 1
        if slow["on"] and slow["calls"] == 3:
            return {"sleep": 30, **good_and_bad(body)}
        return good_and_bad(body)

    with serve_in_thread({"gen": reply}) as server:
        args = ["--db", db_path, "--model", "hosted_vllm/gen", "--base-url", server.base_url, "--inbox", ALICE,
                "--batch-size", 4, "--concurrency", 1, "--quiet"]
        proc = run_cli(*args)
        deadline = time.time() + 60
        while time.time() < deadline and not (cache.exists() and len(cache.read_text().splitlines()) == 2):
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130), err
        assert stored(db_path) == []  # nothing half-done
        assert "Traceback" not in err  # SIGTERM unwinds like Ctrl-C, quietly
        conn = sqlite3.connect(db_path)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        conn.close()
        if sig == signal.SIGTERM:
            assert "interrupted" in err
            return

        slow["on"] = False
        before = len(server.requests)
        proc = run_cli(*args)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert len(server.requests) - before == 1  # only the batch that had no cached reply
        assert "(2 from the cache)" in out
        first = stored(db_path)
        assert len(first) == 6

        proc = run_cli(*args)  # again: nothing new to add
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "already in the database" in out and stored(db_path) == first

        before = len(server.requests)
        proc = run_cli(*args, "--replace", "--seed", 1)  # starts over: every batch asked again
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert len(server.requests) - before == 3 and len(stored(db_path)) == 6 and "already" not in out


def test_cli_errors_are_one_sentence_and_the_key_is_never_shown(db_path, tmp_path):
    proc = run_cli("--db", tmp_path / "nope.db", "--model", "openai/x")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err.strip().splitlines()[-1].startswith("Error: No database at")
    proc = run_cli("--db", db_path, "--model", "openai/x", "--inbox", "nobody@x.com")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and f"the largest inboxes are {ALICE}" in err and "Traceback" not in err
    with serve_in_thread({"gen": lambda body: {"status": 401}}) as server:
        proc = run_cli("--db", db_path, "--model", "hosted_vllm/gen", "--base-url", server.base_url, "--quiet",
                       env={"QUESTIONS_API_KEY": "sk-very-secret-123"})
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "no usable reply" in err and "Traceback" not in err
    assert "sk-very-secret-123" not in out + err
    assert server.requests  # the key was sent, only never shown
    assert stored(db_path) == []


@pytest.mark.parametrize("bad", [dict(test_fraction=1.0), dict(test_fraction=-0.1), dict(batch_size=0),
                                 dict(concurrency=0), dict(max_questions=-1), dict(min_realistic=1.5),
                                 dict(timeout=0.0), dict(timeout=float("nan"))])
def test_bad_settings_are_one_sentence_errors_before_any_request(db_path, bad):
    with pytest.raises(UserError, match="^--[a-z-]+ (must|and)"):
        generate.generate_questions(db_path, config("http://127.0.0.1:9/v1", **bad), progress=False)
    assert stored(db_path) == [] and not generate.cache_path(db_path).exists()


def test_a_provider_key_missing_from_the_environment_stops_before_any_request(db_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = generate.GenerateConfig(model="openai/gpt-4.1", inboxes=[])
    with pytest.raises(UserError, match="^openai/gpt-4.1 needs OPENAI_API_KEY in the environment"):
        generate.generate_questions(db_path, cfg, progress=False)
    assert stored(db_path) == []
    # a rerun whose every reply is cached asks nothing, so it needs no key
    with serve_in_thread({"gpt-4.1": good_and_bad}) as server:
        first = generate.generate_questions(db_path, config(server.base_url, model="openai/gpt-4.1"), progress=False)
    again = generate.generate_questions(db_path, config(None, model="openai/gpt-4.1"), progress=False)
    assert sum(first.added.values()) == 6 and again.cached == again.batches > 0 and not again.added


def test_databases_built_before_the_model_columns_still_work(db_path):
    conn = sqlite3.connect(db_path)
    conn.executescript("DROP TABLE questions; CREATE TABLE questions (id INTEGER PRIMARY KEY, question TEXT NOT NULL, "
                       "answer TEXT NOT NULL, message_ids TEXT NOT NULL, how_realistic REAL, inbox_address TEXT NOT "
                       "NULL, query_date TEXT NOT NULL, split TEXT NOT NULL, gold_in_db INTEGER NOT NULL);"
                       "INSERT INTO questions VALUES (7, 'old?', 'a', '[\"<m5@x>\"]', 0.5, 'alice@x.com', "
                       "'2024-02-01', 'test', 1);")
    conn.close()
    with serve_in_thread({"gen": good_and_bad}) as server:
        summary = generate.generate_questions(db_path, config(server.base_url), progress=False)
    rows = stored(db_path)
    assert rows[0]["id"] == 7 and rows[0]["model"] is None and [r["id"] for r in rows[1:]] == list(range(8, 14))
    # the new question citing <m5@x> (the old test question's email) goes to test too
    assert all(r["split"] == "test" for r in rows if "<m5@x>" in r["message_ids"])
    db = EmailDB(db_path)
    assert len(select_questions(db, "train")) + len(select_questions(db, "test")) == 7
    db.close()
    assert sum(summary.added.values()) == 6


def test_what_is_sent_and_its_cost_are_told_before_anything_is_sent(db_path):
    """The estimate is made before the first request, from the very prompts the run then sends (litellm's token
    count) and litellm's price map; a run stopped there sends and stores nothing, and keeps the replies already
    paid for even with --replace."""
    import litellm

    with serve_in_thread({"gpt-4o-mini": good_and_bad}) as server:
        cfg = config(server.base_url, model="openai/gpt-4o-mini")
        told = []

        def decline(estimate):
            told.append((estimate, len(server.requests)))
            return False

        assert generate.generate_questions(db_path, cfg, progress=False, confirm=decline) is None
        (estimate, sent_before_it), = told
        assert sent_before_it == 0 and server.requests == [] and stored(db_path) == []
        assert (estimate.batches, estimate.emails, estimate.cached) == (3, 12, 0)
        assert "to send     12 emails in 3 batches to openai/gpt-4o-mini" in estimate.lines()[0]

        summary = generate.generate_questions(db_path, cfg, progress=False, confirm=lambda estimate: True)
        assert summary.batches == 3 and len(server.requests) == 3
        sent = sum(litellm.token_counter(model=cfg.model, messages=r["messages"]) for r in server.requests)
        assert estimate.input_tokens == sent  # three batches: each one's prompt counted, none scaled
        replies = 3 * cfg.questions_per_batch * generate.OUTPUT_TOKENS_PER_QUESTION
        assert estimate.cost_usd == pytest.approx(sum(litellm.cost_per_token(
            model=cfg.model, prompt_tokens=sent, completion_tokens=replies)), rel=1e-3)
        assert f"about ${estimate.cost_usd:.2f} at litellm's prices" in estimate.lines()[1]
        assert estimate.cost_usd < estimate.cost_usd_max  # every reply at its 4,000-token limit

        cache = generate.cache_path(db_path).read_text()
        replace = config(server.base_url, model="openai/gpt-4o-mini", replace=True)
        assert generate.generate_questions(db_path, replace, progress=False, confirm=lambda e: False) is None
        assert generate.cache_path(db_path).read_text() == cache and len(stored(db_path)) == 6
        assert len(server.requests) == 3


def test_a_model_without_a_price_is_said_to_cost_an_unknown_amount(db_path):
    told = []
    with serve_in_thread({"gen": good_and_bad}) as server:
        generate.generate_questions(db_path, config(server.base_url, max_questions=4), progress=False,
                                    confirm=lambda estimate: told.append(estimate) or False)
    assert told[0].cost_usd is None and not server.requests
    assert told[0].lines()[0].endswith("to hosted_vllm/gen; --max-questions may stop it after 1 batch")
    assert "the cost is unknown (litellm has no price for hosted_vllm/gen)" in told[0].lines()[1]


def test_on_a_terminal_it_asks_before_sending_and_without_one_it_goes_on(db_path, monkeypatch, capsys):
    """Its stdin a terminal (a pseudo-terminal), "n" typed: nothing is sent. --yes on a terminal, and no terminal
    (a script, a pipe): told, not asked (a "n" waits on the terminal, which a question would read)."""
    import pty

    import train_email_search_agent as cli

    leader, follower = pty.openpty()
    terminal = os.fdopen(follower, "r")
    try:
        with serve_in_thread({"gen": good_and_bad}) as server:
            args = ["generate-questions", "--db", str(db_path), "--model", "hosted_vllm/gen", "--base-url",
                    server.base_url, "--inbox", ALICE, "--batch-size", "4", "--quiet"]
            monkeypatch.setattr(sys, "stdin", terminal)
            os.write(leader, b"n\n")
            assert cli.main(args) == 1
            out, err = capsys.readouterr()
            assert "Send them? [y/N]" in out and "to send     12 emails in 3 batches to hosted_vllm/gen" in err
            assert "stopped: nothing was sent" in err and not server.requests and stored(db_path) == []

            os.write(leader, b"n\n")
            assert cli.main([*args, "--yes"]) == 0
            out, err = capsys.readouterr()
            assert "Send them?" not in out and "to send     12 emails in 3 batches" in err
            assert len(server.requests) == 3 and len(stored(db_path)) == 6

            monkeypatch.setattr(sys, "stdin", io.StringIO("n\n"))
            assert cli.main([*args, "--replace"]) == 0
            out, err = capsys.readouterr()
            assert "Send them?" not in out and "to send     12 emails in 3 batches" in err
            assert len(server.requests) == 6
    finally:
        terminal.close()
        os.close(leader)
