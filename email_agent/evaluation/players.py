"""Evaluation: who plays, served the way it was trained; checked before it plays; what one answer records.

Owns: turning a `--model` value (a training run found by `runs`, `base`, or a provider/model) into a
`Contestant` with a ready policy (a run on its own backend: CPU on one vLLM server per base model, ART's LocalBackend
/ vLLM, W&B Serverless or Tinker; the untrained base model on CPU; a prompted model behind an OpenAI-compatible
endpoint); `probe`, one cheap request that fails fast on an unreachable server, a refused key or an unknown
model; the result record of one question x model (`make_record`, read by `report` and `sft`) and
re-judging it. `test_email_search_agent.py` and the `ask` command are thin layers over this.
It does not render reports (see `report`) and plays episodes only through `rollout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
from tqdm import tqdm

from email_agent import backends
from email_agent.agent import rewards
from email_agent.agent.rewards import Rubric
from email_agent.runs import ART_DIR
from email_agent.backends import CPU_BASE_MODEL
from email_agent.backends.vllm_server import VLLMServer
from email_agent.errors import DataError
from email_agent.agent.episode import Episode
from email_agent.data.questions import Question
from email_agent.evaluation.scores import read_results
from email_agent.redact import redact
from email_agent.runs import Run, find_run, is_step

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Contestants: a --model value -> a ready policy, served the way its run was trained
# ----------------------------------------------------------------------------------------------

@dataclass
class Options:
    """How to serve and play models; the command lines fill it from their flags."""

    art_dir: str = ART_DIR
    base_model: str = CPU_BASE_MODEL  # what `base` means
    base_url: str | None = None  # endpoint of prompted models
    api_key: str | None = None
    temperature: float | None = 0.0
    timeout: float = 300.0  # seconds per model request
    concurrency: int = 8  # rollouts in flight per model (and the CPU server's decoding batch)
    seed: int = 0
    shape: dict = field(default_factory=dict)  # episode-shape fields given as flags: they override every run's
    log_dir: str | None = None  # where the CPU path's vLLM writes its log (default: <art_dir>/logs)
    cpu_lora_rank: int = 8  # the largest LoRA the CPU path's vLLM must hold (`cpu_lora_rank`)


@dataclass
class Contestant:
    label: str
    policy: object  # rollout.Policy
    shape: Episode
    backend: str  # cpu | local | serverless | tinker | api (a prompted model)
    price_model: str | None = None  # litellm name to price tokens with
    history: Path | None = None  # a trained run's history.jsonl, for the learning curve
    step: int | None = None  # the trained run's checkpoint: the curve ends there

    @property
    def tool_choice(self) -> str:
        return self.policy.tool_choice or "auto"

    def episode(self, scoring: Episode) -> Episode:
        """The episode this contestant plays: its own shape, scored as `scoring` says (the evaluation's reward
        mode, judge and grounding check)."""
        return self.shape.scored(scoring)


def check_flags(args) -> None:
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


def split_spec(spec: str) -> tuple[str, str]:
    """(name, step) of a --model value: RUN@STEP is a run's step; a provider/model name is whole, an `@` in it
    included (ART serves checkpoints as name@step: hosted_vllm/agent@7)."""
    name, _, step = spec.partition("@")
    return (spec, "") if "/" in name else (name, step)


def check_specs(specs: list[str], art_dir: str) -> None:
    """What can be told of the --model values before any model is served (a model loads in seconds on CPU,
    minutes on a GPU): a step that is not one, and one checkpoint asked for under two names (RUN and RUN@N where
    N is its latest step). The checks of `open_contestant` stay: `ask` and other callers serve one model."""
    labels = {}
    for spec in specs:
        name, step = split_spec(spec)
        at = "@" in spec and name != spec
        if at and not step:
            raise DataError(f"--model {spec}: give a step after '@' (a number or 'latest'), or leave '@' out")
        run = find_run(name, art_dir)
        if run is None:
            if name == "base" and at:
                raise DataError(f"--model {spec}: 'base' is the untrained model; it has no steps")
            continue
        if step not in ("", "latest") and not is_step(step):
            raise DataError(f"--model {spec}: a step is a number or 'latest'.")
        if run.backend == "cpu":  # its checkpoints are here to count; an ART backend's are its own
            label = f"{run.name}@{run.checkpoint(step)[0]}"
            if label in labels:
                raise DataError(f"--model: {label} is given twice ({labels[label]} and {spec}); each model is "
                                f"evaluated once")
            labels[label] = spec


class Schedule:
    """Who plays when. Each model plays at most `concurrency` episodes at once, each from its first turn to its
    last. (Started all together, a model's episodes queue their requests turn by turn, none ends until nearly all
    have played every turn, and the CPU server's prefix cache, too small for them all, misses: bench_enron's
    evaluation finished no episode of 3 x 120 in ten minutes.) Models served on this machine's CPU (all by one vLLM
    server) play `cpu_at_once` at a time (default: one per core), the next starting when one has played all its
    episodes; GPU, remote and prompted models play alongside."""

    def __init__(self, contestants: list[Contestant], rollouts_each: int, concurrency: int,
                 cpu_at_once: int | None = None) -> None:
        cpu = [c.label for c in contestants if c.backend == "cpu"]
        self._lanes = {c.label: asyncio.Semaphore(concurrency) for c in contestants}
        self._go = {label: asyncio.Event() for label in cpu}
        at_once = max(1, cpu_at_once or os.cpu_count() or 1)
        for label in cpu[:at_once]:
            self._go[label].set()
        self._waiting = cpu[at_once:]
        self._left = dict.fromkeys(cpu, rollouts_each)

    @contextlib.asynccontextmanager
    async def turn(self, label: str):
        """Hold one episode of `label` until its model's turn and a free lane; the last of a CPU model's episodes
        to end lets the next waiting CPU model start."""
        go = self._go.get(label)
        if go is not None:
            await go.wait()
        try:
            async with self._lanes[label]:
                yield
        finally:
            if go is not None:
                self._left[label] -= 1
                if not self._left[label] and self._waiting:
                    self._go[self._waiting.pop(0)].set()


async def open_contestant(spec: str, options: Options, stack: contextlib.AsyncExitStack,
                          default_shape: Episode | None = None) -> Contestant:
    """A --model value -> a Contestant (servers it starts are closed by `stack`).

    A run plays the episode shape it was trained with; `base` and prompted models play `default_shape`
    (else the defaults); flags in `options.shape` override both.
    """
    # here, not at the top: openai takes ~0.4 s, rollout imports ART (torch, seconds); --help loads this module
    from openai import AsyncOpenAI

    from email_agent.agent.rollout import Policy

    check_specs([spec], options.art_dir)
    name, step = split_spec(spec)
    common = dict(max_concurrency=options.concurrency, temperature=options.temperature)
    run = find_run(name, options.art_dir)
    if run is not None:
        shape = run.shape.override(**options.shape)
        if run.backend == "cpu":
            number, ckpt = run.checkpoint(step)
            label = f"{run.name}@{number}"
            try:
                client, _ = await serve_on_cpu(run.base_model, ckpt, label, options, stack,
                                               lora_rank=run.config.get("lora_rank", 8))
            except DataError as exc:
                others = [str(n) for n in run.steps() if n != number]
                raise DataError(f"{exc}" + (f" The run's other checkpoints: {', '.join(others)} (--model "
                                             f"{run.name}@{others[-1]})." if others else "")) from None
        else:
            client, label, served = await serve_with_art(run, step, stack, options.timeout)
        policy = Policy(client, label if run.backend == "cpu" else served, **common)
        return Contestant(label, policy, shape, run.backend, history=run.path / "history.jsonl",
                          step=int(label.rpartition("@")[2]))

    shape = (default_shape or Episode()).override(**options.shape)
    if name == "base":  # check_specs refused base@N
        client, label = await serve_on_cpu(options.base_model, None, None, options, stack)
        return Contestant(label, Policy(client, label, **common), shape, "cpu")

    provider, _, model = name.partition("/")
    if not model:
        raise DataError(f"--model {spec!r} is neither a run under {options.art_dir}/*/models, 'base', nor a "
                        f"provider/model name such as openai/o4-mini or hosted_vllm/<name> (with --base-url).")
    base_url = options.base_url or (os.environ.get("OPENAI_BASE_URL") if provider == "openai" else None)
    if provider != "openai" and not base_url:
        raise DataError(f"--model {spec}: give --base-url of an OpenAI-compatible server (vLLM, a litellm proxy...).")
    api_key = options.api_key or os.environ.get("OPENAI_API_KEY" if provider == "openai" else "POLICY_API_KEY")
    if provider == "openai" and not (api_key or options.base_url):
        raise DataError(f"--model {spec}: set OPENAI_API_KEY (or pass --api-key).")
    served = model if provider in ("openai", "hosted_vllm") else name
    reasoning = provider == "openai" and model.startswith(("o1", "o3", "o4", "gpt-5"))
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=options.timeout, max_retries=3)
    # Prompted models are told they must call a tool (as ART·E's baselines were); trained ones learned to.
    policy = Policy(client, served, logprobs=False, tool_choice="required",
                    **{**common, "temperature": None if reasoning else options.temperature})
    return Contestant(spec, policy, shape, "api", price_model=name)


async def serve_on_cpu(base_model: str, checkpoint: Path | None, label: str | None, options: Options,
                       stack: contextlib.AsyncExitStack, lora_rank: int = 8):
    """(client, model name) on the one vLLM server of `base_model` in this evaluation (`stack`): the base model
    under the server's name for it, a checkpoint a LoRA loaded into it as `label`. The first call starts it."""
    # here, not at the top: openai takes ~0.4 s (pydantic) and backends.cpu imports torch, transformers, peft, ART
    from openai import AsyncOpenAI

    from email_agent.backends.cpu import CheckpointError
    from email_agent.backends.cpu.checkpoints import check_adapter

    servers = _CPU_SERVERS.setdefault(stack, {})
    if base_model not in servers:
        servers[base_model] = asyncio.ensure_future(_start_cpu_server(base_model, options, stack, lora_rank))
    server = await servers[base_model]
    if checkpoint is not None:
        try:
            check_adapter(str(checkpoint))
        except CheckpointError as exc:
            raise DataError(str(exc)) from None
        await server.load_lora(label, str(checkpoint))
    client = AsyncOpenAI(base_url=server.base_url, api_key="local", timeout=options.timeout, max_retries=2)
    return client, label if checkpoint is not None else server.served_name


def cpu_lora_rank(specs: list[str], art_dir: str) -> int:
    """The LoRA rank the CPU path's vLLM must hold for these --model values: the largest CPU run's (vLLM sizes every
    LoRA slot by it, and slots of rank 64 made a rank-8 adapter's evaluation 20% slower: bench_vllm.py)."""
    ranks = [8]
    for spec in specs:
        run = find_run(split_spec(spec)[0], art_dir)
        if run is not None and run.backend == "cpu":
            ranks.append(run.config.get("lora_rank", 8))
    return max(ranks)


def cpu_served_name(base_model: str) -> str:
    """What the CPU path calls an untrained base model (evaluation's `base`, the CPU backend's server)."""
    return f"base:{Path(base_model).name}"


async def _start_cpu_server(base_model: str, options: Options, stack: contextlib.AsyncExitStack, lora_rank: int):
    # here, not at the top: backends.cpu imports torch, transformers, peft and ART (seconds)
    from email_agent.backends.cpu.model import load_tokenizer, served_model_dir

    tokenizer = await asyncio.to_thread(load_tokenizer, base_model)  # its tool chat template
    log = Path(options.log_dir or Path(options.art_dir) / "logs") / "vllm-evaluation.log"
    server = VLLMServer(served_model_dir(base_model), cpu_served_name(base_model),
                        chat_template=tokenizer.chat_template, log_path=log,
                        lora_rank=max(lora_rank, options.cpu_lora_rank),
                        max_num_seqs=max(32, options.concurrency * 3), seed=options.seed)
    stack.push_async_callback(server.close)
    server.start()
    await server.wait_ready()
    return server


# The vLLM server of each base model, per evaluation (one AsyncExitStack): every CPU contestant plays on it.
_CPU_SERVERS: "weakref.WeakKeyDictionary[contextlib.AsyncExitStack, dict]" = weakref.WeakKeyDictionary()


# The ART models registered per evaluation (one AsyncExitStack): several steps of one run share its backend,
# where each would otherwise start its own trainer and vLLM on the same GPU.
_REGISTERED: "weakref.WeakKeyDictionary[contextlib.AsyncExitStack, dict]" = weakref.WeakKeyDictionary()


async def serve_with_art(run: Run, step: str, stack: contextlib.AsyncExitStack, timeout: float):
    """A run trained on an ART backend, served by that backend: register a model of the same name, project
    and folder (as training does), then ask for the step. Returns (client, label, served model name).
    A second step of the same run is served by the backend the first one started."""
    # here, not at the top: ART imports torch and transformers (seconds), and --help loads this module
    import art
    from openai import AsyncOpenAI

    registered = _REGISTERED.setdefault(stack, {})
    try:
        model = registered.get(run.path)
        if model is None:
            cfg = SimpleNamespace(**{**run.config, "art_dir": run.art_dir})
            backends.hide_wandb_key(run.backend, wandb=False)  # ART would start a W&B run to serve it
            try:
                backend = backends.make_backend(run.backend, cfg)
            except backends.BackendError as exc:
                raise DataError(cannot_serve(run, step, str(exc))) from None
            stack.push_async_callback(backend.close)
            model = art.TrainableModel(
                name=run.name, project=run.project, base_model=run.base_model, base_path=run.art_dir,
                _internal_config=backends.internal_config(cfg) if run.backend == "local" else None)
            await model.register(backend)
            registered[run.path] = model
        latest = await model.get_step()
        wanted = latest if step in ("", "latest") else int(step)
        if run.backend == "local" and wanted != latest:
            # ART 0.5.18 serves only the latest step and has no public call for another: load that LoRA
            # into the running vLLM the way ART itself does after each training step.
            _, folder = run.checkpoint(str(wanted))
            await load_lora_adapter(model.inference_base_url, model.inference_api_key,
                                    model.get_inference_name(wanted), str(folder.resolve()))
        served = model.get_inference_name(wanted)
        # Our own client on the model's endpoint and key, as training's Policy.for_model does: ART 0.5.18's
        # model.openai_client() hands openai an httpx.Timeout it cannot add to a float (TypeError per request).
        client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key or "none",
                             timeout=timeout, max_retries=2)
    except DataError:
        raise
    except Exception as exc:  # a runtime that will not build or start: say so, with the way around it
        raise DataError(cannot_serve(run, step, f"{type(exc).__name__}: {redact(str(exc)[:300])}")) from None
    return client, f"{run.name}@{wanted}", served


async def load_lora_adapter(base_url: str, api_key: str | None, lora_name: str, path: str) -> None:
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/load_lora_adapter"
    async with httpx.AsyncClient(timeout=120.0) as client:
        response = await client.post(url, json={"lora_name": lora_name, "lora_path": path, "load_inplace": True},
                                     headers={"Authorization": f"Bearer {api_key or 'none'}"})
    if response.status_code >= 400:
        raise DataError(f"vLLM would not load the LoRA {path} as {lora_name} (HTTP {response.status_code}: "
                        f"{response.text[:200]}).")


def cannot_serve(run: Run, step: str, reason: str) -> str:
    """What is missing to serve a run the way it was trained, and the way around it."""
    message = f"run {run.name!r} was trained on the {run.backend} backend, which cannot serve it here: {reason}"
    steps = run.steps()
    if not steps:
        return message + (f" Its checkpoints are not in {run.path / 'checkpoints'}; evaluate it where it was "
                          f"trained, or copy its folder there first.")
    number = steps[-1] if step in ("", "latest") or not is_step(step) else int(step)
    folder = run.path / "checkpoints" / f"{number:04d}"
    rank = backends.gpu_checks.vllm_lora_rank(run.config.get("lora_rank", 8))
    return message + (f" To evaluate it anyway, serve the checkpoint with vLLM on a GPU machine: `vllm serve "
                      f"{run.base_model} --enable-lora --max-lora-rank {rank} --lora-modules {run.name}={folder} "
                      f"--enable-auto-tool-choice --tool-call-parser hermes`, then pass --model "
                      f"hosted_vllm/{run.name} --base-url http://HOST:8000/v1 (see docs/evaluation.md, 'A GPU "
                      f"run, evaluated anywhere').")


# ----------------------------------------------------------------------------------------------
# Fail fast: one cheap request per contestant before the first rollout
# ----------------------------------------------------------------------------------------------

PROBE_TIMEOUT_S = 20.0


async def probe(contestant: Contestant) -> None:
    """Raise DataError if the contestant's endpoint is unreachable, refuses the key or does not serve the model.

    GET /models first (free, and what every OpenAI-compatible server answers); when the model is not in the
    list, or the server has no such route, a one-token chat request decides.
    """
    # here, not at the top: openai takes ~0.4 s to import (pydantic), and --help loads this module
    import openai

    client = contestant.policy.client.with_options(max_retries=0, timeout=PROBE_TIMEOUT_S)
    model, where = contestant.policy.model, str(client.base_url)
    served: list[str] = []

    def failure(exc: Exception) -> DataError:
        if isinstance(exc, openai.APIConnectionError):  # refused, DNS, timeout
            return DataError(f"{contestant.label}: cannot reach {where} ({type(exc).__name__}); is the server up "
                             f"and the --base-url right?")
        if isinstance(exc, (openai.AuthenticationError, openai.PermissionDeniedError)):
            return DataError(f"{contestant.label}: {where} refused the API key (HTTP {exc.status_code}); check "
                             f"--api-key, OPENAI_API_KEY or POLICY_API_KEY.")
        if isinstance(exc, openai.NotFoundError):
            listed = f"; it serves {', '.join(served[:10])}" if served else ""
            return DataError(f"{contestant.label}: {where} does not serve a model named {model!r}{listed}.")
        return DataError(f"{contestant.label}: {where} answered the probe with HTTP "
                         f"{getattr(exc, 'status_code', '?')}: {redact(str(exc)[:200])}")

    try:
        page = await client.models.list()
        served = [m.id for m in page.data]
        if not served or model in served:
            return
    except (openai.APIConnectionError, openai.AuthenticationError, openai.PermissionDeniedError) as exc:
        raise failure(exc) from None
    except openai.APIStatusError:
        pass  # no /models route here: ask for one token instead
    try:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say OK."}],
                                             max_completion_tokens=1)
    except openai.BadRequestError:
        return  # reachable, authorised, the model exists; the request's shape is the rollout's business
    except (openai.APIConnectionError, openai.APIStatusError) as exc:
        raise failure(exc) from None


# ----------------------------------------------------------------------------------------------
# Records: one per question x model
# ----------------------------------------------------------------------------------------------

def cost_usd(price_model: str | None, prompt_tokens: int, completion_tokens: int) -> float | None:
    if price_model is None:
        return None
    # here, not at the top: litellm takes ~1.5 s to import (openai, pydantic), and --help loads this module
    import litellm

    try:
        prompt_cost, completion_cost = litellm.cost_per_token(model=price_model, prompt_tokens=prompt_tokens,
                                                              completion_tokens=completion_tokens)
    except Exception:  # litellm raises for models it has no price for
        return None
    return prompt_cost + completion_cost


def make_record(contestant: Contestant, question: Question, traj, config) -> dict:
    """One line of results.jsonl: enough to report, re-judge and warm-start from without re-running."""
    m, meta = traj.metrics, traj.metadata
    verdict = None
    if meta.get("answer") is not None:
        verdict = {"correct": bool(m["answer_correct"]), "judge": meta.get("verdict_judge"),
                   "reasoning": meta.get(rewards.VERDICT_REASONING), "error": meta.get(rewards.VERDICT_ERROR)}
    return {"model": contestant.label, "question_id": question.id, "question": question.question,
            "gold_answer": question.answer, "gold_message_ids": question.message_ids, "inbox": question.inbox_address,
            "query_date": question.query_date, "answer": meta.get("answer"), "sources": json.loads(meta["sources"]),
            "withheld": json.loads(meta["withheld"]) if meta.get("withheld") else None,
            "grounded_answers": config.grounded_answers,
            "reward": traj.reward, "reward_mode": config.reward, "max_turns": config.max_turns, "verdict": verdict,
            "episode": contestant.shape.shape(), "tool_choice": contestant.tool_choice, "backend": contestant.backend,
            "concurrency": contestant.policy.max_concurrency,
            "metrics": dict(m),
            "cost_usd": cost_usd(contestant.price_model, m["prompt_tokens"], m["completion_tokens"]),
            "error": meta.get("error"), "messages": traj.messages()}


async def rejudge_folder(folder: Path, config, grounded_answers: bool) -> list[dict]:
    """Every answer of an earlier evaluation (its results.jsonl) scored again with `config`'s judge, without
    playing the episodes again."""
    results = folder / "results.jsonl"
    if not results.is_file():
        raise DataError(f"--rejudge {folder}: no results.jsonl there (an output folder of this command).")
    stored, torn = read_results(results)
    if torn:
        log.warning("note: %d unreadable line(s) in %s skipped", torn, results)
    if not stored:
        raise DataError(f"--rejudge {folder}: results.jsonl holds no results to re-score.")
    unique = {}
    for record in stored:  # two files joined by hand would count each question twice
        unique.setdefault((record["model"], str(record["question_id"])), record)
    if len(unique) < len(stored):
        log.warning("note: %d repeated answer(s) (same model and question) in %s skipped", len(stored) - len(unique),
                    results)
    if any(bool(r.get("grounded_answers")) != grounded_answers for r in unique.values()):
        log.warning("note: re-scoring %s the grounding check (--grounded-answers), unlike the evaluation in %s",
                    "with" if grounded_answers else "without", folder)
    return [await rejudge_record(r, config) for r in tqdm(list(unique.values()), desc="re-judging", unit=" answers")]


async def rejudge_record(record: dict, config) -> dict:
    """Re-score a stored record with another judge: the agent's answer stays, the verdict and reward change.
    An answer the grounding check withheld is judged as the agent gave it, and withheld again only if `config`
    asks for the check (so `--rejudge DIR --grounded-answers` applies it to an evaluation made without)."""
    # here, not at the top: rollout imports ART (torch, seconds), and --help loads this module
    from email_agent.agent.rollout import grade, withhold_ungrounded

    fields = Rubric.__dataclass_fields__
    rubric = Rubric(**{k: v for k, v in record["metrics"].items() if k in fields})
    rubric.answer_correct = rubric.hallucinated = rubric.judge_error = rubric.attempted_answer = 0
    rubric.returned_i_dont_know = rubric.sources_correct = rubric.withheld_answer = rubric.withheld_right = 0
    question = Question(record["question_id"], record["question"], record["gold_answer"], record["gold_message_ids"],
                        None, record["inbox"], record["query_date"], "")
    given = record.get("withheld") or record
    answer, sources, withheld = withhold_ungrounded(given["answer"], given["sources"], record["messages"], config)
    verdict = await grade(rubric, question, answer, sources, config, withheld)
    max_turns = record.get("max_turns", config.max_turns)
    new = dict(record, answer=answer, sources=sources, withheld=withheld, grounded_answers=config.grounded_answers,
               metrics={**record["metrics"], **{k: getattr(rubric, k) for k in fields}},
               reward=rewards.reward(config.reward, rubric, max_turns, len(sources)),
               reward_mode=config.reward)
    new["verdict"] = None if verdict is None else {"correct": verdict.correct, "judge": verdict.judge,
                                                   "reasoning": verdict.reasoning, "error": verdict.error}
    return new


def scoring_config(reward: str | None, judge_model: str | None, judge_base_url: str | None, art_dir: str,
                   grounded_answers: bool = False):
    """A Episode carrying how answers are graded and whether ungrounded ones are withheld (each
    contestant adds its episode shape)."""
    mode, judge = rewards.configure(reward, judge_model, judge_base_url, art_dir)
    if mode == "ruler":  # RULER ranks groups during training; an evaluation grades each answer on its own
        mode = "shaped" if judge else "offline"
    return Episode(reward=mode, judge=judge, grounded_answers=grounded_answers)


def shared_run_shape(specs: list[str], art_dir: str) -> Episode | None:
    """The episode shape of the trained runs among `specs` if they all share one: `base` and prompted models
    then play that shape too, so a comparison with a trained run is like for like."""
    shapes = {run.shape for spec in specs if (run := find_run(spec.partition("@")[0], art_dir)) is not None}
    return shapes.pop() if len(shapes) == 1 else None
