"""Warm start: supervised fine-tuning, before RL, on the episodes `agent.demonstrations` gathers (the expert's or
a teacher's), on their assistant turns; resumable epoch by epoch.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import art
from art.utils.sft import create_lr_schedule

logger = logging.getLogger(__name__)


async def fine_tune(cfg, model, trajectories: list, say: Callable[[str], None] = logger.info) -> None:
    """Supervised fine-tuning on successful (and abstaining) trajectories: ART's train_sft, one checkpoint per epoch
    (`cfg`: the run's TrainConfig).

    `say` gets a line per epoch (step, epoch, seconds). Resumable: the step the warm start began at is saved in the
    run state before the first epoch, so after an interruption (even kill -9) the epochs already checkpointed are
    skipped, not re-run on top of themselves.
    """
    state = model.read_state() or {}
    if "sft_start_step" not in state:
        state = model.merge_state({"sft_start_step": await model.get_step()})
    done = await model.get_step() - state["sft_start_step"]  # epochs already checkpointed
    abstentions = sum(1 for t in trajectories if t.metrics.get("returned_i_dont_know"))
    logger.info("warm start: %d trajectories from %s (%d end in \"I don't know\")%s", len(trajectories), cfg.sft_from,
                abstentions, f"; resuming after epoch {done}" if done else "")
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
        say(f"sft  {step:>4}  epoch {epoch + 1}/{cfg.sft_epochs}  {time.perf_counter() - started:.0f}s")
