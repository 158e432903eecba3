"""`export`: a run's checkpoint as a PEFT LoRA folder, a merged transformers folder and a GGUF, each loadable by
another runtime and each the same model as peft's LoRA on the base (greedy tokens compared on real agent prompts);
and every refusal (unknown run or step, damaged checkpoint, an output folder in use, a format the run cannot
have) before anything loads, leaving nothing behind.

The slow tests load SmolLM2 and write a LoRA with deterministic non-zero weights through the CPU backend's own
checkpoint writer; the GPU path's merge runs on a tiny randomly initialised Qwen2 built here."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import train_email_search_agent as cli
from conftest import QWEN_STYLE_TEMPLATE
from email_agent.errors import UserError
from email_agent.apps.export import export, rope_permute
from email_agent.data.questions import select_questions
from email_agent.agent.rollout import SYSTEM_PROMPT
from email_agent.agent.tools import TOOLS, Inbox, call_tool

LIMITS = {"max_turns": 4, "max_tokens": 64, "max_body_chars": 600, "search_results": 3}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_run(art_dir: Path, name: str, backend: str, base_model: str, steps=(), **config) -> Path:
    folder = art_dir / "email-agent" / "models" / name
    folder.mkdir(parents=True)
    (folder / "run_config.json").write_text(json.dumps(
        {"backend": backend, "base_model": base_model, "lora_rank": 8, "lora_alpha": 16, "episode": LIMITS, **config}))
    for step in steps:
        write_fake_adapter(folder / "checkpoints" / f"{step:04d}")
    return folder


def write_fake_adapter(folder: Path, base: str = "unsloth/qwen2.5-0.5b-instruct-unsloth-bnb-4bit") -> None:
    """A checkpoint in ART LocalBackend's layout (HF Trainer's save_model of a PEFT model), small weights."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": LORA_TARGETS, "task_type": "CAUSAL_LM",
         "base_model_name_or_path": base}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.arange(16.).reshape(8, 2)},
              folder / "adapter_model.safetensors")
    (folder / "training_args.bin").write_bytes(b"ART's trainer state")


# ---- refusals, before anything loads ---------------------------------------------------------------------

def test_unknown_run_or_step_is_one_sentence(tmp_path):
    make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-7B-Instruct", steps=(2, 5))
    with pytest.raises(UserError, match=r"'nope' is not a training run .*runs there: qwen"):
        export("nope", "lora", tmp_path / "out", art_dir=str(tmp_path))
    with pytest.raises(UserError, match=r"no checkpoint '3'; it has 2, 5"):
        export("qwen@3", "lora", tmp_path / "out", art_dir=str(tmp_path))
    for spec in ("qwen@", "qwen@x"):
        with pytest.raises(UserError, match="step"):
            export(spec, "lora", tmp_path / "out", art_dir=str(tmp_path))
    with pytest.raises(UserError, match="choose one of lora, merged, gguf"):
        export("qwen", "onnx", tmp_path / "out", art_dir=str(tmp_path))
    assert not (tmp_path / "out").exists()


def test_damaged_or_incomplete_checkpoints_are_refused(tmp_path):
    run = make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-7B-Instruct", steps=(1, 2, 3))
    (run / "checkpoints" / "0001" / "adapter_model.safetensors").unlink()
    weights = run / "checkpoints" / "0002" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # a copy cut short
    (run / "checkpoints" / "0003" / "adapter_config.json").write_text("{not json")
    with pytest.raises(UserError, match="has no adapter_model.safetensors: it is incomplete"):
        export("qwen@1", "lora", tmp_path / "out", art_dir=str(tmp_path))
    for step in (2, 3):
        with pytest.raises(UserError, match=f"checkpoint .*000{step} is damaged"):
            export(f"qwen@{step}", "lora", tmp_path / "out", art_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["email-agent"]


def test_formats_and_flags_a_run_cannot_have_are_refused(tmp_path):
    make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-7B-Instruct", steps=(1,))
    make_run(tmp_path, "mine", "cpu", str(tmp_path), steps=(1,))  # a CPU run on a local transformers folder
    make_run(tmp_path, "cloud", "serverless", "OpenPipe/Qwen3-14B-Instruct")
    for spec in ("qwen", "mine"):
        with pytest.raises(UserError, match="not a GGUF the CPU backend loads.*--format merged.*convert_hf_to_gguf.py"):
            export(spec, "gguf", tmp_path / "out", art_dir=str(tmp_path))
    with pytest.raises(UserError, match="--base-model is for runs trained on a GPU"):
        export("mine", "merged", tmp_path / "out", art_dir=str(tmp_path), base_model=str(tmp_path))
    with pytest.raises(UserError, match="--base-model .*not a folder"):
        export("qwen", "merged", tmp_path / "out", art_dir=str(tmp_path), base_model=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="serverless backend, which keeps its checkpoints with the service"):
        export("cloud", "lora", tmp_path / "out", art_dir=str(tmp_path))


def test_an_output_in_use_is_refused_and_force_moves_it_aside(tmp_path):
    run = make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-7B-Instruct", steps=(1,))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not empty; .*--force"):
        export("qwen", "lora", out, art_dir=str(tmp_path))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        export("qwen", "lora", tmp_path / "file", art_dir=str(tmp_path))

    export("qwen", "lora", out, art_dir=str(tmp_path), force=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.old-")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "mine"  # moved, not deleted
    assert (out / "adapter_model.safetensors").read_bytes() == \
        (run / "checkpoints" / "0001" / "adapter_model.safetensors").read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    export("qwen", "lora", empty, art_dir=str(tmp_path))  # an empty folder is used as it is
    assert (empty / "README.md").exists()


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    from email_agent.apps import export as module

    make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-7B-Instruct", steps=(1,))

    def full_disk(run, checkpoint, folder):
        (folder / "adapter_config.json").write_text("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_lora", full_disk)
    with pytest.raises(OSError):
        export("qwen", "lora", tmp_path / "out", art_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["email-agent"]  # no output, no temporary folder


def test_a_qwen_cpu_run_is_not_exported_as_an_adapter_for_the_hubs_base(tmp_path, capsys):
    make_run(tmp_path, "q", "cpu", "qwen2.5-0.5b", steps=(1,))
    assert cli.main(["export", "--model", "q", "--format", "lora", "--output", str(tmp_path / "out"), "--art-dir",
                     str(tmp_path), "--quiet"]) == 1
    error = capsys.readouterr().err
    assert "untrained <tool_call> rows" in error and "--format merged or --format gguf" in error
    assert not (tmp_path / "out").exists()


def test_gpu_run_lora_is_the_adapter_with_a_readme_for_vllm(tmp_path, capsys):
    run = make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-7B-Instruct", steps=(1, 2),
                   episode={**LIMITS, "max_turns": 7})
    out = tmp_path / "export"
    assert cli.main(["export", "--model", "qwen@1", "--format", "lora", "--output", str(out), "--art-dir",
                     str(tmp_path), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen2.5-7B-Instruct" and config["r"] == 8
    source = load_file(run / "checkpoints" / "0001" / "adapter_model.safetensors")
    assert torch.equal(load_file(out / "adapter_model.safetensors")[next(iter(source))], next(iter(source.values())))
    readme = (out / "README.md").read_text()
    assert (f"vllm serve Qwen/Qwen2.5-7B-Instruct --enable-lora --max-lora-rank 16 --lora-modules "
            f"agent={out.resolve()} --enable-auto-tool-choice --tool-call-parser hermes\n") in readme
    assert "You have up to 7 turns." in readme and "{inbox}" in readme  # the run's limits; the per-question blanks
    assert json.dumps(TOOLS, indent=2) in readme
    assert "dequantized" not in readme  # the GGUF caveat is for CPU runs

    assert cli.main(["export", "--model", "nope", "--format", "lora", "--output", str(tmp_path / "x"),
                     "--art-dir", str(tmp_path), "--quiet"]) == 1
    assert capsys.readouterr().err.startswith("Error: --model 'nope' is not a training run")


def test_rope_permute_is_what_transformers_gguf_loader_reverses():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = torch.randn(6 * 8, 5).numpy()
    processor = LlamaTensorProcessor(config={"num_attention_heads": 6, "num_key_value_heads": 2})
    for name, heads in (("blk.0.attn_q.weight", 6), ("blk.0.attn_k.weight", 2)):
        permuted = rope_permute(weights, heads)
        assert not (permuted == weights).all()
        assert (processor.process(permuted, name).weights == weights).all()


# ---- a GPU run's merge, on a tiny Qwen2 built here ------------------------------------------------------

def tiny_qwen2(folder: Path) -> None:
    """A randomly initialised Qwen2 (the GPU path's family) with a word-level tokenizer and a Qwen2.5-style
    tool template: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<unk>", "<|im_start|>", "<|im_end|>", *"system user assistant tool hello inbox search".split()]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE.read_text()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(words), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_gpu_run_merges_its_lora_into_the_base_with_peft(tmp_path, monkeypatch):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "qwen-base"
    tiny_qwen2(base)
    run = make_run(tmp_path, "qwen", "local", "Qwen/Qwen2.5-0.5B-Instruct")
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                          LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    peft.save_pretrained(run / "checkpoints" / "0004")

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no Hugging Face, without its retries
    with pytest.raises(UserError, match="cannot load the base model Qwen/Qwen2.5-0.5B-Instruct: it is neither in the "
                                        "Hugging Face cache.*--base-model"):
        export("qwen", "merged", tmp_path / "out", art_dir=str(tmp_path))
    assert not (tmp_path / "out").exists()

    out = export("qwen", "merged", tmp_path / "out", art_dir=str(tmp_path), base_model=str(base))
    merged = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == QWEN_STYLE_TEMPLATE.read_text()
    ids = torch.tensor([tokenizer.encode("<|im_start|> user hello inbox search <|im_end|> <|im_start|> assistant")])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "checkpoints" / "0004")
        expected = adapted(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(ids).logits
        got = merged(ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-2)  # the LoRA changes the model: the merge is not a no-op


# ---- CPU runs: the three formats against peft's LoRA on the base, on real agent prompts ------------------

@pytest.fixture(scope="module")
def one_thread():
    """transformers on one thread (on a busy 2-core machine a second OpenMP thread makes a 700-token prompt's
    greedy decoding several times slower, not faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """A CPU run whose checkpoint 3 holds a LoRA with deterministic non-zero weights, written by the CPU
    backend's own checkpoint writer."""
    from peft import LoraConfig, get_peft_model

    from email_agent.backends.cpu import load_base_model
    from email_agent.backends.cpu.checkpoints import save_checkpoint
    from email_agent.backends.cpu.trainer import new_optimizer

    art_dir = tmp_path_factory.mktemp("art")
    run = make_run(art_dir, "agent", "cpu", "HuggingFaceTB/SmolLM2-135M-Instruct")
    base, _ = load_base_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    save_checkpoint(str(run), 3, peft, new_optimizer(peft, 0.1), seed=0,
                    train_rng=torch.Generator().manual_seed(0).get_state(), sampling_rng=random.Random(0), mode="rl")
    return art_dir


def agent_prompts(db) -> list[list[dict]]:
    """Three prompts as rollouts send them: two first turns, and a second turn after a real search."""
    questions = select_questions(db, "test", seed=0, limit=3)
    prompts = []
    for question in questions:
        system = SYSTEM_PROMPT.format(inbox=question.inbox_address, today=question.query_date, max_turns=4)
        prompts.append([{"role": "system", "content": system}, {"role": "user", "content": question.question}])
    last = questions[-1]
    inbox = Inbox(db, last.inbox_address, last.query_date, max_body_chars=600, default_max_results=3)
    arguments = json.dumps({"keywords": last.question.split()[2:4]})
    result = call_tool(inbox, "search_inbox", arguments)
    prompts[-1] += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "search_inbox", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": result.content}]
    return prompts


def lora_tokens(base_model: str, checkpoint, prompts, n: int) -> list[list[int]]:
    """The first n greedy tokens of each prompt from peft's (unmerged) LoRA of `checkpoint` on the float32 base, as
    the trainer computes it (or from the base alone)."""
    from peft import PeftModel

    from email_agent.backends.cpu import load_base_model

    base, tokenizer = load_base_model(base_model)
    model = PeftModel.from_pretrained(base, str(checkpoint)) if checkpoint else base
    model.eval()
    return [greedy(model, tokenizer.apply_chat_template(m, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False), n) for m in prompts]


def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=2, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def served(cpu_run, demo_db, one_thread):
    """(agent prompts, the first 20 greedy tokens of each from the run's checkpoint: peft's LoRA on the base)."""
    prompts = agent_prompts(demo_db)
    checkpoint = cpu_run / "email-agent" / "models" / "agent" / "checkpoints" / "0003"
    return prompts, lora_tokens("HuggingFaceTB/SmolLM2-135M-Instruct", checkpoint, prompts, 20)


@pytest.mark.slow
def test_merged_and_gguf_exports_give_the_loras_greedy_tokens(cpu_run, served, tmp_path):
    """The exact tokens, 20 per prompt, of a LoRA that changes them."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE

    prompts, served = served
    untrained = lora_tokens("HuggingFaceTB/SmolLM2-135M-Instruct", None, prompts, 20)
    assert served != untrained  # the LoRA changes what the agent says, so agreement below means something

    merged_dir = export("agent", "merged", tmp_path / "merged", art_dir=str(cpu_run))
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert tokenizer.chat_template == TOOL_CHAT_TEMPLATE
    prompt_ids = [tokenizer.apply_chat_template(m, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                return_dict=False) for m in prompts]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert [greedy(merged, ids, 20) for ids in prompt_ids] == served
    del merged

    gguf_dir = export("agent@3", "gguf", tmp_path / "gguf", art_dir=str(cpu_run))
    reader = gguf.GGUFReader(gguf_dir / "model.gguf")
    assert reader.fields["tokenizer.chat_template"].contents() == TOOL_CHAT_TEMPLATE
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    del reader
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="model.gguf", dtype=torch.float32)
    assert [greedy(from_gguf, ids, 20) for ids in prompt_ids] == served
    readme = (gguf_dir / "README.md").read_text()
    assert "llama-server -m" in readme and "dequantized to float32" in readme


@pytest.mark.slow
def test_lora_export_loads_with_peft_and_says_which_base(cpu_run, served, tmp_path):
    """The exported adapter, loaded by peft on the base, gives the checkpoint's tokens."""
    from peft import PeftModel

    from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE, load_base_model

    prompts, served = served
    out = export("agent", "lora", tmp_path / "lora", art_dir=str(cpu_run))
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (out / "chat_template.jinja").read_text() == TOOL_CHAT_TEMPLATE  # SmolLM2's own has no tools
    readme = (out / "README.md").read_text()
    assert f"--chat-template {out.resolve()}/chat_template.jinja" in readme and "prefer them" in readme

    base, tokenizer = load_base_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    ids = [tokenizer.apply_chat_template(m, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                         return_dict=False) for m in prompts]
    adapted = PeftModel.from_pretrained(base, out)
    assert [greedy(adapted, i, 20) for i in ids] == served
