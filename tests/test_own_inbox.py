"""The README's "Your own inbox" walkthrough, end to end, as a user types it: an mbox export -> build-db ->
generate-questions (a scripted LLM writes the questions) -> evaluate (a scripted agent) -> a tiny CPU train,
and the CPU recipe: a teacher evaluated on the train split, then a warm start distilled from its episodes."""

import gzip
import json
import mailbox
import re
import subprocess
import sys
from datetime import datetime, timezone
from email.message import EmailMessage, Message
from email.utils import format_datetime

import pytest

from conftest import ENRON_EMAILS, ROOT
from email_agent.data import questions as qmod
from email_agent.data.email_db import EmailDB
from email_agent.data.sources import parse_date
from scripted_server import expert_script, serve_in_thread

ME = "me@home.example"
FRIENDS = ["ana@friends.example", "bo@work.example", "cy@club.example"]


def write_mbox(path):
    """16 emails as a mail client exports them: plain, HTML-only, with attachments; 12 received, 4 sent."""
    box = mailbox.mbox(path)
    for i in range(16):
        msg = EmailMessage()
        sent = i % 4 == 3
        msg["From"], msg["To"] = (ME, FRIENDS[i % 3]) if sent else (f"Friend {i} <{FRIENDS[i % 3]}>", ME)
        msg["Subject"] = f"Harbor locker {i}"
        msg["Date"] = f"Mon, {i + 1:02d} Jan 2024 09:30:00 +0100"
        msg["Message-ID"] = f"<locker{i}@home.example>"
        fact = f"The code for Harbor locker {i} is {4000 + i * 37}."
        if i % 2:
            msg.set_content(f"<html><body><p>Hi!</p><p>{fact}</p></body></html>", subtype="html")
        else:
            msg.set_content(f"Hi!\n\n{fact}\n")
            msg.add_attachment(b"%PDF-1.4 receipt", maintype="application", subtype="pdf", filename="r.pdf")
        box.add(msg)
    box.close()


def writer(body):
    """The scripted question writer: one question per email it is shown, citing that email."""
    prompt = body["messages"][-1]["content"]
    questions = []
    for mid, n, code in re.findall(r'<email id="([^"]+)">.*?Harbor locker (\d+) is (\d+)', prompt, re.S):
        questions.append({"question": f"What is the code for Harbor locker {n}?", "answer": code,
                          "message_ids": [mid], "how_realistic": 0.8})
    return {"text": json.dumps({"questions": questions})}


def command(script, *args):
    result = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, capture_output=True,
                            text=True, timeout=900, stdin=subprocess.DEVNULL)  # no terminal: nothing is asked
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own")
    write_mbox(tmp / "my.mbox")
    built = command("train_email_search_agent.py", "build-db", "--emails", tmp / "my.mbox", "--db", tmp / "my.db",
                    "--quiet")
    assert re.search(r"^emails\s+16 ", built.stdout, re.M)
    agent: dict = {}
    with serve_in_thread({"gen": writer, "scripted": agent}) as server:
        generated = command("train_email_search_agent.py", "generate-questions", "--db", tmp / "my.db", "--model",
                            "hosted_vllm/gen", "--base-url", server.base_url, "--inbox", ME, "--batch-size", 8,
                            "--test-fraction", 0.25, "--quiet")
        yield tmp, server, agent, generated


def test_walkthrough_build_generate_evaluate(walkthrough):
    tmp, server, agent, generated = walkthrough
    assert "candidates  16: added 4 test, 12 train; rejected 0" in generated.stdout
    # what is sent, told before it is (no terminal here: told, not asked); no price for a model served here
    assert "to send     16 emails in 2 batches to hosted_vllm/gen" in generated.stderr
    assert "the cost is unknown (litellm has no price for hosted_vllm/gen)" in generated.stderr
    db = EmailDB(tmp / "my.db")
    test_qs = qmod.select_questions(db, "test")
    train_qs = qmod.select_questions(db, "train")
    assert len(test_qs) == 4 and len(train_qs) == 12
    assert not {m for q in test_qs for m in q.message_ids} & {m for q in train_qs for m in q.message_ids}
    html_only = db.read("<locker1@home.example>")
    assert (html_only.body == "Hi!\n\nThe code for Harbor locker 1 is 4037."
            and "PDF" not in db.read("<locker0@home.example>").body)
    db.close()
    agent.update({q.question: expert_script(q) for q in test_qs})
    command("test_email_search_agent.py", "--db", tmp / "my.db", "--model", "hosted_vllm/scripted", "--base-url",
            server.base_url, "--output", tmp / "eval", "--art-dir", tmp / "art")
    summary = json.loads((tmp / "eval" / "summary.json").read_text())["models"]["hosted_vllm/scripted"]
    assert summary["n"] == 4 and summary["accuracy"] == 1.0


@pytest.mark.slow
def test_walkthrough_cpu_warm_start_from_a_teacher(walkthrough):
    """Step 4 on a CPU: the teacher's right, correctly cited train-split episodes become the warm start."""
    tmp, server, agent, _ = walkthrough
    db = EmailDB(tmp / "my.db")
    train_qs = qmod.select_questions(db, "train", single_source=True)
    db.close()
    agent.update({q.question: expert_script(q) for q in train_qs})
    agent[train_qs[0].question] = expert_script(train_qs[0], answer="9999")  # a wrong answer
    limit_flags = ["--max-turns", 3, "--max-body-chars", 600, "--search-results", 3]
    command("test_email_search_agent.py", "--db", tmp / "my.db", "--split", "train", "--single-source", "--model",
            "hosted_vllm/scripted", "--base-url", server.base_url, "--output", tmp / "teacher", "--art-dir",
            tmp / "art", *limit_flags)
    result = command("train_email_search_agent.py", "train", "--db", tmp / "my.db", "--name", "distil", "--art-dir",
                     tmp / "art", "--sft-from", tmp / "teacher", "--sft-only", "--sft-epochs", 1, "--sft-batch-size", 4,
                     *limit_flags, "--max-tokens", 48, "--val-size", 0, "--cpu-train-threads", 1)
    assert "the teacher played" not in result.stderr
    # The wrong answer is left out: it would teach the small model to invent.
    assert f"warm start: {len(train_qs) - 1} trajectories from {tmp / 'teacher'}" in result.stderr, result.stderr
    run = tmp / "art" / "email-agent" / "models" / "distil"
    assert (run / "checkpoints" / "0001").is_dir()
    sft_rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines() if "train/loss" in line]
    assert len(sft_rows) == 1 and sft_rows[0]["train/num_trajectories"] > 0


@pytest.mark.slow
def test_walkthrough_tiny_cpu_train(walkthrough):
    tmp, *_ = walkthrough
    result = command("train_email_search_agent.py", "train", "--db", tmp / "my.db", "--name", "mine", "--art-dir",
                     tmp / "art", "--max-steps", 1, "--groups-per-step", 1, "--rollouts-per-group", 2, "--max-turns",
                     2, "--max-tokens", 32, "--val-size", 0, "--cpu-train-threads", 1, "--train-anyway")
    assert re.search(r"^step\s+1\b", result.stdout, re.M), result.stdout
    assert (tmp / "art" / "email-agent" / "models" / "mine" / "checkpoints" / "0001").is_dir()


PHONE = re.compile(r"\(?\b\d{3}\)?[ .-]\d{3}-\d{4}\b")


def real_mail_writer(body):
    """The scripted question writer on real mail: for each email it is shown that gives a phone number, "What
    phone number did SENDER give about SUBJECT?", citing that email."""
    questions = []
    for mid, sender, subject, text in re.findall(r'<email id="([^"]+)">\nDate: [^\n]*\nFrom: ([^\n]*)\nTo: [^\n]*\n'
                                                 r'Subject: ([^\n]*)\n\n(.*?)\n</email>',
                                                 body["messages"][-1]["content"], re.S):
        phone = PHONE.search(text)
        if phone and subject.strip():
            questions.append({"question": f"What phone number did {sender.split('@')[0]} give about "
                                          f"{subject.strip()}?", "answer": phone.group(0), "message_ids": [mid],
                              "how_realistic": 0.7})
    return {"text": json.dumps({"questions": questions[:3]})}


def write_real_mbox(path, inbox_folder, count):
    """The first `count` emails of one CMU inbox folder of the Enron sample, as a mail client would export them."""
    box, written = mailbox.mbox(path), 0
    with gzip.open(ENRON_EMAILS, "rt", encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if record["inbox"] != inbox_folder or "\n" in record["subject"] + record["from_address"]:
                continue
            msg = Message()  # compat32: Enron's address lists hold tokens a strict header parser refuses
            msg["From"], msg["Subject"], msg["Message-ID"] = (record["from_address"], record["subject"],
                                                              record["message_id"])
            if record["to_addresses"]:
                msg["To"] = ", ".join(record["to_addresses"])
            if record["cc_addresses"]:
                msg["Cc"] = ", ".join(record["cc_addresses"])
            msg["Date"] = format_datetime(
                datetime.fromisoformat(parse_date(record["date"])).replace(tzinfo=timezone.utc))
            msg.set_payload(record["body"], charset="utf-8")
            box.add(msg)
            written += 1
            if written == count:
                break
    box.close()


@pytest.mark.slow
def test_walkthrough_on_real_mail_with_the_expert(tmp_path):
    """The README's own-inbox walkthrough, trained as it says, on 300 real emails of one Enron inbox: mbox ->
    build-db -> generate-questions (a scripted writer) -> train --sft-from expert on CPU -> evaluate -> ask."""
    if not ENRON_EMAILS.exists():
        pytest.skip(f"the real Enron sample is not at {ENRON_EMAILS.parent} (it lives beside the checkout)")
    inbox = "tana.jones@enron.com"
    write_real_mbox(tmp_path / "tana.mbox", "jones-t", 300)
    built = command("train_email_search_agent.py", "build-db", "--emails", tmp_path / "tana.mbox", "--db",
                    tmp_path / "me.db", "--quiet")
    assert re.search(r"^emails\s+300 ", built.stdout, re.M), built.stdout
    with serve_in_thread({"gen": real_mail_writer}) as server:
        generated = command("train_email_search_agent.py", "generate-questions", "--db", tmp_path / "me.db", "--model",
                            "hosted_vllm/gen", "--base-url", server.base_url, "--inbox", inbox, "--batch-size", 40,
                            "--max-questions", 16, "--test-fraction", 0.25, "--quiet")
    assert re.search(r"added [1-9]\d* test, [1-9]\d* train", generated.stdout), generated.stdout
    limit_flags = ["--max-turns", 4, "--max-tokens", 64]  # short episodes: the evaluation and ask below play them too
    trained = command("train_email_search_agent.py", "train", "--db", tmp_path / "me.db", "--name", "me", "--art-dir",
                      tmp_path / "art", "--sft-from", "expert", "--sft-only", "--sft-limit", 4, "--sft-batch-size", 4,
                      "--sft-learning-rate", "1e-3", "--val-size", 0, "--cpu-train-threads", 1, *limit_flags)
    ceiling = re.search(r"expert on the (\d+) train questions, in 4 turns: solved (\d+) of", trained.stderr)
    assert ceiling and int(ceiling[2]) > 0, trained.stderr[-3000:]
    assert "warm start: 4 trajectories from expert" in trained.stderr
    assert (tmp_path / "art" / "email-agent" / "models" / "me" / "checkpoints" / "0001").is_dir()
    command("test_email_search_agent.py", "--db", tmp_path / "me.db", "--model", "me", "--limit", 2, "--art-dir",
            tmp_path / "art", "--output", tmp_path / "eval", "--grounded-answers")
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())["models"]
    assert [(label, s["n"], s["n_errors"]) for label, s in summary.items()] == [("me@1", 2, 0)], summary
    db = EmailDB(tmp_path / "me.db")
    question = qmod.select_questions(db, "test")[0]
    db.close()
    asked = command("train_email_search_agent.py", "ask", "--db", tmp_path / "me.db", "--inbox", inbox, "--art-dir",
                    tmp_path / "art", "--model", "me", "--as-of", question.query_date, "--json", question.question)
    answer = json.loads(asked.stdout[asked.stdout.index("{"):])
    assert answer["model"] == "me@1" and answer["question"] == question.question and "answer" in answer, answer
