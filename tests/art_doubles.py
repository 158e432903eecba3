"""ART's LocalBackend on a machine without a GPU, for tests: the installed class itself, with only what needs a
GPU replaced (the unsloth trainer and the vLLM it starts, `GPUService`) and W&B (network) recorded.

Everything else is ART 0.5.18's own code: `register` (model.json, W&B at start), `_prepare_backend_for_training`,
`get_model_config` (the settings the service would get, checked as ART checks them), `train` (its tokenizer and
packer on the real tokenizer of `--base-model`, its metric keys, its skipped-step path), step naming and
checkpoint discovery. So a renamed parameter, method or metric key in ART fails a test here instead of a GPU run.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse

import art
import art.local
from art.dev.validate import validate_dedicated_config
from art.local import LocalBackend
from art.preprocessing.pack import packed_tensors_from_dir
from art.utils.get_model_step import get_step_from_dir
from art.utils.output_dirs import get_model_dir, get_step_checkpoint_dir

from email_agent import backends
from email_agent.backends import readiness
from scripted_server import serve_in_thread

readiness.allow_art_without_megatron()  # as make_backend does: ART 0.5.18's get_model_config imports megatron
from art.dev.get_model_config import get_model_config


class GPUService:
    """Stands in for ART's UnslothService: "serves" a scripted server, "trains" by recording the packed tensors
    ART hands it and writing the next checkpoint folder, as the real one does after its optimizer steps."""

    made: list = []

    def __init__(self, base_url: str, output_dir: str, config: dict):
        self.base_url, self.output_dir, self.config = base_url, output_dir, config
        self.made.append(self)
        self.packed: list[dict] = []  # the tensors of each train call, as ART packed them
        self.loaded: list[tuple[int, str]] = []  # (step, folder) registered with "vLLM"

    async def start_openai_server(self, config) -> tuple[str, int]:
        first = get_step_checkpoint_dir(self.output_dir, 0)
        if not os.path.isdir(os.path.dirname(first)) or not os.listdir(os.path.dirname(first)):
            os.makedirs(first, exist_ok=True)
        url = urllib.parse.urlparse(self.base_url)
        return url.hostname, url.port

    async def train(self, disk_packed_tensors, config, dev_config, verbose: bool = False):
        # copies: the tensors are memory-mapped from a folder ART rewrites at the next step
        self.packed.append({k: v.clone() if hasattr(v, "clone") else v
                            for k, v in packed_tensors_from_dir(**disk_packed_tensors).items()})
        step = get_step_from_dir(self.output_dir) + 1
        os.makedirs(get_step_checkpoint_dir(self.output_dir, step), exist_ok=True)
        yield {"loss/train": 0.25, "loss/grad_norm": 1.0, "loss/learning_rate": config.learning_rate}

    async def train_sft(self, batches, config, verbose: bool = False):
        """Records the SFT batches ART tokenized (its real `tokenize_sft_batch`, unsloth_zoo's masking) and, as the
        real service does after its optimizer steps, writes the next checkpoint folder."""
        self.sft_batches = getattr(self, "sft_batches", [])
        for batch in batches:
            self.sft_batches.append(batch)
            yield {"loss/train": 0.5, "loss/learning_rate": batch.learning_rate}
        step = get_step_from_dir(self.output_dir) + 1
        os.makedirs(get_step_checkpoint_dir(self.output_dir, step), exist_ok=True)

    async def register_lora_for_step(self, step: int, checkpoint_dir: str) -> None:
        self.loaded.append((step, checkpoint_dir))


class LocalBackendOnCPU(LocalBackend):
    """ART's LocalBackend whose GPU service is a `GPUService` on `base_url`."""

    base_url = ""  # set per test (`on_a_gpu_machine`)
    made: list = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.made.append(self)
        self.closed = False
        self.train_calls: list[tuple[list, dict]] = []  # (groups, options) of each train call, then ART's own train

    async def train(self, model, trajectory_groups, **kwargs):
        groups = list(trajectory_groups)
        self.train_calls.append((groups, kwargs))
        return await super().train(model, groups, **kwargs)

    async def _get_service(self, model):
        if model.name not in self._services:  # what ART's own _get_service does before it starts the GPU service
            directory = get_model_dir(model=model, art_path=self._path)
            config = get_model_config(base_model=model.base_model, output_dir=directory, config=model._internal_config)
            validate_dedicated_config(config)
            self._services[model.name] = GPUService(self.base_url, directory, config)
        return self._services[model.name]

    async def close(self) -> None:
        self.closed = True
        await super().close()


@contextlib.contextmanager
def on_a_gpu_machine(monkeypatch, scripts, tokenizer=None, gpu=readiness.GPU("stand-in", 23.6, 23.0)):
    """The world `train`, evaluation and `ask` see on a machine with a 24 GB CUDA GPU and ART's GPU extra:
    `--backend local` builds a `LocalBackendOnCPU` whose "vLLM" is a scripted server (with `tokenizer`, one that
    renders and samples as vLLM does). Yields (backends made, server, W&B runs ART would have started); the
    services the backends started are in `GPUService.made`."""
    LocalBackendOnCPU.made, GPUService.made = [], []
    wandb_runs = []
    with serve_in_thread(scripts, tokenizer=tokenizer) as server:
        LocalBackendOnCPU.base_url = server.base_url
        monkeypatch.setattr(art.local, "LocalBackend", LocalBackendOnCPU)
        monkeypatch.setattr(backends, "cuda_available", lambda: True)
        monkeypatch.setattr(readiness, "find_gpu", lambda: gpu)
        monkeypatch.setattr(readiness, "installed", lambda module: True)  # unsloth, trl, wandb: the GPU extra
        monkeypatch.setenv("ART_VLLM_RUNTIME_BIN", "stand-in")  # a built vLLM runtime, so no uv needed
        # ART starts a W&B run (import wandb, wandb.init) whenever WANDB_API_KEY is set: recorded, not made
        monkeypatch.setattr(art.Model, "_get_wandb_run",
                            lambda self: wandb_runs.append(self.name) if "WANDB_API_KEY" in os.environ else None)
        yield LocalBackendOnCPU.made, server, wandb_runs


def half_solve(question):
    """A script for the scripted server in which a group's rollouts differ, as a sampled policy's do: every other
    episode solves the question (search, read, answer), the others answer at once, wrongly."""
    from scripted_server import call, expert_script

    episodes = iter(range(10 ** 6))
    solve = expert_script(question)

    def reply(body):
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        if turn == 0 and next(episodes) % 2:
            return call("return_final_answer", {"answer": "Tuesday", "sources": []})
        return solve[turn]
    return reply
