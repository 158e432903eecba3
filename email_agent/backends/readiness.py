"""Can an ART backend start here, and does the model fit: checked in seconds, before anything loads.

Owns the prerequisites of ART 0.5.18's GPU and remote backends (read from its code: the wheel is what
`requirements-gpu.txt` installs), the GPU memory estimate of a local run, the default base model of each backend,
and a guard for one import bug of that ART version. `train` and its `--preflight` call `check`; the
training loop itself never comes here. Nothing in this module needs a GPU: the card is described by `GPU`.

How a local run uses the card (ART 0.5.18, `art/unsloth/service.py`, shared mode): the unsloth trainer loads a
4-bit copy of the model, moves it to host memory, then vLLM starts in a process of its own with the model in
bf16 and takes `--gpu-memory-utilization` of the card (weights, then KV cache with what is left). At each step
vLLM sleeps (weights to host memory, KV cache dropped), the trainer comes back to the GPU, trains, goes back
to host memory, and vLLM wakes. So the card must hold, at different times, vLLM's share and the trainer.
"""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2 ** 30

# A card's usable memory is a little under its nominal size (a "24 GB" RTX 4090 reports 23.6 GiB).
CARD_GIB = {24: 23.6, 40: 39.4, 80: 79.1}
NO_GPU_CARD_GB = 24  # what a local run is sized for when no GPU is found (a preflight on a laptop)
VLLM_OVERHEAD_GIB = 1.0  # vLLM's activations while profiling, sampler and CUDA context
CUDA_GRAPHS_GIB = 0.5  # graph capture, unless --enforce-eager
ASLEEP_GIB = 1.0  # a sleeping vLLM's CUDA context and graphs, beside the trainer
TRAINER_FIXED_GIB = 1.5  # the trainer's CUDA context, LoRA weights, 8-bit Adam state, allocator slack
MIN_FULL_SEQUENCES = 4  # KV cache for fewer whole-length sequences than this makes rollouts crawl
LOGPROB_SAVED_COPIES = 4  # vocabulary-wide tensors ART 0.5.18 keeps per packed position (logprob_saved_bytes)
LOGPROB_CHUNK = 1024  # ART's logprob_calculation_chunk_size: its trainer asserts the packed length divides by it
PACK_MULTIPLE = 2048  # ART 0.5.18 pads a step's packed sequences to a multiple of this (local/backend.py)
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank takes; its default is 16

# ART 0.5.18's own lists. Tinker: `art/tinker/renderers.py: get_renderer_name` (read from the installed file);
# Serverless: the models ART's training skills offer (`art/skills/train-rl/SKILL.md`); W&B checks server-side.
SERVERLESS_MODELS = ("OpenPipe/Qwen3-14B-Instruct", "Qwen/Qwen3-30B-A3B-Instruct-2507",
                     "meta-llama/Llama-3.1-8B-Instruct")
DEFAULT_MODELS = {"serverless": "OpenPipe/Qwen3-14B-Instruct", "tinker": "Qwen/Qwen3-8B"}
UV_PIN = "uv==0.13.9"
WANDB_PIN = "wandb==0.25.0"  # what ART's [backend] extra pins


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a transformer decoder depends on (from its config.json)."""

    params: float
    embedding_params: float  # input embeddings plus an untied output head: kept in 16 bits by 4-bit loading
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a transformers config (a local folder's, or the Hugging Face cache's): parameters counted from the
        layer sizes (attention, gated MLP, embeddings)."""
        hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        intermediate = config.intermediate_size
        embedding = vocab * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
        per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
        return cls(layers * per_layer + embedding, embedding, layers, kv_heads, head_dim, hidden, intermediate, vocab)


# Qwen2.5-Instruct, from each model's config.json (parameters as its model card counts them).
QWEN2_5 = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(0.49e9, 151936 * 896, 24, 2, 64, 896, 4864, 151936),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(1.54e9, 151936 * 1536, 28, 2, 128, 1536, 8960, 151936),
    "Qwen/Qwen2.5-3B-Instruct": ModelShape(3.09e9, 151936 * 2048, 36, 2, 128, 2048, 11008, 151936),
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(7.62e9, 2 * 152064 * 3584, 28, 4, 128, 3584, 18944, 152064),
    "Qwen/Qwen2.5-14B-Instruct": ModelShape(14.77e9, 2 * 152064 * 5120, 48, 8, 128, 5120, 13824, 152064),
    "Qwen/Qwen2.5-32B-Instruct": ModelShape(32.76e9, 2 * 152064 * 5120, 64, 8, 128, 5120, 27648, 152064),
}


@dataclass(frozen=True)
class GPU:
    name: str
    total_gib: float
    free_gib: float


def find_gpu() -> GPU | None:
    """The first CUDA device as torch sees it, or None."""
    try:
        # here, not at the top: torch takes ~1 s to import, and this module loads for --help
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(0)
        return GPU(torch.cuda.get_device_name(0), total / GiB, free / GiB)
    except Exception:  # noqa: BLE001 (a broken driver is "no GPU" here; the check says so)
        return None


def model_shape(base_model: str) -> ModelShape | None:
    """The model's sizes: Qwen2.5's are known; others are read from their config.json if it is at hand."""
    if base_model in QWEN2_5:
        return QWEN2_5[base_model]
    try:
        # here, not at the top: transformers takes ~2 s to import (torch), and this module loads for --help
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(base_model))
    except Exception:  # noqa: BLE001 (offline, gated or not a causal LM: the estimate is skipped and says so)
        return None


@dataclass(frozen=True)
class Estimate:
    """GiB a local run needs, in each of its two phases."""

    weights_bf16: float  # vLLM's copy
    kv_per_sequence: float  # KV cache of one --max-seq-length sequence
    vllm_need: float  # weights + KV for MIN_FULL_SEQUENCES sequences + overhead: vLLM's share must hold it
    vllm_share: float  # --gpu-memory-utilization of the card
    trainer: float  # while training: 4-bit weights, activations, a sleeping vLLM beside it
    host: float  # host memory for the sleeping vLLM's weights and the parked trainer

    def fits(self, card_gib: float) -> bool:
        return self.vllm_need <= self.vllm_share and self.trainer <= card_gib


def estimate(shape: ModelShape, card_gib: float, *, gpu_memory_utilization: float, max_seq_length: int,
             enforce_eager: bool) -> Estimate:
    weights = shape.params * 2 / GiB
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * max_seq_length / GiB
    vllm_need = weights + MIN_FULL_SEQUENCES * kv + VLLM_OVERHEAD_GIB + (0 if enforce_eager else CUDA_GRAPHS_GIB)
    four_bit = four_bit_bytes(shape) / GiB
    # unsloth checkpoints each layer's input and recomputes one layer at a time; the log-probs of the packed
    # sequence keep LOGPROB_SAVED_COPIES vocabulary-wide tensors per position, plus one chunk's float32 temporaries
    activations = (shape.layers * max_seq_length * shape.hidden * 2
                   + max_seq_length * (3 * shape.intermediate + 4 * shape.hidden) * 2
                   + logprob_saved_bytes(shape.vocab, max_seq_length)
                   + LOGPROB_CHUNK * shape.vocab * 4) / GiB
    trainer = four_bit + activations + TRAINER_FIXED_GIB + ASLEEP_GIB
    return Estimate(weights, kv, vllm_need, gpu_memory_utilization * card_gib, trainer, weights + four_bit + 2)


def four_bit_bytes(shape: ModelShape) -> float:
    """The trainer's 4-bit copy (bitsandbytes NF4 with its scales), embeddings kept in 16 bits."""
    return (shape.params - shape.embedding_params) * 0.5 * 1.07 + shape.embedding_params * 2


def logprob_saved_bytes(vocab: int, positions: int, dtype_bytes: int = 2) -> int:
    """What ART 0.5.18's `_calculate_logprobs` (art/unsloth/train.py) leaves for backward: it takes the log-probs
    and the entropy of every packed position with gradients, and autograd keeps four vocabulary-wide tensors per
    position (the logits, exp of the log-softmax, its negation, the log-softmax) for all the step's positions,
    whatever the chunk size, until the loss is computed. Measured on CPU with saved-tensor hooks, per position:
    4 x vocab x dtype bytes, plus the logsumexp and the gathered index (tests/test_gpu_memory.py holds this)."""
    return positions * (LOGPROB_SAVED_COPIES * vocab * dtype_bytes + dtype_bytes + 8)


def default_local_model(card_gib: float, *, gpu_memory_utilization: float, max_seq_length: int,
                        enforce_eager: bool) -> str:
    """The largest Qwen2.5-Instruct that fits the card at these settings (the smallest if none does)."""
    fitting = [name for name, shape in QWEN2_5.items()
               if estimate(shape, card_gib, gpu_memory_utilization=gpu_memory_utilization,
                           max_seq_length=max_seq_length, enforce_eager=enforce_eager).fits(card_gib)]
    return fitting[-1] if fitting else next(iter(QWEN2_5))


def vllm_lora_rank(rank: int) -> int:
    """The --max-lora-rank vLLM must be started with to serve a LoRA of this rank (its default, 16, at least)."""
    return next((r for r in VLLM_LORA_RANKS if r >= max(rank, 16)), rank)


def sizing_table(cards=(24, 40, 80), *, gpu_memory_utilization: float = 0.8, max_seq_length: int = 8192,
                 enforce_eager: bool = False) -> list[str]:
    """The README's table: each Qwen2.5 size, what it needs, and on which card it fits at these settings."""
    rows = ["| base model | vLLM: bf16 weights + KV for 4 × 8k + overhead | trainer while training | fits "
            + " / ".join(f"{c} GB" for c in cards) + " |", "|---|---|---|---|"]
    for name, shape in QWEN2_5.items():
        e = [estimate(shape, CARD_GIB[c], gpu_memory_utilization=gpu_memory_utilization,
                      max_seq_length=max_seq_length, enforce_eager=enforce_eager) for c in cards]
        overhead = VLLM_OVERHEAD_GIB + (0 if enforce_eager else CUDA_GRAPHS_GIB)
        rows.append(f"| {name.removeprefix('Qwen/')} | {e[0].weights_bf16:.1f} + {4 * e[0].kv_per_sequence:.1f} + "
                    f"{overhead:.1f} = {e[0].vllm_need:.1f} GiB | {e[0].trainer:.1f} GiB | "
                    + " / ".join("yes" if x.fits(CARD_GIB[c]) else "no" for x, c in zip(e, cards)) + " |")
    return rows


# ---- what is missing --------------------------------------------------------------------------------------

@dataclass
class Readiness:
    """What `train --preflight` prints about a backend before anything loads, and what stops it."""

    backend: str
    base_model: str
    lines: list[str] = field(default_factory=list)  # facts: the model, the card, the estimate
    missing: list[str] = field(default_factory=list)  # one sentence each, with the fix

    @property
    def ok(self) -> bool:
        return not self.missing

    def report(self) -> list[str]:
        return ([f"backend {self.backend}: {self.base_model}"] + [f"  {line}" for line in self.lines]
                + [f"  missing: {m}" for m in self.missing] + ([] if self.missing else ["  nothing missing"]))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tinker_renderer(base_model: str) -> str | None:
    """ART's own renderer lookup for Tinker (None: "Unknown base model"), read from the installed file so it runs
    without the tinker extra (importing `art.tinker` needs fastapi, tinker and tinker_cookbook)."""
    # here, not at the top: ART imports torch and transformers (seconds), and this module loads for --help
    import art

    path = Path(art.__file__).parent / "tinker" / "renderers.py"
    spec = importlib.util.spec_from_file_location("_art_tinker_renderers", path)
    renderers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(renderers)
    try:
        return renderers.get_renderer_name(base_model)
    except ValueError:
        return None


def check(backend: str, settings, gpu: GPU | None, environ=os.environ) -> Readiness:
    """Everything that can be told before an ART backend starts; `settings` are the run's `BackendSettings` (its
    base_model set)."""
    r = Readiness(backend, settings.base_model)
    if backend in ("local", "tinker", "serverless") and not installed("wandb"):
        r.missing.append(f"wandb: ART 0.5.18 imports it at every training step of this backend, W&B or not: "
                         f"pip install {WANDB_PIN}")
    if backend == "local":
        _local(r, settings, gpu, environ)
    elif backend == "tinker":
        if not environ.get("TINKER_API_KEY"):
            r.missing.append("TINKER_API_KEY: set it in the environment (it is never passed on the command line)")
        if not (installed("tinker") and installed("tinker_cookbook") and installed("fastapi")):
            r.missing.append("ART's tinker extra: pip install 'openpipe-art[tinker]==0.5.18'")
        renderer = tinker_renderer(settings.base_model)
        if renderer is None:
            r.missing.append(f"a base model Tinker's renderers know: ART 0.5.18 has none for {settings.base_model} "
                             f"(Llama 3, Qwen3 / Qwen3.x, Kimi K2, DeepSeek V3, gpt-oss); e.g. --base-model "
                             f"{DEFAULT_MODELS['tinker']}")
        else:
            r.lines.append(f"Tinker renders it with {renderer}")
    elif backend == "serverless":
        if not environ.get("WANDB_API_KEY"):
            r.missing.append("WANDB_API_KEY: W&B Training authenticates with it; set it in the environment")
        if settings.base_model not in SERVERLESS_MODELS:
            r.lines.append(f"warning: {settings.base_model} is not among the models ART 0.5.18 offers for Serverless "
                           f"({', '.join(SERVERLESS_MODELS)}); W&B may refuse it")
    return r


def venv_uv() -> Path | None:
    """The uv that `pip install -r requirements-gpu.txt` put beside this interpreter (a venv not activated)."""
    beside = Path(sys.executable).parent / "uv"
    return beside if beside.is_file() else None


def put_venv_uv_on_path(environ=os.environ) -> None:
    """ART runs "uv" from PATH; a venv's own uv is not on it unless the venv is activated."""
    if not shutil.which("uv", path=environ.get("PATH")) and venv_uv():
        environ["PATH"] = f"{venv_uv().parent}{os.pathsep}{environ.get('PATH', '')}"


def _local(r: Readiness, settings, gpu: GPU | None, environ) -> None:
    if not (installed("unsloth") and installed("trl")):
        r.missing.append("ART's GPU extra (unsloth, trl): in a venv of its own, pip install -r requirements-gpu.txt")
    if not (shutil.which("uv") or venv_uv() or environ.get("ART_VLLM_RUNTIME_BIN")):
        r.missing.append(f"uv: ART builds its vLLM runtime with it at the first start: pip install {UV_PIN} (or point "
                         f"ART_VLLM_RUNTIME_BIN at a built runtime)")
    if gpu is None:
        r.missing.append("a CUDA GPU: torch sees none here; use --backend cpu, or run on a machine with one")
    card = gpu.total_gib if gpu else CARD_GIB[NO_GPU_CARD_GB]
    r.lines.append(f"GPU {gpu.name}: {gpu.total_gib:.1f} GiB, {gpu.free_gib:.1f} GiB free" if gpu else
                   f"no GPU: sized for a {NO_GPU_CARD_GB} GB card")
    rank = vllm_lora_rank(settings.lora_rank)
    r.lines.append(f"LoRA r={settings.lora_rank}, alpha={settings.lora_alpha}; vLLM started with "
                   f"--max-lora-rank {rank}")
    if settings.lora_rank > VLLM_LORA_RANKS[-1]:
        r.missing.append(f"a LoRA rank vLLM can serve: at most {VLLM_LORA_RANKS[-1]}, not {settings.lora_rank}")
    if settings.max_seq_length % PACK_MULTIPLE:
        lower = max(PACK_MULTIPLE, settings.max_seq_length // PACK_MULTIPLE * PACK_MULTIPLE)
        r.missing.append(f"--max-seq-length a multiple of {PACK_MULTIPLE}: ART 0.5.18 packs a step to a multiple of "
                         f"{PACK_MULTIPLE} tokens capped at {settings.max_seq_length}, and its trainer stops on a "
                         f"length {LOGPROB_CHUNK} does not divide; use {lower}")
    shape = model_shape(settings.base_model)
    _first_start(r, settings.base_model, shape, environ)
    if shape is None:
        r.lines.append(f"memory: not estimated (no config.json for {settings.base_model} at hand)")
        return
    e = estimate(shape, card, gpu_memory_utilization=settings.gpu_memory_utilization,
                 max_seq_length=settings.max_seq_length, enforce_eager=settings.enforce_eager)
    r.lines.append(f"memory: vLLM needs {e.weights_bf16:.1f} GiB of bf16 weights + {MIN_FULL_SEQUENCES} x "
                   f"{e.kv_per_sequence:.2f} GiB KV for {settings.max_seq_length}-token sequences + overhead = "
                   f"{e.vllm_need:.1f} GiB of its {e.vllm_share:.1f} GiB share (--gpu-memory-utilization "
                   f"{settings.gpu_memory_utilization:g}); the trainer needs {e.trainer:.1f} GiB while vLLM sleeps; "
                   f"host memory {e.host:.0f} GiB")
    smaller = default_local_model(card, gpu_memory_utilization=settings.gpu_memory_utilization,
                                  max_seq_length=settings.max_seq_length, enforce_eager=settings.enforce_eager)
    if e.vllm_need > e.vllm_share:
        room = math.ceil(e.vllm_need / card * 100) / 100
        fix = (f"--gpu-memory-utilization {room:.2f}" if room <= 0.9 else
               f"a smaller model (--base-model {smaller}) or a shorter --max-seq-length")
        r.missing.append(f"GPU memory for vLLM: {e.vllm_need:.1f} GiB needed, {e.vllm_share:.1f} GiB given; use {fix}")
    elif e.trainer > card:
        r.missing.append(f"GPU memory for the trainer: {e.trainer:.1f} GiB needed, the card has {card:.1f}; use "
                         f"--base-model {smaller} or a shorter --max-seq-length")
    if gpu is not None and e.vllm_share + TRAINER_FIXED_GIB > gpu.free_gib:
        r.missing.append(f"free GPU memory: {gpu.free_gib:.1f} GiB free, vLLM's share and the parked trainer take "
                         f"{e.vllm_share + TRAINER_FIXED_GIB:.1f}; stop what else runs on the GPU (nvidia-smi) or "
                         f"lower --gpu-memory-utilization")
    # here, not at the top: a third-party package (installed with peft) that only this local-GPU check needs
    import psutil

    host = psutil.virtual_memory().total / GiB
    if host < e.host:
        r.missing.append(f"host memory: {host:.0f} GiB, and a sleeping vLLM and the parked trainer keep "
                         f"{e.host:.0f} GiB there; use a smaller --base-model")


# ---- the first start: ART's vLLM runtime and the weights --------------------------------------------------

# ART 0.5.18's vLLM runtime (`art/_vllm_runtime/`): vLLM 0.20.2 for manylinux_2_34, in a Python 3.12 venv; 177
# wheels of 3.6 GiB in its lock, about 10 GiB once unpacked.
RUNTIME_GLIBC = (2, 34)
RUNTIME_DISK_GIB = 10.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "UV_OFFLINE", "TRANSFORMERS_OFFLINE")


def glibc_version() -> tuple[int, int] | None:
    """This machine's glibc as (major, minor), or None where the C library is not glibc (musl, macOS)."""
    library, version = platform.libc_ver()
    parts = version.split(".")
    if library != "glibc" or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def built_vllm_runtime(environ=os.environ) -> str | None:
    """Where ART's vLLM runtime is already built (ART_VLLM_RUNTIME_BIN, or the managed runtime in its cache that
    ART 0.5.18's own check accepts), or None: then the first start builds it."""
    if environ.get("ART_VLLM_RUNTIME_BIN"):
        return environ["ART_VLLM_RUNTIME_BIN"]
    # here, not at the top: ART imports torch and transformers (seconds), and this module loads for --help
    from art import vllm_runtime  # ART's own validation, so a runtime it would rebuild is not taken as built

    try:
        manifest = vllm_runtime._load_bundled_manifest()
    except RuntimeError:
        return None
    digest = vllm_runtime._manifest_hash(manifest)
    root = vllm_runtime.get_vllm_runtime_cache_root().expanduser().resolve()
    found = vllm_runtime._validate_managed_runtime(root / digest, cache_root=root, manifest=manifest,
                                                   manifest_hash=digest)
    return str(found) if found else None


def offline(environ=os.environ) -> bool:
    return any(environ.get(name, "").lower() in ("1", "true", "yes", "on") for name in OFFLINE_VARIABLES)


def unsloth_repo(base_model: str) -> str | None:
    """The repository unsloth 2026.3.3 trains instead of a Qwen2.5-Instruct at ART's default load_in_4bit (its
    `models/mapper.py` maps each to a dynamic 4-bit quantisation of its own); None for models not mapped here."""
    return f"unsloth/{base_model.split('/', 1)[1]}-unsloth-bnb-4bit" if base_model in QWEN2_5 else None


def cached_repo(repo: str) -> bool:
    """Whether the Hugging Face cache holds the repository's config.json (what a load reads first)."""
    # here, not at the top: this name loads huggingface_hub's hub client (~0.1 s); only the local-GPU check asks
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except ValueError:  # not a repository id (huggingface_hub's HFValidationError is a ValueError)
        return False


def free_gib(path: Path) -> float:
    """Free space on the disk that holds `path` (its nearest existing parent)."""
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / GiB


def python_312_found(uv: str | None) -> bool:
    """Whether a Python 3.12 runs here (the runtime's venv needs one; uv downloads one otherwise): as uv finds it,
    or a python3.12 on PATH that starts (a pyenv shim of a version not selected does not)."""
    command = [uv, "python", "find", ">=3.12,<3.13"] if uv else ["python3.12", "-c", ""]
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _first_start(r: Readiness, base_model: str, shape: ModelShape | None, environ) -> None:
    """What ART 0.5.18's first start fetches and needs, told before it starts (docs/training.md, "The first
    start"): the vLLM runtime it builds with uv, and the weights vLLM and unsloth each download."""
    is_offline = offline(environ)
    runtime = built_vllm_runtime(environ)
    if runtime:
        r.lines.append(f"vLLM runtime: built ({runtime})")
    else:
        glibc = glibc_version()
        if glibc is None or glibc < RUNTIME_GLIBC:
            found = "this C library is not glibc" if glibc is None else f"this machine has glibc {glibc[0]}.{glibc[1]}"
            r.missing.append(f"glibc 2.34 or newer: ART 0.5.18's vLLM runtime is a manylinux_2_34 wheel and "
                             f"{found} (Ubuntu 22.04, Debian 12 and RHEL 9 have it)")
        uv = shutil.which("uv", path=environ.get("PATH")) or (str(venv_uv()) if venv_uv() else None)
        if python_312_found(uv):
            r.lines.append("vLLM runtime: built at the first start (uv sync, about 3.6 GiB of downloads; Python "
                           "3.12 found)")
        elif is_offline or environ.get("UV_PYTHON_DOWNLOADS") == "never":
            r.missing.append("Python 3.12: ART 0.5.18's vLLM runtime needs it and uv may not download one here "
                             "(offline); install python3.12")
        else:
            r.lines.append("vLLM runtime: built at the first start (uv sync, about 3.6 GiB of downloads, and a "
                           "managed Python 3.12, none being here)")
        cache = Path(environ.get("ART_VLLM_RUNTIME_CACHE_DIR") or Path.home() / ".cache" / "art" / "vllm_runtime")
        if is_offline:
            r.missing.append("a built vLLM runtime: offline, ART cannot build it (docs/training.md, \"An offline "
                             "machine\")")
        elif free_gib(cache) < RUNTIME_DISK_GIB:
            r.missing.append(f"disk for ART's vLLM runtime: {free_gib(cache):.1f} GiB free at {cache}, it takes "
                             f"about {RUNTIME_DISK_GIB:.0f} GiB (or set ART_VLLM_RUNTIME_CACHE_DIR elsewhere)")
    if Path(base_model).expanduser().is_dir():
        r.lines.append(f"weights: the local folder {base_model}")
        return
    repos = [base_model] + ([unsloth_repo(base_model)] if unsloth_repo(base_model) else [])
    missing = [repo for repo in repos if not cached_repo(repo)]
    if not missing:
        r.lines.append(f"weights: cached ({', '.join(repos)})")
    elif is_offline:
        r.missing.append(f"cached weights: offline (HF_HUB_OFFLINE), and the Hugging Face cache lacks "
                         f"{', '.join(missing)}; download them where there is a network first (docs/training.md)")
    elif shape is not None:
        # here, as in cached_repo: huggingface_hub is third-party, and only the local-GPU check needs it
        from huggingface_hub import constants

        need = ((shape.params * 2 if base_model in missing else 0)
                + (four_bit_bytes(shape) if len(missing) > (base_model in missing) else 0)) / GiB
        have = free_gib(Path(constants.HF_HUB_CACHE))
        r.lines.append(f"weights: {', '.join(missing)} downloaded at the first start ({need:.1f} GiB)")
        if have < need:
            r.missing.append(f"disk for the weights: {have:.1f} GiB free at {constants.HF_HUB_CACHE}, "
                             f"{', '.join(missing)} take about {need:.1f} GiB (or set HF_HOME elsewhere)")


# ---- a guard for ART 0.5.18 ---------------------------------------------------------------------------------

DENSE_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def allow_art_without_megatron() -> None:
    """ART 0.5.18's `art.dev.get_model_config` (which LocalBackend and the Tinker backend call when they start)
    imports `art.megatron.model_support`, whose handlers import megatron.core and megatron.bridge at module level:
    neither is in ART's [backend] extra, and megatron-bridge pins transformers<5 against ART's 5.2.0. Without
    them the first `register` fails with "No module named 'megatron'" (fixed upstream after 0.5.18, OpenPipe/ART
    PR #706). Where megatron is not installed, this puts in its place the one function get_model_config uses,
    with ART's target modules for dense models (Qwen2.5, Llama, Qwen3 dense): its registry needs megatron only
    for Qwen3.5 and mixture-of-experts models, which it refuses here with a clear error."""
    name = "art.megatron.model_support"
    if name in sys.modules or installed("megatron"):
        return

    def default_target_modules_for_model(base_model: str, *, allow_unvalidated_arch: bool = False) -> list[str]:
        lowered = base_model.lower()
        if "qwen3.5" in lowered or "qwen3_5" in lowered or "-a3b" in lowered or "moe" in lowered:
            raise RuntimeError(f"{base_model} needs ART's megatron model support (pip install "
                               f"'openpipe-art[megatron]==0.5.18'); the dense models this tool defaults to do not")
        return list(DENSE_TARGET_MODULES)

    module = types.ModuleType(name, "Stand-in for ART 0.5.18's model support where megatron is not installed.")
    module.default_target_modules_for_model = default_target_modules_for_model
    sys.modules[name] = module
