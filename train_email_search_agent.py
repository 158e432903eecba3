"""Train an email search agent with reinforcement learning (the ART·E recipe).

    python train_email_search_agent.py build-db --demo          # the bundled demo inbox (offline)
    python train_email_search_agent.py build-db                 # the Enron corpus + ART·E questions from Hugging Face
    python train_email_search_agent.py search --inbox ADDRESS KEYWORD...   # the agent's search tool, for humans
    python train_email_search_agent.py read MESSAGE_ID          # the agent's read tool, for humans
    python train_email_search_agent.py generate-questions --db my.db --model openai/gpt-4.1   # questions for your inbox
    python train_email_search_agent.py train --demo             # GRPO on the demo inbox, CPU, offline
    python train_email_search_agent.py train --name qwen7b      # GRPO on Enron; GPU (ART LocalBackend) if present
    python train_email_search_agent.py ask "QUESTION" --inbox ADDRESS   # one question to the latest trained agent

Subcommands stay thin: each parses its flags, calls one function of the `email_agent` package and prints;
`train` shows the whole loop: pick questions, gather groups of rollouts, train, log, validate, checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import signal
import sqlite3
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import email_agent  # noqa: F401  (sets offline-friendly environment defaults before litellm/ART load)
from email_agent import cli, runs
from email_agent.backends import ART_DIR, PROJECT, run_path
from email_agent.data import DataError, EmailDB, check_day, visible_until
from email_agent.episode import EpisodeShape

DEFAULT_DB = "data/enron_emails.db"
DEMO_DB = "data/demo.db"


# ---- build-db ------------------------------------------------------------------------------------

def build_db(args) -> None:
    from email_agent import build

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
    from email_agent.generate import GenerateConfig, cache_path, generate_questions

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
    if not results:
        print("no matches")
    for i, r in enumerate(results, 1):
        print(f"{i:>2}. {r.date}  {r.from_address}  {r.subject}")
        print(f"    {r.message_id}")
        print(textwrap.indent(textwrap.fill(" ".join(r.snippet.split()), 100), "    "))


def read(args) -> None:
    db = EmailDB(args.db)
    if args.inbox is not None:
        db.require_inbox(args.inbox)
    email = db.read(args.message_id, inbox=args.inbox, visible_until=visible_until(args.as_of))
    if email is None:
        if db.read(args.message_id) is None:
            hint = "" if args.message_id.startswith("<") else f" (ids are written with angle brackets: '<{args.message_id}>')"
            raise DataError(f"No email with message_id {args.message_id!r}{hint}.")
        hidden = [f"--inbox {args.inbox}" if args.inbox else "", f"--as-of {args.as_of}" if args.as_of else ""]
        raise DataError(f"Email {args.message_id!r} exists, but {' '.join(filter(None, hidden))} hides it (not that "
                        "inbox's, or sent after that day).")
    if args.json:
        print(json.dumps(asdict(email), indent=2, ensure_ascii=False))
        return
    print(f"Message-ID: {email.message_id}\nDate: {email.date} UTC\nFrom: {email.from_address}")
    for label, addresses in (("To", email.to_addresses), ("Cc", email.cc_addresses), ("Bcc", email.bcc_addresses)):
        if addresses:
            print(f"{label}: {', '.join(addresses)}")
    print(f"Subject: {email.subject}\n\n{email.body}")


# ---- ask: one question to a trained agent, each tool call shown as it happens --------------------

def ask(args) -> None:
    from email_agent import ask, evaluation

    for flag in ("max_turns", "max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise DataError(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    spec, db = ask.model_and_db(args.model, args.db, args.art_dir, DEFAULT_DB)
    question = ask.adhoc_question(db, args.question, args.inbox, args.as_of)
    options = evaluation.Options(art_dir=args.art_dir, base_url=args.base_url, api_key=args.api_key, concurrency=1,
                                 shape={"max_turns": args.max_turns, "max_tokens": args.max_tokens})
    live = {} if args.json else dict(
        on_call=lambda *call: print(ask.describe_call(*call), flush=True),
        on_start=lambda label, shape: print(f"{label} ({shape}) asks {question.inbox_address}'s inbox as of "
                                            f"{question.query_date}:", file=sys.stderr))
    result = asyncio.run(ask.ask(spec, question, db, options, grounded_answers=args.grounded_answers, **live))
    if args.json:
        print(json.dumps(result.to_json(), indent=2, ensure_ascii=False))
    elif result.answer is None:
        print(f"no answer after {result.turns} turns (raise --max-turns, or try another model)")
    else:
        print(f"\nanswer: {result.answer}")
        if result.withheld:
            print(f"  (withheld {result.withheld['answer']!r}: {', '.join(result.withheld['unseen'])} in no email or "
                  f"search result it saw)")
        for mid, email in result.cited:
            print(f"  {email.date}  {email.from_address}  {email.subject}  {mid}" if email else
                  f"  {mid}  (not an email in this inbox: the model made it up)")


# ---- train: the configuration, then the loop -----------------------------------------------------

@dataclass
class TrainConfig:
    # run
    name: str = "agent"  # run name: checkpoints and logs go to <art-dir>/<project>/models/<name>
    project: str = PROJECT  # ART project (also the W&B project)
    art_dir: str = ART_DIR  # where runs live
    fresh: bool = False  # delete an existing run of this name and start over (otherwise it resumes)
    preflight: bool = False  # gather one step's groups, say whether GRPO can learn from them, exit 1 if not; no training
    seed: int = 0  # one seed for question order, sampling and LoRA init
    backend: str = "auto"  # cpu | local (GPU) | serverless | tinker; auto: local with CUDA, else cpu
    base_model: str = ""  # default: Qwen/Qwen2.5-7B-Instruct on GPU, SmolLM2-135M-Instruct on CPU (or a local dir)
    # data
    demo: bool = False  # the bundled demo inbox (builds data/demo.db if missing) with the small CPU preset
    db: str = DEFAULT_DB  # database from build-db
    train_limit: int = 0  # use only the first N training questions (0: all)
    val_size: int = 100  # validation questions, held out of the *train* split (the test split stays unseen)
    single_source: bool = True  # only questions answered by one email (as ART·E trains)
    min_realistic: float = 0.0  # only questions with how_realistic >= this
    unanswerable_share: float = 0.0  # share of GRPO questions asked the day before their gold email (best reply: I don't know)
    # ---- ALGO LOGIC: GRPO hyperparameters (ART·E agent_008 on GPU) ----
    groups_per_step: int = 12  # questions per step
    rollouts_per_group: int = 4  # rollouts per question; GRPO compares them
    num_epochs: int = 3  # passes over the training questions
    max_steps: int = 0  # stop after this many RL steps in total (0: run all epochs)
    learning_rate: float = 1.2e-5
    advantage_balance: float = 0.0  # ART's knob, -1..1: >0 scales negative advantages by (1 - x) (0: balanced)
    scale_rewards: bool = True  # divide each group's advantages by its reward std (ART's default); off: Dr. GRPO
    max_turns: int = EpisodeShape.max_turns  # agent turns per question
    max_tokens: int = EpisodeShape.max_tokens  # tokens per model reply
    max_body_chars: int = EpisodeShape.max_body_chars  # read_email cuts longer bodies
    search_results: int = EpisodeShape.search_results  # results per search when the model does not ask for a number
    temperature: float = 1.0  # rollout sampling temperature
    eval_every: int = 30  # validate every N steps (and at the end)
    keep_checkpoints: str = "best"  # best: keep the latest and the best (val/reward) checkpoint; all: keep every one
    # rewards
    reward: str = ""  # offline | shaped | judge | ruler; default: shaped with a judge, offline without
    judge_model: str = ""  # litellm model name of the judge (or JUDGE_MODEL)
    judge_base_url: str = ""  # api_base for the judge, e.g. http://localhost:6688 (or JUDGE_API_BASE)
    ruler_model: str = ""  # judge for --reward ruler (default: the judge model)
    hallucination_penalty: float = 1.0  # what a wrong answer costs (offline/shaped); higher: answers only when surer
    judge_patience: float = 600.0  # seconds a step waits for a failing judge (5xx, 429, timeouts) before the run stops
    min_reward_std: float = 0.01  # a group whose rewards spread less (std) is judge noise: not trained on
    # warm start (supervised, before RL)
    sft_from: str = ""  # demo-expert, or an evaluation folder of a teacher model (its judged-correct episodes)
    sft_only: bool = False  # stop after the warm start
    sft_limit: int = 0  # use at most N warm-start trajectories (0: all)
    sft_epochs: int = 1  # passes over the warm-start trajectories (one checkpoint each)
    sft_learning_rate: float = 1e-4  # peak; the CPU preset uses 1e-3: a 135M model's LoRA barely moves at 1e-4
    sft_batch_size: int = 8  # trajectories per optimiser step
    sft_schedule: str = "linear"  # rate over all warm-start batches: linear/cosine to 0 after 10% warm-up, or constant
    # GPU (local backend) memory settings and LoRA shape
    lora_rank: int = 8
    lora_alpha: int = 16
    gpu_memory_utilization: float = 0.8  # vLLM's share of the GPU; 0.6-0.7 when a 7B run shares a 24 GB card
    max_seq_length: int = 8192  # trainer and vLLM context
    enforce_eager: bool = False  # skip CUDA-graph capture (saves memory on 24 GB cards)
    max_num_seqs: int = 64  # concurrent sequences in vLLM
    concurrency: int = 32  # simultaneous rollouts
    cpu_train_threads: int = 0  # torch threads for CPU training (0: all cores; 1 if other jobs share the machine)
    wandb: bool = False  # log to W&B too (needs WANDB_API_KEY; WANDB_MODE=offline works)


# The small CPU preset `--demo` applies (flags given explicitly still win): minutes per step on 2 cores.
# The warm start does the learning here: one epoch over every episode of the demo expert (~200, a quarter of them
# abstentions) at a constant 1e-3 (the first 170 only, tried to save 2 minutes, warm-started to 34% right and the
# six steps then taught "I don't know" to 45 of 50 test questions: bench/RESULTS.md). Six small GRPO steps then
# teach it when to abstain: with ART's std-scaled advantages a group with no right answer still pushes "I don't
# know" over a wrong one (on 50 test questions: hallucination 36% after the warm start, 14-26% after the six
# steps; 38-48% right). A stronger warm start (rising to 2e-3, then linearly to 0) made the same six steps
# over-teach abstention (72% "I don't know").
# bench/bench_learning.py, with more steps and --no-scale-rewards, is where RL adds right answers instead.
# Every run of this preset and of the changes tried on it: bench/RESULTS.md.
DEMO_PRESET = dict(db=DEMO_DB, name="demo", sft_from="demo-expert", sft_limit=0, sft_epochs=1, sft_batch_size=4,
                   sft_learning_rate=1e-3, sft_schedule="constant", groups_per_step=2, rollouts_per_group=4,
                   num_epochs=1, max_steps=6, learning_rate=1e-4, advantage_balance=0.5, temperature=0.7, max_turns=4,
                   max_tokens=64, max_body_chars=600, search_results=3, eval_every=3, val_size=8, concurrency=8)


def run_dir(cfg: TrainConfig) -> Path:
    return run_path(cfg.art_dir, cfg.project, cfg.name)


def saved_config(cfg: TrainConfig, backend: str) -> dict:
    """What run_config.json holds. The backend and episode shape are read back by evaluation and `ask`: a run
    is served where it was trained and plays the episodes it learned on."""
    return {**asdict(cfg), "db": str(Path(cfg.db).resolve()),  # found from any folder the run is evaluated in
            "backend": backend, "episode": asdict(EpisodeShape.from_run_config(asdict(cfg)))}


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None  # ART 0.5.18's model.log imports it for W&B metrics


async def validate(model, policy, questions, db, rollout_config, step: int) -> dict:
    import art

    from email_agent.rewards import valid_tool_call_rate
    from email_agent.rollout import rollout

    greedy = replace(policy, temperature=0.0)  # as the evaluation does: less noise per question
    # One-episode groups because only gather_trajectory_groups takes max_metrics: gather_trajectories' bar
    # shows every metric (~20), a line that wraps and floods the terminal at each refresh.
    groups = await art.gather_trajectory_groups((art.TrajectoryGroup([rollout(greedy, q, db, rollout_config)])
                                                 for q in questions),
                                                pbar_desc="validate", max_exceptions=len(questions), max_metrics=4)
    trajs = [t for g in groups for t in g.trajectories]
    extra = {"valid_tool_call_rate": valid_tool_call_rate(t.metrics for t in trajs) or 0.0}
    await model.log(trajs, split="val", metrics=extra, step=step)
    return {"reward": sum(t.reward for t in trajs) / max(len(trajs), 1),
            "accuracy": sum(t.metrics["answer_correct"] for t in trajs) / max(len(trajs), 1), **extra}


async def warm_start_episodes(cfg: TrainConfig, db, train_questions, val_questions, rollout_config) -> list:
    """The trajectories the warm start imitates: the demo expert's on the train questions, or a teacher's
    judged-correct ones (none of the validation questions: the curve would score what it imitated)."""
    from email_agent.sft import sft_source

    trajectories = await sft_source(cfg.sft_from, db, train_questions, rollout_config, held_out=val_questions)
    if cfg.sft_limit:
        trajectories = trajectories[:cfg.sft_limit]
    if not trajectories:
        raise DataError(f"--sft-from {cfg.sft_from}: no successful trajectories to learn from.")
    return trajectories


async def warm_start(cfg: TrainConfig, model, trajectories: list) -> None:
    """Supervised fine-tuning on successful (and abstaining) trajectories: ART's train_sft, one checkpoint per epoch.

    Resumable: the step the warm start began at is saved in the run state before the first epoch, so after an
    interruption (even kill -9) the epochs already checkpointed are skipped, not re-run on top of themselves.
    """
    import art
    from art.utils.sft import create_lr_schedule

    state = model.read_state() or {}
    if "sft_start_step" not in state:
        state = model.merge_state({"sft_start_step": await model.get_step()})
    done = await model.get_step() - state["sft_start_step"]  # epochs already checkpointed
    abstentions = sum(1 for t in trajectories if t.metrics.get("returned_i_dont_know"))
    print(f"warm start: {len(trajectories)} trajectories from {cfg.sft_from} ({abstentions} end in \"I don't know\")"
          + (f"; resuming after epoch {done}" if done else ""), file=sys.stderr)
    # One schedule over all epochs (ART's create_lr_schedule), so a resumed warm start picks up its own slice.
    batches = -(-len(trajectories) // cfg.sft_batch_size)
    rates = create_lr_schedule(batches * cfg.sft_epochs, cfg.sft_learning_rate, method=cfg.sft_schedule,
                               warmup_steps=0 if cfg.sft_schedule == "constant" else batches * cfg.sft_epochs // 10)
    for epoch in range(done, cfg.sft_epochs):
        started = time.perf_counter()
        await model.train_sft(trajectories, art.types.TrainSFTConfig(
            learning_rate=rates[epoch * batches:(epoch + 1) * batches], batch_size=cfg.sft_batch_size))
        step = await model.get_step()
        await model.log(metrics={"sft_epoch": epoch + 1}, split="train", step=step)  # marks the step in the curve
        print(f"sft  {step:>4}  epoch {epoch + 1}/{cfg.sft_epochs}  {time.perf_counter() - started:.0f}s", flush=True)


def say_whether_it_can_learn(cfg: TrainConfig, health, reward_mode: str, warm_start_pending: bool):
    """Print what a step's groups offer GRPO and the verdict; returns the verdict."""
    from email_agent import preflight

    verdict = preflight.diagnose(health, reward_mode=reward_mode, sft_from=cfg.sft_from,
                                 warm_start_pending=warm_start_pending)
    space = runs.free_space_warning(run_dir(cfg))
    print("\n".join(preflight.report(health, verdict, cfg.groups_per_step, cfg.rollouts_per_group, cfg.concurrency)
                    + ([f"  warning: {space}"] if space else [])), flush=True)
    return verdict


async def train(cfg: TrainConfig) -> None:
    import art

    from email_agent import backends, judging, preflight, rewards, training_data
    from email_agent.questions import select_questions, with_unanswerable
    from email_agent.rollout import Policy, RolloutConfig, regrade, rollout

    backend_name = backends.resolve_backend(cfg.backend)
    gpu = backends.gpu_checks.find_gpu() if backend_name == "local" else None
    cfg.base_model = cfg.base_model or backends.default_base_model(backend_name, cfg, gpu)
    if cfg.base_model == "smollm2":  # the CPU backend's short name: one run, one spelling in its config
        cfg.base_model = backends.CPU_BASE_MODEL
    if backend_name != "cpu":  # what an ART backend needs, told in seconds, before anything loads
        ready = backends.gpu_checks.readiness(backend_name, cfg, gpu)
        print("\n".join(ready.report()), file=sys.stdout if cfg.preflight else sys.stderr, flush=True)
        if not ready.ok:
            raise DataError(f"--backend {backend_name} cannot start here; missing: " + "; ".join(ready.missing))
    if cfg.demo and cfg.db == DEMO_DB and not Path(cfg.db).exists():  # elsewhere a missing --db is a typo
        build_db(argparse.Namespace(demo=True, db=cfg.db, emails=None, questions=None, quiet=True, overwrite=False))
    db = EmailDB(cfg.db)
    questions = select_questions(db, "train", single_source=cfg.single_source, min_realistic=cfg.min_realistic,
                                 seed=cfg.seed)
    val_questions, train_questions = questions[:cfg.val_size], questions[cfg.val_size:]
    if cfg.train_limit:
        train_questions = train_questions[:cfg.train_limit]
    if not train_questions:
        held_out = f"after holding out {cfg.val_size} for validation: a smaller --val-size, or " if cfg.val_size else ""
        raise DataError(f"No answerable training questions in {cfg.db} ({held_out}write some with "
                        f"`python train_email_search_agent.py generate-questions --db {cfg.db} --model MODEL`).")
    # replays of train questions asked before their answer arrived: groups where abstaining beats inventing
    rl_questions = with_unanswerable(train_questions, db, cfg.unanswerable_share, cfg.seed)
    reward_mode, judge = rewards.configure(cfg.reward or None, cfg.judge_model or None, cfg.judge_base_url or None,
                                           cfg.art_dir)
    if judge:
        await judge.probe()
    ruler_model = cfg.ruler_model or (judge.model if judge else "")
    if reward_mode == "ruler" and not ruler_model:
        raise DataError("--reward ruler needs --ruler-model or --judge-model.")
    rollout_config = RolloutConfig.for_shape(EpisodeShape.from_run_config(asdict(cfg)), reward=reward_mode, judge=judge,
                                             hallucination_penalty=cfg.hallucination_penalty)
    ruler_params = rewards.ruler_params(judge, cfg.judge_base_url)  # the judge's endpoint and key (JUDGE_API_*)
    print(f"reward: {rewards.describe(reward_mode, judge, ruler_model, ruler_params.get('api_base'))}",
          file=sys.stderr)
    if cfg.preflight and cfg.fresh and run_dir(cfg).exists():
        raise DataError(f"--preflight with --fresh would delete run {cfg.name!r}; "
                        "preflight without --fresh, or under another --name.")
    if cfg.wandb and not wandb_installed():
        raise DataError("--wandb logs through the wandb package, which is not installed here: "
                        "pip install wandb==0.25.0 (what ART's GPU extra, requirements-gpu.txt, brings).")
    if backends.hide_wandb_key(backend_name, cfg.wandb):
        print("W&B: off (no --wandb): WANDB_API_KEY is hidden from ART for this run", file=sys.stderr)
    backend = backends.make_backend(backend_name, cfg)  # fails here, before anything is saved, if it cannot run
    new_run = not run_dir(cfg).exists()
    # The run's state and the warm start's episodes are checked before the run is saved and the model loads
    # (minutes on a GPU): a damaged state or a teacher folder with nothing to learn from fails first.
    state = {}
    if not cfg.fresh:
        runs.check_resumable(run_dir(cfg), saved_config(cfg, backend_name))
        state = runs.read_state(run_dir(cfg))
    sft_episodes = (await warm_start_episodes(cfg, db, train_questions, val_questions, rollout_config)
                    if cfg.sft_from and not state.get("sft_done") and not cfg.preflight else None)
    runs.start(run_dir(cfg), saved_config(cfg, backend_name), fresh=cfg.fresh, preflight=cfg.preflight)
    if cfg.wandb:  # Weave traces of every rollout and judge call, beside ART's W&B metrics
        from email_agent.tracing import traced_rollout

        rollout = traced_rollout(cfg.project, rollout, judge)

    model = art.TrainableModel(name=cfg.name, project=cfg.project, base_model=cfg.base_model, base_path=cfg.art_dir,
                               report_metrics=["wandb"] if cfg.wandb else [],
                               _internal_config=backends.internal_config(cfg) if backend_name == "local" else None)
    unanswerable = len(rl_questions) - len(train_questions)
    print(f"training {cfg.name!r}: {cfg.base_model} on {backend_name}, {len(train_questions)} train "
          + (f"(+{unanswerable} asked before their answer arrived) " if unanswerable else "")
          + f"/ {len(val_questions)} val questions, reward {reward_mode}", file=sys.stderr)
    try:
        await model.register(backend)
        policy = Policy.for_model(model, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                  max_concurrency=cfg.concurrency)
        # How the model's chat template wants tool-call arguments in the episodes it is trained on
        arguments = training_data.argument_form(backends.chat_template(backend_name, backend, cfg.base_model))
        state = await runs.check_state(run_dir(cfg), state, model)
        after_each = None
        if reward_mode == "ruler":
            after_each = lambda group: rewards.ruler_group(group, ruler_model, ruler_params)  # noqa: E731
        by_id = {q.id: q for q in rl_questions}

        async def rejudge(group):  # a group the judge failed on, judged again
            if reward_mode == "ruler":
                return await after_each(group)
            for t in group.trajectories:
                if t.metadata.get("verdict_error"):
                    await regrade(t, by_id[t.metadata["question_id"]], rollout_config)
            return group

        async def gather(questions, step):
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(policy, q, db, rollout_config) for _ in range(cfg.rollouts_per_group))
                 for q in questions),
                pbar_desc=f"step {step}", max_exceptions=0.5, max_metrics=4, after_each=after_each)
            # the rollouts are kept while a judge that is down comes back; one that does not stops the run here
            return await judging.settle(groups, rejudge, reward_mode=reward_mode, patience=cfg.judge_patience,
                                        step=step + 1,  # the number of the checkpoint it would make
                                        notify=lambda line: print(line, file=sys.stderr, flush=True))

        warm_start_pending = bool(cfg.sft_from) and not state.get("sft_done")
        # RL steps are counted after the warm start's checkpoints, so a resumed run finds its place in the data
        # (a warm start still to finish, even half done, comes before any RL step).
        sft_steps = state.get("sft_steps", 0)
        rl_step = 0 if warm_start_pending else await model.get_step() - sft_steps
        batches = art.utils.iterate_dataset(rl_questions, groups_per_step=cfg.groups_per_step,
                                            num_epochs=cfg.num_epochs, initial_step=rl_step, use_tqdm=False)
        if cfg.preflight:  # the next step's groups from the policy as it is now: nothing trained, logged or saved
            batch = next(iter(batches), None)
            if batch is None:
                raise DataError(f"--preflight: run {cfg.name!r} has no steps left to check (its epochs are done).")
            started = time.perf_counter()
            groups = await gather(batch.items, batch.step + sft_steps)
            health = preflight.measure(groups, time.perf_counter() - started, cfg.min_reward_std)
            verdict = say_whether_it_can_learn(cfg, health, reward_mode, warm_start_pending)
            if not verdict.ok:
                raise DataError(verdict.headline)
            print(f"preflight: {verdict.headline}")
            return
        if warm_start_pending:
            sft_episodes = sft_episodes or await warm_start_episodes(cfg, db, train_questions, val_questions,
                                                                     rollout_config)
            await warm_start(cfg, model, training_data.for_sft(sft_episodes, arguments))
            state = model.merge_state({"sft_done": True, "sft_steps": await model.get_step()})
            sft_steps = state["sft_steps"]
            policy.model = model.get_inference_name()
            if val_questions:
                step = await model.get_step()
                print(f"val  {step:>4}  {await validate(model, policy, val_questions, db, rollout_config, step)}")
        if cfg.sft_only:
            return
        rollouts = cfg.groups_per_step * cfg.rollouts_per_group
        if backend_name == "cpu" and rollouts > 16:  # GPU-scale steps on a CPU: say what one will cost
            started = time.perf_counter()
            await rollout(policy, rl_questions[0], db, rollout_config)
            one, at_once = time.perf_counter() - started, min(cfg.concurrency, backend.max_batch_size)
            print(f"note: one rollout took {one:.0f}s here, so a step of {rollouts} rollouts ({at_once} at a time) "
                  f"takes about {one * rollouts / at_once / 60:.0f} min before its update; the CPU preset's 8 take "
                  f"about {one * 8 / min(at_once, 8) / 60:.1f} min", file=sys.stderr, flush=True)
        idle_steps = 0  # steps in a row that trained on nothing
        trainable_shares, warned_low_variance = [], False
        for batch in batches:
            if cfg.max_steps and batch.step >= cfg.max_steps:
                break
            step = batch.step + sft_steps
            if batch.step % cfg.eval_every == 0 and val_questions and not (batch.step == 0 and sft_steps):
                print(f"val  {step:>4}  {await validate(model, policy, val_questions, db, rollout_config, step)}")
            started = time.perf_counter()
            groups = await gather(batch.items, step)
            health = preflight.measure(groups, time.perf_counter() - started, cfg.min_reward_std)
            if batch.step == 0:  # a fresh run says at once whether it can learn
                verdict = say_whether_it_can_learn(cfg, health, reward_mode, False)
                print(f"{'' if verdict.ok else 'warning: '}{verdict.headline}", flush=True)
            # ---- ALGO LOGIC: the GRPO update, on exactly the tokens the policy was served and sampled, of the
            # groups whose rewards differ by more than judge noise ----
            result = await backend.train(model, training_data.for_grpo(groups, arguments, cfg.min_reward_std),
                                         learning_rate=cfg.learning_rate, advantage_balance=cfg.advantage_balance,
                                         scale_rewards=cfg.scale_rewards)
            learned = preflight.step_metrics(health, groups, result.metrics, cfg.max_seq_length)
            await model.log(groups, split="train", metrics={**result.metrics, **learned}, step=result.step)
            policy.model = model.get_inference_name()  # serve the new checkpoint from the next rollout on
            print(preflight.step_line(result.step, groups, result.metrics, learned, time.perf_counter() - started),
                  flush=True)
            idle_steps = 0 if learned["trained_token_share"] else idle_steps + 1
            if idle_steps >= preflight.IDLE_STEPS_WARNING:
                print(f"warning: {idle_steps} steps in a row trained on nothing: {preflight.idle_cause(health)}",
                      file=sys.stderr, flush=True)
            trainable_shares.append(learned["trainable_group_share"])
            low_variance = preflight.low_variance_warning(trainable_shares, cfg.temperature)
            if low_variance and not warned_low_variance:
                print(f"warning: {low_variance}", file=sys.stderr, flush=True)
                warned_low_variance = True
        step = await model.get_step()
        if val_questions:
            print(f"val  {step:>4}  {await validate(model, policy, val_questions, db, rollout_config, step)}")
        if cfg.keep_checkpoints == "best":
            await backends.keep_latest_and_best(model, backend, step)
        print(f"done: {run_dir(cfg)} (step {step}); evaluate with "
              f"python test_email_search_agent.py --model {cfg.name}" + (" --demo" if cfg.demo else ""))
    finally:
        await backend.close()
        if cfg.preflight and new_run:  # registering wrote a first checkpoint; a preflight leaves no run behind
            shutil.rmtree(run_dir(cfg), ignore_errors=True)


# What a CPU run takes from the demo preset when these flags are not given: its episode shape and batch. The
# GPU-scale defaults (12 groups x 4 rollouts of up to 10 turns of 2,048 tokens) take hours a step on two cores.
CPU_PRESET_KEYS = ("groups_per_step", "rollouts_per_group", "max_turns", "max_tokens", "max_body_chars",
                   "search_results", "concurrency")


def given_flags(args) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}


def cpu_preset(args) -> dict:
    """The CPU preset's values a run on the CPU backend (named, or chosen for want of CUDA) takes without --demo:
    those of `CPU_PRESET_KEYS` not given as flags."""
    from email_agent import backends

    given = given_flags(args)
    if given.get("demo") or backends.resolve_backend(given.get("backend", "auto")) != "cpu":
        return {}
    return {key: DEMO_PRESET[key] for key in CPU_PRESET_KEYS if key not in given}


def config_from_args(args) -> TrainConfig:
    given = given_flags(args)
    preset = DEMO_PRESET if given.get("demo") else cpu_preset(args)
    return TrainConfig(**{**preset, **given})


def train_command(args) -> None:
    cfg = config_from_args(args)
    if cfg.keep_checkpoints not in ("best", "all"):
        raise DataError("--keep-checkpoints is best or all")
    if not -1 <= cfg.advantage_balance <= 1:
        raise DataError(f"--advantage-balance must be between -1 and 1, not {cfg.advantage_balance}")
    if cfg.sft_schedule not in ("constant", "linear", "cosine"):
        raise DataError(f"--sft-schedule is constant, linear or cosine, not {cfg.sft_schedule!r}")
    if not cfg.hallucination_penalty >= 1:  # below ART·E's 1 a wrong answer could beat a sound "I don't know"
        raise DataError(f"--hallucination-penalty must be at least 1, not {cfg.hallucination_penalty}")
    for key in ("learning_rate", "sft_learning_rate"):
        if not 0 < getattr(cfg, key) < math.inf:
            raise DataError(f"--{key.replace('_', '-')} must be above 0, not {getattr(cfg, key)}")
    if not 0 <= cfg.temperature < math.inf:
        raise DataError(f"--temperature must be at least 0, not {cfg.temperature}")
    if not 0 <= cfg.min_realistic <= 1:  # ART·E's how_realistic scores run from 0 to 1
        raise DataError(f"--min-realistic must be between 0 and 1, not {cfg.min_realistic}")
    for key in ("judge_patience", "min_reward_std"):
        if not 0 <= getattr(cfg, key) < math.inf:
            raise DataError(f"--{key.replace('_', '-')} must be at least 0, not {getattr(cfg, key)}")
    if not 0 <= cfg.unanswerable_share < 1:
        raise DataError(f"--unanswerable-share must be at least 0 and below 1, not {cfg.unanswerable_share}")
    for key in ("groups_per_step", "rollouts_per_group", "num_epochs", "eval_every", "concurrency", "sft_epochs",
                "sft_batch_size", "max_turns", "max_tokens", "max_body_chars", "search_results", "lora_rank",
                "lora_alpha"):
        if getattr(cfg, key) < 1:
            raise DataError(f"--{key.replace('_', '-')} must be at least 1, not {getattr(cfg, key)}")
    for key in ("val_size", "train_limit", "sft_limit", "max_steps"):
        if getattr(cfg, key) < 0:
            raise DataError(f"--{key.replace('_', '-')} must be at least 0, not {getattr(cfg, key)}")
    if cfg.sft_only and not cfg.sft_from:
        raise DataError("--sft-only stops after the warm start, and --sft-from names none; give --sft-from "
                        "demo-expert or an evaluation folder")
    if cfg.sft_from not in ("", "demo-expert") and not (Path(cfg.sft_from).expanduser() / "results.jsonl").is_file():
        raise DataError(f"--sft-from {cfg.sft_from}: expected 'demo-expert' or an evaluation folder with results.jsonl "
                        "(an output folder of test_email_search_agent.py)")
    runs.check_name("--name", cfg.name)
    runs.check_name("--project", cfg.project)
    if preset := cpu_preset(args):
        print("CPU backend: the CPU preset's episode shape and batch ("
              + " ".join(f"--{key.replace('_', '-')} {value}" for key, value in preset.items())
              + "); give these flags to change them", file=sys.stderr)
    print(json.dumps(asdict(cfg)), file=sys.stderr)
    lock = runs.lock(cfg.art_dir, cfg.project, cfg.name)
    # SIGTERM ends the run like Ctrl-C: the current step is abandoned and the backend shut down.
    loop = asyncio.new_event_loop()
    task = loop.create_task(train(cfg))

    def stop() -> None:
        # ART's gather counts a cancelled rollout as a failed one and goes on with the others, so cancelling the
        # run alone would wait for the whole step's rollouts: the rollouts in flight are cancelled too.
        from email_agent.rollout import rollout

        task.cancel()
        for other in asyncio.all_tasks(loop):
            if getattr(other.get_coro(), "cr_code", None) is rollout.__code__:
                other.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    loop.add_signal_handler(signal.SIGINT, stop)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        loop.close()
        lock.close()


# ---- command line --------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("build-db", help="build the search database and question sets",
                       description="Build the SQLite/FTS5 email database (and its questions) atomically. "
                                   "Example: python train_email_search_agent.py build-db --demo")
    p.add_argument("--demo", action="store_true", help="the bundled, offline demo inbox (db: data/demo.db)")
    p.add_argument("--emails", metavar="PATH", help="local corpus: .jsonl(.gz), .parquet, a maildir folder or an mbox file "
                                                   "(default: Hugging Face corbt/enron-emails)")
    p.add_argument("--questions", metavar="PATH", help="local questions: .jsonl(.gz) or .parquet with the ART·E schema "
                                                      "(default: Hugging Face corbt/enron_emails_sample_questions)")
    p.add_argument("--db", metavar="PATH", help=f"output database (default {DEFAULT_DB}; with --demo {DEMO_DB})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --db even though its questions are lost (this build brings none), or "
                        "though another program wrote it")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=build_db)

    p = sub.add_parser("generate-questions", help="write a question set for an inbox with an LLM",
                       description="Ask an LLM to write question/answer pairs from batches of one inbox's emails "
                                   "(as ART·E made its questions), validate each against the database, split them "
                                   "into train/test with no shared email, and store them in the database. Re-running "
                                   "reuses cached replies and adds only new questions. Key: QUESTIONS_API_KEY, or the "
                                   "provider's usual variable (OPENAI_API_KEY...). Example: python "
                                   "train_email_search_agent.py generate-questions --db data/me.db --model "
                                   "openai/gpt-4.1 --inbox me@example.com --max-questions 500")
    p.add_argument("--db", default=DEFAULT_DB, metavar="PATH", help=f"database from build-db (default {DEFAULT_DB})")
    p.add_argument("--model", required=True, metavar="SPEC", help="any litellm model name (openai/gpt-4.1, "
                                                                 "anthropic/..., hosted_vllm/NAME with --base-url)")
    p.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible endpoint (a litellm proxy, vLLM)")
    p.add_argument("--inbox", action="append", metavar="ADDRESS", help="whose mail to ask about (repeat for several; "
                                                                       "default: the largest inbox)")
    p.add_argument("--max-questions", type=int, default=0, metavar="N", help="stop after N new questions (default: "
                                                                             "use every batch)")
    p.add_argument("--batch-size", type=int, default=20, metavar="N", help="emails per request (default 20)")
    p.add_argument("--test-fraction", type=float, default=0.2, metavar="F", help="share of new questions held out "
                                                                                 "for testing (default 0.2)")
    p.add_argument("--min-realistic", type=float, default=0.0, metavar="X",
                   help="reject questions the model rates less realistic than X (0..1, default 0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="batch order, query dates and split (default 0)")
    p.add_argument("--replace", action="store_true", help="delete every stored question and cached reply first")
    p.add_argument("--temperature", type=float, default=0.5, help="sampling temperature (default 0.5, as ART·E)")
    p.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight (default 4)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds a request may take before it is tried again (default 120; 3 tries)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=generate_questions)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=DEFAULT_DB, metavar="PATH", help=f"database (default {DEFAULT_DB})")
    common.add_argument("--as-of", metavar="DATE", help="hide mail dated after DATE, as the agent does for a question "
                                                       "asked that day")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("search", parents=[common], help="search an inbox as the agent does",
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
    p.set_defaults(func=search)

    p = sub.add_parser("read", parents=[common], help="read one email as the agent does",
                       description="Print one email with its recipients. Example: python train_email_search_agent.py "
                                   "read --db data/demo.db '<demo.000001@larkspur.example>'")
    p.add_argument("message_id", metavar="MESSAGE_ID")
    p.add_argument("--inbox", metavar="ADDRESS", help="only if ADDRESS sent or received it")
    p.set_defaults(func=read)

    p = sub.add_parser("ask", help="ask a trained agent a question about an inbox",
                       description="One question, answered by a trained agent (or any model) with the same rollout "
                                   "as training and evaluation: each tool call is shown as it happens, then the answer "
                                   "and the cited emails. No gold answer, so nothing is graded. Example: python "
                                   "train_email_search_agent.py ask --db data/demo.db --inbox "
                                   "priya.natarajan@larkspur.example 'Where is the Egret kickoff being held?'")
    p.add_argument("question", metavar="QUESTION")
    p.add_argument("--inbox", required=True, metavar="ADDRESS", help="whose mail (sent or received) to search")
    p.add_argument("--as-of", metavar="DATE", help="the agent's today: mail dated later is hidden (default: today)")
    p.add_argument("--db", metavar="PATH", help=f"database (default: the run's own, else {DEFAULT_DB})")
    p.add_argument("--model", metavar="SPEC", help="RUN[@STEP] (default: the most recent run), base, or a "
                                                   "provider/model such as openai/o4-mini or hosted_vllm/NAME")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint for a provider/model")
    p.add_argument("--api-key", help="key for --base-url (default: OPENAI_API_KEY for openai/, else POLICY_API_KEY)")
    p.add_argument("--max-turns", type=int, metavar="N", help="agent turns (default: what the run was trained with)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="tokens per reply (default: what the run was trained "
                                                               "with)")
    p.add_argument("--grounded-answers", action="store_true",
                   help="withhold an answer that names something (a word with a capital or a digit) in no email or "
                        "search result the agent saw: it says \"I don't know\" and shows what it withheld")
    p.add_argument("--art-dir", default=ART_DIR, help=f"where runs live (default {ART_DIR})")
    p.add_argument("--json", action="store_true", help="print one JSON object: answer, sources, turns, tool_calls, ...")
    p.set_defaults(func=ask)

    p = sub.add_parser("train", help="train the agent with GRPO (resumes a run of the same name)",
                       description="GRPO on the train split with rollouts from the agent environment. "
                                   "Example: python train_email_search_agent.py train --demo")
    cli.add_dataclass_flags(p, TrainConfig)  # one flag per field; its comment is the help text
    p.set_defaults(func=train_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cli.log_to_stderr()
    cli.stop_on_sigterm()
    try:
        cli.check_text_arguments(argv if argv is not None else sys.argv[1:])
        args.func(args)
    except DataError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except sqlite3.DatabaseError as exc:  # damaged after it was opened (a disk error, a half-copied file)
        print(f"Error: the database could not be read ({exc}); if it is damaged, rebuild it with build-db",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        resume = {"train": "; re-run the same command to resume from the last checkpoint",
                  "generate-questions": "; nothing was stored: re-run to go on (answered batches are cached)"}
        print("interrupted" + resume.get(args.command, ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except Exception as exc:  # a full or read-only disk under a checkpoint, the history or the database
        problem = runs.storage_problem(exc, run_dir(config_from_args(args)) if args.command == "train" else None)
        if problem is None:
            raise
        print(f"Error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
