"""Where emails come from: every export this tool reads, as raw records, and the one row shape they are normalised to.

Owns: the readers (Hugging Face `corbt/enron-emails`, JSONL(.gz), Parquet, mail folders of any layout, mbox, .eml),
picked by `read_emails` from what a path is; an RFC 822 message turned into a record (its text from `mime`); and
`normalize_email`, which makes every source's record the row `build` stores, or a `SkipRecord` saying why not.
It knows nothing of the database: the schema and the read-only queries are `email_db`'s.

Dates come out as 'YYYY-MM-DD HH:MM:SS' in UTC, so string comparison is time comparison.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import gzip
import hashlib
import json
import mailbox as mboxlib
import math
import os
import re
import tarfile
import zipfile
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Iterator

from email_agent.data.mime import decode_header, message_body
from email_agent.errors import UserError


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
                    raise UserError(f"{path}: line {line_no} is not UTF-8 ({exc.reason} at byte {exc.start}); "
                                    "JSON Lines are UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield {"_error": f"line {line_no} is not JSON"}
    except (gzip.BadGzipFile, EOFError) as exc:  # not gzip, or cut off
        raise UserError(f"{path} is not a complete gzip file (after line {line_no}: {exc})") from None


def read_parquet(path: Path) -> Iterator[dict]:
    # here, not at the top: pyarrow imports numpy (~0.1 s), and only Parquet sources need it
    import pyarrow
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
            yield from batch.to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise UserError(f"{path} is not a readable Parquet file ({exc})") from None


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
        raise UserError(f"No such file or folder: {path}")
    if path.is_dir():
        return read_maildir(path)
    name = path.name.lower()
    if name.endswith(RECORD_SUFFIXES):
        return read_jsonl(path)
    if name.endswith(".parquet"):
        return read_parquet(path)
    if _looks_like_mbox(path):
        return read_mbox(path)
    if (unpack := unpacking_advice(path)) is not None:
        raise UserError(unpack)
    if name.endswith(".mbox"):
        with open(path, "rb") as f:
            first = f.readline(80).decode("utf-8", "replace").strip()
        raise UserError(f"{path} is not an mbox file: " + (f"its first line is {first!r}, and an mbox's messages each "
                        f"begin with a 'From ' line" if first else "it is empty"))
    if name.endswith(".eml"):
        with open(path, "rb") as f:
            return iter([message_to_record(email.message_from_binary_file(f, policy=email.policy.compat32), path.name)])
    if name.endswith((".pst", ".ost", ".olm")):
        raise UserError(f"{path} is an Outlook archive, which this tool cannot read; export the folders as mbox "
                        f"(e.g. with Thunderbird's ImportExportTools, or readpst -r from libpst) and pass that.")
    raise UserError(f"Don't know how to read {path}: expected a mail folder, .jsonl(.gz), .parquet, an mbox file or "
                    f"an .eml file.")


def unpacking_advice(path: Path) -> str | None:
    """What to do with an archive or a compressed file given as mail (a Takeout .zip, an .mbox.gz, the CMU Enron
    release's .tar.gz): unpack it first, and pass what it holds, named where the archive says; None if `path` is
    none of these. Read from the file's first bytes, whatever its name."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as archive:
                boxes = sorted((i for i in archive.infolist() if i.filename.lower().endswith(".mbox")),
                               key=lambda i: -i.file_size)
        except (zipfile.BadZipFile, OSError):
            boxes = []
        inside = f"--emails '{boxes[0].filename}'" if boxes else "the mail folder or mbox file it holds"
        return f"{path} is a zip archive; unzip it first (unzip '{path}'), then pass {inside}."
    if magic[:2] != b"\x1f\x8b":
        return None
    try:  # a tar inside: its first entry names the folder it unpacks to
        with tarfile.open(path, "r:gz") as archive:
            first = archive.next()
        top = first.name.split("/")[0] if first is not None else None
    except (tarfile.TarError, OSError, EOFError):
        top = None
    if top:
        return (f"{path} is a compressed tar archive; unpack it first (tar -xzf '{path}'), then pass the folder it "
                f"holds: --emails {top}.")
    unpacked = path.with_suffix("") if path.suffix.lower() == ".gz" else "the file it holds"
    return f"{path} is gzip-compressed; unpack it first (gunzip -k '{path}'), then pass {unpacked}."


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
        raise UserError(HUB_OFFLINE_HELP.format(name=name, error=f"{type(exc).__name__}: {str(exc)[:200]}")) from exc


def read_hub_emails(name: str = "corbt/enron-emails"):
    """The ART·E corpus (a `datasets.Dataset`: iterable of records with `from`/`to`/`cc`/`bcc` columns, and a len)."""
    return load_hub_dataset(name, split="train")

