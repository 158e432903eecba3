"""CPU backend: the tool chat template, SmolLM2's kept conversion, a GRPO step through ART's own loss served by
vLLM, SFT, checkpoints (atomic, resumable, corrupt ones refused) and clean shutdown (vLLM ends with it).

Tests marked slow load SmolLM2-135M once per process and share one event loop and one registered backend;
training tests get their own backend in a temporary directory. vLLM is the test session's server
(EMAIL_AGENT_VLLM_URL, tests/conftest.py), except where a test starts its own to see it end.
"""

import asyncio
import copy
import json
import logging
import socket
import threading
import urllib.parse

import pytest

from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE, CheckpointError, CPUBackend, load_base_model
from email_agent.backends.cpu import model as model_module
from email_agent.backends.vllm_server import URL_ENV
from email_agent.training.training_data import for_grpo
from email_agent.errors import UserError
from hermes_calls import parse_tool_calls

import art
import openai
import psutil
import torch
from art._backend_training import build_rl_train_configs
from art.preprocessing.tokenize import tokenize_trajectory_groups
from openai.types.chat.chat_completion import Choice
from transformers.utils.chat_template_utils import render_jinja_template

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_emails", "description": "Search the inbox for emails matching all keywords.",
    "parameters": {"type": "object", "properties": {"keywords": {"type": "array", "items": {"type": "string"}}},
                   "required": ["keywords"]}}}
SYSTEM = {"role": "system", "content": "You answer questions about the user's email. Use the tools."}
QUESTION = {"role": "user", "content": "When is the budget meeting with Sally?"}


# ----------------------------------------------------------------------------------------------
# The tool chat template vLLM serves SmolLM2 with
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
    """A registered backend whose trainer works in float32, where a logprob must match one pass exactly."""
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


# ----------------------------------------------------------------------------------------------
# Training through ART's loss, each checkpoint served by vLLM
# ----------------------------------------------------------------------------------------------

def completion_logits(backend, messages, choice) -> tuple[torch.Tensor, list[int]]:
    """(the trainer's logits at each sampled position under its current LoRA, the sampled token ids)."""
    tokenizer = backend.trainer.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    completion = [int(t.token.split(":")[1]) for t in choice.logprobs.content]
    with torch.no_grad():
        logits = backend.trainer.peft(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
    return logits, completion


def completion_logprob(backend, messages, choice) -> float:
    """Sum of log p(sampled tokens | prompt) under the backend's current LoRA, measured directly."""
    logits, completion = completion_logits(backend, messages, choice)
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
        served_after = [m.id for m in (await client_for(model).models.list()).data]
        # ART's Backend protocol method (model.delete_checkpoints picks the steps from a val metric).
        await backend._delete_checkpoint_files(model, [1, 2])
        await backend.close()
        # served as it was trained: vLLM's greedy tokens are the trainer's argmax (bfloat16 serving; a close call
        # may differ, so the first four)
        logits, greedy_ids = completion_logits(backend, messages, greedy)
        assert logits.argmax(-1).tolist()[:4] == greedy_ids[:4]
        sampled = sum(len(c.logprobs.content) for c in (good, bad))
        return result, flat_result, before, after, served_names, served_after, weights, step, optimizer, sampled

    result, flat_result, before, after, served_names, served_after, weights, step, optimizer, sampled = \
        loop.run_until_complete(first_run())
    assert after[0] > before[0] and after[1] < before[1], (before, after)
    # only the latest checkpoint is served (and the base model, under the server's name for it)
    assert result.step == 1 and "agent@1" in served_names and "agent@0" not in served_names
    assert "agent@2" in served_after and "agent@1" not in served_after
    # ART LocalBackend's keys, which the training loop's step line reads
    assert {"loss/train", "loss/grad_norm", "data/step_num_trajectories", "data/step_num_groups_trainable",
            "data/step_trainer_tokens", "time/step_trainer_s"} <= set(result.metrics)
    assert (result.metrics["data/step_num_trajectories"] == 2
            and result.metrics["data/step_num_trained_trajectories"] == 2)
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
    """A Choice as vLLM returns it: the message and one logprob per sampled token id."""
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
def test_merged_context_weights_follow_each_step_in_place(loop, tmp_path, monkeypatch):
    """The trainer's merged copy (its context pass) is updated in place after each optimizer step, to exactly what
    a fresh copy and merge give."""
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
        trainer = backend.trainer
        merged = await backend.call(trainer.context_model)
        untrained = merged.state_dict()[name].clone()
        await model.train_sft([trajectory, trajectory], art.TrainSFTConfig(learning_rate=1e-3, batch_size=1))
        after_two = (await backend.call(trainer.context_model)).state_dict()[name].clone()
        await backend.call(trainer.sft_batch, [trajectory], 1e-3)
        current = await backend.call(trainer.context_model)
        fresh = await backend.call(lambda: copy.deepcopy(trainer.peft).merge_and_unload())
        await backend.close()
        return merged, untrained, after_two, current, fresh

    merged, untrained, after_two, current, fresh = loop.run_until_complete(run())
    assert current is merged
    assert not torch.equal(after_two, untrained) and not torch.equal(current.state_dict()[name], after_two)
    for key, value in fresh.state_dict().items():
        assert torch.equal(current.state_dict()[key], value), key


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

    with pytest.raises(UserError, match="not attempted offline"):
        loop.run_until_complete(run())


@pytest.mark.slow
def test_close_ends_its_vllm_and_frees_port_and_threads(loop, tmp_path, monkeypatch, session_vllm):
    """A backend that started vLLM (no EMAIL_AGENT_VLLM_URL) ends it on close: a request under way fails, the port
    closes, no process or trainer thread is left."""
    monkeypatch.delenv(URL_ENV, raising=False)
    threads_before = set(threading.enumerate())  # the module's served backend keeps its own trainer thread

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
    shared = set()  # the test session's vLLM (tests/conftest.py), which this backend did not start
    if session_vllm is not None:
        wrapper = psutil.Process(session_vllm.pid)
        shared = {wrapper.pid, *(p.pid for p in wrapper.children(recursive=True))}
    children = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.pid not in shared]
    assert [c for c in children if "multiprocessing.resource_tracker" not in " ".join(c)] == []
