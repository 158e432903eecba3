"""Evaluate email search agents: trained checkpoints, base models and prompted models, side by side.

    python test_email_search_agent.py --demo                                      # the most recent run, demo inbox
    python test_email_search_agent.py --demo --model base --model demo            # CPU, offline
    python test_email_search_agent.py --model openai/o4-mini --model my-run@latest --limit 100
    python test_email_search_agent.py --rejudge eval/20261123-101500 --judge-model openai/gpt-4.1

Every model plays the same rollout (email_agent.agent.rollout) over the same questions; a trained run is served
by the backend it was trained on and plays the episode shape it was trained with (flags override). Each
model's endpoint is probed before the first rollout. The output folder holds results.jsonl (one line per
question x model, enough to re-judge without re-running), summary.json and report.html / report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

import email_agent  # noqa: F401  (offline environment defaults before litellm/ART load)
from email_agent import cli, runs
from email_agent.evaluation import records, report, scores
from email_agent.serving import players, servers
from email_agent.agent import rewards
from email_agent.runs import ART_DIR, PROJECT
from email_agent.backends import CPU_BASE_MODEL
from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.agent.episode import MEANINGS, SHAPE, Episode
from email_agent.data.questions import Question, id_sort_key, question_counts, select_questions

DEFAULT_DB, DEMO_DB = "data/enron_emails.db", "data/demo.db"


async def evaluate(args) -> int:
    # here, not at the top: rollout imports ART (torch, seconds), which --help never needs; and tests patch
    # email_agent.agent.rollout.rollout, looked up at each call
    from email_agent.agent.rollout import rollout

    scoring = records.scoring_episode(args.reward, args.judge_model, args.judge_base_url, args.art_dir,
                                      args.grounded_answers)
    out = Path(args.output or f"eval/{time.strftime('%Y%m%d-%H%M%S')}")
    report.check_output(out)
    if scoring.judge:
        await scoring.judge.probe()
    if args.rejudge:
        results = await records.rejudge_folder(Path(args.rejudge), scoring, args.grounded_answers)
        report.keep_previous(out)
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        return done(args, out, results, {})

    db, questions = open_questions(args)
    if args.wandb:
        # here, not at the top: tests patch tracing.traced_rollout, so it is looked up at each call
        from email_agent.tracing import traced_rollout

        rollout = traced_rollout(args.project, rollout, scoring.judge)
    options = players.Options(art_dir=args.art_dir, base_model=args.base_model, base_url=args.base_url,
                              api_key=args.api_key, temperature=args.temperature, timeout=args.timeout,
                              concurrency=args.concurrency, seed=args.seed,
                              cpu_lora_rank=players.cpu_lora_rank(args.model, args.art_dir),
                              shape={name: getattr(args, name) for name in SHAPE})
    results: list[dict] = []
    async with contextlib.AsyncExitStack() as stack:
        contestants = await open_contestants(args.model, servers.Servers(options, stack))
        histories = {c.label: scores.load_history(c.history, c.step) for c in contestants
                     if c.history and c.history.exists()}
        for c in contestants:
            print(f"{c.label}: {c.backend}, tool_choice={c.tool_choice}, {c.shape.describe()}", file=sys.stderr)
        print(f"evaluating {len(contestants)} model(s) on {len(questions)} {args.split} questions -> {out}",
              file=sys.stderr)
        labels = [c.label for c in contestants]
        try:
            await play(contestants, questions, db, scoring, rollout, out, results, args.concurrency)
        except (KeyboardInterrupt, asyncio.CancelledError):
            if not results:
                print("\ninterrupted before any rollout finished: nothing written", file=sys.stderr)
                return 130
            print(f"\ninterrupted: writing the {len(results)} finished rollouts", file=sys.stderr)
            done(args, out, results, histories, labels)
            return 130
        except Exception:  # a bug, not a model's failure (those are recorded): keep what finished, then raise
            if results:
                done(args, out, results, histories, labels)
            raise
        return done(args, out, results, histories, labels)  # before the servers close


def open_questions(args) -> tuple[EmailDB, list[Question]]:
    """The database and the questions to play, or one sentence on why there are none."""
    if args.demo and not Path(args.db).exists():
        raise UserError(f"No demo database at {args.db}; build it with "
                        f"`python train_email_search_agent.py build-db --demo`.")
    db = EmailDB(args.db)
    questions = select_questions(db, args.split, single_source=args.single_source, seed=args.seed, limit=args.limit)
    if not questions:
        splits = sorted({row[0] for row in db.conn.execute("SELECT DISTINCT split FROM questions")})
        if splits and args.split not in splits:
            raise UserError(f"--split {args.split!r}: {args.db} has the splits {', '.join(splits)}")
        total = question_counts(db).get(args.split, {}).get("total", 0)
        cited = (f": its {total:,} cite emails that are not in it or not in the inbox they ask about. Build it from "
                 f"the mail they were written about, or write questions for this mail" if total else
                 "; write some")
        raise UserError(f"No answerable {args.split!r} questions in {args.db}{cited} with "
                        f"`python train_email_search_agent.py generate-questions --db {args.db} --model MODEL`.")
    return db, questions


async def open_contestants(specs: list[str], servers: servers.Servers) -> list[players.Contestant]:
    """Every model served and probed before the first rollout: a dead endpoint fails in seconds, not after hours of
    the other models' rollouts."""
    art_dir = servers.options.art_dir
    players.check_specs(specs, art_dir)
    shared = players.shared_run_shape(specs, art_dir)
    contestants = [await players.open_contestant(spec, servers, shared) for spec in specs]
    labels = [c.label for c in contestants]
    if len(set(labels)) < len(labels):  # e.g. RUN and RUN@N where N is its latest step
        twice = next(label for label in labels if labels.count(label) > 1)
        raise UserError(f"--model: {twice} is given twice (under two names); each model is evaluated once")
    for contestant in contestants:
        await players.probe(contestant)
    return contestants


async def play(contestants: list[players.Contestant], questions: list[Question], db: EmailDB, scoring: Episode,
               rollout, out: Path, results: list[dict], concurrency: int) -> None:
    """Every contestant on every question, as `players.Schedule` lets them: each finished rollout's record is
    appended to `results` and written to out/results.jsonl at once (an interrupted evaluation keeps them)."""
    schedule = players.Schedule(contestants, len(questions), concurrency)

    async def one(contestant: players.Contestant, question: Question) -> dict:
        episode = contestant.episode(scoring)
        async with schedule.turn(contestant.label):
            traj = await rollout(contestant.policy, question, db, episode)
        return records.make_record(contestant, question, traj, episode)

    correct: dict[str, list[int]] = {c.label: [0, 0] for c in contestants}
    bar = tqdm(total=len(questions) * len(contestants), unit=" rollouts", desc="evaluating")
    tasks = [asyncio.ensure_future(one(c, q)) for c in contestants for q in questions]
    results_file = None  # opened at the first finished rollout: an evaluation stopped before it writes nothing
    with contextlib.ExitStack() as files:
        try:
            for finished in asyncio.as_completed(tasks):
                record = await finished
                if results_file is None:
                    report.keep_previous(out)
                    results_file = files.enter_context(open(out / "results.jsonl", "w"))
                results.append(record)
                results_file.write(json.dumps(record) + "\n")
                results_file.flush()  # an interrupted evaluation keeps every finished rollout
                tally = correct[record["model"]]
                tally[0] += record["metrics"]["answer_correct"]
                tally[1] += 1
                bar.set_postfix_str(" ".join(f"{k}={v[0] / max(v[1], 1):.0%}" for k, v in correct.items()),
                                    refresh=False)
                bar.update()
        except BaseException:  # interrupted, or a bug: no rollout plays on
            for task in tasks:
                task.cancel()
            raise
        finally:
            bar.close()


def done(args, out: Path, results: list[dict], histories: dict, labels: list[str] = ()) -> int:
    code = finish(out, results, histories, labels)
    args.written = out  # a Ctrl-C while the servers close says where the report is, not "nothing written"
    return code


def finish(out: Path, records: list[dict], histories: dict, labels: list[str] = ()) -> int:
    """Write the report and print the summary; non-zero if a model failed every one of its rollouts."""
    order = {label: i for i, label in enumerate(labels)}
    records.sort(key=lambda r: (order.get(r["model"], 0), id_sort_key(r["question_id"])))
    figures = scores.summarize(records)
    paths = report.write_report(out, records, figures, histories=histories or None)
    print("\n".join(scores.console_lines(figures)))
    print(f"report: {paths['html']}")
    failed = [label for label, s in figures["models"].items() if s["n"] and s["n_errors"] == s["n"]]
    for label in failed:
        first = next(r["error"] for r in records if r["model"] == label)
        print(f"Error: every rollout of {label} failed; the first: {first}", file=sys.stderr)
    return 1 if failed else 0



def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                parents=[cli.console_flags()])
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
    for name, default in Episode().shape().items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       help=f"{MEANINGS[name]} (default: what each trained run was trained with; for base and "
                            f"prompted models the runs' shape if they share one, else {default})")
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
    cli.show_switch_defaults(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.console(args.quiet, args.verbose)

    def command() -> int:
        players.check_flags(args)
        if not args.model and not args.rejudge:
            args.model = [str(runs.latest_run(args.art_dir).path)]
        # the database the trained runs among the models were trained on, as `ask` does
        args.db = args.db or (DEMO_DB if args.demo else runs.trained_db(args.model, args.art_dir) or DEFAULT_DB)
        return asyncio.run(evaluate(args))

    # interrupted before the rollouts began (serving, probing) or during --rejudge: evaluate() handles the rest
    return cli.run_command(command, argv, interrupted=lambda: f"\ninterrupted: the report is in {args.written}"
                           if getattr(args, "written", None) else "\ninterrupted: nothing written")


if __name__ == "__main__":
    sys.exit(main())
