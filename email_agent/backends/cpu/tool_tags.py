"""The hermes tool-call tags a model writes, `<tool_call>` and `</tool_call>`, as rows of its weights: whether its
output layer can tell them apart, and a start a LoRA can learn them from where it cannot.

Qwen2.5's vocabulary has each tag as one added token, and vLLM's hermes parser reads a call only between them. In
Qwen2.5-Coder-0.5B-Instruct the two tags' output rows are one vector, shared with eleven special tokens that a
text model never writes (<|vision_pad|>, <|box_start|>, ...): rows never trained. The model then cannot write a
call: a LoRA on the layers below the output (ART's targets) raises all thirteen tokens together, so a tag can never
be likelier than one in thirteen (bench/RESULTS.md, "Why Qwen2.5-Coder-0.5B wrote no call"). A GGUF's conversion
gives such rows a learnable start (`give_tool_tags_a_start`); a local folder that has them is refused before a run
(`untrained_tool_tags`), since vLLM serves that folder as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
# Rows closer than this, relative to the row's norm, are one vector: the two tags' rows in Qwen2.5-Coder-0.5B are
# 0.0017 apart (the GGUF's quantisation noise), two trained tokens' rows 0.8 or more.
SAME_ROW = 0.1


def tag_ids(tokenizer) -> list[int] | None:
    """The tags' token ids, if each tag is one token of `tokenizer`'s vocabulary (else None: the model writes the
    tags as ordinary text, whose pieces are trained)."""
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in TOOL_CALL_TAGS]
    return ids if all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids) else None


def untrained_tool_tags(output_rows: torch.Tensor) -> bool:
    """Whether `output_rows` (the output layer's rows of `tag_ids`, in order) are one vector: a model that cannot
    write a tool call the hermes parser reads, whatever its LoRA learns."""
    opening, closing = output_rows.float()
    return bool((opening - closing).norm() < SAME_ROW * opening.norm())


def folder_tag_rows(folder: Path, ids: list[int]) -> torch.Tensor | None:
    """The output rows of `ids` in a local transformers folder's safetensors, read without loading the rest (a
    tied model's output rows are its input embeddings). None if the folder holds no safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        file = folder / where[name] if where and name in where else folder / "model.safetensors"
        if not file.is_file():
            continue
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                rows = f.get_slice(name)
                return torch.stack([rows[i] for i in ids])
    return None


def give_tool_tags_a_start(model, tokenizer, seed: int = 0) -> list[str]:
    """Where the tags' output rows are one vector (`untrained_tool_tags`), give each tag rows a LoRA can learn
    from, in place, and return the tags changed. Its input row becomes the mean of the input rows of the text
    pieces that spell it ("<", "tool", "_call", ">"), so the model reads the tag as that text. Its output row
    becomes the output row of its first piece ("<", "</") plus a seeded component of its own, half that row's
    norm, so the tag starts about as likely as the text that begins it, and a LoRA can raise the tag alone
    (a mean of the pieces' output rows could never outscore the likeliest piece)."""
    ids = tag_ids(tokenizer)
    inputs, outputs = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if ids is None or not untrained_tool_tags(outputs[ids].detach()):
        return []
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tag, i in zip(TOOL_CALL_TAGS, ids):
            pieces = [piece.id for piece in tokenizer.backend_tokenizer.model.tokenize(tag)]
            if inputs is not outputs:  # (tied: the one row takes the output's start, which reading needs less)
                inputs[i] = inputs[pieces].mean(dim=0)
            own = torch.randn(outputs.shape[1], generator=generator, dtype=outputs.dtype)
            outputs[i] = outputs[pieces[0]] + own / own.norm() * outputs[pieces[0]].norm() / 2
    return list(TOOL_CALL_TAGS)


def describe_untrained(name: str) -> str:
    """The one-sentence refusal of a local folder whose tags are untrained."""
    return (f"Base model {name!r} cannot write a tool call: its output layer's rows for <tool_call> and "
            "</tool_call> are one vector (never trained, as in Qwen2.5-Coder-0.5B-Instruct), so no LoRA can make "
            "it write the tags vLLM's hermes parser reads; use a model trained for tool calls (Qwen2.5-Instruct), "
            "or --base-model qwen2.5-0.5b, whose conversion gives the tags a learnable start.")
