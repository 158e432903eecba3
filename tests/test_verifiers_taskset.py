"""The verifiers taskset (environments/email_inbox) against the project's own episode, in .venv-verifiers.

Episodes are played by the project's rollout (a scripted policy server) and the same replies are scored by the
taskset through verifiers' loader and its `score` (tests/verifiers_scoring.py, run by that venv's Python): the
reward and the rubric must be the project's. Its tool server's handlers must offer the project's schemas and
answer as the project's tools do, in the question's inbox only; its request hook must word refused calls as the
project does. `bench/bench_verifiers.py` plays the same taskset through vf-eval against a served checkpoint.
"""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, first_messages, rollout
from email_agent.agent.tools import EXTRA_TOOL_CALL, TOOLS, Inbox, call_tool
from email_agent.data import questions as qmod
from scripted_server import ScriptedServer, call, expert_script, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
VF_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
needs_verifiers = pytest.mark.skipif(not VF_PYTHON.exists(),
                                     reason="no .venv-verifiers: `make setup-verifiers` makes it")

LIMITS = dict(max_turns=4, max_body_chars=600, search_results=3)  # the demo run's
RUBRIC = ("answer_correct", "hallucinated", "returned_i_dont_know", "attempted_answer", "sources_correct",
          "withheld_answer", "withheld_right", "num_turns", "ran_out_of_turns", "ever_found_right_email",
          "ever_read_right_email", "ever_read_invalid_email", "searches", "tool_calls", "valid_tool_calls",
          "bad_tool_args", "bad_tool_name", "extra_tool_calls", "parse_errors")


def in_verifiers(request: dict) -> dict:
    done = subprocess.run([str(VF_PYTHON), str(ROOT / "tests" / "verifiers_scoring.py")], input=json.dumps(request),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def scripts_for(qs) -> dict:
    """Six ways an episode goes, one per question: right, wrong (a name no email holds: withheld by the grounding
    check), "I don't know", a malformed call then right, two calls in a turn, and out of turns."""
    a, b, c, d, e, f = qs
    search = call("search_inbox", {"keywords": ["budget"]})
    return {
        a.question: expert_script(a),
        b.question: [search, call("return_final_answer", {"answer": "Zebulon Quartz 77", "sources": []})],
        c.question: [search, call("return_final_answer", {"answer": "I don't know", "sources": []})],
        d.question: [call("search_inbox", "{not json"), call("send_email", {"to": "x"}), *expert_script(d)[1:]],
        e.question: [{"calls": [("search_inbox", {"keywords": ["budget"]}),
                                ("read_email", {"message_id": e.message_ids[0]})]},
                     call("return_final_answer", {"answer": e.answer, "sources": e.message_ids})],
        f.question: [search] * 5,
    }


def replies_of(traj) -> list[dict]:
    """The assistant replies of a played episode, as the model sent them."""
    replies = []
    for message in traj.messages():
        if message["role"] == "assistant":
            replies.append({"content": message.get("content"), "tool_calls": [
                [c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []]})
    return replies


@pytest.fixture(scope="module")
def played(demo_db, demo_db_path):
    """Six episodes played by the project's rollout, then scored (and the tools called) by the taskset."""
    qs = qmod.select_questions(demo_db, "test", seed=0)[:6]
    episode = Episode(**LIMITS, grounded_answers=True)

    async def play():
        async with ScriptedServer(scripts_for(qs)) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            policy = Policy(client, "scripted", temperature=0.0)
            trajs = await asyncio.gather(*(rollout(policy, q, demo_db, episode) for q in qs))
            await client.close()
            return trajs

    trajs = asyncio.run(play())
    q = qs[0]
    other = next(x for x in qs if x.inbox_address != q.inbox_address)
    tool_calls = [[q.id, "search_inbox", json.dumps({"keywords": q.question.split()[-2:]})],
                  [q.id, "read_email", json.dumps({"message_id": q.message_ids[0]})],
                  [q.id, "read_email", json.dumps({"message_id": other.message_ids[0]})],  # another inbox's mail
                  [q.id, "search_inbox", json.dumps({"keywords": ["x"], "folder": "inbox"})]]
    request = {"db": str(demo_db_path), **LIMITS, "task": {"grounded_answers": True}, "tool_calls": tool_calls,
               "episodes": [{"question_id": q.id, "replies": replies_of(t)} for q, t in zip(qs, trajs)]}
    return qs, trajs, tool_calls, in_verifiers(request)


@needs_verifiers
def test_the_taskset_scores_each_episode_as_the_projects_rollout_did(played):
    qs, trajs, _, out = played
    assert len(out["scored"]) == 6
    for q, traj, scored in zip(qs, trajs, out["scored"]):
        assert scored["question_id"] == q.id
        assert scored["rewards"]["reward"] == pytest.approx(traj.reward), q.question
        assert {k: scored["metrics"][k] for k in RUBRIC} == {k: float(traj.metrics[k]) for k in RUBRIC}, q.question
        assert scored["answer"] == traj.metadata["answer"]
    outcomes = [(s["metrics"]["answer_correct"], s["metrics"]["withheld_answer"], s["metrics"]["returned_i_dont_know"],
                 s["metrics"]["ran_out_of_turns"]) for s in out["scored"]]
    # right; withheld (ungrounded); I don't know; right after 2 bad calls; right with an extra call; out of turns
    assert outcomes == [(1, 0, 0, 0), (0, 1, 1, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 1)]
    assert out["scored"][3]["metrics"]["bad_tool_args"] == 1 and out["scored"][3]["metrics"]["bad_tool_name"] == 1
    assert out["scored"][4]["metrics"]["extra_tool_calls"] == 1
    # the episode ends at the first valid return_final_answer, as the rollout's loop does
    assert out["scored"][0]["answered_at"] == [False, False, True]
    assert out["scored"][5]["answered_at"] == [False] * 4


@needs_verifiers
def test_tasks_are_the_evaluations_questions_with_the_projects_prompt(played, demo_db):
    _, _, _, out = played
    expected = qmod.select_questions(demo_db, "test", seed=0)
    assert out["order"] == [q.id for q in expected]
    episode = Episode(**LIMITS)
    for q in expected[:5]:
        system, user = (m["content"] for m in first_messages(q, episode))
        assert out["prompts"][str(q.id)] == [system, user]


@needs_verifiers
def test_the_tool_server_offers_and_runs_the_projects_tools_in_the_questions_inbox_only(played, demo_db):
    qs, _, tool_calls, out = played
    q = qs[0]
    inbox = Inbox(demo_db, q.inbox_address, q.query_date, max_body_chars=LIMITS["max_body_chars"],
                  default_max_results=LIMITS["search_results"])
    listed = out["tool_results"][0]["listed"]
    assert [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["inputSchema"]}} for t in listed] == TOOLS
    for (_, name, arguments), result in zip(tool_calls, out["tool_results"]):
        assert result["content"] == [call_tool(inbox, name, arguments).content]
        assert not result["is_error"]  # a bad call is the project's one-sentence error, for the model to read
    assert "no email with message_id" in out["tool_results"][2]["content"][0]  # another inbox's mail stays unseen
    assert "has no argument 'folder'" in out["tool_results"][3]["content"][0]


@needs_verifiers
def test_calls_the_harness_would_answer_itself_get_the_projects_words(played, demo_db):
    _, _, _, out = played
    assert out["rewritten"] == ["results", EXTRA_TOOL_CALL, call_tool(None, "send_email", "{}").content,
                                call_tool(None, "search_inbox", "{bad").content]


@needs_verifiers
def test_vf_eval_plays_the_scripted_episodes_as_the_projects_rollout_did(played, demo_db_path, tmp_path):
    """verifiers' own CLI end to end: its null harness (which streams), its interception, this taskset's tool
    servers over MCP, its stops, hook and scoring, against a policy scripted as the rollout's was: the same
    rewards and rubric, episode for episode."""
    qs, trajs, _, _ = played
    with serve_in_thread(scripts_for(qs)) as server:
        done = subprocess.run(
            [str(VF_PYTHON.parent / "vf-eval"), "email-inbox", "-m", "scripted", "--client.base-url", server.base_url,
             "--client.api-key-var", "SCRIPTED_KEY", "-n", "6", "-c", "6", "--env.taskset.db", str(demo_db_path),
             *[f"--env.taskset.{k.replace('_', '-')}={v}" for k, v in LIMITS.items()],
             "--env.taskset.task.grounded-answers", "true", "--no-push", "--no-rich", "-o", str(tmp_path),
             "--run.dir", "run"],
            env={**os.environ, "PATH": f"{VF_PYTHON.parent}{os.pathsep}{os.environ['PATH']}", "SCRIPTED_KEY": "test"},
            capture_output=True, text=True, timeout=900, cwd=tmp_path)  # no data/demo.db here: --env.taskset.db is used
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()]
    traces = {str(r["traces"][0]["task"]["data"]["question_id"]): r["traces"][0] for r in records}
    assert sorted(traces) == sorted(str(q.id) for q in qs)
    for q, traj in zip(qs, trajs):
        trace = traces[str(q.id)]
        assert trace["rewards"]["reward"]["score"] == pytest.approx(traj.reward), q.question
        assert {k: trace["metrics"][k] for k in RUBRIC} == {k: float(traj.metrics[k]) for k in RUBRIC}, q.question


def vf_eval_refused(*flags: str, cwd: Path) -> tuple[subprocess.CompletedProcess, str]:
    """vf-eval against a model at a closed port: what it says before it would call the model."""
    done = subprocess.run([str(VF_PYTHON.parent / "vf-eval"), "email-inbox", *flags, "-m", "m", "--client.base-url",
                           "http://127.0.0.1:9/v1", "-n", "1", "--no-push", "--no-rich"],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    return done, " ".join((done.stdout + done.stderr).replace("│", " ").split())  # verifiers boxes a bad config


@needs_verifiers
def test_vf_eval_says_in_one_sentence_when_a_split_has_no_questions(demo_db_path, tmp_path):
    done, said = vf_eval_refused("--env.taskset.db", str(demo_db_path), "--env.taskset.split", "validation",
                                 cwd=tmp_path)
    assert done.returncode == 1
    assert "has no 'validation' questions; its splits are test, train" in said
    assert "Traceback" not in said


@needs_verifiers
def test_vf_eval_without_a_database_names_the_command_that_builds_one(tmp_path):
    """No flag at all, in a folder with no data/demo.db: the default database is missing, said in one sentence."""
    done, said = vf_eval_refused(cwd=tmp_path)
    assert done.returncode == 1
    assert "No database at data/demo.db; run `python train_email_search_agent.py build-db --demo` first." in said
    assert "Traceback" not in said


def test_the_bench_names_the_command_that_makes_a_missing_verifiers_venv(tmp_path):
    missing = tmp_path / "none"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_verifiers.py"), "--venv", str(missing)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: no verifiers venv at {missing}: make it with `make setup-verifiers`"
