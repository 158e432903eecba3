"""Each --model value opened: a model ready to play episodes, served the way it was trained, checked before it plays.

Owns: turning a `--model` value (a training run found by `runs`, `base`, or a provider/model) into an
`OpenedModel` with a ready policy (a run on its own backend, served by `servers.Servers`: CPU on one vLLM server
per base model, ART's LocalBackend / vLLM, W&B Serverless or Tinker; the untrained base model on CPU; a prompted
model behind an OpenAI-compatible endpoint); the --model values checked before anything is served (the other
settings are checked by `email_agent.eval_config`); `EpisodeScheduler`, which model's episodes run when; `probe`,
one cheap request that fails fast on an unreachable server, a refused key or an unknown model.
`test_email_search_agent.py`, `ask` and `serve` are thin layers over this. What one answer records is `records`';
it does not render reports (see `report`) and plays episodes only through `rollout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from email_agent.agent.episode import Episode
from email_agent import backends
from email_agent.backends import CPU_BASE_MODEL
from email_agent.errors import UserError
from email_agent.models.servers import Servers
from email_agent.redact import redact
from email_agent.runs import ART_DIR, find_run, is_step


# ----------------------------------------------------------------------------------------------
# Opened models: a --model value -> a ready policy, served the way its run was trained
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
    limits: dict = field(default_factory=dict)  # episode limits given as flags: they override every run's
    log_dir: str | None = None  # where the CPU path's vLLM writes its log (default: <art_dir>/logs)
    cpu_lora_rank: int = 8  # the largest LoRA the CPU path's vLLM must hold (`cpu_lora_rank`)


@dataclass
class OpenedModel:
    label: str
    policy: object  # rollout.Policy
    limits: Episode
    backend: str  # cpu | local | serverless | tinker | api (a prompted model)
    price_model: str | None = None  # litellm name to price tokens with
    history: Path | None = None  # a trained run's history.jsonl, for the learning curve
    step: int | None = None  # the trained run's checkpoint: the curve ends there

    @property
    def tool_choice(self) -> str:
        return self.policy.tool_choice or "auto"

    def episode(self, scoring: Episode) -> Episode:
        """The episode this model plays: its own limits, scored as `scoring` says (the evaluation's reward
        mode, judge and grounding check)."""
        return self.limits.scored(scoring)


def served_here(backend: str) -> bool:
    """A model of `backend` (a backend's name, or "api" for a prompted model) is served by this project's vLLM
    on this machine (base and CPU runs): such models take turns (`EpisodeScheduler`)."""
    return backend in backends.BACKENDS and backends.get(backend).served_here


def split_spec(spec: str) -> tuple[str, str]:
    """(name, step) of a --model value: RUN@STEP is a run's step; a provider/model name is whole, an `@` in it
    included (ART serves checkpoints as name@step: hosted_vllm/agent@7)."""
    name, _, step = spec.partition("@")
    return (spec, "") if "/" in name else (name, step)


def check_specs(specs: list[str], art_dir: str) -> None:
    """What can be told of the --model values before any model is served (a model loads in seconds on CPU,
    minutes on a GPU): a step that is not one, and one checkpoint asked for under two names (RUN and RUN@N where
    N is its latest step). The checks of `open_model` stay: `ask` and other callers serve one model."""
    labels = {}
    art_runs = [run for run in (find_run(split_spec(spec)[0], art_dir) for spec in specs)
                if run is not None and not backends.get(run.backend).served_here]
    if "base" in specs and art_runs:  # `base` is served by the CPU path's vLLM, which a GPU venv does not hold
        run = art_runs[0]
        raise UserError(f"--model base is the CPU path's untrained {CPU_BASE_MODEL}; the untrained model of run "
                        f"{run.name!r} ({run.backend} backend, {run.base_model}) is its first checkpoint: "
                        f"--model {run.name}@0")
    for spec in specs:
        name, step = split_spec(spec)
        at = "@" in spec and name != spec
        if at and not step:
            raise UserError(f"--model {spec}: give a step after '@' (a number or 'latest'), or leave '@' out")
        run = find_run(name, art_dir)
        if run is None:
            if name == "base" and at:
                raise UserError(f"--model {spec}: 'base' is the untrained model; it has no steps")
            continue
        if step not in ("", "latest") and not is_step(step):
            raise UserError(f"--model {spec}: a step is a number or 'latest'.")
        if backends.get(run.backend).served_here:  # its checkpoints are here to count; an ART backend's are its own
            label = f"{run.name}@{run.checkpoint(step)[0]}"
            if label in labels:
                raise UserError(f"--model: {label} is given twice ({labels[label]} and {spec}); each model is "
                                f"evaluated once")
            labels[label] = spec


class EpisodeScheduler:
    """Which model's episodes run when. Each model plays at most `concurrency` episodes at once, each from its
    first turn to its last. (Started all together, a model's episodes queue their requests turn by turn, none ends
    until nearly all have played every turn, and the CPU server's prefix cache, too small for them all, misses:
    bench_enron's evaluation finished no episode of 3 x 120 in ten minutes.) Models served on this machine's CPU (all
    by one vLLM server) play `cpu_at_once` at a time (default: one per core), the next starting when one has played
    all its episodes; GPU, remote and prompted models play alongside."""

    def __init__(self, opened_models: list[OpenedModel], rollouts_each: int, concurrency: int,
                 cpu_at_once: int | None = None) -> None:
        cpu = [c.label for c in opened_models if served_here(c.backend)]
        self._lanes = {c.label: asyncio.Semaphore(concurrency) for c in opened_models}
        self._go = {label: asyncio.Event() for label in cpu}
        at_once = max(1, cpu_at_once or os.cpu_count() or 1)
        for label in cpu[:at_once]:
            self._go[label].set()
        self._waiting = cpu[at_once:]
        self._left = dict.fromkeys(cpu, rollouts_each)

    @contextlib.asynccontextmanager
    async def slot(self, label: str):
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


async def open_model(spec: str, servers: Servers, default_limits: Episode | None = None) -> OpenedModel:
    """A --model value -> an OpenedModel, served by `servers` (with the evaluation's `Options`) if it is trained or
    `base`.

    A run plays the episode limits it was trained with; `base` and prompted models play `default_limits`
    (else the defaults); flags in `options.limits` override both.
    """
    # here, not at the top: openai takes ~0.4 s, rollout imports ART (torch, seconds); --help loads this module
    from openai import AsyncOpenAI

    from email_agent.agent.rollout import Policy

    options = servers.options
    check_specs([spec], options.art_dir)
    name, step = split_spec(spec)
    common = dict(max_concurrency=options.concurrency, temperature=options.temperature)
    run = find_run(name, options.art_dir)
    if run is not None:
        limits = run.limits.override(**options.limits)
        if backends.get(run.backend).served_here:
            number, ckpt = run.checkpoint(step)
            label = f"{run.name}@{number}"
            try:
                client, _ = await servers.on_cpu(run.base_model, ckpt, label, lora_rank=run.config.get("lora_rank", 8))
            except UserError as exc:
                others = [str(n) for n in run.steps() if n != number]
                raise UserError(f"{exc}" + (f" The run's other checkpoints: {', '.join(others)} (--model "
                                             f"{run.name}@{others[-1]})." if others else "")) from None
        else:
            client, label, served = await servers.with_art(run, step)
        policy = Policy(client, label if backends.get(run.backend).served_here else served, **common)
        return OpenedModel(label, policy, limits, run.backend, history=run.path / "history.jsonl",
                          step=int(label.rpartition("@")[2]))

    limits = (default_limits or Episode()).override(**options.limits)
    if name == "base":  # check_specs refused base@N
        try:
            client, label = await servers.on_cpu(options.base_model, None, None)
        except UserError as exc:  # e.g. a GPU venv, which has no CPU vLLM: say what `base` is and what to type
            raise UserError(f"{str(exc).rstrip('.')} (--model base is the CPU path's untrained {options.base_model}; "
                            f"a GPU run's untrained model is its first checkpoint, --model RUN@0).") from None
        return OpenedModel(label, Policy(client, label, **common), limits, backends.CPU.name)

    provider, _, model = name.partition("/")
    if not model:
        raise UserError(f"--model {spec!r} is neither a run under {options.art_dir}/*/models, 'base', nor a "
                        f"provider/model name such as openai/o4-mini or hosted_vllm/<name> (with --base-url).")
    base_url = options.base_url or (os.environ.get("OPENAI_BASE_URL") if provider == "openai" else None)
    if provider != "openai" and not base_url:
        raise UserError(f"--model {spec}: give --base-url of an OpenAI-compatible server (vLLM, a litellm proxy...).")
    api_key = options.api_key or os.environ.get("OPENAI_API_KEY" if provider == "openai" else "POLICY_API_KEY")
    if provider == "openai" and not (api_key or options.base_url):
        raise UserError(f"--model {spec}: set OPENAI_API_KEY (or pass --api-key).")
    served = model if provider in ("openai", "hosted_vllm") else name
    reasoning = provider == "openai" and model.startswith(("o1", "o3", "o4", "gpt-5"))
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=options.timeout, max_retries=3)
    # Prompted models are told they must call a tool (as ART·E's baselines were); trained ones learned to.
    policy = Policy(client, served, logprobs=False, tool_choice="required",
                    **{**common, "temperature": None if reasoning else options.temperature})
    return OpenedModel(spec, policy, limits, "api", price_model=name)


def cpu_lora_rank(specs: list[str], art_dir: str) -> int:
    """The LoRA rank the CPU path's vLLM must hold for these --model values: the largest CPU run's (vLLM sizes every
    LoRA slot by it, and slots of rank 64 made a rank-8 adapter's evaluation 20% slower: bench_vllm.py)."""
    ranks = [8]
    for spec in specs:
        run = find_run(split_spec(spec)[0], art_dir)
        if run is not None and backends.get(run.backend).served_here:
            ranks.append(run.config.get("lora_rank", 8))
    return max(ranks)



# ----------------------------------------------------------------------------------------------
# Fail fast: one cheap request per opened model before the first rollout
# ----------------------------------------------------------------------------------------------

PROBE_TIMEOUT_S = 20.0


async def probe(opened_model: OpenedModel) -> None:
    """Raise UserError if the opened model's endpoint is unreachable, refuses the key or does not serve the model.

    GET /models first (free, and what every OpenAI-compatible server answers); when the model is not in the
    list, or the server has no such route, a one-token chat request decides.
    """
    # here, not at the top: openai takes ~0.4 s to import (pydantic), and --help loads this module
    import openai

    client = opened_model.policy.client.with_options(max_retries=0, timeout=PROBE_TIMEOUT_S)
    model, where = opened_model.policy.model, str(client.base_url)
    served: list[str] = []

    def failure(exc: Exception) -> UserError:
        if isinstance(exc, openai.APIConnectionError):  # refused, DNS, timeout
            return UserError(f"{opened_model.label}: cannot reach {where} ({type(exc).__name__}); is the server up "
                             f"and the --base-url right?")
        if isinstance(exc, (openai.AuthenticationError, openai.PermissionDeniedError)):
            return UserError(f"{opened_model.label}: {where} refused the API key (HTTP {exc.status_code}); check "
                             f"--api-key, OPENAI_API_KEY or POLICY_API_KEY.")
        if isinstance(exc, openai.NotFoundError):
            listed = f"; it serves {', '.join(served[:10])}" if served else ""
            return UserError(f"{opened_model.label}: {where} does not serve a model named {model!r}{listed}.")
        return UserError(f"{opened_model.label}: {where} answered the probe with HTTP "
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


def shared_run_limits(specs: list[str], art_dir: str) -> Episode | None:
    """The episode limits of the trained runs among `specs` if they all share the same: `base` and prompted models
    then play with those limits too, so a comparison with a trained run is like for like."""
    shared = {run.limits for spec in specs if (run := find_run(spec.partition("@")[0], art_dir)) is not None}
    return shared.pop() if len(shared) == 1 else None
