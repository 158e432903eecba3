"""The training math: GRPO steps through ART's own tokenizer, packer and loss, and SFT on assistant turns,
over one peft LoRA model with an AdamW optimizer.

Owns turning trajectories into rows (`Trainer.pack`), the log-probabilities of trained tokens
(`Trainer.target_logprobs`: the context in the inference dtype through a merged copy, `Trainer.context_model`,
with the prompt prefix all rows share computed once, `Trainer.shared_prefix`; a row's assistant turns in one
float32 pass with gradient) and one optimizer step per call. It runs on whatever thread calls it (the backend's
trainer thread, in practice) and knows nothing of serving, checkpoint files or ART's Backend protocol (`backend`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import random
import threading
import time

import torch
from art import Trajectory, TrajectoryGroup, dev
from art.loss import loss_fn as art_loss_fn, shift_tensor
from art.preprocessing.pack import PackedTensors, packed_tensors_from_tokenized_results
from art.preprocessing.tokenize import tokenize_trajectory_groups
from art.trajectories import get_messages
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import DynamicCache

from email_agent.backends.cpu.model import assistant_token_mask, inference_dtype

logger = logging.getLogger(__name__)

Rows = list[tuple[torch.Tensor, torch.Tensor]]  # ([1, L] token ids, [1, L] bool: position t is scored on t+1)
Prefix = tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]  # (length, per-layer keys/values)


def new_optimizer(peft: PeftModel, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the LoRA weights, with ART LocalBackend's betas (the learning rate is set per step)."""
    params = [p for p in peft.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=5e-6, betas=(0.9, 0.99), weight_decay=weight_decay)


@contextlib.contextmanager
def _seeded_global_random(seed: int):
    """ART's tokenizer and packer shuffle with the global `random`; seed it for them, then restore."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def _runs(targets: list[bool], start: int) -> list[tuple[int, int]]:
    """(begin, end) of each run of trained positions at or after `start`."""
    runs, begin = [], 0
    for is_trained, run in itertools.groupby(targets):
        end = begin + len(list(run))
        if is_trained and end > start:
            runs.append((max(begin, start), end))
        begin = end
    return runs


class Trainer:
    """GRPO and SFT updates of `peft`, each call one clipped AdamW step.

    Adam moments are reset when the mode changes between "rl" and "sft", as ART does; weight decay applies
    to RL steps only. LoRA dropout draws from `train_rng` (a torch RNG state, saved in checkpoints), never
    from the global stream. Training uses `train_threads` intra-op threads, then goes back to the caller's number.
    `closing` aborts a step between rows when the backend shuts down.
    """

    def __init__(self, peft: PeftModel, tokenizer, optimizer: torch.optim.AdamW, *, seed: int,
                 train_rng: torch.Tensor, weight_decay: float, max_grad_norm: float, train_threads: int,
                 closing: threading.Event, mode: str | None = None) -> None:
        self.peft = peft
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.seed = seed
        self.train_rng = train_rng
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.train_threads = train_threads
        self.closing = closing
        self.mode = mode  # "sft" or "rl": what the Adam moments were built on (saved with checkpoints)
        self._context = None  # the current weights merged, for untrained positions (see `context_model`)
        self._merged: list[tuple[LoraLayer, torch.nn.Linear]] = []  # each LoRA layer and its merged linear
        self._stale = False  # an optimizer step has changed the weights since the merge

    def context_model(self):
        """The current weights (LoRA merged in) in the inference dtype: what untrained positions run through.

        They need no gradient, so they need neither the LoRA's extra matmuls nor float32: in bfloat16 on a
        CPU with AMX, their forward (~90% of an agent trajectory's tokens) runs several times faster. Built
        once (a copy and a merge: ~1.2 s on two cores), then brought up to date in place after each optimizer
        step: each merged linear becomes its base weight plus its LoRA's delta (~0.1 s; only LoRA weights
        train), which saves ~1 s per step where the warm start steps every few episodes."""
        if self._context is None or self._context.dtype != inference_dtype():
            self._context = copy.deepcopy(self.peft).merge_and_unload().to(inference_dtype()).eval()
            self._merged = [(layer, self._context.get_submodule(name))
                            for name, layer in self.peft.get_base_model().named_modules()
                            if isinstance(layer, LoraLayer)]
        elif self._stale:
            with torch.no_grad():
                for layer, linear in self._merged:
                    linear.weight.copy_(layer.base_layer.weight + layer.get_delta_weight(self.peft.active_adapter))
        self._stale = False
        return self._context

    # -- GRPO ------------------------------------------------------------------------------------

    def pack(self, groups: list[TrajectoryGroup], dev_config: dev.TrainConfig, step: int
             ) -> tuple[PackedTensors | None, int]:
        """ART's tokenizer (GRPO advantages, masks, sampled logprobs), then ART's packer with one
        trajectory per row, so plain causal attention is exact and no padding is computed.
        Returns (rows, number of trajectories trained on), or (None, 0) when nothing is trainable."""
        allow = dev_config.get("allow_training_without_logprobs", False)
        context_length = self.peft.get_base_model().config.max_position_embeddings
        with _seeded_global_random(self.seed * 1_000_003 + step):
            # As ART's LocalBackend is configured (backends.internal_config): the groups come from the training
            # loop already in the form every backend trains on (`training_data.for_grpo`).
            results = list(tokenize_trajectory_groups(
                self.tokenizer, groups, allow_training_without_logprobs=allow,
                scale_rewards=dev_config.get("scale_rewards", True), chat_template_tool_schema_format="vllm_openai"))
            too_long = [r for r in results if len(r.token_ids) > context_length]
            if too_long:
                logger.warning("dropping %d trajectories longer than the %d-token context", len(too_long),
                               context_length)
                results = [r for r in results if len(r.token_ids) <= context_length]
            if not results:
                return None, 0
            packed = packed_tensors_from_tokenized_results(
                results, max(len(r.token_ids) for r in results), pad_token_id=self.tokenizer.eos_token_id,
                truncate_long_results=False, advantage_balance=dev_config.get("advantage_balance", 0.0),
                verbosity=0, pack_results=False)
        if not allow and torch.isnan(packed["logprobs"]).all():
            return None, 0  # no Choice with logprobs: nothing ART would train on either
        return packed, len({id(r.trajectory) for r in results})

    def rl_update(self, packed: PackedTensors, learning_rate: float, dev_config: dev.TrainConfig
                  ) -> dict[str, float]:
        """Gradient of ART's loss over all rows, normalised as if they were one packed sequence
        (sum over trained tokens / their count), then one clipped AdamW step."""
        lengths = (packed["input_pos"].max(dim=1).values + 1).tolist()
        targets = shift_tensor(packed["assistant_mask"], False)  # position t is scored on token t+1
        total = int(targets.sum())
        kl = dev_config.get("kl_penalty_coef", 0.0) > 0
        self._prepare_optimizer("rl", learning_rate)
        loss_sum = entropy_sum = 0.0
        rows = [(packed["tokens"][row:row + 1, :length], targets[row:row + 1, :length])
                for row, length in enumerate(lengths)]
        with self._training():
            prefix = self.shared_prefix(rows)
            for row, length in enumerate(lengths):
                self._check_open()
                inputs = {key: value[row:row + 1, :length] for key, value in packed.items()
                          if isinstance(value, torch.Tensor)}
                new_logprobs, entropy = self.target_logprobs(*rows[row], prefix)
                reference = None
                if kl:
                    with torch.no_grad(), self.peft.disable_adapter():
                        reference, _ = self.target_logprobs(*rows[row], context=False)
                loss = art_loss_fn(inputs, new_logprobs, reference, None, dev_config, reduction="sum")
                (loss.policy_loss / total).backward()
                loss_sum += loss.policy_loss.item()
                entropy_sum += entropy
            grad_norm = self._optimizer_step(self.max_grad_norm)
        # ART LocalBackend's keys, so one step line reads either backend
        return {"loss/train": loss_sum / total, "loss/grad_norm": grad_norm, "loss/entropy": entropy_sum / total,
                "loss/learning_rate": learning_rate, "data/step_row_tokens": float(sum(lengths)),
                "data/step_trainer_tokens": float(total)}

    # -- log-probabilities -------------------------------------------------------------------------

    def shared_prefix(self, rows: Rows) -> Prefix | None:
        """Keys/values of the tokens every row starts with, ahead of any trained position, computed once
        without gradient (the prompt's tool block: a third of a short trajectory's tokens).

        Rows then run only their own tokens on top of it. Log-probs are exactly those of the full
        sequence; the gradient leaves out the path through the shared prompt's own keys/values (a
        stop-gradient on the tool block), which SFT and GRPO learn without at a fraction of the cost.
        """
        starts = [int(targets[0].nonzero()[0]) for _, targets in rows if targets.any()]
        if len(rows) < 2 or len(starts) < len(rows):
            return None
        first, length = rows[0][0][0], min(starts)
        for tokens, _ in rows[1:]:
            n = min(length, tokens.shape[1])
            differ = (tokens[0, :n] != first[:n]).nonzero()
            length = int(differ[0]) if len(differ) else n
        if length < 32:
            return None
        with torch.no_grad():
            cache = self.context_model()(input_ids=first[None, :length], use_cache=True).past_key_values
        return length, [(k, v) for k, v, _ in cache]

    def target_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor, prefix: Prefix | None = None,
                        context: bool = True) -> tuple[torch.Tensor, float]:
        """[1, L] log-probs of token t+1 at each position t where targets is set (0 elsewhere), plus the
        summed entropy there.

        Two passes. First the row runs, from the end of `prefix` (see `shared_prefix`) on, through
        `context_model` without gradient, which gives the keys/values of every position. Then all its trained
        segments (runs of trained positions: the assistant turns) run at once, each position attending to the
        context before its own segment and to its segment's earlier positions; only this pass builds a graph,
        and it computes logits at trained positions alone (the 49k-wide LM head is a large part of a small
        model's cost). Untrained positions (the prompt, the question, tool results: ~90% of an agent's tokens)
        so cost one forward in the inference dtype, and the assistant turns one forward and backward together
        instead of one each. The log-probs are those of one pass over the row (exactly, in float32); the
        gradient leaves out the paths through the context's keys/values (a stop-gradient: each assistant turn
        is trained given what it saw). `context=False` runs both passes through `peft` as it is (the reference
        pass of a KL penalty, with its adapter disabled).
        """
        start, layers = (0, []) if prefix is None else prefix
        segments = _runs(targets[0].tolist(), start)
        if not segments:
            return torch.zeros(1, tokens.shape[1]), 0.0
        context_model = self.context_model() if context else self.peft
        past = segments[-1][0]  # the context needed: every position before the last segment
        cache = DynamicCache([(k.to(context_model.dtype), v.to(context_model.dtype)) for k, v in layers] or None)
        if past > start:
            with torch.no_grad():
                context_model(input_ids=tokens[:, start:past], past_key_values=cache, use_cache=True,
                              logits_to_keep=1)
        trained_model = self.peft.get_base_model()
        dtype = next(trained_model.parameters()).dtype
        cache = DynamicCache([(layer.keys.to(dtype), layer.values.to(dtype)) for layer in cache.layers] or None)
        positions = torch.cat([torch.arange(begin, end) for begin, end in segments])
        segment_of = torch.cat([torch.full((end - begin,), i) for i, (begin, end) in enumerate(segments)])
        begins = torch.tensor([begin for begin, _ in segments])[segment_of]
        # Position t (of segment s) sees the context before s begins, and s's own positions up to t.
        sees_context = torch.arange(past)[None, :] < begins[:, None]
        sees_own = (segment_of[:, None] == segment_of[None, :]) & (positions[None, :] <= positions[:, None])
        mask = torch.cat([sees_context, sees_own], dim=1)[None, None]
        hidden = trained_model.model(input_ids=tokens[:, positions], attention_mask=mask, position_ids=positions[None],
                                     past_key_values=cache, use_cache=True).last_hidden_state[0]
        logprobs = torch.log_softmax(trained_model.lm_head(hidden).float(), -1)
        picked = logprobs.gather(-1, tokens[0, positions + 1, None])[:, 0]
        entropy = float(-(logprobs.exp() * logprobs).sum().detach())
        return torch.zeros(tokens.shape[1]).index_put((positions,), picked).unsqueeze(0), entropy

    # -- SFT ---------------------------------------------------------------------------------------

    def sft_batch(self, trajectories: list[Trajectory], learning_rate: float) -> dict[str, float]:
        """Mean negative log-likelihood of the assistant tokens (each turn's text and its end of turn, found as
        ART's tokenizer finds sampled turns: `assistant_token_mask`), then one AdamW step with gradients clipped
        to norm 1."""
        started = time.monotonic()
        examples = []
        for trajectory in trajectories:
            ids, mask = assistant_token_mask(self.tokenizer, get_messages(trajectory.messages_and_choices),
                                             trajectory.tools)
            tokens = torch.tensor([ids])
            targets = shift_tensor(torch.tensor([mask], dtype=torch.bool), False)
            if targets.any():
                examples.append((tokens, targets))
        total = sum(int(targets.sum()) for _, targets in examples)
        self._prepare_optimizer("sft", learning_rate)
        loss_sum = 0.0
        with self._training():
            prefix = self.shared_prefix(examples)
            for tokens, targets in examples:
                self._check_open()
                logprobs, _ = self.target_logprobs(tokens, targets, prefix)
                loss = -logprobs.sum() / total
                loss.backward()
                loss_sum += loss.item()
            grad_norm = self._optimizer_step(1.0) if examples else 0.0
        num_tokens = sum(tokens.shape[1] for tokens, _ in examples)
        return {"loss": loss_sum, "learning_rate": learning_rate, "grad_norm": grad_norm,
                "num_trajectories": float(len(examples)), "num_tokens": float(num_tokens),
                "num_trainable_tokens": float(total), "tokens_per_s": num_tokens / (time.monotonic() - started)}

    # -- the optimizer step ------------------------------------------------------------------------

    def _prepare_optimizer(self, mode: str, learning_rate: float) -> None:
        if self.mode not in (None, mode):
            self.optimizer.state.clear()
        self.mode = mode
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
            group["weight_decay"] = self.weight_decay if mode == "rl" else 0.0

    @contextlib.contextmanager
    def _training(self):
        """Train mode (LoRA dropout) on the trainer's own RNG stream (restored on resume), all train threads."""
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over from an aborted step
        self.peft.train()
        threads = torch.get_num_threads()
        torch.set_num_threads(self.train_threads)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.train_rng)
                yield
                self.train_rng = torch.get_rng_state()
        finally:
            torch.set_num_threads(threads)
            self.peft.eval()

    def _optimizer_step(self, max_grad_norm: float) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        self.optimizer.step()
        self._stale = True  # the merged copy is brought up to date when next read
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _check_open(self) -> None:
        if self.closing.is_set():
            raise RuntimeError("the CPU backend was closed during training")
