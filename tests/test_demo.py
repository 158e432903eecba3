"""The demo corpus generator: determinism, schema, integrity of every question, and the difficulty it promises."""

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from datetime import date, datetime
from pathlib import Path

import pytest

from email_agent.data.demo import generate, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
STOPWORDS = {"what", "when", "where", "which", "whom", "whose", "does", "with", "from", "that", "this", "have",
             "were", "your", "about", "into", "much", "many", "there", "their", "they", "them", "then", "than"}
EMAIL_FIELDS = {"message_id": str, "date": str, "subject": str, "from_address": str, "to_addresses": list,
                "cc_addresses": list, "bcc_addresses": list, "body": str, "file_name": str, "inbox": str}
QUESTION_FIELDS = {"id": int, "question": str, "answer": str, "message_ids": list, "how_realistic": float,
                   "inbox_address": str, "query_date": str, "split": str}
DIGEST = ("import hashlib, json\nfrom email_agent.data.demo import generate\n"
          "emails, questions = generate(0)\n"
          "lines = [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in emails + questions]\n"
          "print(hashlib.sha256('\\n'.join(lines).encode()).hexdigest())\n")


@pytest.fixture(scope="module")
def corpus():
    emails, questions = generate(0)
    return emails, questions, {m["message_id"]: m for m in emails}


def participants(mail):
    return [mail["from_address"], *mail["to_addresses"], *mail["cc_addresses"], *mail["bcc_addresses"]]


def day_of(mail):
    return date.fromisoformat(mail["date"][:10])


def test_same_seed_same_output_and_other_seed_differs():
    assert generate(0) == generate(0)
    assert generate(1) != generate(0)
    assert [q["question"] for q in generate(1)[1]] != [q["question"] for q in generate(0)[1]]


def test_output_is_identical_across_processes_with_different_hash_seeds():
    digests = set()
    for hash_seed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", DIGEST], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True)
        digests.add(out.stdout.strip())
    emails, questions = generate(0)
    lines = [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in emails + questions]
    digests.add(hashlib.sha256("\n".join(lines).encode()).hexdigest())
    assert len(digests) == 1


def test_write_jsonl_is_byte_stable_and_round_trips(tmp_path, corpus):
    emails, questions, _ = corpus
    write_jsonl(questions, tmp_path / "a.jsonl")
    write_jsonl(generate(0)[1], tmp_path / "b.jsonl")
    raw = (tmp_path / "a.jsonl").read_bytes()
    assert raw == (tmp_path / "b.jsonl").read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == len(questions)
    assert [json.loads(line) for line in raw.decode("utf-8").splitlines()] == questions
    first = raw.split(b"\n")[0].decode()
    assert list(json.loads(first)) == sorted(json.loads(first))  # keys written sorted


def test_email_schema(corpus):
    emails, _, _ = corpus
    for mail in emails:
        assert set(mail) == set(EMAIL_FIELDS), mail["message_id"]
        for field, kind in EMAIL_FIELDS.items():
            assert isinstance(mail[field], kind), (field, mail["message_id"])
        for address in participants(mail):
            assert isinstance(address, str) and address == address.lower() and "@" in address
        assert mail["to_addresses"] or mail["bcc_addresses"]
        datetime.strptime(mail["date"], "%Y-%m-%dT%H:%M:%SZ")
        assert re.fullmatch(r"<demo\.\d{6}@larkspur\.example>", mail["message_id"])
        assert re.fullmatch(rf"demo/{re.escape(mail['inbox'])}/(inbox|sent)/\d+", mail["file_name"])
        assert mail["subject"].strip() and mail["body"].strip()


def test_emails_sorted_unique_and_in_working_window(corpus):
    emails, _, _ = corpus
    assert emails == sorted(emails, key=lambda m: (m["date"], m["message_id"]))
    assert len({m["message_id"] for m in emails}) == len(emails)
    assert len({m["file_name"] for m in emails}) == len(emails)
    days = [day_of(m) for m in emails]
    assert (max(days) - min(days)).days >= 150  # spread over about six months
    assert all(d.weekday() < 5 for d in days)
    assert all(6 <= int(m["date"][11:13]) < 18 for m in emails)


def test_question_schema(corpus):
    _, questions, _ = corpus
    for q in questions:
        assert set(q) == set(QUESTION_FIELDS), q["id"]
        for field, kind in QUESTION_FIELDS.items():
            assert isinstance(q[field], kind), (field, q["id"])
        assert all(isinstance(m, str) for m in q["message_ids"])
        assert 0.3 <= q["how_realistic"] <= 1.0 and round(q["how_realistic"], 2) == q["how_realistic"]
        assert q["split"] in ("train", "test")
        assert q["inbox_address"] == q["inbox_address"].lower()
        assert date.fromisoformat(q["query_date"]).isoformat() == q["query_date"]
        assert q["question"].endswith("?")
    assert len({q["id"] for q in questions}) == len(questions)


def test_every_question_is_grounded_in_one_gold_email(corpus):
    _, questions, by_id = corpus
    for q in questions:
        assert len(q["message_ids"]) == 1, q
        gold = by_id[q["message_ids"][0]]
        assert q["inbox_address"] in participants(gold), q
        assert q["answer"] in gold["body"], q
        assert 1 <= len(q["answer"].split()) <= 6, q
        assert date.fromisoformat(q["query_date"]) > day_of(gold), q
        assert (date.fromisoformat(q["query_date"]) - day_of(gold)).days <= 14, q


def test_counts(corpus):
    emails, questions, _ = corpus
    splits = Counter(q["split"] for q in questions)
    assert 400 <= len(emails) <= 600
    assert len(questions) >= 300
    assert splits["test"] >= 100 and splits["train"] >= 150
    asked_about = {q["inbox_address"] for q in questions}
    assert 5 <= len(asked_about) <= 6
    assert len({m["inbox"] for m in emails}) == len(asked_about)


def test_questions_share_a_keyword_with_their_gold_email(corpus):
    _, questions, by_id = corpus
    for q in questions:
        gold = by_id[q["message_ids"][0]]
        text = set(re.findall(r"[a-z0-9]+", (gold["subject"] + " " + gold["body"]).lower()))
        words = {w for w in re.findall(r"[a-z]+", q["question"].lower()) if len(w) >= 4 and w not in STOPWORDS}
        assert words & text, q


def test_no_thread_is_split_between_train_and_test(corpus):
    _, questions, by_id = corpus
    split_of = {}
    for q in questions:
        subject = by_id[q["message_ids"][0]]["subject"].removeprefix("Re: ")
        split_of.setdefault((q["inbox_address"], subject), set()).add(q["split"])
    assert all(len(splits) == 1 for splits in split_of.values())


def test_difficulty_cc_only_inboxes_replies_and_mail_from_the_future(corpus):
    emails, questions, by_id = corpus
    golds = [by_id[q["message_ids"][0]] for q in questions]
    cc_only = [q for q, g in zip(questions, golds)
               if q["inbox_address"] in g["cc_addresses"]
               and q["inbox_address"] != g["from_address"] and q["inbox_address"] not in g["to_addresses"]]
    assert len(cc_only) >= 10
    assert sum(g["subject"].startswith("Re: ") for g in golds) >= 30  # gold emails that are replies in a thread
    # Mail the agent must not see: dated after the question's day, in the same inbox, naming the same
    # project, city or partner (the question's capitalised words after its first).
    later_on_topic = 0
    for q, gold in zip(questions, golds):
        asked = date.fromisoformat(q["query_date"])
        names = re.findall(r"\b[A-Z][a-z]{3,}", q["question"].split(" ", 1)[1])
        assert names, q
        later_on_topic += any(day_of(m) > asked and q["inbox_address"] in participants(m)
                              and any(n in m["subject"] + m["body"] for n in names) for m in emails)
    assert later_on_topic >= 20


def test_noise_is_never_gold(corpus):
    emails, questions, _ = corpus
    gold_ids = {q["message_ids"][0] for q in questions}
    noise = [m for m in emails if m["to_addresses"] == ["all-staff@larkspur.example"]
             or m["from_address"].endswith(("energywire.example", "gridline.example"))]
    assert len(noise) >= 60
    assert not gold_ids & {m["message_id"] for m in noise}
