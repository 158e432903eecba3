"""`CPUBackend`: ART's `Backend` protocol over the pieces of this package, for one trainable model: the shape of
ART's LocalBackend (vLLM serves, unsloth trains) with this package's trainer in unsloth's place.

Owns the model's lifecycle: registering (a new LoRA saved as step 0, or a resume from the latest checkpoint), the
step counter, when to checkpoint, and serving each new checkpoint as `name@step` from the vLLM server it starts
(`backends.vllm_server`), loaded at run time as ART loads its own. The training math is in `trainer` and the file
format in `checkpoints`; this module only wires them to ART's calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from art import Trajectory, TrajectoryGroup, dev
from art._backend_training import build_rl_train_configs
from art.local.checkpoints import delete_checkpoints
from art.types import LocalTrainResult, TrainSFTConfig
from art.utils.get_model_step import get_step_from_dir
from art.utils.output_dirs import get_model_dir, get_step_checkpoint_dir
from art.utils.sft import resolve_sft_batch_size
from peft import LoraConfig, get_peft_model
from tqdm import tqdm

from email_agent.backends import cpu_served_name
from email_agent.backends.readiness import DENSE_TARGET_MODULES
from email_agent.backends.vllm_server import VLLMServer
from email_agent.backends.cpu.checkpoints import load_checkpoint, remove_partial_saves, save_checkpoint
from email_agent.backends.cpu.model import load_base_model, load_tokenizer, served_model_dir
from email_agent.backends.cpu.trainer import Trainer, new_optimizer
from email_agent.errors import UserError

logger = logging.getLogger(__name__)

# The GPU path's LoRA targets (ART's, for dense models: Qwen2.5, Llama, SmolLM2), so a CPU run rehearses its adapter.
DEFAULT_LORA_TARGETS = tuple(DENSE_TARGET_MODULES)


class CPUBackend:
    """ART `Backend` that trains a LoRA on the CPU and serves it with vLLM (one trainable model).

    Optimiser defaults follow ART's LocalBackend: AdamW betas (0.9, 0.99), weight decay 0.1 (RL) / 0 (SFT),
    gradient norm clipped to 0.1 (RL) / 1.0 (SFT), one optimiser step per `train` call.
    Training uses `train_threads` (default 1): 2 is up to ~1.8x faster on an otherwise idle 2-core machine, but
    several times slower when any other process wants a core (OpenMP threads then stall at every barrier). vLLM
    decodes between steps, so the two take turns with the cores. Its output goes to `<model dir>/logs/vllm.log`.
    """

    def __init__(self, *, path: str = ".art", seed: int = 0, lora_rank: int = 8, lora_alpha: int = 16,
                 lora_dropout: float = 0.0, lora_target_modules: Iterable[str] = DEFAULT_LORA_TARGETS,
                 max_num_seqs: int = 8, max_grad_norm: float = 0.1, weight_decay: float = 0.1,
                 train_threads: int = 1) -> None:
        self._path = path
        self.seed = seed
        self.lora_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                      target_modules=list(lora_target_modules), task_type="CAUSAL_LM")
        self.max_num_seqs = max_num_seqs  # vLLM's: sequences it decodes at once
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        self.train_threads = train_threads
        self._model = None  # the registered art.TrainableModel
        self._model_dir: str | None = None
        self._trainer: Trainer | None = None
        self._step = 0
        self._sampling_rng = random.Random(seed)  # saved in checkpoints (the stream of an earlier server's seeds)
        self._closing = threading.Event()  # stops a training step between rows when the backend closes
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None  # runs everything that touches the model
        self._server: VLLMServer | None = None
        self._served_step: int | None = None

    async def __aenter__(self) -> CPUBackend:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    @property
    def trainer(self) -> Trainer | None:
        """The registered model's trainer: its LoRA model (`peft`), tokenizer and optimizer."""
        return self._trainer

    @property
    def server(self) -> VLLMServer | None:
        """The vLLM server of the registered model."""
        return self._server

    async def call(self, fn, *args):
        """Run fn(*args) on the thread that owns the trainer's model (one call at a time)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    # -- Backend protocol ------------------------------------------------------------------------

    async def register(self, model) -> None:
        model.base_path = self._path
        model_dir = get_model_dir(model=model, art_path=self._path)
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "model.json"), "w") as f:
            json.dump(model.model_dump(mode="json"), f)
        if not model.trainable:
            return  # a prompted model registers for logging only
        if self._model is not None:
            if self._model.name == model.name:
                return
            raise ValueError(f"CPUBackend already trains {self._model.name!r}; use one backend per model.")
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpu-backend-trainer")
        tokenizer = await self.call(load_tokenizer, model.base_model)  # its tool chat template
        self._server = VLLMServer(
            await self.call(served_model_dir, model.base_model), cpu_served_name(model.base_model),
            chat_template=tokenizer.chat_template, log_path=os.path.join(model_dir, "logs", "vllm.log"),
            lora_rank=self.lora_config.r, max_num_seqs=self.max_num_seqs, seed=self.seed)
        self._server.start()  # vLLM imports and loads (about a minute on 2 cores) while the trainer loads
        try:
            await self.call(self._load, model, model_dir)
            await self._server.wait_ready()
            await self._server.load_lora(f"{model.name}@{self._step}", get_step_checkpoint_dir(model_dir, self._step))
        except BaseException:
            await self.close()
            raise
        self._model = model
        self._served_step = self._step
        logger.info("serving %s@%d at %s with vLLM (its log: %s)", model.name, self._step, self._server.base_url,
                    "the server's own" if self._server.url else self._server.log_path)

    async def _prepare_backend_for_training(self, model, config: dev.OpenAIServerConfig | None = None
                                            ) -> tuple[str, str]:
        self._check_model(model)
        return self._server.base_url, "default"  # no key is checked: loopback only

    def _model_inference_name(self, model, step: int | None = None) -> str:
        if self._model is not None and model.name == self._model.name and model.trainable:
            return f"{model.name}@{self._step if step is None else step}"
        name = model.inference_model_name or model.name
        return name if step is None else f"{name}@{step}"

    async def _get_step(self, model) -> int:
        return get_step_from_dir(get_model_dir(model=model, art_path=self._path)) if model.trainable else 0

    async def _delete_checkpoint_files(self, model, steps_to_keep: list[int]) -> None:
        delete_checkpoints(get_model_dir(model=model, art_path=self._path), steps_to_keep)

    async def train(self, model, trajectory_groups: Iterable[TrajectoryGroup], *, learning_rate: float = 5e-6,
                    loss_fn: str = "cispo", scale_rewards: bool = True, allow_training_without_logprobs: bool = False,
                    kl_penalty_coef: float = 0.0, epsilon: float | None = None, epsilon_high: float | None = None,
                    advantage_balance: float = 0.0, save_checkpoint: bool = True, verbose: bool = False,
                    **ignored_kwargs: Any) -> LocalTrainResult:
        """One GRPO step (ART's tokenize -> pack -> loss), then checkpoint step+1 and serve it."""
        self._check_model(model)
        if loss_fn not in ("cispo", "ppo"):
            raise ValueError("CPUBackend supports loss_fn='cispo' or 'ppo'.")
        if ignored_kwargs:
            logger.warning("train: ignoring options the CPU backend does not implement: %s", sorted(ignored_kwargs))
        _, dev_config = build_rl_train_configs(
            learning_rate=learning_rate, advantage_balance=advantage_balance, scale_rewards=scale_rewards,
            ppo=loss_fn == "ppo", epsilon=epsilon, epsilon_high=epsilon_high, kl_penalty_coef=kl_penalty_coef,
            allow_training_without_logprobs=allow_training_without_logprobs)
        metrics, checkpoint = await self.call(
            self._train_rl, list(trajectory_groups), learning_rate, dev_config, save_checkpoint)
        await self._serve_latest()
        return LocalTrainResult(step=self._step, metrics=metrics, checkpoint_path=checkpoint)

    async def _train_sft(self, model, trajectories: Iterable[Trajectory], config: TrainSFTConfig,
                         dev_config: dev.TrainSFTConfig, verbose: bool = False) -> AsyncIterator[dict[str, float]]:
        """Supervised steps on the assistant turns, one optimiser step per batch; then checkpoint step+1."""
        self._check_model(model)
        trajectories = list(trajectories)
        size = resolve_sft_batch_size(batch_size=config.batch_size, default_batch_size=2)
        batches = [trajectories[i:i + size] for i in range(0, len(trajectories), size)]
        rates = (config.learning_rate if isinstance(config.learning_rate, list)
                 else [config.learning_rate] * len(batches))
        if len(rates) < len(batches):
            raise ValueError(f"{len(batches)} SFT batches but only {len(rates)} learning rates")
        # A progress bar for the person at the terminal (SFT runs for minutes), not a log record.
        with tqdm(total=len(trajectories), desc="sft", unit=" traj", file=sys.stderr) as bar:
            for batch, rate in zip(batches, rates):
                metrics = await self.call(self._trainer.sft_batch, batch, rate)
                bar.update(len(batch))
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                refresh=False)  # drawn with the next update, as often as tqdm's mininterval allows
                yield metrics
        await self.call(self._advance_step, True)
        await self._serve_latest()

    async def _serve_latest(self) -> None:
        """Serve the latest checkpoint as name@step (loaded at run time, as ART's LocalBackend loads its own), and
        stop serving the one before: rollouts ask for the latest step only."""
        if self._served_step == self._step:
            return
        name = self._model.name
        try:
            await self._server.load_lora(f"{name}@{self._step}", get_step_checkpoint_dir(self._model_dir, self._step))
        except UserError as exc:  # vLLM died or hung: the checkpoint is on disk, so say how to go on from it
            raise UserError(f"{exc}. Step {self._step} is saved: re-run the same command to resume from it.") from None
        previous, self._served_step = self._served_step, self._step
        if previous is not None:
            await self._server.unload_lora(f"{name}@{previous}")

    async def close(self) -> None:
        """Stop a training step under way (between rows), then the vLLM server and everything it started."""
        self._closing.set()
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None
        if self._server is not None:
            await self._server.close()
            self._server = None

    def _check_model(self, model) -> None:
        if self._model is None or model.name != self._model.name:
            raise ValueError(f"Model {model.name!r} is not registered with this CPUBackend (await model.register).")

    # -- trainer-thread side ---------------------------------------------------------------------

    def _load(self, model, model_dir: str) -> None:
        base, tokenizer = load_base_model(model.base_model, keep=False)  # loaded once per run
        remove_partial_saves(model_dir)
        self._model_dir = model_dir
        step = get_step_from_dir(model_dir)
        directory = get_step_checkpoint_dir(model_dir, step)
        resumed = os.path.isdir(directory)
        optimizer_for = functools.partial(new_optimizer, weight_decay=self.weight_decay)
        if resumed:
            peft, optimizer, train_rng, mode = load_checkpoint(base, directory, optimizer_for, self._sampling_rng)
            self._step = step
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)  # LoRA A is drawn from the global RNG: seed it for this only
                peft = get_peft_model(base, self.lora_config)
            optimizer = optimizer_for(peft)
            train_rng = torch.Generator().manual_seed(self.seed).get_state()  # LoRA dropout, kept apart
            mode = None
        self._trainer = Trainer(peft, tokenizer, optimizer, seed=self.seed, train_rng=train_rng,
                                weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
                                train_threads=self.train_threads, closing=self._closing, mode=mode)
        if resumed:
            logger.info("resumed %s from %s", model.name, directory)
        else:
            self._save_checkpoint(0)
            logger.info("new LoRA for %s (r=%d, seed %d) saved as step 0", model.name, self.lora_config.r, self.seed)
        peft.eval()

    def _save_checkpoint(self, step: int) -> str:
        trainer = self._trainer
        directory = save_checkpoint(self._model_dir, step, trainer.peft, trainer.optimizer, seed=self.seed,
                                    train_rng=trainer.train_rng, sampling_rng=self._sampling_rng, mode=trainer.mode)
        self._step = step
        return directory

    def _advance_step(self, save_checkpoint: bool) -> str | None:
        # Like LocalBackend, the step lives in the checkpoint directories: no save, no new step.
        return self._save_checkpoint(self._step + 1) if save_checkpoint else None

    def _train_rl(self, groups: list[TrajectoryGroup], learning_rate: float, dev_config: dev.TrainConfig,
                  save_checkpoint: bool) -> tuple[dict[str, float], str | None]:
        started = time.monotonic()
        metrics = {"data/step_num_trajectories": float(sum(len(group.trajectories) for group in groups)),
                   "data/step_num_groups_submitted": float(len(groups)),
                   "data/step_num_groups_trainable": float(sum(len({t.reward for t in group.trajectories}) > 1
                                                               for group in groups)),
                   "data/step_num_trained_trajectories": 0.0, "data/step_trainer_tokens": 0.0,
                   "data/step_row_tokens": 0.0}
        packed, num_trainable = self._trainer.pack(groups, dev_config, self._step)
        if packed is None:
            logger.info("no group has reward variance (or no logprobs): step advances without an update")
            metrics["data/step_num_groups_trainable"] = 0.0  # as ART reports a step it skips
        else:
            metrics.update(self._trainer.rl_update(packed, learning_rate, dev_config),
                           **{"data/step_num_trained_trajectories": float(num_trainable)})
        checkpoint = self._advance_step(save_checkpoint)
        metrics["time/step_trainer_s"] = time.monotonic() - started
        metrics["throughput/trainer_tokens_per_s"] = metrics["data/step_row_tokens"] / metrics["time/step_trainer_s"]
        logger.info("step %d: %d/%d trajectories, %d tokens in %.1fs%s", self._step,
                    metrics["data/step_num_trained_trajectories"], metrics["data/step_num_trajectories"],
                    metrics["data/step_row_tokens"], metrics["time/step_trainer_s"],
                    f", loss {metrics['loss/train']:.4f}" if "loss/train" in metrics else "")
        return metrics, checkpoint
