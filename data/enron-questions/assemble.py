"""Check draft questions about the real Enron sample and assemble the question set.

    python data/enron-questions/assemble.py                      # the drafts beside this file -> questions.jsonl
    python data/enron-questions/assemble.py --emails PATH --out PATH DRAFT.jsonl ...

A draft line is {"question", "answer", "message_ids", "inbox_address", "query_date", "how_realistic"}. A question
is kept only if:
- every cited email is in the sample and in the inbox of `inbox_address` (it sent or received it: from, to, cc or
  bcc), with build-db's own normalisation (email_agent.data.sources.normalize_email), so build-db finds every gold
  email;
- every cited email is dated strictly before query_date (the agent's "today": stored dates compared with
  email_agent.data.email_db.day_start, as the tools compare them);
- every content word of the answer (lower-cased, stopwords and punctuation dropped, "$1,200.00" read as "1200")
  is in a cited email's subject or body, and the answer is not just a cited email's subject (a question
  answered by the search results' subject lines alone does not need the email read);
- it is not a near-duplicate of a question already kept for the same inbox: Jaccard similarity of the two
  questions' content words >= 0.7 (a rewording of the same question), or the same answer drawn from the same
  email (the same fact asked twice, which would weigh it double).
Each dropped question is printed with its reason. Kept questions get ids "enron-0001".. in (inbox, query_date,
question) order and a train/test split by cited email (email_agent.data.generate.assign_splits: questions sharing an
email form one group, whole groups go to test in seeded order until ~30% are test), so no email is cited by
both splits.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from email_agent.errors import UserError
from email_agent.data.email_db import day_start
from email_agent.data.sources import SkipRecord, normalize_email, read_emails
from email_agent.data.generate import assign_splits

DEFAULT_EMAILS = ROOT.parent / "shared" / "data" / "enron" / "emails.jsonl.gz"
TEST_FRACTION = 0.3
SEED = 39  # issue 39
NEAR_DUPLICATE = 0.7
FIELDS = ("question", "answer", "message_ids", "inbox_address", "query_date", "how_realistic")
STOPWORDS = frozenset(
    "a an the and or of to in on at for by with from as is are was were be been it its this that these those "
    "he she his her him they them their we our us you your i my me who what when where which how whose whom "
    "did does do not no per about".split())
REPLY_PREFIXES = frozenset({"re", "fw", "fwd"})
MONTHS = re.compile(r"\b(jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\b|\d+/\d+", re.I)


def words(text: str) -> list[str]:
    """Lower-cased content words; a number loses its thousands commas and trailing decimal zeros ("$1,200.00" and
    "1200" are both "1200"), so an answer matches the email however the figure is written."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())
    tokens = re.findall(r"[a-z0-9]+(?:\.[0-9]+)?", text)
    tokens = [t.rstrip("0").rstrip(".") if re.fullmatch(r"\d+\.\d+", t) else t for t in tokens]
    return [t for t in tokens if t not in STOPWORDS]


def load_emails(path) -> dict[str, dict]:
    """message_id -> {"date", "members" (every address that sent or received it), "text" (subject and body)},
    read and normalised as build-db reads them (the first of two records with one message_id wins, as there)."""
    emails: dict[str, dict] = {}
    for raw in read_emails(path):
        try:
            row = normalize_email(raw)
        except SkipRecord:
            continue  # build-db skips it too, so a question citing it fails as "not in the sample"
        if row["message_id"] in emails:
            continue
        members = {row["from_address"], *row["to"], *row["cc"], *row["bcc"]} - {""}
        emails[row["message_id"]] = {"date": row["date"], "members": members,
                                     "subject": row["subject"], "text": row["subject"] + "\n" + row["body"]}
    return emails


def problem(q, emails: dict[str, dict]) -> str | None:
    """Why draft question `q` cannot be kept on its own (None if it can): the first rule it breaks."""
    if not isinstance(q, dict) or any(q.get(k) in (None, "", []) for k in FIELDS):
        return "malformed: a field is missing or empty"
    ids = q["message_ids"]
    if not isinstance(ids, list) or not all(isinstance(m, str) for m in ids) or len(set(ids)) != len(ids):
        return "malformed: message_ids is not a list of distinct ids"
    realistic = q["how_realistic"]
    if isinstance(realistic, bool) or not isinstance(realistic, (int, float)) or not 0 <= realistic <= 1:
        return "malformed: how_realistic is not in [0, 1]"
    try:
        date.fromisoformat(str(q["query_date"]))
    except ValueError:
        return "malformed: query_date is not YYYY-MM-DD"
    inbox = str(q["inbox_address"]).strip().lower()
    cited = [emails.get(m) for m in ids]
    if None in cited:
        return "cites an email not in the sample"
    if any(inbox not in e["members"] for e in cited):
        return "cites an email outside the inbox"
    if any(e["date"] >= day_start(q["query_date"]) for e in cited):
        return "cites an email dated on or after query_date"
    answer = words(str(q["answer"]))
    if not answer:
        return "answer has no content words"
    if not set(answer) <= {w for e in cited for w in words(e["text"])}:
        return "answer not in the cited emails"
    if any(set(answer) == set(words(e["subject"])) - REPLY_PREFIXES for e in cited):
        return "answer is just a cited email's subject"
    return None


def sort_key(q: dict) -> tuple:
    return (q["inbox_address"].strip().lower(), q["query_date"], q["question"])


def assemble(drafts: list[dict], emails: dict[str, dict]) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(kept questions in the set's schema, [(dropped draft, reason)]); deterministic for the same drafts."""
    kept, dropped = [], []
    for q in drafts:
        reason = problem(q, emails)
        (dropped.append((q, reason)) if reason else kept.append(q))
    unique: list[dict] = []
    seen_words: dict[str, list[frozenset]] = {}
    seen_facts: set[tuple] = set()
    for q in sorted(kept, key=sort_key):
        inbox = q["inbox_address"].strip().lower()
        mine = frozenset(words(q["question"]))
        facts = {(inbox, " ".join(words(q["answer"])), m) for m in q["message_ids"]}
        if any(len(mine & other) / len(mine | other) >= NEAR_DUPLICATE for other in seen_words.get(inbox, [])):
            dropped.append((q, "near-duplicate question (content-word Jaccard >= 0.7)"))
        elif facts & seen_facts:
            dropped.append((q, "near-duplicate: same answer from the same email"))
        else:
            seen_words.setdefault(inbox, []).append(mine)
            seen_facts |= facts
            unique.append(q)
    out = [{"id": f"enron-{n:04d}", "question": q["question"].strip(), "answer": str(q["answer"]).strip(),
            "message_ids": list(q["message_ids"]), "how_realistic": float(q["how_realistic"]),
            "inbox_address": q["inbox_address"].strip().lower(), "query_date": q["query_date"]}
           for n, q in enumerate(unique, 1)]
    assign_splits(out, [], TEST_FRACTION, SEED)
    return out, dropped


def kind(q: dict) -> str:
    """A rough tag of what the question asks for, from its first words."""
    text = q["question"].lower()
    for prefix, tag in (("when", "date/time"), ("by when", "date/time"), ("until when", "date/time"),
                        ("since when", "date/time"), ("who", "person"), ("with whom", "person"),
                        ("where", "place"), ("how much", "amount/number"), ("how many", "amount/number")):
        if text.startswith(prefix):
            return tag
    if re.search(r"\b(date|deadline|time|year)\b", text):
        return "date/time"
    if re.search(r"\b(price|amount|value|cost|volume|number|how much|percentage|horsepower|multiple)\b", text):
        return "amount/number"
    return "name/decision/other"


def read_drafts(paths) -> list[dict]:
    drafts = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    drafts.append(json.loads(line))
                except json.JSONDecodeError:
                    drafts.append({"_where": f"{path}:{n}"})  # reported as malformed
    return drafts


def summary(kept: list[dict], dropped: list[tuple[dict, str]]) -> str:
    by_inbox = Counter(q["inbox_address"] for q in kept)
    dropped_by_inbox = Counter(str(q.get("inbox_address", "?")).lower() for q, _ in dropped)
    splits = Counter(q["split"] for q in kept)
    lines = [f"kept {len(kept)}, dropped {len(dropped)}"]
    lines += [f"  dropped: {reason}: {n}" for reason, n in Counter(r for _, r in dropped).most_common()]
    lines.append(f"{len(by_inbox)} inboxes (kept / dropped, train / test):")
    for inbox in sorted(set(by_inbox) | set(dropped_by_inbox)):
        mine = Counter(q["split"] for q in kept if q["inbox_address"] == inbox)
        lines.append(f"  {inbox:32s} {by_inbox[inbox]:4d} / {dropped_by_inbox[inbox]:3d}, "
                     f"{mine['train']:4d} / {mine['test']:3d}")
    lines.append(f"splits: train {splits['train']}, test {splits['test']}")
    lines.append("kinds: " + ", ".join(f"{k} {n}" for k, n in Counter(map(kind, kept)).most_common()))
    lines.append(f"questions naming a month or date: {sum(bool(MONTHS.search(q['question'])) for q in kept)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafts", nargs="*", help="draft files (default: draft-*.jsonl beside this script)")
    p.add_argument("--emails", default=str(DEFAULT_EMAILS), help="the Enron sample (default: %(default)s)")
    p.add_argument("--out", default=str(HERE / "questions.jsonl"), help="where to write the set (default: %(default)s)")
    args = p.parse_args(argv)
    paths = args.drafts or sorted(HERE.glob("draft-*.jsonl"))
    if not paths:
        print(f"error: no draft files given and none (draft-*.jsonl) in {HERE}", file=sys.stderr)
        return 1
    try:
        emails = load_emails(args.emails)
        kept, dropped = assemble(read_drafts(paths), emails)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    for q, reason in dropped:
        print(f"dropped ({reason}): {str(q.get('question', q.get('_where', q)))[:100]!r} -> {q.get('answer')!r}")
    with open(args.out, "w") as f:
        for q in kept:
            f.write(json.dumps(q) + "\n")
    print(summary(kept, dropped))
    print(f"wrote {len(kept)} questions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
