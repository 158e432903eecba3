"""The generation engine: one worker thread that owns the model, decodes concurrent requests as one
continuous batch over a KV cache that grows in place, and keeps a prefix KV cache of recent prompts.

Decoding speculates by prompt lookup: the agent's tool calls and answers are mostly copies of its context
(message ids, JSON boilerplate, sentences of an email), so each row drafts the tokens that followed the last
earlier occurrence of its latest tokens, and one forward verifies every row's draft. Greedy rows keep exactly
the tokens of one-token decoding; sampled rows keep their distribution (speculative sampling).

Owns everything that runs the model at inference time, and the rule that calls from other threads
(training, loading) run between batches, never while a row decodes. It knows nothing of HTTP, chat
messages or tokenizing text (`server`), nor of training (`trainer`), which it only runs as a `Worker.call`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .model import inference_dtype

# Intra-op threads. Decoding one token per row is bound by reading the weights and the cache and gains little
# from a second thread, while the event loop (HTTP, templates, the rollouts' tools) needs the other core:
# OpenMP threads that lose their core to another busy thread stall at every barrier, and small matmuls then
# take 100x longer. Prefill is large matmuls, bound by arithmetic, and a second thread nearly halves it
# (bench/bench_serving.py measures both). Workers with work at the same time (an evaluation serves each model
# with its own) share the prefill threads, so they never ask for more threads than there are cores; one that
# has finished its share leaves them all to the others. (A prefill counts the busy workers when it starts: one
# that gets work meanwhile can overlap it with a third thread for that one prefill.)
DECODE_THREADS = 1
PREFILL_THREADS = min(2, os.cpu_count() or 1)
_busy_workers: set[Worker] = set()  # workers with rows, requests or calls to run (set.add/discard hold the GIL)

# Speculation. A forward over several positions per row is not free on a CPU: at 8 rows the weights' matmuls
# are already half compute-bound, and each extra position per row costs ~1/5 of a one-token step. So a step
# verifies drafts only when the rows' expected accepted tokens pay for the positions the forward adds,
# counting the rows that draft nothing (they are padded to the widest draft).
DRAFT_TOKENS = 6  # most draft tokens per row and forward; 0 switches speculation off
DRAFT_NGRAM = 3  # the lookup matches the row's last 3 tokens, else 2, else 1
FORWARD_OVERHEAD = 32  # a forward's cost beyond its rows x positions, in positions (weights and cache reads)
ACCEPTANCE_PRIOR, ACCEPTANCE_RATE = 0.5, 0.2  # each row's running estimate that its next draft token is accepted
# Compact the cache once rejected drafts' masked columns are this share of every row. A compaction copies the
# cache (~0.5 s at 8 rows of 1800 columns) and holes cost their share of attention (~0.1 s a step there), so
# a quarter pays back in ~20 steps; rows that finish compact it anyway, most turns are shorter than that.
HOLE_SHARE = 0.25
KEYS_TRANSPOSED = True  # the batch's key cache laid out with positions last (see GrowingLayer)

# Hand freed heap memory back to the OS every TRIM_SECONDS. glibc keeps what each thread frees in that thread's
# arena, and the KV buffers of ever-changing widths fragment them: an evaluation of three demo checkpoints held
# 10.3 GiB with 4.1 GiB of live tensors, and 5.7 GiB when trimmed every 20 s (a trim takes 0.1-0.3 s).
TRIM_SECONDS = 15.0
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only; elsewhere there is nothing to do
_last_trim = [time.monotonic()]


def return_freed_memory(now: float | None = None) -> bool:
    """Trim the heap if TRIM_SECONDS have passed since the last trim by any worker; True if it trimmed."""
    now = time.monotonic() if now is None else now
    if _malloc_trim is None or now - _last_trim[0] < TRIM_SECONDS:
        return False
    _last_trim[0] = now
    _malloc_trim(0)
    return True


# Decode forwards, their rows (row_forwards), the tokens those rows emitted, draft tokens proposed and accepted,
# cache compactions: for benches and tests.
stats: collections.Counter = collections.Counter()


class EngineClosed(RuntimeError):
    """What requests still queued or decoding get when the backend shuts down."""


@dataclass(eq=False)
class Generation:
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
    acceptance: float = ACCEPTANCE_PRIOR  # how often this row's draft tokens were accepted (recent ones weigh more)


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _settle(job: Generation | _Call, result: Any = None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if not job.future.done():
            job.future.set_exception(error) if error is not None else job.future.set_result(result)
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        job.loop.call_soon_threadsafe(settle)


class Worker:
    """Owns the model. Decodes all running requests as one batch (rows join after their own prefill and
    leave when done) and runs training/loading calls between batches, never while a row is decoding,
    so the weights never change under a generation."""

    def __init__(self, max_batch_size: int, name: str = "cpu-backend-worker",
                 prefix_cache_bytes: int = 1 << 30) -> None:
        self.max_batch_size = max_batch_size
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.model = None
        self.tokenizer = None
        self.stop_ids: set[int] = set()
        self.closing = threading.Event()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[Generation] = collections.deque()
        self._calls: collections.deque[_Call] = collections.deque()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def serve(self, model, tokenizer) -> None:
        """Decode with `model` from now on (call it on the worker thread, through `call`)."""
        self.prefix_cache.clear()  # computed by the old weights
        self.model, self.tokenizer = model.to(inference_dtype()), tokenizer
        ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
        eos = model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
        self.stop_ids = {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the worker thread once no row is decoding, and return its result."""
        loop = asyncio.get_running_loop()
        job = _Call(functools.partial(fn, *args), loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    async def generate(self, generation: Generation) -> Generation:
        """Decode `generation` as a row of the running batch; it comes back filled in."""
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
        torch.set_num_threads(DECODE_THREADS)
        batch = _Batch(self)
        try:
            while True:
                return_freed_memory()
                idle = not (batch.rows or self._pending or self._calls)
                if idle:
                    _busy_workers.discard(self)
                if not self._collect(block=idle):
                    break
                _busy_workers.add(self)
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
        finally:
            _busy_workers.discard(self)
        shutdown = EngineClosed("the CPU backend was closed")
        for job in [*batch.rows, *self._pending, *self._calls]:
            _settle(job, error=shutdown)


class PrefixCache:
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
    """Rows decoding together over one left-padded KV cache; each row keeps its own positions. Rejected
    draft tokens leave masked columns (holes) in their rows until `_retire` compacts the cache."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.rows: list[Generation] = []
        self.cache: Cache | None = None
        self.mask: torch.Tensor | None = None  # [rows, cache length], 0 over left padding and holes

    @torch.no_grad()
    def admit(self, row: Generation) -> None:
        if row.future.cancelled():
            return
        prefixes = self.worker.prefix_cache
        try:
            # Prefill alone (no padding waste, causal-only attention), from the longest cached prefix.
            reused, layers = prefixes.longest(row.prompt_ids)
            torch.set_num_threads(max(1, PREFILL_THREADS // max(1, len(_busy_workers))))
            try:
                out = self.worker.model(input_ids=torch.tensor([row.prompt_ids[reused:]]), use_cache=True,
                                        past_key_values=DynamicCache(layers) if layers else None, logits_to_keep=1)
            finally:
                torch.set_num_threads(DECODE_THREADS)
        except Exception as error:  # noqa: BLE001 (one bad request must not stop the others)
            _settle(row, error=error)
            return
        layers, length = [(k, v) for k, v, _ in out.past_key_values], len(row.prompt_ids)
        prefixes.store(row.prompt_ids, layers)
        self.rows.append(row)
        if self.cache is None:
            width, keys, values = length, [[k] for k, _ in layers], [[v] for _, v in layers]
            self.mask = torch.ones(1, length, dtype=torch.long)
        else:
            width = max(self.mask.shape[1], length)
            keys = [[old.keys, k] for old, (k, _) in zip(self.cache.layers, layers)]
            values = [[old.values, v] for old, (_, v) in zip(self.cache.layers, layers)]
            old = torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0))
            new = torch.nn.functional.pad(torch.ones(1, length, dtype=torch.long), (width - length, 0))
            self.mask = torch.cat([old, new])
        self.cache = _cache(keys, values, width, self.rows)
        self._emit(row, verify(out.logits[0, -1:].float(), [], row.temperature, row.top_p, row.generator))
        self._retire()

    @torch.no_grad()
    def step(self) -> None:
        drafts = self._drafts()
        width = 1 + max(map(len, drafts))
        # Each row feeds its last token, then its draft; shorter drafts are padded, and masked.
        input_ids = torch.tensor([[row.tokens[-1], *draft, *[row.tokens[-1]] * (width - 1 - len(draft))]
                                  for row, draft in zip(self.rows, drafts)])
        # The fed tokens' positions in their own sequences, whatever padding their rows have.
        positions = torch.tensor([[len(row.prompt_ids) + len(row.tokens) - 1] for row in self.rows]) + \
            torch.arange(width)
        fed = torch.tensor([[1 + len(draft)] for draft in drafts])
        start = self.mask.shape[1]
        self.mask = torch.cat([self.mask, (torch.arange(width) < fed).long()], dim=1)
        out = self.worker.model(input_ids=input_ids, attention_mask=self.mask, position_ids=positions,
                                past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        kept = []
        for row, draft, logits in zip(self.rows, drafts, out.logits.float()):
            emitted = verify(logits[:1 + len(draft)], draft, row.temperature, row.top_p, row.generator)
            before = len(row.tokens)
            self._emit(row, emitted)
            _update_acceptance(row, draft, len(emitted) - 1)
            kept.append(len(emitted))  # the fed token and the accepted draft tokens are now in the cache
            stats.update(tokens=len(row.tokens) - before, drafted=len(draft), accepted=len(emitted) - 1)
        stats.update(forwards=1, row_forwards=len(self.rows))
        if width > 1:
            # Rejected draft tokens' keys/values must never be attended to again: mask their columns, and
            # drop the columns no row kept.
            self.mask[:, start:] = torch.arange(width) < torch.tensor(kept)[:, None]
            self.mask = self.mask[:, :start + max(kept)]
            self.cache.crop(start + max(kept))
        self._retire()

    def _drafts(self) -> list[list[int]]:
        """Each row's draft, cut to the width that maximises the tokens a forward is expected to emit per
        unit of its cost (no draft at all when one token per row is worth more)."""
        drafts = [propose_draft(row.prompt_ids + row.tokens,
                                min(DRAFT_TOKENS, row.max_new_tokens - len(row.tokens) - 1)) for row in self.rows]
        rows, best, best_value = len(self.rows), 0, 0.0
        for length in range(max(map(len, drafts)) + 1):
            expected = rows + sum(sum(row.acceptance ** i for i in range(1, min(len(draft), length) + 1))
                                  for row, draft in zip(self.rows, drafts))
            value = expected / (FORWARD_OVERHEAD + rows * (1 + length))
            if value > best_value:
                best, best_value = length, value
        return [draft[:best] for draft in drafts]

    def _emit(self, row: Generation, emitted: list[tuple[int, float]]) -> None:
        """Append (token, logprob) pairs up to where one-token decoding would have stopped."""
        for token, logprob in emitted:
            row.tokens.append(token)
            row.logprobs.append(logprob)
            if token in self.worker.stop_ids and not row.ignore_eos:
                row.finish_reason = "stop"
            elif len(row.tokens) >= row.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                return

    def _retire(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if row.finish_reason is None and not row.future.cancelled()]
        for row in self.rows:
            if row.finish_reason is not None:
                _settle(row, result=row)
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return
        width = self.mask.shape[1]
        if len(keep) == len(self.rows) and width - int(self.mask.sum(1).max()) <= HOLE_SHARE * width:
            return
        # Keep the remaining rows, each row's valid columns right-aligned: no rejected drafts' holes, and no
        # left columns that are padding for every row. A stable sort lists each row's masked columns first.
        mask = self.mask[keep]
        width = int(mask.sum(1).max())
        columns = torch.sort(mask, dim=1, stable=True).indices[:, -width:]
        rows = torch.tensor(keep)[:, None]
        self.rows = [self.rows[i] for i in keep]
        self.mask = mask.gather(1, columns)
        self.cache = _cache([[layer.keys[rows, :, columns].transpose(1, 2)] for layer in self.cache.layers],
                            [[layer.values[rows, :, columns].transpose(1, 2)] for layer in self.cache.layers],
                            width, self.rows)
        stats.update(compactions=1)


def propose_draft(ids: list[int], limit: int) -> list[int]:
    """Prompt lookup: up to `limit` tokens that followed the most recent earlier occurrence of the last
    DRAFT_NGRAM tokens of `ids` (then of fewer, down to the last token alone); none without a match."""
    if limit <= 0:
        return []
    sequence = torch.tensor(ids)
    for n in range(min(DRAFT_NGRAM, len(ids) - 1), 0, -1):
        # Windows that end before the last token, so each has a continuation.
        starts = (sequence[:-1].unfold(0, n, 1) == sequence[-n:]).all(1).nonzero()
        if len(starts):
            start = int(starts[-1]) + n
            return ids[start:start + limit]
    return []


def verify(logits: torch.Tensor, draft: list[int], temperature: float, top_p: float,
           generator: torch.Generator) -> list[tuple[int, float]]:
    """The (token, logprob) pairs a row emits from one forward over its last token and `draft`, where
    logits[i] predicts the token after draft[:i]: the accepted draft prefix, then one token of the model's.

    Greedy rows accept a draft token when it is the argmax, so they emit exactly the tokens of one-token
    decoding. Sampled rows run speculative sampling with a point-mass draft: draft token d is accepted with
    probability p(d); on rejection the token is drawn from p without d, renormalised, so every emitted token
    is distributed as if drawn from p. Logprobs are the model's own (temperature 1), whatever the sampling
    temperature, as vLLM returns them by default and as ART's trainer computes them: GRPO's importance ratio
    compares the two, so logprobs at another temperature would bias every step sampled at it.
    """
    emitted = []
    for position, row_logits in enumerate(logits):
        proposed = draft[position] if position < len(draft) else None
        logprobs = torch.log_softmax(row_logits, -1)
        if temperature == 0:
            token = int(row_logits.argmax())
        else:
            probs = torch.softmax(row_logits / temperature, -1)
            if top_p < 1:
                sorted_probs, order = probs.sort(descending=True)
                outside = sorted_probs.cumsum(0) - sorted_probs > top_p
                probs = probs.scatter(0, order[outside], 0.0)
            if proposed is None:
                token = _draw(probs, generator)
            elif float(torch.rand(1, generator=generator)) * float(probs.sum()) < float(probs[proposed]):
                token = proposed
            else:
                probs[proposed] = 0.0
                token = _draw(probs, generator)
        emitted.append((token, float(logprobs[token])))
        if token != proposed:
            return emitted
    return emitted


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from unnormalised `probs`. Inverse CDF: torch.multinomial costs ~1.4 ms over a 49k
    vocabulary, this ~0.1 ms; side="right" never lands on a zero-probability token."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)


def _update_acceptance(row: Generation, draft: list[int], accepted: int) -> None:
    """Fold the draft tokens this forward checked (accepted ones, then the rejected one) into the row's rate."""
    for outcome in [1.0] * accepted + [0.0] * (accepted < len(draft)):
        row.acceptance += ACCEPTANCE_RATE * (outcome - row.acceptance)


def _cache(keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]], width: int,
           rows: list[Generation]) -> Cache:
    """A batch cache from per-layer lists of [rows, heads, seq, dim] parts, stacked along the batch and
    left-padded to `width`, with room for as many tokens as any row may still decode (up to GROWTH)."""
    headroom = min(max(row.max_new_tokens - len(row.tokens) for row in rows), GrowingLayer.GROWTH)
    return Cache(layers=[GrowingLayer(k, v, width, headroom) for k, v in zip(keys, values)])


class GrowingLayer(DynamicLayer):
    """One layer's keys/values as views of buffers with spare positions at the end.

    Appending a decoded token writes one column in place, where transformers' DynamicLayer concatenates
    (torch.cat), copying the whole cache at every step: at 8 rows of 2k tokens that is ~0.7 GB per
    decoded token, more memory traffic than the model's own weights.

    The keys' buffer is stored transposed (position last), so the transposed view attention multiplies by
    is an ordinary matrix whose rows are longer than its positions. Stored row-major, the spare positions
    make the view non-contiguous, and bfloat16 matmul copies the whole cache to multiply it: ~5x the cost
    of a decoding step's attention scores (bench/bench_serving.py, row-major-keys)."""

    GROWTH = 128  # spare positions at most, added again whenever they run out

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], width: int, headroom: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys[0].dtype, keys[0].device, True
        self._keys, self.keys = _stack_left_padded(keys, width, headroom, KEYS_TRANSPOSED)
        self._values, self.values = _stack_left_padded(values, width, headroom)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.keys.shape[2], self.keys.shape[2] + key_states.shape[2]
        if end > self._keys.shape[2]:
            self._keys, self.keys = _stack_left_padded([self.keys], start, max(self.GROWTH, end - start),
                                                       KEYS_TRANSPOSED)
            self._values, self.values = _stack_left_padded([self.values], start, max(self.GROWTH, end - start))
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


def _stack_left_padded(parts: list[torch.Tensor], width: int, headroom: int, transposed: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `parts` stacked along the batch, each right-aligned at `width` (zeros on the left:
    masked positions, but finite, so they add nothing to the attention), in a buffer `headroom` longer.
    Both are [rows, heads, positions, dim]; `transposed` lays the buffer out with positions last."""
    _, heads, _, dim = parts[0].shape
    rows = sum(part.shape[0] for part in parts)
    if transposed:
        buffer = parts[0].new_zeros(rows, heads, dim, width + headroom).transpose(2, 3)
    else:
        buffer = parts[0].new_zeros(rows, heads, width + headroom, dim)
    row = 0
    for part in parts:
        buffer[row:row + part.shape[0], :, width - part.shape[2]:width] = part
        row += part.shape[0]
    return buffer, buffer[:, :, :width]
