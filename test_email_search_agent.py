"""Evaluate email search agents: trained checkpoints, base models and prompted models, side by side.

    python test_email_search_agent.py --demo                                      # the most recent run, demo inbox
    python test_email_search_agent.py --demo --model base --model demo            # CPU, offline
    python test_email_search_agent.py --model openai/o4-mini --model my-run@latest --limit 100
    python test_email_search_agent.py --rejudge eval/20261123-101500 --judge-model openai/gpt-4.1

Every model plays the same rollout (email_agent.rollout) over the same questions; a trained run is served
by the backend it was trained on and plays the episode shape it was trained with (flags override). Each
model's endpoint is probed before the first rollout. The output folder holds results.jsonl (one line per
question x model, enough to re-judge without re-running), summary.json and report.html / report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sqlite3
import sys
import time
from pathlib import Path

import email_agent  # noqa: F401  (offline environment defaults before litellm/ART load)
from email_agent import cli, evaluation, report, rewards, runs, summary
from email_agent.backends import ART_DIR, CPU_BASE_MODEL, PROJECT
from email_agent.data import DataError, EmailDB
from email_agent.episode import EpisodeShape
from email_agent.questions import Question, id_sort_key, select_questions

DEFAULT_DB, DEMO_DB = "data/enron_emails.db", "data/demo.db"


async def evaluate(args) -> int:
    from tqdm import tqdm

    from email_agent.rollout import rollout

    scoring = evaluation.scoring_config(args.reward, args.judge_model, args.judge_base_url, args.art_dir,
                                        args.grounded_answers)
    out = Path(args.output or f"eval/{time.strftime('%Y%m%d-%H%M%S')}")
    check_output(out)
    if scoring.judge:
        await scoring.judge.probe()
    if args.rejudge:
        results = Path(args.rejudge) / "results.jsonl"
        if not results.is_file():
            raise DataError(f"--rejudge {args.rejudge}: no results.jsonl there (an output folder of this command).")
        stored, torn = summary.read_results(results)
        if torn:
            print(f"note: {torn} unreadable line(s) in {results} skipped", file=sys.stderr)
        if not stored:
            raise DataError(f"--rejudge {args.rejudge}: results.jsonl holds no results to re-score.")
        unique = {}
        for record in stored:  # two files joined by hand would count each question twice
            unique.setdefault((record["model"], str(record["question_id"])), record)
        if len(unique) < len(stored):
            print(f"note: {len(stored) - len(unique)} repeated answer(s) (same model and question) in {results} "
                  f"skipped", file=sys.stderr)
            stored = list(unique.values())
        if any(bool(r.get("grounded_answers")) != args.grounded_answers for r in stored):
            print(f"note: re-scoring {'with' if args.grounded_answers else 'without'} the grounding check "
                  f"(--grounded-answers), unlike the evaluation in {args.rejudge}", file=sys.stderr)
        records = [await evaluation.rejudge_record(r, scoring) for r in tqdm(stored, desc="re-judging", unit=" answers")]
        keep_previous(out)
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return finish(out, records, {})

    if args.demo and not Path(args.db).exists():
        raise DataError(f"No demo database at {args.db}; build it with `python train_email_search_agent.py build-db --demo`.")
    db = EmailDB(args.db)
    questions = select_questions(db, args.split, single_source=args.single_source, seed=args.seed, limit=args.limit)
    if not questions:
        splits = sorted({row[0] for row in db.conn.execute("SELECT DISTINCT split FROM questions")})
        if splits and args.split not in splits:
            raise DataError(f"--split {args.split!r}: {args.db} has the splits {', '.join(splits)}")
        raise DataError(f"No answerable {args.split!r} questions in {args.db}; write some with "
                        f"`python train_email_search_agent.py generate-questions --db {args.db} --model MODEL`.")
    if args.wandb:
        from email_agent.tracing import traced_rollout

        rollout = traced_rollout(args.project, rollout, scoring.judge)
    options = evaluation.Options(art_dir=args.art_dir, base_model=args.base_model, base_url=args.base_url,
                                 api_key=args.api_key, temperature=args.temperature, timeout=args.timeout,
                                 concurrency=args.concurrency, seed=args.seed,
                                 shape=dict(max_turns=args.max_turns, max_tokens=args.max_tokens,
                                            max_body_chars=args.max_body_chars, search_results=args.search_results))
    records: list[dict] = []
    async with contextlib.AsyncExitStack() as stack:
        # Serve every model and probe it before the first rollout: a dead endpoint fails in seconds, not after
        # hours of the other models' rollouts.
        evaluation.check_specs(args.model, args.art_dir)
        shared = evaluation.shared_run_shape(args.model, args.art_dir)
        contestants = [await evaluation.open_contestant(spec, options, stack, shared) for spec in args.model]
        labels = [c.label for c in contestants]
        if len(set(labels)) < len(labels):  # e.g. RUN and RUN@N where N is its latest step
            twice = next(label for label in labels if labels.count(label) > 1)
            raise DataError(f"--model: {twice} is given twice (under two names); each model is evaluated once")
        for contestant in contestants:
            await evaluation.probe(contestant)
        histories = {c.label: summary.load_history(c.history, c.step) for c in contestants
                     if c.history and c.history.exists()}
        for c in contestants:
            print(f"{c.label}: {c.backend}, tool_choice={c.tool_choice}, {c.shape.describe()}", file=sys.stderr)
        print(f"evaluating {len(contestants)} model(s) on {len(questions)} {args.split} questions -> {out}",
              file=sys.stderr)
        correct: dict[str, list[int]] = {c.label: [0, 0] for c in contestants}
        bar = tqdm(total=len(questions) * len(contestants), unit=" rollouts", desc="evaluating")

        async def one(contestant: evaluation.Contestant, question: Question):
            config = contestant.rollout_config(scoring)
            traj = await rollout(contestant.policy, question, db, config)
            return evaluation.make_record(contestant, question, traj, config)

        tasks = [asyncio.ensure_future(one(c, q)) for c in contestants for q in questions]
        results_file = None  # opened at the first finished rollout: an evaluation stopped before it writes nothing
        try:
            for finished in asyncio.as_completed(tasks):
                record = await finished
                if results_file is None:
                    keep_previous(out)
                    results_file = stack.enter_context(open(out / "results.jsonl", "w"))
                records.append(record)
                results_file.write(json.dumps(record) + "\n")
                results_file.flush()  # an interrupted evaluation keeps every finished rollout
                tally = correct[record["model"]]
                tally[0] += record["metrics"]["answer_correct"]
                tally[1] += 1
                bar.set_postfix_str(" ".join(f"{k}={v[0] / max(v[1], 1):.0%}" for k, v in correct.items()))
                bar.update()
        except (KeyboardInterrupt, asyncio.CancelledError):
            for task in tasks:
                task.cancel()
            if not records:
                print("\ninterrupted before any rollout finished: nothing written", file=sys.stderr)
                return 130
            print(f"\ninterrupted: writing the {len(records)} finished rollouts", file=sys.stderr)
            finish(out, records, histories, [c.label for c in contestants])
            return 130
        except Exception:  # a bug, not a model's failure (those are recorded): keep what finished, then raise
            for task in tasks:
                task.cancel()
            if records:
                finish(out, records, histories, [c.label for c in contestants])
            raise
        finally:
            bar.close()
    return finish(out, records, histories, [c.label for c in contestants])


def finish(out: Path, records: list[dict], histories: dict, labels: list[str] = ()) -> int:
    """Write the report and print the summary; non-zero if a model failed every one of its rollouts."""
    order = {label: i for i, label in enumerate(labels)}
    records.sort(key=lambda r: (order.get(r["model"], 0), id_sort_key(r["question_id"])))
    figures = summary.summarize(records)
    paths = report.write_report(out, records, figures, histories=histories or None)
    for label, s in figures["models"].items():
        shape = s.get("episode") or {}
        print(f"{label:>32}  accuracy {fmt(s['accuracy'])}  hallucination {fmt(s['hallucination_rate'])}  "
              f"turns {fmt(s['avg_turns'], '.1f')}  n={s['n']}  errors {s['n_errors']}  "
              f"tool_choice {s.get('tool_choice') or 'n/a'}  shape {shape.get('max_turns', '?')} turns/"
              f"{shape.get('max_tokens', '?')} tokens")
    for pair in figures["pairs"]:
        leader = pair["a"] if pair["only_a"] >= pair["only_b"] else pair["b"]
        verdict = f"{leader} is better" if pair["p_value"] < 0.05 else "no significant difference"
        print(f"{pair['a']} vs {pair['b']}: {pair['only_a']} vs {pair['only_b']} questions only one got right, "
              f"McNemar p={pair['p_value']:.3g}: {verdict}")
    print(f"report: {paths['html']}")
    failed = [label for label, s in figures["models"].items() if s["n"] and s["n_errors"] == s["n"]]
    for label in failed:
        first = next(r["error"] for r in records if r["model"] == label)
        print(f"Error: every rollout of {label} failed; the first: {first}", file=sys.stderr)
    return 1 if failed else 0


def fmt(value, spec=".1%"):
    return "n/a" if value is None else format(value, spec)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="SPEC",
                   help="a trained run (NAME[@STEP|@latest] under --art-dir, or its folder; served by the backend "
                        "it was trained on), 'base' (the untrained --base-model on CPU), or a prompted model: "
                        "openai/o4-mini, hosted_vllm/NAME with --base-url, any provider/model behind an "
                        "OpenAI-compatible --base-url. Repeat to compare. Default: the most recent run.")
    p.add_argument("--demo", action="store_true", help=f"use the demo database {DEMO_DB}")
    p.add_argument("--db", help=f"database (default {DEFAULT_DB}; with --demo {DEMO_DB})")
    p.add_argument("--split", default="test", help="question split (default test)")
    p.add_argument("--limit", type=int, help="evaluate the first N questions (after the seeded shuffle)")
    p.add_argument("--single-source", action="store_true", help="only questions with one gold email")
    p.add_argument("--seed", type=int, default=0, help="question order and sampling seed (default 0)")
    p.add_argument("--concurrency", type=int, default=8, help="simultaneous rollouts per model, and the CPU "
                                                              "server's decoding batch (default 8)")
    shape = EpisodeShape()
    for flag, default, meaning in (("--max-turns", shape.max_turns, "agent turns per question"),
                                   ("--max-tokens", shape.max_tokens, "tokens per model reply"),
                                   ("--max-body-chars", shape.max_body_chars, "read_email cuts longer bodies"),
                                   ("--search-results", shape.search_results, "results per search when the model "
                                                                              "does not ask for a number")):
        p.add_argument(flag, type=int, help=f"{meaning} (default: what each trained run was trained with; for "
                                            f"base and prompted models the runs' shape if they share one, else "
                                            f"{default})")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0; omitted for "
                                                                  "OpenAI reasoning models)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model request (default 300)")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for prompted models (vLLM, litellm proxy, ...)")
    p.add_argument("--api-key", help="key for --base-url (default: OPENAI_API_KEY for openai/, else POLICY_API_KEY)")
    p.add_argument("--base-model", default=CPU_BASE_MODEL,
                   help="the model behind --model base (default SmolLM2-135M-Instruct, bundled for CPU)")
    p.add_argument("--reward", choices=rewards.REWARD_MODES,
                   help="scoring: shaped (default with a judge), offline (default without), judge (binary)")
    p.add_argument("--judge-model", help="litellm model name of the LLM judge (or JUDGE_MODEL)")
    p.add_argument("--judge-base-url", help="api_base for the judge, e.g. http://localhost:6688 (or JUDGE_API_BASE; "
                                            "key from JUDGE_API_KEY)")
    p.add_argument("--grounded-answers", action="store_true",
                   help="withhold answers that name something (a word with a capital or a digit) in no email or "
                        "search result the agent saw: they count as \"I don't know\", and the report says how many "
                        "were withheld and how many of those were right. Works with --rejudge too")
    p.add_argument("--rejudge", metavar="DIR", help="re-score DIR/results.jsonl with the judge flags; no model runs")
    p.add_argument("--output", metavar="DIR", help="output folder (default eval/<timestamp>)")
    p.add_argument("--art-dir", default=ART_DIR, help=f"where training runs live (default {ART_DIR})")
    p.add_argument("--wandb", action="store_true", help="trace rollouts and judge calls with W&B Weave (needs "
                                                        "WANDB_API_KEY; tracing is skipped if Weave cannot start)")
    p.add_argument("--project", default=PROJECT, help=f"W&B project for --wandb (default {PROJECT})")
    return p


def check_output(out: Path) -> None:
    """Before any model is served: an --output that cannot become a folder is a one-line error."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    run = next((p for p in (out.resolve(), *out.resolve().parents) if (p / "run_config.json").is_file()), None)
    if run is not None:  # checkpoint pruning and --fresh delete what is in there
        raise DataError(f"--output {out} is {'in ' if run != out.resolve() else ''}a training run's folder; give a "
                        f"folder of its own, such as eval/NAME")
    if not existing.is_dir():
        raise DataError(f"--output {out}: {existing} is a file; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"--output {out}: cannot write in {existing}")
    beside = out.resolve().parent
    if (out / "results.jsonl").exists() and not os.access(beside, os.W_OK | os.X_OK):
        raise DataError(f"--output {out} holds an evaluation, which would move aside into {beside}, where this "
                        f"user cannot write; give another --output")


OUTPUT_FILES = ("results.jsonl", "summary.json", "report.md", "report.html")  # what an evaluation writes


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
        print(f"note: the previous evaluation in {out} is now in {kept}", file=sys.stderr)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--output {out}: {exc.strerror or exc}") from None


def check_args(args) -> None:
    """Numbers that would otherwise slice silently (--limit -5: all but 5), hang (--concurrency 0) or fail every
    request once the models are served (--temperature nan); flags --rejudge would ignore."""
    if args.rejudge:
        ignored = [flag for flag, given in (("--model", args.model), ("--limit", args.limit is not None),
                                            ("--split", args.split != "test"), ("--db", args.db), ("--demo", args.demo),
                                            ("--single-source", args.single_source),
                                            *((f"--{f.replace('_', '-')}", getattr(args, f) is not None)
                                              for f in ("max_turns", "max_tokens", "max_body_chars", "search_results")))
                   if given]
        if ignored:
            raise DataError(f"--rejudge re-scores the answers in {args.rejudge} as they are; it runs no model, so "
                            f"{', '.join(ignored)} would change nothing")
    for flag in ("limit", "concurrency", "max_turns", "max_tokens", "max_body_chars", "search_results"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise DataError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    if not args.timeout > 0 or math.isinf(args.timeout):  # NaN fails the first test
        raise DataError(f"--timeout is seconds per model request, more than 0; not {args.timeout}")
    if not 0 <= args.temperature <= 2:  # what OpenAI-compatible servers accept; NaN fails it too
        raise DataError(f"--temperature must be between 0 and 2, not {args.temperature}")
    repeated = sorted({spec for spec in args.model or [] if args.model.count(spec) > 1})
    if repeated:
        raise DataError(f"--model {repeated[0]} is given twice: each model is evaluated once per question")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.log_to_stderr()
    cli.stop_on_sigterm()
    try:
        cli.check_text_arguments(argv if argv is not None else sys.argv[1:])
        check_args(args)
        if not args.model and not args.rejudge:
            args.model = [str(runs.latest_run(args.art_dir).path)]
        # the database the trained runs among the models were trained on, as `ask` does
        args.db = args.db or (DEMO_DB if args.demo else runs.trained_db(args.model, args.art_dir) or DEFAULT_DB)
        return asyncio.run(evaluate(args))
    except DataError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except sqlite3.DatabaseError as exc:  # damaged after it was opened (a disk error, a half-copied file)
        print(f"Error: the database could not be read ({exc}); if it is damaged, rebuild it with build-db",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the rollouts began (serving, probing) or during --rejudge
        print("\ninterrupted: nothing written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
