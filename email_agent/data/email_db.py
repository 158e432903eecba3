"""The email database: its SQLite/FTS5 schema and the read-only access the agent's tools run.

Owns: the schema and indexes `build` creates, `member_token` (an address as one FTS token), keywords and dates
as the queries take them, and `EmailDB`, the read-only handle whose search and read are what the agent sees.
Where emails come from and how a record is normalised is `sources`'; building a database from emails and
questions is `build`'s (it sits above this module, `sources` and `questions`).

An *inbox* is every message an address sent or received (to/cc/bcc), as in ART·E. Dates are stored as
'YYYY-MM-DD HH:MM:SS' in UTC, so string comparison is time comparison.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sqlite3
import textwrap
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Iterable
from urllib.parse import quote

from email_agent.errors import UserError


MAX_SEARCH_RESULTS = 20  # search_inbox clamps max_results to this instead of failing the call
SNIPPET_TOKENS = 16

SCHEMA = """
CREATE TABLE emails (
    id           INTEGER PRIMARY KEY,
    message_id   TEXT NOT NULL UNIQUE,
    date         TEXT NOT NULL,            -- 'YYYY-MM-DD HH:MM:SS', UTC
    subject      TEXT NOT NULL,
    from_address TEXT NOT NULL,            -- lower-case
    body         TEXT NOT NULL,
    file_name    TEXT NOT NULL,
    members      TEXT NOT NULL             -- member_token() of sender and recipients, indexed by FTS
);
CREATE TABLE recipients (
    email_id INTEGER NOT NULL REFERENCES emails(id),
    address  TEXT NOT NULL,                -- lower-case
    kind     TEXT NOT NULL                 -- 'to', 'cc' or 'bcc' (no CHECK: it tripled this table's load time)
);
-- Inbox membership (sender and every recipient), so inbox scoping is one indexed lookup.
CREATE TABLE mailbox (
    address  TEXT NOT NULL,
    email_id INTEGER NOT NULL,
    PRIMARY KEY (address, email_id)
) WITHOUT ROWID;
-- `members` lets FTS5 intersect keyword matches with an inbox inside the index (fast for big inboxes
-- and common words); the exact check against `mailbox` still decides what is in an inbox.
CREATE VIRTUAL TABLE emails_fts USING fts5(
    subject, body, members, content='emails', content_rowid='id',
    tokenize='porter unicode61 remove_diacritics 2'
);
CREATE TABLE questions (
    id            NOT NULL PRIMARY KEY,    -- no type: an integer or a string id is kept as given
    question      TEXT NOT NULL,
    answer        TEXT NOT NULL,
    message_ids   TEXT NOT NULL,           -- JSON list
    how_realistic REAL,
    inbox_address TEXT NOT NULL,           -- lower-case
    query_date    TEXT NOT NULL,           -- 'YYYY-MM-DD'
    split         TEXT NOT NULL,
    gold_in_db    INTEGER NOT NULL,        -- 1 when every message_id is in emails and in inbox_address's mailbox
    model         TEXT,                    -- the LLM that wrote it (generate-questions); NULL if imported
    temperature   REAL                     -- its sampling temperature
);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# Created after the bulk load: building indexes once is much faster than maintaining them per row.
INDEXES = """
CREATE INDEX idx_emails_from ON emails(from_address);
CREATE INDEX idx_emails_date ON emails(date);
CREATE INDEX idx_recipients_address ON recipients(address, kind);
CREATE INDEX idx_recipients_email ON recipients(email_id);
CREATE INDEX idx_questions_split ON questions(split);
"""


# ----------------------------------------------------------------------------------------------
# Read-only access: the queries behind the agent's tools
# ----------------------------------------------------------------------------------------------

@dataclass
class SearchResult:
    message_id: str
    subject: str
    from_address: str
    date: str
    snippet: str

    def as_text(self, rank: int) -> str:
        """For a person (`search`): the rank, date, sender and subject, the id, the snippet wrapped."""
        snippet = textwrap.indent(textwrap.fill(" ".join(self.snippet.split()), 100), "    ")
        return f"{rank:>2}. {self.date}  {self.from_address}  {self.subject}\n    {self.message_id}\n{snippet}"


@dataclass
class Email:
    message_id: str
    date: str
    subject: str
    from_address: str
    to_addresses: list[str]
    cc_addresses: list[str]
    bcc_addresses: list[str]
    body: str
    file_name: str

    def as_text(self) -> str:
        """For a person (`read`): the headers, then the body."""
        lines = [f"Message-ID: {self.message_id}", f"Date: {self.date} UTC", f"From: {self.from_address}"]
        lines += [f"{label}: {', '.join(addresses)}" for label, addresses in
                  (("To", self.to_addresses), ("Cc", self.cc_addresses), ("Bcc", self.bcc_addresses)) if addresses]
        return "\n".join(lines + [f"Subject: {self.subject}", "", self.body])


@functools.lru_cache(maxsize=1 << 20)  # addresses repeat across a corpus; hashing each once saves ~10% of a build
def member_token(address: str) -> str:
    """A single FTS token standing for one address (digits only, so the porter stemmer leaves it alone)."""
    digest = hashlib.blake2b(address.encode("utf-8"), digest_size=8).digest()
    return "m" + str(int.from_bytes(digest, "big"))


def fts_query(keywords: Iterable[str]) -> str | None:
    """Keywords -> an FTS5 query that matches each keyword literally (as a phrase), all of them (AND).

    Quoting makes every FTS5 operator (AND, NEAR, *, -, parentheses, column filters) plain text. Keywords
    with no letters or digits can match nothing, so they are dropped; None means nothing searchable is left.
    """
    phrases = []
    for keyword in keywords:
        text = str(keyword).replace("\x00", " ")  # NUL would end the query string inside SQLite
        if any(unicodedata.category(ch)[0] in "LN" for ch in text):
            phrases.append('"' + text.replace('"', '""') + '"')
    return " AND ".join(phrases) or None


def _day(day: str) -> datetime:
    try:
        return datetime.fromisoformat(str(day).strip()[:10])
    except ValueError:
        raise ValueError(f"not a date: {day!r}") from None


def day_start(day: str) -> str:
    """'YYYY-MM-DD' (or a longer ISO timestamp) -> the stored form of that day's midnight; ValueError if not a date."""
    return f"{_day(day).date().isoformat()} 00:00:00"  # isoformat keeps 4 digits for years before 1000


def day_after(day: str) -> str:
    """Exclusive upper bound that keeps everything dated on `day` (e.g. a question's query_date)."""
    start = _day(day)
    if start.date() == datetime.max.date():
        return "9999-12-31 24:00:00"  # no next day to name; compared as text, this follows every time that day
    return f"{(start + timedelta(days=1)).date().isoformat()} 00:00:00"


def check_day(flag: str, day: str | None) -> str | None:
    """A date a user typed, whole: the agent's tools read the first 10 characters of what a model sends
    ('2001-05-31T09:00'), but '2001-05-31x' on a command line is a typo to point at."""
    if day is not None:
        try:  # YYYY-MM-DD first: fromisoformat alone also takes '20010531T0900', which the tools cannot read
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", day.strip()[:10]):
                raise ValueError  # to the message below
            datetime.fromisoformat(day.strip())
        except ValueError:
            raise UserError(f"{flag} must be a date like 2001-05-31, not {day!r}") from None
    return day


def visible_until(as_of: str | None) -> str | None:
    """The bound that hides mail dated after `as_of` (a user's --as-of; None shows everything)."""
    return None if check_day("--as-of", as_of) is None else day_after(as_of)


DEMO_DB = "data/demo.db"  # where `build-db --demo` writes the demo inbox, and what --demo reads


def no_database(path: Path, build: str = "build-db") -> str:
    """The error for a database that is not there, pointing to the demo inbox's when that one is."""
    demo = Path(DEMO_DB)
    if demo.resolve() == path.resolve():
        build = "build-db --demo"
    elif demo.is_file():
        return (f"No database at {path}; build it with `python train_email_search_agent.py {build}`, or use the "
                f"demo inbox's {DEMO_DB} with --demo.")
    return f"No database at {path}; run `python train_email_search_agent.py {build}` first."


# What this module reads: a database without these (another program's, or a build older than the mailbox table)
# is refused when opened, not midway through a search.
READ_COLUMNS = [("id, message_id, date, subject, from_address, body, file_name", "emails"),
                ("email_id, address, kind", "recipients"), ("address, email_id", "mailbox"),
                ("subject, body, members", "emails_fts"), ("id, question, answer, message_ids", "questions"),
                ("key, value", "meta")]


# `# pragma: no mutate` marks SQL text: mutmut's mutants of it change its case (SQLite reads keywords and names in
# any case) or wrap it in "XX" (a syntax error every query hits), so they say nothing about the tests.
class EmailDB:
    """Read-only handle on a built database. Opened with mode=ro: nothing a caller sends can change it."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not path.is_file():
            raise UserError(no_database(path))
        self.path = path
        self.conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, check_same_thread=False)
        try:
            for columns, table in READ_COLUMNS:  # prepared, not run: a missing table or column fails here
                self.conn.execute(f"SELECT {columns} FROM {table} LIMIT 0").fetchall()
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise UserError(f"{path} cannot be read as an email database of this tool ({exc}): it is another "
                            f"program's, from an older version, or damaged; rebuild it with build-db.") from exc

    def close(self) -> None:
        self.conn.close()

    def meta(self) -> dict[str, str]:
        return dict(self.conn.execute("SELECT key, value FROM meta"))  # pragma: no mutate

    def inbox_size(self, address: str) -> int:
        """How many emails `address` sent or received."""
        return self.conn.execute("SELECT COUNT(*) FROM mailbox WHERE address = ?",  # pragma: no mutate
                                 (address.strip().lower(),)).fetchone()[0]

    def largest_inboxes(self, n: int) -> list[tuple[str, int]]:
        return self.conn.execute("SELECT address, COUNT(*) AS k FROM mailbox "  # pragma: no mutate
                                 "GROUP BY address ORDER BY k DESC LIMIT ?",  # pragma: no mutate
                                 (n,)).fetchall()

    def question_counts(self) -> dict[str, int]:
        """address -> how many questions (either split) ask about its inbox."""
        return dict(self.conn.execute("SELECT inbox_address, COUNT(*) FROM questions "  # pragma: no mutate
                                      "GROUP BY inbox_address").fetchall())  # pragma: no mutate

    def require_inbox(self, address: str) -> None:
        """UserError naming the largest inboxes when `address` has no mail at all: a typo, not an empty result."""
        if self.inbox_size(address) == 0:
            known = ", ".join(f"{inbox} ({count})" for inbox, count in self.largest_inboxes(5))
            raise UserError(f"{self.path} has no mail sent or received by {address!r}; its largest inboxes: {known}.")

    def search(self, inbox: str, keywords: Iterable[str], *, from_address: str | None = None,
               to_address: str | None = None, sent_after: str | None = None, sent_before: str | None = None,
               visible_until: str | None = None, max_results: int = 10) -> list[SearchResult]:
        """Emails in `inbox` matching every keyword, best bm25 match first (newest first on ties).

        sent_after is inclusive of that day, sent_before exclusive ('YYYY-MM-DD'; ValueError if malformed).
        visible_until is an exclusive 'YYYY-MM-DD HH:MM:SS' bound set by the environment, not the model.
        max_results is clamped to 1..MAX_SEARCH_RESULTS.
        """
        query = fts_query(keywords)
        if query is None:
            return []
        inbox = inbox.strip().lower()
        where = ["emails_fts MATCH ?",  # pragma: no mutate
                 "EXISTS (SELECT 1 FROM mailbox m WHERE m.address = ? AND m.email_id = e.id)"]  # pragma: no mutate
        params: list = [f"members : {member_token(inbox)} AND {{subject body}} : ({query})", inbox]
        if from_address:
            where.append("e.from_address = ?")  # pragma: no mutate
            params.append(from_address.strip().lower())
        if to_address:
            where.append("EXISTS (SELECT 1 FROM recipients r "  # pragma: no mutate
                         "WHERE r.address = ? AND r.email_id = e.id)")  # pragma: no mutate
            params.append(to_address.strip().lower())
        if sent_after:
            where.append("e.date >= ?")  # pragma: no mutate
            params.append(day_start(sent_after))
        if sent_before:
            where.append("e.date < ?")  # pragma: no mutate
            params.append(day_start(sent_before))
        if visible_until:
            where.append("e.date < ?")  # pragma: no mutate
            params.append(visible_until)
        params.append(max(1, min(int(max_results), MAX_SEARCH_RESULTS)))
        # bm25 weight 0 for `members`: being in the inbox must not change relevance.
        sql = f"""
            SELECT e.message_id, e.subject, e.from_address, e.date,
                   snippet(emails_fts, 1, '**', '**', ' ... ', {SNIPPET_TOKENS})
            FROM emails_fts JOIN emails e ON e.id = emails_fts.rowid
            WHERE {' AND '.join(where)}
            ORDER BY bm25(emails_fts, 1.0, 1.0, 0.0), e.date DESC
            LIMIT ?"""
        return [SearchResult(*row) for row in self.conn.execute(sql, params)]

    def read_or_explain(self, message_id: str, *, inbox: str | None = None, as_of: str | None = None) -> Email:
        """`read` for a person: a UserError saying why there is no such email, or what hides it."""
        email = self.read(message_id, inbox=inbox, visible_until=visible_until(as_of))
        if email is not None:
            return email
        if self.read(message_id) is None:
            hint = "" if message_id.startswith("<") else f" (ids are written with angle brackets: '<{message_id}>')"
            raise UserError(f"No email with message_id {message_id!r}{hint}.")
        hidden = [f"--inbox {inbox}" if inbox else "", f"--as-of {as_of}" if as_of else ""]
        raise UserError(f"Email {message_id!r} exists, but {' '.join(filter(None, hidden))} hides it (not that "
                        "inbox's, or sent after that day).")

    def read(self, message_id: str, *, inbox: str | None = None, visible_until: str | None = None) -> Email | None:
        """One email by message_id; None if absent, outside `inbox`, or dated at/after `visible_until`."""
        sql = ("SELECT id, message_id, date, subject, from_address, body, file_name "  # pragma: no mutate
               "FROM emails e WHERE message_id = ?")  # pragma: no mutate
        params: list = [str(message_id).strip()]
        if inbox is not None:
            sql += " AND e.id IN (SELECT email_id FROM mailbox WHERE address = ?)"  # pragma: no mutate
            params.append(inbox.strip().lower())
        if visible_until is not None:
            sql += " AND e.date < ?"  # pragma: no mutate
            params.append(visible_until)
        row = self.conn.execute(sql, params).fetchone()
        if row is None:
            return None
        email_id, *fields = row
        recipients = {"to": [], "cc": [], "bcc": []}
        for address, kind in self.conn.execute(
                "SELECT address, kind FROM recipients WHERE email_id = ? ORDER BY rowid",  # pragma: no mutate
                (email_id,)):
            recipients[kind].append(address)
        mid, date, subject, sender, body, file_name = fields
        return Email(mid, date, subject, sender, recipients["to"], recipients["cc"], recipients["bcc"], body, file_name)
