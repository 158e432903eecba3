"""Serving speed of the CPU backend on agent-length conversations (a script that prints figures; not a test).

Plays EPISODES scripted episodes at once against `serve_checkpoint`, as the evaluation does: each turn sends
the whole conversation (the tool block, the system prompt, the question and every earlier turn; 1-3k tokens
by the last turn), greedy, at most MAX_TOKENS new tokens. Between turns the script appends real tool results
from the demo inbox (a search, the gold email, another search), whatever the model said, so every engine
configuration below does the same work when its greedy tokens agree. The prefix cache serves each turn's
shared start: only what an episode added since its last turn is prefilled.

Each configuration runs in the same process, one after the other, on the same episodes; the first one is
the reference for greedy agreement (identical token ids per request), which exact levers must keep at 100%.

    .venv/bin/python bench/bench_serving.py [--db data/demo.db] [--checkpoint DIR] [--rounds 2]

(--db is built as the demo inbox first if it does not exist.)

With --agent CHECKPOINT the work is instead the evaluation's own: the checkpoint plays --questions held-out
test questions through the real rollout code (greedy, 8 at once, the demo preset's episode shape: 4 turns,
64 tokens, 3 results, 600-character bodies), so the time is what `test_email_search_agent.py --limit 16`
spends on rollouts, and agreement compares each episode's messages.

Figures depend on what else runs on the machine; the load average is printed for that reason.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from email_agent.backends.cpu import engine, serve_checkpoint  # noqa: E402  (offline litellm default first)
from email_agent.data import EmailDB  # noqa: E402
from email_agent.questions import select_questions  # noqa: E402
from email_agent.rollout import SYSTEM_PROMPT, assistant_message  # noqa: E402
from email_agent.tools import TOOLS, Inbox, call_tool  # noqa: E402

import openai  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

EPISODES = 8  # played at once: the evaluation's default --concurrency, and the server's batch
TURNS = 4
MAX_TOKENS = 64
MAX_BODY_CHARS = 1500


def scripted_tool_results(db: EmailDB, question) -> list[str]:
    """What the environment answers after turns 1..TURNS-1: a search on the question's longer words, the
    gold email, then a search on the first of them alone."""
    inbox = Inbox(db, question.inbox_address, question.query_date, max_body_chars=MAX_BODY_CHARS,
                  default_max_results=5)
    words = [w.strip("?,.'\"").lower() for w in question.question.split() if len(w.strip("?,.'\"")) > 4][:3]
    return [call_tool(inbox, "search_inbox", {"keywords": words[:2]}).content,
            call_tool(inbox, "read_email", {"message_id": question.message_ids[0]}).content,
            call_tool(inbox, "search_inbox", {"keywords": words[:1]}).content][:TURNS - 1]


async def episode(client: openai.AsyncOpenAI, name: str, question, tool_results: list[str]
                  ) -> tuple[list[list[int]], int]:
    """(generated token ids per turn, prompt tokens over all turns)."""
    system = SYSTEM_PROMPT.format(inbox=question.inbox_address, today=question.query_date, max_turns=TURNS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question.question}]
    generated, prompt_tokens = [], 0
    for turn in range(TURNS):
        response = await client.chat.completions.create(
            model=name, messages=messages, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS, logprobs=True)
        choice = response.choices[0]
        generated.append([int(t.token.split(":")[1]) for t in choice.logprobs.content])
        prompt_tokens += response.usage.prompt_tokens
        messages.append(assistant_message(choice))
        if turn < len(tool_results):
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": tool_results[turn]})
    return generated, prompt_tokens


async def served_and_timed(checkpoint: str | None, play) -> tuple[object, float, collections.Counter]:
    """Serve the base model (with `checkpoint`'s LoRA), warm it up, then time `play(client)`: (its result,
    seconds, the engine's counters over that time)."""
    async with serve_checkpoint("smollm2", checkpoint, "bench", max_batch_size=EPISODES) as base_url:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=3600)
        await client.chat.completions.create(model="bench", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2)  # warm-up
        stats = engine.stats.copy()
        started = time.monotonic()
        result = await play(client)
        return result, time.monotonic() - started, engine.stats - stats


async def agent_episodes(checkpoint: str, db: EmailDB, questions) -> dict:
    """The evaluation's work: `rollout` of the checkpoint on each question, greedy, EPISODES at once."""
    from email_agent.episode import EpisodeShape
    from email_agent.rollout import Policy, RolloutConfig, rollout

    shape = EpisodeShape(max_turns=TURNS, max_tokens=MAX_TOKENS, max_body_chars=600, search_results=3)

    def play(client):
        policy = Policy(client, "bench", temperature=0.0, max_tokens=shape.max_tokens, max_concurrency=EPISODES)
        return asyncio.gather(*(rollout(policy, q, db, RolloutConfig.for_shape(shape)) for q in questions))

    trajectories, seconds, stats = await served_and_timed(checkpoint, play)
    return {"seconds": seconds, "stats": stats, "tokens": [json.dumps(t.messages(), sort_keys=True) for t in trajectories],
            "generated": sum(t.metrics["completion_tokens"] for t in trajectories),
            "prompt_tokens": sum(t.metrics["prompt_tokens"] for t in trajectories),
            "correct": sum(t.metrics["answer_correct"] for t in trajectories)}


def concatenated_cache(keys, values, width, rows):
    """The engine's batch cache before its growing layers: every decode step torch.cat's each layer's whole
    KV cache (stands in for `engine._cache`)."""
    def stack(parts):
        return torch.cat([torch.nn.functional.pad(p, (0, 0, width - p.shape[2], 0)) for p in parts])
    return DynamicCache([(stack(k), stack(v)) for k, v in zip(keys, values)])


# name -> context manager that switches one lever off (or an alternative on) by patching the engine's settings
# (the engine's defaults: prefill on 2 threads, decoding on 1, on two cores). The first one run is the
# reference for greedy agreement.
CONFIGURATIONS = {
    "all": ("engine (all levers on)", contextlib.nullcontext),
    "cat-cache": ("KV cache grown by torch.cat instead of in place",
                  lambda: mock.patch.object(engine, "_cache", concatenated_cache)),
    "row-major-keys": ("key cache stored row-major instead of transposed",
                       lambda: mock.patch.object(engine, "KEYS_TRANSPOSED", False)),
    "prefill-1-thread": ("prefill on 1 thread instead of 2",
                         lambda: mock.patch.multiple(engine, PREFILL_THREADS=1, DECODE_THREADS=1)),
    "decode-2-threads": ("decoding on 2 threads instead of 1",
                         lambda: mock.patch.multiple(engine, PREFILL_THREADS=2, DECODE_THREADS=2)),
    "no-speculation": ("no prompt-lookup speculation (one token per row and forward)",
                       lambda: mock.patch.object(engine, "DRAFT_TOKENS", 0)),
    "float32": ("float32 instead of bfloat16 (weights, activations and the cache)",
                lambda: mock.patch.dict(os.environ, {"EMAIL_AGENT_CPU_DTYPE": "float32"})),
}


async def run(configuration, checkpoint: str | None, questions, scripts, agent: str | None, db: EmailDB) -> dict:
    _, lever = configuration
    with lever():
        if agent:
            return await agent_episodes(agent, db, questions)
        episodes, seconds, stats = await served_and_timed(checkpoint, lambda client: asyncio.gather(
            *(episode(client, "bench", q, s) for q, s in zip(questions, scripts))))
    tokens = [turn for generated, _ in episodes for turn in generated]
    return {"seconds": seconds, "tokens": tokens, "generated": sum(map(len, tokens)),
            "prompt_tokens": sum(p for _, p in episodes), "stats": stats}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="data/demo.db", help="a demo database (built as the demo inbox if missing)")
    parser.add_argument("--checkpoint", help="a LoRA checkpoint directory to serve (default: the base model)")
    parser.add_argument("--agent", metavar="CHECKPOINT", help="play real evaluation episodes of this LoRA "
                                                             "checkpoint directory instead of scripted ones")
    parser.add_argument("--questions", type=int, default=16, help="test questions played with --agent")
    parser.add_argument("--rounds", type=int, default=1, help="repeat all configurations, interleaved")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, the first is the reference (default: all of {', '.join(CONFIGURATIONS)})")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    if not Path(args.db).exists():  # the demo inbox is made, not downloaded: build it as `train --demo` does
        from email_agent import build

        emails, question_rows, source, total = build.open_sources(demo=True, emails=None, questions=None)
        build.build_database(emails, question_rows, args.db, source=source, total=total, progress=False)
    db = EmailDB(args.db)
    questions = select_questions(db, "test", seed=0, limit=args.questions) if args.agent else \
        select_questions(db, "test", seed=0, limit=EPISODES)
    scripts = [scripted_tool_results(db, q) for q in questions]
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.2f}")
    if args.agent:
        print(f"evaluation episodes: {len(questions)} test questions, {EPISODES} at once, greedy, checkpoint {args.agent}")
    else:
        print(f"{EPISODES} episodes at once, {TURNS} turns each, greedy, max_tokens {MAX_TOKENS}, "
              f"model: {args.checkpoint or 'base SmolLM2-135M'}")
    reference = None
    chosen = [CONFIGURATIONS[name] for name in args.configurations.split(",")]
    for round_ in range(args.rounds):
        for configuration in chosen:
            result = await run(configuration, args.checkpoint, questions, scripts, args.agent, db)
            reference = reference or result["tokens"]
            same = sum(a == b for a, b in zip(result["tokens"], reference))
            print(f"[round {round_ + 1}] {configuration[0]}: {result['seconds']:6.1f}s, "
                  f"{result['seconds'] / len(questions):5.2f} s/episode, {result['generated'] / result['seconds']:5.1f} "
                  f"generated tokens/s ({result['generated']} tokens; {result['prompt_tokens']} prompt tokens "
                  f"over {len(result['tokens'])} {'episodes' if args.agent else 'requests'}); greedy agreement "
                  f"{same}/{len(reference)}{', correct answers ' + str(result['correct']) if args.agent else ''}, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            stats = result["stats"]
            print(f"    decode forwards {stats['forwards']}, {stats['tokens'] / max(stats['row_forwards'], 1):.2f} "
                  f"tokens per row and forward; draft tokens accepted {stats['accepted']}/{stats['drafted']}; "
                  f"cache compactions {stats['compactions']}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
