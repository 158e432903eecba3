"""A training run's configuration: the typed `TrainConfig` (one flag per field, declared with its help and the
values it allows: `settings.setting`), the presets (`--demo`, and the CPU backend's episode limits and batch), the
checks made before anything loads, and what is saved beside the run (`run_config.json`) and told at its start.

The training loop itself is email_agent/training/loop.py; this module owns no behaviour of it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from email_agent import backends, cli, settings
from email_agent.settings import setting
from email_agent.runs import ART_DIR, PROJECT, check_name, read_state, run_path
from email_agent.errors import UserError
from email_agent.agent.episode import LIMITS, Episode
from email_agent.data import email_db

# --sft-from's expert names, as agent.demonstrations.EXPERT_NAMES (not imported here: that module loads ART, seconds)
EXPERT_NAMES = ("expert", "demo-expert")

DEFAULT_DB = "data/enron_emails.db"
DEMO_DB = email_db.DEMO_DB


@dataclass
class TrainConfig:
    # run
    name: str = setting("agent", "run name: checkpoints and logs go to <art-dir>/<project>/models/<name>")
    project: str = setting(PROJECT, "ART project (also the W&B project)")
    art_dir: str = setting(ART_DIR, "where runs live")
    fresh: bool = setting(False, "delete an existing run of this name and start over (otherwise it resumes)")
    preflight: bool = setting(
        False, "gather one step's groups, say if GRPO can learn from them (exit 1 if not); trains nothing")
    train_anyway: bool = setting(
        False, "train even when the first step's check says GRPO cannot learn (otherwise it stops)")
    seed: int = setting(0, "one seed for question order, sampling and LoRA init")
    backend: str = setting("auto", "cpu | local (GPU) | serverless | tinker; auto: local with CUDA, else cpu")
    base_model: str = setting(
        "", "GPU: the largest Qwen2.5-Instruct the card fits (7B: 24-40 GB, 14B: 80 GB); CPU: SmolLM2")
    # data
    demo: bool = setting(False, "the bundled demo inbox (builds data/demo.db if missing) with the small CPU preset")
    db: str = setting(DEFAULT_DB, "database from build-db")
    train_limit: int = setting(0, "use only the first N training questions (0: all)", ge=0)
    val_size: int = setting(
        100, "validation questions, held out of the *train* split (the test split stays unseen)", ge=0)
    single_source: bool = setting(True, "only questions answered by one email (as ART·E trains)")
    # ART·E's how_realistic scores run from 0 to 1
    min_realistic: float = setting(0.0, "only questions with how_realistic >= this", ge=0, le=1)
    unanswerable_share: float = setting(
        0.0, "share of GRPO questions asked before their gold email came (best: I don't know)", ge=0, lt=1)
    # ---- ALGO LOGIC: GRPO hyperparameters (ART·E agent_008 on GPU) ----
    groups_per_step: int = setting(12, "questions per step", ge=1)
    rollouts_per_group: int = setting(4, "rollouts per question; GRPO compares them", ge=1)
    num_epochs: int = setting(3, "passes over the training questions", ge=1)
    max_steps: int = setting(0, "stop after this many RL steps in total (0: run all epochs)", ge=0)
    learning_rate: float = setting(1.2e-5, "GRPO's learning rate", gt=0, finite=True)
    advantage_balance: float = setting(
        0.0, "ART's knob, -1..1: >0 scales negative advantages by (1 - x) (0: balanced)", ge=-1, le=1)
    scale_rewards: bool = setting(
        True, "divide each group's advantages by its reward std (as ART); off (--demo): Dr. GRPO")
    max_turns: int = setting(Episode.max_turns, "agent turns per question", ge=1)
    max_tokens: int = setting(Episode.max_tokens, "tokens per model reply", ge=1)
    max_body_chars: int = setting(Episode.max_body_chars, "read_email cuts longer bodies", ge=1)
    search_results: int = setting(
        Episode.search_results, "results per search when the model does not ask for a number", ge=1)
    temperature: float = setting(1.0, "rollout sampling temperature", ge=0, finite=True)
    eval_every: int = setting(30, "validate every N steps (and at the end)", ge=1)
    keep_checkpoints: str = setting("best", "best: keep the latest and the best (val/reward) checkpoint; all: keep "
                                    "every one", choices=("best", "all"))
    # rewards
    reward: str = setting("", "offline | shaped | judge | ruler; default: shaped with a judge, offline without")
    judge_model: str = setting("", "litellm model name of the judge (or JUDGE_MODEL)")
    judge_base_url: str = setting("", "api_base for the judge, e.g. http://localhost:6688 (or JUDGE_API_BASE)")
    ruler_model: str = setting("", "judge for --reward ruler (default: the judge model)")
    # below ART·E's 1, a wrong answer could beat a sound "I don't know"
    hallucination_penalty: float = setting(
        1.0, "what a wrong answer costs (offline/shaped); higher: answers only when surer", ge=1)
    judge_patience: float = setting(
        600.0, "seconds a step waits for a failing judge (5xx, 429, timeouts) before the run stops", ge=0, finite=True)
    min_reward_std: float = setting(
        0.01, "a group whose rewards spread less (std) is judge noise: not trained on", ge=0, finite=True)
    # warm start (supervised, before RL)
    sft_from: str = setting("", "expert (a scripted expert on the train questions), or a teacher's evaluation folder")
    sft_only: bool = setting(False, "stop after the warm start")
    sft_limit: int = setting(0, "use at most N warm-start trajectories (0: all)", ge=0)
    sft_epochs: int = setting(1, "passes over the warm-start trajectories (one checkpoint each)", ge=1)
    sft_learning_rate: float = setting(
        1e-4, "peak (a GPU's 7B model); the CPU backend's default is 1e-3, constant", gt=0, finite=True)
    sft_batch_size: int = setting(8, "trajectories per optimiser step", ge=1)
    sft_schedule: str = setting("linear", "rate over all warm-start batches: linear/cosine to 0 after 10% warm-up, or "
                                "constant", choices=("constant", "linear", "cosine"))
    # GPU (local backend) memory settings and LoRA shape
    lora_rank: int = setting(8, "LoRA rank", ge=1)
    lora_alpha: int = setting(16, "LoRA alpha", ge=1)
    gpu_memory_utilization: float = setting(0.8, "vLLM's share of the GPU; 0.6-0.7 when a 7B run shares a 24 GB card",
                                            gt=0, le=1,
                                            refusal="is a share of the GPU's memory, above 0 and at most 1,")
    max_seq_length: int = setting(8192, "trainer and vLLM context", ge=1)
    enforce_eager: bool = setting(False, "skip CUDA-graph capture (saves memory on 24 GB cards)")
    max_num_seqs: int = setting(64, "concurrent sequences in vLLM", ge=1)
    concurrency: int = setting(32, "simultaneous rollouts", ge=1)
    cpu_train_threads: int = setting(
        0, "torch threads for CPU training (0: the cores it may use; 1 if jobs share them)", ge=0)
    wandb: bool = setting(False, "log to W&B too (needs WANDB_API_KEY; WANDB_MODE=offline works)")
    tensorboard: bool = setting(
        True, "every step's metrics as TensorBoard curves in the run folder (open: `dashboard`)")




# The small CPU preset `--demo` applies (flags given explicitly still win): minutes per step on 2 cores. Each value
# was measured over seeds (bench/bench_learning.py; every run in bench/RESULTS.md, the story in
# docs/agent-and-rewards.md).
DEMO_PRESET = dict(
    db=DEMO_DB, name="demo",
    # the warm start does the learning: one epoch over every demo-expert episode at a constant 1e-3
    sft_from="demo-expert", sft_limit=0, sft_epochs=1, sft_batch_size=4, sft_learning_rate=1e-3,
    sft_schedule="constant",
    # three GRPO steps of 6 groups x 4 rollouts, all sent at once (later steps drifted to running out of turns)
    groups_per_step=6, rollouts_per_group=4, num_epochs=1, max_steps=3, learning_rate=1e-4, concurrency=24,
    # Dr. GRPO advantages (std-scaled ones traded right answers for abstentions), negative advantages halved
    advantage_balance=0.5, scale_rewards=False,
    hallucination_penalty=1.25,  # scored higher than 1.0 and 1.5 did
    temperature=0.8,  # scored higher, and more right, than 1.0
    # the episode limits a 135M model on two cores can afford
    max_turns=4, max_tokens=64, max_body_chars=600, search_results=3,
    eval_every=3, val_size=8)


def run_dir(cfg: TrainConfig) -> Path:
    return run_path(cfg.art_dir, cfg.project, cfg.name)


# What a CPU run takes from the demo preset when these flags are not given: its episode limits, its batch and its
# warm start's rate. The GPU-scale defaults (12 groups x 4 rollouts of up to 10 turns of 1,024 tokens) take hours
# a step on two cores, and the GPU's warm-start rate (1e-4, for a 7B model) teaches a small CPU model no tool call.
CPU_PRESET_KEYS = ("groups_per_step", "rollouts_per_group", *LIMITS, "concurrency", "sft_learning_rate",
                   "sft_schedule", "sft_batch_size")


def given_flags(args) -> dict:
    return cli.given_flags(args, TrainConfig)


def cpu_preset(args) -> dict:
    """The CPU preset's values a run on the CPU backend (named, or chosen for want of CUDA) takes without --demo:
    those of `CPU_PRESET_KEYS` not given as flags."""
    given = given_flags(args)
    if given.get("demo") or not backends.get(given.get("backend", "auto")).on_this_cpu:
        return {}
    return {key: DEMO_PRESET[key] for key in CPU_PRESET_KEYS if key not in given}


def config_from_args(args) -> TrainConfig:
    given = given_flags(args)
    preset = DEMO_PRESET if given.get("demo") else cpu_preset(args)
    return TrainConfig(**{**preset, **given})


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def check(cfg: TrainConfig) -> None:
    """A run's flags, checked once (by the `train` command, before the run's lock file is made and ART loads):
    values no run can use (each field's declared range, `settings.check`, and what depends on two fields), a run
    that could not learn (`check_warm_start`), names no folder can take; each refused with one sentence."""
    if cfg.preflight and cfg.fresh and run_dir(cfg).exists():
        raise UserError(f"--preflight with --fresh would delete run {cfg.name!r}; "
                        "preflight without --fresh, or under another --name.")
    if cfg.wandb and not wandb_installed():  # ART 0.5.18's model.log imports it for W&B metrics
        raise UserError("--wandb logs through the wandb package, which is not installed here: "
                        "pip install wandb==0.25.0 (what ART's GPU extra, requirements-gpu.txt, brings).")
    backends.cpu_dtype()  # an environment variable mistyped would otherwise stop the CPU trainer minutes in
    backends.check_model_folder(cfg.base_model)
    settings.check(cfg)  # each field's declared choices and range
    if cfg.sft_only and not cfg.sft_from:
        raise UserError("--sft-only stops after the warm start, and --sft-from names none; give --sft-from "
                        "expert or an evaluation folder")
    if cfg.sft_from not in ("", *EXPERT_NAMES) and not (Path(cfg.sft_from).expanduser() / "results.jsonl").is_file():
        raise UserError(f"--sft-from {cfg.sft_from}: expected 'expert' or an evaluation folder with results.jsonl "
                        "(an output folder of test_email_search_agent.py)")
    check_warm_start(cfg)
    check_name("--name", cfg.name)
    check_name("--project", cfg.project)


def check_warm_start(cfg: TrainConfig) -> None:
    """SmolLM2 never makes a valid tool call untrained, so GRPO from it learns nothing, for hours on a CPU: a run of
    it on the CPU backend with no warm start, now or earlier in the run, is refused in a second, before ART loads
    (--preflight measures it instead)."""
    if (cfg.sft_from or cfg.train_anyway or cfg.preflight
            or cfg.base_model not in ("", "smollm2", backends.CPU_BASE_MODEL)
            or not backends.get(cfg.backend).on_this_cpu
            or not cfg.fresh and read_state(run_dir(cfg)).get("sft_done")):
        return
    what = ("no GPU found, so this run would train SmolLM2-135M-Instruct on the CPU" if cfg.backend == "auto"
            else "the CPU backend's SmolLM2-135M-Instruct")
    demo = "" if cfg.demo else ", or train the demo inbox with --demo"
    raise UserError(f"{what}, which never makes a valid tool call untrained, so GRPO would learn nothing: "
                    f"warm-start it with --sft-from expert{demo}, or add --train-anyway to train regardless.")


def opening_lines(cfg: TrainConfig, backend: str, train: int, unanswerable: int, val: int, steps: int,
            reward: str, warm_start_done: bool = False) -> list[str]:
    """What a run is about to do, for a person, at its start (every setting is in run_config.json)."""
    replays = f" (+{unanswerable} asked before their answer arrived)" if unanswerable else ""
    warm = (f"{cfg.sft_from}, {cfg.sft_epochs} epoch(s) at learning rate {cfg.sft_learning_rate:g}" if cfg.sft_from
            else "none") + (" (done earlier in this run)" if warm_start_done else "")
    opener = "python train_email_search_agent.py dashboard" + (
        f" --art-dir {cfg.art_dir}" if cfg.art_dir != ART_DIR else "") + (
        f" --project {cfg.project}" if cfg.project != PROJECT else "")
    board = (f"TensorBoard curves in {run_dir(cfg) / 'tensorboard'} as it trains; open them: {opener}"
             if cfg.tensorboard else "off (--no-tensorboard); every step is in history.jsonl")
    return [f"run          {cfg.name} in {run_dir(cfg)} (all settings: run_config.json there)",
            f"backend      {backend}: {cfg.base_model}, LoRA rank {cfg.lora_rank}",
            f"data         {cfg.db}: {train} train{replays} / {val} validation questions (the test split unused)",
            f"episodes     up to {cfg.max_turns} turns of {cfg.max_tokens} tokens; {cfg.search_results} results per "
            f"search, emails cut at {cfg.max_body_chars} characters",
            f"warm start   {warm}",
            "GRPO         none: --sft-only stops after the warm start" if cfg.sft_only else
            f"GRPO         {steps} steps of {cfg.groups_per_step} questions x {cfg.rollouts_per_group} rollouts at "
            f"learning rate {cfg.learning_rate:g}; validation every {cfg.eval_every} steps",
            f"reward       {reward}",
            f"dashboard    {board}",
            "stop         Ctrl-C; the same command resumes from the last checkpoint"]
