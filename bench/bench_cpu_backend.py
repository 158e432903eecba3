"""Throughput of the CPU backend (a script that prints figures; not a test).

(a) Trainer: trained tokens/s of `CPUBackend.train` on a fixed batch of tool-using trajectories sampled
    through the backend's vLLM server, beside two bare forward+backward loops over the same token rows
    with the same LoRA (see `bare_loops`): one doing the same model work as the trainer (shared prefix
    once, untrained segments without gradient, logits at assistant positions only), which gives the trainer's
    overhead (target: train / equal-work >= 0.7), and the plain transformers loop (all logits, whole rows),
    which gives the speed-up over the textbook approach.
(b) Server (vLLM): generated tokens/s at concurrency 1 and 8 (fixed max_tokens, ignore_eos), and the ratio.
    Target: 8 concurrent >= 3x single stream.

    .venv/bin/python bench/bench_cpu_backend.py        (~4 minutes on 2 cores)

Figures depend on what else runs on the machine: another busy process makes multi-threaded torch
stall at every barrier. The load average is printed for that reason.
"""

import argparse
import asyncio
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from email_agent.backends.cpu import CPUBackend  # (sets the offline litellm default first)
from email_agent.backends.cpu.model import inference_dtype
from email_agent.training import training_data

import art
import openai
import torch
from art.loss import shift_tensor
from transformers import DynamicCache

TOOLS = [
    {"type": "function", "function": {
        "name": "search_emails", "description": "Search the user's inbox. All keywords must match.",
        "parameters": {"type": "object", "properties": {
            "keywords": {"type": "array", "items": {"type": "string"}},
            "from_addr": {"type": "string"}, "sent_after": {"type": "string", "description": "YYYY-MM-DD"},
            "sent_before": {"type": "string", "description": "YYYY-MM-DD"}}, "required": ["keywords"]}}},
    {"type": "function", "function": {
        "name": "read_email", "description": "Read one email by its message id.",
        "parameters": {"type": "object", "properties": {"message_id": {"type": "string"}},
                       "required": ["message_id"]}}},
    {"type": "function", "function": {
        "name": "return_final_answer", "description": "Give the final answer and the message ids it rests on.",
        "parameters": {"type": "object", "properties": {
            "answer": {"type": "string"}, "sources": {"type": "array", "items": {"type": "string"}}},
            "required": ["answer", "sources"]}}},
]
SYSTEM = ("You are an email search agent. Use the tools to search the user's inbox and answer the question. "
          "You may take up to 10 turns; if a search finds nothing, try other keywords. "
          "The user's address is sally.beck@enron.com and today is 2001-05-14.")
QUESTIONS = ["When is the budget review with the trading desk?", "Who approved the new credit limits for Dynegy?",
             "What time does the Houston ops meeting start on Friday?", "Which hotel was booked for the offsite?"]
SEARCH_RESULT = json.dumps([{"message_id": f"<{1000 + i}.JavaMail.evans@thyme>",
                             "snippet": f"... the <b>budget</b> review is moved to Thursday {i + 1} pm "
                                        f"in room EB3{i}21 ... please bring the Q2 trading desk numbers and the credit "
                                        "exposure report ..."}
                            for i in range(6)])
TRAJECTORIES_PER_GROUP = 4
SAMPLED_TOKENS = 40


async def sample_trajectories(model, client) -> list[art.TrajectoryGroup]:
    async def trajectory(question: str, seed: int, reward: float) -> art.Trajectory:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        items: list = list(messages)
        for turn in range(2):
            response = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, tools=TOOLS, temperature=1.0,
                seed=seed * 10 + turn, max_tokens=SAMPLED_TOKENS, logprobs=True, extra_body={"ignore_eos": True})
            choice = response.choices[0]
            items.append(choice)
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            if turn == 0:  # a tool result, as the rollout would append after a search
                tool = {"role": "tool", "tool_call_id": "call_0", "content": SEARCH_RESULT}
                items.append(tool)
                messages.append(tool)
        return art.Trajectory(messages_and_choices=items, tools=TOOLS, reward=reward)

    groups = [art.TrajectoryGroup(trajectory(q, g * 10 + i, reward=float(i % 2 == 0) + 0.1 * i)
                                  for i in range(TRAJECTORIES_PER_GROUP)) for g, q in enumerate(QUESTIONS[:2])]
    return await art.gather_trajectory_groups(groups, pbar_desc="sample")


def bare_loops(backend, groups) -> dict[str, tuple[int, float]]:
    """Forward+backward over the rows `train` will see, with the same LoRA and threads, two ways:

    - "equal work": what the trainer computes, written with plain HF calls: a merged copy of the weights in the
      inference dtype (bfloat16 with AMX) runs the prompt prefix all rows share once, then each row's context,
      without gradient; then each row's assistant positions in one float32 pass over that context, logits only
      there. Against it, `train`'s figure measures the trainer's overhead (ART's tokenizer and loss, AdamW,
      the checkpoint).
    - "plain transformers": the textbook loop (whole row, float32, all logits). Against it, the speed-up that
      the inference dtype, the gradient-free context and the batched assistant turns buy.
    Each returns (tokens, seconds); tokens count whole rows, as `train` does.
    """
    packed, _ = backend.trainer.pack(groups, {"scale_rewards": True}, step=0)
    lengths = (packed["input_pos"].max(dim=1).values + 1).tolist()
    targets = shift_tensor(packed["assistant_mask"], False)  # position t is scored on token t+1
    rows = [(packed["tokens"][row:row + 1, :length], targets[row, :length]) for row, length in enumerate(lengths)]
    peft = backend.trainer.peft
    torch.set_num_threads(backend.train_threads)
    peft.train()

    def plain() -> None:
        for tokens, scored in rows:
            logprobs = torch.log_softmax(peft(input_ids=tokens).logits[0, :-1].float(), -1)
            picked = logprobs.gather(-1, tokens[0, 1:, None]).squeeze(-1)
            (-(picked * scored[:-1]).sum()).backward()

    # The trainer's merged copy exists before its step (the server serves it), so it is made outside the timing.
    context = copy.deepcopy(peft).merge_and_unload().to(inference_dtype()).eval()

    def equal_work() -> None:
        equal_work_pass(context, peft, rows)

    # warm-up: the first pass over new shapes builds oneDNN's kernels, which the trainer's step finds built
    equal_work()
    peft.zero_grad(set_to_none=True)
    timings = {}
    for name, loop in (("equal work", equal_work), ("plain transformers", plain)):
        started = time.monotonic()
        loop()
        timings[name] = (sum(lengths), time.monotonic() - started)
        peft.zero_grad(set_to_none=True)
    peft.eval()
    torch.set_num_threads(1)
    return timings


def equal_work_pass(context, peft, rows) -> None:
    """The trainer's computation in plain HF calls: the rows' shared prefix once and each row's context through
    the merged copy without gradient, then each row's assistant positions in one float32 pass, logits only there."""
    # The longest common prefix of all rows that ends before the first scored position.
    first = rows[0][0][0]
    shared = min(int(scored.nonzero()[0]) for _, scored in rows)
    for tokens, _ in rows[1:]:
        differ = (tokens[0, :shared] != first[:shared]).nonzero()
        shared = int(differ[0]) if len(differ) else shared
    with torch.no_grad():
        prefix = context(input_ids=first[None, :shared], use_cache=True).past_key_values
    for tokens, scored in rows:
        positions = scored.nonzero()[:, 0]
        # Each scored run (assistant turn) sees the context before it begins and its own earlier positions.
        run_of = torch.cumsum(torch.cat([torch.ones(1, dtype=torch.long), (positions.diff() > 1).long()]), 0)
        begins = positions[torch.searchsorted(run_of, run_of, right=False)]
        past = int(begins.max())
        cache = DynamicCache([(layer.keys, layer.values) for layer in prefix.layers])
        with torch.no_grad():
            context(input_ids=tokens[:, shared:past], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = DynamicCache([(layer.keys.float(), layer.values.float()) for layer in cache.layers])
        mask = torch.cat([torch.arange(past)[None, :] < begins[:, None],
                          (run_of[:, None] == run_of[None, :]) & (positions[None, :] <= positions[:, None])], 1)
        hidden = peft.get_base_model().model(input_ids=tokens[:, positions], attention_mask=mask[None, None],
                                             position_ids=positions[None], past_key_values=cache).last_hidden_state
        logprobs = torch.log_softmax(peft.get_base_model().lm_head(hidden[0]).float(), -1)
        (-logprobs.gather(-1, tokens[0, positions + 1, None]).sum()).backward()


async def server_throughput(model, client, concurrency: int, requests: int, max_tokens: int) -> float:
    async def one(i: int) -> int:
        response = await client.chat.completions.create(
            model=model.get_inference_name(), max_tokens=max_tokens, temperature=1.0, seed=i,
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], extra_body={"ignore_eos": True})
        return response.usage.completion_tokens

    started, tokens = time.monotonic(), 0
    for batch_start in range(0, requests, concurrency):
        done = await asyncio.gather(*(one(i) for i in range(batch_start, min(requests, batch_start + concurrency))))
        tokens += sum(done)
    return tokens / (time.monotonic() - started)


async def main() -> None:
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as path:
        async with CPUBackend(path=path, seed=0) as backend:
            model = art.TrainableModel(name="bench", project="bench", base_model="smollm2", report_metrics=[])
            await model.register(backend)
            client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key="x", max_retries=0)

            # (b) first, on the untrained weights the rollouts below also use.
            await server_throughput(model, client, 1, 1, 8)  # warm-up
            single = await server_throughput(model, client, 1, 2, 64)
            batched = await server_throughput(model, client, 8, 8, 64)

            started = time.monotonic()
            groups = await sample_trajectories(model, client)
            print(f"sampled {sum(len(g.trajectories) for g in groups)} tool-using trajectories "
                  f"(2 assistant turns of {SAMPLED_TOKENS} tokens each) in {time.monotonic() - started:.0f}s")
            groups = training_data.for_grpo(groups, "string")  # as the training loop hands them over
            bare = await backend.call(bare_loops, backend, groups)
            result = await backend.train(model, groups, learning_rate=1e-5)

    train_rate = result.metrics["throughput/trainer_tokens_per_s"]
    equal_rate, plain_rate = (tokens / seconds for tokens, seconds in bare.values())
    print(f"\n(a) trainer, {backend.train_threads} threads, {int(result.metrics['data/step_row_tokens'])} tokens in "
          f"{int(result.metrics['data/step_num_trained_trajectories'])} rows "
          f"({int(result.metrics['data/step_trainer_tokens'])} trained on)")
    print(f"    CPUBackend.train (whole call: tokenize, forward/backward, AdamW, checkpoint): "
          f"{train_rate:7.1f} tokens/s ({result.metrics['time/step_trainer_s']:.1f}s)")
    for name, (tokens, seconds) in bare.items():
        print(f"    bare forward+backward loop, {name}, same rows and LoRA:".ljust(84)
              + f"{tokens / seconds:7.1f} tokens/s ({seconds:.1f}s)")
    print(f"    overhead: train / equal-work loop = {train_rate / equal_rate:.2f} (target >= 0.7)")
    print(f"    speed-up: train / plain transformers loop = {train_rate / plain_rate:.2f}")
    print("\n(b) server, 64 tokens per request (ignore_eos), short chat prompt")
    print(f"    concurrency 1: {single:6.1f} tokens/s")
    print(f"    concurrency 8: {batched:6.1f} tokens/s")
    print(f"    ratio 8/1: {batched / single:.2f} (target >= 3)")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    asyncio.run(main())
