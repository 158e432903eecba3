"""Backends: where the policy is served and trained. The training loop is the same for all of them.

  cpu         our CPUBackend (email_agent/backends/cpu/): transformers + peft, in-process server; the
              embedded default when no GPU is present
  local       ART's LocalBackend: unsloth trainer + vLLM on one CUDA GPU (pip install -r requirements-gpu.txt)
  serverless  ART's ServerlessBackend (W&B Training; needs WANDB_API_KEY)
  tinker      ART's TinkerBackend (needs TINKER_API_KEY and openpipe-art[tinker])

This module only picks and builds one, and builds the model's ART settings; it hides nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..data import DataError

BACKENDS = ("cpu", "local", "serverless", "tinker")
CPU_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GPU_BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"
ART_DIR = ".art"  # where runs live: ART's layout <art_dir>/<project>/models/<name>/
PROJECT = "email-agent"  # the ART (and W&B) project


def run_path(art_dir: str, project: str, name: str) -> Path:
    return Path(art_dir) / project / "models" / name


class BackendError(DataError):
    """A backend that cannot start here, worded for the user (one sentence, no traceback)."""


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "local" if cuda_available() else "cpu"
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} or auto")
    return name


def default_base_model(backend: str) -> str:
    return CPU_BASE_MODEL if backend == "cpu" else GPU_BASE_MODEL


def internal_config(cfg):
    """ART's model settings for the GPU backend: the knobs that decide whether a 7B run fits a 24 GB card."""
    import art

    return art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=cfg.max_seq_length),
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=cfg.gpu_memory_utilization,
                                       enforce_eager=cfg.enforce_eager, max_num_seqs=cfg.max_num_seqs,
                                       max_model_len=cfg.max_seq_length),
        peft_args=art.dev.PeftArgs(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha),
    )


def make_backend(name: str, cfg):
    """Build the chosen backend; `cfg` is the training config (art_dir, seed, LoRA and memory settings)."""
    if name == "cpu":
        from .cpu import CPUBackend, find_base_model

        find_base_model(cfg.base_model)
        return CPUBackend(path=cfg.art_dir, seed=cfg.seed, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                          train_threads=cfg.cpu_train_threads or os.cpu_count() or 1)
    if name == "local":
        if not cuda_available():
            raise BackendError("--backend local needs a CUDA GPU (torch sees none); use --backend cpu here.")
        try:
            from art.local import LocalBackend
        except ImportError as exc:
            raise BackendError(f"--backend local needs ART's GPU extra: pip install -r requirements-gpu.txt ({exc})") from exc
        return LocalBackend(path=cfg.art_dir)
    if name == "serverless":
        if not os.environ.get("WANDB_API_KEY"):
            raise BackendError("--backend serverless trains on W&B Training: set WANDB_API_KEY first.")
        import art

        return art.ServerlessBackend()  # reads WANDB_API_KEY itself
    if name == "tinker":
        if not os.environ.get("TINKER_API_KEY"):
            raise BackendError("--backend tinker needs TINKER_API_KEY in the environment.")
        try:
            from art.tinker.backend import TinkerBackend
        except ImportError as exc:
            raise BackendError(f"--backend tinker needs ART's tinker extra: pip install 'openpipe-art[tinker]==0.5.18' ({exc})") from exc
        # Never pass the key as an argument: ART 0.5.18 prints a key given that way.
        return TinkerBackend(path=cfg.art_dir)
    raise BackendError(f"unknown backend {name!r}")


async def keep_latest_and_best(model, backend, latest: int) -> None:
    """Delete every checkpoint but the latest and the one with the best mean val/reward.

    (ART 0.5.18's model.delete_checkpoints fails on the string `recorded_at` column of its own history.)
    """
    import json

    history = run_path(model.base_path, model.project, model.name) / "history.jsonl"
    rewards_by_step: dict[int, list[float]] = {}
    for line in history.read_text(errors="replace").splitlines() if history.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line a killed run cut off
        if isinstance(row, dict) and isinstance(row.get("val/reward"), (int, float)) and isinstance(row.get("step"), int):
            rewards_by_step.setdefault(row["step"], []).append(row["val/reward"])
    keep = {latest}
    if rewards_by_step:
        keep.add(max(rewards_by_step, key=lambda s: (sum(rewards_by_step[s]) / len(rewards_by_step[s]), s)))
    await backend._delete_checkpoint_files(model, sorted(keep))
