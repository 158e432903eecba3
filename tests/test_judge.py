"""The LLM judge as the reward modes use it: --reward judge (1 for a right answer, 0 otherwise), a mode that needs a
judge refused without one, JUDGE_MODEL / JUDGE_API_BASE from the environment, and its on-disk cache surviving a
line a killed run cut off."""

import asyncio
import json

import pytest
from openai import AsyncOpenAI

from email_agent import rewards
from email_agent import questions as qmod
from email_agent.data import DataError
from email_agent.rollout import Policy, RolloutConfig, rollout
from scripted_server import ScriptedServer, expert_script

ACCEPT = {"text": json.dumps({"reasoning": "same facts", "accept": True})}
REJECT = {"text": json.dumps({"reasoning": "another place", "accept": False})}


@pytest.fixture(scope="module")
def q(demo_db):
    return qmod.select_questions(demo_db, "train", seed=0)[0]


def play(db, q, answer, judge_reply, mode, tmp_path):
    """One episode answering `answer`, graded by a scripted judge in reward mode `mode`."""
    scripts = {"agent": {q.question: expert_script(q, answer=answer)}, "judge": {"*": [judge_reply]}}

    async def go():
        async with ScriptedServer(scripts) as server:
            mode_, judge = rewards.configure(mode, "openai/judge", server.base_url, tmp_path)
            client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            traj = await rollout(Policy(client, "agent"), q, db, RolloutConfig(reward=mode_, judge=judge))
            return traj, [r for r in server.requests if r["model"] == "judge"]

    return asyncio.run(go())


@pytest.mark.parametrize("judge_reply, reward", [(ACCEPT, 1.0), (REJECT, 0.0)])
def test_reward_judge_is_the_judges_verdict_alone(demo_db, q, tmp_path, judge_reply, reward):
    """A paraphrase the offline matcher would fail: under --reward judge only the judge decides, 1 or 0 (no
    partial credit, no turn bonus, no hallucination penalty)."""
    traj, asked = play(demo_db, q, "the answer, in other words", judge_reply, "judge", tmp_path)
    assert len(asked) == 1 and traj.metadata["verdict_judge"] == "openai/judge"
    assert traj.reward == reward and traj.metrics["answer_correct"] == int(reward)
    assert traj.metrics["hallucinated"] == 1 - int(reward)


@pytest.mark.parametrize("mode", ["judge", "shaped"])
def test_a_reward_that_needs_a_judge_is_refused_without_one(monkeypatch, tmp_path, mode):
    monkeypatch.delenv("JUDGE_MODEL", raising=False)
    with pytest.raises(DataError, match=f"--reward {mode} needs a judge: pass --judge-model"):
        rewards.configure(mode, None, None, tmp_path)
    assert rewards.configure(None, None, None, tmp_path) == ("offline", None)  # no judge: offline by default


def test_the_judge_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JUDGE_MODEL", "openai/env-judge")
    monkeypatch.setenv("JUDGE_API_BASE", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("JUDGE_API_KEY", "judge-secret")
    mode, judge = rewards.configure(None, None, None, tmp_path)
    assert mode == "shaped" and judge.model == "openai/env-judge"  # a judge makes shaped the default
    assert judge.litellm_params() == {"api_base": "http://127.0.0.1:9/v1", "api_key": "judge-secret",
                                      "timeout": 60.0}
    assert "judge-secret" not in repr(judge)
    # a flag wins over the environment
    assert rewards.configure(None, "openai/flag-judge", None, tmp_path)[1].model == "openai/flag-judge"


def test_the_judge_cache_survives_a_torn_line(demo_db, q, tmp_path):
    """A run killed while appending to judge_cache.jsonl leaves half a line: the next run reads the whole lines,
    answers those verdicts from the cache without asking, and appends after them (it used to append to the torn
    line, so the next verdict was lost with it)."""
    traj, asked = play(demo_db, q, "the answer, in other words", ACCEPT, "shaped", tmp_path)
    assert len(asked) == 1 and traj.metrics["answer_correct"] == 1
    cache = tmp_path / "judge_cache.jsonl"
    with open(cache, "a") as f:
        f.write('{"key": "abc", "verdict": {"correct": tr')  # the torn line
    traj, asked = play(demo_db, q, "the answer, in other words", REJECT, "shaped", tmp_path)
    assert asked == [] and traj.metrics["answer_correct"] == 1  # the cached verdict, not the judge's new one
    traj, asked = play(demo_db, q, "yet another wording", REJECT, "shaped", tmp_path)
    assert len(asked) == 1 and traj.metrics["answer_correct"] == 0
    lines = cache.read_text().splitlines()
    assert [json.loads(line)["verdict"]["correct"] for line in lines] == [True, False]  # the torn line is gone


def test_judge_failures_are_transient_or_not():
    """What decides whether a training step waits for the judge (judging.settle) or stops at once."""
    class Status(Exception):
        def __init__(self, status):
            self.status_code = status

    assert all(rewards.may_pass(Status(s)) for s in (408, 429, 500, 502, 503))
    assert not any(rewards.may_pass(Status(s)) for s in (400, 401, 403, 404))
    assert not rewards.may_pass(ValueError("judge reply has no JSON"))  # a reply that never parses
