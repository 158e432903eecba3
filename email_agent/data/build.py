"""Building the database: emails and questions from any source into one SQLite file, atomically.

Owns: the build (load emails, the inbox table, the FTS5 index and secondary indexes, then the questions with
a flag saying whether their cited emails are present) and its summary. It sits above `sources` (reading and
normalising records), `email_db` (the schema) and `questions` (the question schema), which know nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable
from urllib.parse import quote

from tqdm import tqdm

from email_agent.data import demo as demo_inbox
from email_agent.data.email_db import INDEXES, SCHEMA, member_token
from email_agent.data.sources import SkipRecord, normalize_email, read_emails, read_hub_emails
from email_agent.errors import UserError
from email_agent.data.questions import normalize_question, read_hub_questions, read_questions

SKIP_EXAMPLES = 3  # skipped records the summary shows with their reason (the rest are counted)


@dataclass
class BuildSummary:
    db_path: str
    emails: int = 0
    duplicates: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    addresses: int = 0
    first_date: str | None = None
    last_date: str | None = None
    questions: dict[str, int] = field(default_factory=dict)  # split -> count
    questions_missing_gold: int = 0
    questions_skipped: int = 0
    skip_examples: list[str] = field(default_factory=list)  # the first few skipped emails, with why
    question_skip_examples: list[str] = field(default_factory=list)  # the first few skipped questions, with why
    seconds: float = 0.0
    db_bytes: int = 0

    def lines(self) -> list[str]:
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        q = ", ".join(f"{n} {split}" for split, n in sorted(self.questions.items())) or "none"
        return [
            f"database    {self.db_path} ({self.db_bytes / 1e6:.1f} MB)",
            f"emails      {self.emails:,} in {self.seconds:.1f}s ({self.emails / max(self.seconds, 1e-9):,.0f}/s)",
            f"addresses   {self.addresses:,} (an inbox is an address's sent and received mail)",
            f"dates       {self.first_date} .. {self.last_date} (UTC)",
            f"duplicates  {self.duplicates:,} dropped (same message_id)",
            f"skipped     {skipped:,} malformed ({why})",
            f"questions   {q}; {self.questions_missing_gold:,} cite an email not in the database or not in "
            f"their inbox "
            f"(kept, excluded from training); {self.questions_skipped:,} malformed skipped",
            *(f"  skipped email     {example}" for example in self.skip_examples),
            *(f"  skipped question  {example}" for example in self.question_skip_examples),
        ]


def open_sources(*, demo: bool = False, emails: str | None = None, questions: str | None = None
                 ) -> tuple[Iterable[dict], Iterable[dict], str, int | None]:
    """(emails, questions, source name, email count if known) for build-db's flags: the demo inbox; local
    files; or the ART·E corpus and questions from Hugging Face. Local emails without --questions: none."""
    if demo:
        email_rows, question_rows = demo_inbox.generate(seed=0)
        return email_rows, question_rows, "the bundled demo inbox (email_agent/data/demo.py, seed 0)", len(email_rows)
    email_rows = read_emails(emails) if emails else read_hub_emails()
    if questions:
        question_rows = read_questions(questions)
    else:
        question_rows = [] if emails else read_hub_questions()
    total = len(email_rows) if hasattr(email_rows, "__len__") else None
    return email_rows, question_rows, str(emails) if emails else "hf:corbt/enron-emails", total


def check_target(db_path: str | os.PathLike, sources: Iterable[str | None], brings_questions: bool,
                 overwrite: bool = False) -> None:
    """Refuse a build that would destroy what it cannot give back (UserError): a source file of its own, a file
    that is not a database, unless `overwrite` another program's database, or the questions of the database it
    replaces when it brings none (generate-questions' cost money). A corrupt database may be replaced: that is how
    it is repaired."""
    db_path = Path(db_path)
    if db_path.is_dir():
        raise UserError(f"--db {db_path} is a folder; give a file path, such as {db_path / 'emails.db'}")
    for source in filter(None, sources):
        if db_path.resolve() == Path(source).expanduser().resolve():
            raise UserError(f"--db {db_path} is the source {source} itself: build into another file")
    if not db_path.exists():
        return
    with open(db_path, "rb") as f:
        header = f.read(16)
    if header and header != b"SQLite format 3\x00":
        raise UserError(f"--db {db_path} exists and is not a database; not replacing it: choose another --db, or "
                        "delete that file first")
    if overwrite:
        return
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(str(db_path.resolve()))}?mode=ro", uri=True)) as conn:
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            held = conn.execute("SELECT count(*) FROM questions").fetchone()[0] if "questions" in tables else 0
    except sqlite3.DatabaseError:
        return  # corrupt: nothing to keep
    if tables and not {"emails", "meta"} <= tables:
        names = ", ".join(sorted(tables)[:5])
        raise UserError(f"--db {db_path} is another program's SQLite database (tables: {names}); "
                        f"not replacing it: choose another --db, or pass --overwrite to replace it anyway")
    if held and not brings_questions:
        raise UserError(f"{db_path} holds {held:,} questions, and this build has no --questions: replacing it would "
                        f"drop them (rebuilding adds no questions back; generate-questions' cost money). Build into "
                        f"another --db, or pass --overwrite to replace it anyway")


def build_database(emails: Iterable[dict], questions: Iterable[dict], db_path: str | os.PathLike, *,
                   source: str, total: int | None = None, progress: bool = True,
                   meta: dict[str, str] | None = None) -> BuildSummary:
    """Build the database at db_path from raw email records and raw question records (`meta`: more keys for its
    meta table, such as which real-mail sample it holds).

    The build writes a temporary file beside db_path and renames it into place only when complete, so an
    interrupted or failed build never leaves a partial database (an existing one stays untouched): any
    exception, KeyboardInterrupt included, removes the temporary file, and a disk that fills up is one sentence.
    (The CLI turns SIGTERM into KeyboardInterrupt; a SIGKILL's leftover is swept by the next build.)
    """

    db_path = Path(db_path)
    try:
        db_path.parent.mkdir(parents=True, exist_ok=True)
        for stale in db_path.parent.glob(db_path.name + ".tmp-*"):  # left by a build that was SIGKILLed
            if not _process_alive(stale.name.rpartition("-")[2]):  # not another build of the same --db, running
                stale.unlink(missing_ok=True)
        tmp_path = db_path.with_name(f"{db_path.name}.tmp-{os.getpid()}")
        conn = sqlite3.connect(tmp_path)
    except (OSError, sqlite3.OperationalError) as exc:
        raise UserError(f"cannot write the database at {db_path} ({exc}): choose a --db in a folder you can write") \
            from None
    summary = BuildSummary(db_path=str(db_path))
    started = time.perf_counter()
    try:
        try:
            _fill(conn, emails, questions, summary, source, total, progress, meta or {})
        except sqlite3.OperationalError as exc:
            if "disk is full" not in str(exc):  # SQLITE_FULL: the disk (or a quota) ran out mid-build
                raise
            written = tmp_path.stat().st_size / 1e6 if tmp_path.exists() else 0
            kept = "the database already there is untouched" if db_path.exists() else "no database was written"
            raise UserError(f"The disk filled up while building {db_path} ({exc}, after {written:,.0f} MB): {kept} and "
                            f"the partial file is deleted; free some space, or build into a --db on another disk") \
                from None
        finally:
            conn.close()
        os.replace(tmp_path, db_path)
    finally:
        tmp_path.unlink(missing_ok=True)
    summary.seconds = time.perf_counter() - started
    summary.db_bytes = db_path.stat().st_size
    return summary


def _process_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _fill(conn, emails, questions, summary, source, total, progress, extra_meta):
    """The build, in a private file: the emails and who is in each inbox, the indexes, the questions, the meta."""
    # The file is private until renamed into place, so durability during the build buys nothing.
    conn.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-200000;")
    conn.executescript(SCHEMA)
    conn.execute("BEGIN")
    seen = _load_emails(conn, emails, summary, total, progress)
    # SQLite sorts faster than Python, and appending in key order is much faster than random inserts.
    # (OR IGNORE drops a sender who is also a recipient: cheaper than UNION's de-duplication.)
    conn.execute("INSERT OR IGNORE INTO mailbox SELECT address, email_id FROM ("
                 "SELECT from_address AS address, id AS email_id FROM emails WHERE from_address != '' "
                 "UNION ALL SELECT address, email_id FROM recipients) ORDER BY address, email_id")
    summary.emails = len(seen)
    if summary.emails == 0:
        if not summary.skipped:
            raise UserError(f"No emails in {source}.")
        raise UserError(f"No usable emails in {source} ({sum(summary.skipped.values())} malformed records skipped; "
                        f"first: {summary.skip_examples[0]}).")

    # A 32 MB term buffer (default 1 MB) writes fewer, larger FTS segments, so less merging.
    conn.execute("INSERT INTO emails_fts(emails_fts, rank) VALUES ('hashsize', 33554432)")
    steps = [("full-text index", "INSERT INTO emails_fts(emails_fts) VALUES ('rebuild')"), ("indexes", INDEXES)]
    for name, sql in tqdm(steps, desc="indexing", unit=" step", disable=not progress):
        conn.executescript(sql) if ";" in sql else conn.execute(sql)

    _load_questions(conn, questions, seen, summary)
    summary.addresses = conn.execute("SELECT COUNT(DISTINCT address) FROM mailbox").fetchone()[0]
    summary.first_date, summary.last_date = conn.execute("SELECT MIN(date), MAX(date) FROM emails").fetchone()
    meta = {"source": source, "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "emails": str(summary.emails), "duplicates": str(summary.duplicates),
            "skipped": json.dumps(summary.skipped), "schema_version": "2", **extra_meta}
    conn.executemany("INSERT INTO meta VALUES (?,?)", sorted(meta.items()))
    conn.execute("COMMIT")
    conn.execute("ANALYZE")


def _load_emails(conn, emails, summary, total, progress) -> set[str]:
    """Every usable email and its recipients, in source order (a record's id is its place); returns the
    message_ids stored. Malformed records are counted by reason, duplicates by number."""
    seen: set[str] = set()
    email_rows, recipient_rows = [], []

    def flush():
        conn.executemany("INSERT INTO emails VALUES (?,?,?,?,?,?,?,?)", email_rows)
        conn.executemany("INSERT INTO recipients VALUES (?,?,?)", recipient_rows)
        email_rows.clear(), recipient_rows.clear()

    bar = tqdm(emails, total=total, unit=" emails", desc="loading", disable=not progress, mininterval=0.5)
    for n, raw in enumerate(bar, 1):
        try:
            if isinstance(raw, dict) and "_error" in raw:
                raise SkipRecord(raw["_error"])
            row = normalize_email(raw)
        except SkipRecord as exc:
            reason = str(exc).split(" '")[0]  # group "unparseable date 'x'" and "unparseable date 'y'"
            summary.skipped[reason] = summary.skipped.get(reason, 0) + 1
            if len(summary.skip_examples) < SKIP_EXAMPLES:
                where = (isinstance(raw, dict) and (raw.get("message_id") or raw.get("file_name"))) or f"record {n}"
                summary.skip_examples.append(f"{where}: {exc}")
            continue
        if row["message_id"] in seen:
            summary.duplicates += 1
            continue
        seen.add(row["message_id"])
        email_id = len(seen)
        members = {row["from_address"]} if row["from_address"] else set()
        for kind in ("to", "cc", "bcc"):
            for address in row[kind]:
                recipient_rows.append((email_id, address, kind))
                members.add(address)
        email_rows.append((email_id, row["message_id"], row["date"], row["subject"], row["from_address"],
                           row["body"], row["file_name"], " ".join(map(member_token, sorted(members)))))
        if len(email_rows) >= 5000:
            flush()
    flush()
    bar.close()
    return seen


def _load_questions(conn, questions, seen: set[str], summary) -> None:
    """Every well-formed question, flagged with whether the agent can reach its gold emails; malformed ones
    and a second question with the same id are skipped and counted."""
    split_counts: dict[str, int] = {}
    question_ids: set = set()
    for n, raw in enumerate(questions, 1):
        try:
            q = normalize_question(raw)
            if q.id in question_ids:  # the first of two questions with one id is kept, as it was read
                raise ValueError(f"id {q.id!r} given twice")
            question_ids.add(q.id)
        except ValueError as exc:
            summary.questions_skipped += 1
            if len(summary.question_skip_examples) < SKIP_EXAMPLES:
                qid = raw.get("id") if isinstance(raw, dict) else None
                where = f"record {n}" + (f" (id {qid!r})" if qid is not None else "")
                summary.question_skip_examples.append(f"{where}: {exc}")
            continue
        # Answerable only if the agent can reach every gold email: it is stored and in the asked inbox.
        gold_in_db = all(m in seen for m in q.message_ids) and conn.execute(
            "SELECT COUNT(*) FROM emails JOIN mailbox ON mailbox.email_id = emails.id WHERE mailbox.address = ? "
            f"AND emails.message_id IN ({','.join('?' * len(q.message_ids))})",
            (q.inbox_address, *q.message_ids)).fetchone()[0] == len(set(q.message_ids))
        summary.questions_missing_gold += not gold_in_db
        split_counts[q.split] = split_counts.get(q.split, 0) + 1
        conn.execute("INSERT INTO questions VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                     (q.id, q.question, q.answer, json.dumps(q.message_ids), q.how_realistic,
                      q.inbox_address, q.query_date, q.split, int(gold_in_db), None, None))
    summary.questions = split_counts
    if summary.questions_skipped and not split_counts:  # e.g. the emails file given as --questions
        raise UserError(f"No usable questions among {summary.questions_skipped} records (first: "
                        f"{summary.question_skip_examples[0]}); is that the questions file?")


def add_arguments(p, default_db: str, demo_db: str) -> None:
    """The build-db subcommand's flags."""
    p.add_argument("--demo", action="store_true", help="the bundled, offline demo inbox (db: data/demo.db)")
    p.add_argument("--enron-sample", action="store_true",
                   help="the real-mail sample (29,997 Enron emails, data/enron-sample) with its 530 questions "
                        "(data/enron-questions), picked from --emails (the CMU release's maildir/, or Hugging Face's "
                        "parquet files) or downloaded from Hugging Face")
    p.add_argument("--emails", metavar="PATH", help="local corpus: .jsonl(.gz), .parquet, a maildir folder "
                                                   "or an mbox file (default: Hugging Face corbt/enron-emails)")
    p.add_argument("--questions", metavar="PATH", help="local questions: .jsonl(.gz) or .parquet with the ART·E schema "
                                                      "(default: Hugging Face corbt/enron_emails_sample_questions; "
                                                      "with --enron-sample data/enron-questions/questions.jsonl)")
    p.add_argument("--db", metavar="PATH", help=f"output database (default {default_db}; with --demo {demo_db}; with "
                                                f"--enron-sample data/enron_sample.db)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --db even though its questions are lost (this build brings none), or "
                        "though another program wrote it")
