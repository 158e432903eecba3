"""CPU backend for ART: trains and serves a LoRA on the CPU with no GPU, vLLM or Unsloth.

Modules, in the order data flows through them:
  model        base model loading (SmolLM2 GGUF or a local directory), the tool chat template, decode attention
  toolcalls    parsing <tool_call> blocks out of generated text
  engine       the worker thread that owns the model: continuous batching and the prefix KV cache
  server       the OpenAI-compatible HTTP server, and `serve_checkpoint` for evaluation
  checkpoints  atomic save and exact resume in LocalBackend's layout
  trainer      the GRPO/SFT math over ART's tokenizer, packer and loss
  backend      `CPUBackend`, ART's Backend protocol over all of the above
"""

from .backend import CPUBackend
from .checkpoints import CheckpointError
from .model import TOOL_CHAT_TEMPLATE, find_base_model, load_base_model
from .server import serve_checkpoint
from .toolcalls import parse_tool_calls

__all__ = ["CPUBackend", "CheckpointError", "TOOL_CHAT_TEMPLATE", "find_base_model", "load_base_model",
           "parse_tool_calls", "serve_checkpoint"]
