"""Question sets: the schema of a question, reading question files, and choosing questions for a run.

A question is asked on behalf of one inbox on one day (`query_date`) and cites the email(s) that hold its
answer (`message_ids`). Questions are stored in the database next to the emails (see `data`), with a flag
saying whether their gold emails are present, so training and evaluation read one file.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Iterator

from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.data.sources import read_jsonl, read_parquet


@dataclass(frozen=True)
class Question:
    id: int | str  # kept as the question file gives it: 17 and "q-17" both work
    question: str
    answer: str
    message_ids: list[str]
    how_realistic: float | None
    inbox_address: str
    query_date: str  # 'YYYY-MM-DD': the agent's "today"; it never sees mail dated later
    split: str


def question_id(value) -> int | str:
    """An id as given: an integer (17, or 17.0 from a float column) or a non-empty string ("q-17"); else ValueError."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"id must be an integer or a non-empty string, not {value!r}")


def id_sort_key(value) -> tuple:
    """Sort mixed ids as SQLite does: integers first, in numeric order, then strings."""
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def normalize_question(raw: dict) -> Question:
    """A record with the Hugging Face `corbt/enron_emails_sample_questions` fields -> Question.

    Raises ValueError with a short reason (shown in the build summary) if the record is malformed.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"not an object: {str(raw)[:40]!r}")
    if "_error" in raw:
        raise ValueError(raw["_error"])
    missing = [k for k in ("id", "question", "answer", "message_ids", "inbox_address", "query_date")
               if raw.get(k) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    try:
        message_ids = raw["message_ids"]
        if isinstance(message_ids, str):
            message_ids = json.loads(message_ids) if message_ids.startswith("[") else [message_ids]
        question = Question(
            id=question_id(raw["id"]),
            question=str(raw["question"]).strip(),
            answer=str(raw["answer"]).strip(),
            message_ids=[str(m).strip() for m in message_ids],
            how_realistic=None if raw.get("how_realistic") is None else float(raw["how_realistic"]),
            inbox_address=str(raw["inbox_address"]).strip().lower(),
            query_date=date.fromisoformat(str(raw["query_date"]).strip()[:10]).isoformat(),
            split=str(raw.get("split") or "train"),
        )
    except (TypeError, ValueError) as exc:  # no KeyError: every key read is checked above
        raise ValueError(str(exc)) from exc
    empty = [k for k in ("question", "answer", "message_ids", "inbox_address") if not getattr(question, k)]
    if empty:
        raise ValueError(f"empty {', '.join(empty)}")
    return question


def read_questions(path: str | Path) -> Iterator[dict]:
    """A local question file (.jsonl(.gz) or .parquet) with the Hugging Face schema (+ optional `split`)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--questions {path} is a folder; give the questions file (.jsonl, .jsonl.gz or .parquet)")
    if not path.is_file():
        raise UserError(f"No such question file: {path}")
    if path.name.lower().endswith(".parquet"):
        return read_parquet(path)
    return read_jsonl(path)


def read_hub_questions(name: str = "corbt/enron_emails_sample_questions") -> Iterator[dict]:
    """Both splits of the ART·E question set, each row tagged with its split."""
    # here, not at the top: tests patch sources.load_hub_dataset, so it is looked up at each call
    from email_agent.data.sources import load_hub_dataset

    splits = load_hub_dataset(name)
    for split in ("train", "test"):
        for row in splits[split]:
            yield {**row, "split": split}


def select_questions(db: EmailDB, split: str, *, single_source: bool = False, min_realistic: float = 0.0,
                     require_gold: bool = True, seed: int | None = None, limit: int | None = None) -> list[Question]:
    """Questions of one split, filtered, optionally shuffled with `seed`, then cut to `limit`.

    require_gold drops questions whose cited emails are not in the database or not in the asked inbox: nobody
    can answer them.
    Without a seed the order is by id, so `limit` always takes the same questions.
    """
    # `# pragma: no mutate` marks SQL text (why: see EmailDB in data.py)
    sql = ("SELECT id, question, answer, message_ids, how_realistic, "  # pragma: no mutate
           "inbox_address, query_date, split FROM questions WHERE split = ?")  # pragma: no mutate
    params: list = [split]
    if require_gold:
        sql += " AND gold_in_db = 1"  # pragma: no mutate
    if min_realistic > 0:
        sql += " AND how_realistic >= ?"  # pragma: no mutate
        params.append(min_realistic)
    rows = db.conn.execute(sql + " ORDER BY id", params).fetchall()
    questions = [Question(r[0], r[1], r[2], json.loads(r[3]), r[4], r[5], r[6], r[7]) for r in rows]
    if single_source:
        questions = [q for q in questions if len(q.message_ids) <= 1]
    if seed is not None:
        random.Random(seed).shuffle(questions)
    return questions[:limit] if limit is not None else questions


def withheld(question: Question, db: EmailDB) -> Question | None:
    """The question asked the day before its (earliest) gold email was sent: the inbox cannot answer it
    (unless an earlier email carries the same fact). None when no gold email is in the database, or it is dated
    on the first day there is."""
    dates = [email.date[:10] for email in (db.read(m) for m in question.message_ids) if email is not None]
    if not dates or min(dates) == str(date.min):
        return None
    return dataclasses.replace(question, query_date=str(date.fromisoformat(min(dates)) - timedelta(days=1)))


def with_unanswerable(questions: list[Question], db: EmailDB, share: float, seed: int = 0) -> list[Question]:
    """`questions` plus withheld-gold replays of a seeded sample of them, making up `share` of the result
    (at most one replay per question, so at most half).

    A replay keeps its question and gold answer (a right answer stays right) but is asked before the answer
    arrived, so the best reply is "I don't know": GRPO groups on replays reward abstaining over inventing.
    """
    wanted = min(round(share / (1 - share) * len(questions)), len(questions))  # replays / result = share
    replays = (withheld(q, db) for q in random.Random(seed).sample(questions, wanted))
    return questions + [dataclasses.replace(r, id=f"{r.id}-withheld") for r in replays if r is not None]


def question_counts(db: EmailDB) -> dict[str, dict[str, int]]:
    """split -> {"total", "answerable"} (answerable: every cited email is in the database)."""
    rows = db.conn.execute("SELECT split, COUNT(*), SUM(gold_in_db) "  # pragma: no mutate
                           "FROM questions GROUP BY split ORDER BY split")  # pragma: no mutate
    return {split: {"total": total, "answerable": answerable or 0} for split, total, answerable in rows}


def training_questions(db: EmailDB, cfg) -> tuple[list[Question], list[Question], list[Question]]:
    """(validation, train, GRPO) questions of a run (`cfg`: its TrainConfig), all from the train split: the
    first `val_size` held out for validation, then at most `train_limit` to train on; GRPO's add replays asked
    before their answer arrived (`unanswerable_share`), where abstaining beats inventing."""
    questions = select_questions(db, "train", single_source=cfg.single_source, min_realistic=cfg.min_realistic,
                                 seed=cfg.seed)
    val, train = questions[:cfg.val_size], questions[cfg.val_size:]
    train = train[:cfg.train_limit] if cfg.train_limit else train
    if not train:
        counts = question_counts(db).get("train", {})
        total = counts.get("total", 0)
        if total and not counts.get("answerable"):  # questions there, but about mail this database does not hold
            raise UserError(f"None of the {total:,} train questions in {cfg.db} can be answered from it: each cites "
                            f"an email that is not in the database or not in the inbox it asks about (build-db "
                            f"counted them). Build it from the mail the questions were written about, or write "
                            f"questions for this mail with `python train_email_search_agent.py generate-questions "
                            f"--db {cfg.db} --model MODEL`.")
        held_out = f"after holding out {cfg.val_size} for validation: a smaller --val-size, or " if cfg.val_size else ""
        raise UserError(f"No answerable training questions in {cfg.db} ({held_out}write some with "
                        f"`python train_email_search_agent.py generate-questions --db {cfg.db} --model MODEL`).")
    return val, train, with_unanswerable(train, db, cfg.unanswerable_share, cfg.seed)
