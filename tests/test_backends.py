"""What an ART backend needs, told before anything loads: the prerequisites of ART 0.5.18's GPU and remote
backends (each missing one a sentence with its fix), the GPU memory estimate and the default model per card,
the LoRA rank vLLM is started with, the guard for ART's megatron import, and `train --preflight` on a machine
that cannot run the backend."""

import ast
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import art
import pytest

from conftest import ROOT
from email_agent import backends
from email_agent.backends import readiness

import train_email_search_agent as cli

CARD_24 = readiness.GPU("a 24 GB card", 23.6, 23.2)


def config(**overrides) -> cli.TrainConfig:
    cfg = cli.TrainConfig(**overrides)
    cfg.base_model = cfg.base_model or "Qwen/Qwen2.5-7B-Instruct"
    return cfg


@pytest.fixture
def gpu_extra(monkeypatch):
    """unsloth, trl and wandb importable, uv on PATH: what `pip install -r requirements-gpu.txt` brings; and a
    machine a first start has run on (ART's vLLM runtime built, the weights cached)."""
    monkeypatch.setattr(readiness, "installed", lambda module: True)
    monkeypatch.setattr(readiness.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
    monkeypatch.setattr(readiness, "built_vllm_runtime", lambda environ: "/opt/art-runtime/bin/serve")
    monkeypatch.setattr(readiness, "cached_repo", lambda repo: True)


def test_every_missing_local_prerequisite_is_one_sentence_with_its_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(readiness, "installed", lambda module: False)
    monkeypatch.setattr(readiness.shutil, "which", lambda name, path=None: None)
    monkeypatch.setattr(readiness.sys, "executable", str(tmp_path / "bin" / "python"))
    ready = readiness.check("local", config(), None, environ={})
    assert not ready.ok
    missing = "\n".join(ready.missing)
    assert f"uv: ART builds its vLLM runtime with it at the first start: pip install {readiness.UV_PIN}" in missing
    assert f"wandb: ART 0.5.18 imports it at every training step of this backend, W&B or not: pip install " \
           f"{readiness.WANDB_PIN}" in missing
    assert "pip install -r requirements-gpu.txt" in missing
    assert "a CUDA GPU: torch sees none here; use --backend cpu" in missing
    # a built vLLM runtime needs no uv
    assert not any(m.startswith("uv") for m in readiness.check(
        "local", config(), None, environ={"ART_VLLM_RUNTIME_BIN": "/opt/vllm/bin/serve"}).missing)
    # uv installed in the venv that runs this, not activated: found, and put on PATH for ART, which runs "uv"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "uv").write_text("")
    assert not any(m.startswith("uv") for m in readiness.check("local", config(), None, environ={}).missing)
    environ = {"PATH": "/usr/bin"}
    readiness.put_venv_uv_on_path(environ)
    assert environ["PATH"] == f"{tmp_path / 'bin'}:/usr/bin"


def test_the_default_7b_fits_a_24_gb_card_at_the_default_share_and_not_at_the_old_readme_setting(gpu_extra):
    ready = readiness.check("local", config(), CARD_24, environ={})
    assert ready.ok, ready.missing
    assert any("vLLM needs 14.2 GiB of bf16 weights" in line for line in ready.lines)
    # the README's 24 GB row said --gpu-memory-utilization 0.6: 14.2 GiB of vLLM's share for 14.2 GiB of weights
    ready = readiness.check("local", config(gpu_memory_utilization=0.6), CARD_24, environ={})
    (missing,) = [m for m in ready.missing if m.startswith("GPU memory")]
    assert missing.startswith("GPU memory for vLLM: 17.4 GiB needed, 14.2 GiB given; use --gpu-memory-utilization")
    # a model no share of the card holds: a smaller one is named
    missing = readiness.check("local", config(base_model="Qwen/Qwen2.5-32B-Instruct"), CARD_24, {}).missing
    assert "use a smaller model (--base-model Qwen/Qwen2.5-7B-Instruct)" in missing[0]
    # something else on the GPU
    busy = readiness.GPU("busy", 23.6, 9.0)
    assert any(m.startswith("free GPU memory: 9.0 GiB free")
               for m in readiness.check("local", config(), busy, {}).missing)


@pytest.mark.parametrize("card, model", [(16, "Qwen/Qwen2.5-1.5B-Instruct"), (24, "Qwen/Qwen2.5-7B-Instruct"),
                                         (40, "Qwen/Qwen2.5-7B-Instruct"), (80, "Qwen/Qwen2.5-14B-Instruct")])
def test_the_default_local_model_is_the_largest_that_fits_the_card(card, model):
    gpu = readiness.GPU(f"{card} GB", readiness.CARD_GIB.get(card, card * 0.98), card * 0.95)
    assert backends.get("local").default_base_model(cli.TrainConfig(), gpu) == model
    cfg = config(base_model=model)
    assert readiness.estimate(readiness.QWEN2_5[model], gpu.total_gib, gpu_memory_utilization=0.8,
                               max_seq_length=8192, enforce_eager=False).fits(gpu.total_gib)
    assert cfg.base_model == model
    # without a GPU (a preflight on a laptop) the run is sized for a 24 GB card
    assert backends.get("local").default_base_model(cli.TrainConfig(), None) == "Qwen/Qwen2.5-7B-Instruct"


def test_remote_backends_default_to_models_they_accept(monkeypatch):
    monkeypatch.setattr(readiness, "installed", lambda module: True)
    assert backends.get("serverless").default_base_model(cli.TrainConfig(), None) in readiness.SERVERLESS_MODELS
    tinker = backends.get("tinker").default_base_model(cli.TrainConfig(), None)
    ready = readiness.check("tinker", config(base_model=tinker), None, environ={"TINKER_API_KEY": "k"})
    assert ready.ok and "Tinker renders it with qwen3_disable_thinking" in ready.lines  # ART's own lookup
    # ART's Tinker renderers do not know Qwen2.5: ART's register would raise "Unknown base model"
    ready = readiness.check("tinker", config(base_model="Qwen/Qwen2.5-7B-Instruct"), None,
                                 environ={"TINKER_API_KEY": "k"})
    (missing,) = ready.missing
    assert missing.startswith("a base model Tinker's renderers know: ART 0.5.18 has none for Qwen/Qwen2.5-7B")
    ready = readiness.check("serverless", config(base_model="Qwen/Qwen2.5-7B-Instruct"), None, environ={})
    assert ready.missing == ["WANDB_API_KEY: W&B Training authenticates with it; set it in the environment"]
    assert any(line.startswith("warning: Qwen/Qwen2.5-7B-Instruct is not among") for line in ready.lines)


def test_remote_backends_need_wandb_installed(monkeypatch):
    """ART 0.5.18's ServerlessBackend.train and LocalBackend.train (which Tinker inherits) run `import wandb`
    at every step, key or not; nothing but the GPU extra installs it."""
    monkeypatch.setattr(readiness, "installed", lambda module: module != "wandb")
    for backend in ("serverless", "tinker"):
        ready = readiness.check(backend, config(base_model="Qwen/Qwen3-8B"), None,
                                     environ={"WANDB_API_KEY": "k", "TINKER_API_KEY": "k"})
        assert [m for m in ready.missing if m.startswith("wandb:")], backend


@pytest.mark.parametrize("rank, served", [(8, 16), (16, 16), (32, 32), (48, 64), (256, 256)])
def test_vllm_is_started_with_a_lora_rank_that_fits(rank, served):
    assert readiness.vllm_lora_rank(rank) == served
    settings = backends.internal_config(cli.TrainConfig(lora_rank=rank))
    assert settings["engine_args"]["max_lora_rank"] == served and settings["peft_args"]["r"] == rank


def test_wandb_key_is_hidden_from_local_and_tinker_only_without_the_flag():
    for backend, wandb, hidden in (("local", False, True), ("tinker", False, True), ("local", True, False),
                                   ("serverless", False, False), ("cpu", False, False)):
        environ = {"WANDB_API_KEY": "k"}
        assert backends.hide_wandb_key(backend, wandb, environ) is hidden
        assert ("WANDB_API_KEY" in environ) is not hidden


MEGATRON_PROBE = """
import sys
try:
    import art.dev.get_model_config
except ModuleNotFoundError as exc:
    print("without guard:", exc)
from email_agent.backends import readiness
for name in [m for m in sys.modules if m.startswith("art.megatron") or m == "art.dev.get_model_config"]:
    del sys.modules[name]
readiness.allow_art_without_megatron()
from art.dev.get_model_config import get_model_config
print("with guard:", get_model_config("Qwen/Qwen2.5-7B-Instruct", "/tmp/x", None)["peft_args"]["target_modules"])
"""


@pytest.mark.skipif(readiness.installed("megatron"), reason="megatron is installed here: ART imports it as it is")
def test_art_s_model_config_imports_without_megatron_once_guarded():
    """ART 0.5.18's get_model_config imports megatron.core and megatron.bridge, which its [backend] extra does not
    install: LocalBackend and Tinker could not start. The guard stands in with ART's own dense target modules."""
    probe = subprocess.run([sys.executable, "-c", MEGATRON_PROBE], capture_output=True, text=True, cwd=ROOT,
                           timeout=600)  # importing ART took over 120 s on a loaded 2-core machine
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert "without guard: No module named 'megatron'" in probe.stdout
    registry = Path(art.__file__).parent / "megatron" / "model_support" / "registry.py"
    dense = next(ast.literal_eval(node.value) for node in ast.parse(registry.read_text()).body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_DENSE_TARGET_MODULES")
    assert list(dense) == readiness.DENSE_TARGET_MODULES
    assert f"with guard: {readiness.DENSE_TARGET_MODULES}" in probe.stdout


def test_preflight_of_a_gpu_run_on_a_machine_without_one_says_what_is_missing(demo_db_path, tmp_path, capsys,
                                                                               monkeypatch):
    """Refused among the start-up checks (the machine's), before the backend is made or anything is saved."""
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    code = cli.main(["train", "--backend", "local", "--preflight", "--db", str(demo_db_path), "--art-dir",
                     str(tmp_path), "--name", "g", "--lora-rank", "32"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.startswith("backend local: Qwen/Qwen2.5-7B-Instruct\n  no GPU: sized for a 24 GB card")
    assert "LoRA r=32, alpha=16; vLLM started with --max-lora-rank 32" in out
    assert "memory: vLLM needs 14.2 GiB of bf16 weights" in out
    assert "  missing: a CUDA GPU" in out and "Traceback" not in err
    assert "Error: --backend local cannot start here; missing: " in err
    assert not (tmp_path / "email-agent").exists()  # nothing saved


def test_the_documented_memory_table_is_the_estimate():
    assert "\n".join(readiness.sizing_table()) in (ROOT / "docs" / "training.md").read_text()


def test_every_command_of_the_gpu_smoke_run_parses(tmp_path):
    """bench/gpu_smoke.py cannot run here (no GPU); its commands are the scripts' own, so a renamed flag fails here."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_smoke
    import test_email_search_agent as evaluate_cli

    phases = gpu_smoke.commands("Qwen/Qwen2.5-0.5B-Instruct", 30, 2, str(tmp_path / "art"), str(tmp_path / "d.db"),
                                str(tmp_path / "eval"))
    assert [phase for phase, _ in phases] == ["build the demo inbox", "warm start + GRPO", "evaluate"]
    for _, (script, *argv) in phases:
        parser = cli.make_parser() if script == "train_email_search_agent.py" else evaluate_cli.make_parser()
        parser.parse_args(argv)  # exits (SystemExit) on a flag that is not there
    train = cli.config_from_args(cli.make_parser().parse_args(phases[1][1][1:]))
    assert (train.backend, train.base_model, train.max_steps, train.sft_from) == (
        "local", "Qwen/Qwen2.5-0.5B-Instruct", 2, "demo-expert")


def test_a_max_seq_length_art_s_trainer_cannot_pack_is_refused_in_one_sentence(gpu_extra):
    missing = readiness.check("local", config(max_seq_length=3000), CARD_24, environ={}).missing
    assert missing == ["--max-seq-length a multiple of 2048: ART 0.5.18 packs a step to a multiple of 2048 tokens "
                       "capped at 3000, and its trainer stops on a length 1024 does not divide; use 2048"]
    assert readiness.check("local", config(max_seq_length=4096), CARD_24, environ={}).ok


def test_the_first_start_s_needs_are_told_before_it(monkeypatch, gpu_extra, tmp_path):
    """No runtime built yet: glibc, Python 3.12 and disk for the runtime; offline, the runtime and both weight
    repositories (the model's and unsloth's 4-bit one) must already be there."""
    monkeypatch.setattr(readiness, "built_vllm_runtime", lambda environ: None)
    monkeypatch.setattr(readiness, "python_312_found", lambda uv: True)
    monkeypatch.setattr(readiness, "free_gib", lambda path: 500.0)
    monkeypatch.setattr(readiness.platform, "libc_ver", lambda: ("glibc", "2.31"))
    (missing,) = readiness.check("local", config(), CARD_24, environ={}).missing
    assert missing.startswith("glibc 2.34 or newer: ART 0.5.18's vLLM runtime is a manylinux_2_34 wheel and this "
                              "machine has glibc 2.31")
    monkeypatch.setattr(readiness.platform, "libc_ver", lambda: ("glibc", "2.35"))
    ready = readiness.check("local", config(), CARD_24, environ={})
    assert ready.ok and "vLLM runtime: built at the first start (uv sync, about 3.6 GiB of downloads; Python 3.12 " \
                        "found)" in ready.lines
    monkeypatch.setattr(readiness, "python_312_found", lambda uv: False)
    assert any("a managed Python 3.12" in line for line in readiness.check("local", config(), CARD_24, {}).lines)
    monkeypatch.setattr(readiness, "free_gib", lambda path: 4.0)
    monkeypatch.setattr(readiness, "cached_repo", lambda repo: repo.startswith("Qwen/"))
    missing = readiness.check("local", config(), CARD_24, environ={}).missing
    assert [m.split(":")[0] for m in missing] == ["disk for ART's vLLM runtime", "disk for the weights"]
    assert "unsloth/Qwen2.5-7B-Instruct-unsloth-bnb-4bit take about 5.3 GiB" in missing[1]
    missing = readiness.check("local", config(), CARD_24, environ={"HF_HUB_OFFLINE": "1"}).missing
    assert missing[0].startswith("Python 3.12: ART 0.5.18's vLLM runtime needs it and uv may not download one")
    assert missing[1].startswith("a built vLLM runtime: offline, ART cannot build it")
    assert missing[2].startswith("cached weights: offline (HF_HUB_OFFLINE), and the Hugging Face cache lacks "
                                 "unsloth/Qwen2.5-7B-Instruct-unsloth-bnb-4bit;")
    monkeypatch.setattr(readiness, "built_vllm_runtime", lambda environ: "/opt/runtime/bin/serve")
    monkeypatch.setattr(readiness, "cached_repo", lambda repo: True)
    assert readiness.check("local", config(), CARD_24, environ={"HF_HUB_OFFLINE": "1"}).ok
    # a local model folder: nothing to download, nothing looked up on the hub
    monkeypatch.undo()
    ready = readiness.check("local", config(base_model=str(tmp_path)), CARD_24, environ={"HF_HUB_OFFLINE": "1",
                                                                                           "ART_VLLM_RUNTIME_BIN": "x"})
    assert f"weights: the local folder {tmp_path}" in ready.lines
    assert not any(m.startswith("cached weights") for m in ready.missing)
    assert readiness.cached_repo("a/../b") is False


def test_a_built_runtime_is_the_one_art_itself_accepts(tmp_path, monkeypatch):
    """ART 0.5.18's own validation of its managed runtime: an empty cache has none; a folder as ART installs it
    (its manifest's hash for a name, ART's install marker with this cache root, a venv, the server) is one; the
    same folder moved to another cache root is not (ART records the root it was built under)."""
    from art import vllm_runtime

    monkeypatch.setenv("ART_VLLM_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    assert readiness.built_vllm_runtime({}) is None
    assert readiness.built_vllm_runtime({"ART_VLLM_RUNTIME_BIN": "/x/serve"}) == "/x/serve"
    manifest = vllm_runtime._load_bundled_manifest()
    digest = vllm_runtime._manifest_hash(manifest)

    def build(root):
        runtime = root / digest
        (runtime / ".venv" / "bin").mkdir(parents=True)
        (runtime / ".venv" / "pyvenv.cfg").write_text("")
        server = runtime / ".venv" / "bin" / vllm_runtime.RUNTIME_SERVER
        server.write_text("#!/bin/sh\n")
        server.chmod(0o755)
        marker = vllm_runtime.VllmRuntimeInstallMarker(
            runtime_version=manifest.runtime_version, protocol_version=manifest.protocol_version,
            manifest_hash=digest, runtime_wheel_sha256=manifest.runtime_wheel_sha256,
            cache_root=str(root.resolve()))
        (runtime / "install.json").write_text(marker.model_dump_json())
        return server

    server = build(tmp_path / "cache")
    assert readiness.built_vllm_runtime({}) == str(server.resolve())
    build(tmp_path / "elsewhere")
    (tmp_path / "cache" / digest / "install.json").unlink()
    import shutil

    shutil.move(str(tmp_path / "elsewhere" / digest / "install.json"), tmp_path / "cache" / digest / "install.json")
    assert readiness.built_vllm_runtime({}) is None


def test_glibc_is_read_from_the_c_library(monkeypatch):
    monkeypatch.setattr(readiness.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert readiness.glibc_version() == (2, 36)
    monkeypatch.setattr(readiness.platform, "libc_ver", lambda: ("", ""))
    assert readiness.glibc_version() is None


def test_train_checks_a_gpu_run_before_anything_loads(demo_db_path, tmp_path, monkeypatch, gpu_extra):
    """The order `train` keeps: the backend's readiness first, then the backend is built (ART loads nothing
    before `register`); a readiness that fails stops it before that."""
    events = []
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    monkeypatch.setattr(readiness, "find_gpu", lambda: CARD_24)
    check = readiness.check
    monkeypatch.setattr(readiness, "check", lambda *a, **k: events.append("readiness") or check(*a, **k))

    def make_backend(settings):
        events.append("make_backend")
        raise backends.BackendError("stopped here by the test")

    monkeypatch.setitem(backends.BACKENDS, "local", dataclasses.replace(backends.LOCAL, make=make_backend))
    argv = ["train", "--backend", "local", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--name", "g"]
    assert cli.main(argv) == 1 and events == ["readiness", "make_backend"]
    events.clear()
    assert cli.main(argv + ["--max-seq-length", "3000"]) == 1 and events == ["readiness"]


@pytest.mark.parametrize("backend", ["cpu", "local"])
def test_a_base_model_folder_without_a_model_is_refused_before_anything_loads(tmp_path, capsys, backend):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    argv = ["train", "--backend", backend, "--art-dir", str(tmp_path / "art"), "--sft-from", "expert"]
    started = time.perf_counter()
    assert cli.main([*argv, "--base-model", str(folder)]) == 1
    err = capsys.readouterr().err
    missing = err.split("holds no loadable model:")[1].split("missing there")[0]
    assert "weights" in missing and "tokenizer" in missing and "config.json" not in missing
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "art").exists() and time.perf_counter() - started < 30  # before any model or ART loads
    assert cli.main([*argv, "--base-model", str(tmp_path / "nowhere")]) == 1
    assert "no such folder" in capsys.readouterr().err


def test_a_model_folder_or_a_hub_name_passes_the_folder_check(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    backends.check_model_folder(str(tmp_path))
    backends.check_model_folder("Qwen/Qwen2.5-7B-Instruct")
    backends.check_model_folder("smollm2")
