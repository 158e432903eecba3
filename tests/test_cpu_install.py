"""The CPU install as a user's machine resolves it: torch's CPU build in both CPU venvs, no CUDA package, and the
machine checked before anything downloads.

A developer machine or CI may point pip at a local wheel cache (PIP_FIND_LINKS, a pip config), which hides what a
fresh machine resolves: these resolutions run with the environment's find-links and pip config hidden, PyPI plus
PyTorch's CPU index only. That index is stood in for by a folder holding the same torch wheel where the real one
cannot be reached (this workplace reaches PyPI only); with neither, the resolutions skip and say so.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from conftest import MAKE_DRY_RUN  # noqa: E402
import check_machine  # noqa: E402 (a script, not a package: stdlib only, run before any venv exists)

CUDA_PACKAGE = re.compile(r"^(nvidia-|cuda-|triton$)")
UNREACHABLE = re.compile(r"NewConnectionError|Failed to establish a new connection|Network is unreachable|"
                         r"Temporary failure in name resolution|Max retries exceeded|Could not fetch URL")


def makefile_variable(name: str) -> str:
    return re.search(rf"^{name}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def torch_pin() -> str:
    return re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)


def clean_environment() -> dict[str, str]:
    """The environment of a machine with no wheel cache and no pip config: PyPI alone, unless told otherwise."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no config file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def local_torch_wheel() -> Path | None:
    """The torch CPU wheel in a wheel cache this machine's pip is pointed at, if any (the index's stand-in)."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    folders += re.findall(r"find-links='([^']+)'", listed.stdout)
    for folder in folders:
        for wheel in sorted(Path(folder.removeprefix("file://")).glob(f"torch-{torch_pin()}-cp311-*.whl")):
            return wheel
    return None


def resolve(tmp_path: Path, *args: str, torch_source: list[str]) -> subprocess.CompletedProcess:
    report = tmp_path / "report.json"
    # For this machine (the supported platform: see the skip below), so pip may use sdists as an install would.
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *torch_source, *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=900, env=clean_environment())
    except subprocess.TimeoutExpired:
        pytest.skip("pip did not finish resolving in 15 minutes (registry too slow to reach)")


@pytest.fixture(scope="module")
def torch_source(tmp_path_factory) -> list[str]:
    """pip options for PyTorch's CPU index: the real one if it answers, else a folder with its torch wheel."""
    if check_machine.problems("cpu", **{**LINUX, "machine": platform.machine(), "system": platform.system()}):
        pytest.skip(f"the CPU install is for Linux x86_64, not {platform.system()} {platform.machine()}")
    wheel = local_torch_wheel()
    if wheel is not None:
        return ["--find-links", str(wheel.parent)]
    index = makefile_variable("TORCH_INDEX")
    probe = resolve(tmp_path_factory.mktemp("probe"), "--no-deps", f"torch=={torch_pin()}",
                    torch_source=["--extra-index-url", index])
    if probe.returncode != 0 and UNREACHABLE.search(probe.stderr):
        pytest.skip(f"neither {index} nor a local wheel cache holding torch {torch_pin()} can be reached")
    return ["--extra-index-url", index]


def installed(tmp_path: Path, done: subprocess.CompletedProcess) -> dict[str, str]:
    if done.returncode != 0:
        if UNREACHABLE.search(done.stderr) and "ResolutionImpossible" not in done.stderr:
            pytest.skip(f"the package registry cannot be reached: {UNREACHABLE.search(done.stderr).group(0)}")
        pytest.fail("the CPU install does not resolve:\n" + "\n".join(done.stderr.splitlines()[-30:]))
    return {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
            for item in json.loads((tmp_path / "report.json").read_text())["install"]}


def test_torch_is_pinned_to_its_cpu_build():
    assert torch_pin().endswith("+cpu")
    vllm_pin = re.search(r"^torch==(\S+)", (ROOT / "requirements-vllm.txt").read_text(), re.M).group(1)
    assert vllm_pin == torch_pin()


@pytest.mark.parametrize("venv, args", [(".venv", ["-r", "requirements.txt"]),
                                        (".venv-vllm", ["--no-deps", "-r", "requirements-vllm.txt"])])
def test_each_cpu_venv_resolves_to_cpu_torch_and_no_cuda_package(venv, args, torch_source, tmp_path):
    packages = installed(tmp_path, resolve(tmp_path, *[ROOT / a if a.endswith(".txt") else a for a in args],
                                           torch_source=torch_source))
    assert packages["torch"] == torch_pin(), f"{venv} resolves torch {packages['torch']}"
    assert not sorted(name for name in packages if CUDA_PACKAGE.match(name)), f"{venv} resolves CUDA packages"


def test_without_the_cpu_index_pip_fails_rather_than_take_cuda_torch(tmp_path):
    """PyPI alone (the README's hint forgotten, a mirror down): a loud failure, never PyPI's CUDA build."""
    done = resolve(tmp_path, "--no-deps", f"torch=={torch_pin()}", torch_source=[])
    if done.returncode != 0 and UNREACHABLE.search(done.stderr):
        pytest.skip(f"the package registry cannot be reached: {UNREACHABLE.search(done.stderr).group(0)}")
    assert done.returncode != 0
    assert f"No matching distribution found for torch=={torch_pin()}" in done.stderr


def test_make_setup_installs_cpu_torch_from_its_index_before_anything_else(tmp_path):
    """`make -n` prints the recipe: each CPU venv takes torch from TORCH_INDEX, then its requirements."""
    printed = subprocess.run([*MAKE_DRY_RUN, "setup", f"VENV={tmp_path}/a", f"VLLM_VENV={tmp_path}/b"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    for venv, requirements in ((f"{tmp_path}/a", "-r requirements.txt"), (f"{tmp_path}/b", "-r requirements-vllm.txt")):
        steps = [line for line in printed if line.startswith(f"{venv}/bin/python -m pip install")]
        torch_step = next(i for i, line in enumerate(steps) if f"'torch=={torch_pin()}'" in line)
        assert f"--index-url {makefile_variable('TORCH_INDEX')}" in steps[torch_step]
        assert torch_step < next(i for i, line in enumerate(steps) if requirements in line)
    assert printed[0].endswith("scripts/check_machine.py cpu"), "the machine is checked before anything downloads"


LINUX = dict(free_gb=50.0, machine="x86_64", system="Linux", python=(3, 11), has_ensurepip=True, glibc=(2, 36),
             gpus=["NVIDIA H100"])


@pytest.mark.parametrize("change, says", [
    (dict(system="Darwin", machine="arm64"), "are for Linux x86_64"),
    (dict(machine="aarch64"), "x86_64 container"),
    (dict(glibc=(2, 17)), "glibc is 2.17"),
    (dict(python=(3, 12)), "need Python 3.11"),
    (dict(has_ensurepip=False), "apt-get install python3.11-venv"),
    (dict(free_gb=2.0), "needs about 6 GB"),
])
def test_the_machine_check_stops_a_cpu_install_in_one_sentence(change, says):
    found = check_machine.problems("cpu", **{**LINUX, **change, "gpus": None})
    assert len(found) == 1 and says in found[0] and found[0].endswith(".")


def test_the_gpu_check_wants_a_gpu_and_more_disk_and_passes_a_gpu_box():
    assert check_machine.problems("gpu", **LINUX) == []
    no_gpu = check_machine.problems("gpu", **{**LINUX, "gpus": None})
    assert len(no_gpu) == 1 and "no NVIDIA GPU" in no_gpu[0] and "FORCE=1" in no_gpu[0]
    # the venv (8.6 GB) is the smaller part: ART's vLLM runtime and the 7B's weights come at the first run
    short = check_machine.problems("gpu", **{**LINUX, "free_gb": 20.0})
    assert len(short) == 1 and "needs about 40 GB" in short[0] and "vLLM runtime" in short[0]


def test_make_setup_gpu_stops_before_downloading_on_a_machine_without_a_gpu(tmp_path):
    if check_machine.visible_gpus():
        pytest.skip("this machine has an NVIDIA GPU")
    done = subprocess.run(["make", "setup-gpu", f"GPU_VENV={tmp_path}/gpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "make setup-gpu: no NVIDIA GPU is visible" in done.stderr
    assert not (tmp_path / "gpu").exists(), "nothing is installed before the check"


def test_make_demo_builds_trains_and_evaluates_after_the_install(tmp_path):
    """The main job's recipe (an install edit once dropped it: `make demo` then did nothing and exited 0)."""
    printed = subprocess.run([*MAKE_DRY_RUN, "demo", f"VENV={tmp_path}/a", f"VLLM_VENV={tmp_path}/b"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    jobs = [line for line in printed if "_email_search_agent.py" in line]
    assert [job.split()[1:3] for job in jobs] == [["train_email_search_agent.py", "build-db"],
                                                  ["train_email_search_agent.py", "train"],
                                                  ["test_email_search_agent.py", "--demo"]]
    assert printed.index(jobs[0]) > max(i for i, line in enumerate(printed) if "pip install" in line)


@pytest.mark.parametrize("flags, kind", [("fpu sse2 avx avx2 fma avx512f avx512_bf16", "bfloat16 in hardware"),
                                         ("fpu avx2 amx_bf16 amx_tile", "bfloat16 in hardware"),
                                         ("fpu sse2 avx avx2 fma", "AVX2"), ("fpu sse2 sse4_2", "neither")])
def test_the_machine_check_says_which_of_the_readmes_times_apply(flags, kind):
    """The README quotes each time with the CPU kind that made it; `make setup` says which kind this CPU is, in
    the README's own words."""
    said = check_machine.cpu_kind(f"processor\t: 0\nflags\t\t: {flags}\n", cores=4)
    assert kind in said and "4 cores" in said
    quoted = re.findall(r'"([^"]+)"', said)
    readme = " ".join((ROOT / "README.md").read_text().split())
    if kind == "neither":
        assert not quoted and "none was measured" in said
    else:
        assert len(quoted) == 1 and readme.count(quoted[0]) >= 2, quoted  # in the README, beside its times
