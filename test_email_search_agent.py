"""Evaluate email search agents: trained checkpoints, base models and prompted models, side by side.

    python test_email_search_agent.py --demo --model base --model demo            # CPU, offline
    python test_email_search_agent.py --model openai/o4-mini --model my-run@latest --limit 100
    python test_email_search_agent.py --rejudge eval/20261123-101500 --judge-model openai/gpt-4.1

Every model plays the same rollout (email_agent.rollout) over the same questions. The output folder holds
results.jsonl (one line per question x model, enough to re-judge without re-running), summary.json and a
self-contained report.html / report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import email_agent  # noqa: F401  (offline environment defaults before litellm/ART load)
from email_agent import cli, report, rewards
from email_agent.data import DataError, EmailDB
from email_agent.questions import Question, id_sort_key, select_questions
from email_agent.rollout import Policy, RolloutConfig, rollout

ART_DIR = ".art"
PROJECT = "email-agent"


@dataclass
class Contestant:
    label: str
    policy: Policy
    price_model: str | None = None  # litellm name to price tokens with
    history: Path | None = None  # a trained run's history.jsonl, for the learning curve


# ----------------------------------------------------------------------------------------------
# Which models: run checkpoints, the base model, prompted models
# ----------------------------------------------------------------------------------------------

def run_dir(name: str, art_dir: str) -> Path | None:
    path = Path(name)
    if (path / "checkpoints").is_dir():
        return path
    path = Path(art_dir) / PROJECT / "models" / name
    return path if (path / "checkpoints").is_dir() else None


def checkpoint_dir(run: Path, step: str) -> Path:
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    if not steps:
        raise DataError(f"{run} has no checkpoints yet.")
    if step in ("", "latest"):
        return run / "checkpoints" / f"{steps[-1]:04d}"
    if not step.isdigit() or int(step) not in steps:
        raise DataError(f"{run} has no checkpoint {step!r}; it has {', '.join(map(str, steps))} (or use @latest).")
    return run / "checkpoints" / f"{int(step):04d}"


async def open_contestant(spec: str, args, stack: contextlib.AsyncExitStack) -> Contestant:
    """A --model value -> a Contestant with a ready Policy (servers it starts are closed by `stack`)."""
    from openai import AsyncOpenAI

    name, _, step = spec.partition("@")
    common = dict(max_tokens=args.max_tokens, max_concurrency=args.concurrency, temperature=args.temperature)
    run = run_dir(name, args.art_dir)
    if run is not None or name == "base":
        from email_agent.backends.cpu import serve_checkpoint

        if run is not None:
            config = json.loads((run / "run_config.json").read_text())
            ckpt, base_model = checkpoint_dir(run, step), config["base_model"]
            label, history = f"{run.name}@{int(ckpt.name)}", run / "history.jsonl"
        else:
            ckpt, base_model, label, history = None, args.base_model, f"base:{Path(args.base_model).name}", None
        base_url = await stack.enter_async_context(
            serve_checkpoint(base_model, ckpt, label, seed=args.seed, max_batch_size=args.concurrency))
        client = AsyncOpenAI(base_url=base_url, api_key="local", timeout=args.timeout, max_retries=2)
        return Contestant(label, Policy(client, label, **common), None, history)

    provider, _, model = name.partition("/")
    if not model:
        raise DataError(f"--model {spec!r} is neither a run under {args.art_dir}/{PROJECT}/models, 'base', nor a "
                        f"provider/model name such as openai/o4-mini or hosted_vllm/<name> (with --base-url).")
    base_url = args.base_url or (os.environ.get("OPENAI_BASE_URL") if provider == "openai" else None)
    if provider != "openai" and not base_url:
        raise DataError(f"--model {spec}: give --base-url of an OpenAI-compatible server (vLLM, a litellm proxy...).")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY" if provider == "openai" else "POLICY_API_KEY")
    if provider == "openai" and not (api_key or args.base_url):
        raise DataError(f"--model {spec}: set OPENAI_API_KEY (or pass --api-key).")
    served = model if provider in ("openai", "hosted_vllm") else name
    reasoning = provider == "openai" and model.startswith(("o1", "o3", "o4", "gpt-5"))
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=args.timeout, max_retries=3)
    policy = Policy(client, served, logprobs=False, tool_choice="required",
                    **{**common, "temperature": None if reasoning else args.temperature})
    return Contestant(spec, policy, price_model=name)


def cost_usd(price_model: str | None, prompt_tokens: int, completion_tokens: int) -> float | None:
    if price_model is None:
        return None
    import litellm

    try:
        prompt_cost, completion_cost = litellm.cost_per_token(model=price_model, prompt_tokens=prompt_tokens,
                                                              completion_tokens=completion_tokens)
    except Exception:  # litellm raises for models it has no price for
        return None
    return prompt_cost + completion_cost


# ----------------------------------------------------------------------------------------------
# Records: one per question x model
# ----------------------------------------------------------------------------------------------

def make_record(label: str, question: Question, traj, config: RolloutConfig, price_model: str | None) -> dict:
    m, meta = traj.metrics, traj.metadata
    verdict = None
    if meta.get("answer") is not None:
        verdict = {"correct": bool(m["answer_correct"]), "judge": meta.get("verdict_judge"),
                   "reasoning": meta.get("verdict_reasoning"), "error": meta.get("verdict_error")}
    return {"model": label, "question_id": question.id, "question": question.question,
            "gold_answer": question.answer, "gold_message_ids": question.message_ids, "inbox": question.inbox_address,
            "query_date": question.query_date, "answer": meta.get("answer"), "sources": json.loads(meta["sources"]),
            "reward": traj.reward, "reward_mode": config.reward, "max_turns": config.max_turns, "verdict": verdict,
            "metrics": dict(m), "cost_usd": cost_usd(price_model, m["prompt_tokens"], m["completion_tokens"]),
            "error": meta.get("error"), "messages": traj.messages()}


async def rejudge_record(record: dict, config: RolloutConfig) -> dict:
    """Re-score a stored record with another judge: the answer stays, the verdict and reward change."""
    from email_agent.rewards import Rubric
    from email_agent.rollout import grade

    fields = Rubric.__dataclass_fields__
    rubric = Rubric(**{k: v for k, v in record["metrics"].items() if k in fields})
    rubric.answer_correct = rubric.hallucinated = rubric.judge_error = rubric.attempted_answer = 0
    rubric.returned_i_dont_know = rubric.sources_correct = 0
    question = Question(record["question_id"], record["question"], record["gold_answer"], record["gold_message_ids"],
                        None, record["inbox"], record["query_date"], "")
    verdict = await grade(rubric, question, record["answer"], record["sources"], config)
    max_turns = record.get("max_turns", config.max_turns)
    new = dict(record, metrics={**record["metrics"], **{k: getattr(rubric, k) for k in fields}},
               reward=rewards.reward(config.reward, rubric, max_turns, len(record["sources"])),
               reward_mode=config.reward)
    new["verdict"] = None if verdict is None else {"correct": verdict.correct, "judge": verdict.judge,
                                                   "reasoning": verdict.reasoning, "error": verdict.error}
    return new


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def reward_config(args) -> RolloutConfig:
    mode, judge = rewards.configure(args.reward, args.judge_model, args.judge_base_url, args.art_dir)
    if mode == "ruler":  # RULER ranks groups during training; an evaluation grades each answer on its own
        mode = "shaped" if judge else "offline"
    return RolloutConfig(max_turns=args.max_turns, max_body_chars=args.max_body_chars,
                         search_results=args.search_results, reward=mode, judge=judge)


async def evaluate(args) -> int:
    from tqdm import tqdm

    config = reward_config(args)
    out = Path(args.output or f"eval/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.rejudge:
        stored = [json.loads(line) for line in (Path(args.rejudge) / "results.jsonl").read_text().splitlines() if line]
        records = [await rejudge_record(r, config) for r in tqdm(stored, desc="re-judging", unit=" answers")]
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return finish(out, records, {}, args)

    db = EmailDB(args.db)
    questions = select_questions(db, args.split, single_source=args.single_source, seed=args.seed, limit=args.limit)
    if not questions:
        raise DataError(f"No answerable {args.split!r} questions in {args.db}; write some with "
                        f"`python train_email_search_agent.py generate-questions --db {args.db} --model MODEL`.")
    records, histories = [], {}
    async with contextlib.AsyncExitStack() as stack:
        contestants = [await open_contestant(spec, args, stack) for spec in args.model]
        histories = {c.label: report.load_history(c.history) for c in contestants if c.history and c.history.exists()}
        print(f"evaluating {', '.join(c.label for c in contestants)} on {len(questions)} {args.split} questions "
              f"-> {out}", file=sys.stderr)
        correct: dict[str, list[int]] = {c.label: [0, 0] for c in contestants}
        bar = tqdm(total=len(questions) * len(contestants), unit=" rollouts", desc="evaluating")

        async def one(contestant: Contestant, question: Question):
            traj = await rollout(contestant.policy, question, db, config)
            return make_record(contestant.label, question, traj, config, contestant.price_model)

        tasks = [asyncio.ensure_future(one(c, q)) for c in contestants for q in questions]
        with open(out / "results.jsonl", "w") as results_file:
            try:
                for finished in asyncio.as_completed(tasks):
                    record = await finished
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
                print(f"\ninterrupted: writing the {len(records)} finished rollouts", file=sys.stderr)
                finish(out, records, histories, args)
                return 130
            finally:
                bar.close()
    return finish(out, records, histories, args)


def finish(out: Path, records: list[dict], histories: dict, args) -> int:
    order = {spec: i for i, spec in enumerate(args.model or [])}
    records.sort(key=lambda r: (order.get(r["model"], 0), id_sort_key(r["question_id"])))
    summary = report.summarize(records)
    paths = report.write_report(out, records, summary, histories=histories or None)
    for label, s in summary["models"].items():
        acc = "n/a" if s["accuracy"] is None else f"{s['accuracy']:.1%}"
        print(f"{label:>32}  accuracy {acc}  hallucination {fmt(s['hallucination_rate'])}  "
              f"turns {fmt(s['avg_turns'], '.1f')}  n={s['n']}")
    print(f"report: {paths['html']}")
    return 0


def fmt(value, spec=".1%"):
    return "n/a" if value is None else format(value, spec)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="SPEC",
                   help="a trained run (NAME[@STEP|@latest] under --art-dir, or its folder), 'base' (the untrained "
                        "--base-model on CPU), or a prompted model: openai/o4-mini, hosted_vllm/NAME with --base-url, "
                        "any provider/model behind an OpenAI-compatible --base-url. Repeat to compare.")
    p.add_argument("--demo", action="store_true", help="use the demo database data/demo.db")
    p.add_argument("--db", help="database (default data/enron_emails.db; with --demo data/demo.db)")
    p.add_argument("--split", default="test", help="question split (default test)")
    p.add_argument("--limit", type=int, help="evaluate the first N questions (after the seeded shuffle)")
    p.add_argument("--single-source", action="store_true", help="only questions with one gold email")
    p.add_argument("--seed", type=int, default=0, help="question order and sampling seed (default 0)")
    p.add_argument("--concurrency", type=int, default=8, help="simultaneous rollouts per model, and the CPU server's decoding batch (default 8)")
    p.add_argument("--max-turns", type=int, default=10, help="agent turns per question (default 10)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per model reply (default 1024)")
    p.add_argument("--max-body-chars", type=int, default=4000, help="read_email cuts longer bodies (default 4000)")
    p.add_argument("--search-results", type=int, default=10, help="results per search when the model does not "
                                                                   "ask for a number (default 10)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0; omitted for "
                                                                  "OpenAI reasoning models)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model request (default 300)")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for prompted models (vLLM, litellm proxy, ...)")
    p.add_argument("--api-key", help="key for --base-url (default: OPENAI_API_KEY for openai/, else POLICY_API_KEY)")
    p.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="the model behind --model base (default SmolLM2-135M-Instruct, bundled for CPU)")
    p.add_argument("--reward", choices=rewards.REWARD_MODES,
                   help="scoring: shaped (default with a judge), offline (default without), judge (binary)")
    p.add_argument("--judge-model", help="litellm model name of the LLM judge (or JUDGE_MODEL)")
    p.add_argument("--judge-base-url", help="api_base for the judge, e.g. http://localhost:6688 (or JUDGE_API_BASE; "
                                            "key from JUDGE_API_KEY)")
    p.add_argument("--rejudge", metavar="DIR", help="re-score DIR/results.jsonl with the judge flags; no model runs")
    p.add_argument("--output", metavar="DIR", help="output folder (default eval/<timestamp>)")
    p.add_argument("--art-dir", default=ART_DIR, help="where training runs live (default .art)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.log_to_stderr()
    args.db = args.db or ("data/demo.db" if args.demo else "data/enron_emails.db")
    if not args.model and not args.rejudge:
        print("Error: give at least one --model (or --rejudge DIR).", file=sys.stderr)
        return 2
    try:
        return asyncio.run(evaluate(args))
    except DataError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
