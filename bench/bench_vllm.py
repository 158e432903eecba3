"""vLLM on the CPU, lever by lever, on the work the CPU path gives it (a script that prints figures; not a test).

Each configuration starts its own server for one LoRA checkpoint and does, one after the other:
  start-up   seconds from starting the server to its first answer on /v1/models;
  warm-up    the first chat request (2 tokens) after that;
  eval       the evaluation's work: `rollout` of the checkpoint on --questions held-out test questions, greedy,
             8 at once, with the demo preset's episode limits (4 turns, 64 tokens, 3 results, 600-character bodies);
  grpo       a GRPO step's rollouts: 2 training questions x 4 rollouts at temperature 0.7, the demo preset's step
             when this bench was written (2026-12-02; config.DEMO_PRESET's step is wider now), so that its figures
             stay comparable;
  memory     the peak resident memory of the server's processes (sampled every 0.5 s), KV cache included.
The same questions, seeds and settings for every configuration; `vllm` (this project's settings) is the
reference: the others are one lever changed. Greedy agreement compares what the agent said in each evaluation
episode (its text and calls) with the reference (bfloat16 matmuls in another order may flip a close greedy choice).
The engine vLLM replaced was measured with this bench before its removal (bench/RESULTS.md, "vLLM on the CPU").

    .venv/bin/python bench/bench_vllm.py --checkpoint DIR [--questions 16] [--configurations vllm,stock-lora]

(DIR: a LoRA checkpoint of the demo run, e.g. .art/email-agent/models/demo/checkpoints/0001 after make demo.)
Figures depend on what else runs on the machine; the load average is printed for that reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE, served_model_dir
from email_agent.backends.vllm_server import VLLMServer
from email_agent.data.email_db import EmailDB
from email_agent.agent.episode import Episode
from email_agent.data.questions import select_questions
from email_agent.agent.rollout import Policy, rollout

import openai
import psutil

LIMITS = Episode(max_turns=4, max_tokens=64, max_body_chars=600, search_results=3)
AT_ONCE = 8  # the evaluation's --concurrency and the server's batch
GRPO_QUESTIONS, GRPO_ROLLOUTS, GRPO_TEMPERATURE = 2, 4, 0.7  # the demo preset's step of 2026-12-02

# name -> (what it is, the environment it changes for the server)
CONFIGURATIONS = {
    "vllm": ("vLLM, this project's settings (LoRA plugin, worker on every core)", {}),
    "stock-lora": ("vLLM's own LoRA ops (plugin off)", {"VLLM_PLUGINS": "lora_filesystem_resolver"}),
    "reserved-core": ("vLLM's default binding (one core kept for its API server)",
                      {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}),
    "rank-64": ("LoRA slots of rank 64 (what the evaluation's server reserves) for the rank-8 adapter", {}),
    "merged": ("the LoRA merged into a copy of the weights, served without LoRA (vLLM then compiles the model)", {}),
    "bfloat16": ("served in bfloat16 (emulated on a CPU without AMX or AVX512-BF16)",
                 {"EMAIL_AGENT_CPU_DTYPE": "bfloat16"}),
    "float32": ("served in float32", {"EMAIL_AGENT_CPU_DTYPE": "float32"}),
}


def said(trajectory) -> list:
    """What the agent said in an episode, turn by turn: its text and its calls (names and arguments; vLLM gives each
    call a random id)."""
    turns = []
    for message in trajectory.messages():
        if message.get("role") == "assistant":
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
            turns.append((message.get("content"), calls))
    return turns


def merged_copy(checkpoint: str, folder: Path) -> Path:
    """The base model with `checkpoint`'s LoRA merged in (float32), saved as a transformers folder vLLM loads."""
    from peft import PeftModel

    from email_agent.backends.cpu import load_base_model

    base, tokenizer = load_base_model("smollm2")
    PeftModel.from_pretrained(base, checkpoint).merge_and_unload().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.asynccontextmanager
async def peak_memory(pid_of):
    """Yields a dict whose 'peak' is the largest resident memory (bytes) of the process `pid_of()` names and its
    children, sampled every 0.5 s while the block runs."""
    seen = {"peak": 0}

    async def sample():
        while True:
            with contextlib.suppress(psutil.Error, TypeError):
                root = psutil.Process(pid_of())
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                seen["peak"] = max(seen["peak"], total)
            await asyncio.sleep(0.5)

    task = asyncio.create_task(sample())
    try:
        yield seen
    finally:
        task.cancel()


async def play(client, questions, db, temperature: float, rollouts: int, seed: int = 0) -> tuple[list, float]:
    """`rollout` of every question `rollouts` times, AT_ONCE at a time: (trajectories, seconds)."""
    policy = Policy(client, "bench", temperature=temperature, max_concurrency=AT_ONCE)
    started = time.monotonic()
    trajectories = await asyncio.gather(*(rollout(policy, q, db, LIMITS)
                                          for q in questions for _ in range(rollouts)))
    return trajectories, time.monotonic() - started


@contextlib.asynccontextmanager
async def served(name: str, checkpoint: str, log_dir: Path):
    """(base URL, pid of the serving process) of configuration `name`, started here and stopped after."""
    if name == "merged":
        server = VLLMServer(merged_copy(checkpoint, log_dir / "merged"), "bench", chat_template=TOOL_CHAT_TEMPLATE,
                            log_path=log_dir / f"{name}.log", max_num_seqs=AT_ONCE, lora_rank=0)
    else:
        server = VLLMServer(served_model_dir("smollm2"), "base", chat_template=TOOL_CHAT_TEMPLATE,
                            log_path=log_dir / f"{name}.log", max_num_seqs=AT_ONCE, loras={"bench": checkpoint},
                            lora_rank=64 if name == "rank-64" else 8)
    with mock.patch.dict(os.environ, CONFIGURATIONS[name][1]):
        async with server:
            yield server.base_url, server._process.pid


async def measure(name: str, checkpoint: str, eval_questions, grpo_questions, db, log_dir: Path) -> dict:
    started = time.monotonic()
    async with served(name, checkpoint, log_dir) as (base_url, pid):
        result = {"start_s": time.monotonic() - started}
        async with peak_memory(lambda: pid) as memory:
            client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=3600)
            started = time.monotonic()
            await client.chat.completions.create(model="bench", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
            result["warmup_s"] = time.monotonic() - started
            episodes, result["eval_s"] = await play(client, eval_questions, db, 0.0, 1)
            _, result["grpo_s"] = await play(client, grpo_questions, db, GRPO_TEMPERATURE, GRPO_ROLLOUTS)
            result["peak_gb"] = memory["peak"] / 1e9
    result["messages"] = [json.dumps(said(t), default=str) for t in episodes]
    result["generated"] = sum(t.metrics["completion_tokens"] for t in episodes)
    result["prompt_tokens"] = sum(t.metrics["prompt_tokens"] for t in episodes)
    result["correct"] = sum(t.metrics["answer_correct"] for t in episodes)
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a LoRA checkpoint directory of the demo run")
    parser.add_argument("--db", default="data/demo.db", help="the demo database (make demo builds it)")
    parser.add_argument("--questions", type=int, default=16, help="test questions for the evaluation's work")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, the first is the reference (default: {','.join(CONFIGURATIONS)})")
    parser.add_argument("--log-dir", default="bench/logs", help="the servers' logs")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    db = EmailDB(args.db)
    eval_questions = select_questions(db, "test", seed=0, limit=args.questions)
    grpo_questions = select_questions(db, "train", seed=0, limit=GRPO_QUESTIONS)
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.2f}; checkpoint {args.checkpoint}")
    print(f"eval: {len(eval_questions)} test questions, {AT_ONCE} at once, greedy; grpo: {GRPO_QUESTIONS} train "
          f"questions x {GRPO_ROLLOUTS} at temperature {GRPO_TEMPERATURE}; limits {LIMITS}")
    reference = None
    for name in args.configurations.split(","):
        r = await measure(name, args.checkpoint, eval_questions, grpo_questions, db, Path(args.log_dir))
        reference = reference or r
        same = sum(a == b for a, b in zip(r["messages"], reference["messages"]))
        print(f"{name:>14}: start {r['start_s']:5.1f} s, warm-up {r['warmup_s']:5.1f} s, eval {r['eval_s']:6.1f} s "
              f"({r['eval_s'] / reference['eval_s']:.2f}x the first; {r['generated']} tokens generated, "
              f"{r['prompt_tokens']} prompt tokens, {r['correct']} right, "
              f"greedy agreement {same}/{len(r['messages'])}),"
              f" grpo step {r['grpo_s']:5.1f} s ({r['grpo_s'] / reference['grpo_s']:.2f}x), peak {r['peak_gb']:.2f} GB;"
              f" load {os.getloadavg()[0]:.2f}  [{CONFIGURATIONS[name][0]}]", flush=True)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
