"""The LLM judge as the reward modes use it: --reward judge (1 for a right answer, 0 otherwise), a mode that needs a
judge refused without one, JUDGE_MODEL / JUDGE_API_BASE from the environment, and its on-disk cache surviving a
line a killed run cut off."""

import asyncio
import json
import re

import art
import pytest
from openai import AsyncOpenAI

from email_agent import model_api
from email_agent.agent import grading, llm_judge, rewards
from email_agent.data import questions as qmod
from email_agent.errors import UserError
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
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
            mode_, judge = grading.configure(mode, "openai/judge", server.base_url, tmp_path)
            client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            traj = await rollout(Policy(client, "agent"), q, db, Episode(reward=mode_, judge=judge))
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
def test_a_reward_that_needs_a_judge_is_refused_without_one(monkeypatch, tmp_path, mode, caplog):
    monkeypatch.delenv("JUDGE_MODEL", raising=False)
    with pytest.raises(UserError, match=f"--reward {mode} needs a judge: pass --judge-model"):
        grading.configure(mode, None, None, tmp_path)
    assert grading.configure(None, None, None, tmp_path) == ("offline", None)  # no judge: offline by default
    assert caplog.messages[-1] == (f"no judge configured: answers are graded OFFLINE by the {grading.GRADER} against "
                                   "the gold answer (pass --judge-model for an LLM judge).")  # said loudly
    with pytest.raises(UserError, match=re.escape("--reward must be one of offline, shaped, judge, ruler, not 'rlhf'")):
        grading.configure("rlhf", None, None, tmp_path)


def test_the_judge_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JUDGE_MODEL", "openai/env-judge")
    monkeypatch.setenv("JUDGE_API_BASE", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("JUDGE_API_KEY", "judge-secret")
    mode, judge = grading.configure(None, None, None, tmp_path)
    assert mode == "shaped" and judge.model == "openai/env-judge"  # a judge makes shaped the default
    assert judge.litellm_params() == {"api_base": "http://127.0.0.1:9/v1", "api_key": "judge-secret",
                                      "timeout": 60.0}
    assert "judge-secret" not in repr(judge)
    # the judge's cache may go in a folder that does not exist yet
    assert grading.configure(None, None, None, tmp_path / "new" / "run")[1].cache_path.parent.is_dir()
    # a flag wins over the environment
    assert grading.configure(None, "openai/flag-judge", None, tmp_path)[1].model == "openai/flag-judge"


def test_ruler_without_an_answer_judge_uses_the_judge_endpoint_and_key_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JUDGE_API_BASE", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("JUDGE_API_KEY", "judge-secret")
    assert model_api.judge_endpoint(None) == {"api_base": "http://127.0.0.1:9/v1", "api_key": "judge-secret"}
    assert model_api.judge_endpoint("http://flag/v1")["api_base"] == "http://flag/v1"  # the flag wins
    judge = grading.configure(None, "openai/j", None, tmp_path)[1]  # the answer judge asks the same endpoint
    assert judge.litellm_params() == model_api.judge_endpoint(None, judge.timeout)


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


def test_a_cache_line_that_does_not_parse_loses_only_itself(tmp_path):
    """Catches: reading the cache stopping at the first bad line (an older run's torn line, glued to the verdict
    after it), which would drop every verdict written after it."""
    cache = tmp_path / "judge_cache.jsonl"
    ask_judge([ACCEPT], "Which room?", "Room 3C", ["It is room 3C."], cache_path=cache)
    cache.write_text('{"key": "abc", "verdict": {"correct": tr{"key": "def"}\n' + cache.read_text())
    (verdict,), requests = ask_judge([REJECT], "Which room?", "Room 3C", ["It is room 3C."], cache_path=cache)
    assert requests == [] and verdict.correct


def test_judge_failures_are_transient_or_not():
    """What decides whether a training step waits for the judge (judge_outages.settle) or stops at once."""
    class Status(Exception):
        def __init__(self, status):
            self.status_code = status

    assert all(model_api.worth_waiting_for(Status(s)) for s in (408, 409, 429, 500, 502, 503))
    assert not any(model_api.worth_waiting_for(Status(s)) for s in (400, 401, 403, 404, 410))
    assert not model_api.worth_waiting_for(RuntimeError("no status at all"))
    assert model_api.worth_retrying(ValueError("judge reply has no JSON"))  # asked again at once ...
    assert not model_api.worth_waiting_for(ValueError("judge reply has no JSON"))  # ... not waited for: never parses


def test_a_judge_that_answers_in_prose_is_asked_again_then_graded_offline():
    """Catches: a malformed reply not retried (the judge may answer properly next time), or marked as a failure
    that waiting cures."""
    (verdict,), requests = ask_judge([{"text": "They match."}], "Which room?", "Room 3C", ["Room 3C"], retries=2)
    assert len(requests) == 2 and verdict.judge == "offline" and verdict.transient is False
    assert "judge reply has no JSON: 'They match.'" in verdict.error


def test_judge_endpoints_get_a_placeholder_key_only_when_local():
    """Catches: a placeholder key sent to a provider's own API (it must fall back to e.g. OPENAI_API_KEY), or none
    sent to a local server (the OpenAI client refuses to send no key)."""
    assert model_api.endpoint_params(None, None) == {}
    assert model_api.endpoint_params("http://127.0.0.1:8000/v1", None, 5.0) == {
        "api_base": "http://127.0.0.1:8000/v1", "api_key": "none", "timeout": 5.0}
    assert model_api.endpoint_params(None, "sk-x") == {"api_key": "sk-x"}


def ask_judge(replies, question, gold, answers, retries=3, cache_path=None):
    """`answers` graded in turn by one LLMJudge against a scripted judge that gives `replies`, one per request:
    (verdicts, the judge's requests)."""
    from scripted_server import serve_in_thread

    def script(body, seen=[]):
        return replies[min(len(seen.append(body) or seen), len(replies)) - 1]

    with serve_in_thread({"judge": {"*": script}}) as server:
        judge = llm_judge.LLMJudge("openai/judge", api_base=server.base_url, retries=retries, cache_path=cache_path)
        verdicts = [asyncio.run(judge.verdict(question, gold, answer)) for answer in answers]
        return verdicts, server.requests


def test_the_judge_sees_the_question_the_reference_and_the_answer_and_decides_once():
    """Catches: a request without the grading instructions as its system message, or with the question, the gold
    answer or the agent's answer left out; a sampled (temperature > 0) or unbounded verdict; a verdict cached
    as nothing (the second ask of the same answer must come from the cache); and "I don't know" sent to the
    judge at all (it is never right, whatever a judge says)."""
    verdicts, requests = ask_judge([ACCEPT], "Which room?", "Room 3C", ["It is room 3C.", "It is room 3C.",
                                                                        "I don't know"])
    assert [(v.correct, v.judge, v.reasoning) for v in verdicts] == [
        (True, "openai/judge", "same facts"), (True, "openai/judge", "same facts"),
        (False, "openai/judge", "answered I don't know")]
    assert len(requests) == 1
    assert requests[0]["messages"] == [
        {"role": "system", "content": llm_judge.JUDGE_PROMPT},
        {"role": "user", "content": "Question: Which room?\nReference answer: Room 3C\nAI answer: It is room 3C."}]
    assert requests[0]["temperature"] == 0 and requests[0]["max_tokens"] == 300


def test_a_judge_that_fails_leaves_the_offline_matchers_verdict_flagged():
    """Catches: the fallback grading without the question (here the answer "21" is right only because "FTEs"
    restates the question) or without its reasons."""
    question, gold = "How many FTEs were approved?", "21 FTEs"
    (verdict,), requests = ask_judge([{"status": 401}], question, gold, ["21"])
    offline = grading.offline_verdict("21", gold, question)
    assert offline.correct and len(requests) == 1  # a wrong key is not retried
    assert (verdict.correct, verdict.judge, verdict.reasoning) == (True, "offline", offline.reasoning)
    assert verdict.error.startswith("judge openai/judge failed after 1 try (AuthenticationError")
    assert "scripted failure" in verdict.error  # what the judge's server said
    assert verdict.transient is False


def test_a_judge_that_is_rate_limited_backs_off_exponentially_up_to_10_s(monkeypatch):
    """Catches: retries without waiting (a rate-limited judge hammered), or waits that grow otherwise than 0.5 s,
    1 s, 2 s ... capped at 10 s. The waits are recorded, not slept."""
    import tenacity.asyncio  # noqa: F401  (sleeps through asyncio.sleep, looked up at each wait)

    waits, real_sleep = [], asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda seconds: waits.append(seconds) or real_sleep(0))
    (verdict,), requests = ask_judge([{"status": 429}], "Which room?", "Room 3C", ["Room 3C"], retries=7)
    assert len(requests) == 7 and verdict.transient is True
    assert [w for w in waits if w] == [0.5, 1, 2, 4, 8, 10]


@pytest.mark.parametrize("text, correct, reasoning", [
    ('{\n  "reasoning": "same room",\n  "accept": true\n}', True, "same room"),  # pretty-printed over lines
    ('Verdict: {"accept": false}', False, ""),  # no reasoning given
    (json.dumps({"reasoning": "x" * 900, "accept": True}), True, "x" * 500),  # a rambling reason, cut
])
def test_judge_replies_that_parse(text, correct, reasoning):
    verdict = llm_judge.parse_judge_reply(text, "openai/judge")
    assert (verdict.correct, verdict.judge, verdict.reasoning) == (correct, "openai/judge", reasoning)


@pytest.mark.parametrize("text, says", [("They match.", "judge reply has no JSON: 'They match.'"),
                                         ('{"accept": "yes"}', "judge reply has no boolean 'accept'")])
def test_judge_replies_that_do_not_parse_say_why(text, says):
    """Catches: an error without its reason (it is what the report shows for a judge that answers in prose)."""
    with pytest.raises(ValueError, match=re.escape(says)):
        llm_judge.parse_judge_reply(text, "openai/judge")


def test_a_failing_judge_prints_no_litellm_banner(monkeypatch, capfd):
    """Catches: litellm's "Give Feedback / Get Help" banner printed for each failed verdict (the failure is
    recorded on the verdict and reported by the caller)."""
    import litellm

    monkeypatch.setattr(litellm, "suppress_debug_info", False)
    (verdict,), _ = ask_judge([{"status": 401}], "Which room?", "Room 3C", ["Room 3C"])
    out = capfd.readouterr()
    assert verdict.error and "Give Feedback" not in out.out + out.err and "LiteLLM" not in out.out + out.err


def test_an_episode_the_judge_failed_on_is_graded_again_as_it_was_played(demo_db, q, tmp_path):
    """What the train loop does once a judge that was down is back (`regrade_judge_failures`). Catches: the answer
    or its sources not read back from the episode, outcome fields left from the offline fallback, and the run's
    hallucination penalty dropped from the new reward."""
    from email_agent.agent.grading import regrade_judge_failures

    scripts = {"agent": {q.question: expert_script(q)}, "judge": {"*": [{"status": 401}]}}

    async def go():
        async with ScriptedServer(scripts) as server:
            judge = llm_judge.LLMJudge("openai/judge", api_base=server.base_url, retries=1)
            config = Episode(reward="shaped", judge=judge, hallucination_penalty=2.0)
            client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            traj = await rollout(Policy(client, "agent"), q, demo_db, config)
            first = (dict(traj.metrics), dict(traj.metadata))
            server.scripts["judge"] = {"*": [REJECT]}  # back, and it rejects the answer
            group = await regrade_judge_failures(art.TrajectoryGroup([traj]), {q.id: q}, config)
            return first, group.trajectories[0], server.requests

    (metrics, metadata), traj, requests = asyncio.run(go())
    assert metadata["verdict_error"] and metadata["verdict_judge"] == "offline" and metrics["judge_error"] == 1
    assert metrics["answer_correct"] == 1  # the gold answer word for word: the offline matcher accepted it
    assert traj.metadata["verdict_error"] is None and traj.metadata["verdict_judge"] == "openai/judge"
    m = traj.metrics
    assert (m["answer_correct"], m["hallucinated"], m["attempted_answer"], m["judge_error"]) == (0, 1, 1, 0)
    assert m["sources_correct"] == 1 and m["ever_read_right_email"] == 1  # its sources, read back
    partial = 0.1 * (m["ever_found_right_email"] + m["ever_read_right_email"] + m["sources_correct"])
    assert traj.reward == pytest.approx(-2.0 + partial)  # the run's penalty, 2
    judged = [r["messages"][1]["content"] for r in requests if r["model"] == "judge"]
    assert judged[-1].endswith(f"AI answer: {q.answer}")


@pytest.mark.parametrize("reward", ["shaped", "judge"])
def test_a_regraded_episode_the_judge_accepts_is_rewarded_in_the_runs_mode(demo_db, q, reward):
    """Catches a re-graded reward computed in another mode than the run's, or without the number of sources (the
    shaped reward's citing bonus is divided by it)."""
    from email_agent.agent.grading import regrade_judge_failures

    scripts = {"agent": {q.question: expert_script(q)}, "judge": {"*": [{"status": 401}]}}

    async def go():
        async with ScriptedServer(scripts) as server:
            config = Episode(reward=reward, judge=llm_judge.LLMJudge("openai/judge", api_base=server.base_url,
                                                                           retries=1))
            client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            traj = await rollout(Policy(client, "agent"), q, demo_db, config)
            server.scripts["judge"] = {"*": [ACCEPT]}
            return (await regrade_judge_failures(art.TrajectoryGroup([traj]), {q.id: q}, config)).trajectories[0]

    traj = asyncio.run(go())
    assert traj.metrics["answer_correct"] == 1 and traj.metadata["verdict_judge"] == "openai/judge"
    assert traj.reward == pytest.approx(1.0 if reward == "judge" else rewards.shaped_reward(
        rewards.Rubric(**{k: v for k, v in traj.metrics.items() if k in rewards.Rubric.__dataclass_fields__}),
        Episode().max_turns, len(q.message_ids)))
