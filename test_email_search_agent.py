"""Evaluate email search agents: trained checkpoints, base models and prompted models, side by side.

    python test_email_search_agent.py --demo                                      # the most recent run, demo inbox
    python test_email_search_agent.py --demo --model base --model demo            # CPU, offline
    python test_email_search_agent.py --model openai/o4-mini --model my-run@latest --limit 100
    python test_email_search_agent.py --rejudge eval/20261123-101500 --judge-model openai/gpt-4.1
    python test_email_search_agent.py --config eval/20261123-101500/eval_config.json --limit 20   # run it again

Every model plays the same rollout (email_agent.agent.rollout) over the same questions; a trained run is served
by the backend it was trained on and plays with the episode limits it was trained with (flags override). Each
model's endpoint is probed before the first rollout. The output folder holds results.jsonl (one line per
question x model, enough to re-judge without re-running), summary.json, report.html / report.md and
eval_config.json (every setting; `--config` reads it back, the flags given winning: email_agent/eval_config.py).

Read top to bottom: `main` parses and checks the settings (`eval_config.load`); `evaluate` plays every model on
every question (`play_episodes`), grades each answer as it finishes, and writes the report (`finish`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from tqdm import tqdm

import email_agent  # noqa: F401  (offline environment defaults before litellm/ART load)
from email_agent import cli, eval_config
from email_agent.evaluation import records, report, scores
from email_agent.models import opened, servers
from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.agent.episode import LIMITS, Episode
from email_agent.data.questions import Question, id_sort_key, question_counts, select_questions
from email_agent.eval_config import EvalConfig


async def evaluate(cfg: EvalConfig, written: list[Path]) -> int:
    """Play every model on every question and grade the answers (or, with --rejudge, grade an earlier evaluation's
    answers again), then write the report; `written` gets its folder."""
    # here, not at the top: rollout imports ART (torch, seconds), which --help never needs; and tests patch
    # email_agent.agent.rollout.rollout, looked up at each call
    from email_agent.agent.rollout import rollout

    scoring = records.scoring_episode(cfg.reward, cfg.judge_model, cfg.judge_base_url, cfg.art_dir,
                                      cfg.grounded_answers)
    out = Path(cfg.output)
    report.check_output(out)
    if scoring.judge:
        await scoring.judge.probe()
    if cfg.rejudge:
        return await rejudge(cfg, scoring, written)

    db, questions = open_questions(cfg)
    if cfg.wandb:
        # here, not at the top: tests patch tracing.traced_rollout, so it is looked up at each call
        from email_agent.tracing import traced_rollout

        rollout = traced_rollout(cfg.project, rollout, scoring.judge)
    results: list[dict] = []
    async with contextlib.AsyncExitStack() as stack:
        opened_models = await open_models(cfg.model, servers.Servers(serving_options(cfg), stack))
        histories = {c.label: scores.load_history(c.history, c.step) for c in opened_models
                     if c.history and c.history.exists()}
        lines = [f"{c.label}: {c.backend}, tool_choice={c.tool_choice}, {c.limits.describe()}" for c in opened_models]
        print(*lines, f"evaluating {len(opened_models)} model(s) on {len(questions)} {cfg.split} questions -> {out}",
              sep="\n", file=sys.stderr)
        labels = [c.label for c in opened_models]
        try:
            await play_episodes(opened_models, questions, db, scoring, rollout, out, results, cfg.concurrency)
        except (KeyboardInterrupt, asyncio.CancelledError):
            if not results:
                print("\ninterrupted before any rollout finished: nothing written", file=sys.stderr)
                return 130
            print(f"\ninterrupted: writing the {len(results)} finished rollouts", file=sys.stderr)
            finish(cfg, results, histories, labels, written=written)
            return 130
        except Exception:  # a bug, not a model's failure (those are recorded): keep what finished, then raise
            if results:
                finish(cfg, results, histories, labels, written=written)
            raise
        return finish(cfg, results, histories, labels, written=written)  # before the servers close


async def rejudge(cfg: EvalConfig, scoring: Episode, written: list[Path]) -> int:
    """An earlier evaluation's answers (cfg.rejudge) graded again as `scoring` says, into a report of their own."""
    results = await records.rejudge_folder(Path(cfg.rejudge), scoring, cfg.grounded_answers)
    report.keep_previous(Path(cfg.output))
    (Path(cfg.output) / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    return finish(cfg, results, {}, written=written)


def serving_options(cfg: EvalConfig) -> opened.Options:
    """How the models are served and asked, from the evaluation's settings."""
    return opened.Options(art_dir=cfg.art_dir, base_model=cfg.base_model, base_url=cfg.base_url,
                          api_key=cfg.api_key, temperature=cfg.temperature, timeout=cfg.timeout,
                          concurrency=cfg.concurrency, seed=cfg.seed,
                          cpu_lora_rank=opened.cpu_lora_rank(cfg.model, cfg.art_dir),
                          limits={name: getattr(cfg, name) for name in LIMITS})


def open_questions(cfg: EvalConfig) -> tuple[EmailDB, list[Question]]:
    """The database and the questions to play, or one sentence on why there are none."""
    if cfg.demo and not Path(cfg.db).exists():
        raise UserError(f"No demo database at {cfg.db}; build it with "
                        f"`python train_email_search_agent.py build-db --demo`.")
    db = EmailDB(cfg.db)
    questions = select_questions(db, cfg.split, single_source=cfg.single_source, seed=cfg.seed, limit=cfg.limit)
    if not questions:
        splits = sorted({row[0] for row in db.conn.execute("SELECT DISTINCT split FROM questions")})
        if splits and cfg.split not in splits:
            raise UserError(f"--split {cfg.split!r}: {cfg.db} has the splits {', '.join(splits)}")
        total = question_counts(db).get(cfg.split, {}).get("total", 0)
        cited = (f": its {total:,} cite emails that are not in it or not in the inbox they ask about. Build it from "
                 f"the mail they were written about, or write questions for this mail" if total else
                 "; write some")
        raise UserError(f"No answerable {cfg.split!r} questions in {cfg.db}{cited} with "
                        f"`python train_email_search_agent.py generate-questions --db {cfg.db} --model MODEL`.")
    return db, questions


async def open_models(specs: list[str], servers: servers.Servers) -> list[opened.OpenedModel]:
    """Every model served and probed before the first rollout: a dead endpoint fails in seconds, not after hours of
    the other models' rollouts."""
    art_dir = servers.options.art_dir
    opened.check_specs(specs, art_dir)
    shared = opened.shared_run_limits(specs, art_dir)
    opened_models = [await opened.open_model(spec, servers, shared) for spec in specs]
    labels = [c.label for c in opened_models]
    if len(set(labels)) < len(labels):  # e.g. RUN and RUN@N where N is its latest step
        twice = next(label for label in labels if labels.count(label) > 1)
        raise UserError(f"--model: {twice} is given twice (under two names); each model is evaluated once")
    for opened_model in opened_models:
        await opened.probe(opened_model)
    return opened_models


async def play_episodes(opened_models: list[opened.OpenedModel], questions: list[Question], db: EmailDB,
                        scoring: Episode, rollout, out: Path, results: list[dict], concurrency: int) -> None:
    """Every opened model on every question, as `opened.EpisodeScheduler` lets them: each finished rollout's record is
    appended to `results` and written to out/results.jsonl at once (an interrupted evaluation keeps them)."""
    scheduler = opened.EpisodeScheduler(opened_models, len(questions), concurrency)

    async def one(opened_model: opened.OpenedModel, question: Question) -> dict:
        episode = opened_model.episode(scoring)
        async with scheduler.slot(opened_model.label):
            traj = await rollout(opened_model.policy, question, db, episode)
        return records.make_record(opened_model, question, traj, episode)

    correct: dict[str, list[int]] = {c.label: [0, 0] for c in opened_models}
    bar = tqdm(total=len(questions) * len(opened_models), unit=" rollouts", desc="evaluating")
    tasks = [asyncio.ensure_future(one(c, q)) for c in opened_models for q in questions]
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


def finish(cfg: EvalConfig, results: list[dict], histories: dict, labels: list[str] = (), *,
           written: list[Path]) -> int:
    """Write the report and eval_config.json beside it, and print the summary; non-zero if a model failed every one
    of its rollouts. The folder goes into `written`: a Ctrl-C while the servers close then says where it is."""
    out = Path(cfg.output)
    order = {label: i for i, label in enumerate(labels)}
    results.sort(key=lambda r: (order.get(r["model"], 0), id_sort_key(r["question_id"])))
    figures = scores.summarize(results)
    paths = report.write_report(out, results, figures, histories=histories or None)
    eval_config.save(cfg, out)
    written.append(out)
    print("\n".join(scores.console_lines(figures)))
    print(f"report: {paths['html']}")
    failed = [label for label, s in figures["models"].items() if s["n"] and s["n_errors"] == s["n"]]
    for label in failed:
        first = next(r["error"] for r in results if r["model"] == label)
        print(f"Error: every rollout of {label} failed; the first: {first}", file=sys.stderr)
    return 1 if failed else 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                parents=[cli.console_flags()])
    cli.add_dataclass_flags(p, EvalConfig)  # one flag per field, with its help, default and allowed values
    p.add_argument("--config", metavar="FILE", help="start from the settings in FILE, an evaluation's "
                                                     "eval_config.json; the flags given here win")
    cli.show_switch_defaults(p)  # --quiet, --verbose
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.console(args.quiet, args.verbose)
    written: list[Path] = []

    def command() -> int:
        cfg = eval_config.load(cli.given_flags(args, EvalConfig), args.config)  # checked once, derived
        print(eval_config.opening_line(cfg), file=sys.stderr)
        return asyncio.run(evaluate(cfg, written))

    # interrupted before the rollouts began (serving, probing) or during --rejudge: evaluate() handles the rest
    return cli.run_command(command, argv, interrupted=lambda: f"\ninterrupted: the report is in {written[-1]}"
                           if written else "\ninterrupted: nothing written")


if __name__ == "__main__":
    sys.exit(main())
