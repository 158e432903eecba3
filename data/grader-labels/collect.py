"""Collect real agent answers from evaluations' results.jsonl into label sheets, and merge labelled sheets.

    python data/grader-labels/collect.py SHEET.jsonl --from eval/demo:demo --from DIR:SET ...   # new answers only
    python data/grader-labels/collect.py SHEET.jsonl --from-run .art/email-agent/models/NAME:SET --questions FILE
    python data/grader-labels/collect.py --merge SHEET.jsonl ... --out data/grader-labels/labels.jsonl

`--from-run` reads a training run's own rollouts (its trajectories/train/*.parquet, as ART writes them: the
policy of each GRPO step, sampled at the run's temperature), with the questions and gold answers from FILE (the
question file build-db read).

A sheet line is one answer the agent gave (the answer that stood, or the one the grounding check withheld) to one
question, with the question and its gold answer, for a person to label `accept` or `reject` by ART·E's judge rule
(README.md beside this file). "I don't know" and empty answers are left out: they are wrong by rule, not by a
grader. An answer already in the labels (same question, same answer) is not collected again. Each question falls
in `tune` or `heldout` by a hash of its set and id, so every answer to one question lands on one side; each
collection is a `round` (round 1: the answers the grader was written beside; later rounds are measured unseen).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from email_agent.agent.matcher import is_i_dont_know  # noqa: E402

LABELS = HERE / "labels.jsonl"
KEYS = ("set", "question_id", "question", "gold", "answer", "source", "split", "round", "label", "labeller", "note")


def split_of(set_name: str, question_id: str) -> str:
    digest = hashlib.sha256(f"{set_name}/{question_id}".encode()).digest()
    return "heldout" if digest[0] % 2 else "tune"


def answers_of(results: Path, set_name: str):
    for line in results.read_text().splitlines():
        record = json.loads(line)
        given = record.get("withheld") or {}
        for answer in (record.get("answer"), given.get("answer")):
            if answer and answer.strip() and not is_i_dont_know(answer):
                yield {"set": set_name, "question_id": str(record["question_id"]), "question": record["question"],
                       "gold": record["gold_answer"], "answer": answer.strip(),
                       "source": f"{record['model']} ({results.parent.name})",
                       "split": split_of(set_name, str(record["question_id"])), "label": "", "labeller": "",
                       "note": ""}


def answers_of_run(run: Path, set_name: str, questions: dict[str, dict]):
    import pandas as pd  # only here: the evaluation's results need no parquet reader

    for part in sorted((run / "trajectories" / "train").glob("*.parquet")):
        for meta in pd.read_parquet(part, columns=["metadata"])["metadata"]:
            meta = json.loads(meta)
            answer, q = meta.get("answer"), questions[str(meta["question_id"])]
            if answer and answer.strip() and not is_i_dont_know(answer):
                yield {"set": set_name, "question_id": str(q["id"]), "question": q["question"], "gold": q["answer"],
                       "answer": answer.strip(), "source": f"{meta['policy']} ({run.name}, training rollout)",
                       "split": split_of(set_name, str(q["id"])), "label": "", "labeller": "", "note": ""}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def collect(sheet: Path, sources: list[str], runs: list[str] = (), questions: Path | None = None) -> None:
    seen = {(r["set"], r["question_id"], r["answer"]) for r in read(LABELS) + read(sheet)}  # each answer once
    if runs and questions is None:
        raise SystemExit("--from-run needs --questions FILE: the question file its database was built from")
    by_id = {str(q["id"]): q for q in read(questions)} if runs else {}
    found = []
    for source in sources:
        folder, _, set_name = source.partition(":")
        found.append(answers_of(Path(folder) / "results.jsonl", set_name or Path(folder).name))
    for source in runs:
        folder, _, set_name = source.partition(":")
        found.append(answers_of_run(Path(folder), set_name or Path(folder).name, by_id))
    labelled = read(LABELS)
    this_round = max((r.get("round") or 1 for r in labelled), default=0) + 1  # a round: answers labelled together
    rows = []
    for answers in found:
        for row in answers:
            key = (row["set"], row["question_id"], row["answer"])
            if key not in seen:
                seen.add(key)
                rows.append({**row, "round": this_round})
    with open(sheet, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{len(rows)} new answers -> {sheet}")


def merge(sheets: list[Path], out: Path) -> None:
    rows = {(r["set"], r["question_id"], r["answer"]): {"round": 1, **r} for r in read(out)}
    for sheet in sheets:
        for row in read(sheet):
            if row.get("label") not in ("accept", "reject"):
                raise SystemExit(f"{sheet}: {row['set']} {row['question_id']} {row['answer']!r} has no label")
            rows[(row["set"], row["question_id"], row["answer"])] = {k: row.get(k, "") for k in KEYS}
    ordered = sorted(rows.values(), key=lambda r: (r["set"], r["question_id"], r["answer"]))
    out.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    print(f"{len(ordered)} labelled answers -> {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sheet", nargs="?", type=Path)
    parser.add_argument("--from", dest="sources", action="append", default=[], metavar="DIR[:SET]")
    parser.add_argument("--from-run", dest="runs", action="append", default=[], metavar="RUN_DIR[:SET]")
    parser.add_argument("--questions", type=Path, help="the question file, for --from-run")
    parser.add_argument("--merge", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=LABELS)
    args = parser.parse_args()
    merge(args.merge, args.out) if args.merge else collect(args.sheet, args.sources, args.runs, args.questions)
