"""The real-mail sample: the 29,997 Enron emails of 45 CMU `inbox` folders that every real-mail figure of this project
used, picked out of a public source by a manifest shipped in the repository, and checked against it.

Owns: the manifest (data/enron-sample/manifest.json.xz: the sample's message ids by CMU inbox folder, in the sample's
order, each with a digest of its body, and a checksum over them), the sources the sample is picked from (Hugging
Face's `corbt/enron-emails`, downloaded or as its parquet files; the CMU release `enron_mail_20150507` unpacked, its
`maildir/`; or any file build-db reads, such as the sample's own emails.jsonl.gz), the conversion of a CMU file the
sample was made with (../shared/data/enron/SOURCE.md), and the check of what a source holds. The build itself is
`build`'s; the emails come out in the sample's order, so every source builds the same rows.

A body's digest is taken over its words: whitespace runs read as one space and characters outside ASCII dropped (the
sample's bodies are all ASCII; a converter that decodes Windows-1252 bytes otherwise, or strips a body's blank lines,
gives the same digest), the first 8 hex digits of its sha256. The sample's checksum is the sha256 of the lines
`message_id<TAB>digest\\n` in message_id order, so the manifest checks itself and any build can be checked against it.
"""

from __future__ import annotations

import email
import email.header
import email.policy
import hashlib
import json
import lzma
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from email_agent.errors import UserError
from email_agent.data.questions import read_questions
from email_agent.data.sources import read_emails, load_hub_dataset

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "data" / "enron-sample" / "manifest.json.xz"
QUESTIONS = ROOT / "data" / "enron-questions" / "questions.jsonl"  # the real-mail questions, written for the sample
SAMPLE_DB = "data/enron_sample.db"
HUB_NAME = "corbt/enron-emails"
# More of the sample missing or changed than this, and a build is refused: one converter's few odd messages stay under
# it, while a half-unpacked release, one parquet file of three or another corpus is far over, and the figures built
# on such a copy would not be this project's.
MAX_UNMATCHED = 0.01


# ---- digests and the manifest ----------------------------------------------------------------------------------

def body_digest(body: str) -> str:
    """The first 8 hex digits of the sha256 of a body's words (see the module's docstring)."""
    words = " ".join(str(body or "").encode("ascii", "ignore").decode("ascii").split())
    return hashlib.sha256(words.encode("ascii")).hexdigest()[:8]


def sample_checksum(digests: dict[str, str]) -> str:
    """message_id -> body digest, as one sha256: of the lines `message_id<TAB>digest\\n` in message_id order."""
    return hashlib.sha256("".join(f"{mid}\t{digests[mid]}\n" for mid in sorted(digests)).encode()).hexdigest()


@dataclass
class Manifest:
    inboxes: dict[str, list[tuple[str, str]]]  # CMU folder owner -> (message_id, body digest), in the sample's order
    sha256: str
    path: Path

    @property
    def digests(self) -> dict[str, str]:
        return {mid: digest for entries in self.inboxes.values() for mid, digest in entries}

    def inbox_of(self) -> dict[str, str]:
        return {mid: inbox for inbox, entries in self.inboxes.items() for mid, _ in entries}


def write_manifest(rows: Iterable[dict], path: Path, about: str) -> Manifest:
    """The manifest of records with `inbox`, `message_id` and `body` (the sample's emails.jsonl.gz), in their order."""
    inboxes: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        inboxes.setdefault(row["inbox"], []).append((row["message_id"], body_digest(row["body"])))
    manifest = Manifest(inboxes, "", path)
    manifest.sha256 = sample_checksum(manifest.digests)
    head = {"about": about, "emails": len(manifest.digests), "sha256": manifest.sha256}
    folders = ",\n".join(f"{json.dumps(inbox)}: [\n" + ",\n".join(json.dumps(entry) for entry in entries) + "\n]"
                          for inbox, entries in inboxes.items())
    text = json.dumps(head, indent=0)[:-2] + ',\n"inboxes": {\n' + folders + "\n}\n}\n"  # one email a line
    path.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    return manifest


def load_manifest(path: Path | None = None) -> Manifest:
    """The manifest, checked against its own checksum (UserError if it is damaged or was changed)."""
    path = Path(path or MANIFEST)
    restore = f"restore it with: git checkout -- {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    try:
        document = json.loads(lzma.decompress(path.read_bytes()))
        inboxes = {inbox: [(mid, digest) for mid, digest in entries] for inbox, entries in document["inboxes"].items()}
        manifest = Manifest(inboxes, document["sha256"], path)
    except FileNotFoundError:
        raise UserError(f"The sample's manifest {path} is missing; {restore}") from None
    except (lzma.LZMAError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"The sample's manifest {path} is damaged ({type(exc).__name__}: {exc}); {restore}") from None
    if sample_checksum(manifest.digests) != manifest.sha256:
        raise UserError(f"The sample's manifest {path} does not match its own checksum (it was changed or damaged); "
                        f"{restore}")
    return manifest


# ---- a CMU file, converted as the sample was (../shared/data/enron/SOURCE.md, "How it was converted") -----------

_HEADER_LINE = re.compile(rb"[!-9;-~]+:")


def cmu_record(data: bytes, file_name: str) -> dict:
    """One file of the CMU maildir -> a raw record: headers unfolded as the sample's were ("\\n\\t", which the CMU
    export put inside words, removed; other folds one space), the text/plain body decoded with its charset, else
    Windows-1252, else Latin-1, CRLF -> LF and otherwise untouched (build-db's own mail reader strips a body's
    surrounding blank lines and decodes undeclared bytes as UTF-8 first: other text for the same message)."""
    head, sep, rest = data.replace(b"\r\n", b"\n").partition(b"\n\n")
    lines = head.split(b"\n")
    joined: list[bytes] = []
    for line in lines:  # a wrapped header line without its indent (11 files of the sample): part of the one above
        if joined and line and not line[:1].isspace() and not _HEADER_LINE.match(line):
            joined[-1] += line
        else:
            joined.append(line)
    msg = email.message_from_bytes(b"\n".join(joined) + sep + rest, policy=email.policy.compat32)
    payload = msg.get_payload(decode=True) or b""
    body = None
    for charset in filter(None, (msg.get_content_charset(), "cp1252")):
        try:
            body = payload.decode(charset)
            break
        except (LookupError, UnicodeDecodeError):  # an unknown charset name, or bytes it does not have
            continue
    body = payload.decode("latin-1") if body is None else body

    def unfold(name: str) -> str:
        value = msg.get(name)
        if isinstance(value, email.header.Header):  # 8-bit bytes in it (7 addresses of the sample): as UTF-8, and
            value = "".join(chunk.decode("utf-8", "replace") if isinstance(chunk, bytes) else chunk  # U+FFFD if not
                            for chunk, _ in email.header.decode_header(value))
        text = "" if value is None else str(value)
        return re.sub(r"\n[ \t]*", " ", text.replace("\r\n", "\n").replace("\n\t", "")).strip()

    return {"message_id": unfold("Message-ID"), "date": unfold("Date"), "subject": unfold("Subject"),
            "from_address": unfold("From"), "to_addresses": unfold("To"), "cc_addresses": unfold("Cc"),
            "bcc_addresses": unfold("Bcc"), "body": body.replace("\r\n", "\n"), "file_name": file_name}


# ---- the sources -------------------------------------------------------------------------------------------------

def _maildir(path: Path, manifest: Manifest) -> Path | None:
    """The CMU maildir/ at `path` (or inside it: the unpacked release's folder), or None."""
    for root in (path / "maildir", path):
        if any((root / inbox / "inbox").is_dir() for inbox in manifest.inboxes):
            return root
    return None


def read_cmu_maildir(root: Path, manifest: Manifest) -> Iterator[dict]:
    """Every file of the sample's inbox folders (only these: the release's other ~490k files are not the sample)."""
    for inbox in manifest.inboxes:
        folder = root / inbox / "inbox"
        if folder.is_dir():
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                yield cmu_record(path.read_bytes(), "maildir/" + path.relative_to(root).as_posix())


def _arrow_rows(batches, wanted, where: str) -> Iterator[dict]:
    """The rows of Arrow batches whose message_id is wanted (the Hub's 517k rows, filtered in Arrow, not in Python)."""
    import pyarrow.compute as pc

    for batch in batches:
        if "message_id" not in batch.schema.names or "body" not in batch.schema.names:
            raise UserError(f"{where} has no message_id and body columns ({', '.join(batch.schema.names[:8])}): it "
                            f"is not Hugging Face's {HUB_NAME}")
        ids = pc.utf8_trim_whitespace(batch.column("message_id"))
        yield from batch.filter(pc.is_in(ids, value_set=wanted)).to_pylist()


def read_hub_parquet(paths: list[Path], wanted) -> Iterator[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    for path in paths:
        try:
            yield from _arrow_rows(pq.ParquetFile(path).iter_batches(batch_size=8192), wanted, str(path))
        except (pyarrow.ArrowException, OSError) as exc:  # cut off mid-download, or not Parquet
            raise UserError(f"{path} is not a readable Parquet file ({str(exc)[:200]}): download it again") from None


def read_hub(wanted) -> Iterator[dict]:
    """The sample's rows of the Hub's dataset (all ~517k emails, downloaded into `datasets`' cache the first time)."""
    dataset = load_hub_dataset(HUB_NAME, split="train")
    yield from _arrow_rows(dataset.with_format("arrow").iter(batch_size=8192), wanted, f"hf:{HUB_NAME}")


@dataclass
class SampleCheck:
    """What a source holds of the sample."""
    source: str
    total: int
    missing: list[str] = field(default_factory=list)  # message ids of the sample the source lacks
    differing: list[str] = field(default_factory=list)  # ... whose body's digest is not the manifest's
    absent_folders: list[str] = field(default_factory=list)  # CMU inbox folders not there (a maildir source)
    checksum: str = ""
    manifest_checksum: str = ""
    dropped_questions: list = field(default_factory=list)  # questions citing a missing email: left out
    questions_on_other_text: list = field(default_factory=list)  # questions citing an email of other text: kept

    @property
    def matches(self) -> bool:
        return self.checksum == self.manifest_checksum

    def line(self) -> str:
        """One line: what was found, the checksum, the questions dropped."""
        found = self.total - len(self.missing)
        if self.matches:
            return (f"sample      all {self.total:,} emails found in {self.source}; checksum {self.checksum[:12]} = "
                    f"the manifest's: the sample every real-mail figure of this project used")

        def ids(items: list) -> str:
            return ", ".join(map(str, items[:8])) + (f" and {len(items) - 8} more" if len(items) > 8 else "")

        parts = [f"sample      {found:,} of the {self.total:,} emails found in {self.source}"
                 + (f" ({len(self.missing):,} missing, first {self.missing[0]})" if self.missing else ""),
                 f"{len(self.differing):,} with other text than the sample's"
                 + (f" (first {self.differing[0]})" if self.differing else ""),
                 f"checksum {self.checksum[:12]} != the manifest's {self.manifest_checksum[:12]}",
                 f"{len(self.dropped_questions)} questions cite a missing email and are left out"
                 + (f" ({ids(self.dropped_questions)})" if self.dropped_questions else "")]
        if self.questions_on_other_text:
            parts.append(f"{len(self.questions_on_other_text)} cite one of other text (kept: "
                         f"{ids(self.questions_on_other_text)})")
        return "; ".join(parts)

    def meta(self) -> dict[str, str]:
        """For the database's meta table: which sample it holds."""
        return {"sample_manifest_sha256": self.manifest_checksum, "sample_sha256": self.checksum,
                "sample_missing": str(len(self.missing)), "sample_differing": str(len(self.differing))}


def open_sample(source: str | None, questions: str | None = None, manifest_path: Path | None = None
                ) -> tuple[list[dict], list[dict], str, SampleCheck]:
    """(the sample's records in its order, the question records, the source's name, the check) from `source`: a CMU
    maildir/ (or the release folder holding it), the Hub's parquet file or a folder of them, any file build-db reads,
    or None (the Hub). UserError, before anything is written, when the source is not the sample's or lacks too much."""
    manifest = load_manifest(manifest_path)
    digests = manifest.digests
    maildir = None
    if source is None:
        import pyarrow

        name, advice = f"hf:{HUB_NAME}", "build from the CMU release instead (--emails DIR/maildir)"
        records = read_hub(pyarrow.array(list(digests)))
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"No such file or folder: {path}")
        name = str(path)
        parquet = sorted(path.rglob("*.parquet")) if path.is_dir() else [path] if path.suffix == ".parquet" else []
        maildir = _maildir(path, manifest) if path.is_dir() else None
        if maildir is not None:
            records = read_cmu_maildir(maildir, manifest)
            advice = "unpack enron_mail_20150507.tar.gz again and pass its maildir/ folder"
        elif parquet:
            import pyarrow

            records = read_hub_parquet(parquet, pyarrow.array(list(digests)))
            advice = f"pass every parquet file of {HUB_NAME} (its data/ folder), or no --emails to download them"
        elif path.is_dir():
            raise UserError(f"{path} is neither the CMU release's maildir/ (none of the sample's inbox folders, such "
                            f"as {path / next(iter(manifest.inboxes)) / 'inbox'}, is there) nor a folder of "
                            f"{HUB_NAME}'s parquet files")
        else:
            records = read_emails(path)
            advice = "pass the CMU release's maildir/ or the Hub's parquet files"

    chosen: dict[str, dict] = {}
    for record in records:
        mid = str(record.get("message_id") or "").strip() if isinstance(record, dict) else ""
        if mid in digests and (mid not in chosen or body_digest(chosen[mid].get("body")) != digests[mid]):
            chosen[mid] = record  # of two copies of one message (a corpus's folders), the sample's text
    check = SampleCheck(name, len(digests), manifest_checksum=manifest.sha256)
    check.missing = [mid for mid in digests if mid not in chosen]
    found = {mid: body_digest(record.get("body")) for mid, record in chosen.items()}
    check.differing = [mid for mid in digests if mid in found and found[mid] != digests[mid]]
    check.checksum = sample_checksum(found)
    if maildir is not None:
        check.absent_folders = [inbox for inbox in manifest.inboxes if not (maildir / inbox / "inbox").is_dir()]
    unmatched = len(check.missing) + len(check.differing)
    if unmatched > MAX_UNMATCHED * check.total:
        folders = (f", {len(check.absent_folders)} of its {len(manifest.inboxes)} inbox folders absent "
                   f"({', '.join(check.absent_folders[:3])}...)" if check.absent_folders else "")
        raise UserError(f"{name} holds {len(found):,} of the sample's {check.total:,} emails ({len(check.missing):,} "
                        f"missing{folders}; {len(check.differing):,} of other text): over {MAX_UNMATCHED:.0%} is "
                        f"not the sample, and nothing was built; {advice}")

    question_rows = list(read_questions(questions or QUESTIONS))
    missing, differing = set(check.missing), set(check.differing)
    for row in question_rows:
        cited = set(row.get("message_ids") or []) if isinstance(row, dict) else set()
        if cited & missing:
            check.dropped_questions.append(row.get("id"))
        elif cited & differing:
            check.questions_on_other_text.append(row.get("id"))
    return [chosen[mid] for mid in digests if mid in chosen], question_rows, name, check
