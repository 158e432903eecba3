"""The email database: where emails come from, the SQLite/FTS5 schema, and read-only access.

Owns: reading corpora (Hugging Face `corbt/enron-emails`, JSONL(.gz), Parquet, maildir, mbox, the demo
inbox), normalising records, the schema, and the read-only search/read queries the agent's tools run.
Building a database from emails and questions is `build`'s (it sits above this module and `questions`).

An *inbox* is every message an address sent or received (to/cc/bcc), as in ART·E. Dates are stored as
'YYYY-MM-DD HH:MM:SS' in UTC, so string comparison is time comparison.
"""

from __future__ import annotations

import email
import email.policy
import hashlib
import email.utils
import functools
import gzip
import json
import math
import mailbox as mboxlib
import os
import re
import sqlite3
import textwrap
import unicodedata
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import quote

from email_agent.data.mime import decode_header, message_body

from email_agent.errors import DataError


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


class SkipRecord(Exception):
    """A malformed email record: skipped and counted, never fatal."""


# ----------------------------------------------------------------------------------------------
# Normalising records from any source into one shape
# ----------------------------------------------------------------------------------------------

def parse_date(value) -> str:
    """Any date we meet (ISO string, 'YYYY-MM-DD HH:MM:SS', RFC 2822 header, datetime or date, Unix time) -> UTC
    'YYYY-MM-DD HH:MM:SS'."""
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, date):  # a Parquet date32 column
        dt = datetime(value.year, value.month, value.day)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        seconds = value / 1000 if abs(value) >= 1e11 else value  # Unix time in seconds, or in milliseconds
        try:
            dt = datetime.fromtimestamp(seconds, timezone.utc)
        except (OverflowError, OSError, ValueError) as exc:
            raise SkipRecord(f"unparseable date {value!r}") from exc
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        try:
            dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            try:
                dt = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError) as exc:
                raise SkipRecord(f"unparseable date {text[:40]!r}") from exc
    else:
        raise SkipRecord("missing date")
    if dt.tzinfo is not None:  # naive datetimes (the HF dataset's timestamps) are taken as UTC
        try:
            dt = dt.astimezone(timezone.utc).replace(tzinfo=None)
        except OverflowError as exc:  # year 1 east of UTC, year 9999 west of it
            raise SkipRecord(f"unparseable date {value!r}"[:60]) from exc
    return dt.isoformat(" ", "seconds")  # strftime's %Y writes year 999 as '999', which sorts after '2024'


def _addresses(value, field: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (str, list, tuple)):
        raise SkipRecord(f"{field} is neither an address nor a list of them")
    if isinstance(value, str):
        if "<" not in value and "," not in value and '"' not in value and " " not in value.strip():
            value = [value]  # a bare address: the full header parser is the slowest step of a build
        else:
            value = [addr for _, addr in email.utils.getaddresses([value])]
    return [str(a).strip().lower() for a in value if a and str(a).strip()]


def _text(raw: dict, field: str) -> str:
    value = raw.get(field) or ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise SkipRecord(f"{field} is not text")
    if not value.isascii():  # O(1) in CPython: only non-ASCII text pays for the check
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a JSON \ud800 escape: SQLite stores UTF-8 only
            value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def normalize_email(raw: dict) -> dict:
    """One record from any source (our JSONL schema or the HF column names) -> the row we store."""
    if not isinstance(raw, dict):
        raise SkipRecord("not a JSON object")
    message_id = _text(raw, "message_id").strip()
    if not message_id:
        raise SkipRecord("missing message_id")
    senders = _addresses(raw.get("from_address", raw.get("from")), "from_address")
    return {
        "message_id": message_id,
        "date": parse_date(raw.get("date")),
        "subject": _text(raw, "subject"),
        "from_address": senders[0] if senders else "",
        "to": _addresses(raw.get("to_addresses", raw.get("to")), "to_addresses"),
        "cc": _addresses(raw.get("cc_addresses", raw.get("cc")), "cc_addresses"),
        "bcc": _addresses(raw.get("bcc_addresses", raw.get("bcc")), "bcc_addresses"),
        "body": _text(raw, "body"),
        "file_name": _text(raw, "file_name"),
    }


def _unfold(header, decode: bool = True) -> str:
    # CMU/Enron exports fold long headers mid-word with "\n\t"; other folds become one space.
    # Address headers are parsed before decoding: a decoded display name may hold a comma ("Müller, Jörg").
    if header is None:
        return ""
    text = decode_header(header) if decode else str(header)
    return " ".join(text.replace("\r", "").replace("\n\t", "").split("\n")).strip()


def _mbox_from_date(msg: email.message.Message) -> str | None:
    """The date on an mbox message's "From " separator line ('From sender Thu Jan 11 10:00:00 2024', Gmail's
    with '+0000' before the year): drafts and some clients' messages have no Date header, but mbox writers
    stamp every message there."""
    if not isinstance(msg, mboxlib.mboxMessage):
        return None
    parts = msg.get_from().split()[1:]
    zone = next((p for p in parts if re.fullmatch(r"[+-]\d{4}", p)), "+0000")
    try:
        return datetime.strptime(" ".join([*(p for p in parts if p != zone), zone]),
                                 "%a %b %d %H:%M:%S %Y %z").isoformat(" ")
    except ValueError:
        return None


def message_to_record(msg: email.message.Message, file_name: str) -> dict:
    """An RFC 822 message (maildir file, mbox entry, .eml) -> a raw record in our JSONL schema.

    The body is the message's inline text (HTML turned into text when there is no plain part; attachments
    skipped); headers are decoded (RFC 2047, any charset). A message without a Message-ID (drafts, some
    Sent folders) gets a stable one made from its content, so it is kept and a re-import finds the same id.
    """
    body = message_body(msg).replace("\r\n", "\n")
    record = {
        "message_id": _unfold(msg.get("Message-ID")),
        "date": _unfold(msg.get("Date")) or _mbox_from_date(msg),
        "subject": _unfold(msg.get("Subject")),
        "from_address": _unfold(msg.get("From"), decode=False),
        "to_addresses": _unfold(msg.get("To"), decode=False),
        "cc_addresses": _unfold(msg.get("Cc"), decode=False),
        "bcc_addresses": _unfold(msg.get("Bcc"), decode=False),
        "body": body,
        "file_name": file_name,
    }
    if not record["message_id"] and (record["date"] or body):
        digest = hashlib.sha1(json.dumps([record[k] for k in ("date", "from_address", "subject", "body")]).encode())
        record["message_id"] = f"<{digest.hexdigest()[:20]}@no-message-id>"
    return record


# ----------------------------------------------------------------------------------------------
# Sources: each yields raw records (dicts); normalize_email makes them uniform.
# ----------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> Iterator[dict]:
    line_no = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a byte-order mark is not JSON
                except UnicodeDecodeError as exc:  # a binary file or another encoding: not worth reading on
                    raise DataError(f"{path}: line {line_no} is not UTF-8 ({exc.reason} at byte {exc.start}); "
                                    "JSON Lines are UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield {"_error": f"line {line_no} is not JSON"}
    except (gzip.BadGzipFile, EOFError) as exc:  # not gzip, or cut off
        raise DataError(f"{path} is not a complete gzip file (after line {line_no}: {exc})") from None


def read_parquet(path: Path) -> Iterator[dict]:
    # here, not at the top: pyarrow imports numpy (~0.1 s), and only Parquet sources need it
    import pyarrow
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
            yield from batch.to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc})") from None


RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")  # JSON Lines, one email record per line

# Files in mail folders that are not mail: Thunderbird indexes, Apple Mail and Dovecot/Courier bookkeeping.
NOT_MAIL_SUFFIXES = (".msf", ".plist", ".index", ".cache", ".log", ".json", ".dat", ".db", ".sqlite", ".toc",
                     ".html", ".htm")  # Thunderbird writes filterlog.html beside its folders
# A database's companions (build-db's temporary file, SQLite's journal, generate-questions' reply cache): a --db
# kept inside the --emails folder is not read back as mail.
NOT_MAIL_PARTS = (".db.", ".db-", ".sqlite.", ".sqlite-")
NOT_MAIL_NAMES = {"maildirfolder", "dovecot-uidlist", "dovecot-keywords", "dovecot-uidvalidity", "subscriptions",
                  "courierimapkeywords", "courierimapuiddb", "courierimapacl", "table_of_contents",
                  "msgFilterRules.dat"}


def read_maildir(root: Path) -> Iterator[dict]:
    """A folder of mail, however it is laid out: a CMU-style tree (every file one message), maildirs (cur/new,
    nested Maildir++ folders; tmp/ holds unfinished deliveries and is skipped), Thunderbird's mbox files and
    their .sbd subfolders, Apple Mail's Name.mbox/mbox, and .eml files; JSON Lines and Parquet files in it are
    read as such. Index files and dotfiles are skipped."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.name
        if name.startswith(".") or name in NOT_MAIL_NAMES or name.lower().endswith(NOT_MAIL_SUFFIXES) \
                or any(part in name.lower() for part in NOT_MAIL_PARTS) or name.startswith("dovecot.") \
                or path.stat().st_size == 0:
            continue  # an empty file is an empty Thunderbird folder, not a message
        if path.parent.name == "tmp" and (path.parent.parent / "cur").is_dir():
            continue
        label = str(path.relative_to(root.parent))
        if name.lower().endswith((*RECORD_SUFFIXES, ".parquet")):
            yield from read_emails(path)
            continue
        if _looks_like_mbox(path):
            yield from read_mbox(path, label)
            continue
        with open(path, "rb") as f:
            msg = email.message_from_binary_file(f, policy=email.policy.compat32)
        yield message_to_record(msg, label)


def read_mbox(path: Path, label: str | None = None) -> Iterator[dict]:
    box = mboxlib.mbox(path, create=False)
    try:
        for key, msg in box.iteritems():
            yield message_to_record(msg, f"{label or path.name}#{key}")
    finally:
        box.close()


def read_emails(path: str | os.PathLike) -> Iterator[dict]:
    """Pick a reader from what PATH is: a directory (mail folders of any layout), .jsonl(.gz), .parquet, an
    mbox file (Gmail Takeout, Thunderbird) or a single .eml message."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"No such file or folder: {path}")
    if path.is_dir():
        return read_maildir(path)
    name = path.name.lower()
    if name.endswith(RECORD_SUFFIXES):
        return read_jsonl(path)
    if name.endswith(".parquet"):
        return read_parquet(path)
    if _looks_like_mbox(path):
        return read_mbox(path)
    if name.endswith(".mbox"):
        with open(path, "rb") as f:
            first = f.readline(80).decode("utf-8", "replace").strip()
        raise DataError(f"{path} is not an mbox file: " + (f"its first line is {first!r}, and an mbox's messages each "
                        f"begin with a 'From ' line" if first else "it is empty"))
    if name.endswith(".eml"):
        with open(path, "rb") as f:
            return iter([message_to_record(email.message_from_binary_file(f, policy=email.policy.compat32), path.name)])
    if name.endswith((".pst", ".ost", ".olm")):
        raise DataError(f"{path} is an Outlook archive, which this tool cannot read; export the folders as mbox "
                        f"(e.g. with Thunderbird's ImportExportTools, or readpst -r from libpst) and pass that.")
    raise DataError(f"Don't know how to read {path}: expected a mail folder, .jsonl(.gz), .parquet, an mbox file or "
                    f"an .eml file.")


def _looks_like_mbox(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(5) == b"From "


HUB_OFFLINE_HELP = (
    "Could not load {name!r} from the Hugging Face Hub ({error}). The default build downloads the ART·E "
    "Enron corpus (~517k emails) and its questions, which needs network access or a populated Hugging Face "
    "cache (set HF_HUB_OFFLINE=1 to use the cache, HF_ENDPOINT to use a mirror). Offline, build from local "
    "files with --emails PATH (JSONL, Parquet, maildir or mbox) and --questions PATH, or try the bundled "
    "demo inbox with --demo."
)


def load_hub_dataset(name: str, split: str | None = None):
    """A Hugging Face dataset by name, with a readable error instead of a network traceback."""
    try:
        # here, not at the top: datasets takes ~1.5 s to import (pyarrow, numpy); only build-db from the hub needs it
        import datasets
        import huggingface_hub

        datasets.logging.set_verbosity_error()
        huggingface_hub.utils.logging.set_verbosity_error()  # one clear error below instead of retry chatter
        return datasets.load_dataset(name, split=split)
    except Exception as exc:  # the hub raises many kinds (ConnectionError, HfHubHTTPError, OfflineModeIsEnabled...)
        raise DataError(HUB_OFFLINE_HELP.format(name=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")) from exc


def read_hub_emails(name: str = "corbt/enron-emails"):
    """The ART·E corpus (a `datasets.Dataset`: iterable of records with `from`/`to`/`cc`/`bcc` columns, and a len)."""
    return load_hub_dataset(name, split="train")


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
            raise DataError(f"{flag} must be a date like 2001-05-31, not {day!r}") from None
    return day


def visible_until(as_of: str | None) -> str | None:
    """The bound that hides mail dated after `as_of` (a user's --as-of; None shows everything)."""
    return None if check_day("--as-of", as_of) is None else day_after(as_of)


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
            raise DataError(f"No database at {path}; run `python train_email_search_agent.py build-db` first.")
        self.path = path
        self.conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, check_same_thread=False)
        try:
            for columns, table in READ_COLUMNS:  # prepared, not run: a missing table or column fails here
                self.conn.execute(f"SELECT {columns} FROM {table} LIMIT 0").fetchall()
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise DataError(f"{path} cannot be read as an email database of this tool ({exc}): it is another "
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

    def require_inbox(self, address: str) -> None:
        """DataError naming the largest inboxes when `address` has no mail at all: a typo, not an empty result."""
        if self.inbox_size(address) == 0:
            known = ", ".join(f"{inbox} ({count})" for inbox, count in self.largest_inboxes(5))
            raise DataError(f"{self.path} has no mail sent or received by {address!r}; its largest inboxes: {known}.")

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
        """`read` for a person: a DataError saying why there is no such email, or what hides it."""
        email = self.read(message_id, inbox=inbox, visible_until=visible_until(as_of))
        if email is not None:
            return email
        if self.read(message_id) is None:
            hint = "" if message_id.startswith("<") else f" (ids are written with angle brackets: '<{message_id}>')"
            raise DataError(f"No email with message_id {message_id!r}{hint}.")
        hidden = [f"--inbox {inbox}" if inbox else "", f"--as-of {as_of}" if as_of else ""]
        raise DataError(f"Email {message_id!r} exists, but {' '.join(filter(None, hidden))} hides it (not that "
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
