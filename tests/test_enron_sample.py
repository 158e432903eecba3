"""`build-db --enron-sample`: the real-mail sample rebuilt from a public source by its manifest, without a network.

From ../shared/data/enron/emails.jsonl.gz (skipped when absent) the tests write the two sources a user has, as they
are laid out: Hugging Face's corbt/enron-emails (three parquet files in its schema, the sample among distractor
emails, one sample email also present as a truncated copy) and the CMU release's maildir/ (one RFC 822 file per email
under <owner>/inbox/, headers folded with "\\n\\t" inside words, X-* headers, file names ending in a dot). They run the
real build on each and compare its rows with a build of the sample itself. The per-source tests use a subset (the 9
inbox folders the questions were written over, plus every email a question cites: 8,853 emails, with a manifest of
their own, made as the real one is); one test builds the whole sample from a maildir against the shipped manifest.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import sqlite3
from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest

from conftest import ENRON_EMAILS, needs_enron
from email_agent.data import enron_sample
from email_agent.data.email_db import EmailDB

QUESTION_FOLDERS = ("beck-s", "campbell-l", "dasovich-j", "germany-c", "jones-t", "nemec-g", "sager-e",
                    "shackleton-s", "taylor-m")
ROWS = "SELECT id, message_id, date, subject, from_address, body FROM emails ORDER BY id"
RECIPIENTS = ("SELECT e.message_id, r.kind, r.address FROM recipients r JOIN emails e ON e.id = r.email_id "
              "ORDER BY r.rowid")


def cli(*argv: str) -> int:
    import train_email_search_agent

    return train_email_search_agent.main(["build-db", "--enron-sample", "--quiet", *argv])


@pytest.fixture(scope="module")
def sample() -> list[dict]:
    if not ENRON_EMAILS.exists():
        pytest.skip(f"the real Enron sample is not at {ENRON_EMAILS.parent}")
    with gzip.open(ENRON_EMAILS, "rt") as lines:
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def questions() -> list[dict]:
    return [json.loads(line) for line in enron_sample.QUESTIONS.read_text().splitlines()]


@pytest.fixture(scope="module")
def subset(sample, questions, tmp_path_factory):
    """(the subset's rows, its manifest, a database built from those rows as build-db --emails builds the sample)."""
    from email_agent.data.build import build_database

    cited = {mid for q in questions for mid in q["message_ids"]}
    rows = [r for r in sample if r["inbox"] in QUESTION_FOLDERS or r["message_id"] in cited]
    assert len(rows) == 8853  # as the docs say
    folder = tmp_path_factory.mktemp("subset")
    enron_sample.write_manifest(rows, folder / "manifest.json.xz", "the test's subset")
    build_database(rows, questions, folder / "reference.db", source="reference", progress=False)
    return rows, folder / "manifest.json.xz", folder / "reference.db"


# ---- the sources, written as they are published ---------------------------------------------------------------

def fold(value: str, width: int = 60) -> str:
    """A header value folded as the CMU export folds: "\\n\\t" every `width` characters, inside words too."""
    return "\n\t".join(value[i:i + width] for i in range(0, len(value), width)) if value else value


def cmu_file(row: dict, unindented_wrap: bool = False) -> bytes:
    """One email as the CMU release's file of it: its headers in their order, X-* ones, the Date in Pacific time."""
    when = datetime.fromisoformat(row["date"].replace("Z", "+00:00")).astimezone(ZoneInfo("America/Los_Angeles"))
    owner = row["inbox"]
    subject = fold(row["subject"])
    if unindented_wrap and row["subject"].endswith("?"):  # as 11 files of the sample: a wrap with no indent
        subject = row["subject"][:-1] + "\n?"
    headers = [f"Message-ID: {row['message_id']}", f"Date: {when.strftime('%a, %-d %b %Y %H:%M:%S %z (%Z)')}",
               f"From: {row['from_address']}"]
    headers += [f"To: {fold(', '.join(row['to_addresses']))}"] if row["to_addresses"] else []
    headers += [f"Subject: {subject}"]
    headers += [f"Cc: {fold(', '.join(row['cc_addresses']))}"] if row["cc_addresses"] else []
    headers += ["Mime-Version: 1.0", "Content-Type: text/plain; charset=us-ascii", "Content-Transfer-Encoding: 7bit"]
    headers += [f"Bcc: {fold(', '.join(row['bcc_addresses']))}"] if row["bcc_addresses"] else []
    headers += [f"X-From: {row['from_address'].split('@')[0]}", f"X-To: {fold(', '.join(row['to_addresses']))}",
                "X-cc: ", "X-bcc: ", f"X-Folder: \\{owner}\\Inbox", f"X-Origin: {owner.upper()}",
                f"X-FileName: {owner}.nsf"]
    return ("\n".join(headers) + "\n\n" + row["body"]).encode("utf-8")  # 7 addresses hold a U+FFFD


def write_maildir(rows: list[dict], root) -> None:
    """The CMU release's maildir/ for `rows`, and beside the sample what the release also holds: the owners' other
    folders and campbell-l/inbox/1526. (in the release, not in the sample: the copy it was made from had lost it)."""
    for n, row in enumerate(rows):
        path = root / row["file_name"].removeprefix("maildir/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(cmu_file(row, unindented_wrap=n % 20 == 0))
        if n % 10 == 0:  # the same message in the owner's all_documents folder, another Message-ID there
            other = root / row["inbox"] / "all_documents" / path.name
            other.parent.mkdir(parents=True, exist_ok=True)
            other.write_bytes(cmu_file({**row, "message_id": row["message_id"].replace(".Java", "9.Java")}))
    lost = {**rows[0], "message_id": "<1526.1075840000000.JavaMail.evans@thyme>", "body": "not in the sample\n"}
    (root / "campbell-l" / "inbox").mkdir(parents=True, exist_ok=True)
    (root / "campbell-l" / "inbox" / "1526.").write_bytes(cmu_file(lost))


def write_hub_parquet(rows: list[dict], folder) -> None:
    """The Hub's corbt/enron-emails as `datasets` downloads it (data/train-0000N-of-00003.parquet; columns message_id,
    subject, from, to, cc, bcc (lists, an empty one sometimes ['']), date (timestamp, no zone), body, file_name), with
    distractors: the sample's emails again under other ids and folders, and a truncated copy of one before it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("message_id", pa.string()), ("subject", pa.string()), ("from", pa.string()),
                        ("to", pa.list_(pa.string())), ("cc", pa.list_(pa.string())), ("bcc", pa.list_(pa.string())),
                        ("date", pa.timestamp("us")), ("body", pa.string()), ("file_name", pa.string())])

    def hub_row(row: dict, n: int) -> dict:
        when = datetime.fromisoformat(row["date"].replace("Z", "+00:00")).astimezone(timezone.utc)
        return {"message_id": row["message_id"], "subject": row["subject"], "from": row["from_address"],
                "to": row["to_addresses"] or ([""] if n % 2 else []), "cc": row["cc_addresses"],
                "bcc": row["bcc_addresses"], "date": when.replace(tzinfo=None), "body": row["body"],
                "file_name": row["file_name"].removeprefix("maildir/")}

    hub = []
    for n, row in enumerate(rows):
        if n == 5:  # a copy of one message with its body cut short, met first: the sample's text must win
            hub.append(hub_row({**row, "body": row["body"][:20]}, n) | {"file_name": "x/discussion_threads/1."})
        hub.append(hub_row(row, n))
        if n % 3 == 0:
            hub.append(hub_row({**row, "message_id": row["message_id"].replace(".Java", "7.Java")}, n)
                       | {"file_name": f"{row['inbox']}/all_documents/{n}."})
    (folder / "data").mkdir(parents=True)
    third = len(hub) // 3 + 1
    for i in range(3):
        table = pa.Table.from_pylist(hub[i * third:(i + 1) * third], schema=schema)
        pq.write_table(table, folder / "data" / f"train-{i:05d}-of-00003.parquet")


# ---- the checks ----------------------------------------------------------------------------------------------

def assert_same_sample(db_path, reference_path, questions) -> None:
    """The same emails in the same order, the same dates, subjects, senders, bodies and recipients as the reference;
    every question's cited emails in its inbox."""
    with contextlib.closing(sqlite3.connect(db_path)) as db, contextlib.closing(sqlite3.connect(reference_path)) as ref:
        assert db.execute(ROWS).fetchall() == ref.execute(ROWS).fetchall()
        assert db.execute(RECIPIENTS).fetchall() == ref.execute(RECIPIENTS).fetchall()
        gold = db.execute("SELECT COUNT(*), SUM(gold_in_db) FROM questions").fetchone()
        assert gold == (530, 530)
    with contextlib.closing(EmailDB(db_path)) as db:
        for q in questions:
            for mid in q["message_ids"]:
                assert db.read(mid, inbox=q["inbox_address"]) is not None, (q["id"], mid)


@needs_enron
def test_the_manifest_is_the_local_sample_and_small(sample):
    manifest = enron_sample.load_manifest()
    assert list(manifest.digests) == [r["message_id"] for r in sample]  # every email, in the sample's order
    assert list(manifest.inboxes) == sorted({r["inbox"] for r in sample}) and len(manifest.inboxes) == 45
    assert manifest.sha256 == enron_sample.sample_checksum(
        {r["message_id"]: enron_sample.body_digest(r["body"]) for r in sample})
    assert enron_sample.MANIFEST.stat().st_size < 400_000


def test_a_body_digest_reads_the_words_only():
    digest = enron_sample.body_digest
    assert digest("Hi Sally,\r\n\r\nthe deal  is done.\n") == digest("\nHi Sally,\n\nthe deal is done.")
    assert digest("caf\xe9 \u2019ok\u2019") == digest("caf\ufffd \x92ok\x92")  # Windows-1252 read two ways
    assert digest("the deal is done") != digest("the deal is not done")


@needs_enron
def test_the_hub_parquet_files_build_the_sample(subset, questions, tmp_path, monkeypatch, capsys):
    rows, manifest, reference = subset
    monkeypatch.setattr(enron_sample, "MANIFEST", manifest)
    write_hub_parquet(rows, tmp_path / "hub")
    assert cli("--emails", str(tmp_path / "hub"), "--db", str(tmp_path / "s.db")) == 0
    out = capsys.readouterr().out
    assert f"sample      all {len(rows):,} emails found in {tmp_path / 'hub'}; checksum" in out
    assert "= the manifest's" in out
    assert_same_sample(tmp_path / "s.db", reference, questions)
    with contextlib.closing(EmailDB(tmp_path / "s.db")) as db:
        meta = db.meta()
        assert meta["sample_sha256"] == meta["sample_manifest_sha256"] == enron_sample.load_manifest().sha256
        assert db.read(rows[0]["message_id"]).file_name == rows[0]["file_name"].removeprefix("maildir/")


@needs_enron
def test_the_hub_download_builds_the_sample(subset, questions, tmp_path, monkeypatch, capsys):
    """No --emails: the dataset as `datasets` gives it (here loaded from the parquet files, not downloaded)."""
    import datasets

    rows, manifest, reference = subset
    monkeypatch.setattr(enron_sample, "MANIFEST", manifest)
    write_hub_parquet(rows, tmp_path / "hub")
    files = sorted(str(p) for p in (tmp_path / "hub" / "data").glob("*.parquet"))
    asked = []

    def load(name, split):
        asked.append((name, split))
        return datasets.Dataset.from_parquet(files, cache_dir=str(tmp_path / "cache"))

    monkeypatch.setattr(enron_sample, "load_hub_dataset", load)
    assert cli("--db", str(tmp_path / "s.db")) == 0
    assert asked == [("corbt/enron-emails", "train")]
    assert "emails found in hf:corbt/enron-emails; checksum" in capsys.readouterr().out
    assert_same_sample(tmp_path / "s.db", reference, questions)


@needs_enron
def test_the_cmu_maildir_builds_the_sample(subset, questions, tmp_path, monkeypatch, capsys):
    rows, manifest, reference = subset
    monkeypatch.setattr(enron_sample, "MANIFEST", manifest)
    write_maildir(rows, tmp_path / "enron_mail_20150507" / "maildir")
    assert (tmp_path / "enron_mail_20150507" / "maildir" / "beck-s" / "inbox" / "1.").is_file()
    # the release's folder or its maildir/: either is found
    assert cli("--emails", str(tmp_path / "enron_mail_20150507"), "--db", str(tmp_path / "s.db")) == 0
    assert "= the manifest's" in capsys.readouterr().out
    assert_same_sample(tmp_path / "s.db", reference, questions)
    with contextlib.closing(sqlite3.connect(tmp_path / "s.db")) as db, \
            contextlib.closing(sqlite3.connect(reference)) as ref:  # the CMU paths, as the sample has them
        names = "SELECT file_name FROM emails ORDER BY id"
        assert db.execute(names).fetchall() == ref.execute(names).fetchall()


@needs_enron
def test_the_whole_sample_from_a_maildir_matches_the_shipped_manifest(sample, questions, enron_db_path, tmp_path,
                                                                      capsys):
    """The full size: 29,997 files, the real manifest, every question answerable; the emails and recipients are
    those of a build of emails.jsonl.gz itself (conftest's, with ART·E's questions: the 530 are checked here)."""
    write_maildir(sample, tmp_path / "maildir")
    assert cli("--emails", str(tmp_path / "maildir"), "--db", str(tmp_path / "s.db")) == 0
    out = capsys.readouterr().out
    assert "sample      all 29,997 emails found" in out and "= the manifest's" in out
    assert_same_sample(tmp_path / "s.db", enron_db_path, questions)


# ---- bad input: one sentence each, nothing lost ----------------------------------------------------------------

def previous_database(path) -> bytes:
    from email_agent.data.build import build_database

    build_database([{"message_id": "<x@y>", "date": "2001-01-01", "body": "kept", "from_address": "a@b.c"}],
                   [{"id": 1, "question": "q", "answer": "a", "message_ids": ["<x@y>"], "inbox_address": "a@b.c",
                     "query_date": "2001-01-02"}], path, source="before", progress=False)
    return path.read_bytes()


def assert_refused(argv, capsys, *phrases) -> str:
    assert cli(*argv) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()  # what it is doing, then the error
    assert "Traceback" not in err and lines[-1].startswith("Error: ") and len(lines) <= 2, err
    err = lines[-1]
    for phrase in phrases:
        assert phrase in err, err
    return err


@needs_enron
def test_a_wrong_or_half_unpacked_cmu_folder_is_one_sentence(subset, tmp_path, monkeypatch, capsys):
    rows, manifest, _ = subset
    monkeypatch.setattr(enron_sample, "MANIFEST", manifest)
    folders = len(enron_sample.load_manifest().inboxes)  # the 9 and those holding an email a question cites
    before = previous_database(tmp_path / "s.db")
    (tmp_path / "wrong" / "lay-k" / "sent").mkdir(parents=True)
    assert_refused(["--emails", str(tmp_path / "wrong"), "--db", str(tmp_path / "s.db")], capsys,
                   "is neither the CMU release's maildir/", "beck-s/inbox")
    # unpacking stopped part way: the first folders are there, and the last file written is cut short
    half = [r for r in rows if r["inbox"] in QUESTION_FOLDERS[:4]]
    write_maildir(half, tmp_path / "maildir")
    last = tmp_path / "maildir" / half[-1]["file_name"].removeprefix("maildir/")
    last.write_bytes(last.read_bytes()[:300])
    assert_refused(["--emails", str(tmp_path / "maildir"), "--db", str(tmp_path / "s.db")], capsys,
                   f"holds {len(half):,} of the sample's {len(rows):,} emails",
                   f"{folders - 4} of its {folders} inbox folders absent",
                   "1 of other text", "nothing was built", "unpack enron_mail_20150507.tar.gz again")
    assert (tmp_path / "s.db").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maildir", "s.db", "wrong"]


@needs_enron
def test_a_hub_copy_missing_a_few_emails_builds_the_rest_and_names_the_questions_lost(subset, questions, tmp_path,
                                                                                      monkeypatch, capsys):
    rows, manifest, _ = subset
    monkeypatch.setattr(enron_sample, "MANIFEST", manifest)
    lost = {questions[0]["message_ids"][0], questions[1]["message_ids"][0], rows[-1]["message_id"]}
    write_hub_parquet([r for r in rows if r["message_id"] not in lost], tmp_path / "hub")
    assert cli("--emails", str(tmp_path / "hub"), "--db", str(tmp_path / "s.db")) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sample ")]
    dropped = sorted(q["id"] for q in questions if lost & set(q["message_ids"]))
    assert len(line) == 1 and f"{len(rows) - 3:,} of the {len(rows):,} emails found" in line[0]
    assert "(3 missing, first " in line[0] and "0 with other text" in line[0]
    assert f"{len(dropped)} questions cite a missing email and are left out ({', '.join(dropped)})" in line[0]
    with contextlib.closing(EmailDB(tmp_path / "s.db")) as db:
        assert db.meta()["sample_missing"] == "3"
        unanswerable = db.conn.execute("SELECT id FROM questions WHERE gold_in_db = 0 ORDER BY id").fetchall()
        assert [qid for (qid,) in unanswerable] == dropped


@needs_enron
def test_one_parquet_file_of_three_is_refused(subset, tmp_path, monkeypatch, capsys):
    rows, manifest, _ = subset
    monkeypatch.setattr(enron_sample, "MANIFEST", manifest)
    write_hub_parquet(rows, tmp_path / "hub")
    one = tmp_path / "hub" / "data" / "train-00001-of-00003.parquet"
    assert_refused(["--emails", str(one), "--db", str(tmp_path / "s.db")], capsys,
                   "nothing was built", "pass every parquet file of corbt/enron-emails")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(one.read_bytes()[:-5000])  # a download that stopped
    assert_refused(["--emails", str(cut), "--db", str(tmp_path / "s.db")], capsys,
                   "is not a readable Parquet file", "download it again")
    assert not (tmp_path / "s.db").exists()


@needs_enron
def test_a_changed_or_damaged_manifest_is_one_sentence(sample, tmp_path, monkeypatch, capsys):
    import lzma

    text = lzma.decompress(enron_sample.MANIFEST.read_bytes()).decode()
    first = sample[0]["message_id"]
    edited = tmp_path / "edited.json.xz"  # one email taken out, its checksum left as it was
    edited.write_bytes(lzma.compress(text.replace(f'["{first}", "{enron_sample.body_digest(sample[0]["body"])}"],\n',
                                                  "", 1).encode()))
    monkeypatch.setattr(enron_sample, "MANIFEST", edited)
    before = previous_database(tmp_path / "s.db")
    assert_refused(["--emails", str(ENRON_EMAILS), "--db", str(tmp_path / "s.db")], capsys,
                   "does not match its own checksum", "git checkout -- ")
    damaged = tmp_path / "damaged.json.xz"
    damaged.write_bytes(enron_sample.MANIFEST.read_bytes()[:1000])
    monkeypatch.setattr(enron_sample, "MANIFEST", damaged)
    assert_refused(["--emails", str(ENRON_EMAILS), "--db", str(tmp_path / "s.db")], capsys, "is damaged")
    assert (tmp_path / "s.db").read_bytes() == before


def test_a_full_disk_during_the_build_is_one_sentence_and_leaves_the_old_database(tmp_path, monkeypatch, capsys):
    """SQLite's own "database or disk is full", from a file it may not grow past 2 MB (a small disk)."""
    from email_agent.data import build

    before = previous_database(tmp_path / "s.db")
    connect = sqlite3.connect

    def small_disk(path, *args, **kwargs):
        conn = connect(path, *args, **kwargs)
        conn.execute("PRAGMA max_page_count = 512")  # 512 pages of 4 kB
        return conn

    monkeypatch.setattr(build.sqlite3, "connect", small_disk)
    emails = [{"message_id": f"<{n}@x>", "date": "2001-01-01", "from_address": "a@b.c", "body": f"{n} " * 2000}
              for n in range(2000)]
    with pytest.raises(build.UserError, match=r"The disk filled up while building .*s\.db \(database or disk is "
                                              r"full, after \d MB\): the database already there is untouched"):
        build.build_database(emails, [], tmp_path / "s.db", source="t", progress=False)
    assert (tmp_path / "s.db").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]  # no partial file left


def test_the_sample_and_the_demo_are_two_databases(capsys):
    assert_refused(["--demo"], capsys, "--demo and --enron-sample build two different databases")
