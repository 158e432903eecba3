"""An evaluation's results.jsonl, one record per episode: the keys and types its readers (the report,
`--rejudge`, `--sft-from`) need, and the reader that keeps well-typed records and counts the rest.

Its own module, below both of its readers: the evaluation writes and reports these files, and the warm start
learns from a teacher's (`agent.demonstrations`), which the evaluation's modules sit above.
"""

from __future__ import annotations

import json
from pathlib import Path


RESULT_KEYS = ("model", "question_id", "question", "gold_answer", "gold_message_ids", "inbox", "query_date",
               "answer", "sources", "messages", "metrics", "reward")
# The type each key's value must have for the readers (report, --rejudge, --sft-from) to use it.
RESULT_TYPES = {"model": str, "question_id": (str, int), "question": str, "gold_answer": str, "gold_message_ids": list,
                "inbox": str, "query_date": str, "answer": (str, type(None)), "sources": list, "messages": list,
                "metrics": dict, "reward": (int, float)}


def _well_typed(record: dict, keys: tuple[str, ...]) -> bool:
    withheld = record.get("withheld")
    return (all(key in record and isinstance(record[key], RESULT_TYPES[key]) for key in keys)
            and (withheld is None or isinstance(withheld, dict) and isinstance(withheld.get("answer"), str)
                 and isinstance(withheld.get("sources"), list))
            and all(isinstance(v, (int, float)) for v in (record.get("metrics") or {}).values())
            and all(isinstance(m, dict) for m in record.get("messages") or [])
            and type(record.get("max_turns", 1)) is int)


def read_results(path, keys: tuple[str, ...] = RESULT_KEYS) -> tuple[list[dict], int]:
    """(records, unreadable lines) of an evaluation's results.jsonl: a line cut off by a killed evaluation or a
    full disk, or a record without the `keys` its reader needs (or with a value of another type), is counted,
    not fatal."""
    records, unreadable = [], 0
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and _well_typed(record, keys):
            records.append(record)
        else:
            unreadable += 1
    return records, unreadable
