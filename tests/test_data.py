"""The database build (sources, atomicity, counts) and the read-only search/read queries."""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import email
import gzip
import json
import mailbox
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, needs_enron
from email_agent.data import email_db, questions, sources
from email_agent.data.build import build_database
from email_agent.config import TrainConfig
from email_agent.data.email_db import EmailDB
from email_agent.data.sources import normalize_email
from email_agent.agent.tools import TOOLS, Inbox, call_tool, parse_arguments


def record(i, **over):
    row = {"message_id": f"<m{i}@x>", "date": f"2001-05-{1 + i % 28:02d}T10:00:00Z", "subject": f"subject {i}",
           "from_address": "Alice@X.com", "to_addresses": ["bob@x.com"], "cc_addresses": ["carol@x.com"],
           "bcc_addresses": [], "body": f"body number {i} about the falcon pipeline", "file_name": f"f/{i}"}
    row.update(over)
    return row


def question(i, **over):
    row = {"id": i, "question": f"q{i}?", "answer": "a", "message_ids": [f"<m{i}@x>"], "how_realistic": 0.5,
           "inbox_address": "bob@x.com", "query_date": "2001-06-30", "split": "train"}
    row.update(over)
    return row


@pytest.fixture()
def small_db(tmp_path):
    emails = [record(i) for i in range(10)]
    emails += [record(3), {"subject": "no id"}, record(20, date="not a date"), record(21, date=None)]
    emails += [record(30, from_address="dave@x.com", to_addresses=["erin@x.com"], cc_addresses=[],
                      body="falcon secret for erin only", date="2001-05-02T10:00:00Z"),
               record(31, date="2001-07-15T10:00:00Z", body="falcon news from the future")]
    qs = [question(1), question(2, split="test"), question(3, message_ids=["<missing@x>"]),
          question(4, message_ids=["<m4@x>", "<m5@x>"], how_realistic=0.9), {"id": 5, "question": "no answer"}]
    path = tmp_path / "small.db"
    summary = build_database(emails, qs, path, source="test", progress=False)
    db = EmailDB(path)
    yield summary, db
    db.close()


def test_build_counts_duplicates_and_malformed(small_db):
    summary, db = small_db
    assert summary.emails == 12
    assert summary.duplicates == 1
    assert summary.skipped == {"missing message_id": 1, "unparseable date": 1, "missing date": 1}
    assert summary.questions == {"train": 3, "test": 1}
    assert summary.questions_missing_gold == 1 and summary.questions_skipped == 1
    assert summary.first_date == "2001-05-01 10:00:00" and summary.last_date == "2001-07-15 10:00:00"
    assert db.meta()["emails"] == "12"


def test_read_returns_recipients_lowercased(small_db):
    _, db = small_db
    email = db.read("<m2@x>")
    assert email.from_address == "alice@x.com"
    assert (email.to_addresses, email.cc_addresses, email.bcc_addresses) == (["bob@x.com"], ["carol@x.com"], [])
    assert email.date == "2001-05-03 10:00:00"


def test_inbox_scoping_search_and_read(small_db):
    _, db = small_db
    ids = {r.message_id for r in db.search("bob@x.com", ["falcon"], max_results=20)}
    assert "<m30@x>" not in ids and "<m1@x>" in ids
    assert {r.message_id for r in db.search("erin@x.com", ["falcon"])} == {"<m30@x>"}
    assert {r.message_id for r in db.search("carol@x.com", ["falcon"], max_results=20)} == ids  # cc counts
    assert db.read("<m30@x>", inbox="bob@x.com") is None
    assert db.read("<m30@x>", inbox="ERIN@x.com").message_id == "<m30@x>"
    assert db.search("nobody@x.com", ["falcon"]) == []


def test_date_bounds(small_db):
    _, db = small_db
    future = "<m31@x>"
    assert future in {r.message_id for r in db.search("bob@x.com", ["falcon"], max_results=20)}
    visible = {r.message_id for r in db.search("bob@x.com", ["falcon"], max_results=20,
                                              visible_until=email_db.day_after("2001-06-30"))}
    assert future not in visible and len(visible) == 10
    assert db.read(future, visible_until=email_db.day_after("2001-06-30")) is None
    assert db.read(future, visible_until=email_db.day_after("2001-07-15")) is not None  # same day stays visible
    after = {r.message_id for r in db.search("bob@x.com", ["falcon"], sent_after="2001-05-05",
                                             sent_before="2001-05-07")}
    assert after == {"<m4@x>", "<m5@x>"}  # dated 05-05 and 05-06: after is inclusive, before exclusive
    with pytest.raises(ValueError):
        db.search("bob@x.com", ["falcon"], sent_after="last tuesday")


def test_search_and_ranking_and_clamp(small_db):
    _, db = small_db
    assert len(db.search("bob@x.com", ["falcon"], max_results=1000)) == 11  # clamped to 20, 11 exist
    assert len(db.search("bob@x.com", ["falcon"], max_results=-5)) == 1
    assert [r.message_id for r in db.search("bob@x.com", ["number 7"])] == ["<m7@x>"]  # a phrase
    assert db.search("bob@x.com", ["falcon", "number 7"])[0].snippet.count("**") >= 2  # highlighted
    assert db.search("bob@x.com", ["falcon", "zebra"]) == []  # AND


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keywords=st.lists(st.text(), max_size=5))
def test_hostile_keywords_never_raise(small_db, keywords):
    _, db = small_db
    for kw in (keywords, keywords + ["falcon"]):
        assert isinstance(db.search("bob@x.com", kw), list)


# keyword -> what it finds alone, and beside "falcon": every FTS5 operator is taken literally. Punctuation is not
# part of a token (so "falcon*" is the word falcon); a keyword without a token finds nothing alone and is ignored
# beside another; operators are words, so "falcon OR zebra" is a phrase no email holds, and "body:" names no column.
FALCON = "falcon"  # the ten visible emails of bob@x.com saying "falcon pipeline"
LITERAL = {'"': ([], FALCON), '""': ([], FALCON), "*": ([], FALCON), "": ([], FALCON), "   ": ([], FALCON),
           "falcon*": (FALCON, FALCON), "-falcon": (FALCON, FALCON), "(falcon": (FALCON, FALCON),
           "^falcon": (FALCON, FALCON), "\x00falcon": (FALCON, FALCON),
           "NEAR(falcon pipeline)": ([], []), "falcon AND": ([], []), "body:falcon": ([], []),
           "falcon OR zebra": ([], [])}


@pytest.mark.parametrize("kw", list(LITERAL))
def test_fts_operators_are_literal(small_db, kw):
    """Catches a search that passes FTS5 syntax through: an OR, NEAR, column filter or prefix * would widen or
    break the search the agent asked for."""
    _, db = small_db
    falcon = [r.message_id for r in db.search("bob@x.com", ["falcon"])]
    assert len(falcon) == 10
    alone, beside = ([r.message_id for r in db.search("bob@x.com", keywords)] for keywords in ([kw], [kw, "falcon"]))
    expected_alone, expected_beside = (falcon if e == FALCON else e for e in LITERAL[kw])
    assert (alone, beside) == (expected_alone, expected_beside)


def test_from_and_to_filters_find_what_they_name(small_db):
    """Positive cases of the sender and recipient filters (a filter that matched nothing would pass a test that
    only checks what it excludes)."""
    _, db = small_db
    assert {r.message_id for r in db.search("erin@x.com", ["falcon"], from_address="dave@x.com")} == {"<m30@x>"}
    assert db.search("erin@x.com", ["falcon"], from_address="alice@x.com") == []
    to_bob = {r.message_id for r in db.search("carol@x.com", ["falcon"], to_address="BOB@x.com", max_results=20)}
    assert to_bob == {f"<m{i}@x>" for i in range(10)} | {"<m31@x>"}
    cc_carol = {r.message_id for r in db.search("bob@x.com", ["falcon"], to_address="carol@x.com", max_results=20)}
    assert cc_carol == to_bob  # to_address matches cc too
    assert db.search("bob@x.com", ["falcon"], to_address="erin@x.com") == []


# ---- the agent's tools: the search and read it is given, and its mistakes ----------------------------------

def test_the_agents_search_keeps_its_filters_and_its_default_count(small_db):
    """What `search_inbox` finds through the agent's tool: each filter the model sends reaches the search (a
    dropped one would list mail it excludes), the inbox's default count applies when the model names none."""
    _, db = small_db
    inbox = Inbox(db, "bob@x.com", "2001-06-30", default_max_results=3)

    def found(**arguments):
        outcome = call_tool(inbox, "search_inbox", {"keywords": ["falcon"], **arguments})
        assert outcome.error is None and outcome.arguments == {"keywords": ["falcon"], **arguments}
        assert outcome.result == (json.loads(outcome.content) if outcome.result else [])  # what the model is shown
        return [r["message_id"] for r in outcome.result]

    assert len(found()) == 3 and len(found(max_results=5)) == 5
    assert found(from_address="dave@x.com") == [] and len(found(from_address="alice@x.com")) == 3
    assert found(to_address="erin@x.com") == [] and len(found(to_address="carol@x.com")) == 3
    assert sorted(found(sent_after="2001-05-05", sent_before="2001-05-07")) == ["<m4@x>", "<m5@x>"]
    assert "<m31@x>" not in found(max_results=20)  # sent on 07-15, after the question's day
    assert "<m31@x>" in {r["message_id"]
                         for r in Inbox(db, "bob@x.com", "2001-07-15").search_inbox(["falcon"], max_results=20)}
    empty = call_tool(inbox, "search_inbox", {"keywords": ["zebra"]})
    assert (empty.error, empty.result) == (None, []) and empty.content.startswith("No emails matched")


def test_the_agents_read_shows_what_tells_it_something_and_cuts_long_bodies(small_db):
    _, db = small_db
    body = db.read("<m2@x>").body
    outcome = call_tool(Inbox(db, "bob@x.com", "2001-06-30", max_body_chars=10), "read_email", {"message_id": "<m2@x>"})
    shown = json.loads(outcome.content)
    assert outcome.error is None and outcome.result == shown
    assert "file_name" not in shown and "bcc_addresses" not in shown  # empty or the agent's no business: not shown
    assert shown["cc_addresses"] == ["carol@x.com"] and shown["subject"] == "subject 2"
    assert shown["body"] == body[:10] + f"\n[... {len(body) - 10} more characters cut]"
    whole = call_tool(Inbox(db, "bob@x.com", "2001-06-30", max_body_chars=len(body)), "read_email",
                      {"message_id": "<m2@x>"})
    assert whole.result["body"] == body  # a body of exactly the limit is not cut
    hidden = call_tool(Inbox(db, "bob@x.com", "2001-06-30"), "read_email", {"message_id": "<m30@x>"})
    assert (hidden.error, hidden.result) == (None, None) and "no email with message_id '<m30@x>'" in hidden.content


def test_tool_argument_mistakes_are_caught_and_shown_with_a_call_that_works(small_db):
    inbox = Inbox(small_db[1], "bob@x.com", "2001-06-30")
    unknown, malformed = call_tool(inbox, "delete_inbox", {}), call_tool(inbox, "read_email", "{")
    assert (unknown.name, unknown.error, malformed.name, malformed.error) == ("delete_inbox", "bad_tool_name",
                                                                              "read_email", "bad_tool_args")
    assert malformed.content.startswith("Error: the arguments of read_email are not valid JSON")
    assert unknown.content.endswith("the tools are search_inbox, read_email, return_final_answer.")  # the real names
    assert {t["function"]["name"] for t in TOOLS} == {"search_inbox", "read_email", "return_final_answer"}
    for name in ("search_inbox", "read_email", "return_final_answer"):
        with pytest.raises(ValueError, match="must be a JSON object like ") as caught:
            parse_arguments(name, "[1]")
        example = str(caught.value).split(" like ", 1)[1]
        assert parse_arguments(name, example) == json.loads(example)  # the example given is itself a good call
    with pytest.raises(ValueError, match="read_email needs 'message_id'"):
        parse_arguments("read_email", None)
    assert parse_arguments("search_inbox", {"keywords": ["a"], "from_address": None}) == {"keywords": ["a"]}
    with pytest.raises(ValueError, match="'max_results' must be an integer"):  # a None skipped, not the rest
        parse_arguments("search_inbox", {"keywords": ["a"], "from_address": None, "max_results": "ten"})
    for arguments, message in [({"keywords": ["a"], "max_results": True}, "'max_results' must be an integer"),
                               ({"keywords": ["a", 1]}, "'keywords' must be a list of strings"),
                               ({"keywords": ["a"], "from_address": 5}, "'from_address' must be a string"),
                               ({"keywords": ["a"], "sent_before": "2001-13-01"}, "'sent_before' must be a date like")]:
        with pytest.raises(ValueError, match=message):
            parse_arguments("search_inbox", arguments)


def test_the_agent_is_shown_the_arguments_it_sent_and_text_as_written(tmp_path):
    """A read's outcome carries the arguments the model sent (the rollout counts reads of the gold email from
    them); search and read results show accented text as written, not as \\u escapes that cost the model tokens
    and hide the words; several wrong or missing argument names are all named."""
    build_database([record(1, subject="Réunion café", body="falcon à Zürich")], [], tmp_path / "a.db", source="t",
                   progress=False)
    db = EmailDB(tmp_path / "a.db")
    try:
        inbox = Inbox(db, "bob@x.com", "2001-06-30")
        read = call_tool(inbox, "read_email", '{"message_id": "<m1@x>"}')
        assert read.arguments == {"message_id": "<m1@x>"} and read.result["subject"] == "Réunion café"
        found = call_tool(inbox, "search_inbox", {"keywords": ["falcon"]})
        for outcome in (read, found):
            assert "Réunion café" in outcome.content and "\\u" not in outcome.content
    finally:
        db.close()
    with pytest.raises(ValueError) as unknown:
        parse_arguments("search_inbox", {"keywords": ["a"], "folder": "x", "limit": 3})
    assert str(unknown.value) == ("search_inbox has no argument 'folder', 'limit'; its arguments are keywords, "
                                  "from_address, to_address, sent_after, sent_before, max_results")
    with pytest.raises(ValueError, match="^return_final_answer needs 'answer', 'sources'; e.g. "):
        parse_arguments("return_final_answer", {})


def test_read_for_a_person_and_the_text_of_mail_and_search_results(small_db):
    """`read` and `search` on the command line: the email as its headers and body, each result as rank, date,
    sender, subject, id and the snippet wrapped at 100 characters; a missing id says so (with the angle-bracket
    hint only when they are missing)."""
    _, db = small_db
    email = db.read_or_explain("<m2@x>", inbox="bob@x.com", as_of="2001-06-30")
    assert email == db.read("<m2@x>")
    assert email.as_text() == ("Message-ID: <m2@x>\nDate: 2001-05-03 10:00:00 UTC\nFrom: alice@x.com\n"
                               "To: bob@x.com\nCc: carol@x.com\nSubject: subject 2\n\n"
                               "body number 2 about the falcon pipeline")
    two = dataclasses.replace(email, to_addresses=["bob@x.com", "dan@x.com"], bcc_addresses=["eve@x.com"])
    assert "\nTo: bob@x.com, dan@x.com\nCc: carol@x.com\nBcc: eve@x.com\nSubject: " in two.as_text()
    with pytest.raises(email_db.UserError) as bare:
        db.read_or_explain("m2@x")
    assert str(bare.value) == "No email with message_id 'm2@x' (ids are written with angle brackets: '<m2@x>')."
    with pytest.raises(email_db.UserError) as missing:
        db.read_or_explain("<m99@x>")
    assert str(missing.value) == "No email with message_id '<m99@x>'."
    words = " ".join(f"word{i:02d}" for i in range(30))  # 30 x 6 characters + spaces: wraps after 14 words
    result = email_db.SearchResult("<m2@x>", "subject 2", "alice@x.com", "2001-05-03 10:00:00", "  " + words + "\n ")
    assert result.as_text(3).splitlines() == [
        " 3. 2001-05-03 10:00:00  alice@x.com  subject 2", "    <m2@x>",
        "    " + " ".join(f"word{i:02d}" for i in range(14)), "    " + " ".join(f"word{i:02d}" for i in range(14, 28)),
        "    word28 word29"]


def test_what_hides_an_email_and_which_inboxes_exist_are_said_in_full(small_db, tmp_path):
    """`read` names exactly the flags that hide an email that exists; `--as-of` is named when its date is
    malformed; a mistyped inbox lists the five largest, "address (count)" apart by commas; a snippet of 101
    characters is wrapped at 100."""
    _, db = small_db
    with pytest.raises(email_db.UserError) as other_inbox:
        db.read_or_explain("<m30@x>", inbox="bob@x.com")  # erin's email, asked in bob's inbox
    assert str(other_inbox.value) == ("Email '<m30@x>' exists, but --inbox bob@x.com hides it (not that inbox's, "
                                      "or sent after that day).")
    with pytest.raises(email_db.UserError) as both:
        db.read_or_explain("<m31@x>", inbox="bob@x.com", as_of="2001-06-30")  # sent 07-15
    assert "exists, but --inbox bob@x.com --as-of 2001-06-30 hides it" in str(both.value)
    with pytest.raises(email_db.UserError, match="^--as-of must be a date like 2001-05-31, not '2001-06-30x'$"):
        email_db.visible_until("2001-06-30x")
    people = [f"p{i}@x.com" for i in range(7)]  # p0 in 7 emails, p1 in 6, ... p6 in 1; each sender in 1
    build_database([record(i, from_address=f"s{i}@x.com", to_addresses=people[:7 - i], cc_addresses=[])
                    for i in range(7)], [], tmp_path / "p.db", source="t", progress=False)
    many = EmailDB(tmp_path / "p.db")
    try:
        with pytest.raises(email_db.UserError) as typo:
            many.require_inbox("p9@x.com")
        assert str(typo.value).startswith(f"{tmp_path / 'p.db'} has no mail")  # the database searched
        assert str(typo.value).endswith("has no mail sent or received by 'p9@x.com'; its largest inboxes: "
                                        "p0@x.com (7), p1@x.com (6), p2@x.com (5), p3@x.com (4), p4@x.com (3).")
    finally:
        many.close()
    wide = email_db.SearchResult("<m2@x>", "s", "a@x.com", "2001-05-03 10:00:00", "a" * 50 + " " + "b" * 50)
    assert wide.as_text(1).splitlines()[2:] == ["    " + "a" * 50, "    " + "b" * 50]


def test_a_keyword_with_a_double_quote_and_a_timestamp_for_a_day(small_db):
    """A double quote inside a keyword is escaped as FTS5 wants ("" inside the phrase), not dropped or garbled:
    `falcon"pipeline` finds what the phrase `falcon pipeline` finds; a timestamp passed where a day is expected
    names that day."""
    _, db = small_db
    phrase = [r.message_id for r in db.search("bob@x.com", ["falcon pipeline"])]
    assert len(phrase) == 10 and [r.message_id for r in db.search("bob@x.com", ['falcon"pipeline'])] == phrase
    assert email_db.day_start("2001-06-30 17:45:00") == "2001-06-30 00:00:00"
    assert email_db.day_after("2001-06-30T17:45:00") == "2001-07-01 00:00:00"


def test_one_database_serves_many_threads(small_db):
    """`serve` and the rollouts read one open database from worker threads: a connection bound to the thread
    that opened it would fail there."""
    _, db = small_db
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hits = pool.submit(lambda: len(db.search("bob@x.com", ["falcon"]))).result()
    assert hits == 10


def test_database_is_read_only(small_db):
    _, db = small_db
    with pytest.raises(sqlite3.OperationalError):
        db.conn.execute("DELETE FROM emails")


def test_missing_or_foreign_database(tmp_path):
    with pytest.raises(email_db.UserError, match="build-db"):
        EmailDB(tmp_path / "nope.db")
    (tmp_path / "junk.db").write_text("not sqlite")
    with pytest.raises(email_db.UserError, match="cannot be read as an email database of this tool"):
        EmailDB(tmp_path / "junk.db")


def test_rebuild_is_idempotent(tmp_path):
    emails = [record(i) for i in range(50)]
    counts = []
    for _ in range(2):
        build_database(emails, [question(1)], tmp_path / "a.db", source="t", progress=False)
        conn = sqlite3.connect(tmp_path / "a.db")
        counts.append([conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                       for t in ("emails", "recipients", "mailbox", "questions")])
        conn.close()
    assert counts[0] == counts[1] == [50, 100, 150, 1]
    assert list(tmp_path.iterdir()) == [tmp_path / "a.db"]  # no temporary files left


def test_failed_build_keeps_previous_database(tmp_path):
    path = tmp_path / "a.db"
    build_database([record(1)], [], path, source="t", progress=False)

    def exploding():
        yield record(2)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        build_database(exploding(), [], path, source="t", progress=False)
    assert EmailDB(path).read("<m1@x>") is not None
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(email_db.UserError, match="No usable emails"):
        build_database([{"subject": "x"}], [], tmp_path / "b.db", source="t", progress=False)
    assert not (tmp_path / "b.db").exists()


SLOW_BUILD = """
import sys, time
sys.path.insert(0, {root!r})
from email_agent.data.build import build_database
from email_agent.cli import stop_on_sigterm
stop_on_sigterm()  # as the CLI does: SIGTERM unwinds like Ctrl-C
def emails():
    for i in range(10**7):
        if i == 2000:
            print("started", flush=True)
        yield {{"message_id": f"<{{i}}@x>", "date": "2001-01-01", "from_address": "a@x", "body": "w" * 50}}
build_database(emails(), [], {path!r}, source="slow", progress=False)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_build_leaves_no_database(tmp_path, sig):
    path = tmp_path / "db" / "enron.db"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_BUILD.format(root=str(ROOT), path=str(path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert not path.exists()
    leftovers = list(path.parent.iterdir())
    if sig != signal.SIGKILL:
        assert leftovers == []  # the unwinding build removed its temporary file
    build_database([record(1)], [], path, source="t", progress=False)  # the next build sweeps SIGKILL leftovers
    assert list(path.parent.iterdir()) == [path]


# ---- sources ---------------------------------------------------------------------------------------

def test_jsonl_gz_and_bad_lines(tmp_path):
    path = tmp_path / "e.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(record(1)) + "\n{not json\n\n" + json.dumps(record(2)) + "\n")
    summary = build_database(sources.read_emails(path), [], tmp_path / "a.db", source="t", progress=False)
    assert summary.emails == 2 and summary.skipped == {"line 2 is not JSON": 1}


def test_maildir_and_mbox_sources(tmp_path):
    raw = (b"Message-ID: <mail1@x>\nDate: Mon, 14 May 2001 16:39:00 -0700 (PDT)\n"
           b"From: Phillip Allen <phillip.allen@x.com>\nTo: tim.belden@x.com, John <john@x.com>\n"
           b"Subject: Forecast\n\tupdate\nContent-Type: text/plain; charset=us-ascii\n\nHere is our forecast.\r\n")
    msg = email.message_from_bytes(raw)
    folder = tmp_path / "maildir" / "allen-p" / "inbox"
    folder.mkdir(parents=True)
    (folder / "1.").write_bytes(raw)
    box = mailbox.mbox(tmp_path / "mail.mbox")
    box.add(msg)
    box.close()
    for source in (tmp_path / "maildir", tmp_path / "mail.mbox"):
        rows = [normalize_email(r) for r in sources.read_emails(source)]
        assert len(rows) == 1
        row = rows[0]
        assert row["date"] == "2001-05-14 23:39:00"  # converted to UTC
        assert row["from_address"] == "phillip.allen@x.com"
        assert row["to"] == ["tim.belden@x.com", "john@x.com"]
        assert row["subject"] == "Forecastupdate"  # CMU-style fold removed
        assert row["body"].strip() == "Here is our forecast."
    assert rows[0]["file_name"].endswith("#0")
    with pytest.raises(email_db.UserError):
        sources.read_emails(tmp_path / "missing.jsonl")


def test_a_folder_of_json_lines_parquet_and_mail_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "part1.jsonl").write_text("".join(json.dumps(record(i)) + "\n" for i in (1, 2)))
    pq.write_table(pa.Table.from_pylist([record(3)]), folder / "part2.parquet")
    (folder / "one.eml").write_bytes(b"Message-ID: <eml1@x>\nDate: Mon, 14 May 2001 16:39:00 -0700\n"
                                     b"From: a@x.com\nTo: b@x.com\nSubject: Hi\n\nHello.\n")
    ids = sorted(normalize_email(r)["message_id"] for r in sources.read_emails(folder))
    assert ids == ["<eml1@x>", "<m1@x>", "<m2@x>", "<m3@x>"]


def test_records_of_the_wrong_shape_are_skipped_and_counted_not_fatal(tmp_path):
    lines = ["\ufeff" + json.dumps(record(1)), "[1, 2]", "42", "null", json.dumps(record(2, message_id=7)),
             json.dumps(record(3, to_addresses=5)), json.dumps(record(4, subject=["x"])),
             json.dumps(record(5, body={"a": 1})), json.dumps(record(6, body="lone \ud800 surrogate")),
             json.dumps(record(8, date=988000000)), json.dumps(record(9, date=988000000000))]
    (tmp_path / "e.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    qs = [question(i, id=qid, message_ids=[f"<m{i}@x>"]) for i, qid in ((1, "a"), (9, "a"), (8, "b"))]
    summary = build_database(sources.read_emails(tmp_path / "e.jsonl"), qs, tmp_path / "a.db", source="t",
                             progress=False)
    assert summary.emails == 5  # the BOM line, the numeric id, the surrogate, both Unix times
    assert summary.skipped == {"not a JSON object": 3, "to_addresses is neither an address nor a list of them": 1,
                               "subject is not text": 1, "body is not text": 1}
    db = EmailDB(tmp_path / "a.db")
    assert db.read("7") is not None and db.read("<m6@x>").body == "lone ? surrogate"
    assert db.read("<m8@x>").date == "2001-04-23 04:26:40" == db.read("<m9@x>").date
    assert summary.questions == {"train": 2} and summary.questions_skipped == 1  # the second id "a" is skipped
    assert db.conn.execute("SELECT message_ids FROM questions WHERE id = 'a'").fetchone()[0] == '["<m1@x>"]'
    assert normalize_email(record(1, date=datetime.date(2001, 5, 2)))["date"] == "2001-05-02 00:00:00"  # Parquet date32


def test_a_question_whose_inbox_does_not_hold_its_email_is_not_answerable(tmp_path):
    emails = [record(1), record(2, from_address="dave@x.com", to_addresses=["erin@x.com"], cc_addresses=[])]
    qs = [question(1), question(2), question(3, message_ids=["<m1@x>", "<m1@x>"])]  # bob@x.com's inbox
    summary = build_database(emails, qs, tmp_path / "a.db", source="t", progress=False)
    assert summary.questions_missing_gold == 1  # <m2@x> is between dave and erin only
    answerable = EmailDB(tmp_path / "a.db").conn.execute("SELECT id FROM questions WHERE gold_in_db ORDER BY id")
    assert [qid for (qid,) in answerable] == [1, 3]


def test_a_build_refuses_another_programs_database_and_a_folder_it_cannot_write(tmp_path):
    from email_agent.data.build import check_target

    other = tmp_path / "contacts.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE contacts (name)")
    with pytest.raises(email_db.UserError, match="another program's SQLite database \\(tables: contacts\\)"):
        check_target(other, [], brings_questions=True)
    check_target(other, [], brings_questions=True, overwrite=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(email_db.UserError, match="cannot write the database at"):
        build_database([record(1)], [], tmp_path / "afile" / "x.db", source="t", progress=False)


def test_a_build_leaves_the_temporary_file_of_a_running_build_alone(tmp_path):
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live, dead = tmp_path / f"a.db.tmp-{running.pid}", tmp_path / "a.db.tmp-999999999"
        live.write_text("another build"), dead.write_text("a killed build")
        build_database([record(1)], [], tmp_path / "a.db", source="t", progress=False)
        assert live.exists() and not dead.exists()
    finally:
        running.kill()
        running.wait()


def test_databases_that_lack_what_search_reads_are_refused_when_opened(tmp_path):
    build_database([record(1)], [], tmp_path / "a.db", source="t", progress=False)
    with sqlite3.connect(tmp_path / "a.db") as conn:
        conn.execute("DROP TABLE mailbox")
    with pytest.raises(email_db.UserError, match="no such table: mailbox"):
        EmailDB(tmp_path / "a.db")


def test_dates_at_the_end_of_the_calendar_and_malformed_ones():
    assert email_db.visible_until("9999-12-31") > "9999-12-31 23:59:59"
    with pytest.raises(ValueError, match="not a date: '99999-01-01'"):
        email_db.day_start("99999-01-01")
    # years before 1000 keep four digits, so dates still compare as text (strftime wrote year 999 as '999')
    assert sources.parse_date("0999-06-01") == "0999-06-01 00:00:00" < email_db.day_start("2024-01-01")
    with pytest.raises(sources.SkipRecord, match="unparseable date"):  # before the first day there is, in UTC
        sources.parse_date("0001-01-01T00:00:00+05:00")


def test_a_file_or_folder_without_mail_says_so(tmp_path):
    (tmp_path / "notes.mbox").write_text("hello\nnot mail\n")
    (tmp_path / "empty.mbox").write_text("")
    with pytest.raises(email_db.UserError, match="is not an mbox file: its first line is 'hello'"):
        sources.read_emails(tmp_path / "notes.mbox")
    with pytest.raises(email_db.UserError, match="is not an mbox file: it is empty"):
        sources.read_emails(tmp_path / "empty.mbox")
    (tmp_path / "folder").mkdir()
    with pytest.raises(email_db.UserError, match=r"^No emails in folder\.$"):
        build_database(sources.read_emails(tmp_path / "folder"), [], tmp_path / "a.db", source="folder",
                       progress=False)
    assert not (tmp_path / "a.db").exists()


def test_hub_schema_via_parquet(tmp_path):
    """The Hugging Face corbt/enron-emails columns (from/to/cc/bcc, timestamp date), without the network."""
    import datetime as dt

    import datasets

    features = datasets.Features({
        "message_id": datasets.Value("string"), "subject": datasets.Value("string"), "from": datasets.Value("string"),
        "to": datasets.Sequence(datasets.Value("string")), "cc": datasets.Sequence(datasets.Value("string")),
        "bcc": datasets.Sequence(datasets.Value("string")), "date": datasets.Value("timestamp[us]"),
        "body": datasets.Value("string"), "file_name": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({
        "message_id": ["<h1@x>"], "subject": ["Hi"], "from": ["a@x.com"], "to": [["b@x.com"]], "cc": [[]],
        "bcc": [["c@x.com"]], "date": [dt.datetime(2001, 3, 4, 5, 6, 7)], "body": ["hello"],
        "file_name": ["x/1."]}, features=features)
    ds.to_parquet(tmp_path / "hub.parquet")
    build_database(sources.read_emails(tmp_path / "hub.parquet"), [], tmp_path / "a.db", source="t", progress=False)
    email = EmailDB(tmp_path / "a.db").read("<h1@x>")
    assert (email.date, email.to_addresses, email.bcc_addresses) == ("2001-03-04 05:06:07", ["b@x.com"], ["c@x.com"])
    for row in ds:  # what read_hub_emails yields goes through the same normaliser
        assert normalize_email(row)["from_address"] == "a@x.com"


def test_hub_questions_are_both_splits_each_row_tagged_with_its_own(monkeypatch):
    hub = {"corbt/enron_emails_sample_questions": {"train": [{"id": 1}, {"id": 2}], "test": [{"id": 3}]}}
    monkeypatch.setattr(sources, "load_hub_dataset", hub.__getitem__)
    assert list(questions.read_hub_questions()) == [{"id": 1, "split": "train"}, {"id": 2, "split": "train"},
                                                    {"id": 3, "split": "test"}]


def test_hub_unreachable_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "build-db", "--db",
                           "/dev/null/x"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "--emails" in proc.stderr and "--demo" in proc.stderr


# ---- questions -------------------------------------------------------------------------------------

def test_question_selection(small_db):
    _, db = small_db
    assert [q.id for q in questions.select_questions(db, "train")] == [1, 4]  # 3 lacks its gold email
    assert [q.id for q in questions.select_questions(db, "train", require_gold=False)] == [1, 3, 4]
    assert [q.id for q in questions.select_questions(db, "train", single_source=True)] == [1]
    assert [q.id for q in questions.select_questions(db, "train", min_realistic=0.8)] == [4]
    assert [q.id for q in questions.select_questions(db, "test")] == [2]
    assert questions.question_counts(db) == {"test": {"total": 1, "answerable": 1},
                                             "train": {"total": 3, "answerable": 2}}


def test_a_question_without_a_realism_score_is_selected_unless_a_minimum_is_asked(tmp_path):
    """A user's own question file may carry no `how_realistic`. Catches such questions dropped by default."""
    path = tmp_path / "q.db"
    build_database([record(1), record(2)], [question(1, how_realistic=None), question(2)], path, source="test",
                   progress=False)
    with contextlib.closing(EmailDB(path)) as db:
        assert [q.id for q in questions.select_questions(db, "train")] == [1, 2]
        assert [q.id for q in questions.select_questions(db, "train", min_realistic=0.1)] == [2]


def test_a_selected_question_carries_every_field_from_its_own_column(small_db):
    _, db = small_db
    assert questions.select_questions(db, "train")[1] == questions.Question(
        4, "q4?", "a", ["<m4@x>", "<m5@x>"], 0.9, "bob@x.com", "2001-06-30", "train")


def test_a_split_with_no_answerable_question_counts_none(tmp_path):
    path = tmp_path / "q.db"
    build_database([record(1)], [question(1), question(2, split="test", message_ids=["<missing@x>"])], path,
                   source="test", progress=False)
    db = EmailDB(path)
    try:
        assert questions.question_counts(db) == {"test": {"total": 1, "answerable": 0},
                                                 "train": {"total": 1, "answerable": 1}}
    finally:
        db.close()


def test_question_shuffle_is_seeded(demo_db):
    a = questions.select_questions(demo_db, "train", seed=1, limit=20)
    assert a == questions.select_questions(demo_db, "train", seed=1, limit=20)
    assert a != questions.select_questions(demo_db, "train", seed=2, limit=20)
    assert len(a) == 20


def test_a_question_record_is_read_as_given_and_refused_with_its_reason():
    raw = {"id": 3, "question": " When? ", "answer": " Friday ", "message_ids": '["<a@x>", " <b@x> "]',
           "how_realistic": "0.5", "inbox_address": " Bob@X.com ", "query_date": "2001-06-30T08:00:00"}
    assert questions.normalize_question(raw) == questions.Question(3, "When?", "Friday", ["<a@x>", "<b@x>"], 0.5,
                                                                   "bob@x.com", "2001-06-30", "train")
    one = questions.normalize_question({**raw, "message_ids": "<a@x>", "how_realistic": None, "split": "test"})
    assert (one.message_ids, one.how_realistic, one.split) == (["<a@x>"], None, "test")
    for bad, reason in [("not a record", "not an object: 'not a record'"),
                        ({"_error": "line 3 is not JSON"}, "line 3 is not JSON"),
                        ({**raw, "answer": None, "inbox_address": None}, "missing answer, inbox_address"),
                        ({**raw, "answer": " ", "message_ids": []}, "empty answer, message_ids"),
                        ({**raw, "query_date": "someday"}, "someday"), ({**raw, "how_realistic": "very"}, "very")]:
        with pytest.raises(ValueError) as caught:
            questions.normalize_question(bad)
        assert reason in str(caught.value), (bad, caught.value)


def test_question_files_that_are_not_there_are_one_line_errors(tmp_path):
    with pytest.raises(email_db.UserError, match="is a folder; give the questions file"):
        questions.read_questions(tmp_path)
    with pytest.raises(email_db.UserError, match="No such question file"):
        questions.read_questions(tmp_path / "q.jsonl")
    (tmp_path / "q.jsonl").write_text(json.dumps(question(1)) + "\n")
    assert list(questions.read_questions(tmp_path / "q.jsonl")) == [question(1)]
    import pyarrow
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.Table.from_pylist([question(2)]), tmp_path / "Q.PARQUET")  # any case of the suffix
    assert list(questions.read_questions(tmp_path / "Q.PARQUET")) == [question(2)]


def test_withheld_questions_are_asked_the_day_before_their_answer_arrived(small_db):
    _, db = small_db
    one, two_sources = questions.select_questions(db, "train")
    assert questions.withheld(one, db) == dataclasses.replace(one, query_date="2001-05-01")  # gold sent 05-02
    assert questions.withheld(two_sources, db).query_date == "2001-05-04"  # the earlier of 05-05 and 05-06
    unanswerable = questions.select_questions(db, "train", require_gold=False)[1]
    assert unanswerable.message_ids == ["<missing@x>"] and questions.withheld(unanswerable, db) is None

    class FirstDayOnly:  # gold mail dated on the first day a date can have: there is no day before to ask on
        def read(self, message_id):
            return types.SimpleNamespace(date="0001-01-01 09:00:00")
    assert questions.withheld(one, FirstDayOnly()) is None  # not an OverflowError that stops the run
    assert questions.with_unanswerable([one, two_sources], db, 0.0) == [one, two_sources]
    replayed = questions.with_unanswerable([one, two_sources], db, 0.5)  # one replay per question at most
    assert replayed[:2] == [one, two_sources] and len(replayed) == 4
    for asked in (one, two_sources):
        assert dataclasses.replace(questions.withheld(asked, db), id=f"{asked.id}-withheld") in replayed[2:]


def test_a_runs_questions_hold_out_validation_then_train_then_replays(small_db):
    _, db = small_db
    one, four = questions.select_questions(db, "train")
    cfg = TrainConfig(db="small.db", val_size=1, single_source=False, seed=None)
    assert questions.training_questions(db, cfg) == ([one], [four], [four])
    assert questions.training_questions(db, TrainConfig(val_size=0, single_source=True, seed=None))[1] == [one]
    assert questions.training_questions(db, TrainConfig(val_size=0, train_limit=1, single_source=False, seed=None,
                                                        unanswerable_share=0.5))[1:] == (
        [one], [one, dataclasses.replace(questions.withheld(one, db), id="1-withheld")])
    with pytest.raises(email_db.UserError, match=r"No answerable training questions in small.db \(after holding out 2 "
                                             r"for validation: a smaller --val-size, or write some"):
        questions.training_questions(db, TrainConfig(db="small.db", val_size=2, single_source=False))
    with pytest.raises(email_db.UserError, match=r"No answerable training questions in small.db \(write some"):
        questions.training_questions(db, TrainConfig(db="small.db", val_size=0, min_realistic=0.95))


def test_question_selection_seed_and_limit_and_replay_share(demo_db):
    train = questions.select_questions(demo_db, "train")
    assert [q.id for q in train] == sorted(q.id for q in train)  # by id without a seed
    assert questions.select_questions(demo_db, "train", limit=5) == train[:5]
    assert questions.select_questions(demo_db, "train", seed=0, limit=None) != train
    val, rest, grpo = questions.training_questions(demo_db, TrainConfig(val_size=2, train_limit=10, seed=3,
                                                                        unanswerable_share=0.2))
    assert val + rest == questions.select_questions(demo_db, "train", single_source=True, seed=3)[:12]  # the run's seed
    assert (grpo == questions.with_unanswerable(rest, demo_db, 0.2, seed=3)
            != questions.with_unanswerable(rest, demo_db, 0.2))
    mixed = questions.with_unanswerable(train[:20], demo_db, 0.2, seed=3)
    replays = mixed[20:]
    assert len(replays) == 5 and all(q.id.endswith("-withheld") for q in replays)  # 5 of 25 = 20%
    assert replays == questions.with_unanswerable(train[:20], demo_db, 0.2, seed=3)[20:]  # seeded
    assert replays != questions.with_unanswerable(train[:20], demo_db, 0.2, seed=4)[20:]


# ---- the real Enron sample -------------------------------------------------------------------------

@needs_enron
def test_enron_sample_counts(enron_db):
    assert enron_db.meta()["emails"] == "29997"
    assert enron_db.meta()["duplicates"] == "0"
    counts = questions.question_counts(enron_db)
    # SOURCE.md: 2,510 train + 376 test questions; only 2 have every cited email in this sample.
    assert counts == {"test": {"total": 376, "answerable": 0}, "train": {"total": 2510, "answerable": 2}}
    addresses = enron_db.conn.execute("SELECT COUNT(DISTINCT address) FROM mailbox").fetchone()[0]
    assert addresses > 20000


@needs_enron
def test_enron_sample_search_read_and_scoping(enron_db):
    inbox = "gerald.nemec@enron.com"
    results = enron_db.search(inbox, ["falcon", "gas"])
    assert results and all(enron_db.read(r.message_id, inbox=inbox) for r in results)
    email = enron_db.read(results[0].message_id)
    assert email.to_addresses  # the ART·E original lost recipients; we keep them
    outsider = enron_db.conn.execute(
        "SELECT message_id FROM emails e WHERE NOT EXISTS "
        "(SELECT 1 FROM mailbox m WHERE m.address = ? AND m.email_id = e.id) LIMIT 1", (inbox,)).fetchone()[0]
    assert enron_db.read(outsider) is not None and enron_db.read(outsider, inbox=inbox) is None
    # cc-only membership counts (the CMU Bcc is a copy of Cc)
    row = enron_db.conn.execute("SELECT e.message_id, r.address FROM recipients r JOIN emails e ON e.id = r.email_id "
                                "WHERE r.kind = 'cc' LIMIT 1").fetchone()
    assert enron_db.read(row[0], inbox=row[1]) is not None


def test_readme_search_and_read_examples_find_mail(demo_db_path, tmp_path):
    """The README's first look (`search --demo`, `read --demo`), run as printed where build-db --demo has written
    data/demo.db, returns mail."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines()
             if line.startswith(("python train_email_search_agent.py search --demo",
                                 "python train_email_search_agent.py read --demo"))]
    assert len(lines) == 2
    (tmp_path / "data").mkdir()
    shutil.copy(demo_db_path, tmp_path / "data" / "demo.db")
    for line in lines:
        args = [arg.strip("'") for arg in line.split("#")[0].split()[1:]]
        result = subprocess.run([sys.executable, str(ROOT / args[0]), *args[1:]], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "<demo." in result.stdout and "no matches" not in result.stdout, (line, result.stdout)


def test_build_db_never_destroys_what_it_cannot_give_back(small_db, tmp_path):
    """Its own source, a file that is not a database, the questions of the database it replaces."""
    def build_db(*args):
        return subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "build-db", "--quiet",
                               *map(str, args)], capture_output=True, text=True, timeout=120)

    export = tmp_path / "mail.jsonl"
    export.write_text("".join(json.dumps(record(i)) + "\n" for i in range(3)))
    before = export.read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database")
    with_questions = tmp_path / "small.db"  # small_db's, with its questions
    kept = with_questions.read_bytes()
    refusals = [(["--emails", export, "--db", export], "is the source"),
                (["--emails", export, "--db", notes], "is not a database"),
                (["--emails", export, "--db", tmp_path], "is a folder"),
                (["--emails", export, "--db", with_questions], "--overwrite"),
                (["--demo", "--emails", export, "--db", tmp_path / "d.db"], "takes no --emails")]
    for args, message in refusals:
        proc = build_db(*args)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert export.read_bytes() == before and notes.read_text() == "not a database"
    assert with_questions.read_bytes() == kept and not (tmp_path / "d.db").exists()
    assert "holds 4 questions" in build_db("--emails", export, "--db", with_questions).stderr
    assert build_db("--emails", export, "--db", with_questions, "--overwrite").returncode == 0
    assert EmailDB(with_questions).conn.execute("SELECT count(*) FROM questions").fetchone()[0] == 0


@pytest.mark.parametrize("name, content, message", [
    ("mail.parquet", b"not parquet at all", "is not a readable Parquet file"),
    ("mail.jsonl", json.dumps(record(1)).encode() + b"\n" + "caf\u00e9".encode("latin-1") + b"\n",
     "line 2 is not UTF-8"),
    ("mail.jsonl.gz", gzip.compress(json.dumps(record(1)).encode(), mtime=0)[:20], "is not a complete gzip file"),
], ids=["parquet", "jsonl", "jsonl.gz"])  # stable ids: mutmut names the tests it reruns by id
def test_unreadable_source_files_are_one_line_errors(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    for flag in ("--emails", "--questions"):
        args = [flag, tmp_path / name] if flag == "--emails" else ["--emails", tmp_path / name, flag, tmp_path / name]
        proc = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "build-db", "--quiet",
                               "--db", tmp_path / "out.db", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "out.db").exists()


def test_search_and_read_mistakes_say_what_went_wrong(demo_db_path):
    """A mistyped inbox is not an empty search, and a hidden email is not a missing one."""
    def run(*args):
        proc = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), *args, "--db",
                               str(demo_db_path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr

    assert "has no mail sent or received by 'nobody@x.example'; its largest inboxes: " in run(
        "search", "--inbox", "nobody@x.example", "egret")
    assert "has no mail sent or received by 'nobody@x.example'" in run(
        "read", "<demo.000083@larkspur.example>", "--inbox", "nobody@x.example")
    assert "ids are written with angle brackets: '<demo.000083@larkspur.example>'" in run(
        "read", "demo.000083@larkspur.example")
    assert "exists, but --as-of 2024-01-01 hides it" in run("read", "<demo.000083@larkspur.example>",
                                                            "--as-of", "2024-01-01")
    # a typed date is read whole: a stray character is pointed at, not cut off
    assert "--after must be a date like 2001-05-31, not '2024-05-01x'" in run(
        "search", "--inbox", "maya.okafor@larkspur.example", "egret", "--after", "2024-05-01x")
    assert "--before must be a date like 2001-05-31, not '2024-13-01'" in run(
        "search", "--inbox", "maya.okafor@larkspur.example", "egret", "--before", "2024-13-01")
    assert "--as-of must be a date like 2001-05-31, not '2024-05-01x'" in run(
        "read", "<demo.000083@larkspur.example>", "--as-of", "2024-05-01x")
    assert "has no mail sent or received by ''" in run("read", "<demo.000083@larkspur.example>", "--inbox", "")
    assert "--after must be a date like 2001-05-31, not '20240501T0900'" in run(
        "search", "--inbox", "maya.okafor@larkspur.example", "egret", "--after", "20240501T0900")
    assert "--after must be a date like 2001-05-31, not ''" in run(
        "search", "--inbox", "maya.okafor@larkspur.example", "egret", "--after", "")
    # bytes that are not UTF-8 (a Latin-1 terminal): one error, not a traceback where they are first written
    proc = subprocess.run([sys.executable.encode(), str(ROOT / "train_email_search_agent.py").encode(), b"search",
                           b"--inbox", b"\xff", b"egret", b"--db", str(demo_db_path).encode()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the argument '\\xff' is not UTF-8 text" in proc.stderr, proc.stderr


def test_swapped_emails_and_questions_files_are_caught(tmp_path):
    emails, qs = tmp_path / "emails.jsonl", tmp_path / "questions.jsonl"
    emails.write_text("".join(json.dumps(record(i)) + "\n" for i in range(3)))
    qs.write_text("".join(json.dumps(question(i)) + "\n" for i in range(3)))
    for args, message in [(["--emails", qs], "No usable emails in"), (["--emails", emails, "--questions", emails],
                                                                       "is that the questions file?")]:
        proc = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "build-db", "--quiet", "--db",
                               tmp_path / "out.db", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and message in proc.stderr and "first: record 1: missing" in proc.stderr
        assert not (tmp_path / "out.db").exists()


def test_search_and_read_as_of_hide_later_mail(demo_db, demo_db_path, capsys):
    """`search --as-of` and `read --as-of` show what the agent sees on that day: mail sent later is hidden (a
    flag that only parsed, or a bound off by a day, would show it)."""
    import train_email_search_agent as cli

    q = questions.select_questions(demo_db, "test", seed=0)[0]
    gold = demo_db.read(q.message_ids[0])
    word = next(w for w in gold.subject.split() if len(w) > 3 and w.isalpha())
    args = ["search", "--db", str(demo_db_path), "--inbox", q.inbox_address, word, "--json", "--max-results", "20"]
    assert cli.main(args) == 0
    everything = {r["message_id"] for r in json.loads(capsys.readouterr().out)}
    day_of = gold.date[:10]
    assert cli.main(args + ["--as-of", day_of]) == 0
    on_the_day = {r["message_id"] for r in json.loads(capsys.readouterr().out)}
    before = str(datetime.date.fromisoformat(day_of) - datetime.timedelta(days=1))
    assert cli.main(args + ["--as-of", before]) == 0
    the_day_before = {r["message_id"] for r in json.loads(capsys.readouterr().out)}
    assert gold.message_id in everything and gold.message_id in on_the_day  # its own day counts
    assert gold.message_id not in the_day_before and the_day_before <= on_the_day <= everything
    assert all(demo_db.read(m).date[:10] <= before for m in the_day_before)
    assert cli.main(["read", "--db", str(demo_db_path), gold.message_id, "--as-of", before]) == 1
    assert f"exists, but --as-of {before} hides it" in capsys.readouterr().err


def test_build_db_and_inboxes_list_the_addresses_inbox_may_name(tmp_path):
    """--inbox is required by search, ask and serve: build-db names the largest inboxes, `inboxes` lists them all with
    their emails and questions."""
    db = tmp_path / "d.db"
    built = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "build-db", "--demo", "--db",
                            str(db), "--quiet"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert built.returncode == 0, built.stderr
    line = next(line for line in built.stdout.splitlines() if line.startswith("inboxes"))
    with contextlib.closing(EmailDB(db)) as opened:
        (largest, count), *_ = opened.largest_inboxes(1)
        asked = opened.question_counts()
    assert f"{largest} ({count:,})" in line and f"inboxes --db {db}" in line
    listed = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "inboxes", "--db", str(db),
                             "--json", "--limit", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    rows = json.loads(listed.stdout)
    assert rows[0] == {"inbox": largest, "emails": count, "questions": asked.get(largest, 0)}
    assert [r["emails"] for r in rows] == sorted((r["emails"] for r in rows), reverse=True)
    assert sum(r["questions"] for r in rows) == sum(asked.values()) > 0
    table = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "inboxes", "--db", str(db),
                            "--limit", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    assert table.splitlines()[0].split() == ["inbox", "emails", "questions"] and len(table.splitlines()) == 3
    missing = subprocess.run([sys.executable, str(ROOT / "train_email_search_agent.py"), "inboxes", "--db",
                              str(tmp_path / "none.db")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode == 1 and "No database at" in missing.stderr and "Traceback" not in missing.stderr


def test_ones_own_mail_is_never_built_under_the_enron_databases_name(tmp_path, monkeypatch, capsys):
    """`build-db --emails my.mbox` without --db once wrote the user's mail into data/enron_emails.db, the name every
    other command reads by default: refused in one sentence naming --db, nothing written."""
    import train_email_search_agent as cli

    export = tmp_path / "mail.jsonl"
    export.write_text("".join(json.dumps(record(i)) + "\n" for i in range(3)))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["build-db", "--emails", str(export), "--quiet"]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("Error: --emails needs --db") and "data/enron_emails.db" in said[0]
    assert not (tmp_path / "data").exists()
    assert cli.main(["build-db", "--emails", str(export), "--db", "data/me.db", "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["me.db"]


def test_every_command_that_reads_a_database_takes_demo_and_a_missing_one_points_to_it(demo_db_path, tmp_path,
                                                                                       monkeypatch, capsys):
    """--demo wherever --db is taken, never both; "No database at data/enron_emails.db" names data/demo.db when
    it is there (and only then)."""
    import test_email_search_agent as evaluate
    import train_email_search_agent as cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["inboxes"]) == 1
    assert capsys.readouterr().err.strip() == ("Error: No database at data/enron_emails.db; run `python "
                                               "train_email_search_agent.py build-db` first.")
    assert cli.main(["inboxes", "--demo"]) == 1
    assert "data/demo.db; run `python train_email_search_agent.py build-db --demo` first." in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    shutil.copy(demo_db_path, tmp_path / "data" / "demo.db")
    inbox, message_id = "maya.okafor@larkspur.example", "<demo.000068@larkspur.example>"
    for argv, shown in ((["inboxes"], inbox), (["search", "--inbox", inbox, "Godwit", "review"], message_id),
                        (["read", message_id], "Subject: Godwit status review")):
        assert cli.main(argv) == 1
        assert "or use the demo inbox's data/demo.db with --demo." in capsys.readouterr().err
        assert cli.main([*argv, "--demo"]) == 0 and shown in capsys.readouterr().out
    parser = cli.make_parser()
    for argv in (["ask", "--inbox", inbox, "When?"], ["serve"], ["generate-questions", "--model", "m"]):
        assert parser.parse_args([*argv, "--demo"]).db == "data/demo.db"
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--demo", "--db", "x.db"])
        assert "not allowed with argument" in capsys.readouterr().err
    # every subcommand of both scripts that takes --db takes --demo (build-db, train and the evaluation: their own)
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in [*subcommands.items(), ("evaluation", evaluate.make_parser())]:
        flags = {flag for action in sub._actions for flag in action.option_strings}
        assert "--db" not in flags or "--demo" in flags, name


def test_a_quoted_phrase_that_matches_nothing_is_told_that_quotes_make_a_phrase(demo_db_path, capsys):
    """`search "Godwit review"` finds no email where the two words stand side by side; the hint says so, and its
    command, run as printed, finds the mail. A phrase that matches, or one word, gets no hint."""
    import train_email_search_agent as cli

    inbox = ["--db", str(demo_db_path), "--inbox", "maya.okafor@larkspur.example"]
    assert cli.main(["search", *inbox, "Godwit review"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "no matches"
    assert err.startswith("hint: quotes make a phrase: 'Godwit review' matches only those words side by side")
    suggested = err.split(": search ", 1)[1].split()
    assert suggested == ["--inbox", "maya.okafor@larkspur.example", "Godwit", "review"]
    assert cli.main(["search", "--db", str(demo_db_path), *suggested, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and f"without quotes {len(found)} emails match" in err
    for keywords, hinted in ((["Godwit status review"], False), (["Godwit"], False), (["Godwit zebra"], True)):
        assert cli.main(["search", *inbox, *keywords]) == 0
        out, err = capsys.readouterr()
        assert ("no matches" in out) == hinted
        assert err == ("hint: quotes make a phrase: 'Godwit zebra' matches only those words side by side, in that "
                       "order; without quotes nothing matches either\n" if hinted else "")


def test_an_archive_or_a_compressed_export_is_answered_with_how_to_unpack_it(tmp_path, monkeypatch, capsys):
    """A Takeout .zip, an .mbox.gz and the CMU release's .tar.gz: one sentence saying how to unpack it and what to
    pass then (the mbox inside a zip named); that advice, followed as written, builds the mail."""
    import tarfile
    import zipfile

    import train_email_search_agent as cli

    monkeypatch.chdir(tmp_path)
    box = mailbox.mbox(tmp_path / "plain.mbox")
    for i in range(2):
        box.add(email.message_from_string(f"From: a@x.com\nTo: b@x.com\nSubject: s{i}\nMessage-ID: <z{i}@x>\n"
                                          f"Date: Mon, 01 Jan 2024 09:30:00 +0000\n\nbody {i}\n"))
    box.close()
    mbox = (tmp_path / "plain.mbox").read_bytes()
    takeout = "Takeout/Mail/All mail Including Spam and Trash.mbox"
    with zipfile.ZipFile(tmp_path / "takeout-001.zip", "w") as archive:
        archive.writestr("Takeout/archive_browser.html", "<html></html>")
        archive.writestr(takeout, mbox)
    (tmp_path / "mail.mbox.gz").write_bytes(gzip.compress(mbox))
    (tmp_path / "maildir" / "allen-p" / "inbox").mkdir(parents=True)
    (tmp_path / "maildir" / "allen-p" / "inbox" / "1.").write_bytes(mbox.split(b"\n", 1)[1])
    with tarfile.open(tmp_path / "enron_mail.tar.gz", "w:gz") as archive:
        archive.add("maildir")
    shutil.rmtree(tmp_path / "maildir")
    advice = {"takeout-001.zip": f"is a zip archive; unzip it first (unzip 'takeout-001.zip'), then pass --emails "
                                 f"'{takeout}'.",
              "mail.mbox.gz": "is gzip-compressed; unpack it first (gunzip -k 'mail.mbox.gz'), then pass mail.mbox.",
              "enron_mail.tar.gz": "is a compressed tar archive; unpack it first (tar -xzf 'enron_mail.tar.gz'), "
                                   "then pass the folder it holds: --emails maildir."}
    for name, says in advice.items():
        assert cli.main(["build-db", "--emails", name, "--db", "out.db", "--quiet"]) == 1
        err = capsys.readouterr().err.strip()
        assert err == f"Error: {name} {says}"
        assert not (tmp_path / "out.db").exists()
    zipfile.ZipFile("takeout-001.zip").extractall()
    (tmp_path / "mail.mbox").write_bytes(gzip.decompress((tmp_path / "mail.mbox.gz").read_bytes()))
    with tarfile.open("enron_mail.tar.gz") as archive:
        archive.extractall(filter="data")
    for unpacked in (takeout, "mail.mbox", "maildir"):
        assert cli.main(["build-db", "--emails", unpacked, "--db", "out.db", "--overwrite", "--quiet"]) == 0
        assert re.search(r"^emails\s+[12] ", capsys.readouterr().out, re.M), unpacked
