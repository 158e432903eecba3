"""Real rollouts against the demo inbox (and the Enron sample) driven by a scripted policy server."""

import asyncio
import dataclasses
import itertools
import json
import types

import pytest
from openai import AsyncOpenAI

from conftest import needs_enron
from email_agent.data import questions as qmod
from email_agent.agent import grading, rewards
from email_agent.data.questions import Question
from email_agent.agent.rewards import Rubric, shaped_reward
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from scripted_server import ScriptedServer, call, expert_script


def run(coro):
    return asyncio.run(coro)


async def play(db, script_by_question, qs, config=None, timeout=10.0, max_retries=0, **policy_options):
    async with ScriptedServer(script_by_question) as server:
        client = AsyncOpenAI(base_url=server.base_url, api_key="test", timeout=timeout, max_retries=max_retries)
        policy = Policy(client, "scripted", **policy_options)
        trajs = await asyncio.gather(*(rollout(policy, q, db, config or Episode()) for q in qs))
        await client.close()
        return trajs, server


@pytest.fixture(scope="module")
def q(demo_db):
    """A demo test question whose gold email search finds with the question's own keywords."""
    return next(x for x in qmod.select_questions(demo_db, "test") if "Glasgow" in x.question)


def test_the_runs_body_limit_and_result_count_reach_the_agents_inbox(demo_db, q):
    """Catches a rollout that builds the agent's inbox without the run's `max_body_chars` or `search_results`:
    the email read is then cut, and a search that asks for no number lists, at the defaults, not at what the
    run (and the trained model's context) was sized for."""
    script = [call("search_inbox", {"keywords": ["trip"]}), *expert_script(q)[1:]]  # 5 results in this inbox
    listed = []
    for count in (1, 2):
        _, server = run(play(demo_db, {q.question: script}, [q], Episode(max_body_chars=30,
                                                                               search_results=count)))
        listed.append(len(json.loads(server.requests[-1]["messages"][3]["content"])))
    assert listed == [1, 2]
    body = json.loads(server.requests[-1]["messages"][5]["content"])["body"]
    full = demo_db.read(q.message_ids[0]).body
    assert len(full) > 60 and body.startswith(full[:30]) and len(body) < len(full) - 20


def test_the_policys_temperature_is_sent_and_none_sends_none(demo_db, q):
    """Catches a policy that drops its sampling temperature (GRPO samples at 1.0, evaluation greedily at 0) or
    sends one when told to leave the server's default (o-series models refuse any other); and one that does not
    ask for the sampled tokens' log-probabilities by default."""
    for value, sent in ((0.7, 0.7), (None, "unset")):
        _, server = run(play(demo_db, {q.question: expert_script(q)}, [q], temperature=value))
        assert [r.get("temperature", "unset") for r in server.requests] == [sent] * 3
        assert [r.get("logprobs") for r in server.requests] == [True] * 3  # what ART trains on


def test_correct_path(demo_db, q):
    """Also catches a trajectory that does not say which question, inbox, split and policy it is (its metadata
    is how a logged or exported trajectory is traced back)."""
    (traj,), server = run(play(demo_db, {q.question: expert_script(q)}, [q]))
    assert {k: traj.metadata[k] for k in ("question_id", "inbox", "split", "policy")} == \
        {"question_id": q.id, "inbox": q.inbox_address, "split": "test", "policy": "scripted"}
    m = traj.metrics
    assert (m["answer_correct"], m["sources_correct"], m["attempted_answer"], m["hallucinated"]) == (1, 1, 1, 0)
    assert (m["num_turns"], m["tool_calls"], m["valid_tool_calls"]) == (3, 3, 3)
    assert (m["ever_found_right_email"], m["ever_read_right_email"], m["ever_read_invalid_email"]) == (1, 1, 0)
    assert m["bad_tool_name"] == m["bad_tool_args"] == m["parse_errors"] == m["ran_out_of_turns"] == 0
    assert (m["prompt_tokens"], m["completion_tokens"], m["sequence_tokens"]) == (300, 30, 110)
    assert traj.reward == pytest.approx(1 + 0.3 + 0.1 + 0.1 * (1 - 3 / 10))
    assert traj.metadata["answer"] == q.answer and json.loads(traj.metadata["sources"]) == q.message_ids
    # the model saw the real tool results, and the system prompt binds inbox and date
    sent = server.requests[-1]["messages"]
    assert q.inbox_address in sent[0]["content"] and q.query_date in sent[0]["content"]
    assert q.message_ids[0] in sent[3]["content"]  # search results
    assert q.answer in json.loads(sent[5]["content"])["body"]  # the email read
    assert [t["function"]["name"] for t in server.requests[0]["tools"]] == ["search_inbox", "read_email",
                                                                            "return_final_answer"]
    # the model's own call goes back as it was sent (the chat template renders it into the next prompt)
    assert sent[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "search_inbox", "arguments": json.dumps(
            expert_script(q)[0]["args"])}}]}
    # each tool reply names the call it answers (a chat template, and the OpenAI API, pair them by this id)
    assert [(m["role"], m.get("tool_call_id")) for m in sent[3:6:2]] == [("tool", "call_0_0"), ("tool", "call_1_0")]
    assert [m["tool_call_id"] for m in traj.messages_and_choices if isinstance(m, dict) and m["role"] == "tool"] \
        == ["call_0_0", "call_1_0", "call_2_0"]


def test_a_reply_without_a_call_is_answered_with_a_nudge_and_extra_calls_are_counted(demo_db, q):
    """Catches: the nudge sent in another role, or another message recorded in its place in the trajectory
    (what GRPO trains on); an extra call answered with other words than why it did not run; and a turn's extra
    calls, or an episode's replies without a call, counted as one however many there were."""
    script = {q.question: [{"text": "Let me think."},
                           {"calls": [("search_inbox", {"keywords": ["x"]}), ("read_email", {"message_id": "y"}),
                                      ("read_email", {"message_id": "z"})]}, {"text": "Hmm."}] + expert_script(q)}
    (traj,), server = run(play(demo_db, script, [q]))
    nudge = {"role": "user", "content": "Error: reply with a tool call (search_inbox, read_email or "
                                        "return_final_answer), not plain text."}
    assert server.requests[1]["messages"][3] == nudge and traj.messages_and_choices[3] == nudge
    assert [m["content"] for m in server.requests[2]["messages"] if m["role"] == "tool"][1:] == \
        ["Error: only the first tool call of a turn is run; make one call per turn."] * 2
    assert (traj.metrics["parse_errors"], traj.metrics["tool_calls"], traj.metrics["extra_tool_calls"]) == (2, 6, 2)
    # the extra calls never ran: not valid calls, and no read of a missing email
    assert (traj.metrics["valid_tool_calls"], traj.metrics["ever_read_invalid_email"]) == (4, 0)


def test_hallucination_and_idk(demo_db, q):
    wrong = {q.question: [call("return_final_answer", {"answer": "Tuesday at noon", "sources": []})]}
    (traj,), _ = run(play(demo_db, wrong, [q]))
    assert (traj.metrics["attempted_answer"], traj.metrics["hallucinated"], traj.metrics["answer_correct"]) == (1, 1, 0)
    assert traj.reward == pytest.approx(-1.0)
    (traj,), _ = run(play(demo_db, wrong, [q], Episode(hallucination_penalty=2)))
    assert traj.reward == pytest.approx(-2.0)  # a costlier hallucination
    # the right answer citing another email: the sources are not right just because there are some
    other = {q.question: [call("return_final_answer", {"answer": q.answer, "sources": ["<other@x>"]})]}
    (traj,), _ = run(play(demo_db, other, [q]))
    assert (traj.metrics["answer_correct"], traj.metrics["sources_correct"]) == (1, 0)
    idk = {q.question: [call("search_inbox", {"keywords": ["zebra"]}),
                        call("return_final_answer", {"answer": "I don't know", "sources": []})]}
    (traj,), _ = run(play(demo_db, idk, [q]))
    assert (traj.metrics["returned_i_dont_know"], traj.metrics["hallucinated"],
            traj.metrics["attempted_answer"]) == (1, 0, 0)
    assert traj.metrics["searches"] == 1 and traj.reward == pytest.approx(0.0)  # looked, found nothing: sound
    # "I don't know" without a search that ran is not a sound abstention (GRPO learned it in run P)
    unlooked = {q.question: [call("search_inbox", '{"keywords": ["zebra")}'),
                             call("return_final_answer", {"answer": "I don't know", "sources": []})]}
    (traj,), _ = run(play(demo_db, unlooked, [q]))
    assert (traj.metrics["searches"], traj.metrics["bad_tool_args"]) == (0, 1)
    assert traj.reward == pytest.approx(-0.6)


BAD_CALLS = [
    ("unknown tool", call("delete_inbox", {}), "bad_tool_name", "no tool 'delete_inbox'"),
    ("not JSON", call("search_inbox", "{keywords: [falcon"), "bad_tool_args", "not valid JSON"),
    ("JSON list", call("search_inbox", "[1, 2]"), "bad_tool_args", "must be a JSON object"),
    ("unexpected kwarg", call("read_email", {"message_ids": ["x"]}), "bad_tool_args", "no argument 'message_ids'"),
    ("wrong type", call("search_inbox", {"keywords": "falcon review"}), "bad_tool_args", "must be a list of strings"),
    ("wrong int type", call("search_inbox", {"keywords": ["x"], "max_results": "5"}), "bad_tool_args", "an integer"),
    ("missing required", call("read_email", {}), "bad_tool_args", "needs 'message_id'"),
    ("bad date", call("search_inbox", {"keywords": ["x"], "sent_after": "last week"}), "bad_tool_args", "a date like"),
    ("empty keywords", call("search_inbox", {"keywords": ["", " "]}), "bad_tool_args", "non-empty keyword"),
    ("final answer w/o sources", call("return_final_answer", {"answer": "x"}), "bad_tool_args", "needs 'sources'"),
    ("plain text", {"text": "The meeting is on Tuesday."}, "parse_errors", "reply with a tool call"),
    ("two calls", {"calls": [("search_inbox", {"keywords": ["x"]}), ("read_email", {"message_id": "y"})]},
     "extra_tool_calls", "only the first tool call"),
]


@pytest.mark.parametrize("label,bad,counter,message", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_calls_are_reported_and_recoverable(demo_db, q, label, bad, counter, message):
    script = {q.question: [bad] + expert_script(q)}
    (traj,), server = run(play(demo_db, script, [q]))
    m = traj.metrics
    assert m[counter] == 1
    assert sum(m[k] for k in ("bad_tool_name", "bad_tool_args", "parse_errors", "extra_tool_calls")) == 1
    feedback = [m["content"] for m in server.requests[1]["messages"][3:]]  # what the model saw after its turn
    assert [f for f in feedback if f.startswith("Error") and message in f]
    assert m["answer_correct"] == 1 and m["num_turns"] == 4  # it recovered
    assert traj.reward == pytest.approx(1 + 0.3 + 0.1 + 0.1 * (1 - 4 / 10) - 0.1)


def test_every_bad_call_and_search_is_counted_not_just_the_first():
    """Catches a counter that records that a kind of call happened rather than how often (the shaped reward
    charges each bad call, and the report shows searches per episode)."""
    from email_agent.agent.rollout import record_outcome
    from email_agent.agent.tools import ToolOutcome

    outcomes = [ToolOutcome("nope", "", "bad_tool_name")] * 2 + [ToolOutcome("read_email", "", "bad_tool_args")] * 3
    outcomes += [ToolOutcome("search_inbox", "[]", None, {"keywords": ["x"]}, [])] * 2
    rubric = Rubric()
    for outcome in outcomes:
        record_outcome(rubric, outcome, {"<gold@x>"})
    assert (rubric.bad_tool_name, rubric.bad_tool_args, rubric.searches, rubric.valid_tool_calls) == (2, 3, 2, 2)


def test_max_turns_exhaustion(demo_db, q):
    script = {q.question: [call("search_inbox", {"keywords": ["zebra"]})] * 3}
    (traj,), _ = run(play(demo_db, script, [q], Episode(max_turns=3)))
    assert (traj.metrics["ran_out_of_turns"], traj.metrics["num_turns"], traj.metrics["attempted_answer"]) == (1, 3, 0)
    assert traj.reward == -0.5 and traj.metadata["answer"] is None  # below "I don't know": no decision made
    # an answer on the last turn is not out of turns, and the time spent in the tools is counted
    (traj,), _ = run(play(demo_db, {q.question: expert_script(q)}, [q], Episode(max_turns=3)))
    assert (traj.metrics["ran_out_of_turns"], traj.metrics["answer_correct"]) == (0, 1)
    assert traj.metrics["env_s"] > 0 and traj.messages_and_choices[-1]["content"] == "Answer recorded."


def test_api_error_and_timeout_end_the_episode_without_raising(demo_db, q):
    """Also catches an error recorded without the server's words (the reason a user needs), or with a key the
    server quoted left in: the error goes to logs, traces and the report; and one cut at another length than
    its documented 300 characters."""
    failure = {"status": 500, "message": "quota exceeded for key sk-live0123456789abcdef"}
    script = {q.question: [call("search_inbox", {"keywords": ["zebra"]}), failure]}
    (traj,), server = run(play(demo_db, script, [q], max_retries=1))
    assert traj.metrics["api_errors"] == 1 and traj.metrics["num_turns"] == 1
    assert "InternalServerError" in traj.metadata["error"] and "quota exceeded for key sk-[redacted]" in \
        traj.metadata["error"] and "0123456789" not in traj.metadata["error"]
    assert len(server.requests) == 3  # the client retried the 500 once
    (traj,), _ = run(play(demo_db, {q.question: [{"status": 503, "message": "y" * 400}]}, [q]))
    prefix = "policy API error: InternalServerError: "  # then the client's words, the first 300 characters
    error = traj.metadata["error"]
    assert error.startswith(prefix + "Error code: 503") and len(error) == len(prefix) + 300 and error.endswith("y")
    slow = {q.question: [{"sleep": 5, "text": "late"}]}
    (traj,), _ = run(play(demo_db, slow, [q], timeout=0.5))
    assert traj.metrics["api_errors"] == 1 and "Timeout" in traj.metadata["error"]


def test_a_reply_with_no_choices_is_an_api_error_not_a_crash(demo_db, q):
    """`choices: []` from a policy server crashed the rollout (IndexError) and with it the whole step."""
    empty = {"raw": {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}}}
    (traj,), _ = run(play(demo_db, {q.question: [empty]}, [q]))
    assert traj.metrics["api_errors"] == 1 and traj.metrics["answer_correct"] == 0 and traj.metrics["num_turns"] == 0
    assert traj.metadata["error"] == "policy API error: the reply had no choices"
    assert traj.reward == rewards.reward("offline", rewards.Rubric(api_errors=1), 10, 0)


def test_a_reply_whose_token_counts_are_null_counts_no_tokens(demo_db, q):
    """Some servers send `usage` with null counts. Catches them counted as anything but zero (the tokens are what
    the evaluation prices a model by)."""
    answer = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "return_final_answer", "arguments": json.dumps(
                {"answer": q.answer, "sources": q.message_ids})}}]}}],
        "usage": {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None}}
    (traj,), _ = run(play(demo_db, {q.question: [{"raw": answer}]}, [q]))
    m = traj.metrics
    assert (m["prompt_tokens"], m["completion_tokens"], m["sequence_tokens"], m["answer_correct"]) == (0, 0, 0, 1)


def test_model_and_tool_time_add_up_over_the_turns(demo_db, q, monkeypatch):
    """With a clock that moves one second per reading, each turn's model call and its tool work take a second
    each. Catches an episode's time that keeps only the last turn's, or counts it the wrong way."""
    import email_agent.agent.rollout as rollout_module

    ticks = itertools.count()
    monkeypatch.setattr(rollout_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    (traj,), _ = run(play(demo_db, {q.question: expert_script(q)}, [q]))
    assert (traj.metrics["num_turns"], traj.metrics["latency_s"], traj.metrics["env_s"]) == (3, 3.0, 3.0)


def test_cannot_read_other_inboxes_or_future_mail(demo_db, q):
    """The agent's search and read are scoped to the question's inbox and to mail sent up to its day. Catches a
    rollout whose tools lose either bound (a search that drops `visible_until` shows the future email below; one
    that drops the inbox shows the other inbox's), and a read that does the same."""
    other = demo_db.conn.execute(
        "SELECT message_id FROM emails e WHERE NOT EXISTS (SELECT 1 FROM mailbox m WHERE m.address = ? "
        "AND m.email_id = e.id) LIMIT 1", (q.inbox_address,)).fetchone()[0]
    future = demo_db.conn.execute(
        "SELECT message_id FROM emails e WHERE date >= ? AND EXISTS (SELECT 1 FROM mailbox m WHERE m.address = ? "
        "AND m.email_id = e.id) LIMIT 1", (q.query_date + " 23:59:59", q.inbox_address)).fetchone()[0]

    def word_also_visible(message_id, inbox):
        """A word of the email's subject that the scoped search finds in visible mail too: a search for it lists
        results, and would list the email itself without the bound under test."""
        email = demo_db.read(message_id)
        for word in (w.strip(".,:;!?()'\"") for w in email.subject.split()):
            if len(word) > 3 and demo_db.search(q.inbox_address, [word], visible_until=q.query_date + " 24") and \
                    message_id in {r.message_id for r in demo_db.search(inbox, [word], max_results=20)}:
                return word
        raise AssertionError(f"no word of {email.subject!r} to search with")

    owner = demo_db.conn.execute("SELECT address FROM mailbox m JOIN emails e ON e.id = m.email_id "
                                 "WHERE e.message_id = ? LIMIT 1", (other,)).fetchone()[0]
    future_word, other_word = word_also_visible(future, q.inbox_address), word_also_visible(other, owner)
    script = {q.question: [call("read_email", {"message_id": other}), call("read_email", {"message_id": future}),
                           call("search_inbox", {"keywords": [future_word], "max_results": 20}),
                           call("search_inbox", {"keywords": [other_word], "max_results": 20}),
                           call("search_inbox", {"keywords": ['") OR 1=1 --', "*", "NEAR(a b)"]})]}
    (traj,), server = run(play(demo_db, script, [q], Episode(max_turns=5)))
    contents = [m["content"] for m in server.requests[-1]["messages"] if m["role"] == "tool"]
    assert "no email with message_id" in contents[0] and "no email with message_id" in contents[1]
    assert traj.metrics["ever_read_invalid_email"] == 1 and traj.metrics["bad_tool_args"] == 0
    for content in contents[2:4]:
        listed = {r["message_id"] for r in json.loads(content)}
        assert listed and future not in listed and other not in listed
        for mid in listed:  # each one in the inbox, and sent by the question's day
            assert demo_db.read(mid, inbox=q.inbox_address, visible_until=q.query_date + " 24") is not None


def test_concurrent_rollouts(demo_db):
    qs = qmod.select_questions(demo_db, "train", limit=12)
    scripts = {x.question: expert_script(x) for x in qs}
    trajs, _ = run(play(demo_db, scripts, qs))
    assert [t.metadata["question_id"] for t in trajs] == [x.id for x in qs]
    assert all(t.metrics["sources_correct"] == 1 and t.metrics["answer_correct"] == 1 for t in trajs)


def test_latency_counts_the_model_not_the_wait_for_a_request_slot(demo_db):
    qs = qmod.select_questions(demo_db, "train", limit=4)
    answer = {"sleep": 0.3, **call("return_final_answer", {"answer": "I don't know", "sources": []})}

    async def one_slot():
        async with ScriptedServer({x.question: [answer] for x in qs}) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            policy = Policy(client, "scripted", max_concurrency=1)
            started = asyncio.get_running_loop().time()
            trajs = await asyncio.gather(*(rollout(policy, x, demo_db, Episode()) for x in qs))
            await client.close()
            return trajs, asyncio.get_running_loop().time() - started

    trajs, wall = run(one_slot())
    assert wall >= 4 * 0.3  # the episodes really queued for the one slot
    # each episode's own request took ~0.3 s; the last one waited ~0.9 s before it was sent
    assert all(0.3 <= t.metrics["latency_s"] < 0.6 for t in trajs), [t.metrics["latency_s"] for t in trajs]


@pytest.mark.parametrize("penalty", [1.0, 2.0, 4.0])
def test_reward_ordering_holds_everywhere(penalty):
    """correct > "I don't know" > wrong with the same partial credit and penalties; a sound abstention (a search
    ran and the right email never showed up) beats every wrong answer; running out of turns, abstaining with
    the answer in view, or abstaining without a search that ran, sits below a sound abstention."""
    import itertools

    worst_correct, best_idk, best_wrong, worst_sound_idk = 9, -9, -9, 9
    cases = itertools.product((0, 1), (0, 1), (0, 1), (0, 3, 9), (1, 10), (0, 2))
    for found, read, cited, bad, turns, searches in cases:
        base = dict(ever_found_right_email=found, ever_read_right_email=read, sources_correct=cited,
                    bad_tool_args=bad, num_turns=turns, searches=searches)
        worst_correct = min(worst_correct, shaped_reward(Rubric(answer_correct=1, attempted_answer=1, **base), 10, 1))
        idk = shaped_reward(Rubric(returned_i_dont_know=1, **base), 10, 1)
        wrong = shaped_reward(Rubric(attempted_answer=1, hallucinated=1, **base), 10, 1, penalty)
        best_idk, best_wrong = max(best_idk, idk), max(best_wrong, wrong)
        assert idk > wrong
        if not cited:  # citing needs an answer
            out_of_turns = shaped_reward(Rubric(ran_out_of_turns=1, **base), 10, 1)
            api_ended = shaped_reward(Rubric(api_errors=1, **base), 10, 1)
            assert api_ended > out_of_turns > wrong  # the server's failure is not the policy's decision
            if not found and not read and searches:
                worst_sound_idk = min(worst_sound_idk, idk)
                assert idk == api_ended > out_of_turns
            else:
                assert idk == out_of_turns  # the answer was in view, or it never looked
    assert worst_correct > best_idk and worst_sound_idk > best_wrong


def test_an_episodes_limits_and_a_served_model_become_the_rollouts_settings():
    """Catches: an episode's turn limit or results per search dropped on the way to the environment (the evaluation of a
    checkpoint must play the episodes it was trained on), or a trained model's client left without a time limit
    (a hung server would stall a training step for ever)."""
    import art
    from email_agent.agent.episode import Episode

    trained = Episode(max_turns=3, max_tokens=50, max_body_chars=700, search_results=4, reward="offline")
    episode = trained.scored(Episode(max_turns=10, search_results=9, reward="judge", grounded_answers=True))
    assert episode.limits() == {"max_turns": 3, "max_tokens": 50, "max_body_chars": 700, "search_results": 4}
    assert (episode.reward, episode.grounded_answers) == ("judge", True)
    model = art.Model(name="agent", project="p", inference_base_url="http://127.0.0.1:9/v1",
                      inference_model_name="agent@2")
    policy = Policy.for_model(model)
    assert (policy.model, policy.client.timeout, policy.client.max_retries) == ("agent@2", 300.0, 2)
    policy = Policy.for_model(model, timeout=5.0, max_retries=0, temperature=0.3, max_concurrency=3)
    assert (policy.client.timeout, policy.client.max_retries, policy.temperature, policy.max_concurrency) == \
        (5.0, 0, 0.3, 3)  # the sampling settings reach the policy, the client's reach the client


def test_shaped_reward_hand_values():
    """The bands of `shaped_reward`'s docstring, by hand. Catches: the precise-citing bonus multiplied instead of
    divided by the number of sources, given for sources that are wrong or to an answer that cites none; and a
    default penalty for a wrong answer other than ART·E's 1."""
    right = dict(answer_correct=1, attempted_answer=1, num_turns=4)
    assert shaped_reward(Rubric(**right, sources_correct=1), 10, 2) == pytest.approx(1 + 0.3 + 0.1 / 2 + 0.06)
    assert shaped_reward(Rubric(**right, sources_correct=1), 10, 1) == pytest.approx(1 + 0.3 + 0.1 + 0.06)
    assert shaped_reward(Rubric(**right), 10, 2) == pytest.approx(1 + 0.06)  # cited, but not the gold email
    assert shaped_reward(Rubric(**right), 10, 0) == pytest.approx(1 + 0.06)  # cited nothing
    assert shaped_reward(Rubric(**right, bad_tool_args=2), 10, 0) == pytest.approx(1 + 0.06 - 0.2)
    credit = dict(ever_found_right_email=1, ever_read_right_email=1, sources_correct=1)
    wrong = Rubric(attempted_answer=1, hallucinated=1, bad_tool_name=9, **credit)
    assert shaped_reward(wrong, 10, 1) == pytest.approx(-1 + 0.3 - 0.5)  # penalty 1; bad calls cost 0.5 at most
    assert shaped_reward(wrong, 10, 1, hallucination_penalty=2) == pytest.approx(-2 + 0.3 - 0.5)
    assert shaped_reward(Rubric(returned_i_dont_know=1, searches=1, ever_found_right_email=1), 10, 0) == \
        pytest.approx(-0.5 + 0.1)  # "I don't know" with the answer in view


@needs_enron
def test_rollout_on_real_enron_sample(enron_db):
    inbox = "gerald.nemec@enron.com"
    hit = enron_db.search(inbox, ["falcon", "gas"])[0]
    email = enron_db.read(hit.message_id)
    question = Question(1, "What company do we want to do a transaction with for base gas?", "Falcon Gas",
                        [hit.message_id], 1.0, inbox, email.date[:10], "test")
    script = {question.question: [call("search_inbox", {"keywords": ["falcon", "gas"]}),
                                  call("read_email", {"message_id": hit.message_id}),
                                  call("return_final_answer", {"answer": "Falcon Gas", "sources": [hit.message_id]})]}
    (traj,), _ = run(play(enron_db, script, [question]))
    assert traj.metrics["answer_correct"] == 1 and traj.metrics["ever_read_right_email"] == 1


def test_i_dont_know_is_graded_wrong_by_rule(q):
    """`--rejudge` writes this verdict into results.jsonl as it is. Catches an "I don't know" recorded as right."""
    from email_agent.agent.grading import grade

    rubric = Rubric()
    verdict = asyncio.run(grade(rubric, q, "I don't know", [], Episode()))
    assert (verdict.correct, verdict.judge, verdict.reasoning) == (False, "rule", "answered I don't know")
    assert (rubric.returned_i_dont_know, rubric.attempted_answer, rubric.answer_correct) == (1, 0, 0)


def test_graded_rollout_uses_the_question(demo_db, q):
    """The rollout grades with the question: a gold answer ending in the question's last word ("... Glasgow")
    is matched by the expert's answer without it."""
    last_word = q.question.rstrip("?").split()[-1]
    asked = dataclasses.replace(q, answer=f"{q.answer} {last_word}")
    (traj,), _ = run(play(demo_db, {asked.question: expert_script(q)}, [asked]))
    assert traj.metadata["answer"] == q.answer and traj.metrics["answer_correct"] == 1


def test_ungrounded_terms_are_the_names_and_numbers_in_nothing_the_agent_saw():
    messages = [{"role": "system", "content": "Room 7Q is in the system prompt only"},
                {"role": "user", "content": "Which room is the Egret kickoff in?"},
                {"role": "assistant", "content": "Maybe Room 12?"},  # the agent's own words prove nothing
                {"role": "tool", "content": json.dumps([{"subject": "Kickoff", "snippet": "Café Élan"}])},
                {"role": "tool", "content": json.dumps({"body": "moved to Room 4B at 2:30 PM, code 2FXQ7R,\nKestrel"})},
                {"role": "tool", "content": "Error: no email with message_id 'Room 9Z' in this inbox."},
                {"role": "user", "content": "Error: reply with a tool call, not plain text."}]
    assert grading.ungrounded_terms("Room 4B at 2:30 PM", messages) == []
    assert grading.ungrounded_terms("CAFÉ ELAN, for the Egret kickoff", messages) == []  # question words count
    assert grading.ungrounded_terms("Room 7Q", messages) == ["7Q"]  # the system prompt is not evidence
    assert grading.ungrounded_terms("Room 12", messages) == ["12"]
    assert grading.ungrounded_terms("FXQ7R", messages) == ["FXQ7R"]  # a code with a dropped character
    assert grading.ungrounded_terms("Room 3 or Room 3", messages) == ["3"]
    assert grading.ungrounded_terms("Room 9Z", messages) == ["9Z"]  # an error quoting the agent proves nothing
    assert grading.ungrounded_terms("Tuesday, March 12", messages) == ["12"]  # calendar names follow from dates
    # a JSON reply is read by its values: "\nKestrel" is "Kestrel", not the escaped text's "nKestrel"
    assert grading.ungrounded_terms("Kestrel", messages) == []


def test_grounding_check_withholds_answers_naming_what_the_agent_never_saw(demo_db, q):
    invented = {q.question: expert_script(q, answer="Zanzibar Lodge")}
    (plain,), _ = run(play(demo_db, invented, [q]))
    assert plain.metrics["hallucinated"] == 1 and plain.metrics["withheld_answer"] == 0
    assert plain.metadata["withheld"] is None
    (checked,), _ = run(play(demo_db, invented, [q], Episode(grounded_answers=True)))
    m = checked.metrics
    assert (m["returned_i_dont_know"], m["attempted_answer"], m["hallucinated"]) == (1, 0, 0)
    assert (m["withheld_answer"], m["withheld_right"], m["judge_error"]) == (1, 0, 0)  # graded, by a judge that ran
    assert checked.metadata["answer"] == grading.IDK and json.loads(checked.metadata["sources"]) == []
    assert json.loads(checked.metadata["withheld"]) == {"answer": "Zanzibar Lodge", "sources": q.message_ids,
                                                        "unseen": ["Zanzibar"]}
    assert "Zanzibar" in checked.metadata["verdict_reasoning"]
    assert checked.reward > plain.reward  # withheld, it is scored as the abstention it now is
    assert checked.metadata["verdict_judge"] == "rule"
    # "I don't know" (no name in it to check) and no answer at all pass the check untouched
    idk = {q.question: expert_script(q, answer="I don't know", sources=[])}
    (abstained,), _ = run(play(demo_db, idk, [q], Episode(grounded_answers=True)))
    assert abstained.metrics["withheld_answer"] == 0 and abstained.metadata["withheld"] is None
    assert (abstained.metadata["verdict_judge"], abstained.metadata["verdict_reasoning"]) == ("rule",
                                                                                             "answered I don't know")
    (silent,), _ = run(play(demo_db, {q.question: expert_script(q)[:1]}, [q], Episode(max_turns=1,
                                                                                             grounded_answers=True)))
    assert silent.metrics["ran_out_of_turns"] == 1 and silent.metadata["withheld"] is None
    # a right answer copied from the email passes; one that adds an unseen code is withheld, and counted as right
    (right,), _ = run(play(demo_db, {q.question: expert_script(q)}, [q], Episode(grounded_answers=True)))
    assert right.metrics["answer_correct"] == 1 and right.metrics["withheld_answer"] == 0
    padded = {q.question: expert_script(q, answer=f"{q.answer}, booking 9ZZ9")}
    (costly,), _ = run(play(demo_db, padded, [q], Episode(grounded_answers=True)))
    m = costly.metrics
    assert (m["withheld_answer"], m["withheld_right"], m["answer_correct"]) == (1, 1, 0)
