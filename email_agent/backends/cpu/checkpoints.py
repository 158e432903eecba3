"""Checkpoints in LocalBackend's layout (`<model dir>/checkpoints/NNNN/`), written atomically and resumed exactly.

A checkpoint holds the LoRA adapter (peft's files, so ART and vLLM can load it too), the optimizer state and
`trainer_state.json` with the step, the seed and both random streams (LoRA dropout, request sampling).
This module owns the file format and the all-or-nothing rename; it does not decide when to save or which
steps to keep (`backend`), nor how the optimizer is built (`trainer` passes a factory).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from collections.abc import Callable

import torch
from art.utils.output_dirs import get_step_checkpoint_dir
from peft import PeftModel
from safetensors import safe_open

from email_agent.errors import UserError

_TEMPORARY = ".tmp-"


class CheckpointError(UserError):
    """The latest checkpoint exists but cannot be loaded (worded for the user: one sentence, no traceback)."""


def remove_partial_saves(model_dir: str) -> None:
    """Delete what saves that were killed before their rename left behind."""
    root = os.path.join(model_dir, "checkpoints")
    for leftover in (os.listdir(root) if os.path.isdir(root) else []):
        if leftover.startswith(_TEMPORARY):
            shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)


def save_checkpoint(model_dir: str, step: int, peft: PeftModel, optimizer: torch.optim.Optimizer, *,
                    seed: int, train_rng: torch.Tensor, sampling_rng: random.Random, mode: str | None) -> str:
    """Write step's checkpoint to a temporary directory and rename it into place: a kill mid-save leaves no
    step directory. Returns the checkpoint directory."""
    final = get_step_checkpoint_dir(model_dir, step)
    temporary = os.path.join(os.path.dirname(final), f"{_TEMPORARY}{step:04d}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        peft.save_pretrained(temporary, save_embedding_layers=False)  # only the LoRA
        torch.save(optimizer.state_dict(), os.path.join(temporary, "optimizer.pt"))
        internal = sampling_rng.getstate()
        with open(os.path.join(temporary, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "seed": seed, "mode": mode,
                       "train_rng": base64.b64encode(bytes(train_rng.tolist())).decode(),
                       "sampling_rng": [internal[0], list(internal[1]), internal[2]]}, f)
    except BaseException:  # a full disk, a kill: the half-written folder goes, the last checkpoint stays
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(temporary, final)
    return final


def load_checkpoint(base, directory: str, new_optimizer: Callable[[PeftModel], torch.optim.Optimizer],
                    sampling_rng: random.Random) -> tuple[PeftModel, torch.optim.Optimizer, torch.Tensor, str | None]:
    """(trainable LoRA on `base`, optimizer with its saved state, LoRA-dropout RNG state, the optimizer's mode:
    "sft", "rl" or None) from `directory`;
    `sampling_rng` is restored in place. Anything unreadable raises CheckpointError, worded for the user."""
    try:
        peft = PeftModel.from_pretrained(base, directory, is_trainable=True)
        optimizer = new_optimizer(peft)
        optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt")))
        with open(os.path.join(directory, "trainer_state.json")) as f:
            state = json.load(f)
        train_rng = torch.ByteTensor(list(base64.b64decode(state["train_rng"])))
        version, internal, gauss = state["sampling_rng"]
        sampling_rng.setstate((version, tuple(internal), gauss))
    except Exception as error:
        raise CheckpointError(
            f"Cannot resume from checkpoint {directory} ({type(error).__name__}: {error}). It is corrupt or "
            "incomplete: start over with --fresh, or delete that directory to resume from the one before."
        ) from error
    return peft, optimizer, train_rng, state.get("mode")


def load_merged(base, directory: str):
    """`base` with the LoRA in `directory` merged into its weights, for serving: decoding is ~20% faster
    than through the LoRA layers."""
    try:
        return PeftModel.from_pretrained(base, directory).merge_and_unload()
    except Exception as error:
        raise CheckpointError(f"Could not load the LoRA checkpoint {directory}: "
                              f"{type(error).__name__}: {error}") from error


def check_adapter(directory: str) -> None:
    """That `directory` holds a LoRA adapter vLLM can load (peft's config and a readable safetensors file), told
    in one sentence before vLLM is asked to load it; CheckpointError if not."""
    try:
        with open(os.path.join(directory, "adapter_config.json")) as f:
            config = json.load(f)
        if not isinstance(config, dict) or "r" not in config:
            raise ValueError("adapter_config.json is not a LoRA config")
        with safe_open(os.path.join(directory, "adapter_model.safetensors"), "pt") as tensors:
            if not list(tensors.keys()):
                raise ValueError("adapter_model.safetensors holds no weights")
    except Exception as error:
        raise CheckpointError(f"Could not load the LoRA checkpoint {directory}: "
                              f"{type(error).__name__}: {error}") from error
