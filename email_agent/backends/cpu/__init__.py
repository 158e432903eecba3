"""CPU backend for ART: trains a LoRA on the CPU and serves it with vLLM, with no GPU or unsloth.

Modules, in the order data flows through them:
  model        base model loading (SmolLM2 GGUF or a local directory), the tool chat template, the folder vLLM loads
  tool_tags    the <tool_call> tags' rows: a folder whose rows are untrained is refused, a GGUF's given a start
  checkpoints  atomic save and exact resume in LocalBackend's layout (peft adapters vLLM loads as they are)
  trainer      the GRPO/SFT math over ART's tokenizer, packer and loss
  backend      `CPUBackend`, ART's Backend protocol: this trainer, and a vLLM server (`backends.vllm_server`)
"""

from email_agent.backends.cpu.backend import CPUBackend
from email_agent.backends.cpu.checkpoints import CheckpointError
from email_agent.backends.cpu.model import (TOOL_CHAT_TEMPLATE, find_base_model, gguf_tokenizer, load_base_model,
                                            served_model_dir)

__all__ = ["CPUBackend", "CheckpointError", "TOOL_CHAT_TEMPLATE", "find_base_model", "gguf_tokenizer",
           "load_base_model", "served_model_dir"]
