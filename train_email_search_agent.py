"""Train an email search agent with reinforcement learning (the ART·E recipe).

    python train_email_search_agent.py build-db --demo          # the bundled demo inbox (offline)
    python train_email_search_agent.py build-db                 # the Enron corpus + ART·E questions from Hugging Face
    python train_email_search_agent.py search --inbox ADDRESS KEYWORD...   # the agent's search tool, for humans
    python train_email_search_agent.py read MESSAGE_ID          # the agent's read tool, for humans
    python train_email_search_agent.py generate-questions --db my.db --model openai/gpt-4.1   # questions for your inbox
    python train_email_search_agent.py train --demo             # GRPO on the demo inbox, CPU, offline
    python train_email_search_agent.py train --name qwen7b      # GRPO on Enron; GPU (ART LocalBackend) if present
    python train_email_search_agent.py ask "QUESTION" --inbox ADDRESS   # one question to the latest trained agent
    python train_email_search_agent.py serve --inbox ADDRESS     # the agent as an MCP server for assistants
    python train_email_search_agent.py export --model demo --format gguf --output export/demo   # for llama.cpp

Subcommands stay thin: each parses its flags, calls one function of the `email_agent` package and prints;
`train` shows the whole loop: pick questions, gather groups of rollouts, train, log, validate, checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, replace

import email_agent  # noqa: F401  (sets offline-friendly environment defaults before litellm/ART load)
from email_agent.apps import ask, export, serve
from email_agent.data import build, generate
from email_agent import backends, cli, runs
from email_agent.agent.rewards import valid_tool_call_rate
from email_agent.evaluation import players
from email_agent.config import (DEFAULT_DB, DEMO_DB, DEMO_PRESET, TrainConfig, check, check_warm_start,
                                config_from_args, cpu_preset, run_dir, saved_config)
from email_agent.errors import DataError
from email_agent.data.email_db import EmailDB, check_day, visible_until


# ---- build-db ------------------------------------------------------------------------------------

def build_db(args) -> None:
    db_path = args.db or (DEMO_DB if args.demo else DEFAULT_DB)
    if args.demo and (args.emails or args.questions):
        raise DataError("--demo builds the bundled demo inbox; it takes no --emails or --questions")
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


# ---- generate-questions: an LLM writes the question set for an inbox -----------------------------

def generate_questions(args) -> None:
    # here, not at the top: there this function's own name would replace the imported generate_questions
    from email_agent.data.generate import GenerateConfig, cache_path, generate_questions

    cfg = GenerateConfig(model=args.model, base_url=args.base_url, api_key=os.environ.get("QUESTIONS_API_KEY"),
                         inboxes=args.inbox or [], max_questions=args.max_questions, batch_size=args.batch_size,
                         test_fraction=args.test_fraction, min_realistic=args.min_realistic, seed=args.seed,
                         replace=args.replace, temperature=args.temperature, concurrency=args.concurrency,
                         timeout=args.timeout)
    print(f"generating questions for {args.db} with {cfg.model} (temperature {cfg.temperature}; a request waits up "
          f"to {cfg.timeout:g} s, {cfg.retries} tries); replies cached in {cache_path(args.db)}", file=sys.stderr)
    summary = generate_questions(args.db, cfg, progress=not args.quiet)
    print("\n".join(summary.lines()))


# ---- search / read: exactly what the agent's tools return ----------------------------------------

def search(args) -> None:
    db = EmailDB(args.db)
    db.require_inbox(args.inbox)
    results = db.search(args.inbox, args.keywords, from_address=args.from_address, to_address=args.to_address,
                        sent_after=check_day("--after", args.after), sent_before=check_day("--before", args.before),
                        visible_until=visible_until(args.as_of), max_results=args.max_results)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, ensure_ascii=False))
        return
    print("\n".join(r.as_text(rank) for rank, r in enumerate(results, 1)) if results else "no matches")


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
            raise DataError(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    spec, db = ask.model_and_db(args.model, args.db, args.art_dir, DEFAULT_DB)
    question = ask.adhoc_question(db, args.question, args.inbox, args.as_of)
    options = players.Options(art_dir=args.art_dir, base_url=args.base_url, api_key=args.api_key, concurrency=1,
                                 shape={"max_turns": args.max_turns, "max_tokens": args.max_tokens})
    live = {} if args.json else dict(
        on_call=lambda *call: print(ask.describe_call(*call), flush=True),
        on_start=lambda label, shape: print(f"{label} ({shape}) asks {question.inbox_address}'s inbox as of "
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


# ---- train: the configuration, then the loop -----------------------------------------------------

async def validate(model, policy, questions, db, episode, step: int) -> str:
    """Greedy episodes of the validation questions, logged as val/*; returns the line to print."""
    # here, not at the top: ART (and rollout, which imports it) load torch in seconds; only train needs them
    import art

    from email_agent.agent.rollout import rollout

    greedy = replace(policy, temperature=0.0)  # as the evaluation does: less noise per question
    # One-episode groups because only gather_trajectory_groups takes max_metrics: gather_trajectories' bar
    # shows every metric (~20), a line that wraps and floods the terminal at each refresh.
    groups = await art.gather_trajectory_groups((art.TrajectoryGroup([rollout(greedy, q, db, episode)])
                                                 for q in questions),
                                                pbar_desc="validate", max_exceptions=len(questions), max_metrics=4)
    trajs = [t for g in groups for t in g.trajectories]
    extra = {"valid_tool_call_rate": valid_tool_call_rate(t.metrics for t in trajs) or 0.0}
    await model.log(trajs, split="val", metrics=extra, step=step)
    n = max(len(trajs), 1)
    right = sum(t.metrics["answer_correct"] for t in trajs) / n
    hallucinated = sum(t.metrics["hallucinated"] for t in trajs) / n
    return (f"val  {step:>4}  reward {sum(t.reward for t in trajs) / n:+.3f}  accuracy {right:.0%}  hallucination "
            f"{hallucinated:.0%}  valid calls {extra['valid_tool_call_rate']:.0%}  ({len(trajs)} questions, greedy)")


def say_whether_it_can_learn(cfg: TrainConfig, health, reward_mode: str, warm_start_pending: bool):
    """Print what a step's groups offer GRPO and the verdict; returns the verdict."""
    # here, not at the top: step_health imports ART (torch, seconds); only train needs it
    from email_agent.training import step_health

    verdict = step_health.diagnose(health, reward_mode=reward_mode, sft_from=cfg.sft_from,
                                 warm_start_pending=warm_start_pending)
    space = runs.free_space_warning(run_dir(cfg))
    print("\n".join(step_health.report(health, verdict, cfg.groups_per_step, cfg.rollouts_per_group, cfg.concurrency)
                    + ([f"  warning: {space}"] if space else [])), flush=True)
    return verdict


async def train(cfg: TrainConfig) -> None:
    # ART, torch and the training modules load here, not at the top: the other subcommands need none of them
    import art

    from email_agent.training import run_plan, step_health, training_data

    plan = await run_plan.resolve(cfg)  # everything that can refuse the run, before anything is saved or loads
    cfg = plan.config
    backend = backends.make_backend(plan.backend, cfg)  # fails here, before anything is saved, if it cannot run
    new_run = not run_dir(cfg).exists()
    runs.start(run_dir(cfg), saved_config(cfg, plan.backend), fresh=cfg.fresh, preflight=cfg.preflight)
    model = plan.trainable_model()
    print("\n".join(plan.opening_lines()), file=sys.stderr)
    try:
        await model.register(backend)
        policy = plan.policy(model)
        steps = run_plan.Steps(plan, policy)
        tokenizer = backends.tokenizer(plan.backend, backend, cfg.base_model)  # None: a remote backend renders
        arguments = training_data.argument_form(tokenizer.chat_template if tokenizer else None)
        state = await runs.check_state(run_dir(cfg), plan.state, model)  # may reopen a warm start (deleted checkpoints)
        warm_start_pending = bool(cfg.sft_from) and not state.get("sft_done")
        # RL steps are counted after the warm start's checkpoints, so a resumed run finds its place in the data
        # (a warm start still to finish, even half done, comes before any RL step).
        sft_steps = state.get("sft_steps", 0)
        rl_step = 0 if warm_start_pending else await model.get_step() - sft_steps
        batches = art.utils.iterate_dataset(plan.rl_questions, groups_per_step=cfg.groups_per_step,
                                            num_epochs=cfg.num_epochs, initial_step=rl_step, use_tqdm=False)
        if cfg.preflight:  # the next step's groups from the policy as it is now: nothing trained, logged or saved
            return await preflight(plan, steps, next(iter(batches), None), sft_steps, warm_start_pending)
        if warm_start_pending:
            sft_steps = await warm_start(plan, model, policy, arguments)
        if cfg.sft_only:
            return
        if plan.backend == "cpu":
            await say_what_a_cpu_step_costs(plan, policy, backend.max_batch_size)
        warnings = step_health.Warnings(cfg.temperature)
        for batch in batches:
            if cfg.max_steps and batch.step >= cfg.max_steps:
                break
            step = batch.step + sft_steps
            if batch.step % cfg.eval_every == 0 and plan.val_questions and not (batch.step == 0 and sft_steps):
                print(await validate(model, policy, plan.val_questions, plan.db, plan.episode, step))
            started = time.perf_counter()
            groups = await steps.settle(await steps.gather(batch.items, step), step)  # a judge that is down: waited for
            health = step_health.measure(groups, time.perf_counter() - started, cfg.min_reward_std)
            if batch.step == 0:  # a fresh run says at once whether it can learn
                verdict = say_whether_it_can_learn(cfg, health, plan.episode.reward, False)
                if verdict.cannot_learn and not cfg.train_anyway:  # not hours of steps that learn nothing
                    raise DataError(f"{verdict.headline.rstrip('.')}; stopped before its first update, with the run "
                                    f"kept (rerun with the fix to go on from here, or add --train-anyway to train "
                                    f"regardless).")
                print(f"{'' if verdict.ok else 'warning: '}{verdict.headline}", flush=True)
            # ---- ALGO LOGIC: the GRPO update, on exactly the tokens the policy was served and sampled, of the
            # groups whose rewards differ by more than judge noise ----
            trained = training_data.for_grpo(groups, arguments, cfg.min_reward_std, tokenizer)
            result = await backend.train(model, trained, learning_rate=cfg.learning_rate,
                                         advantage_balance=cfg.advantage_balance, scale_rewards=cfg.scale_rewards)
            learned = step_health.step_metrics(health, groups, result.metrics, cfg.max_seq_length)
            await model.log(groups, split="train", metrics={**result.metrics, **learned}, step=result.step)
            policy.model = model.get_inference_name()  # serve the new checkpoint from the next rollout on
            print(step_health.step_line(result.step, groups, result.metrics, learned, time.perf_counter() - started),
                  flush=True)
            for warning in warnings.after_step(health, learned):
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        step = await model.get_step()
        if plan.val_questions:
            print(await validate(model, policy, plan.val_questions, plan.db, plan.episode, step))
        if cfg.keep_checkpoints == "best":
            await backends.keep_latest_and_best(model, backend, step, also=(sft_steps,) if sft_steps else ())
        print(f"done: {run_dir(cfg)} (step {step}); evaluate with "
              f"python test_email_search_agent.py --model {cfg.name}" + (" --demo" if cfg.demo else ""))
    finally:
        await backend.close()
        if cfg.preflight and new_run:  # registering wrote a first checkpoint; a preflight leaves no run behind
            shutil.rmtree(run_dir(cfg), ignore_errors=True)


async def preflight(plan, steps, batch, sft_steps: int, warm_start_pending: bool) -> None:
    """--preflight: one step's groups gathered and judged, the verdict printed; DataError if GRPO cannot learn."""
    # here, not at the top: step_health imports ART (torch, seconds); only train needs it
    from email_agent.training import step_health

    if batch is None:
        raise DataError(f"--preflight: run {plan.config.name!r} has no steps left to check (its epochs are done).")
    step = batch.step + sft_steps
    started = time.perf_counter()
    groups = await steps.settle(await steps.gather(batch.items, step), step)
    health = step_health.measure(groups, time.perf_counter() - started, plan.config.min_reward_std)
    verdict = say_whether_it_can_learn(plan.config, health, plan.episode.reward, warm_start_pending)
    if not verdict.ok:
        raise DataError(verdict.headline)
    print(f"preflight: {verdict.headline}")


async def warm_start(plan, model, policy, arguments) -> int:
    """The warm start (SFT on the expert's or a teacher's episodes), then a validation; returns its last step."""
    # here, not at the top: both import ART (torch, seconds); only train needs them
    from email_agent.training import training_data, warm_start as sft

    cfg = plan.config
    episodes = plan.sft_episodes or await sft.warm_start_episodes(cfg, plan.db, plan.train_questions,
                                                                  plan.val_questions, plan.episode)
    await sft.warm_start(cfg, model, training_data.for_sft(episodes, arguments), say=cli.say)
    state = model.merge_state({"sft_done": True, "sft_steps": await model.get_step()})
    policy.model = model.get_inference_name()
    if plan.val_questions:
        print(await validate(model, policy, plan.val_questions, plan.db, plan.episode, await model.get_step()))
    return state["sft_steps"]


async def say_what_a_cpu_step_costs(plan, policy, max_batch_size: int) -> None:
    """GPU-scale steps on a CPU: one rollout timed, and what a step of them will cost, said before the first."""
    # here, not at the top: step_health imports ART (torch, seconds); only train needs it
    from email_agent.training import step_health

    cfg = plan.config
    rollouts = cfg.groups_per_step * cfg.rollouts_per_group
    preset_rollouts = DEMO_PRESET["groups_per_step"] * DEMO_PRESET["rollouts_per_group"]
    if rollouts > preset_rollouts:
        started = time.perf_counter()
        await plan.rollout(policy, plan.rl_questions[0], plan.db, plan.episode)
        print(step_health.cpu_step_note(time.perf_counter() - started, rollouts, min(cfg.concurrency, max_batch_size),
                                        preset_rollouts), file=sys.stderr, flush=True)


def train_command(args) -> None:
    cfg = config_from_args(args)
    check(cfg)  # before the run's lock file is made
    check_warm_start(cfg)  # and before ART loads: seconds
    runs.check_name("--name", cfg.name)
    runs.check_name("--project", cfg.project)
    if preset := cpu_preset(args):
        print("CPU backend: the CPU preset's episode shape and batch ("
              + " ".join(f"--{key.replace('_', '-')} {value}" for key, value in preset.items())
              + "); give these flags to change them", file=sys.stderr)
    with runs.lock(cfg.art_dir, cfg.project, cfg.name):
        cli.run_cancellable(train(cfg))


# ---- command line --------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    console = cli.console_flags()

    def command(name: str, func, parents: list, **texts: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=parents, **texts)
        p.set_defaults(func=func)
        return p

    p = command("build-db", build_db, [console], help="build the search database and question sets",
                description="Build the SQLite/FTS5 email database (and its questions) atomically. "
                            "Example: python train_email_search_agent.py build-db --demo")
    build.add_arguments(p, DEFAULT_DB, DEMO_DB)

    p = command("generate-questions", generate_questions, [console],
                help="write a question set for an inbox with an LLM",
                description="Ask an LLM to write question/answer pairs from batches of one inbox's emails "
                            "(as ART·E made its questions), validate each against the database, split them "
                            "into train/test with no shared email, and store them in the database. Re-running "
                            "reuses cached replies and adds only new questions. Key: QUESTIONS_API_KEY, or the "
                            "provider's usual variable (OPENAI_API_KEY...). Example: python "
                            "train_email_search_agent.py generate-questions --db data/me.db --model "
                            "openai/gpt-4.1 --inbox me@example.com --max-questions 500")
    generate.add_arguments(p, DEFAULT_DB)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=DEFAULT_DB, metavar="PATH", help=f"database (default {DEFAULT_DB})")
    common.add_argument("--as-of", metavar="DATE", help="hide mail dated after DATE, as the agent does for a question "
                                                       "asked that day")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("search", search, [common, console], help="search an inbox as the agent does",
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

    p = command("read", read, [common, console], help="read one email as the agent does",
                description="Print one email with its recipients. Example: python train_email_search_agent.py "
                            "read --db data/demo.db '<demo.000001@larkspur.example>'")
    p.add_argument("message_id", metavar="MESSAGE_ID")
    p.add_argument("--inbox", metavar="ADDRESS", help="only if ADDRESS sent or received it")

    p = command("ask", ask_command, [console], help="ask a trained agent a question about an inbox",
                description="One question to a trained agent (or any model), played by the rollout of training "
                            "and evaluation, each tool call shown as it happens; nothing is graded. Example: "
                            "python train_email_search_agent.py ask --db data/demo.db --inbox "
                            "priya.natarajan@larkspur.example 'Where is the Egret kickoff being held?'")
    ask.add_arguments(p, DEFAULT_DB)

    p = command("serve", serve_command, [console], help="serve a trained agent to assistants over MCP",
                description="An MCP server (stdio, or streamable HTTP with --http) with three tools: "
                            "ask_inbox (the trained agent answers, as `ask` does), search_inbox and read_email "
                            "(its own tools). The model is served once and shared by all requests. Example: "
                            "python train_email_search_agent.py serve --db data/demo.db --inbox "
                            "priya.natarajan@larkspur.example")
    serve.add_arguments(p, DEFAULT_DB)

    p = command("export", export_command, [console],
                help="write a trained checkpoint for vLLM, transformers or llama.cpp",
                description="Write one checkpoint of a run as a PEFT LoRA folder (lora), the base model with the "
                            "LoRA merged, with its tokenizer and chat template (merged), or a float32 GGUF "
                            "for llama.cpp (gguf: CPU runs on SmolLM2), with a README.md on loading and "
                            "prompting it. Example: python train_email_search_agent.py export --model demo@4 "
                            "--format merged --output export/demo-merged")
    export.add_arguments(p)

    p = command("train", train_command, [console], help="train the agent with GRPO (resumes a run of the same name)",
                description="GRPO on the train split with rollouts from the agent environment. "
                            "Example: python train_email_search_agent.py train --demo")
    cli.add_dataclass_flags(p, TrainConfig)  # one flag per field; its comment is the help text
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.console(args.quiet, args.verbose)
    resume = {"train": "; re-run the same command to resume from the last checkpoint",
              "generate-questions": "; nothing was stored: re-run to go on (answered batches are cached)"}
    return cli.run_command(lambda: args.func(args), argv, interrupted="interrupted" + resume.get(args.command, ""),
                           run_folder=lambda: run_dir(config_from_args(args)) if args.command == "train" else None)


if __name__ == "__main__":
    sys.exit(main())
