"""The evaluation's report and its output folder: `write_report` writes the figures of `summary` as summary.json,
report.md (rendered here from `report_tables`) and report.html (`report_html`): the comparison table, outcomes,
paired tests, what training changed and the learning curve of each trained run (rows of `scores.load_history`).
`check_output` and `keep_previous` make the folder ready before any model is served.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from email_agent.errors import UserError
from email_agent.evaluation.report_html import page
from email_agent.evaluation.report_tables import (NOTES, OUTCOME_NOTE, PAIR_NOTE, comparison_rows, history_table,
                                                  outcome_rows, pair_rows, setup_rows, what_training_changed,
                                                  when_what)
from email_agent.redact import redact

log = logging.getLogger(__name__)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(redact(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    return [line(header), "|" + "---|" * len(header)] + [line(r) for r in rows]


def _markdown(title, records, summary, histories) -> str:
    lines = [f"# {redact(title)}", "", when_what(records, summary), "", "## Comparison", ""]
    lines += _md_table(*comparison_rows(summary))
    lines += ["", NOTES, "", "## How each model played", ""] + _md_table(*setup_rows(summary))
    lines += ["", "## Where answers went wrong", ""] + _md_table(*outcome_rows(summary)) + ["", OUTCOME_NOTE]
    changed = what_training_changed(summary)
    if changed:
        lines += ["", "## What training changed", ""] + [f"- {redact(line)}" for line in changed]
    if summary.get("pairs"):
        lines += ["", "## Paired comparison", ""] + _md_table(*pair_rows(summary)) + ["", PAIR_NOTE]
    if histories:
        lines += ["", "## Learning curve", "", "Per step: the GRPO rollouts' mean reward (train/reward, sampled) "
                  "and greedy validation on held-out train questions (val/*); phase \"warm start\" marks the "
                  "supervised steps before RL."]
        for label, rows in histories.items():
            lines += ["", f"### {redact(label)}", ""] + _md_table(*history_table(rows))
    return "\n".join(lines) + "\n"


def write_report(out_dir, records, summary, *, title="Email search agent evaluation",
                 histories: dict[str, list[dict]] | None = None) -> dict[str, Path]:
    """Write summary.json, report.md and report.html into out_dir (created if needed); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.json", "markdown": out / "report.md", "html": out / "report.html"}
    paths["summary"].write_text(json.dumps(summary, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    paths["markdown"].write_text(_markdown(title, records, summary, histories), encoding="utf-8")
    paths["html"].write_text(page(title, records, summary, histories), encoding="utf-8")
    return paths


# ---- the output folder ---------------------------------------------------------------------------------

def check_output(out: Path) -> None:
    """Before any model is served: an --output that cannot become a folder is a one-line error."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    run = next((p for p in (out.resolve(), *out.resolve().parents) if (p / "run_config.json").is_file()), None)
    if run is not None:  # checkpoint pruning and --fresh delete what is in there
        raise UserError(f"--output {out} is {'in ' if run != out.resolve() else ''}a training run's folder; give a "
                        f"folder of its own, such as eval/NAME")
    if not existing.is_dir():
        raise UserError(f"--output {out}: {existing} is a file; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--output {out}: cannot write in {existing}")
    beside = out.resolve().parent
    if (out / "results.jsonl").exists() and not os.access(beside, os.W_OK | os.X_OK):
        raise UserError(f"--output {out} holds an evaluation, which would move aside into {beside}, where this "
                        f"user cannot write; give another --output")


OUTPUT_FILES = ("results.jsonl", "summary.json", "report.md", "report.html", "eval_config.json")  # what it writes


def keep_previous(out: Path) -> None:
    """Create `out`; an evaluation already there moves aside to OUT-<its time>/ rather than being overwritten
    (its results.jsonl is what --rejudge needs). Only the evaluation's own files move: whatever else the
    folder holds stays where it is."""
    if (out / "results.jsonl").exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((out / "results.jsonl").stat().st_mtime))
        where = out.resolve()
        kept = where.parent / f"{where.name or 'eval'}-{stamp}"
        n = 1
        while kept.exists():
            n += 1
            kept = where.parent / f"{where.name or 'eval'}-{stamp}-{n}"
        kept.mkdir()
        for file in OUTPUT_FILES:
            if (out / file).exists():
                (out / file).rename(kept / file)
        log.info("the previous evaluation in %s is now in %s", out, kept)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--output {out}: {exc.strerror or exc}") from None
