"""What the commands print on stderr when it is a log file rather than a terminal."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A bar redrawn through set_postfix after every update, as ART's gather bar is (art.gather.GatherContext.update_pbar),
# with a log record in the middle; stderr is a file.
SCRIPT = """
import logging
from tqdm import auto as tqdm
from email_agent import cli

cli.console()
bar = tqdm.tqdm(desc="step 3", total=200)
for i in range(200):
    bar.update(1)
    bar.set_postfix({"reward": i / 200})
    if i == 100:
        logging.getLogger("email_agent.agent.rollout").info("half way")
bar.close()
"""


def test_progress_in_a_log_file_is_a_few_plain_lines(tmp_path):
    """Catches a log with one carriage-return frame (or one line) per rollout: the bar's redraws must come out as
    plain lines, the first and the last state only when they are seconds apart, and log records untouched."""
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}  # as a user's shell has them
        subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stderr=stderr, check=True, timeout=120)
    text = log.read_text()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    bars = [line for line in lines if line.startswith("step 3")]
    assert len(bars) == 2, lines  # the first frame, then the closed bar (the 30-second interval never passed)
    assert "200/200" in bars[-1] and "reward=0.995" in bars[-1]
    assert any(line.endswith("] half way") for line in lines)


def test_quiet_lasts_one_command_of_a_process(monkeypatch):
    """Catches a bench (or any caller of main() in-process) whose build-db --quiet silenced every later command's
    progress bars; a TQDM_DISABLE the user set stays set."""
    from email_agent import cli

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    cli.console(quiet=True)
    assert os.environ.get("TQDM_DISABLE") == "1"
    cli.console()
    assert "TQDM_DISABLE" not in os.environ

    monkeypatch.setenv("TQDM_DISABLE", "1")
    cli.console(quiet=True)
    cli.console()
    assert os.environ.get("TQDM_DISABLE") == "1"
