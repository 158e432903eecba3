"""Warm-start sources: the scripted demo expert and a teacher's evaluation folder."""

import asyncio
import hashlib
import json
import logging

import pytest

from email_agent.data import questions as qmod
from email_agent.config import DEMO_PRESET, TrainConfig, check
from email_agent.errors import UserError
from email_agent.agent.expert import question_keywords
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import assistant_message
from email_agent.agent.demonstrations import expert_trajectories, sft_source, teacher_trajectories


def test_question_keywords():
    assert question_keywords("Where is the Petrel steering committee being held?") == ["Petrel", "steering"]
    assert question_keywords("What's the hotel confirmation code for my Glasgow trip?")[0] == "Glasgow"
    assert question_keywords("When is flight BW863 leaving?")[0] == "BW863"


def test_expert_solves_most_train_questions_and_never_test(demo_db):
    train = qmod.select_questions(demo_db, "train")
    test = qmod.select_questions(demo_db, "test")[:5]
    trajs = asyncio.run(expert_trajectories(demo_db, train + test, Episode(max_turns=4, max_body_chars=600)))
    solved = [t for t in trajs if t.metrics["answer_correct"]]
    assert len(solved) >= 0.6 * len(train)  # 163 of 210 with 4 turns and 3 results when written
    assert {t.metadata["question_id"] for t in trajs} <= {q.id for q in train}
    for t in solved:
        assert t.metrics["answer_correct"] == t.metrics["sources_correct"] == 1
        assert t.metrics["bad_tool_args"] == t.metrics["bad_tool_name"] == t.metrics["parse_errors"] == 0
        names = [c.function.name for c in (ch.message.tool_calls for ch in t.messages_and_choices
                                           if not isinstance(ch, dict)) for c in c]
        assert names[0] == "search_inbox" and names[-1] == "return_final_answer" and "read_email" in names


def test_the_demo_presets_warm_start_episodes_are_unchanged(demo_db, caplog):
    """`make demo` warm-starts from `--sft-from demo-expert`: the generalised expert, searching the question's
    names first, plays the demo preset's train questions message for message as the demo-only expert did
    (the digest below was the same from that expert's code, commit 1aa0dbd), and logs its ceiling."""
    _, train, _ = qmod.training_questions(demo_db, TrainConfig(**DEMO_PRESET))
    config = Episode(max_turns=4, max_body_chars=600, search_results=3)
    with caplog.at_level(logging.INFO, logger="email_agent"):
        trajs = asyncio.run(sft_source("demo-expert", demo_db, train, config))
    played = json.dumps([[m if isinstance(m, dict) else assistant_message(m) for m in t.messages_and_choices]
                         for t in trajs])
    assert len(trajs) == 207
    assert hashlib.sha256(played.encode()).hexdigest() == \
        "b16d810da2c55ad2dece266b75c54b3d4a6da59d321c3e40a7ceb1910eff80e9"
    assert ("expert on the 202 train questions, in 4 turns: solved 155 of 202 (77%); answered from another email 10; "
            "said \"I don't know\" 37; ran out of turns 0") in caplog.text


def test_warm_start_abstains_only_where_the_search_really_fails(demo_db):
    """About a quarter of the expert's episodes end in "I don't know", each one after a search that never
    showed the gold email: the expert's own failures, or a question asked the day before its gold email
    was sent (withheld). The mix is shuffled, so a --sft-limit prefix keeps it."""
    train = qmod.select_questions(demo_db, "train", seed=0)
    config = Episode(max_turns=4, max_body_chars=600, search_results=3)
    trajs = asyncio.run(expert_trajectories(demo_db, train, config))
    idk = [t for t in trajs if t.metrics["returned_i_dont_know"]]
    assert 0.2 <= len(idk) / len(trajs) <= 0.3
    assert len(idk) + sum(t.metrics["answer_correct"] for t in trajs) == len(trajs)  # nothing else: no wrong answers
    by_id = {q.id: q for q in train}
    withheld = [t for t in idk if t.metadata.get("withheld_gold")]
    assert withheld and len(withheld) < len(idk)  # both kinds
    for t in idk:
        m = t.metrics
        assert m["ever_found_right_email"] == m["ever_read_right_email"] == m["attempted_answer"] == 0
        assert m["bad_tool_args"] == m["bad_tool_name"] == m["parse_errors"] == m["ran_out_of_turns"] == 0
        last = t.messages_and_choices[-2].message.tool_calls[0].function
        assert (last.name, json.loads(last.arguments)) == ("return_final_answer",
                                                           {"answer": "I don't know", "sources": []})
    for t in withheld:  # the episode's "today" is before the gold email, so the inbox could not show it
        gold = demo_db.read(by_id[t.metadata["question_id"]].message_ids[0])
        system = t.messages_and_choices[0]["content"]
        today = system.split("Today's date is ")[1][:10]
        assert today < gold.date[:10]
    first = trajs[:40]
    assert 5 <= sum(t.metrics["returned_i_dont_know"] for t in first) <= 17


def record(qid, correct=1, sources=1, error=None, model="openai/o4-mini"):
    return {"model": model, "question_id": qid, "reward": 1.0 if correct else -1.0, "error": error,
            "metrics": {"answer_correct": correct, "sources_correct": sources, "num_turns": 2},
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "read_email", "arguments": "{\"message_id\": \"m\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "{}"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c2", "type": "function", "function": {
                              "name": "return_final_answer",
                              "arguments": "{\"answer\": \"a\", \"sources\": [\"m\"]}"}}]}]}


def test_teacher_folder_keeps_exactly_the_judged_correct_cited_train_episodes(demo_db, tmp_path):
    train_ids = [q.id for q in qmod.select_questions(demo_db, "train")[:5]]
    test_id = qmod.select_questions(demo_db, "test")[0].id
    rows = [record(train_ids[0]), record(train_ids[1], correct=0, sources=0), record(train_ids[2], sources=0),
            record(train_ids[3], error="policy API error"), record(test_id), record(train_ids[4])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trajs = teacher_trajectories(tmp_path, demo_db)
    assert [t.metadata["question_id"] for t in trajs] == [train_ids[0], train_ids[4]]
    messages = trajs[0].messages_and_choices
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "read_email", "arguments": "{\"message_id\": \"m\"}"}
    assert "refusal" not in messages[2] and messages[2]["content"] == ""  # only what a chat template renders
    assert trajs[0].tools and trajs[0].metadata["teacher"] == "openai/o4-mini"
    # training passes the questions it validates on: they are not imitated
    held_out = [q for q in qmod.select_questions(demo_db, "train") if q.id == train_ids[4]]
    assert [t.metadata["question_id"] for t in teacher_trajectories(tmp_path, demo_db, None, held_out)] == [
        train_ids[0]]


def test_a_teacher_folder_with_unreadable_results(demo_db, tmp_path, caplog):
    train_id = qmod.select_questions(demo_db, "train")[0].id
    folder = tmp_path / "a teacher"  # a space in the path is a path like any other
    folder.mkdir()
    (folder / "results.jsonl").write_text("junk\n")
    with pytest.raises(UserError, match="results.jsonl holds no episodes"):
        teacher_trajectories(folder, demo_db)
    (folder / "results.jsonl").write_text(json.dumps(record(train_id)) + "\n" + json.dumps(record(train_id))[:50])
    with caplog.at_level(logging.WARNING, logger="email_agent"):
        trajs = asyncio.run(sft_source(str(folder), demo_db, [], Episode()))
    assert len(trajs) == 1 and "1 unreadable line(s)" in caplog.text


def test_teacher_played_with_other_episode_limits_is_flagged(demo_db, tmp_path, caplog):
    train_id = qmod.select_questions(demo_db, "train")[0].id
    limits = {"max_turns": 10, "max_tokens": 1024, "max_body_chars": 4000, "search_results": 10}
    (tmp_path / "results.jsonl").write_text(json.dumps({**record(train_id), "episode": limits}) + "\n")
    same = Episode(max_turns=10, max_body_chars=4000, search_results=10)
    with caplog.at_level(logging.WARNING, logger="email_agent"):
        assert len(teacher_trajectories(tmp_path, demo_db, same)) == 1
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="email_agent"):
        assert len(teacher_trajectories(tmp_path, demo_db, Episode(max_turns=4, max_body_chars=600,
                                                                         search_results=3))) == 1
    [warning] = caplog.records
    assert ("the teacher played max_turns 10, max_body_chars 4000, search_results 10, this run trains with "
            "max_turns 4, max_body_chars 600, search_results 3") in warning.getMessage()


def test_bad_sources_are_clear_errors(demo_db, tmp_path):
    with pytest.raises(UserError, match="expected 'expert'"):
        sft_source("no-such-thing", demo_db, [], Episode())
    for name in ("expert", "demo-expert"):  # the expert's names pass the checks made before anything loads
        check(TrainConfig(sft_from=name, sft_only=True))
    with pytest.raises(UserError, match="expected 'expert' or an evaluation folder"):
        check(TrainConfig(sft_from="experts", sft_only=True))
    with pytest.raises(UserError, match="results.jsonl"):
        asyncio.run(sft_source(str(tmp_path), demo_db, [], Episode()))


@pytest.mark.slow
def test_tiny_warm_start_raises_expert_logprobs_and_teaches_smollm2_to_call_a_tool(demo_db, tmp_path):
    """SmolLM2-135M alone answers in plain text. A few supervised steps on expert episodes must raise the
    log-probability of the expert's assistant tokens and make the model emit a tool call that parses (a
    known tool, JSON object arguments), served by vLLM, greedily (repeatable: unseeded samples are not), on train
    questions."""
    import art

    from email_agent.backends.cpu import CPUBackend
    from email_agent.agent.rollout import Policy, rollout
    from email_agent.agent.tools import TOOLS

    config = Episode(max_turns=4, max_body_chars=600, search_results=3)
    train = qmod.select_questions(demo_db, "train", seed=0)
    expert = asyncio.run(expert_trajectories(demo_db, train[:12], config))[:8]

    async def run():
        backend = CPUBackend(path=str(tmp_path), seed=0)
        model = art.TrainableModel(name="tiny-sft", project="test", base_model="smollm2", report_metrics=[])
        try:
            await model.register(backend)
            sft = art.types.TrainSFTConfig(learning_rate=1e-3, batch_size=2)
            # 2 epochs x 4 batches of 2: 8 optimizer steps. A batch's loss is measured before its update,
            # so the first epoch's first batch is the untrained model and the last epoch's is the trained one.
            epochs = [[m async for m in backend._train_sft(model, expert, sft, {})] for _ in range(2)]
            policy = Policy.for_model(model, temperature=0.0)
            one_turn = Episode(max_turns=1, max_tokens=64, max_body_chars=600, search_results=3)
            return epochs, [await rollout(policy, q, demo_db, one_turn) for q in train[:4]]
        finally:
            await backend.close()

    epochs, trajs = asyncio.run(run())
    before, after = epochs[0][0], epochs[-1][0]  # mean negative log-prob of the same expert tokens
    assert before["num_trainable_tokens"] == after["num_trainable_tokens"] > 100
    print(f"expert tokens: loss {before['loss']:.3f} untrained, {after['loss']:.3f} after one epoch")
    assert after["loss"] < 0.5 * before["loss"], (before["loss"], after["loss"])
    names = {t["function"]["name"] for t in TOOLS}
    parsed = []
    for traj in trajs:
        choice = next(m for m in traj.messages_and_choices if not isinstance(m, dict))
        for call in choice.message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                continue
            if call.function.name in names and isinstance(arguments, dict):
                parsed.append((call.function.name, arguments))
    assert parsed, [t.messages_and_choices[-1] for t in trajs]


def _expert_messages(demo_db, tokenizer, count: int):
    """Demo-expert episodes as the warm start hands them to a backend (`for_sft`, arguments in the template's form)."""
    from art.trajectories import get_messages

    from email_agent.training.training_data import argument_form, for_sft

    config = Episode(max_turns=4, max_body_chars=600, search_results=3)
    train = qmod.select_questions(demo_db, "train", seed=0)[:count]
    trajs = for_sft(asyncio.run(expert_trajectories(demo_db, train, config)), argument_form(tokenizer.chat_template))
    return [(get_messages(t.messages_and_choices), t.tools) for t in trajs]


def test_assistant_turns_are_found_as_smollm2s_generation_markers_mark_them(demo_db, smollm2_tokenizer):
    """The trainer finds assistant turns without {% generation %} markers (ART's way: the turns replaced by a
    stand-in); on SmolLM2's template, which has the markers, it finds exactly the tokens they mark."""
    from email_agent.backends.cpu.model import assistant_token_mask

    episodes = _expert_messages(demo_db, smollm2_tokenizer, 24)
    assert len(episodes) >= 12
    for messages, tools in episodes:
        marked = smollm2_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                       return_assistant_tokens_mask=True)
        ids, mask = assistant_token_mask(smollm2_tokenizer, messages, tools)
        assert ids == marked["input_ids"]
        assert mask == marked["assistant_masks"]
        assert sum(mask) > 20


def test_templates_the_trainer_cannot_read_are_refused_in_one_sentence(smollm2_tokenizer):
    import copy

    from email_agent.backends.cpu.model import check_chat_template

    check_chat_template(smollm2_tokenizer, "smollm2")  # its own template passes
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    # a template that drops earlier assistant turns' text (as reasoning templates drop earlier thinking)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                               "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError, match=r"^Base model 'odd': its chat template does not render") as error:
        check_chat_template(tokenizer, "odd")
    assert "\n" not in str(error.value)
