"""The GPU install resolves: pip's metadata-only dry run of requirements-gpu.txt for the machines it is for.

No GPU and no CUDA wheel is needed for this: pip resolves for another platform from the registry's metadata
(`--dry-run --report --only-binary=:all: --platform ...`) and installs nothing. It needs the package registry;
where that cannot be reached the test skips and says so, and any other failure to resolve fails it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Linux x86_64 with glibc 2.34 or newer (what ART 0.5.18's vLLM runtime needs): every manylinux tag up to 2.34.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(34, 16, -1)] + ["manylinux2014_x86_64"]
UNREACHABLE = re.compile(r"NewConnectionError|Failed to establish a new connection|Network is unreachable|"
                         r"Temporary failure in name resolution|Max retries exceeded|Could not fetch URL")


def pinned(requirements: Path) -> dict[str, str]:
    """{normalised name: version} of every `name==version` line (extras dropped)."""
    pins = {}
    for line in requirements.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s#;]+)", line.strip())
        if match:
            pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(3)
    return pins


@pytest.fixture(scope="module")
def resolution(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("gpu-install")
    report = work / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--python-version", "3.11", "--only-binary=:all:",
               "--target", str(work / "target"), "-r", str(ROOT / "requirements-gpu.txt")]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("pip did not finish resolving requirements-gpu.txt in 15 minutes (registry too slow to reach)")
    if done.returncode != 0:
        if UNREACHABLE.search(done.stderr) and "ResolutionImpossible" not in done.stderr:
            pytest.skip(f"the package registry cannot be reached: {UNREACHABLE.search(done.stderr).group(0)}")
        errors = [line for line in done.stderr.splitlines() if not line.startswith("WARNING: Location")]
        pytest.fail("requirements-gpu.txt does not resolve:\n" + "\n".join(errors[-30:]))
    return {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def test_requirements_gpu_resolves_to_its_own_pins(resolution):
    pins = pinned(ROOT / "requirements-gpu.txt")
    assert pins, "requirements-gpu.txt pins nothing"
    assert {name: resolution.get(name) for name in pins} == pins


def test_the_gpu_install_is_arts_trainer_stack(resolution):
    """What ART 0.5.18's [backend] extra pins arrives as pinned (a CUDA torch of ART's, unsloth, transformers)."""
    assert {name: resolution.get(name) for name in ("torch", "unsloth", "unsloth-zoo", "trl", "transformers",
                                                    "wandb")} == {
        "torch": "2.10.0", "unsloth": "2026.3.3", "unsloth-zoo": "2026.3.1", "trl": "0.20.0",
        "transformers": "5.2.0", "wandb": "0.25.0"}


def test_pinned_reads_exact_pins_only(tmp_path):
    requirements = tmp_path / "r.txt"
    requirements.write_text("# a comment\nopenpipe-art[backend]==0.5.18\nFoo_Bar==1.2  # why\nloose>=1\n"
                            "marked==2.0; python_version >= '3.11'\n")
    assert pinned(requirements) == {"openpipe-art": "0.5.18", "foo-bar": "1.2", "marked": "2.0"}


def test_the_gpu_venv_runs_every_command(resolution):
    """`serve` (mcp), `export`, the evaluation and `dashboard` (tensorboard) run from the GPU venv too: what they
    import arrives there, at the CPU install's pins."""
    cpu = pinned(ROOT / "requirements.txt")
    for name in ("mcp", "openpipe-art", "tqdm", "tenacity", "tensorboard"):
        assert resolution.get(name) == cpu[name], name
