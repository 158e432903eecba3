"""CPU backend: tool-call parsing, the tool chat template, the OpenAI-compatible server, a GRPO step
through ART's own loss, SFT, checkpoints (atomic, resumable, corrupt ones refused) and clean shutdown.

Tests marked slow load SmolLM2-135M once per process (~25 s) and share one event loop and one served
backend; training tests get their own backend in a temporary directory.
"""

import asyncio
import copy
import json
import logging
import math
import types
import socket
import threading
import time
import urllib.parse

import pytest

from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE, CheckpointError, CPUBackend, parse_tool_calls, serve_checkpoint
from email_agent.backends.cpu import engine, load_base_model
from email_agent.backends.cpu import model as model_module
from email_agent.backends.cpu.engine import GrowingLayer, PrefixCache, propose_draft, verify
from email_agent.training_data import for_grpo
from email_agent.data import DataError

import aiohttp  # noqa: E402  (after cpu: it sets the offline litellm default before art loads)
import art  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from art._backend_training import build_rl_train_configs  # noqa: E402
from art.preprocessing.tokenize import tokenize_trajectory_groups  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_emails", "description": "Search the inbox for emails matching all keywords.",
    "parameters": {"type": "object", "properties": {"keywords": {"type": "array", "items": {"type": "string"}}},
                   "required": ["keywords"]}}}
SYSTEM = {"role": "system", "content": "You answer questions about the user's email. Use the tools."}
QUESTION = {"role": "user", "content": "When is the budget meeting with Sally?"}


# ----------------------------------------------------------------------------------------------
# Tool-call parsing
# ----------------------------------------------------------------------------------------------

def test_parse_valid_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "search_emails", "arguments": {"keywords": ["x"]}}\n'
                                      '</tool_call>')
    assert content is None
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "search_emails", "arguments": '{"keywords": ["x"]}'}}]
    assert json.loads(calls[0]["function"]["arguments"]) == {"keywords": ["x"]}


def test_arguments_written_as_a_string_stay_a_string_as_vllm_parses_them():
    """A model taught double-encoded arguments writes "arguments": "{...}": vLLM's hermes parser encodes that
    string again, so the tool sees a string, not an object (the CPU server must not be more lenient)."""
    _, calls = parse_tool_calls('<tool_call>\n{"name": "read_email", "arguments": "{\\"message_id\\": \\"x\\"}"}\n'
                                '</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == '{"message_id": "x"}'


def test_parse_invalid_json_keeps_raw_arguments():
    content, calls = parse_tool_calls('<tool_call>{"name": "read_email", "arguments": {"id": 12,}</tool_call>')
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "read_email"
    assert calls[0]["function"]["arguments"] == '{"name": "read_email", "arguments": {"id": 12,}'
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0]["function"]["arguments"])


def test_parse_several_calls_and_text():
    text = ('Let me look.\n<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"q\\": \\"é\\"}"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"k": 1}, '{"q": "é"}']  # as vLLM parses


def test_parse_no_call_and_unclosed_call():
    assert parse_tool_calls("The meeting is on Friday.") == ("The meeting is on Friday.", [])
    assert parse_tool_calls("") == (None, [])
    content, calls = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {}}')  # cut at max_tokens
    assert content is None and calls[0]["function"] == {"name": "a", "arguments": "{}"}


# ----------------------------------------------------------------------------------------------
# Chat template (rendered by transformers' own Jinja renderer, no model needed)
# ----------------------------------------------------------------------------------------------

def render(messages, tools=None, add_generation_prompt=False):
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=TOOL_CHAT_TEMPLATE,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


def assistant_call(arguments, content=None, name="search_emails"):
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}]}


def test_template_lists_tools_in_system_turn_before_the_system_text():
    text = render([SYSTEM, QUESTION], tools=[SEARCH_TOOL], add_generation_prompt=True)
    system_turn = text.split("<|im_end|>")[0]
    assert system_turn.startswith("<|im_start|>system\n# Tools")
    assert system_turn.endswith("</tool_call>\n\n" + SYSTEM["content"])
    tools_json = system_turn.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools_json) == SEARCH_TOOL
    assert text.endswith("<|im_start|>user\n" + QUESTION["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    # Prompts with the same tools share everything before the system text (what the prefix cache reuses).
    other = render([{"role": "system", "content": "Another inbox."}, QUESTION], tools=[SEARCH_TOOL])
    assert other.split("</tool_call>")[0] == text.split("</tool_call>")[0]


def test_template_renders_string_and_dict_arguments_alike():
    as_string = render([QUESTION, assistant_call('{"keywords": ["budget"]}')])
    as_dict = render([QUESTION, assistant_call({"keywords": ["budget"]})])
    expected = ('<|im_start|>assistant\n<tool_call>\n{"name": "search_emails", "arguments": {"keywords": ["budget"]}}'
                '\n</tool_call><|im_end|>\n')
    assert as_string == as_dict
    assert as_string.endswith(expected)


def test_template_renders_invalid_json_raw_and_tool_results():
    broken = '{"keywords": ["budget"'
    text = render([QUESTION, assistant_call(broken, content="Searching."),
                   {"role": "tool", "tool_call_id": "call_0", "content": '[{"message_id": "<1@x>"}]'},
                   {"role": "tool", "tool_call_id": "call_1", "content": "second"}], add_generation_prompt=True)
    assert '<|im_start|>assistant\nSearching.\n<tool_call>\n{"name": "search_emails", "arguments": ' + broken in text
    assert text.endswith('<|im_start|>user\n<tool_response>\n[{"message_id": "<1@x>"}]\n</tool_response>\n'
                         '<tool_response>\nsecond\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_template_without_tools_or_content():
    text = render([QUESTION, {"role": "assistant", "content": None}, {"role": "user", "content": [
        {"type": "text", "text": "parts"}]}])
    assert text == ("<|im_start|>user\n" + QUESTION["content"] + "<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
                    "<|im_start|>user\nparts<|im_end|>\n")


# ----------------------------------------------------------------------------------------------
# Model-backed tests: one event loop and one served backend for the module
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_loads_from_its_kept_conversion_as_from_the_gguf(tmp_path, monkeypatch, caplog):
    """The first load keeps a float32 conversion of the GGUF; later loads read it (the same weights and
    tokens), and a damaged one is converted again instead of failing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def load():
        model_module._load_base_model_once.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=model_module.__name__):
            return load_base_model("smollm2")
    from_gguf, tokenizer = load()
    converted = list((tmp_path / "email-agent").iterdir())
    assert [path.name.endswith("-float32") for path in converted] == [True]
    weights = next(converted[0].glob("*.safetensors"))
    size = weights.stat().st_size
    from_conversion, kept_tokenizer = load()
    assert "converted from" in caplog.text and "discarding" not in caplog.text
    chat = [{"role": "user", "content": "Who approved the Q3 budget? <|im_end|> ünïcode"}]
    assert kept_tokenizer.apply_chat_template(chat, tools=[SEARCH_TOOL], tokenize=True) == \
        tokenizer.apply_chat_template(chat, tools=[SEARCH_TOOL], tokenize=True)
    assert (kept_tokenizer.eos_token, kept_tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    reference = from_gguf.state_dict()
    assert all(torch.equal(value, reference[name]) for name, value in from_conversion.state_dict().items())

    weights.write_bytes(weights.read_bytes()[:1000])  # a damaged conversion
    repaired, _ = load()
    assert "discarding" in caplog.text
    assert torch.equal(repaired.lm_head.weight, from_gguf.lm_head.weight) and weights.stat().st_size == size
    model_module._load_base_model_once.cache_clear()


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def served(loop, tmp_path_factory):
    """Served in float32, where batching, prefix reuse and speculation must not change a logprob; bfloat16 (the
    default on CPUs with AMX) keeps the tokens but not the last digits (test_bfloat16_serving_...)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMAIL_AGENT_CPU_DTYPE", "float32")
        backend = CPUBackend(path=str(tmp_path_factory.mktemp("served")), train_threads=1)
        model = art.TrainableModel(name="agent", project="test", base_model="smollm2", report_metrics=[])
        loop.run_until_complete(model.register(backend))
    yield backend, model
    loop.run_until_complete(backend.close())


def client_for(model) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)


async def ask(model, messages, **kwargs) -> Choice:
    response = await client_for(model).chat.completions.create(
        model=model.get_inference_name(), messages=messages, **{"max_tokens": 16, "logprobs": True, **kwargs})
    return response.choices[0]


@pytest.mark.slow
def test_server_answers_tool_request_in_openai_format(loop, served):
    _, model = served

    async def run():
        response = await client_for(model).chat.completions.create(
            model=model.get_inference_name(), messages=[SYSTEM, QUESTION], tools=[SEARCH_TOOL],
            max_completion_tokens=24, temperature=1.0, seed=3)
        models = await client_for(model).models.list()
        return response, [m.id for m in models.data]

    response, served_names = loop.run_until_complete(run())
    assert served_names == ["agent@0"] and response.model == "agent@0"
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    tokens = choice.logprobs.content
    assert len(tokens) == response.usage.completion_tokens > 0
    assert all(t.token.startswith("token_id:") and int(t.token.split(":")[1]) >= 0 for t in tokens)
    assert all(t.logprob <= 0 and math.isfinite(t.logprob) for t in tokens)
    assert response.usage.prompt_tokens > 100  # the tool schema is in the prompt
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


@pytest.mark.slow
def test_server_rejects_bad_requests_and_keeps_serving(loop, served):
    _, model = served

    async def run():
        client = client_for(model)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nobody@0", messages=[QUESTION])
        with pytest.raises(openai.BadRequestError, match="n=1"):
            await client.chat.completions.create(model=model.get_inference_name(), messages=[QUESTION], n=2)
        with pytest.raises(openai.BadRequestError, match="context length"):
            await client.chat.completions.create(model=model.get_inference_name(), messages=[
                {"role": "user", "content": "word " * 9000}])
        async with aiohttp.ClientSession() as session:
            url = model.inference_base_url + "/chat/completions"
            async with session.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
                malformed = r.status, await r.json()
            async with session.post(url, json={"model": model.get_inference_name(), "messages": "hi"}) as r:
                bad_messages = r.status, await r.json()
        return malformed, bad_messages, await ask(model, [QUESTION], max_tokens=4)

    malformed, bad_messages, choice = loop.run_until_complete(run())
    assert malformed[0] == 400 and "not valid JSON" in malformed[1]["error"]["message"]
    assert bad_messages[0] == 400 and "messages" in bad_messages[1]["error"]["message"]
    assert len(choice.logprobs.content) >= 1  # still serving


@pytest.mark.slow
def test_concurrent_requests_batch_without_changing_results(loop, served):
    _, model = served
    prompts = [[SYSTEM, QUESTION], [{"role": "user", "content": "Write a haiku about snow."}],
               [{"role": "user", "content": "hi"}], [SYSTEM, {"role": "user", "content": "Who sent the memo?"}]]

    async def run():
        together = await asyncio.gather(*(ask(model, p, temperature=0, max_tokens=12) for p in prompts))
        alone = [await ask(model, p, temperature=0, max_tokens=12) for p in prompts]
        return together, alone

    together, alone = loop.run_until_complete(run())
    for a, b in zip(together, alone):
        assert [t.token for t in a.logprobs.content] == [t.token for t in b.logprobs.content]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs.content, b.logprobs.content)) < 1e-3


@pytest.mark.slow
def test_bfloat16_serving_keeps_the_float32_greedy_tool_call(loop, served, monkeypatch):
    """The same checkpoint served in bfloat16 (faster prefill, half the bytes per token) starts its answer to a tool
    request with the float32 tokens (later ones may part at a near tie), with logprobs close to float32's."""
    _, model = served
    messages = [SYSTEM, QUESTION]
    reference = loop.run_until_complete(ask(model, messages, tools=[SEARCH_TOOL], temperature=0, max_tokens=8))
    monkeypatch.setenv("EMAIL_AGENT_CPU_DTYPE", "bfloat16")

    async def in_bfloat16():
        async with serve_checkpoint("smollm2", None, "bf16") as base_url:
            client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
            response = await client.chat.completions.create(model="bf16", messages=messages, tools=[SEARCH_TOOL],
                                                            temperature=0, max_tokens=8, logprobs=True)
            return response.choices[0]

    fast = loop.run_until_complete(in_bfloat16())
    assert [t.token for t in fast.logprobs.content] == [t.token for t in reference.logprobs.content]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(fast.logprobs.content, reference.logprobs.content)) < 0.25


@pytest.mark.slow
def test_models_served_at_once_share_the_prefill_threads(loop, served, monkeypatch):
    """Two models with work at once (an evaluation's contestants) never ask for more threads than cores; once
    one has nothing left to do, the other prefills on all of them."""
    _, model = served
    asked = []
    real = torch.set_num_threads
    monkeypatch.setattr(engine.torch, "set_num_threads", lambda n: (asked.append(n), real(n)))
    monkeypatch.setattr(engine, "PREFILL_THREADS", 2)

    def prefill_threads(prompt: str) -> int:
        asked.clear()
        loop.run_until_complete(ask(model, [{"role": "user", "content": prompt}], temperature=0, max_tokens=1))
        return max(asked)

    alone = prefill_threads("Which room is the workshop in?")
    other = engine.Worker(max_batch_size=1, name="second-model")
    started, release = threading.Event(), threading.Event()

    def hold() -> None:  # keeps the other worker busy until released
        started.set()
        release.wait()
    try:
        holding = loop.create_task(other.call(hold))
        loop.run_until_complete(asyncio.to_thread(started.wait))
        shared = prefill_threads("Which day is the kickoff?")
        release.set()
        loop.run_until_complete(holding)
        deadline = time.monotonic() + 10
        while other in engine._busy_workers and time.monotonic() < deadline:  # it marks itself idle just after
            time.sleep(0.01)
        other_idle = prefill_threads("Who approved the budget?")
    finally:
        release.set()
        other.close()
    assert (alone, shared, other_idle, prefill_threads("Who signed the lease?")) == (2, 1, 2, 2)


@pytest.mark.slow
def test_follow_up_turn_reuses_cached_prefix_with_identical_results(loop, served):
    backend, model = served
    cache = backend.worker.prefix_cache
    first_turn = [SYSTEM, QUESTION]
    follow_up = [SYSTEM, QUESTION, assistant_call('{"keywords": ["budget", "Sally"]}'),
                 {"role": "tool", "tool_call_id": "call_0", "content": '[{"message_id": "<1@x>", "subject": "Budget"}]'}]

    async def run():
        first = await ask(model, first_turn, tools=[SEARCH_TOOL], temperature=0, max_tokens=8)
        reused_before = cache.hit_tokens
        cached = await ask(model, follow_up, tools=[SEARCH_TOOL], temperature=0, max_tokens=8)
        reused = cache.hit_tokens - reused_before
        await backend.worker.call(cache.clear)
        fresh = await ask(model, follow_up, tools=[SEARCH_TOOL], temperature=0, max_tokens=8)
        return first, reused, cached, fresh

    first, reused, cached, fresh = loop.run_until_complete(run())
    assert reused > 100  # at least the tool block and the question
    assert [t.token for t in cached.logprobs.content] == [t.token for t in fresh.logprobs.content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(cached.logprobs.content, fresh.logprobs.content)) < 1e-4


def test_prefix_cache_keeps_longest_entries_within_its_budget():
    cache = PrefixCache(max_bytes=32)  # room for 4 tokens' keys and values (float32, one layer, one dim)

    def layers(n):
        return [(torch.full((1, 1, n, 1), float(n)), torch.full((1, 1, n, 1), float(n)))]

    cache.store([1, 2], layers(2))
    cache.store([1, 2, 3], layers(3))  # covers [1, 2]: that entry goes
    assert list(cache.entries) == [(1, 2, 3)]
    reused, kv = cache.longest([1, 2, 3, 4] * 10)
    assert reused == 0 and kv is None  # shorter than MIN_REUSE
    cache.MIN_REUSE = 1
    reused, kv = cache.longest([1, 2, 9])
    assert reused == 2 and kv[0][0].shape[2] == 2  # a view of the first two positions
    reused, _ = cache.longest([1, 2, 3])
    assert reused == 2  # the last prompt token is always computed, for its logits
    cache.store([7, 8], layers(2))  # over budget: the least recently used entry goes
    assert list(cache.entries) == [(7, 8)] and cache.bytes == 16

@pytest.mark.skipif(engine._malloc_trim is None, reason="malloc_trim is glibc's; other C libraries have no such call")
def test_worker_hands_memory_freed_in_its_thread_back_to_the_os():
    """Catches the engine leaving freed KV buffers in glibc's per-thread arenas (an evaluation of three
    checkpoints grew to 13.5 GiB around 4 GiB of live tensors): 300 MB freed in a thread stay resident until
    the periodic trim, which runs at most every TRIM_SECONDS."""
    process = psutil.Process()

    def allocate_and_free():
        blocks = [bytearray(64 * 1024) for _ in range(4800)]  # below the mmap threshold: from the arena heap
        keep = blocks[-1]  # pins the heap's top, so only a trim of the middle gives memory back
        del blocks
        freed.append(keep)

    freed: list = []
    thread = threading.Thread(target=allocate_and_free)
    thread.start()
    thread.join()
    before = process.memory_info().rss
    now = time.monotonic()
    assert engine.return_freed_memory(now + engine.TRIM_SECONDS)
    assert not engine.return_freed_memory(now + engine.TRIM_SECONDS + 1)  # too soon after the last one
    assert before - process.memory_info().rss > 200 * 2**20



def test_growing_kv_layer_matches_concatenation_and_grows_past_its_room():
    short, long = torch.randn(1, 3, 4, 8), torch.randn(2, 3, 6, 8)
    layer = GrowingLayer([short, long], [short * 2, long * 2], width=6, headroom=2)
    padded = torch.cat([torch.nn.functional.pad(short, (0, 0, 2, 0)), long])  # left padding is zeros
    assert torch.equal(layer.keys, padded) and torch.equal(layer.values, padded * 2)
    reference = padded
    for _ in range(5):  # 2 positions of room, then it must grow
        new = torch.randn(3, 3, 1, 8)
        keys, values = layer.update(new, new * 2)
        reference = torch.cat([reference, new], dim=2)
        assert torch.equal(keys, reference) and torch.equal(values, reference * 2)
        # Positions last: the transposed keys attention multiplies by are a plain strided matrix, which bfloat16
        # matmul reads in place (a non-contiguous row-major view it would copy whole at every step).
        assert keys.transpose(-1, -2).stride(-1) == 1
    assert layer.get_seq_length() == 11


# ----------------------------------------------------------------------------------------------
# Speculative decoding (prompt lookup)
# ----------------------------------------------------------------------------------------------

def test_draft_copies_what_followed_the_latest_match_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 8, 1, 2, 3]
    # [1, 2, 3] occurs at 0 only (followed by 4, 5, ...); [2, 3] alone would match later, at 6 (followed by 6).
    assert propose_draft(ids, 4) == [4, 5, 9, 2]
    assert propose_draft(ids, 2) == [4, 5]
    assert propose_draft(ids[:9] + [2, 3], 3) == [6, 2, 3]  # [6, 2, 3] has no earlier match; [2, 3] at 6 wins
    assert propose_draft([5, 6, 7, 6], 3) == [7, 6]  # down to one token, cut at the end of the sequence
    assert propose_draft([5, 6, 7, 8], 3) == []  # no earlier occurrence of the last token
    assert propose_draft(ids, 0) == [] and propose_draft([4], 3) == []


def test_greedy_verification_accepts_the_argmax_prefix_then_the_model_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0],   # argmax 1
                           [0.0, 0.0, 0.0, 5.0],   # argmax 3
                           [2.0, 0.0, 1.0, 0.0],   # argmax 0
                           [0.0, 0.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(logits, -1)
    assert verify(logits, [1, 3, 2], 0.0, 1.0, generator) == [
        (1, float(logprobs[0, 1])), (3, float(logprobs[1, 3])), (0, float(logprobs[2, 0]))]  # 2 rejected
    assert verify(logits[:3], [1, 3], 0.0, 1.0, generator) == [
        (1, float(logprobs[0, 1])), (3, float(logprobs[1, 3])), (0, float(logprobs[2, 0]))]  # all + one more
    assert verify(logits[:1], [], 0.0, 1.0, generator) == [(1, float(logprobs[0, 1]))]


def test_sampled_verification_accepts_certain_drafts_and_never_emits_a_rejected_one():
    logits = torch.tensor([[4.0, 0.0, 0.0, -1.0], [0.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    temperature, top_p = 0.7, 0.5  # top_p keeps only the leading token of rows 0 and 1
    logprobs = torch.log_softmax(logits, -1)  # what ART is given: the model's own (temperature 1), unfiltered
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        emitted = verify(logits, [0, 1], temperature, top_p, generator)
        assert [t for t, _ in emitted[:2]] == [0, 1]  # p(draft) = 1 after top_p: always accepted
        assert emitted[2][1] == float(logprobs[2, emitted[2][0]])
        generator = torch.Generator().manual_seed(seed)
        emitted = verify(logits, [3, 1], temperature, top_p, generator)
        assert emitted == [(0, float(logprobs[0, 0]))]  # p(3) = 0: rejected, p without 3 leaves only 0


def test_sampled_verification_keeps_the_model_distribution():
    """Speculative sampling with a point-mass draft: the first emitted token is distributed as p whatever the
    draft, and after an accepted draft token the next one is drawn from the next position's p."""
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])
    temperature, trials = 1.3, 6000
    p = torch.softmax(logits / temperature, -1)
    generator = torch.Generator().manual_seed(1)
    first, second = torch.zeros(3), torch.zeros(3)
    for _ in range(trials):
        emitted = verify(logits, [1], temperature, 1.0, generator)
        first[emitted[0][0]] += 1
        if len(emitted) == 2:
            second[emitted[1][0]] += 1
    tolerance = 4 * (p * (1 - p) / trials).sqrt()  # four standard errors
    assert ((first / trials - p[0]).abs() < tolerance[0]).all(), (first / trials, p[0])
    assert first[1] == second.sum()  # accepted draft tokens, each followed by one model token
    assert ((second / second.sum() - p[1]).abs() < 4 * (p[1] * (1 - p[1]) / second.sum()).sqrt()).all()


def test_emitted_run_stops_where_one_token_decoding_would():
    worker = types.SimpleNamespace(stop_ids={2})
    batch = engine._Batch(worker)

    def row(max_new_tokens, ignore_eos=False):
        return engine.Generation([1], max_new_tokens, 0.0, 1.0, ignore_eos, None, None, None,
                                 tokens=[1], logprobs=[0.0])

    emitted = [(5, -0.1), (2, -0.2), (7, -0.3)]
    stopped, cut, through = row(10), row(3), row(10, ignore_eos=True)
    for generation in (stopped, cut, through):
        batch._emit(generation, emitted)
    assert stopped.tokens == [1, 5, 2] and stopped.logprobs == [0.0, -0.1, -0.2] and stopped.finish_reason == "stop"
    assert cut.tokens == [1, 5, 2] and cut.finish_reason == "stop"
    assert through.tokens == [1, 5, 2, 7] and through.finish_reason is None
    batch._emit(through, emitted)
    assert through.tokens == [1, 5, 2, 7, 5, 2, 7] and through.finish_reason is None
    short = row(3, ignore_eos=True)
    batch._emit(short, emitted)
    assert short.tokens == [1, 5, 2] and short.finish_reason == "length"


def test_compaction_right_aligns_each_rows_valid_keys_and_values():
    batch = engine._Batch(types.SimpleNamespace(stop_ids=set()))
    batch.rows = [engine.Generation([1], 8, 0.0, 1.0, False, None, None, types.SimpleNamespace(cancelled=lambda: False))
                  for _ in range(2)]
    batch.mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0]])  # rejected drafts left holes
    keys = torch.randn(2, 3, 6, 4)
    batch.cache = engine._cache([[keys]], [[keys * 2]], 6, batch.rows)
    batch._retire()
    assert batch.mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    layer = batch.cache.layers[0]
    assert torch.equal(layer.keys[0, :, 1:], keys[0, :, [1, 2, 4]]) and torch.equal(layer.keys[1], keys[1, :, :4])
    assert torch.equal(layer.values, layer.keys * 2)
    new = torch.randn(2, 3, 1, 4)
    assert torch.equal(layer.update(new, new)[0][:, :, -1:], new)  # still grows in place
    batch.mask = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 1, 1]])  # a full row: compacting would gain nothing
    batch._retire()
    assert batch.mask.shape == (2, 5)


@pytest.mark.slow
def test_speculation_keeps_greedy_tokens_and_logprobs(loop, served, monkeypatch):
    """Concurrent requests of different lengths that copy from their prompts: the same tokens and logprobs with
    speculation (compacting the cache at every step, or only past HOLE_SHARE) as one token per forward."""
    _, model = served
    message_id, body = "<demo.000201@larkspur.example>", ("Hi team, the quarterly budget meeting with Sally moves "
                                                          "to Friday at 3pm in room 4B. Bring the Q3 forecast.")
    prompts = [[{"role": "user", "content": "Repeat exactly: <a.17@corp.example>"},
                {"role": "assistant", "content": "<a.17@corp.example>"},
                {"role": "user", "content": f"Repeat exactly: {message_id}"}],
               [{"role": "user", "content": f"Copy this text exactly: {body}"}],
               [{"role": "user", "content": "Continue the list up to 20: 1, 2, 3, 4, 5, 6, 7, 8"}],
               [{"role": "user", "content": 'Output this JSON exactly: {"name": "read_email", "arguments": '
                                            f'{{"message_id": "{message_id}"}}}}'}],
               [SYSTEM, QUESTION]]
    lengths = [24, 40, 30, 36, 16]

    async def run():
        return await asyncio.gather(*(ask(model, p, temperature=0, max_tokens=n) for p, n in zip(prompts, lengths)))

    def decode():
        before = engine.stats.copy()
        choices = loop.run_until_complete(run())
        return choices, engine.stats - before

    monkeypatch.setattr(engine, "HOLE_SHARE", 0.0)
    compacting, compacting_stats = decode()
    monkeypatch.undo()
    speculative, speculative_stats = decode()
    monkeypatch.setattr(engine, "DRAFT_TOKENS", 0)
    plain, plain_stats = decode()
    assert plain_stats["drafted"] == 0 and plain_stats["tokens"] == plain_stats["row_forwards"]
    for run_stats in (compacting_stats, speculative_stats):
        assert run_stats["accepted"] > 10 and run_stats["forwards"] < plain_stats["forwards"], run_stats
    assert compacting_stats["compactions"] >= 1
    for choices in (compacting, speculative):
        for a, b in zip(choices, plain):
            assert [t.token for t in a.logprobs.content] == [t.token for t in b.logprobs.content]
            assert a.finish_reason == b.finish_reason
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs.content, b.logprobs.content)) < 1e-4
    assert plain[0].message.content == message_id and plain[1].message.content == body  # copied from the prompt


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def completion_logprob(backend, messages, choice) -> float:
    """Sum of log p(sampled tokens | prompt) under the backend's current LoRA, measured directly."""
    tokenizer = backend.trainer.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    completion = [int(t.token.split(":")[1]) for t in choice.logprobs.content]
    with torch.no_grad():
        logits = backend.trainer.peft(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
    return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).sum())


def lora_weights(backend) -> dict:
    return {k: v.detach().clone() for k, v in backend.trainer.peft.named_parameters() if "lora_" in k}


@pytest.mark.slow
def test_train_step_moves_logprobs_checkpoints_and_resumes(loop, tmp_path):
    messages = [SYSTEM, QUESTION]

    async def first_run():
        backend = CPUBackend(path=str(tmp_path), seed=1, train_threads=1)
        model = art.TrainableModel(name="agent", project="test", base_model="smollm2", report_metrics=[])
        await model.register(backend)
        good, bad = await asyncio.gather(ask(model, messages, seed=1), ask(model, messages, seed=2))
        assert [t.token for t in good.logprobs.content] != [t.token for t in bad.logprobs.content]
        before = completion_logprob(backend, messages, good), completion_logprob(backend, messages, bad)
        group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, good], reward=1.0),
                                     art.Trajectory(messages_and_choices=[*messages, bad], reward=0.0)])
        result = await backend.train(model, [group], learning_rate=1e-3)
        after = completion_logprob(backend, messages, good), completion_logprob(backend, messages, bad)
        await model.log([group], split="train", metrics=result.metrics, step=result.step)
        served_names = [m.id for m in (await client_for(model).models.list()).data]
        with pytest.raises(openai.NotFoundError):
            await client_for(model).chat.completions.create(model="agent@0", messages=messages)
        greedy = await ask(model, messages, temperature=0, max_tokens=8)  # agent@1 answers
        # All rewards equal: no update, but the step still advances (as LocalBackend does).
        flat = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, good], reward=0.5)] * 2)
        flat_result = await backend.train(model, [flat], learning_rate=1e-3)
        weights, step = lora_weights(backend), await model.get_step()
        optimizer = backend.trainer.optimizer.state_dict()
        # ART's Backend protocol method (model.delete_checkpoints picks the steps from a val metric).
        await backend._delete_checkpoint_files(model, [1, 2])
        await backend.close()
        # The evaluation path: the same checkpoint served on its own answers the same, greedily.
        checkpoint = tmp_path / "test" / "models" / "agent" / "checkpoints" / "0001"
        async with serve_checkpoint("smollm2", str(checkpoint), "agent-eval") as base_url:
            client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
            evaluated = (await client.chat.completions.create(
                model="agent-eval", messages=messages, temperature=0, max_tokens=8, logprobs=True)).choices[0]
        assert [t.token for t in evaluated.logprobs.content] == [t.token for t in greedy.logprobs.content]
        sampled = sum(len(c.logprobs.content) for c in (good, bad))
        return result, flat_result, before, after, served_names, weights, step, optimizer, sampled

    result, flat_result, before, after, served_names, weights, step, optimizer, sampled = loop.run_until_complete(
        first_run())
    assert after[0] > before[0] and after[1] < before[1], (before, after)
    assert result.step == 1 and served_names == ["agent@1"]
    # ART LocalBackend's keys, which the training loop's step line reads
    assert {"loss/train", "loss/grad_norm", "data/step_num_trajectories", "data/step_num_groups_trainable",
            "data/step_trainer_tokens", "time/step_trainer_s"} <= set(result.metrics)
    assert result.metrics["data/step_num_trajectories"] == 2 and result.metrics["data/step_num_trained_trajectories"] == 2
    assert result.metrics["data/step_trainer_tokens"] == sampled
    assert result.metrics["loss/grad_norm"] > 0
    checkpoint = tmp_path / "test" / "models" / "agent" / "checkpoints" / "0001"
    assert result.checkpoint_path == str(checkpoint)
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"} <= {
        p.name for p in checkpoint.iterdir()}
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 1
    assert json.loads((checkpoint / "trainer_state.json").read_text())["mode"] == "rl"  # Adam moments' kind
    history = (tmp_path / "test" / "models" / "agent" / "history.jsonl").read_text()
    assert '"loss/train"' in history
    assert flat_result.step == step == 2 and flat_result.metrics["data/step_num_groups_trainable"] == 0
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["0001", "0002"]  # 0000 deleted, no temp dirs

    async def resume():
        backend = CPUBackend(path=str(tmp_path), seed=1, train_threads=1)
        model = art.TrainableModel(name="agent", project="test", base_model="smollm2", report_metrics=[])
        await model.register(backend)
        state = lora_weights(backend), await model.get_step(), model.get_inference_name()
        optimizer_state = backend.trainer.optimizer.state_dict()
        assert backend.trainer.mode == "rl"  # so a resumed SFT step would reset the RL moments, as without a restart
        await backend.close()
        return (*state, optimizer_state)

    resumed_weights, resumed_step, name, resumed_optimizer = loop.run_until_complete(resume())
    assert resumed_step == 2 and name == "agent@2"
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)
    assert any(w.abs().sum() > 0 for k, w in weights.items() if "lora_B" in k)  # really trained
    assert all(torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
               for a, b in zip(optimizer["state"].values(), resumed_optimizer["state"].values()))


def sampled_choice(message: dict, token_ids: list[int], finish_reason: str = "stop") -> Choice:
    """A Choice as the engine returns it: the message and one logprob per sampled token id."""
    return Choice.model_validate({
        "index": 0, "finish_reason": finish_reason, "message": {"role": "assistant", **message},
        "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                 for i in token_ids]}})


@pytest.mark.slow
def test_sampled_tool_call_tokens_appear_once_in_training_sequence(served):
    backend, _ = served
    tokenizer = backend.trainer.tokenizer
    call_text = '<tool_call>\n{"name": "search_emails", "arguments": {"keywords": ["budget"]}}\n</tool_call>'
    ids = tokenizer.encode(call_text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    _, calls = parse_tool_calls(call_text)
    choice = sampled_choice({"content": None, "tool_calls": calls}, ids, "tool_calls")
    answer = sampled_choice({"content": "Friday."}, tokenizer.encode("Friday.", add_special_tokens=False) + ids[-1:])
    trajectory = art.Trajectory(messages_and_choices=[
        SYSTEM, QUESTION, choice, {"role": "tool", "tool_call_id": "call_0", "content": "[]"}, answer],
        tools=[SEARCH_TOOL], reward=1.0)
    group = art.TrajectoryGroup([trajectory, trajectory.model_copy(update={"reward": 0.0})])
    call = '<tool_call>\n{"name": "search_emails"'
    unfixed = next(tokenize_trajectory_groups(tokenizer, [group], False, True))
    assert tokenizer.decode(unfixed.token_ids).count(call) == 2  # ART alone renders the sampled call twice
    result = next(tokenize_trajectory_groups(tokenizer, for_grpo([group], "string"), False, True))
    text = tokenizer.decode(result.token_ids)
    assert text.count(call) == 1
    assert text.endswith('</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n[]\n</tool_response><|im_end|>'
                         '\n<|im_start|>assistant\nFriday.<|im_end|>')
    trained = [t for t, m in zip(result.token_ids, result.assistant_mask) if m]
    assert trained == ids + tokenizer.encode("Friday.", add_special_tokens=False) + ids[-1:]


@pytest.mark.slow
@pytest.mark.parametrize("scale_rewards, advantages", [(True, [1.0]), (False, [0.5, 1.5])])
def test_grpo_advantage_is_divided_by_the_group_std_only_with_scale_rewards(served, scale_rewards, advantages):
    """ART scales the whole batch's advantages to a mean magnitude of 1 either way; scale_rewards decides whether
    each group is first divided by its own std (a 3-vs-0 group then weighs as much as a 1-vs-0 one) or not."""
    backend, _ = served
    tokenizer = backend.trainer.tokenizer
    ids = tokenizer.encode("Friday.", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    answer = sampled_choice({"content": "Friday."}, ids)
    episode = art.Trajectory(messages_and_choices=[SYSTEM, QUESTION, answer], reward=0.0)
    groups = [art.TrajectoryGroup([episode.model_copy(update={"reward": high}), episode.model_copy()])
              for high in (3.0, 1.0)]
    _, dev_config = build_rl_train_configs(learning_rate=1e-4, scale_rewards=scale_rewards)
    packed, trained = backend.trainer.pack(groups, dev_config, step=0)
    assert trained == 4
    per_token = packed["advantages"][packed["assistant_mask"].bool()].tolist()
    assert sorted({round(abs(a), 4) for a in per_token}) == advantages
    assert round(sum(per_token), 4) == 0  # each group's advantages still sum to zero


@pytest.mark.slow
def test_sft_trains_on_assistant_turns(loop, tmp_path):
    trajectory = art.Trajectory(messages_and_choices=[
        SYSTEM, QUESTION, assistant_call({"keywords": ["budget", "Sally"]}),
        {"role": "tool", "tool_call_id": "call_0", "content": "[]"},
        {"role": "assistant", "content": "I don't know."}], tools=[SEARCH_TOOL], reward=0.0)

    async def run():
        backend = CPUBackend(path=str(tmp_path), train_threads=1)
        model = art.TrainableModel(name="sft", project="test", base_model="smollm2", report_metrics=[])
        await model.register(backend)
        config = art.TrainSFTConfig(learning_rate=1e-3, batch_size=1)
        await model.train_sft([trajectory], config)  # one batch, so the step's logged metrics are that batch's
        await model.train_sft([trajectory], config)
        step = await model.get_step()
        await backend.close()
        return step

    step = loop.run_until_complete(run())
    history = (tmp_path / "test" / "models" / "sft" / "history.jsonl").read_text().splitlines()
    first, second = [row for row in map(json.loads, history) if "train/loss" in row]
    tokens = first["train/num_trainable_tokens"]
    # The two assistant turns (tool call and answer, each with its <|im_end|>), nothing else.
    assert 25 < tokens < 45, tokens
    assert second["train/loss"] < first["train/loss"]
    assert step == 2
    saved = tmp_path / "test" / "models" / "sft" / "checkpoints" / "0002" / "trainer_state.json"
    assert json.loads(saved.read_text())["mode"] == "sft"  # a resumed RL step resets these moments


@pytest.mark.slow
def test_merged_weights_follow_each_step_in_place_and_serving_keeps_its_own_copy(loop, tmp_path, monkeypatch):
    """The trainer's merged copy is updated in place after each optimizer step, to exactly what a fresh copy and
    merge give; the server decodes with a copy made at publish time, which a later step leaves alone."""
    monkeypatch.setenv("EMAIL_AGENT_CPU_DTYPE", "float32")
    trajectory = art.Trajectory(messages_and_choices=[
        SYSTEM, QUESTION, assistant_call({"keywords": ["budget", "Sally"]}),
        {"role": "tool", "tool_call_id": "call_0", "content": "[]"},
        {"role": "assistant", "content": "I don't know."}], tools=[SEARCH_TOOL], reward=0.0)
    name = "model.layers.0.self_attn.q_proj.weight"

    async def run():
        backend = CPUBackend(path=str(tmp_path), train_threads=1)
        model = art.TrainableModel(name="merge", project="test", base_model="smollm2", report_metrics=[])
        await model.register(backend)
        trainer, worker = backend.trainer, backend.worker
        merged = trainer.context_model()
        untrained = merged.state_dict()[name].clone()
        await model.train_sft([trajectory, trajectory], art.TrainSFTConfig(learning_rate=1e-3, batch_size=1))
        served = worker.model
        published = served.state_dict()[name].clone()
        await worker.call(trainer.sft_batch, [trajectory], 1e-3)  # a third step, not published
        current = await worker.call(trainer.context_model)
        fresh = await worker.call(lambda: copy.deepcopy(trainer.peft).merge_and_unload())
        await backend.close()
        return merged, untrained, served, published, current, fresh

    merged, untrained, served, published, current, fresh = loop.run_until_complete(run())
    assert current is merged and served is not merged
    assert not torch.equal(published, untrained) and not torch.equal(current.state_dict()[name], published)
    for key, value in fresh.state_dict().items():
        assert torch.equal(current.state_dict()[key], value), key
    assert torch.equal(served.state_dict()[name], published)  # unchanged by the unpublished step


@pytest.mark.slow
# bfloat16's error depends on the CPU's kernels: with AMX every token was within 0.1 nats; on an AVX512-BF16
# machine (AMD EPYC, 2026-11-25) the mean error was 0.03 nats and one token of 39 was 0.55 off.
@pytest.mark.parametrize("dtype, mean_error, max_error", [("float32", 1e-4, 1e-4), ("bfloat16", 0.06, 1.0)])
def test_trained_logprobs_are_those_of_one_pass_over_the_conversation(served, monkeypatch, dtype, mean_error,
                                                                       max_error):
    """Shared prefix once, the context without gradient (in the inference dtype), then all assistant turns of a
    row at once: the values are those of one float32 pass (exactly in float32, to bfloat16's precision else)."""
    monkeypatch.setenv("EMAIL_AGENT_CPU_DTYPE", dtype)
    backend, _ = served
    conversations = [[SYSTEM, {"role": "user", "content": question}, assistant_call({"keywords": [word]}),
                      {"role": "tool", "tool_call_id": "call_0", "content": f'[{{"subject": "{word} notes"}}]'},
                      {"role": "assistant", "content": f"The {word} notes say Tuesday."}]
                     for question, word in [("When is the budget meeting?", "budget"), ("Who is Sally?", "Sally")]]
    rows = []
    for messages in conversations:
        encoded = backend.trainer.tokenizer.apply_chat_template(messages, tools=[SEARCH_TOOL], tokenize=True,
                                                         return_dict=True, return_assistant_tokens_mask=True)
        targets = torch.tensor([encoded["assistant_masks"][1:] + [0]], dtype=torch.bool)  # t scores t+1
        rows.append((torch.tensor([encoded["input_ids"]]), targets))
    assert backend.trainer.context_model().dtype == getattr(torch, dtype)
    prefix = backend.trainer.shared_prefix(rows)
    assert prefix is not None
    length, _ = prefix
    first_trained = min(int(targets[0].nonzero()[0]) for _, targets in rows)
    assert 100 < length <= first_trained  # the tool block and system text, nothing that is trained on
    assert rows[0][0][0, :length].equal(rows[1][0][0, :length])
    with torch.no_grad():
        for tokens, targets in rows:
            assert len(torch.unique_consecutive(targets[0])) == 5  # two trained turns between untrained text
            one_pass = torch.log_softmax(backend.trainer.peft(input_ids=tokens).logits[0, :-1].float(), -1)
            expected = (one_pass.gather(-1, tokens[0, 1:, None])[:, 0] * targets[0, :-1])[None]
            expected = torch.nn.functional.pad(expected, (0, 1))
            full_row, _ = backend.trainer.target_logprobs(tokens, targets)
            shared_row, _ = backend.trainer.target_logprobs(tokens, targets, prefix)
            assert targets.sum() > 10
            assert (full_row != 0).sum() == targets.sum()
            for row in (full_row, shared_row):
                error = (row - expected).abs()[targets]
                assert error.mean() <= mean_error and error.max() <= max_error, (error.mean(), error.max())
    assert backend.trainer.shared_prefix(rows[:1]) is None  # one row: nothing to share


# ----------------------------------------------------------------------------------------------
# Failure and shutdown
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_refused_clearly(loop, tmp_path):
    broken = tmp_path / "test" / "models" / "agent" / "checkpoints" / "0003"
    broken.mkdir(parents=True)
    (broken / "adapter_config.json").write_text("{truncated")
    (broken / "adapter_model.safetensors").write_bytes(b"\0" * 10)

    async def run():
        backend = CPUBackend(path=str(tmp_path))
        model = art.TrainableModel(name="agent", project="test", base_model="smollm2", report_metrics=[])
        try:
            await model.register(backend)
        finally:
            await backend.close()

    with pytest.raises(CheckpointError, match="--fresh") as error:
        loop.run_until_complete(run())
    assert str(broken) in str(error.value)


def test_unknown_base_model_is_a_clear_error(loop, tmp_path):
    async def run():
        backend = CPUBackend(path=str(tmp_path))
        model = art.TrainableModel(name="agent", project="test", base_model="Qwen/Qwen2.5-7B-Instruct")
        try:
            await model.register(backend)
        finally:
            await backend.close()

    with pytest.raises(DataError, match="not attempted offline"):
        loop.run_until_complete(run())


@pytest.mark.slow
def test_close_frees_port_and_threads(loop, tmp_path):
    threads_before = set(threading.enumerate())  # the module's served backend keeps its own worker

    async def run():
        backend = CPUBackend(path=str(tmp_path))
        model = art.TrainableModel(name="agent", project="test", base_model="smollm2", report_metrics=[])
        await model.register(backend)
        port = urllib.parse.urlsplit(model.inference_base_url).port
        pending = asyncio.ensure_future(ask(model, [QUESTION], max_tokens=2000, extra_body={"ignore_eos": True}))
        await asyncio.sleep(1.0)  # mid-generation
        await backend.close()
        with pytest.raises(openai.APIError):
            await pending
        return port

    port = loop.run_until_complete(run())
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert not [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("cpu-")]
    # tqdm's multiprocessing lock (first progress bar) starts Python's resource tracker; it is not ours.
    children = [p.cmdline() for p in psutil.Process().children(recursive=True)]
    assert [c for c in children if "multiprocessing.resource_tracker" not in " ".join(c)] == []
