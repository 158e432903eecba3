"""The hermes tool-call tags as rows of a model's weights (backends/cpu/tool_tags.py), on Qwen2.5's real vocabulary:
a folder whose two tag rows are one vector (as Qwen2.5-Coder-0.5B-Instruct's are) is refused before a run, and a
GGUF's conversion gives such rows a start a LoRA can learn from."""

from __future__ import annotations

import shutil

import pytest
import torch

SIBLINGS = range(151646, 151659)  # <|object_ref_start|> .. </tool_call>: one shared row in Qwen2.5-Coder-0.5B


def tiny_qwen2_on_qwen25_vocabulary(tokenizer, untrained: bool):
    """A random Qwen2 of Qwen2.5's vocabulary and untied output layer, whose tag rows, if `untrained`, are the one
    row they share with eleven never-written special tokens, as in the Coder GGUF."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False))
    if untrained:
        with torch.no_grad():
            for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
                weight[list(SIBLINGS)] = weight[SIBLINGS.start] + 1e-4 * torch.randn(len(SIBLINGS), 32)
    return model


@pytest.mark.parametrize("untrained", [True, False])
def test_a_folder_whose_tool_call_rows_are_one_vector_is_refused_before_a_run(qwen25_model_dir, qwen25_tokenizer,
                                                                              tmp_path, untrained):
    from email_agent.backends.cpu.model import check_base_model
    from email_agent.errors import UserError

    folder = tmp_path / "model"
    shutil.copytree(qwen25_model_dir, folder)
    tiny_qwen2_on_qwen25_vocabulary(qwen25_tokenizer, untrained).save_pretrained(folder)
    if untrained:
        with pytest.raises(UserError, match=r"cannot write a tool call: .*<tool_call> and </tool_call> are one vector"):
            check_base_model(str(folder))
    else:
        check_base_model(str(folder))  # trained rows: accepted


def test_untrained_tags_start_from_their_spelling_and_can_outscore_it(qwen25_tokenizer):
    from email_agent.backends.cpu import tool_tags

    model = tiny_qwen2_on_qwen25_vocabulary(qwen25_tokenizer, untrained=True)
    inputs, outputs = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    before = outputs.detach().clone()
    assert tool_tags.give_tool_tags_a_start(model, qwen25_tokenizer) == ["<tool_call>", "</tool_call>"]
    opening, closing = 151657, 151658
    spelled = {opening: [27, 14172, 13429, 29], closing: [522, 14172, 13429, 29]}  # "<" "tool" "_call" ">", "</" ...
    for tag, pieces in spelled.items():
        assert torch.allclose(inputs[tag], inputs[pieces].mean(dim=0))  # read as the text that spells it
        own = outputs[tag] - outputs[pieces[0]]
        assert torch.isclose(own.norm(), outputs[pieces[0]].norm() / 2, rtol=1e-4)
    assert not tool_tags.untrained_tool_tags(outputs[[opening, closing]])
    # only the two tags moved: the other eleven siblings and every other row are as they were
    changed = (outputs.detach() != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [opening, closing]
    # the tag outscores its first piece ("<") wherever the hidden state leans on the tag's own component: a
    # mean of the pieces' output rows could never outscore the likeliest piece
    hidden = outputs[27] + 3 * (outputs[opening] - outputs[27])
    scores = outputs.detach() @ hidden.detach()
    assert scores[opening] > scores[27]
    # and a model whose tags are already trained is left alone
    trained = tiny_qwen2_on_qwen25_vocabulary(qwen25_tokenizer, untrained=False)
    assert tool_tags.give_tool_tags_a_start(trained, qwen25_tokenizer) == []


def test_a_vocabulary_without_tag_tokens_writes_them_as_text(smollm2_tokenizer):
    from email_agent.backends.cpu import tool_tags

    assert tool_tags.tag_ids(smollm2_tokenizer) is None
