"""Whether a question an LLM wrote may be stored, and which split it goes to.

Owns: the checks on one candidate (every field present; it cites emails that exist, belong to the inbox and were
shown to the model; its query_date is on or after every cited email, or is drawn after them as ART·E did), what
counts as a near-duplicate, and the split by connected groups of emails, so no email is cited by both a train and
a test question. Pure decisions over rows and read-only queries: asking the model and writing the accepted
questions are `generate`'s.
"""

from __future__ import annotations

import random
import re
from datetime import date, timedelta

NEAR_DUPLICATE = 0.8  # Jaccard similarity of two questions' word sets at which the later one is dropped


class Reject(Exception):
    """A candidate that is not stored; the message is the reason counted in the summary."""


def words(text: str) -> frozenset:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def is_near_duplicate(a: frozenset, b: frozenset) -> bool:
    return a == b or (bool(a | b) and len(a & b) / len(a | b) >= NEAR_DUPLICATE)


def check_candidate(item, inbox: str, shown_emails: list[dict], conn, min_realistic: float, rng: random.Random) -> dict:
    """One candidate from the model, which was shown `shown_emails` of `inbox` -> a question row, or Reject(reason)."""
    if not isinstance(item, dict):
        raise Reject("not a JSON object")
    question, answer = item.get("question"), item.get("answer")
    if not isinstance(question, str) or not question.strip() or not isinstance(answer, str) or not answer.strip():
        raise Reject("empty or missing question/answer")
    ids = item.get("message_ids")
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not ids or not all(isinstance(m, str) and m.strip() for m in ids):
        raise Reject("no message_ids")
    ids = list(dict.fromkeys(m.strip() for m in ids))
    realistic = item.get("how_realistic")
    if isinstance(realistic, bool) or not isinstance(realistic, (int, float)) or not 0 <= realistic <= 1:
        raise Reject("how_realistic missing or not in 0..1")
    shown = {e["message_id"]: e for e in shown_emails}
    for mid in ids:
        if mid in shown:
            continue
        row = conn.execute("SELECT id FROM emails WHERE message_id = ?", (mid,)).fetchone()
        if row is None:
            raise Reject("cites an email that does not exist (fabricated id)")
        if conn.execute("SELECT 1 FROM mailbox WHERE address = ? AND email_id = ?",
                        (inbox, row[0])).fetchone() is None:
            raise Reject("cites an email outside the inbox")
        raise Reject("cites an email the model was not shown")
    latest = max(date.fromisoformat(shown[m]["date"][:10]) for m in ids)
    if item.get("query_date") is not None:  # the model may propose one; it must not predate the evidence
        try:
            query_date = date.fromisoformat(str(item["query_date"]).strip()[:10])
        except ValueError:
            raise Reject("unparseable query_date") from None
        if query_date < latest:
            raise Reject("query_date before a cited email")
    else:  # ART·E: the latest cited email's date plus 1-30 days
        query_date = latest + timedelta(days=rng.randint(1, 30))
    if realistic < min_realistic:
        raise Reject("how_realistic below --min-realistic")
    return {"question": question.strip(), "answer": answer.strip(), "message_ids": ids,
            "how_realistic": float(realistic), "inbox": inbox, "query_date": query_date.isoformat()}


def assign_splits(new: list[dict], stored: list[dict], test_fraction: float, seed: int) -> list[dict]:
    """Give each new question a split so that no email is cited by both a train and a test question.

    Questions that share a cited email form a group (union-find over emails); a group joined to stored
    questions takes their split, the other groups go to test in seeded order until test_fraction of the new
    questions are test. A new question linking a stored train and a stored test question cannot be placed:
    it gets split None (rejected by the caller).
    """
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = x = parent[parent[x]]
        return x

    for q in stored + new:
        first = find(q["message_ids"][0])
        for mid in q["message_ids"][1:]:
            parent[find(mid)] = first
    fixed: dict[str, set] = {}
    for q in stored:
        fixed.setdefault(find(q["message_ids"][0]), set()).add(q["split"])
    groups: dict[str, list[dict]] = {}
    for q in new:
        groups.setdefault(find(q["message_ids"][0]), []).append(q)
    free = []
    for root, members in groups.items():
        splits = fixed.get(root)
        if splits is None:
            free.append(members)
            continue
        for q in members:
            q["split"] = next(iter(splits)) if len(splits) == 1 else None
    free.sort(key=lambda members: members[0]["message_ids"][0])
    random.Random(seed).shuffle(free)
    target, test = round(test_fraction * len(new)), 0
    for members in free:
        split = "test" if test + len(members) <= target else "train"
        test += len(members) if split == "test" else 0
        for q in members:
            q["split"] = split
    return new
