"""Print, as JSON, the vLLM command line ART 0.5.18 builds for this project's default GPU configuration.

Run as a script (it stubs modules, so it keeps out of the test process): `python tests/art_vllm_argv.py RUNTIME_DIR`,
where RUNTIME_DIR holds ART's runtime wheel (`art/_vllm_runtime/art_vllm_runtime-*.whl`) unpacked. Both stages are
ART's own code: `UnslothService._start_vllm_subprocess` builds the runtime server's command (stopped at its
Popen), and the runtime's `dedicated_server.main` turns that into vLLM's argv (stopped at vLLM's parse_args; its
vLLM, 0.20 for CUDA, is not installed here).
"""

import asyncio
import json
import os
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), sys.argv[1]]

import email_agent  # noqa: F401  (offline environment defaults)
from email_agent import backends
from email_agent.backends import readiness

import train_email_search_agent as cli

readiness.allow_art_without_megatron()
import art.unsloth.service as service_module
from art.dev.get_model_config import get_model_config


class Stop(Exception):
    """Carries the argv a stage would have run."""


def art_runtime_command(base_model: str, output_dir: str) -> list[str]:
    os.environ["ART_VLLM_RUNTIME_BIN"] = "art-vllm-runtime-server"  # else ART builds its runtime with uv
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    config = get_model_config(base_model=base_model, output_dir=output_dir,
                              config=backends.internal_config(cli.TrainConfig()))
    service = service_module.UnslothService(model_name="agent", base_model=base_model, output_dir=output_dir,
                                            config=config)

    def popen(command, **kwargs):
        raise Stop(command)

    service_module.subprocess.Popen = popen
    try:
        asyncio.run(service._start_vllm_subprocess(f"{output_dir}/checkpoints/0000", 8000,
                                                   config={"server_args": {"port": 8000}}))
    except Stop as stop:
        wrapped = stop.args[0]  # [python, managed_process.py, --parent-pid, N, --, server, *arguments]
        return wrapped[wrapped.index("--") + 2:]
    finally:
        service.close()
    raise RuntimeError("ART did not start its vLLM runtime")


def vllm_argv(runtime_arguments: list[str]) -> list[str]:
    from art_vllm_runtime import dedicated_server

    dedicated_server.apply_vllm_runtime_patches = dedicated_server._patch_art_runtime_routes = lambda: None

    class Parser:
        def __init__(self, *args, **kwargs):
            pass

        def parse_args(self, argv):
            raise Stop(argv)

    stubs = {"vllm": {}, "vllm.entrypoints": {}, "vllm.entrypoints.openai": {}, "vllm.utils": {},
             "vllm.entrypoints.openai.api_server": {},
             "vllm.entrypoints.openai.cli_args": {"make_arg_parser": lambda parser: parser,
                                                  "validate_parsed_serve_args": None},
             "vllm.utils.argparse_utils": {"FlexibleArgumentParser": Parser}}
    for name, attributes in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        module.__path__ = []
        sys.modules[name] = module
    try:
        dedicated_server.main(runtime_arguments)
    except Stop as stop:
        return list(stop.args[0])
    raise RuntimeError("ART's runtime did not parse a vLLM command line")


if __name__ == "__main__":
    runtime = art_runtime_command("Qwen/Qwen2.5-7B-Instruct", tempfile.mkdtemp())
    print(json.dumps({"runtime": runtime, "vllm": vllm_argv(runtime)}))
