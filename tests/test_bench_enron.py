"""`make enron`'s pipeline cannot rot: bench/bench_enron.py --quick, the command `make enron` runs with tiny
settings, on the real Enron sample (skipped when ../shared/data/enron is absent): every phase runs through the tool's
own commands, and the report is written with each model it was to compare."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ENRON, ROOT, needs_enron


@needs_enron
@pytest.mark.slow
def test_the_real_mail_recipe_runs_each_phase_and_writes_its_report(tmp_path):
    work = tmp_path / "enron"
    done = subprocess.run([sys.executable, "bench/bench_enron.py", "--quick", "--enron", str(ENRON), "--work",
                           str(work), "--demo-art-dir", str(tmp_path / "no-demo")], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # the model chosen by the CPU, and why, before anything runs
    assert "bfloat16 native" in out or "bfloat16 not native (float32)" in out
    for phase in ("--- build:", "--- warm start, seed 0:", "--- GRPO, seed 0:", "--- evaluate:"):
        assert phase in out, phase
    summary = json.loads((work / "seed-0" / "report" / "summary.json").read_text())["models"]
    state = json.loads((work / "seed-0" / "art" / "email-agent" / "models" / "enron" / "state.json").read_text())
    warm = f"enron@{state['sft_steps']}"
    trained = [label for label in summary if label.startswith("enron@")]
    assert warm in trained and len(trained) == 2  # the warm start and the GRPO step after it
    assert any(label.startswith("base") for label in summary)
    assert any(label.startswith("hosted_vllm/") and s["tool_choice"] == "required" for label, s in summary.items())
    assert all(s["n"] == 2 for s in summary.values())
    assert (work / "seed-0" / "report" / "report.html").stat().st_size > 1000
    for line in ("the expert, in this episode shape", "McNemar p =", "sign test p =", "targets (issue 80):",
                 "wall time: build"):
        assert line in out, line
    # run again: the report is kept, nothing trained again
    again = subprocess.run([sys.executable, "bench/bench_enron.py", "--quick", "--enron", str(ENRON), "--work",
                            str(work)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "its report exists: not run again" in again.stdout
    assert "--- warm start" not in again.stdout
