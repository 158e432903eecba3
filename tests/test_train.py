"""The training command: the CPU end-to-end run (warm start, GRPO, resume, evaluation), clean shutdown,
and the wiring of the GPU/remote backends (ART's GPU-bound calls replaced by a recording fake)."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import MAKE_DRY_RUN, ROOT
from email_agent import backends, config, runs
from email_agent.agent.episode import Episode
from email_agent.agent import demonstrations
from email_agent.training import loop, warm_start
from email_agent.backends.vllm_server import URL_ENV
from art_doubles import GPUService, half_solve, on_a_gpu_machine
from scripted_server import call, expert_script
from test_dashboard import curves_in_history, curves_in_tensorboard

import test_email_search_agent as evaluate_cli
import train_email_search_agent as cli

# A plumbing run, as small as each stage allows: 2 warm-start trajectories cannot teach valid tool calls, so the
# "cannot learn" stop is overridden.
TINY = ["--train-anyway", "--sft-from", "demo-expert", "--sft-limit", "2", "--sft-epochs", "1", "--sft-batch-size", "2",
        "--groups-per-step", "1", "--rollouts-per-group", "2", "--max-turns", "3", "--max-tokens", "40",
        "--val-size", "1", "--eval-every", "1", "--keep-checkpoints", "all", "--max-body-chars", "300"]


def train_cmd(db, art_dir, *extra):
    return [sys.executable, str(ROOT / "train_email_search_agent.py"), "train", "--demo", "--db", str(db),
            "--art-dir", str(art_dir), "--name", "t", *TINY, *map(str, extra)]


@pytest.mark.slow
def test_cpu_end_to_end_train_resume_evaluate(demo_db_path, tmp_path):
    art_dir = tmp_path / "art"
    first = subprocess.run(train_cmd(demo_db_path, art_dir, "--max-steps", 1), capture_output=True, text=True,
                           timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    run = art_dir / "email-agent" / "models" / "t"
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["0000", "0001", "0002"]  # untrained LoRA, after the warm start, after one GRPO step
    for name in ckpts:
        assert (run / "checkpoints" / name / "adapter_model.safetensors").exists()
        assert (run / "checkpoints" / name / "adapter_config.json").exists()
    before = load_file(run / "checkpoints" / "0000" / "adapter_model.safetensors")
    after = load_file(run / "checkpoints" / "0001" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not before[k].equal(after[k]) for k in before)  # the warm start changed the LoRA
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert any(k.startswith("train/") for row in history for k in row)
    assert any("val/reward" in row for row in history) and any("val/answer_correct" in row for row in history)
    config = json.loads((run / "run_config.json").read_text())
    assert config["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["backend"] == "cpu"
    assert "trainable groups" in first.stdout and re.search(r"^step\s+2\b.*trained on \d+% of groups",
                                                            first.stdout, re.M)  # the first step's verdict
    # the local dashboard holds every metric of every step in history.jsonl, validation beside training
    curves = curves_in_tensorboard(run)
    assert curves == curves_in_history(run)
    assert [step for step, _ in curves[("train", "reward")]] == [2] and ("val", "answer_correct") in curves
    assert {step for step, _ in curves[("val", "reward")]} == {1, 2}  # after the warm start, at the end

    # a preflight of the warm-started run trains, logs and checkpoints nothing: the resume below is unchanged
    history_before = (run / "history.jsonl").read_text()
    check = subprocess.run(train_cmd(demo_db_path, art_dir, "--max-steps", 2, "--preflight"), capture_output=True,
                           text=True, timeout=900)
    assert "Traceback" not in check.stderr, check.stderr[-3000:]
    assert "trainable groups" in check.stdout
    # the exit code is the verdict's: 0 with "can learn", 1 with the reason it cannot
    learns = re.search(r"^preflight: can learn: \d+ of \d+ groups", check.stdout, re.M)
    refused = re.search(r"^Error: (cannot learn|learns little): ", check.stderr, re.M)
    assert (check.returncode, bool(learns), bool(refused)) in ((0, True, False), (1, False, True)), check.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ckpts
    assert (run / "history.jsonl").read_text() == history_before

    second = subprocess.run(train_cmd(demo_db_path, art_dir, "--max-steps", 2), capture_output=True, text=True,
                            timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming run 't'" in second.stderr
    assert "warm start: " not in second.stderr  # done once, remembered in the run's state
    assert "warm start   demo-expert, 1 epoch(s) at learning rate 0.001 (done earlier in this run)" in second.stderr
    assert re.search(r"^step\s+3\b", second.stdout, re.M)  # continued at step 3
    curves = curves_in_tensorboard(run)  # the resumed run's curve goes on, no step shown twice
    assert curves == curves_in_history(run) and [step for step, _ in curves[("train", "reward")]] == [2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "0003"

    evaluation = subprocess.run(
        [sys.executable, str(ROOT / "test_email_search_agent.py"), "--db", str(demo_db_path), "--art-dir", str(art_dir),
         "--model", "t", "--limit", "2", "--max-turns", "3", "--max-tokens", "40", "--output", str(tmp_path / "eval")],
        capture_output=True, text=True, timeout=600)
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())["models"]
    assert list(summary) == ["t@3"] and summary["t@3"]["n"] == 2
    assert "Learning curve" in (tmp_path / "eval" / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sig, own_vllm", [(signal.SIGKILL, True), (signal.SIGINT, False), (signal.SIGTERM, False)])
def test_interrupt_shuts_down_cleanly(demo_db_path, tmp_path, sig, own_vllm):
    """Ctrl-C, SIGTERM and kill -9 of `train`: no process of it is left, the vLLM it started included (vLLM runs in
    a process group of its own, so it is found as the command's descendants before the signal)."""
    env = {k: v for k, v in os.environ.items() if not (own_vllm and k == URL_ENV)}
    proc = subprocess.Popen(train_cmd(demo_db_path, tmp_path / "art", "--max-steps", 5), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    port = None
    deadline = time.time() + 600
    while time.time() < deadline and port is None:
        line = proc.stderr.readline()
        match = re.search(r"serving \S+ at http://127\.0\.0\.1:(\d+)", line)
        port = int(match.group(1)) if match else None
    assert port, "the backend never started serving"
    time.sleep(2)  # mid warm start or rollout
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert len(descendants) >= (3 if own_vllm else 0)  # ART's wrapper, vLLM's API server, engine core, worker...
    os.kill(proc.pid, sig)
    proc.wait(timeout=120)
    rest = proc.stderr.read()
    if sig != signal.SIGKILL:
        assert proc.returncode == 130, rest[-2000:]
        assert "re-run the same command to resume" in rest and "Traceback" not in rest
    _, alive = psutil.wait_procs(descendants, timeout=30)  # the resource tracker exits a moment after its parent
    assert alive == []  # no server or worker process left behind
    if own_vllm:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)


@pytest.mark.slow
def test_interrupt_mid_step_cancels_the_rollouts_in_flight(demo_db_path, tmp_path):
    """ART's gather counts a cancelled rollout as a failed one and waits for the others: one Ctrl-C must still
    end the step now, not after every rollout of it has played out (minutes with these settings)."""
    proc = subprocess.Popen(train_cmd(demo_db_path, tmp_path / "art", "--sft-from", "",
                                      "--groups-per-step", 4,
                                      "--rollouts-per-group", 4, "--max-turns", 6, "--max-tokens", 512, "--val-size", 1,
                                      "--eval-every", 100), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:  # validation comes before the first step's rollouts
            if line.startswith("val "):
                break
        time.sleep(3)  # the step's rollouts are decoding
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rest = proc.stderr.read()
    assert proc.returncode == 130, rest[-2000:]
    assert "re-run the same command to resume" in rest and "Traceback" not in rest
    assert "request failed" not in rest and "Task was destroyed" not in rest


def test_refuses_changed_base_model_and_fresh_starts_over(tmp_path):
    cfg = cli.TrainConfig(name="x", art_dir=str(tmp_path), base_model="a")
    runs.start(cli.run_dir(cfg), runs.saved_config(cfg, "cpu"))
    (cli.run_dir(cfg) / "checkpoints").mkdir()
    changed = cli.TrainConfig(name="x", art_dir=str(tmp_path), base_model="b")
    with pytest.raises(cli.UserError, match="pass --base-model a to resume it [(]--fresh would delete the run"):
        runs.start(cli.run_dir(cfg), runs.saved_config(changed, "cpu"))
    runs.start(cli.run_dir(cfg), runs.saved_config(changed, "cpu"), fresh=True)
    # what picks the questions and the episode limits stay; rates and steps may change
    for other in (dict(seed=5), dict(val_size=0), dict(max_turns=9), dict(db="/elsewhere/me.db")):
        with pytest.raises(cli.UserError, match=f"was trained with --{next(iter(other)).replace('_', '-')} "):
            runs.check_resumable(cli.run_dir(cfg), runs.saved_config(cli.TrainConfig(**{**vars(changed), **other}),
                                                                     "cpu"))
    runs.check_resumable(cli.run_dir(cfg), runs.saved_config(cli.TrainConfig(**{**vars(changed),
                                                                                 "learning_rate": 1e-4,
                                                                                 "max_steps": 9}), "cpu"))
    # the batch size may change after the warm start (the bench does), not once GRPO has taken steps
    wider = runs.saved_config(cli.TrainConfig(**{**vars(changed), "groups_per_step": 6}), "cpu")
    runs.check_resumable(cli.run_dir(cfg), wider)
    (cli.run_dir(cfg) / "history.jsonl").write_text('{"step": 1, "train/reward": 0.5}\n')
    with pytest.raises(cli.UserError, match="was trained with --groups-per-step 12, not --groups-per-step 6; pass "
                                            "--groups-per-step 12 to resume it"):
        runs.check_resumable(cli.run_dir(cfg), wider)
    assert not (cli.run_dir(cfg) / "checkpoints").exists()
    assert json.loads((cli.run_dir(cfg) / "run_config.json").read_text())["base_model"] == "b"


@pytest.mark.parametrize("saved, given", [(["--max-turns", "4"], ["--max-turns", "6"]),
                                          (["--no-single-source"], []),
                                          (["--unanswerable-share", "0.25"], ["--unanswerable-share", "0.5"])])
def test_a_changed_setting_is_refused_with_the_flag_that_resumes_the_run(demo_db_path, tmp_path, capsys, saved,
                                                                         given):
    argv = ["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--name", "r"]
    cfg = cli.config_from_args(cli.make_parser().parse_args([*argv, *saved]))
    runs.start(cli.run_dir(cfg), runs.saved_config(replace(cfg, base_model=backends.CPU_BASE_MODEL), "cpu"))
    (cli.run_dir(cfg) / "history.jsonl").write_text('{"step": 1, "train/reward": 0.5}\n')  # GRPO began
    assert cli.main([*argv, *given]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    advice = re.search(r"; pass (.+) to resume it \(--fresh would delete the run and start it over; another --name "
                       r"starts a new run\)\.$", error)
    assert advice and advice[1] == " ".join(saved), error
    # the advice works: with it, the run is resumable, and it was left as it was
    resumed = cli.config_from_args(cli.make_parser().parse_args([*argv, *given, *advice[1].split()]))
    runs.check_resumable(cli.run_dir(cfg), runs.saved_config(replace(resumed, base_model=backends.CPU_BASE_MODEL),
                                                             "cpu"))
    assert (cli.run_dir(cfg) / "history.jsonl").read_text().startswith('{"step": 1')


def test_demo_preset_and_explicit_flags(monkeypatch):
    args = cli.make_parser().parse_args(["train", "--demo", "--max-steps", "7", "--no-single-source"])
    cfg = cli.config_from_args(args)
    assert (cfg.max_steps, cfg.single_source, cfg.db, cfg.sft_from) == (7, False, cli.DEMO_DB, "demo-expert")
    # without --demo, a CPU run takes the CPU preset's episode limits and batch (test_judge_outage), a GPU run none
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    assert cli.config_from_args(cli.make_parser().parse_args(["train"])) == cli.TrainConfig()


# ---- GPU and remote backends: wiring only (no GPU here) ---------------------------------------------

def train_on_scripts(scripts: dict, monkeypatch, tokenizer=None, **config):
    """loop.train as on a GPU machine: ART's LocalBackend with its GPU service stubbed (art_doubles), the policy a
    scripted server (question -> tool calls). Returns (the backend, the server, W&B runs ART would have started)."""
    # without a tokenizer the server sends no logprobs: the first step's check would stop the run before training
    config.setdefault("train_anyway", tokenizer is None)
    with on_a_gpu_machine(monkeypatch, scripts, tokenizer) as (made, server, wandb_runs):
        asyncio.run(loop.train(cli.TrainConfig(**config)))
    (backend,) = made
    return backend, server, wandb_runs


def test_local_backend_wiring(demo_db, demo_db_path, qwen_style_model_dir, tmp_path, monkeypatch, capfd):
    """The loop through ART's own LocalBackend: its settings reach ART's get_model_config, ART tokenizes and packs
    the groups the loop hands it (sampled tokens, with logprobs), its metric keys reach the step line."""
    from art.local import LocalBackend
    from transformers import AutoTokenizer

    from email_agent.data import questions

    qs = questions.select_questions(demo_db, "train", seed=0)[:6]
    tokenizer = AutoTokenizer.from_pretrained(qwen_style_model_dir)
    backend, server, wandb_runs = train_on_scripts(
        {q.question: half_solve(q) for q in qs}, monkeypatch, tokenizer, name="gpu", art_dir=str(tmp_path),
        db=str(demo_db_path), val_size=2, train_limit=4, groups_per_step=2, rollouts_per_group=2, max_steps=2,
        eval_every=1, learning_rate=3e-6, advantage_balance=0.5, scale_rewards=False, gpu_memory_utilization=0.6,
        enforce_eager=True, max_num_seqs=16, max_seq_length=4096, lora_rank=32, lora_alpha=64,
        base_model=str(qwen_style_model_dir))
    assert isinstance(backend, LocalBackend) and backend.closed and wandb_runs == []
    (service,) = GPUService.made
    # what ART's get_model_config made of the run's settings: what unsloth and vLLM would be started with
    assert service.config["init_args"]["max_seq_length"] == 4096
    assert service.config["peft_args"]["r"] == 32 and service.config["peft_args"]["lora_alpha"] == 64
    assert {k: service.config["engine_args"][k] for k in ("gpu_memory_utilization", "enforce_eager", "max_num_seqs",
                                                          "max_model_len", "max_lora_rank", "enable_sleep_mode")} == {
        "gpu_memory_utilization": 0.6, "enforce_eager": True, "max_num_seqs": 16, "max_model_len": 4096,
        "max_lora_rank": 32, "enable_sleep_mode": True}  # vLLM's default rank, 16, would refuse this LoRA
    # ART tokenized and packed what the policy sampled: the trained tokens are the sampled ones
    assert len(service.packed) == 2
    sampled = [len(r["sampled_ids"]) for r in server.served]
    assert all(int(p["assistant_mask"].sum()) > 0 for p in service.packed)
    assert sum(int(p["assistant_mask"].sum()) for p in service.packed) <= sum(sampled)
    out = capfd.readouterr()
    run_dir = tmp_path / "email-agent/models/gpu"
    assert (run_dir / "model.json").exists()  # LocalBackend.register wrote it
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    steps = [row for row in history if "loss/train" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["data/step_trainer_tokens"] == int(p["assistant_mask"].sum())
               for row, p in zip(steps, service.packed))
    assert all(row["train/trained_token_share"] == 1.0 and row["train/trainable_group_share"] == 1.0 for row in steps)
    assert re.search(r"^step\s+1 .* loss \+0\.2500 +trained on 100% of groups, 100% of tokens", out.out, re.M)
    assert any(row.get("val/answer_correct") == 1.0 for row in history)
    assert curves_in_tensorboard(run_dir) == curves_in_history(run_dir)  # the dashboard, as on the CPU path
    # The validation bar, like the training bar, shows a few running metrics, not the whole rubric.
    bars = [seg for seg in re.split(r"[\r\n]", out.err) if seg.startswith(("validate", "step "))]
    assert any(seg.startswith("validate") and "reward=" in seg for seg in bars)
    assert all(seg.count("=") <= 4 for seg in bars), max(bars, key=lambda seg: seg.count("="))


def test_hallucination_penalty_sets_what_a_wrong_answer_scores(demo_db, demo_db_path, qwen_style_model_dir, tmp_path,
                                                               monkeypatch, capsys):
    from email_agent.data import questions

    wrong = [call("return_final_answer", {"answer": "Tuesday at noon", "sources": []})]  # no search: no partial credit
    backend, _, _ = train_on_scripts({q.question: wrong for q in questions.select_questions(demo_db, "train", seed=0)},
                                     monkeypatch, name="h", art_dir=str(tmp_path), db=str(demo_db_path), val_size=2,
                               train_limit=2, groups_per_step=2, rollouts_per_group=2, max_steps=1, eval_every=1,
                               hallucination_penalty=2.5, base_model=str(qwen_style_model_dir))
    rewards = [t.reward for groups, _ in backend.train_calls for g in groups for t in g.trajectories]
    assert rewards and all(r == pytest.approx(-2.5) for r in rewards)
    assert "a wrong answer costing 2.5" in capsys.readouterr().err  # the run's opening lines say so
    history = [json.loads(line) for line in (tmp_path / "email-agent/models/h/history.jsonl").read_text().splitlines()]
    assert [row["val/reward"] for row in history if "val/reward" in row] == [pytest.approx(-2.5)] * 2


def test_unanswerable_share_adds_questions_asked_before_their_answer(demo_db, demo_db_path, qwen_style_model_dir,
                                                                     tmp_path, monkeypatch, capsys):
    from email_agent.data import questions

    train = questions.select_questions(demo_db, "train", seed=0)[2:4]  # after 2 validation questions
    idk = [call("search_inbox", {"keywords": ["zebra"]}),  # a search that ran: the abstention is a sound one
           call("return_final_answer", {"answer": "I don't know", "sources": []})]
    backend, _, _ = train_on_scripts({q.question: idk for q in train}, monkeypatch, name="u", art_dir=str(tmp_path),
                               db=str(demo_db_path), val_size=2, train_limit=2, unanswerable_share=0.5,
                               groups_per_step=4, rollouts_per_group=2, max_steps=1, eval_every=1,
                               base_model=str(qwen_style_model_dir))
    assert "2 train (+2 asked before their answer arrived)" in capsys.readouterr().err
    [(groups, _)] = backend.train_calls
    by_id = {g.trajectories[0].metadata["question_id"]: g for g in groups}
    assert sorted(map(str, by_id)) == sorted([str(q.id) for q in train] + [f"{q.id}-withheld" for q in train])
    for q in train:  # the replay's "today" is before its gold email, so no search can show it
        today = (by_id[f"{q.id}-withheld"].trajectories[0].messages_and_choices[0]["content"]
                 .split("Today's date is ")[1])
        assert today[:10] < demo_db.read(q.message_ids[0]).date[:10] <= q.query_date
        assert all(t.reward == 0 and t.metrics["returned_i_dont_know"] for t in by_id[f"{q.id}-withheld"].trajectories)
    code = cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path),
                     "--unanswerable-share", "1"])
    assert code == 1 and "--unanswerable-share must be at least 0 and below 1, not 1.0" in capsys.readouterr().err


def test_backend_selection_errors(monkeypatch):
    cfg = cli.TrainConfig()
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert backends.resolve_backend("auto") == "cpu"
    with pytest.raises(backends.BackendError, match="CUDA"):
        backends.make_backend("local", cfg)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(backends.BackendError, match="WANDB_API_KEY"):
        backends.make_backend("serverless", cfg)
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(backends.BackendError, match="TINKER_API_KEY"):
        backends.make_backend("tinker", cfg)
    with pytest.raises(backends.BackendError, match="unknown backend"):
        backends.resolve_backend("tpu")
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    assert backends.resolve_backend("auto") == "local"


def test_remote_backends_get_keys_from_the_environment_only(monkeypatch, capsys):
    """ART's real ServerlessBackend, built as the run builds it: it authenticates with the key from the
    environment and nothing prints it. (TinkerBackend prints a key passed as an argument; make_backend passes
    none. Its import needs the tinker extra, which CI does not install, so it is not built here.)"""
    import art

    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-123")
    backend = backends.make_backend("serverless", cli.TrainConfig())
    assert isinstance(backend, art.ServerlessBackend) and backend._client.api_key == "wandb-secret-123"
    shown = capsys.readouterr()
    assert "wandb-secret-123" not in shown.out + shown.err


def test_the_run_saves_its_episode_limits_for_evaluation(tmp_path):
    cfg = cli.config_from_args(cli.make_parser().parse_args(["train", "--demo", "--art-dir", str(tmp_path),
                                                             "--max-turns", "5"]))
    runs.start(cli.run_dir(cfg), runs.saved_config(cfg, "cpu"))
    saved = json.loads((cli.run_dir(cfg) / "run_config.json").read_text())
    assert saved["db"] == str(Path(cli.DEMO_DB).resolve())  # found again from any folder
    assert saved["episode"] == {"max_turns": 5, "max_tokens": 64, "max_body_chars": 600, "search_results": 3}
    run = runs.find_run("demo", str(tmp_path))
    assert run.limits == Episode(5, 64, 600, 3) and run.backend == "cpu"
    # A run saved before the "episode" entry existed: its top-level flags say the same.
    assert Episode.from_run_config({k: v for k, v in saved.items() if k != "episode"}) == run.limits
    assert Episode.from_run_config({}) == Episode()


def test_the_opening_summary_says_what_the_run_will_do():
    """Catches the summary announcing GRPO steps that --sft-only will never run (as it did for bench_enron)."""
    def summary(*flags):
        cfg = cli.config_from_args(cli.make_parser().parse_args(["train", "--demo", *flags]))
        return "\n".join(config.opening_lines(cfg, "cpu", train=202, unanswerable=0, val=8, steps=cfg.max_steps,
                                             reward="offline"))

    full = summary()
    assert "warm start   demo-expert, 1 epoch(s) at learning rate 0.001" in full
    assert "GRPO         3 steps of 6 questions x 4 rollouts at learning rate 0.0001; validation every 3 steps" in full
    assert "GRPO         none: --sft-only stops after the warm start" in summary("--sft-only")
    assert "warm start   none" in summary("--sft-from", "")


def test_wandb_traces_training_rollouts_with_weave(demo_db, demo_db_path, qwen_style_model_dir, tmp_path, monkeypatch):
    from email_agent.data import questions
    from email_agent import tracing

    qs = questions.select_questions(demo_db, "train", seed=0)[:3]
    traced = []

    def fake_traced(project, rollout, judge=None):
        async def wrapper(policy, *args, **kwargs):
            traced.append((project, "validation" if policy.temperature == 0 else "training"))
            return await rollout(policy, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(tracing, "traced_rollout", fake_traced)
    monkeypatch.setattr(config, "wandb_installed", lambda: True)
    monkeypatch.setenv("WANDB_API_KEY", "wandb-test-key")
    train_on_scripts({q.question: expert_script(q) for q in qs}, monkeypatch, name="w", art_dir=str(tmp_path),
                     db=str(demo_db_path), val_size=1, train_limit=2, groups_per_step=1, rollouts_per_group=2,
                     max_steps=1, eval_every=5, wandb=True, project="p", base_model=str(qwen_style_model_dir))
    # both rollouts of the one training group and the validation episodes (before the step and at the end) went
    # through the traced function
    assert sorted(traced) == [("p", "training")] * 2 + [("p", "validation")] * 2


def test_no_wandb_run_without_the_flag_even_with_a_key(demo_db, demo_db_path, qwen_style_model_dir, tmp_path,
                                                       monkeypatch, capsys):
    """ART 0.5.18's LocalBackend starts a W&B run at register and at every train whenever WANDB_API_KEY is set,
    whatever report_metrics says; without --wandb the run must not start one."""
    from email_agent.data import questions

    qs = questions.select_questions(demo_db, "train", seed=0)[:3]
    monkeypatch.setenv("WANDB_API_KEY", "wandb-test-key")
    _, _, wandb_runs = train_on_scripts({q.question: expert_script(q) for q in qs}, monkeypatch, name="nw",
                                        art_dir=str(tmp_path), db=str(demo_db_path), val_size=1, train_limit=2,
                                        groups_per_step=1, rollouts_per_group=2, max_steps=1, eval_every=5,
                                        base_model=str(qwen_style_model_dir))
    assert wandb_runs == []
    err = capsys.readouterr().err
    assert "W&B: off (no --wandb)" in err and "wandb-test-key" not in err
    monkeypatch.setenv("WANDB_API_KEY", "wandb-test-key")
    monkeypatch.setattr(config, "wandb_installed", lambda: True)
    _, _, wandb_runs = train_on_scripts({q.question: expert_script(q) for q in qs}, monkeypatch, name="yw",
                                        art_dir=str(tmp_path), db=str(demo_db_path), val_size=1, train_limit=2,
                                        groups_per_step=1, rollouts_per_group=2, max_steps=1, eval_every=5,
                                        wandb=True, base_model=str(qwen_style_model_dir))
    assert wandb_runs and set(wandb_runs) == {"yw"}  # with --wandb, ART's own W&B run, as before
    both = tmp_path / "email-agent" / "models" / "yw"  # and the local dashboard beside it
    assert curves_in_tensorboard(both) == curves_in_history(both) and ("train", "reward") in curves_in_history(both)


def test_a_dashboard_folder_that_cannot_be_written_leaves_training_going_and_says_so_once(
        demo_db, demo_db_path, qwen_style_model_dir, tmp_path, monkeypatch, capsys):
    from email_agent.data import questions

    qs = questions.select_questions(demo_db, "train", seed=0)[:3]
    run = tmp_path / "email-agent" / "models" / "nb"
    run.mkdir(parents=True)
    (run / "tensorboard").write_text("a file where the dashboard's folder goes")
    train_on_scripts({q.question: expert_script(q) for q in qs}, monkeypatch, name="nb", art_dir=str(tmp_path),
                     db=str(demo_db_path), val_size=1, train_limit=2, groups_per_step=1, rollouts_per_group=2,
                     max_steps=2, eval_every=1, base_model=str(qwen_style_model_dir))
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history if "train/reward" in row] == [1, 2]  # both steps trained and logged
    err = capsys.readouterr().err
    assert err.count("dashboard: off for this run") == 1 and f"{run / 'tensorboard'} cannot be written" in err


def test_wandb_without_the_package_is_a_clear_error(demo_db_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(config, "wandb_installed", lambda: False)
    code = cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--wandb",
                     "--backend", "cpu"])
    assert code == 1 and "pip install wandb==0.25.0" in capsys.readouterr().err
    assert not (tmp_path / "email-agent").exists()  # refused before the run was created


# ---- warm start: resume after a hard kill -------------------------------------------------------------------

class Killed(Exception):
    """Stands in for kill -9 (SystemExit would escape asyncio's task bookkeeping as a stray traceback)."""


class SFTRecorder:
    """The parts of an art.TrainableModel the warm start uses; the run (checkpoint step, state, log) is
    `run`, shared between "processes". `die_in_epoch` makes train_sft die like kill -9: no checkpoint."""

    def __init__(self, run, die_in_epoch=None):
        self.run, self.die_in_epoch = run, die_in_epoch

    def read_state(self):
        return dict(self.run["state"])

    def merge_state(self, update):
        self.run["state"].update(update)
        return dict(self.run["state"])

    async def get_step(self):
        return self.run["step"]

    async def train_sft(self, trajectories, config):
        epoch = len(self.run["trained"]) + 1
        if epoch == self.die_in_epoch:
            raise Killed("killed")
        self.run["trained"].append((self.run["step"], len(trajectories), config.learning_rate))
        self.run["step"] += 1  # ART checkpoints once per train_sft call

    async def log(self, trajectories=None, split="val", *, metrics=None, step=None):
        self.run["log"].append((step, metrics))


def test_warm_start_resumes_at_the_epoch_after_the_last_checkpoint(demo_db, caplog):
    import logging

    from email_agent.data import questions

    caplog.set_level(logging.INFO, logger="email_agent")

    cfg = cli.TrainConfig(sft_from="demo-expert", sft_limit=6, sft_epochs=3, sft_learning_rate=1e-3,
                          sft_schedule="constant")
    train = questions.select_questions(demo_db, "train", seed=0)[:20]
    episode = Episode(max_turns=4, max_body_chars=600, search_results=3)
    episodes = asyncio.run(demonstrations.warm_start_episodes(cfg.sft_from, cfg.sft_limit, demo_db, train, [], episode))
    run = {"step": 0, "state": {}, "trained": [], "log": []}
    with pytest.raises(Killed):  # dies during epoch 2, after epoch 1's checkpoint (step 1)
        asyncio.run(warm_start.fine_tune(cfg, SFTRecorder(run, die_in_epoch=2), episodes))
    assert run["step"] == 1 and len(run["trained"]) == 1
    asyncio.run(warm_start.fine_tune(cfg, SFTRecorder(run), episodes))
    # Epochs 2 and 3 ran once each, on top of epoch 1's checkpoint: no epoch repeated, none skipped.
    assert run["trained"] == [(0, 6, [1e-3]), (1, 6, [1e-3]), (2, 6, [1e-3])] and run["step"] == 3
    assert "resuming after epoch 1" in caplog.text
    assert [m for _, m in run["log"]] == [{"sft_epoch": 1}, {"sft_epoch": 2}, {"sft_epoch": 3}]  # curve markers
    assert [s for s, _ in run["log"]] == [1, 2, 3]
    asyncio.run(warm_start.fine_tune(cfg, SFTRecorder(run), episodes))  # all done: nothing re-runs
    assert len(run["trained"]) == 3


def test_a_resumed_warm_start_continues_the_learning_rate_schedule_where_it_stopped(demo_db):
    from email_agent.data import questions

    cfg = cli.TrainConfig(sft_from="demo-expert", sft_limit=10, sft_epochs=2, sft_batch_size=2,
                          sft_learning_rate=1e-3, sft_schedule="linear")
    train = questions.select_questions(demo_db, "train", seed=0)[:30]
    episode = Episode(max_turns=4, max_body_chars=600, search_results=3)
    episodes = asyncio.run(demonstrations.warm_start_episodes(cfg.sft_from, cfg.sft_limit, demo_db, train, [], episode))
    whole = {"step": 0, "state": {}, "trained": [], "log": []}
    asyncio.run(warm_start.fine_tune(cfg, SFTRecorder(whole), episodes))
    rates = [r for _, _, epoch_rates in whole["trained"] for r in epoch_rates]
    # 2 epochs of 5 batches: one warm-up batch up to the peak, then a straight line down to 0 at the last batch.
    assert len(rates) == 10 and rates[0] == pytest.approx(1e-3) and rates[-1] == 0
    assert all(a > b for a, b in zip(rates[1:], rates[2:]))
    interrupted = {"step": 0, "state": {}, "trained": [], "log": []}
    with pytest.raises(Killed):
        asyncio.run(warm_start.fine_tune(cfg, SFTRecorder(interrupted, die_in_epoch=2), episodes))
    asyncio.run(warm_start.fine_tune(cfg, SFTRecorder(interrupted), episodes))
    assert interrupted["trained"] == whole["trained"]  # epoch 2 got epoch 2's rates, not the schedule's start


def test_a_damaged_state_file_is_one_error_before_any_model_loads(tmp_path):
    folder = tmp_path / "r"
    assert runs.read_state(folder) == {}  # a new run
    folder.mkdir()
    for content, problem in (("{half", "Expecting"), ("[1]", "not an object"),
                             ('{"sft_steps": "x"}', "sft_steps is 'x', not an int"),
                             ('{"sft_start_step": -2}', "sft_start_step is -2"),
                             ('{"sft_done": 1}', "sft_done is 1, not a bool")):
        (folder / "state.json").write_text(content)
        with pytest.raises(cli.UserError, match=re.escape(problem)):
            runs.read_state(folder)
    (folder / "state.json").write_text('{"sft_start_step": 0, "sft_done": true, "sft_steps": 2, "other": [1]}')
    assert runs.read_state(folder)["sft_steps"] == 2  # keys of others are left alone


def test_run_state_is_checked_against_the_checkpoints(tmp_path, capsys):
    folder = tmp_path / "r"
    # checkpoints deleted back into the warm start: it resumes from the latest one left
    run = {"step": 1, "state": {"sft_start_step": 0, "sft_done": True, "sft_steps": 3}}
    state = asyncio.run(runs.check_state(folder, run["state"], SFTRecorder(run)))
    assert state == {"sft_start_step": 0, "sft_done": False, "sft_steps": 3} == run["state"]
    assert "the warm start resumes from step 1" in capsys.readouterr().err
    # the state deleted after a warm start: where it ended is unknown
    folder.mkdir(parents=True)
    (folder / "history.jsonl").write_text('{"step": 3, "train/sft_epoch": 3}\n')
    with pytest.raises(cli.UserError, match="no state.json, so where its warm start ended is unknown"):
        asyncio.run(runs.check_state(folder, {}, SFTRecorder({"step": 5, "state": {}})))
    # a run trained with GRPO alone has no state: nothing to check
    (folder / "history.jsonl").write_text('{"step": 5, "train/reward": 0.5}\n')
    assert asyncio.run(runs.check_state(folder, {}, SFTRecorder({"step": 5, "state": {}}))) == {}


def test_a_damaged_run_state_or_empty_teacher_is_refused_before_the_model_loads(demo_db_path, tmp_path, capsys,
                                                                               monkeypatch):
    """What the command checks first, before it loads the base model (seconds on CPU, minutes on a GPU)."""
    from email_agent.backends.cpu import CPUBackend

    async def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(CPUBackend, "register", no_model)
    common = ["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path)]
    folder = runs.run_path(str(tmp_path), runs.PROJECT, "demo")
    folder.mkdir(parents=True)
    (folder / "state.json").write_text('{"sft_steps": "3"}')
    assert cli.main(common) == 1
    assert "state.json is damaged (sft_steps is '3', not an int)" in capsys.readouterr().err
    assert not (folder / "run_config.json").exists()  # a refused run is not saved
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "results.jsonl").write_text('{"question_id": "nope"}\n')
    assert cli.main(common + ["--name", "taught", "--sft-from", str(teacher)]) == 1
    assert "results.jsonl holds no episodes" in capsys.readouterr().err
    assert not runs.run_path(str(tmp_path), runs.PROJECT, "taught").exists()


def test_a_half_written_history_line_is_dropped_before_the_run_goes_on(tmp_path, capsys):
    history = tmp_path / "history.jsonl"
    history.write_text('{"step": 1, "val/reward": 0.5}\n{"step": 2, "train/rew')
    runs.drop_torn_history_line(history)
    assert history.read_text() == '{"step": 1, "val/reward": 0.5}\n' and "half-written" in capsys.readouterr().err
    runs.drop_torn_history_line(history)  # whole lines are left alone
    assert history.read_text() == '{"step": 1, "val/reward": 0.5}\n'


def test_one_run_is_trained_by_one_process_at_a_time(demo_db_path, tmp_path, capsys):
    cfg = cli.TrainConfig(name="busy", art_dir=str(tmp_path))
    held = runs.lock(cfg.art_dir, cfg.project, cfg.name)
    try:
        code = cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--name", "busy"])
        assert code == 1 and f"run 'busy' is being trained by process {os.getpid()}" in capsys.readouterr().err
    finally:
        held.close()
    runs.lock(cfg.art_dir, cfg.project, cfg.name).close()  # free again once the holder is gone


@pytest.mark.slow
def test_kill_9_during_warm_start_epoch_2_resumes_at_epoch_2(demo_db_path, tmp_path):
    """The real command: SIGKILL (no cleanup at all) while epoch 2 trains, then the same command again."""
    art_dir = tmp_path / "art"
    cmd = train_cmd(demo_db_path, art_dir, "--sft-only", "--sft-epochs", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        deadline = time.time() + 600
        line = ""
        while time.time() < deadline and not re.match(r"sft\s+1\s+epoch 1/2", line):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the warm start ended before epoch 1 was reported"
        time.sleep(1)  # inside epoch 2
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    run = art_dir / "email-agent" / "models" / "t"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000", "0001"]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after epoch 1" in again.stderr
    assert re.findall(r"^sft\s+(\d+)\s+epoch (\d)/2", again.stdout, re.M) == [("2", "2")]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000", "0001", "0002"]


@pytest.mark.parametrize("seed, run", [(None, "demo"), ("1", "demo-seed1")])
def test_make_demo_evaluates_50_questions_with_the_runs_own_episode_limits(seed, run):
    """`make demo` evaluates the trained agent as it was trained: no limit flag overrides the run's own limits
    (test_the_run_saves_its_episode_limits_for_evaluation checks that evaluation reads it). `SEED=1` trains and
    evaluates run demo-seed1, so it never resumes seed 0's run."""
    dry = subprocess.run([*MAKE_DRY_RUN, "demo", *([f"SEED={seed}"] if seed else [])], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    train = next(line for line in dry.splitlines() if "train_email_search_agent.py train" in line)
    assert f"--seed {seed or 0} --name {run}" in train
    line = next(line for line in dry.splitlines() if "test_email_search_agent.py" in line)
    flags = dict(re.findall(r"--([a-z-]+)(?: (\S+))?", line))
    assert int(flags["limit"]) >= 50 and flags["output"] == f"eval/{run}"
    assert not {"max-turns", "max-tokens", "max-body-chars", "search-results"} & set(flags)
    # what RL changed: the base model, the warm start's checkpoint (step 1: one epoch) and the final agent
    assert re.findall(r"--model (\S+)", line) == ["base", f"{run}@1", run] and config.DEMO_PRESET["sft_epochs"] == 1


def test_keep_checkpoints_best_keeps_the_latest_the_best_and_the_warm_start(tmp_path):
    """--keep-checkpoints best (the default), through ART's own LocalBackend deletion: it must keep the step with
    the best mean val/reward, not the worst, and the warm start's checkpoint the evaluation compares with."""
    import art

    from art_doubles import LocalBackendOnCPU

    model = art.TrainableModel(name="k", project="p", base_model="Qwen/Qwen2.5-0.5B-Instruct", base_path=str(tmp_path))
    run = tmp_path / "p" / "models" / "k"
    for step in range(6):
        (run / "checkpoints" / f"{step:04d}").mkdir(parents=True)
    rows = [{"step": 1, "val/reward": 0.1}, {"step": 2, "val/reward": 0.9}, {"step": 2, "val/reward": 0.7},
            {"step": 4, "val/reward": 0.5}, {"step": 5, "val/reward": -0.2}, {"step": 3, "train/reward": 5.0}]
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "val/rew')
    asyncio.run(backends.keep_latest_and_best(model, LocalBackendOnCPU(path=str(tmp_path)), 5, also=(1,)))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0001", "0002", "0005"]


def test_a_backend_that_cannot_start_saves_no_run(demo_db_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    code = cli.main(["train", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--name", "g",
                     "--backend", "local", "--val-size", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "--backend local cannot start here; missing: " in err and "a CUDA GPU: torch sees none" in err
    assert not (tmp_path / "email-agent" / "models" / "g" / "run_config.json").exists()  # a CPU run may use the name


def test_a_missing_base_model_saves_no_run(demo_db_path, tmp_path, capsys):
    code = cli.main(["train", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--name", "m",
                     "--base-model", str(tmp_path / "no-such-model"), "--val-size", "1"])
    assert code == 1 and "no-such-model: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "email-agent" / "models" / "m").exists()  # the right --base-model may use the name


def test_an_unknown_learning_rate_schedule_is_a_clear_error(demo_db_path, tmp_path, capsys):
    code = cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path),
                     "--sft-schedule", "step"])
    assert code == 1 and "--sft-schedule is constant, linear or cosine" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--eval-every", "--groups-per-step", "--rollouts-per-group", "--max-turns",
                                  "--hallucination-penalty"])
def test_counts_below_one_are_clear_errors(demo_db_path, tmp_path, capsys, flag):
    code = cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path), flag, "0.5"
                     if flag == "--hallucination-penalty" else "0"])
    assert code == 1 and f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--hallucination-penalty", "nan"], "--hallucination-penalty must be at least 1, not nan"),
    (["--max-body-chars", "-5"], "--max-body-chars must be at least 1, not -5"),
    (["--search-results", "0"], "--search-results must be at least 1, not 0"),
    (["--learning-rate", "-1"], "--learning-rate must be above 0, not -1.0"),
    (["--sft-learning-rate", "inf"], "--sft-learning-rate must be above 0, not inf"),
    (["--temperature", "-1"], "--temperature must be at least 0, not -1.0"),
    (["--advantage-balance", "2"], "--advantage-balance must be between -1 and 1, not 2.0"),
    (["--min-realistic", "5"], "--min-realistic must be between 0 and 1, not 5.0"),
    (["--sft-only", "--sft-from", ""], "--sft-only stops after the warm start, and --sft-from names none"),
    (["--cpu-train-threads", "-1"], "--cpu-train-threads must be at least 0, not -1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, not 0"),
    (["--max-seq-length", "0"], "--max-seq-length must be at least 1, not 0"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization is a share of the GPU's memory, above 0 and at "
                                        "most 1, not 0.0"),
    (["--gpu-memory-utilization", "80"], "--gpu-memory-utilization is a share of the GPU's memory, above 0 and at "
                                         "most 1, not 80.0"),
])
def test_values_out_of_range_are_clear_errors(demo_db_path, tmp_path, capsys, flags, message):
    assert cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path), *flags]) == 1
    assert message in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_a_mistyped_cpu_dtype_is_refused_before_the_run_starts(demo_db_path, tmp_path, capsys, monkeypatch):
    from email_agent.backends.cpu import model

    monkeypatch.setenv("EMAIL_AGENT_CPU_DTYPE", "bf16")
    assert cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path)]) == 1
    message = ("EMAIL_AGENT_CPU_DTYPE='bf16' is not a dtype the CPU backend runs in: set it to float32 or bfloat16, "
               "or unset it to let the backend choose")
    assert capsys.readouterr().err.strip() == f"Error: {message}" and not any(tmp_path.iterdir())
    with pytest.raises(cli.UserError, match=re.escape(message)):  # the trainer reads the same list
        model.inference_dtype()
    monkeypatch.setenv("EMAIL_AGENT_CPU_DTYPE", "float32")
    assert model.inference_dtype() is torch.float32


def test_untrained_smollm2_on_a_cpu_is_refused_at_once(demo_db_path, tmp_path, capsys, monkeypatch):
    """The README's GPU command on a machine without one: SmolLM2 untrained would learn nothing for hours."""
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    argv = ["train", "--name", "qwen7b", "--judge-model", "openai/gpt-4.1-mini", "--art-dir", str(tmp_path)]
    assert cli.main(argv) == 1  # before the judge is asked (no network here), the database opened or a model loaded
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("Error: no GPU found, so this run would train SmolLM2-135M-Instruct on the CPU, which never "
                     "makes a valid tool call untrained, so GRPO would learn nothing: warm-start it with --sft-from "
                     "expert, or train the demo inbox with --demo, or add --train-anyway to train regardless.")
    assert not (tmp_path / "email-agent").exists()
    assert cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--backend", "cpu",
                     "--sft-from", ""]) == 1
    assert "Error: the CPU backend's SmolLM2-135M-Instruct, which never makes a valid tool call untrained, so GRPO " \
           "would learn nothing: warm-start it with --sft-from expert, or add --train-anyway" in capsys.readouterr().err
    # a run whose warm start is done may go on without --sft-from
    run = tmp_path / "email-agent" / "models" / "demo"
    run.mkdir(parents=True)
    (run / "state.json").write_text('{"sft_done": true, "sft_steps": 1}')
    resumed = cli.config_from_args(cli.make_parser().parse_args(
        ["train", "--demo", "--art-dir", str(tmp_path), "--sft-from", ""]))
    config.check_warm_start(resumed)
    with pytest.raises(cli.UserError, match="--train-anyway"):  # unless --fresh starts it over
        config.check_warm_start(replace(resumed, fresh=True))


def test_an_art_dir_that_cannot_hold_runs_and_a_mistyped_demo_db_are_errors(demo_db_path, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert cli.main(["train", "--demo", "--db", str(demo_db_path), "--art-dir", str(tmp_path / "file")]) == 1
    assert f"--art-dir {tmp_path / 'file'}: runs cannot be kept there" in capsys.readouterr().err
    # --demo builds the demo inbox at its own path only: elsewhere a missing --db is a typo, not a place to fill
    assert cli.main(["train", "--demo", "--db", str(tmp_path / "typo.db"), "--art-dir", str(tmp_path / "art")]) == 1
    assert "typo.db" in capsys.readouterr().err and not (tmp_path / "typo.db").exists()


@pytest.mark.parametrize("command", ["build-db", "generate-questions", "search", "read", "ask", "train", "dashboard"])
def test_every_command_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.make_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and f" {command} [-h]" in out


def test_the_evaluation_script_prints_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        evaluate_cli.make_parser().parse_args(["--help"])
    assert exit_.value.code == 0 and "--model" in capsys.readouterr().out


def test_a_resumed_run_trains_the_next_questions_not_the_first_again(demo_db, demo_db_path, qwen_style_model_dir,
                                                                     tmp_path, monkeypatch):
    """GRPO resumes at the next batch of the dataset: a restart that began at step 0 again (or skipped a batch)
    would train some questions twice and others never."""
    import art

    from email_agent.data import questions

    train = questions.select_questions(demo_db, "train", seed=0)
    settings = dict(name="r", art_dir=str(tmp_path), db=str(demo_db_path), val_size=2, train_limit=8,
                    groups_per_step=2, rollouts_per_group=2, eval_every=100, base_model=str(qwen_style_model_dir),
                    keep_checkpoints="all")
    first, _, _ = train_on_scripts({q.question: expert_script(q) for q in train}, monkeypatch, max_steps=1, **settings)
    second, _, _ = train_on_scripts({q.question: expert_script(q) for q in train}, monkeypatch, max_steps=3, **settings)
    trained = [[g.trajectories[0].metadata["question_id"] for g in groups]
               for backend in (first, second) for groups, _ in backend.train_calls]
    rl_questions = questions.training_questions(demo_db, cli.TrainConfig(**settings))[2]
    batches = [[q.id for q in batch.items] for batch in art.utils.iterate_dataset(
        rl_questions, groups_per_step=2, num_epochs=3, use_tqdm=False)][:3]
    assert trained == batches and len({tuple(b) for b in batches}) == 3
