"""RULER group scoring against a scripted judge (litellm -> the scripted OpenAI-compatible server): scores
re-keyed by trajectory id, incomplete replies retried, failures recorded and shown by the train loop."""

import asyncio
import json

import art
import pytest
from openai import AsyncOpenAI

from email_agent.training import step_health
from email_agent.agent import ruler
from email_agent.data import questions as qmod
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from scripted_server import ScriptedServer, call, expert_script
from test_preflight import LOGPROBS

PLAYS = ["expert", "wrong", "idk"]


class ScriptedJudge(ScriptedServer):
    """Answers each judge request with the next reply in `replies` (the last one repeats)."""

    def __init__(self, replies):
        super().__init__({})
        self.replies = replies

    async def _completions(self, request):
        self.scripts = {"*": [self.replies[min(len(self.requests), len(self.replies) - 1)]]}
        return await super()._completions(request)


def scores(*pairs):
    return {"text": json.dumps({"scores": [{"trajectory_id": str(i), "explanation": f"t{i}", "score": s}
                                           for i, s in pairs]})}


@pytest.fixture(scope="module")
def group(demo_db):
    """Three rollouts of one question (expert, wrong answer, I don't know), recorded once."""
    q = qmod.select_questions(demo_db, "train", seed=0)[0]
    scripts = {"expert": {q.question: expert_script(q)},
               "wrong": {q.question: [call("return_final_answer", {"answer": "Tuesday", "sources": []})]},
               "idk": {q.question: [call("return_final_answer", {"answer": "I don't know", "sources": []})]}}

    async def go():
        async with ScriptedServer(scripts) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            trajs = await asyncio.gather(*(rollout(Policy(client, p), q, demo_db, Episode()) for p in PLAYS))
            await client.close()
            return trajs

    trajs = asyncio.run(go())
    for item in (item for t in trajs for item in t.messages_and_choices if not isinstance(item, dict)):
        item.logprobs = LOGPROBS  # as a trainable policy's server sends them
    return trajs


def judge(group_trajs, replies, use_art=False):
    """`group_trajs` (copies of them, or the group itself if it is an art.TrajectoryGroup) scored by RULER against
    a scripted judge: (the group, the judge server)."""
    async def go():
        async with ScriptedJudge(replies) as server:
            fresh = group_trajs if isinstance(group_trajs, art.TrajectoryGroup) else \
                art.TrajectoryGroup([t.model_copy(deep=True) for t in group_trajs])
            params = {"api_base": server.base_url, "api_key": "none"}
            if use_art:
                from art.rewards import ruler_score_group

                return await ruler_score_group(fresh, "openai/judge", extra_litellm_params=params), server
            return await ruler.ruler_group(fresh, "openai/judge", params), server

    return asyncio.run(go())


def test_scores_are_matched_by_id_not_position(group):
    reply = scores((3, 0.1), ("trajectory 1", 0.9), (2, 0.4))  # the judge lists trajectory 3 first
    scored, server = judge(group, [reply])
    assert [t.reward for t in scored.trajectories] == [0.9, 0.4, 0.1]
    assert [t.metrics["ruler_score"] for t in scored.trajectories] == [0.9, 0.4, 0.1]
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [t.reward for t in group]
    assert all(t.metrics["ruler_error"] == 0 for t in scored.trajectories) and len(server.requests) == 1
    assert [t.logs[-1] for t in scored.trajectories] == [f"RULER explanation: t{i}" for i in ("trajectory 1", 2, 3)]
    assert server.requests[0]["response_format"]["type"] == "json_schema"  # RULER's structured reply
    # the judge is shown the agent's tools, so it can tell a valid call from an invented one
    tools = server.requests[0]["messages"][-1]["content"].split("<available_tools>")[1].split("</available_tools>")[0]
    assert [t["function"]["name"] for t in json.loads(tools)] == ["search_inbox", "read_email", "return_final_answer"]
    # why: ART 0.5.18's ruler_score_group pairs by position and gives the expert's score to the I-don't-know
    art_scored, _ = judge(group, [reply], use_art=True)
    assert [t.reward for t in art_scored.trajectories] == [0.1, 0.9, 0.4]


def test_incomplete_reply_is_retried(group):
    scored, server = judge(group, [scores((1, 0.9), (2, 0.4)), scores((2, 0.5), (1, 0.8), (3, 0.0))])
    assert len(server.requests) == 2
    assert [t.reward for t in scored.trajectories] == [0.8, 0.5, 0.0]


@pytest.mark.parametrize("reply, says", [
    ({"text": json.dumps({"scores": []})}, "ValueError: Expected 3 scores, but got 0"),
    (scores((1, 0.9), (1, 0.8), (2, 0.1)),
     "judge scored trajectories ['1', '1', '2'], not each of"),  # 1 twice, 3 never
    ({"text": "I cannot grade these."}, "I cannot grade these."),  # no JSON
    ({"status": 500}, "InternalServerError: litellm.InternalServerError"),
    (scores((1, 0.9), (2, 0.4), ("trajectory 3 or 1", 0.1)), "'trajectory 3 or 1'"),  # an id naming two: neither
])
def test_failed_judge_is_recorded_not_zeroed_silently(group, reply, says):
    """Catches: a failed group trained on (or zeroed without a mark), its own rewards lost, or a mark that does
    not say what the judge did."""
    scored, server = judge(group, [reply])
    assert len(server.requests) == (6 if "status" in reply else 2)  # one retry (of the client's 3 tries on a 5xx)
    trajs = scored.trajectories
    assert all(t.metrics["ruler_error"] == 1 and t.reward == 0.0 for t in trajs)  # equal rewards: GRPO skips it
    assert [t.metrics["independent_reward"] for t in trajs] == [t.reward for t in group]
    assert all(t.metadata["ruler_error"].startswith("RULER judge openai/judge:") for t in trajs)
    assert says in trajs[0].metadata["ruler_error"]
    h = step_health.measure([scored])
    assert (h.ruler_errors, h.trainable_groups) == (1, 0)
    verdict = step_health.diagnose(h, reward_mode="ruler")
    assert not verdict.ok and verdict.headline.startswith("cannot learn: RULER failed on 100%")
    assert "--ruler-model" in verdict.headline
    assert step_health.idle_cause(h).startswith("RULER could not score any group")


def test_a_ruler_judge_that_never_scores_stops_the_loop_before_it_trains(demo_db, demo_db_path, qwen_style_model_dir,
                                                                         tmp_path, monkeypatch):
    """A reply that never parses does not pass by waiting: the run stops at the step, nothing trained (it used to
    train on nothing and go on, step after step)."""
    from email_agent.training import judge_outages
    from test_preflight import run_loop

    train_qs = qmod.select_questions(demo_db, "train", seed=0)
    scripts = {q.question: expert_script(q) for q in train_qs}
    scripts["judge"] = {"*": [{"text": json.dumps({"scores": []})}]}
    with pytest.raises(judge_outages.JudgeDown, match=r"^the judge cannot grade step 1 \(RULER judge openai/judge: "
                                                 r"ValueError: .*\), and waiting will not change that"):
        run_loop(demo_db, demo_db_path, tmp_path, monkeypatch, scripts, qwen_style_model_dir, max_steps=1,
                 reward="ruler", ruler_model="openai/judge", judge_base_url=lambda url: url)
    history = tmp_path / "email-agent/models/h/history.jsonl"
    assert not history.exists() or "data/step_trainer_tokens" not in history.read_text()


def test_a_group_scored_again_after_a_failure_keeps_its_own_rewards(group):
    """Catches: the second try at a group RULER failed on (the train loop tries again) taking the failure's 0s
    as the trajectories' own rewards."""
    failed, _ = judge(group, [{"text": "I cannot grade these."}])
    assert [t.reward for t in failed.trajectories] == [0.0, 0.0, 0.0]
    scored, _ = judge(failed, [scores((1, 0.9), (2, 0.4), (3, 0.1))])
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [t.reward for t in group]
    assert [t.reward for t in scored.trajectories] == [0.9, 0.4, 0.1]
    assert not any("ruler_error" in t.metadata or "judge_transient" in t.metadata for t in scored.trajectories)


def test_a_failing_ruler_judge_prints_no_litellm_banner(group, monkeypatch, capfd):
    """Catches: litellm's "Give Feedback / Get Help" banner printed for each failed RULER call (the failure is
    recorded on the group, and the train loop reports it)."""
    import litellm

    monkeypatch.setattr(litellm, "suppress_debug_info", False)
    scored, server = judge(group, [{"status": 401}])
    out = capfd.readouterr()
    assert scored.trajectories[0].metrics["ruler_error"] == 1 and len(server.requests) == 2
    assert "Give Feedback" not in out.out + out.err and "LiteLLM" not in out.out + out.err
