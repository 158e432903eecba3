"""The GPU memory estimate's log-prob term is ART 0.5.18's own: its trainer's `_calculate_logprobs`, run on the CPU,
keeps for backward what `readiness.logprob_saved_bytes` counts.

`art/unsloth/train.py` imports trl and unsloth (which refuses to load without a GPU), so the function is taken from
the installed file's source alone; it needs nothing but torch. What autograd saves is counted with saved-tensor
hooks, once per storage. Small vocabularies stand in for Qwen's 151,936: the count is linear in the vocabulary and
the estimate scales it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from email_agent.backends import readiness

TRAIN_PY = Path(importlib.util.find_spec("art").submodule_search_locations[0]) / "unsloth" / "train.py"


def art_calculate_logprobs():
    source = TRAIN_PY.read_text()
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_calculate_logprobs"]
    namespace = {"torch": torch}
    exec(compile(ast.Module([node], []), str(TRAIN_PY), "exec"), namespace)
    return namespace["_calculate_logprobs"]


def saved_bytes(fn, *args) -> tuple[object, int, set[int]]:
    """(fn's result, bytes of the distinct storages autograd saved while computing it, their data pointers)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn(*args)
    return result, sum(storages.values()), set(storages)


@pytest.mark.parametrize("dtype, vocab, positions", [(torch.bfloat16, 4096, 1024), (torch.bfloat16, 8192, 2048),
                                                     (torch.float32, 4096, 2048)])
def test_art_keeps_what_the_estimate_counts_per_packed_position(dtype, vocab, positions):
    calculate = art_calculate_logprobs()
    hidden = 32
    head = torch.randn(vocab, hidden, dtype=dtype)  # the LM head: frozen under LoRA
    states = torch.randn(1, positions, hidden, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (1, positions))
    (logprobs, entropy), total, pointers = saved_bytes(calculate, head.t(), states, targets, readiness.LOGPROB_CHUNK)
    weight = head.untyped_storage().nbytes() if head.untyped_storage().data_ptr() in pointers else 0
    dtype_bytes = torch.finfo(dtype).bits // 8
    assert total - weight == readiness.logprob_saved_bytes(vocab, positions, dtype_bytes)
    logprobs.sum().backward()  # what the bytes are kept for
    assert states.grad is not None and torch.isfinite(states.grad.float()).all()


def test_the_saved_bytes_do_not_shrink_with_the_chunk_size():
    """Every chunk's tensors stay until backward: a smaller logprob_calculation_chunk_size saves no memory."""
    calculate = art_calculate_logprobs()
    head = torch.randn(2048, 16, dtype=torch.bfloat16)
    states = torch.randn(1, 2048, 16, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 2048, (1, 2048))
    totals = {chunk: saved_bytes(calculate, head.t(), states, targets, chunk)[1] for chunk in (256, 1024, 2048)}
    assert len(set(totals.values())) == 1, totals


def test_qwen_s_log_probs_take_about_1_16_gib_per_1024_positions_and_the_7b_trainer_most_of_a_24_gb_card():
    assert readiness.logprob_saved_bytes(151936, 1024) / readiness.GiB == pytest.approx(1.159, abs=0.001)
    trainer = readiness.estimate(readiness.QWEN2_5["Qwen/Qwen2.5-7B-Instruct"], 23.6, gpu_memory_utilization=0.8,
                           max_seq_length=8192, enforce_eager=False).trainer
    assert 19.5 < trainer < 21.0  # 9.3 GiB of it the log-probs' saved tensors
