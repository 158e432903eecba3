"""The GPU path, proven on CPU with ART 0.5.18's own code: every sequence a backend trains on is the prompt the
server rendered plus the ids it sampled, turn after turn; the warm start teaches tool calls the agent's parser
reads. Both with SmolLM2's template (the CPU backend's) and Qwen2.5's real tokenizer and template (the GPU default's
family: its vocabulary, its hermes template, no generation markers), through ART's real tokenizer called as
LocalBackend calls it. The raw groups, as the loop handed them to LocalBackend before `training_data` existed, fail
the same checks: the tests say so."""

import asyncio
import copy
import json
import re

import art
import pytest
from art.local import LocalBackend
from art.preprocessing.tokenize import (_messages_for_chat_template, _normalize_tools_for_chat_template,
                                        tokenize_trajectory_groups)
from openai import AsyncOpenAI

from email_agent import backends
from email_agent.training import training_data
from email_agent.data import questions as qmod
from hermes_calls import parse_tool_calls
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from email_agent.agent.demonstrations import expert_trajectories
from email_agent.agent.tools import parse_arguments
from scripted_server import ScriptedServer, as_vllm_renders, call, expert_script, hermes_text

import train_email_search_agent as cli

PLAYS = ("solves", "errs", "abstains", "chats")  # one group per question: a rollout of each


def scripts_for(q) -> dict:
    solve = expert_script(q)
    return {
        "solves": solve,  # search, read, answer: three turns
        "errs": [call("search_inbox", {"keywords": "one string"}), *solve],  # a tool error, then the solution
        "abstains": [call("search_inbox", {"keywords": ["zebra", "quartz"]}),
                     call("return_final_answer", {"answer": "I don't know", "sources": []})],
        "chats": [{"text": "Let me look."}, call("return_final_answer", {"answer": "Tuesday", "sources": []})],
    }


@pytest.fixture(params=["smollm2", "qwen2.5"])
def tokenizer(request):
    return request.getfixturevalue("smollm2_tokenizer" if request.param == "smollm2" else "qwen25_tokenizer")


def play(tokenizer, db, questions):
    """Each question's group, played through the real rollout against a server that renders and samples as vLLM."""
    scripts = {name: {q.question: scripts_for(q)[name] for q in questions} for name in PLAYS}

    async def go():
        async with ScriptedServer(scripts, tokenizer=tokenizer) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            groups = [art.TrajectoryGroup([await rollout(Policy(client, name), q, db, Episode(max_turns=5))
                                           for name in PLAYS]) for q in questions]
            await client.close()
            return groups, server.served

    return asyncio.run(go())


def local_backend_tool_format(tmp_path) -> str:
    """The tool-schema format ART's LocalBackend tokenizes with, for the settings this project gives it."""
    return LocalBackend(path=str(tmp_path))._chat_template_tool_schema_format(
        backends.internal_config(cli.TrainConfig()))


def expected(result, served, questions) -> tuple[list[int], list[int]]:
    """The sequence the policy was served for this trajectory (its last prompt plus the ids sampled for it, each
    earlier turn a prefix of it) and its mask of sampled positions."""
    question = next(q.question for q in questions if q.id == result.trajectory.metadata["question_id"])
    turns = [r for r in served if r["question"] == question and r["model"] == result.trajectory.metadata["policy"]]
    sequence = turns[-1]["prompt_ids"] + turns[-1]["sampled_ids"]
    mask = [0] * len(sequence)
    for turn in turns:
        start, end = len(turn["prompt_ids"]), len(turn["prompt_ids"]) + len(turn["sampled_ids"])
        assert sequence[:end] == turn["prompt_ids"] + turn["sampled_ids"], "an earlier turn is not a prefix"
        mask[start:end] = [1] * (end - start)
    return sequence, mask


def test_every_trained_sequence_is_what_the_policy_was_served(tokenizer, demo_db, tmp_path):
    questions = qmod.select_questions(demo_db, "train", seed=0)[:2]
    groups, served = play(tokenizer, demo_db, questions)
    assert [t.metrics["num_turns"] for t in groups[0].trajectories] == [3, 4, 2, 2]
    assert groups[0].trajectories[1].metrics["bad_tool_args"] == 1  # the tool error happened
    assert len({t.reward for t in groups[0].trajectories}) > 1  # so ART trains every rollout
    tool_format = local_backend_tool_format(tmp_path)
    assert tool_format == "vllm_openai"

    form = training_data.argument_form(tokenizer.chat_template)
    results = list(tokenize_trajectory_groups(tokenizer, training_data.for_grpo(groups, form), False, True,
                                              chat_template_tool_schema_format=tool_format))
    assert len(results) == 8
    for result in results:
        sequence, mask = expected(result, served, questions)
        assert result.token_ids == sequence
        assert result.assistant_mask == mask
    # ART re-validates the tools (pydantic stores {"function", "type"}) before it renders them: only the
    # vllm_openai format, which internal_config gives LocalBackend and the CPU trainer passes, renders the tool
    # block the policy saw, whatever order the loop hands them in
    default = tokenize_trajectory_groups(tokenizer, training_data.for_grpo(groups, form), False, True)
    assert all(r.token_ids != expected(r, served, questions)[0] for r in default)
    # `sequence_tokens`, what the step line counts too-long trajectories by, is that length
    assert sorted(len(r.token_ids) for r in results) == sorted(t.metrics["sequence_tokens"]
                                                               for g in groups for t in g.trajectories)

    raw = list(tokenize_trajectory_groups(tokenizer, groups, False, True, chat_template_tool_schema_format=tool_format))
    wrong = [r for r in raw if r.token_ids != expected(r, served, questions)[0]]
    assert len(wrong) >= 6  # every multi-turn rollout: each sampled call rendered again after its tokens
    assert any(tokenizer.decode(r.token_ids).count('<tool_call>\n{"name": "search_inbox"') >= 2 for r in wrong)


# ways a model writes a call that the hermes parser reads, but the template writes back otherwise
WRITTEN_OTHERWISE = {
    "a key the parser drops": lambda text: text.replace("}}\n</tool_call>", '}, "parameters": {}}\n</tool_call>'),
    "no closing tag": lambda text: text.removesuffix("\n</tool_call>"),  # seen on real vLLM (ended early)
    "other spacing": lambda text: text.replace("<tool_call>\n", "<tool_call>").replace("}\n</", "}</"),
    "text after the call": lambda text: text + "\nThat should find it.",
    "as the template writes it": lambda text: text,
}


@pytest.mark.parametrize("how", WRITTEN_OTHERWISE)
def test_a_call_rendered_back_otherwise_is_trained_as_the_server_rendered_it(tokenizer, demo_db, how):
    """A model may write a call the parser reads but the template writes back otherwise (seen on real vLLM: a
    "parameters" key beside "arguments", a call ended before its closing tag): every later prompt renders the call
    as parsed. Trained on its sampled ids, the later turns would sit in a context no prompt had; trained as the
    server rendered it, the sequence is the last prompt served, and only the later turns are trained. A call
    written as the template writes it is trained on its sampled ids, like the others."""
    question = qmod.select_questions(demo_db, "train", seed=0)[0]
    solve = expert_script(question)
    name, args = solve[0]["tool"], solve[0]["args"]
    written = WRITTEN_OTHERWISE[how](hermes_text([(name, args)], None))
    calls = parse_tool_calls(written)[1]  # what vLLM's hermes parser reads from it: the same call
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [(name, args)]

    async def go():
        scripts = {"odd": {question.question: [{**solve[0], "sampled": written}, *solve[1:]]},
                   "abstains": {question.question: scripts_for(question)["abstains"]}}  # rewards differ: trained
        async with ScriptedServer(scripts, tokenizer=tokenizer) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            trajectory = await rollout(Policy(client, "odd"), question, demo_db, Episode(max_turns=5))
            served = list(server.served)
            other = await rollout(Policy(client, "abstains"), question, demo_db, Episode(max_turns=5))
            await client.close()
            return art.TrajectoryGroup([trajectory, other]), served

    group, served = asyncio.run(go())
    assert group.trajectories[0].metrics["num_turns"] == 3 and group.trajectories[0].metrics["answer_correct"]
    form = training_data.argument_form(tokenizer.chat_template)

    def tokenized(reader):
        prepared = training_data.for_grpo([group], form, tokenizer=reader)
        return next(tokenize_trajectory_groups(tokenizer, prepared, False, True, shuffle_group_trajectories=False,
                                               drop_zero_advantage_trajectories=False,
                                               chat_template_tool_schema_format="vllm_openai"))

    result = tokenized(tokenizer)
    assert result.token_ids == served[-1]["prompt_ids"] + served[-1]["sampled_ids"]
    trained = [i for i, bit in enumerate(result.assistant_mask) if bit]
    kept = served if how == "as the template writes it" else served[1:]
    assert trained == [i for t in kept for i in range(len(t["prompt_ids"]), len(t["prompt_ids"] + t["sampled_ids"]))]
    if how != "as the template writes it":  # with no tokenizer to read the sampled text, the gap is there
        assert tokenized(None).token_ids != result.token_ids


def test_warm_start_teaches_what_vllm_shows_and_calls_the_parser_reads(tokenizer, demo_db):
    """ART renders warm-start episodes with the model's template (tokenize_sft_batch's own helpers, below). The
    rendered conversation must be the one vLLM shows the model, and each assistant turn a tool call whose
    arguments `tools.parse_arguments` accepts. Qwen2.5's template puts `arguments | tojson` on the episodes'
    JSON strings, encoding them twice, unless the loop hands it objects (`training_data.for_sft`)."""
    questions = qmod.select_questions(demo_db, "train", seed=0)[:6]
    episodes = asyncio.run(expert_trajectories(demo_db, questions, Episode()))
    assert episodes
    form = training_data.argument_form(tokenizer.chat_template)
    qwen_style = "is string" not in tokenizer.chat_template
    assert form == ("object" if qwen_style else "string")

    def rendered(trajectory):
        messages = _messages_for_chat_template(tokenizer, trajectory.messages_and_choices)
        tools = _normalize_tools_for_chat_template(trajectory.tools, tool_schema_format="vllm_openai")
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    def parsed_calls(text):
        spans = re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, re.S)
        calls = [c["function"] for span in spans for c in parse_tool_calls(span)[1]]
        assert len(calls) == len(spans) >= 2
        return [parse_arguments(c["name"], c["arguments"]) for c in calls]

    for trajectory in training_data.for_sft(episodes, form):
        text = rendered(trajectory)
        messages = [m for m in _messages_for_chat_template(tokenizer, copy.deepcopy(
            next(e for e in episodes if e.metadata == trajectory.metadata).messages_and_choices))]
        as_served = tokenizer.apply_chat_template(*as_vllm_renders(messages, trajectory.tools), tokenize=False)
        assert text == as_served
        assert all(isinstance(args, dict) for args in parsed_calls(text))
    if qwen_style:
        with pytest.raises(ValueError, match="must be a JSON object"):
            parsed_calls(rendered(episodes[0]))  # the episodes as they were handed over before


def test_the_qwen2_5_style_fixture_is_qwen_s_real_template_but_for_its_default_system_prompt(qwen25_tokenizer):
    """tests/fixtures' template (the loop's wiring tests run it on SmolLM2's small vocabulary) is Qwen2.5's own."""
    from conftest import QWEN_STYLE_TEMPLATE

    fixture = QWEN_STYLE_TEMPLATE.read_text()
    fixture = fixture[fixture.index("-#}") + len("-#}\n"):]
    qwen_s = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    real = qwen25_tokenizer.chat_template.replace(qwen_s, "You are a helpful assistant.")
    assert fixture.strip() == real.strip()
