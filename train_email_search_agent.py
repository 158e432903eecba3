"""Train an email search agent with reinforcement learning (the ART·E recipe).

    python train_email_search_agent.py build-db --demo          # the bundled demo inbox (offline)
    python train_email_search_agent.py build-db                 # the Enron corpus + ART·E questions from Hugging Face
    python train_email_search_agent.py inboxes                  # the inboxes --inbox may name, largest first
    python train_email_search_agent.py search --inbox ADDRESS KEYWORD...   # the agent's search tool, for humans
    python train_email_search_agent.py read MESSAGE_ID          # the agent's read tool, for humans
    python train_email_search_agent.py generate-questions --db my.db --model openai/gpt-4.1   # questions for your inbox
    python train_email_search_agent.py train --demo             # GRPO on the demo inbox, CPU, offline
    python train_email_search_agent.py train --name qwen7b      # GRPO on Enron; GPU (ART LocalBackend) if present
    python train_email_search_agent.py dashboard                # every run's curves in TensorBoard, as they train
    python train_email_search_agent.py ask "QUESTION" --inbox ADDRESS   # one question to the latest trained agent
    python train_email_search_agent.py serve --inbox ADDRESS     # the agent as an MCP server for assistants
    python train_email_search_agent.py export --model demo --format gguf --output export/demo   # for llama.cpp

Subcommands stay thin: each parses its flags, calls one function of the `email_agent` package and prints;
`train` checks its flags, locks the run and hands it to the loop, read top to bottom in email_agent/training/loop.py
(gather groups of rollouts, judge, train, log, validate, checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict

import email_agent  # noqa: F401  (sets offline-friendly environment defaults before litellm/ART load)
from email_agent.apps import ask, export, serve
from email_agent.data import build, enron_sample, generate
from email_agent import cli, dashboard, runs
from email_agent.models import opened
from email_agent.config import DEFAULT_DB, DEMO_DB, TrainConfig, config_from_args, cpu_preset, run_dir
from email_agent.errors import UserError
from email_agent.runs import ART_DIR, PROJECT
from email_agent.data.email_db import MAX_SEARCH_RESULTS, EmailDB, check_day, visible_until


# ---- build-db ------------------------------------------------------------------------------------

def build_db(args) -> None:
    if args.enron_sample:
        return build_enron_sample(args)
    db_path = args.db or (DEMO_DB if args.demo else DEFAULT_DB)
    if args.demo and (args.emails or args.questions):
        raise UserError("--demo builds the bundled demo inbox; it takes no --emails or --questions")
    if args.emails and not args.db:  # refused, not named after the source: every later command needs --db anyway
        raise UserError(f"--emails needs --db to name the database of that mail (e.g. --db data/me.db): without it "
                        f"the mail would go to {DEFAULT_DB}, the Enron corpus's name, which the other commands read "
                        f"when given no --db")
    build.check_target(db_path, [args.emails, args.questions], brings_questions=not args.emails or bool(args.questions),
                       overwrite=args.overwrite)
    emails, question_rows, source, total = build.open_sources(demo=args.demo, emails=args.emails,
                                                              questions=args.questions)
    if args.emails and not args.questions:
        print(f"note: no --questions given; the database will hold emails only. Write questions for it with: "
              f"python train_email_search_agent.py generate-questions --db {db_path} --model MODEL", file=sys.stderr)
    print(f"building {db_path} from {source}", file=sys.stderr)
    summary = build.build_database(emails, question_rows, db_path, source=source, total=total, progress=not args.quiet)
    print("\n".join(summary.lines()))
    with contextlib.closing(EmailDB(db_path)) as db:  # what --inbox may name, largest first
        largest = ", ".join(f"{address} ({count:,})" for address, count in db.largest_inboxes(5))
    print(f"inboxes     {largest}; all: python train_email_search_agent.py inboxes --db {db_path}")


def build_enron_sample(args) -> None:
    """The real-mail sample, picked out of --emails or Hugging Face by its manifest and checked against it."""
    if args.demo:
        raise UserError("--demo and --enron-sample build two different databases; give one of them")
    db_path = args.db or enron_sample.SAMPLE_DB
    build.check_target(db_path, [args.emails, args.questions], brings_questions=True, overwrite=args.overwrite)
    print(f"picking the sample out of {args.emails or 'hf:' + enron_sample.HUB_NAME}", file=sys.stderr)
    emails, question_rows, source, check = enron_sample.open_sample(args.emails, args.questions)
    print(f"building {db_path} from the sample in {source}", file=sys.stderr)
    summary = build.build_database(emails, question_rows, db_path, source=f"the real-mail sample, from {source}",
                                   total=len(emails), progress=not args.quiet, meta=check.meta())
    print("\n".join([*summary.lines(), check.line()]))
    with contextlib.closing(EmailDB(db_path)) as db:
        largest = ", ".join(f"{address} ({count:,})" for address, count in db.largest_inboxes(5))
    print(f"inboxes     {largest}; all: python train_email_search_agent.py inboxes --db {db_path}")


# ---- inboxes: the addresses --inbox may name -----------------------------------------------------

def inboxes(args) -> None:
    with contextlib.closing(EmailDB(args.db)) as db:
        rows, questions = db.largest_inboxes(args.limit or -1), db.question_counts()
    if args.json:
        print(json.dumps([{"inbox": a, "emails": n, "questions": questions.get(a, 0)} for a, n in rows], indent=2))
        return
    width = max((len(address) for address, _ in rows), default=5)
    print(f"{'inbox':<{width}}  {'emails':>8}  {'questions':>9}")
    print("\n".join(f"{address:<{width}}  {count:>8,}  {questions.get(address, 0):>9,}" for address, count in rows))


# ---- generate-questions: an LLM writes the question set for an inbox -----------------------------

def generate_questions(args) -> int | None:
    # here, not at the top: there this function's own name would replace the imported generate_questions
    from email_agent.data.generate import GenerateConfig, cache_path, generate_questions

    cfg = GenerateConfig(model=args.model, base_url=args.base_url, api_key=os.environ.get("QUESTIONS_API_KEY"),
                         inboxes=args.inbox or [], max_questions=args.max_questions, batch_size=args.batch_size,
                         test_fraction=args.test_fraction, min_realistic=args.min_realistic, seed=args.seed,
                         replace=args.replace, temperature=args.temperature, concurrency=args.concurrency,
                         timeout=args.timeout)
    print(f"generating questions for {args.db} with {cfg.model} (temperature {cfg.temperature}; a request waits up "
          f"to {cfg.timeout:g} s, {cfg.retries} tries); replies cached in {cache_path(args.db)}", file=sys.stderr)

    def confirm(estimate) -> bool:  # the mail and the money, before either is sent
        print("\n".join(estimate.lines()), file=sys.stderr)
        if args.yes or not sys.stdin.isatty():  # a script or a pipe: told, never asked
            return True
        try:
            return input("Send them? [y/N] ").strip().lower() in ("y", "yes")
        except EOFError:
            return False

    summary = generate_questions(args.db, cfg, progress=not args.quiet, confirm=confirm)
    if summary is None:
        print("stopped: nothing was sent (--yes sends without asking)", file=sys.stderr)
        return 1
    print("\n".join(summary.lines()))


# ---- search / read: exactly what the agent's tools return ----------------------------------------

def search(args) -> None:
    db = EmailDB(args.db)
    db.require_inbox(args.inbox)
    filters = dict(from_address=args.from_address, to_address=args.to_address,
                   sent_after=check_day("--after", args.after), sent_before=check_day("--before", args.before),
                   visible_until=visible_until(args.as_of), max_results=args.max_results)
    results = db.search(args.inbox, args.keywords, **filters)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, ensure_ascii=False))
    else:
        print("\n".join(r.as_text(rank) for rank, r in enumerate(results, 1)) if results else "no matches")
    phrases = [keyword for keyword in args.keywords if len(keyword.replace('"', " ").split()) > 1]
    if not results and phrases:  # `search "quarterly budget"`: the words were likely meant, anywhere in an email
        words = [word for keyword in args.keywords for word in keyword.replace('"', " ").split()]
        found = len(db.search(args.inbox, words, **{**filters, "max_results": MAX_SEARCH_RESULTS}))
        count = f"{found}{'+' if found == MAX_SEARCH_RESULTS else ''} email{'s match' if found > 1 else ' matches'}"
        unquoted = (f"without quotes {count}: search --inbox {args.inbox} {' '.join(words)}" if found else
                    "without quotes nothing matches either")
        print(f"hint: quotes make a phrase: {phrases[0]!r} matches only those words side by side, in that order; "
              f"{unquoted}", file=sys.stderr)


def read(args) -> None:
    db = EmailDB(args.db)
    if args.inbox is not None:
        db.require_inbox(args.inbox)
    email = db.read_or_explain(args.message_id, inbox=args.inbox, as_of=args.as_of)
    print(json.dumps(asdict(email), indent=2, ensure_ascii=False) if args.json else email.as_text())


# ---- ask: one question to a trained agent, each tool call shown as it happens --------------------

def ask_command(args) -> None:
    for flag in ("max_turns", "max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    spec, db = ask.model_and_db(args.model, args.db, args.art_dir, DEFAULT_DB)
    question = ask.adhoc_question(db, args.question, args.inbox, args.as_of)
    options = opened.Options(art_dir=args.art_dir, base_url=args.base_url, api_key=args.api_key, concurrency=1,
                                 limits={"max_turns": args.max_turns, "max_tokens": args.max_tokens})
    live = {} if args.json else dict(
        on_call=lambda *call: print(ask.describe_call(*call), flush=True),
        on_start=lambda label, limits: print(f"{label} ({limits}) asks {question.inbox_address}'s inbox as of "
                                            f"{question.query_date}:", file=sys.stderr))
    result = asyncio.run(ask.ask(spec, question, db, options, grounded_answers=args.grounded_answers, **live))
    print(json.dumps(result.to_json(), indent=2, ensure_ascii=False) if args.json else ask.answer_text(result))


# ---- serve: the trained agent and its tools as an MCP server --------------------------------------

def serve_command(args) -> None:
    asyncio.run(serve.serve(serve.settings_from_args(args, DEFAULT_DB)))


# ---- export: a checkpoint in the formats other runtimes load --------------------------------------

def export_command(args) -> None:
    # here, not at the top: there `export` is the module (for make_parser's export.add_arguments)
    from email_agent.apps.export import export

    folder = export(args.model, args.format, args.output, art_dir=args.art_dir, force=args.force,
                    base_model=args.base_model)
    print(f"wrote {folder} (how to load and prompt it: {folder / 'README.md'})")


# ---- dashboard: every run's curves in TensorBoard, on this machine ----------------------------------

def dashboard_command(args) -> None:
    logdir = runs.run_path(args.art_dir, args.project, "")
    url = dashboard.serve(logdir, args.port)
    shown = dashboard.runs_shown(logdir)
    print(f"TensorBoard at {url} with the curves of " + (f"{len(shown)} run(s) in {logdir} ({', '.join(shown)})"
          if shown else f"the runs in {logdir}: none has curves yet; they appear as a run trains") +
          "; Ctrl-C closes it", flush=True)
    while True:  # TensorBoard serves from a thread of its own
        time.sleep(3600)


# ---- train: the flags checked once, the run locked, then the loop (email_agent/training/loop.py) ----

def train_command(args) -> None:
    # here, not at the top: run_plan imports the agent (the OpenAI client); the other subcommands need none of it
    from email_agent.training import run_plan

    cfg = config_from_args(args)
    # the first of the start-up checks (run_plan: flags, data, machine, resume), once, before the run's lock file
    # is made and before ART loads (seconds); the loop asks the others
    run_plan.check_flags(cfg)
    if preset := cpu_preset(args):
        print("CPU backend: the CPU preset's episode limits and batch ("
              + " ".join(f"--{key.replace('_', '-')} {value}" for key, value in preset.items())
              + "); give these flags to change them", file=sys.stderr)
    with runs.lock(cfg.art_dir, cfg.project, cfg.name):
        # here, not at the top: the loop imports ART (torch, seconds); the other subcommands need none of it
        from email_agent.training import loop

        cli.run_cancellable(loop.train(cfg))


# ---- command line --------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    console = cli.console_flags()
    add_inbox_commands(sub, console)
    add_agent_commands(sub, console)
    cli.show_switch_defaults(parser)
    return parser


def command(sub, name: str, func, parents: list, **texts: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=parents, **texts)
    p.set_defaults(func=func)
    return p


def add_inbox_commands(sub, console: argparse.ArgumentParser) -> None:
    """build-db, generate-questions, inboxes, search, read: the inbox and its questions."""
    p = command(sub, "build-db", build_db, [console], help="build the search database and question sets",
                description="Build the SQLite/FTS5 email database (and its questions) atomically. "
                            "Example: python train_email_search_agent.py build-db --demo")
    build.add_arguments(p, DEFAULT_DB, DEMO_DB)

    p = command(sub, "generate-questions", generate_questions, [console],
                help="write a question set for an inbox with an LLM",
                description="Ask an LLM to write question/answer pairs from batches of one inbox's emails "
                            "(as ART·E made its questions), validate each against the database, split them "
                            "into train/test with no shared email, and store them in the database. Re-running "
                            "reuses cached replies and adds only new questions. Key: QUESTIONS_API_KEY, or the "
                            "provider's usual variable (OPENAI_API_KEY...). Example: python "
                            "train_email_search_agent.py generate-questions --db data/me.db --model "
                            "openai/gpt-4.1 --inbox me@example.com --max-questions 500")
    cli.add_db_flags(p, DEFAULT_DB, f"database from build-db (default {DEFAULT_DB})")
    generate.add_arguments(p)

    common = argparse.ArgumentParser(add_help=False)
    cli.add_db_flags(common, DEFAULT_DB, f"database (default {DEFAULT_DB})")
    common.add_argument("--as-of", metavar="DATE", help="hide mail dated after DATE, as the agent does for a question "
                                                       "asked that day")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    p = command(sub, "search", search, [common, console], help="search an inbox as the agent does",
                description="Search one inbox with the agent's own search. All keywords must match; best "
                            "match first. Example: python train_email_search_agent.py search --db data/demo.db "
                            "--inbox maya.okafor@larkspur.example Godwit review")
    p.add_argument("keywords", nargs="+", metavar="KEYWORD")
    p.add_argument("--inbox", required=True, metavar="ADDRESS", help="whose mail (sent or received) to search")
    p.add_argument("--from", dest="from_address", metavar="ADDRESS", help="only mail sent by ADDRESS")
    p.add_argument("--to", dest="to_address", metavar="ADDRESS", help="only mail sent to ADDRESS (to/cc/bcc)")
    p.add_argument("--after", metavar="DATE", help="only mail sent on or after DATE (YYYY-MM-DD)")
    p.add_argument("--before", metavar="DATE", help="only mail sent before DATE (YYYY-MM-DD)")
    p.add_argument("--max-results", type=int, default=10, metavar="N",
                   help="number of results (default 10, clamped to 1..20)")

    p = command(sub, "inboxes", inboxes, [console], help="list the inboxes --inbox may name, with their sizes",
                description="Every address with mail sent or received in the database, largest first, with how "
                            "many emails and questions it has. Example: python train_email_search_agent.py "
                            "inboxes --db data/demo.db")
    cli.add_db_flags(p, DEFAULT_DB, f"database (default {DEFAULT_DB})")
    p.add_argument("--limit", type=int, default=20, metavar="N", help="the N largest (default 20; 0: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command(sub, "read", read, [common, console], help="read one email as the agent does",
                description="Print one email with its recipients. Example: python train_email_search_agent.py "
                            "read --db data/demo.db '<demo.000001@larkspur.example>'")
    p.add_argument("message_id", metavar="MESSAGE_ID")
    p.add_argument("--inbox", metavar="ADDRESS", help="only if ADDRESS sent or received it")


def add_agent_commands(sub, console: argparse.ArgumentParser) -> None:
    """ask, serve, export, train, dashboard: the agent trained and put to use."""
    p = command(sub, "ask", ask_command, [console], help="ask a trained agent a question about an inbox",
                description="One question to a trained agent (or any model), played by the rollout of training "
                            "and evaluation, each tool call shown as it happens; nothing is graded. Example: "
                            "python train_email_search_agent.py ask --db data/demo.db --inbox "
                            "priya.natarajan@larkspur.example 'Where is the Egret kickoff being held?'")
    ask.add_arguments(p, DEFAULT_DB)

    p = command(sub, "serve", serve_command, [console], help="serve a trained agent to assistants over MCP",
                description="An MCP server (stdio, or streamable HTTP with --http) with three tools: "
                            "ask_inbox (the trained agent answers, as `ask` does), search_inbox and read_email "
                            "(its own tools). The model is served once and shared by all requests. Example: "
                            "python train_email_search_agent.py serve --db data/demo.db --inbox "
                            "priya.natarajan@larkspur.example")
    serve.add_arguments(p, DEFAULT_DB)

    p = command(sub, "export", export_command, [console],
                help="write a trained checkpoint for vLLM, transformers or llama.cpp",
                description="Write one checkpoint of a run as a PEFT LoRA folder (lora), the base model with the "
                            "LoRA merged, with its tokenizer and chat template (merged), or a float32 GGUF "
                            "for llama.cpp (gguf: CPU runs on SmolLM2), with a README.md on loading and "
                            "prompting it. Example: python train_email_search_agent.py export --model demo@4 "
                            "--format merged --output export/demo-merged")
    export.add_arguments(p)

    p = command(sub, "train", train_command, [console],
                help="train the agent with GRPO (resumes a run of the same name)",
                description="GRPO on the train split with rollouts from the agent environment. "
                            "Example: python train_email_search_agent.py train --demo")
    cli.add_dataclass_flags(p, TrainConfig)  # one flag per field; its comment is the help text

    p = command(sub, "dashboard", dashboard_command, [console],
                help="open the training curves of every run in TensorBoard (127.0.0.1 only)",
                description="TensorBoard on this machine with the curves `train` writes into each run's folder "
                            "as it trains: reward, accuracy, hallucination, \"I don't know\", valid calls, "
                            "trainable share, loss, validation beside training; one line per run. Example: "
                            "python train_email_search_agent.py dashboard --port 6006")
    p.add_argument("--art-dir", default=ART_DIR, help=f"where runs live (default {ART_DIR})")
    p.add_argument("--project", default=PROJECT, help=f"whose runs to show (default {PROJECT})")
    p.add_argument("--port", type=int, default=dashboard.PORT, help=f"its port on 127.0.0.1 (default {dashboard.PORT})")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.console(args.quiet, args.verbose)
    resume = {"train": "; re-run the same command to resume from the last checkpoint",
              "generate-questions": "; nothing was stored: re-run to go on (answered batches are cached)",
              "dashboard": ": the dashboard is closed (runs go on writing their curves)"}
    return cli.run_command(lambda: args.func(args), argv, interrupted="interrupted" + resume.get(args.command, ""),
                           run_folder=lambda: run_dir(config_from_args(args)) if args.command == "train" else None)


if __name__ == "__main__":
    sys.exit(main())
