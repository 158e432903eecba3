"""`train_email_search_agent.py ask`: one question to an agent, through the same rollout, shown as it happens."""

import json

import pytest

from email_agent.data import questions as qmod
from scripted_server import call, expert_script, serve_in_thread
from art_doubles import on_a_gpu_machine
from test_evaluate import GPU_LIMITS, make_gpu_run

import train_email_search_agent as cli


@pytest.fixture(scope="module")
def q(demo_db):
    return qmod.select_questions(demo_db, "test", seed=0, limit=1)[0]


def ask(*argv):
    return cli.main(["ask", *map(str, argv)])


def test_ask_shows_each_call_then_the_answer_and_cited_emails(demo_db, demo_db_path, q, tmp_path, capsys):
    with serve_in_thread({q.question: expert_script(q)}) as server:
        rc = ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/x",
                 "--base-url", server.base_url, "--art-dir", tmp_path)
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.splitlines()
    gold = demo_db.read(q.message_ids[0])
    assert lines[0].startswith("> search_inbox {") and "result(s)" in lines[1]
    assert lines[2] == f'> read_email {{"message_id": "{gold.message_id}"}}'
    assert gold.subject[:40] in lines[3] and gold.from_address in lines[3]
    assert lines[4].startswith("> return_final_answer")
    assert f"answer: {q.answer}" in lines
    assert lines[-1] == f"  {gold.date}  {gold.from_address}  {gold.subject}  {gold.message_id}"
    assert "tool_choice" not in out.out and "correct" not in out.out  # no gold answer, nothing graded


def day_before(day: str) -> str:
    from datetime import date, timedelta

    return (date.fromisoformat(day) - timedelta(days=1)).isoformat()


def test_ask_json(demo_db, demo_db_path, q, tmp_path, capsys):
    script = [{"text": "let me think"}, *expert_script(q)]
    with serve_in_thread({q.question: script}) as server:
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/x",
                   "--base-url", server.base_url, "--json", "--as-of", q.query_date, "--art-dir", tmp_path) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["answer"] == q.answer and result["sources"] == q.message_ids and result["turns"] == 4
    assert [c["tool"] for c in result["tool_calls"]] == [None, "search_inbox", "read_email", "return_final_answer"]
    assert result["cited"][0]["message_id"] == q.message_ids[0] and result["as_of"] == q.query_date
    assert f"Today's date is {q.query_date}" in server.requests[0]["messages"][0]["content"]
    # --as-of is the agent's today: asked the day before the gold email was sent, it cannot read it
    gold_day = demo_db.read(q.message_ids[0]).date[:10]
    with serve_in_thread({q.question: script}) as server:
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/x",
                   "--base-url", server.base_url, "--json", "--as-of", day_before(gold_day), "--art-dir", tmp_path) == 0
    result = json.loads(capsys.readouterr().out)
    read_reply = [m["content"] for m in server.requests[-1]["messages"] if m["role"] == "tool"][1]
    assert "no email with message_id" in read_reply and result["cited"] == []


def test_ask_with_grounded_answers_withholds_an_invented_answer(demo_db_path, q, tmp_path, capsys):
    script = expert_script(q, answer="Bittern 77Z")
    with serve_in_thread({q.question: script}) as server:
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/x",
                   "--base-url", server.base_url, "--grounded-answers", "--art-dir", tmp_path) == 0
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/x",
                   "--base-url", server.base_url, "--grounded-answers", "--json", "--art-dir", tmp_path) == 0
    shown, printed = capsys.readouterr().out.split("\n{", 1)
    assert "answer: I don't know" in shown
    assert "(withheld 'Bittern 77Z': 77Z in no email or search result it saw)" in shown
    result = json.loads("{" + printed)
    assert result["answer"] == "I don't know" and result["sources"] == [] and result["cited"] == []
    assert result["withheld"] == {"answer": "Bittern 77Z", "sources": q.message_ids, "unseen": ["77Z"]}


def test_ask_without_model_uses_the_most_recent_run_and_its_limits(demo_db_path, q, tmp_path, capsys, monkeypatch):
    assert ask("Anything?", "--inbox", q.inbox_address, "--db", demo_db_path, "--art-dir", tmp_path / "none") == 1
    err = capsys.readouterr().err
    assert "no trained run under" in err and "--model" in err and "base" in err and "Traceback" not in err

    make_gpu_run(tmp_path / "art")
    with on_a_gpu_machine(monkeypatch, {q.question: expert_script(q)}) as (_, server, _):
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--art-dir", tmp_path / "art",
                   "--json") == 0
        policy_requests = [r for r in server.requests if r.get("tools")]
    assert {r["model"] for r in policy_requests} == {"gpu@2"}
    assert {r["max_completion_tokens"] for r in policy_requests} == {GPU_LIMITS["max_tokens"]}
    assert json.loads(capsys.readouterr().out)["model"] == "gpu@2"


def test_ask_out_of_turns_and_made_up_sources(demo_db_path, q, tmp_path, capsys):
    wander = [call("search_inbox", {"keywords": ["zebra"]})] * 2
    made_up = [call("return_final_answer", {"answer": "Room 9", "sources": ["<nope@x>"]})]
    with serve_in_thread({"a": {q.question: wander}, "b": {q.question: made_up}}) as server:
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/a",
                   "--base-url", server.base_url, "--max-turns", 2, "--art-dir", tmp_path) == 0
        assert "no answer after 2 turns" in capsys.readouterr().out
        assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "hosted_vllm/b",
                   "--base-url", server.base_url, "--art-dir", tmp_path) == 0
        assert "<nope@x>  (not an email in this inbox" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--inbox", "nobody@nowhere.example"],
     "has no mail sent or received by 'nobody@nowhere.example'; its largest inboxes: "),
    (["--as-of", "yesterday"], "--as-of must be a date"),
    (["--as-of", ""], "--as-of must be a date like 2001-05-31, not ''"),
    (["--as-of", "2024-04-24T23:59 garbage"], "not '2024-04-24T23:59 garbage'"),
    (["--model", "demo@"], "--model demo@: give a step after '@'"),
    (["--model", "hosted_vllm/x", "--base-url", "http://127.0.0.1:9/v1"], "cannot reach http://127.0.0.1:9/v1"),
    (["--model", "nonsense"], "neither a run"),
    (["--max-turns", "0"], "--max-turns must be at least 1, not 0"),
    (["--max-tokens", "-1"], "--max-tokens must be at least 1, not -1"),
])
def test_ask_bad_input_is_one_clear_error(demo_db_path, q, tmp_path, capsys, argv, message):
    defaults = {"--inbox": q.inbox_address, "--model": "hosted_vllm/x", "--base-url": "http://127.0.0.1:9/v1"}
    given = dict(zip(argv[::2], argv[1::2]))
    flags = [x for k, v in {**defaults, **given}.items() for x in (k, v)]
    assert ask(q.question, "--db", demo_db_path, "--art-dir", tmp_path, *flags) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_timestamp_as_of_is_its_day(demo_db, q):
    from email_agent.apps.ask import adhoc_question

    assert adhoc_question(demo_db, "Where?", q.inbox_address, "2024-04-24T23:59").query_date == "2024-04-24"


def test_the_rollout_hook_sees_every_action(demo_db, q):
    """Also catches an outcome that does not name the call it answers (the hook's callers may read either), says
    another kind of mistake than the one made (an extra call, an answer with bad arguments), or, for a good
    answer, leaves out its parsed arguments as every other good call's outcome has them."""
    import asyncio

    from email_agent.agent.episode import Episode
    from email_agent.agent.rollout import Policy, rollout
    from openai import AsyncOpenAI

    seen = []
    script = [{"text": "hmm"}, call("nope", {}), {"calls": [("search_inbox", {"keywords": ["x"]}), ("nope", {})]},
              call("return_final_answer", {"answer": 7}), *expert_script(q)]
    with serve_in_thread({q.question: script}) as server:
        policy = Policy(AsyncOpenAI(base_url=server.base_url, api_key="x"), "x")
        traj = asyncio.run(rollout(policy, q, demo_db, Episode(), on_call=lambda *a: seen.append(a)))
    assert [(name, outcome.error if outcome else None) for name, _, outcome in seen] == [
        (None, None), ("nope", "bad_tool_name"), ("search_inbox", None), ("nope", "extra_tool_call"),
        ("return_final_answer", "bad_tool_args"), ("search_inbox", None), ("read_email", None),
        ("return_final_answer", None)]
    assert all(outcome.name == name for name, _, outcome in seen[1:])
    assert seen[-1][2].arguments == {"answer": q.answer, "sources": q.message_ids}
    assert seen[0][1] == "hmm" and traj.metrics["answer_correct"] == 1  # graded: a real question has a gold answer


@pytest.mark.slow
def test_ask_the_real_base_model_on_cpu(demo_db_path, q, tmp_path, capsys):
    """SmolLM2-135M, untrained, one short turn: the CPU path end to end (it rarely calls a tool; that is fine)."""
    assert ask(q.question, "--inbox", q.inbox_address, "--db", demo_db_path, "--model", "base", "--max-turns", 1,
               "--max-tokens", 16, "--json", "--art-dir", tmp_path) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "base:SmolLM2-135M-Instruct" and result["turns"] == 1 and result["tool_calls"]
    # one turn: it either answered or ran out of turns, and the JSON says which
    assert result["ran_out_of_turns"] == (result["answer"] is None)
