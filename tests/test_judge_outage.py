"""A judge that fails, and a disk that fills, must not eat the run: the train loop on ART's LocalBackend (its
GPU service stubbed, art_doubles) with a scripted policy and a scripted judge behind --judge-base-url."""

import errno
import json
import time

import pytest

from art_doubles import GPUService, half_solve, on_a_gpu_machine
from email_agent.training import judge_outages
from email_agent.agent import llm_judge, rewards
from email_agent.data import questions as qmod
from email_agent.backends.cpu import checkpoints

import train_email_search_agent as cli


class Judge:
    """The judge's replies over time: for `down_for` seconds from its first request it fails with `status`,
    then it answers `reply(body)`."""

    def __init__(self, down_for=0.0, status=500, reply=None):
        self.down_for, self.status, self.first = down_for, status, None
        self.reply = reply or (lambda body: ruler_scores(body, 0.9, 0.1))

    def __call__(self, body):
        self.first = self.first or time.monotonic()
        if time.monotonic() - self.first < self.down_for:
            return {"status": self.status}
        return self.reply(body)


def ruler_scores(body, *scores):
    return {"text": json.dumps({"scores": [{"trajectory_id": str(i), "explanation": "e", "score": s}
                                           for i, s in enumerate(scores, 1)]})}


@pytest.fixture
def quick_waits(monkeypatch):
    monkeypatch.setattr(judge_outages, "FIRST_WAIT_S", 0.05)
    monkeypatch.setattr(judge_outages, "MAX_WAIT_S", 0.2)


def run(monkeypatch, demo_db, demo_db_path, tmp_path, model_dir, judge, tokenizer, **overrides):
    qs = qmod.select_questions(demo_db, "train", seed=0)
    scripts = {**{q.question: half_solve(q) for q in qs}, "judge": judge}
    with on_a_gpu_machine(monkeypatch, scripts, tokenizer) as (made, server, _):
        argv = ["train", "--backend", "local", "--name", "j", "--art-dir", str(tmp_path), "--db", str(demo_db_path),
                "--val-size", "0", "--train-limit", "4", "--groups-per-step", "2", "--rollouts-per-group", "2",
                "--max-steps", "1", "--eval-every", "100", "--base-model", str(model_dir), "--reward", "ruler",
                "--ruler-model", "openai/judge", "--judge-base-url", server.base_url, "--keep-checkpoints", "all"]
        argv += [str(x) for kv in overrides.items() for x in kv]
        started = time.monotonic()
        code = cli.main(argv)
        return code, made, time.monotonic() - started, list(server.requests)


@pytest.fixture
def tokenizer(qwen_style_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_style_model_dir)


def checkpoints_of(tmp_path):
    return sorted(p.name for p in (tmp_path / "email-agent/models/j/checkpoints").iterdir())


def policy_questions(requests):
    """The questions the policy was asked, in order (first turns only)."""
    return [r["messages"][1]["content"] for r in requests if r.get("tools") and len(r["messages"]) == 2]


def test_a_judge_down_for_a_while_is_waited_for_and_the_step_trains(monkeypatch, demo_db, demo_db_path, tmp_path,
                                                                    qwen_style_model_dir, tokenizer, quick_waits,
                                                                    capsys):
    judge = Judge(down_for=5.0)  # the step's first judging fails, and a few tries after it
    code, made, _, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, judge, tokenizer)
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "judge: 2 of 2 groups of step 1 unjudged (RULER judge openai/judge:" in err and "trying again" in err
    assert "LEARNED NOTHING" not in out and "RULER errors" not in out
    (backend,) = made
    [(groups, _)] = backend.train_calls
    assert len(groups) == 2 and all({t.reward for t in g.trajectories} == {0.9, 0.1} for g in groups)
    assert checkpoints_of(tmp_path) == ["0000", "0001"]


def test_a_judge_that_stays_down_stops_the_run_and_the_same_step_trains_when_it_is_back(
        monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, tokenizer, quick_waits, capsys):
    judge = Judge(down_for=10 ** 6)
    code, made, _, requests = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, judge,
                                  tokenizer, **{"--judge-patience": 0.5})
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "Error: the judge failed on 2 of 2 groups of step 1 for " in err
    assert "run the same command again to resume at step 1" in err
    assert made[0].train_calls == [] and checkpoints_of(tmp_path) == ["0000"]  # nothing trained, nothing consumed
    asked = policy_questions(requests)

    judge.down_for = 0  # the judge is back
    code, made, _, requests = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, judge,
                                  tokenizer, **{"--judge-patience": 0.5})
    assert code == 0, capsys.readouterr().err[-2000:]
    assert sorted(set(policy_questions(requests))) == sorted(set(asked))  # step 1's questions, not step 2's
    assert len(made[0].train_calls) == 1 and checkpoints_of(tmp_path) == ["0000", "0001"]


@pytest.mark.parametrize("status", [401, 404])
def test_a_judge_that_refuses_stops_at_once(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir,
                                            tokenizer, status, capsys):
    code, made, seconds, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir,
                                 Judge(down_for=10 ** 6, status=status), tokenizer)
    err = capsys.readouterr().err
    assert code == 1 and seconds < 60  # --judge-patience is 600 s: it did not wait
    assert "Error: the judge cannot grade step 1 (RULER judge openai/judge:" in err
    assert "waiting will not change that" in err and "Traceback" not in err
    assert made[0].train_calls == [] and checkpoints_of(tmp_path) == ["0000"]


def test_near_identical_judge_scores_are_not_trained_on(monkeypatch, demo_db, demo_db_path, tmp_path,
                                                        qwen_style_model_dir, tokenizer, capsys):
    judge = Judge(reply=lambda body: ruler_scores(body, 0.500, 0.501))
    code, made, _, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, judge, tokenizer)
    out = capsys.readouterr().out
    assert code == 0
    [(groups, _)] = made[0].train_calls
    # one reward per group, so ART trains none of it: its std-scaled advantages would have made full-size updates
    # of a 0.001 difference
    assert len(groups) == 2 and all(len({t.reward for t in g.trajectories}) == 1 for g in groups)
    history = (tmp_path / "email-agent/models/j/history.jsonl").read_text()
    assert '"data/step_num_groups_trainable": 0.0' in history and '"data/step_trainer_tokens": 0.0' in history
    assert "trainable groups     0/2 (0%) have reward variance (2 more differ by less than --min-reward-std 0.01)" \
        in out
    assert "learns little: the judge's scores are too close to learn from" in out
    assert "groups too close (< --min-reward-std) 2" in out and "LEARNED NOTHING" in out


def test_each_reward_mode_says_what_it_uses(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir,
                                            tokenizer, capsys):
    code, _, _, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, Judge(), tokenizer)
    err = capsys.readouterr().err
    assert code == 0
    assert "reward       RULER openai/judge at http://127.0.0.1:" in err and "ranks each group" in err
    assert "no judge configured" not in err
    judge = llm_judge.LLMJudge("openai/grader", api_base="http://localhost:6688")
    assert rewards.describe("offline", None, hallucination_penalty=1.5) == (
        "offline (right > \"I don't know\" > wrong, a wrong answer costing 1.5, with partial credit); "
        "answers graded offline by the offline matcher v2 (core and context); no judge")
    assert rewards.describe("shaped", judge).endswith("answers graded by the judge openai/grader at "
                                                      "http://localhost:6688")
    assert rewards.describe("judge", judge) == ("judge openai/grader at http://localhost:6688: 1 for a right "
                                                "answer, 0 otherwise")
    assert rewards.describe("ruler", judge, "openai/o4-mini").startswith("RULER openai/o4-mini ranks each group; "
                                                                        "answers graded by the judge openai/grader")


def test_an_answer_judge_down_for_a_while_regrades_the_step(monkeypatch, demo_db, demo_db_path, tmp_path,
                                                            qwen_style_model_dir, tokenizer, quick_waits, capsys):
    """--reward shaped: each answer the judge failed on is graded again once it is back (not offline)."""
    accept = Judge(reply=lambda body: {"text": json.dumps({"reasoning": "same facts", "accept": True})})
    outage = Judge(down_for=5.0, status=503, reply=accept)
    probed = []

    def judge(body):  # the probe at start passes; then the judge is down for 5 s (every answer's 3 tries fail)
        if not probed:
            probed.append(body)
            return accept(body)
        return outage(body)

    code, made, _, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, judge, tokenizer,
                           **{"--reward": "shaped", "--judge-model": "openai/judge"})
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "of step 1 unjudged (judge openai/judge failed after 3 tries" in err
    [(groups, _)] = made[0].train_calls
    trajectories = [t for g in groups for t in g.trajectories]
    assert not any(t.metadata.get("verdict_error") for t in trajectories)
    assert all(t.metadata["verdict_judge"] == "openai/judge" for t in trajectories if t.metrics["attempted_answer"])


def test_a_full_disk_is_a_sentence_and_the_run_resumes_once_there_is_room(monkeypatch, demo_db, demo_db_path,
                                                                          tmp_path, qwen_style_model_dir, tokenizer,
                                                                          capsys):
    real_train = GPUService.train

    async def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", f"{self.output_dir}/checkpoints/0001")
        yield  # an async generator, as ART's service is

    monkeypatch.setattr(GPUService, "train", full_disk)
    code, _, _, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, Judge(), tokenizer)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "could not write " in err and "checkpoints/0001: no space left on the device (" in err
    assert "run the same command again: the run resumes from its last complete checkpoint, step 0." in err
    monkeypatch.setattr(GPUService, "train", real_train)  # space freed
    code, _, _, _ = run(monkeypatch, demo_db, demo_db_path, tmp_path, qwen_style_model_dir, Judge(), tokenizer)
    assert code == 0 and checkpoints_of(tmp_path) == ["0000", "0001"]


def test_a_checkpoint_that_cannot_be_written_leaves_no_half_folder(tmp_path, monkeypatch):
    """The CPU backend's writer: the temporary folder goes, the checkpoint before stays the resume point."""
    import random

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    peft = get_peft_model(tiny, LoraConfig(r=2, target_modules=["q_proj"]))
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad])

    def save(step):
        return checkpoints.save_checkpoint(
            str(tmp_path), step, peft, optimizer, seed=0, train_rng=torch.get_rng_state(),
            sampling_rng=random.Random(0), mode="rl")

    save(1)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", no_space)
    with pytest.raises(OSError):
        save(2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0001"]


def test_the_preflight_warns_when_the_run_folder_is_nearly_full(tmp_path, monkeypatch):
    from email_agent import runs

    run = tmp_path / "run"
    (run / "checkpoints" / "0000").mkdir(parents=True)
    (run / "checkpoints" / "0000" / "adapter_model.safetensors").write_bytes(b"x" * 2 ** 20)
    monkeypatch.setattr(runs.shutil, "disk_usage", lambda path: type("U", (), {"free": 2 * 2 ** 20})())
    warning = runs.free_space_warning(run)
    assert warning.startswith("only 2 MB free in") and "each checkpoint takes about 1.0 MB: room for 2 more" in warning
    monkeypatch.setattr(runs.shutil, "disk_usage", lambda path: type("U", (), {"free": 2 ** 30})())
    assert runs.free_space_warning(run) is None


def test_a_cpu_run_without_flags_takes_the_cpu_preset(monkeypatch, capsys):
    from email_agent import backends

    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    cfg = cli.config_from_args(cli.make_parser().parse_args(["train"]))
    assert (cfg.groups_per_step, cfg.rollouts_per_group, cfg.max_turns, cfg.max_tokens, cfg.concurrency) == (
        6, 4, 4, 64, 24)
    # the warm start's rate too: the GPU's 1e-4 moves a small CPU model's LoRA too little to teach a tool call
    assert (cfg.sft_learning_rate, cfg.sft_schedule, cfg.sft_batch_size) == (1e-3, "constant", 4)
    assert cli.config_from_args(cli.make_parser().parse_args(
        ["train", "--sft-learning-rate", "5e-4"])).sft_learning_rate == 5e-4
    assert cli.TrainConfig().groups_per_step == 12  # the GPU-scale defaults stay the dataclass's
    explicit = cli.config_from_args(cli.make_parser().parse_args(["train", "--groups-per-step", "12"]))
    assert explicit.groups_per_step == 12 and explicit.rollouts_per_group == 4
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    assert cli.config_from_args(cli.make_parser().parse_args(["train"])) == cli.TrainConfig()


def test_judge_settings_out_of_range_are_errors(demo_db_path, tmp_path, capsys):
    for flag in ("--judge-patience", "--min-reward-std"):
        assert cli.main(["train", "--db", str(demo_db_path), "--art-dir", str(tmp_path), flag, "-1"]) == 1
        assert f"{flag} must be at least 0" in capsys.readouterr().err
