"""More of ART 0.5.18's real GPU stack, run on the CPU: the warm start through LocalBackend's own `_train_sft`
(ART's `tokenize_sft_batch` with unsloth_zoo's real response masking), and the unsloth service ART moves to a
child process, pickled and rebuilt in a fresh interpreter as `spawn` does.

Only `unsloth` itself is stood in for (it refuses to import without a GPU; ART's SFT tokenizer imports it just to
set an environment variable), and unsloth_zoo's package `__init__`, which checks for a GPU, is skipped: its
`dataset_utils` runs as it is. unsloth-zoo is installed without its dependencies (requirements-model.txt).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import os
import pickle
import subprocess
import sys
import types

import art
import pytest

from conftest import ROOT
from email_agent import backends
from email_agent.training import training_data
from email_agent.data import questions as qmod
from email_agent.backends import readiness
from email_agent.agent.episode import Episode
from email_agent.agent.demonstrations import expert_trajectories
from email_agent.training.warm_start import fine_tune

import train_email_search_agent as cli
from art_doubles import GPUService, on_a_gpu_machine


@pytest.fixture
def unsloth_zoo_without_a_gpu(monkeypatch):
    spec = importlib.util.find_spec("unsloth_zoo")
    assert spec is not None, "unsloth-zoo is installed by make setup (requirements-model.txt)"
    unsloth = types.ModuleType("unsloth", "Stand-in: the real one refuses to import without a GPU.")
    unsloth.__spec__ = importlib.machinery.ModuleSpec("unsloth", None)
    package = types.ModuleType("unsloth_zoo")
    package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
    monkeypatch.setitem(sys.modules, "unsloth", unsloth)
    monkeypatch.setitem(sys.modules, "unsloth_zoo", package)
    yield
    for name in [name for name in sys.modules if name.startswith("unsloth_zoo.")]:
        del sys.modules[name]


def test_the_warm_start_through_art_s_local_backend_trains_exactly_the_assistant_turns(
        monkeypatch, tmp_path, demo_db, qwen25_model_dir, unsloth_zoo_without_a_gpu):
    """`train`'s warm start (warm_start.fine_tune) on a GPU run: ART's LocalBackend tokenizes each episode with the
    model's template and masks it with unsloth_zoo's train_on_responses_only. What it trains must be each
    assistant turn (a tool call the agent's parser reads) and nothing the tools or the user said."""
    questions = qmod.select_questions(demo_db, "train", seed=0)[:4]
    episodes = asyncio.run(expert_trajectories(demo_db, questions, Episode()))
    cfg = cli.TrainConfig(base_model=str(qwen25_model_dir), sft_from="expert", sft_batch_size=2,
                          sft_schedule="constant", art_dir=str(tmp_path))
    with on_a_gpu_machine(monkeypatch, scripts={}):
        backend = backends.make_backend("local", cfg)
        model = art.TrainableModel(name="warm", project="p", base_model=cfg.base_model, base_path=str(tmp_path),
                                   _internal_config=backends.internal_config(cfg))

        async def go():
            await model.register(backend)
            form = training_data.argument_form(backends.LOCAL.tokenizer(backend, cfg.base_model).chat_template)
            await fine_tune(cfg, model, training_data.for_sft(episodes, form))
            return await model.get_step()

        assert asyncio.run(go()) == 1  # one epoch, one checkpoint
        (service,) = GPUService.made
    tokenizer = backend._tokenizers[next(iter(backend._tokenizers))]
    batches = service.sft_batches
    assert [b.num_trajectories for b in batches] == [2] * (len(episodes) // 2) + [1] * (len(episodes) % 2)
    for batch in batches:
        for tensors in batch.trajectory_tensors:
            ids, labels = tensors["input_ids"][0].tolist(), tensors["labels"][0].tolist()
            text = tokenizer.decode(ids)
            trained = [i for i, label in zip(ids, labels) if label != -100]
            assert trained == [label for label in labels if label != -100]  # labels are the ids themselves
            spans = text.split("<|im_start|>assistant")[1:]
            replies = [span.split("<|im_end|>")[0] + "<|im_end|>" for span in spans]
            # unsloth's masking starts right after "<|im_start|>assistant" (the newline is trained, an off-by-one
            # of its own) and ends after the newline that follows <|im_end|>
            assert tokenizer.decode(trained) == "".join(reply + "\n" for reply in replies)
            assert (all("<tool_call>" in reply for reply in replies)
                    and "<tool_response>" not in tokenizer.decode(trained))


CHILD = """
import pickle, sys
service = pickle.loads(sys.stdin.buffer.read())
loaded = sorted(m for m in sys.modules if m.startswith("art.megatron") or m.split(".")[0] in ("unsloth", "unsloth_zoo"))
print(type(service).__name__, service.base_model, service.config["engine_args"]["max_lora_rank"],
      service.config["peft_args"]["r"], loaded)
"""


def test_art_s_unsloth_service_pickles_into_a_fresh_interpreter(tmp_path):
    """LocalBackend moves its UnslothService to a child process ("model-service", started with spawn): the
    service, built from this project's settings as ART's _get_service builds it, must pickle, and unpickle in an
    interpreter that has imported nothing, without ART's megatron import (which the guard stands in for only in
    the parent) and without unsloth."""
    readiness.allow_art_without_megatron()
    from art.dev.get_model_config import get_model_config
    from art.dev.validate import is_dedicated_mode, validate_dedicated_config
    from art.unsloth.service import UnslothService

    cfg = cli.TrainConfig(lora_rank=32)
    config = get_model_config(base_model="Qwen/Qwen2.5-7B-Instruct", output_dir=str(tmp_path),
                              config=backends.internal_config(cfg))
    validate_dedicated_config(config)
    assert not is_dedicated_mode(config)  # shared mode: the one move_to_child_process serves
    service = UnslothService(model_name="agent", base_model="Qwen/Qwen2.5-7B-Instruct", config=config,
                             output_dir=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", CHILD], input=pickle.dumps(service), capture_output=True,
                           cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "IMPORT_UNSLOTH"}, timeout=300)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().split() == ["UnslothService", "Qwen/Qwen2.5-7B-Instruct", "32", "32", "[]"]
