"""Training health: the preflight verdict and the per-step numbers, on groups recorded from real rollouts
(scripted policies on the demo inbox), the train loop's use of them (with a recording stand-in backend),
and one real run of the untrained CPU model that must be told it cannot learn."""

import asyncio
import json
import re
import subprocess
import sys

import art
import pytest
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

from conftest import ROOT
from email_agent import config
from email_agent.training import loop, step_health
from email_agent.data import questions as qmod
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from art_doubles import on_a_gpu_machine
from scripted_server import ScriptedServer, call, expert_script

import train_email_search_agent as cli

LOGPROBS = ChoiceLogprobs(content=[ChatCompletionTokenLogprob(token="x", logprob=-0.5, bytes=None, top_logprobs=[])])


@pytest.fixture(scope="module")
def qs(demo_db):
    return qmod.select_questions(demo_db, "train", seed=0)[:4]


def record(db, qs, plays, logprobs=True):
    """One group per question; `plays` names the scripted policy of each rollout in a group."""
    scripts = {
        "expert": {q.question: expert_script(q) for q in qs},
        "wrong": {q.question: [call("return_final_answer", {"answer": "Tuesday at noon", "sources": []})] for q in qs},
        "idk": {q.question: [call("return_final_answer", {"answer": "I don't know", "sources": []})] for q in qs},
        "chatty": {q.question: [{"text": "Let me think."}, {"text": "Hmm."}] for q in qs},
    }

    async def go():
        async with ScriptedServer(scripts) as server:
            client = AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
            config = Episode(max_turns=2 if "chatty" in plays else 4)
            groups = [art.TrajectoryGroup(await asyncio.gather(
                *(rollout(Policy(client, name), q, db, config) for name in plays))) for q in qs]
            await client.close()
            return groups

    groups = asyncio.run(go())
    for traj in (t for g in groups for t in g.trajectories):  # as the CPU backend and vLLM serve them
        for item in traj.messages_and_choices:
            if logprobs and not isinstance(item, dict):
                item.logprobs = LOGPROBS
    return groups


def test_untrained_policy_cannot_learn(demo_db, qs):
    h = step_health.measure(record(demo_db, qs, ["chatty", "chatty"]), gather_s=12.0)
    assert (h.groups, h.rollouts, h.trainable_groups, h.valid_call_rate) == (4, 8, 0, 0.0)
    assert h.no_answer == 1.0 and h.mean_reward == pytest.approx(-0.5 - 0.2) and h.turns_without_logprobs == 0.0
    verdict = step_health.diagnose(h, reward_mode="offline")
    assert not verdict.ok and verdict.headline.startswith("cannot learn: no valid tool calls")
    assert "--sft-from expert" in verdict.headline
    # a warm start that is configured but has not run yet is the fix to name
    pending = step_health.diagnose(h, reward_mode="offline", sft_from="demo-expert", warm_start_pending=True)
    assert "--sft-only" in pending.headline
    assert "no rollout made a valid tool call" in step_health.idle_cause(h)


def test_warm_started_policy_passes(demo_db, qs):
    groups = record(demo_db, qs, ["expert", "wrong", "idk", "expert"])
    h = step_health.measure(groups, gather_s=30.0)
    assert (h.trainable_groups, h.ruler_errors, h.judge_errors) == (4, 0, 0)
    assert h.answered == 0.75 and h.correct == 0.5 and h.hallucinated == 0.25 and h.i_dont_know == 0.25
    assert h.valid_call_rate == 1.0 and h.reward_spread > 0.5
    verdict = step_health.diagnose(h, reward_mode="offline")
    assert verdict.ok and verdict.warnings == [] and verdict.headline.startswith("can learn: 4 of 4 groups")
    lines = "\n".join(step_health.report(h, verdict, groups_per_step=4, rollouts_per_group=4, concurrency=8))
    for text in ("4/4 (100%) have reward variance", "valid tool calls     100%", "50% correct, 25% hallucinated",
                 "25% I don't know", "0% of 32 assistant turns", "about 30s of rollouts per step"):
        assert text in lines


def test_few_trainable_groups_and_missing_logprobs(demo_db, qs):
    same = record(demo_db, qs, ["expert", "expert"])  # every rollout alike: nothing to compare
    mixed = record(demo_db, qs[:1], ["expert", "wrong"])
    h = step_health.measure(same + mixed)
    assert (h.trainable_groups, h.groups) == (1, 5)
    verdict = step_health.diagnose(h, reward_mode="offline")
    assert not verdict.ok and verdict.headline.startswith("learns little: only 1 of 5 groups")
    assert "--rollouts-per-group" in verdict.headline
    judged = step_health.diagnose(h, reward_mode="judge")
    assert "--reward shaped" in judged.headline

    bare = step_health.measure(record(demo_db, qs, ["expert", "wrong"], logprobs=False))
    assert bare.turns_without_logprobs == 1.0
    verdict = step_health.diagnose(bare, reward_mode="offline")
    assert not verdict.ok and "no assistant turn has logprobs" in verdict.headline
    assert "no logprobs" in step_health.idle_cause(bare)


def test_step_metrics(demo_db, qs):
    groups = record(demo_db, qs[:2], ["expert", "wrong"]) + record(demo_db, qs[2:], ["idk", "idk"])
    h = step_health.measure(groups)
    sampled = sum(len(c.logprobs.content) for g in groups for t in g.trajectories for c in t.messages_and_choices
                  if not isinstance(c, dict))
    # ART's LocalBackend and the CPU backend both report the sampled tokens the update trained on, under ART's keys
    trained_keys = {"loss/train": 0.1, "data/step_trainer_tokens": 3.0, "data/step_num_groups_trainable": 2.0}
    m = step_health.step_metrics(h, groups, trained_keys, max_seq_length=8192)
    assert m == {"trainable_group_share": 0.5, "trained_token_share": pytest.approx(3 / sampled),
                 "ruler_errors": 0.0, "judge_errors": 0.0, "close_groups": 0.0, "too_long": 0.0}
    skipped = {"data/step_trainer_tokens": 0.0, "data/step_num_groups_trainable": 0.0}  # ART's skipped step
    assert step_health.step_metrics(h, groups, skipped, 8192)["trained_token_share"] == 0.0
    # a backend that reports neither (a remote one): estimated from the sampled tokens of groups with variance
    expected = sum(len(c.logprobs.content) for g in groups[:2] for t in g.trajectories for c in t.messages_and_choices
                   if not isinstance(c, dict)) / sampled
    assert step_health.step_metrics(h, groups, {}, 8192)["trained_token_share"] == pytest.approx(expected)
    # ART's gather overwrites completion_tokens with a per-turn mean: the token column does not read it
    for t in (t for g in groups for t in g.trajectories):
        t.metrics["completion_tokens"] = 0.5
    trained = step_health.step_line(5, groups, trained_keys, m, 42.0)
    assert re.match(r"step +5 +reward [+-]\d\.\d{3} +accuracy 25% .* loss \+0\.1000 +trained on 50% of groups", trained)
    assert f"tokens {sampled / 8:.0f}  loss" in trained
    idle = step_health.step_line(6, groups, skipped, step_health.step_metrics(h, groups, skipped, 8192), 42.0)
    assert re.search(r"loss -  trained on \d+% of groups, 0% of tokens  LEARNED NOTHING", idle) and "nan" not in idle


def test_groups_spread_less_than_min_reward_std_train_at_their_mean(demo_db, qs):
    """The loop's choice of what trains: a group whose rewards spread less than --min-reward-std gets its mean for
    every rollout (zero advantages), any other is left as it was."""
    close, apart, same = (record(demo_db, qs[:1], ["expert", "wrong"]) + record(demo_db, qs[1:2], ["expert", "wrong"])
                          + record(demo_db, qs[2:3], ["idk", "idk"]))
    close.trajectories[0].reward, close.trajectories[1].reward = 0.500, 0.501
    assert loop.reward_spread(close) == pytest.approx(0.0005) and loop.reward_spread(apart) > 0.5
    assert loop.reward_spread(art.TrajectoryGroup([])) == float("inf")  # nothing to flatten
    flattened = loop.at_mean_reward(close)
    assert [t.reward for t in flattened.trajectories] == [pytest.approx(0.5005)] * 2
    assert [t.reward for t in close.trajectories] == [0.500, 0.501]  # a copy: the logged groups keep their rewards
    assert flattened.trajectories[0].messages_and_choices == close.trajectories[0].messages_and_choices
    assert loop.at_mean_reward(same).trajectories == same.trajectories  # equal rewards: their mean changes nothing


def test_trajectories_too_long_to_train_are_counted(demo_db, qs):
    """ART's LocalBackend drops trajectories longer than max_seq_length from the update with a warning only."""
    groups = record(demo_db, qs[:2], ["expert", "wrong"]) + record(demo_db, qs[2:3], ["idk", "idk"])
    for t in (t for g in groups for t in g.trajectories):
        assert t.metrics["sequence_tokens"] == 110  # the last request's prompt + reply, as the server counted
    for t in groups[0].trajectories + groups[2].trajectories:  # the last group has no variance: never trained
        t.metrics["sequence_tokens"] = 9000
    m = step_health.step_metrics(step_health.measure(groups), groups, {"data/step_trainer_tokens": 1.0}, 8192)
    assert m["too_long"] == 2.0
    line = step_health.step_line(1, groups, {"loss/train": 0.1}, m, 1.0)
    assert "too long for --max-seq-length (not trained) 2" in line


def test_judge_failures_fail_the_preflight(demo_db, qs):
    groups = record(demo_db, qs, ["expert", "wrong"])
    for t in (t for g in groups for t in g.trajectories):
        t.metrics["judge_error"] = 1
        t.metadata["verdict_error"] = "judge openai/x failed after 3 tries (APIConnectionError: refused)"
    h = step_health.measure(groups)
    assert h.judge_errors == 8 and h.judged == 8
    verdict = step_health.diagnose(h, reward_mode="shaped")
    assert not verdict.ok and verdict.headline.startswith("cannot learn: the judge failed on 100%")
    assert "APIConnectionError" in verdict.headline and "--judge-model" in verdict.headline


def test_no_rollouts_at_all():
    h = step_health.measure([])
    verdict = step_health.diagnose(h, reward_mode="offline")
    assert not verdict.ok and verdict.headline.startswith("cannot learn: every rollout failed")
    assert step_health.idle_cause(h).startswith("every rollout failed")


# ---- the train loop: verdict on the first step, shares on every step, preflight trains nothing -----------

def run_loop(demo_db, demo_db_path, tmp_path, monkeypatch, scripts, base_model, **overrides):
    """The train loop on ART's LocalBackend (its GPU service stubbed: art_doubles) with a scripted policy."""
    made = {}
    with on_a_gpu_machine(monkeypatch, scripts) as (backends_made, server, _):
        overrides = {k: v(server.base_url) if callable(v) else v for k, v in overrides.items()}  # e.g. a judge URL
        cfg = cli.TrainConfig(name="h", art_dir=str(tmp_path), db=str(demo_db_path), val_size=0, train_limit=4,
                              groups_per_step=2, rollouts_per_group=2, eval_every=100, base_model=str(base_model),
                              **overrides)
        try:
            asyncio.run(loop.train(cfg))
        finally:
            made["backend"] = backends_made[-1] if backends_made else None
            made["requests"] = list(server.requests)
    return made


def test_loop_marks_steps_that_learned_nothing(demo_db, demo_db_path, qwen_style_model_dir, tmp_path, monkeypatch, qs,
                                              capsys):
    # the scripted server sends no logprobs: every step trains on nothing, and the loop says so
    train_qs = qmod.select_questions(demo_db, "train", seed=0)
    made = run_loop(demo_db, demo_db_path, tmp_path, monkeypatch, {q.question: expert_script(q) for q in train_qs},
                    qwen_style_model_dir, max_steps=3, train_anyway=True)  # told to go on past the first verdict
    out, err = capsys.readouterr()
    assert len(made["backend"].train_calls) == 3
    assert "trainable groups     0/2" in out and "warning: cannot learn: no assistant turn has logprobs" in out
    assert out.count("LEARNED NOTHING") == 3
    assert out.count("preflight: 2 groups x 2 rollouts") == 1  # the verdict comes with the first step only
    assert "3 steps in a row trained on nothing: the policy's replies carry no logprobs" in err
    history = [json.loads(line) for line in (tmp_path / "email-agent/models/h/history.jsonl").read_text().splitlines()]
    rows = [row for row in history if "data/step_trainer_tokens" in row]  # ART's own record of each step
    assert [row["train/trainable_group_share"] for row in rows] == [0.0, 0.0, 0.0]
    assert [row["train/trained_token_share"] for row in rows] == [0.0, 0.0, 0.0]


def test_a_first_step_that_cannot_learn_stops_the_run_before_training_and_keeps_it(demo_db, demo_db_path,
                                                                                  qwen_style_model_dir, tmp_path,
                                                                                  monkeypatch, capsys):
    from transformers import AutoTokenizer

    # served as vLLM serves (logprobs and all), a policy that never calls a tool: no warm start to fall back on
    tokenizer = AutoTokenizer.from_pretrained(qwen_style_model_dir)
    chatty = {q.question: [{"text": "Let me think."}, {"text": "Hmm."}]
              for q in qmod.select_questions(demo_db, "train", seed=0)}
    argv = ["train", "--backend", "local", "--name", "h", "--art-dir", str(tmp_path), "--db", str(demo_db_path),
            "--val-size", "0", "--train-limit", "4", "--groups-per-step", "2", "--rollouts-per-group", "2",
            "--max-turns", "2", "--max-steps", "1", "--eval-every", "100", "--base-model", str(qwen_style_model_dir)]
    with on_a_gpu_machine(monkeypatch, chatty, tokenizer) as (made, _, _):
        code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err and "preflight: 2 groups x 2 rollouts" in out
    error = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and error[0].startswith("Error: cannot learn: no valid tool calls; warm-start it first: "
                                                   "--sft-from expert") and "--train-anyway" in error[0]
    assert made[-1].train_calls == [] and made[-1].closed  # stopped before the update, the backend shut down
    run = tmp_path / "email-agent/models/h"
    assert (run / "run_config.json").is_file() and (run / "checkpoints" / "0000").is_dir()
    assert not (run / "history.jsonl").exists() or '"train/reward"' not in (run / "history.jsonl").read_text()
    # the run was kept as it was: the same command told to go on resumes it and trains the same first step
    with on_a_gpu_machine(monkeypatch, chatty, tokenizer) as (made, _, _):
        assert cli.main([*argv, "--train-anyway"]) == 0
    out, err = capsys.readouterr()
    assert "resuming run 'h'" in err and "warning: cannot learn: no valid tool calls" in out
    assert len(made[-1].train_calls) == 1 and (run / "checkpoints" / "0001").is_dir()


def test_preflight_trains_and_logs_nothing(demo_db, demo_db_path, qwen_style_model_dir, tmp_path, monkeypatch, capsys):
    train_qs = qmod.select_questions(demo_db, "train", seed=0)
    with pytest.raises(cli.UserError, match="^cannot learn: no assistant turn has logprobs"):
        run_loop(demo_db, demo_db_path, tmp_path, monkeypatch, {q.question: expert_script(q) for q in train_qs},
                 qwen_style_model_dir, preflight=True, sft_from="demo-expert")
    assert "preflight: 2 groups x 2 rollouts" in capsys.readouterr().out
    run = tmp_path / "email-agent/models/h"
    assert not run.exists()  # a preflight of a new run leaves no run behind (registering wrote its model.json)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)  # a run that exists
    with pytest.raises(cli.UserError, match="^cannot learn"):
        run_loop(demo_db, demo_db_path, tmp_path, monkeypatch, {q.question: expert_script(q) for q in train_qs},
                 qwen_style_model_dir, preflight=True, sft_from="demo-expert")
    assert not (run / "history.jsonl").exists() and not (run / "state.json").exists()  # nothing marked done
    assert not (run / "run_config.json").exists() and (run / "checkpoints").is_dir()  # nor saved, nor deleted
    with pytest.raises(cli.UserError, match="--preflight with --fresh would delete"):
        config.check(cli.TrainConfig(name="h", art_dir=str(tmp_path), db=str(demo_db_path), val_size=0,
                                     preflight=True, fresh=True))


@pytest.mark.slow
def test_untrained_cpu_model_gets_cannot_learn(demo_db_path, tmp_path):
    """The real thing: SmolLM2 without a warm start makes no valid tool call; the preflight says so and fails."""
    art_dir = tmp_path / "art"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train_email_search_agent.py"), "train", "--demo", "--db", str(demo_db_path),
         "--art-dir", str(art_dir), "--name", "raw", "--sft-from", "", "--preflight", "--groups-per-step", "2",
         "--rollouts-per-group", "2", "--max-turns", "2", "--max-tokens", "32"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Error: cannot learn: no valid tool calls; warm-start it first: --sft-from expert" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "valid tool calls     0%" in proc.stdout and "trainable groups" in proc.stdout
    assert not (art_dir / "email-agent" / "models" / "raw").exists()  # nothing trained, no run left behind


def test_a_run_whose_groups_mostly_lack_reward_variance_is_told_to_sample_more_widely():
    run_s = [0.67, 0.33, 0.67, 0.0, 0.17]  # bench/RESULTS.md run S, temperature 0.7: 37% over five steps
    warning = step_health.low_variance_warning(run_s, 0.7)
    assert warning.startswith("only 37% of the groups of the last 5 steps had reward variance")
    assert "--temperature" in warning
    assert "--temperature" not in step_health.low_variance_warning(run_s, 1.0)  # already samples as trained
    assert step_health.low_variance_warning(run_s[:4], 0.7) is None  # too few steps to tell
    run_t1 = [1.0, 0.83, 0.5, 0.67, 0.67]  # run T1, temperature 1.0: 73%
    assert step_health.low_variance_warning(run_s + run_t1, 0.7) is None  # only the last five steps count


def test_the_cpu_step_note_prices_a_gpu_sized_step_against_the_cpu_preset():
    note = step_health.cpu_step_note(20.0, rollouts=48, at_once=8, preset_rollouts=24)
    assert "a step of 48 rollouts (8 at a time) takes about 2 min before its update" in note
    assert note.endswith("the CPU preset's 24 take about 1.0 min")
