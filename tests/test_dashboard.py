"""The local dashboard (email_agent/dashboard.py): history.jsonl's rows in TensorBoard as a run writes them, a resumed
run's curve without a step twice, a folder that cannot be written (training goes on, said once), and the command
that opens it (served on 127.0.0.1; a port taken is one sentence). Read back with TensorBoard's own reader.

The real runs' curves are checked where they train: tests/test_train.py (the CPU run and its resume, ART's GPU
backend)."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import ROOT
from email_agent import dashboard

import train_email_search_agent as cli


def curves_in_history(run: Path) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """{(split, tag): [(step, value)]} as the dashboard should show history.jsonl (values as float32, as stored)."""
    curves: dict = {}
    for line in (run / "history.jsonl").read_text().splitlines():
        row = json.loads(line)
        split = "val" if any(key.startswith("val/") for key in row) else "train"
        for key, value in row.items():
            if key not in ("step", "training_step") and isinstance(value, (int, float)):
                curves.setdefault((split, key.removeprefix(f"{split}/")), []).append(
                    (row["step"], float(np.float32(value))))
    return curves


def curves_in_tensorboard(run: Path) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """{(split, tag): [(step, value)]} as TensorBoard loads the run's event files (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves = {}
    for split_folder in sorted((run / dashboard.FOLDER).iterdir()):
        board = EventAccumulator(str(split_folder), size_guidance={"scalars": 0})  # 0: every point, none sampled
        board.Reload()
        for tag in board.Tags()["scalars"]:
            curves[(split_folder.name, tag)] = [(e.step, e.value) for e in board.Scalars(tag)]
    return curves


def art_row(step: int, split: str, **metrics) -> str:
    """A row as ART 0.5.18's model.log writes it (split-prefixed metrics, the step twice, a time)."""
    return json.dumps({**{f"{split}/{k}": v for k, v in metrics.items()}, "time/wall_clock_sec": step * 60.0,
                       "training_step": step, "step": step, "recorded_at": f"2026-12-07T14:{step:02d}:00"}) + "\n"


def test_each_row_reaches_tensorboard_while_the_run_goes_on_and_a_resume_shows_each_step_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    history = run / "history.jsonl"
    history.write_text(art_row(1, "train", sft_epoch=1) + art_row(1, "val", reward=-0.2, answer_correct=0.25,
                                                                  hallucinated=0.5, valid_tool_call_rate=0.75))
    mirror = dashboard.Mirror(run).start()
    try:
        assert curves_in_tensorboard(run) == curves_in_history(run)  # the history so far, at once
        with open(history, "a") as f:
            f.write(art_row(2, "train", reward=0.1, answer_correct=0.5, returned_i_dont_know=0.25,
                            trainable_group_share=0.5))
            f.write('{"train/reward": 0.3, "st')  # a row still being written: not read until it ends
        deadline = time.monotonic() + 10 * dashboard.FOLLOW_S
        while ("train", "reward") not in curves_in_tensorboard(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert curves_in_tensorboard(run)[("train", "reward")] == [(2, np.float32(0.1))]  # live, before close
    finally:
        mirror.close()
    history.write_text(history.read_text().rsplit("\n", 1)[0] + "\n")  # as runs.start drops a torn line

    # resumed: a new process writes the copy again and goes on; TensorBoard shows every step once
    dashboard.Mirror(run).start().close()
    with open(history, "a") as f:
        f.write(art_row(3, "train", reward=0.4, answer_correct=0.75) + art_row(3, "val", reward=0.5))
    mirror = dashboard.Mirror(run).start()
    mirror.close()
    shown = curves_in_tensorboard(run)
    assert shown == curves_in_history(run)
    assert shown[("train", "reward")] == [(2, np.float32(0.1)), (3, np.float32(0.4))]
    assert shown[("val", "reward")] == [(1, np.float32(-0.2)), (3, np.float32(0.5))]  # validation beside training
    assert len(list((run / dashboard.FOLDER / "train").iterdir())) == 1  # one copy on disk, not one per process


def test_a_folder_that_cannot_be_written_turns_the_dashboard_off_with_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / dashboard.FOLDER).write_text("a file where the folder goes")
    (run / "history.jsonl").write_text(art_row(1, "train", reward=0.1))
    mirror = dashboard.Mirror(run).start()
    with open(run / "history.jsonl", "a") as f:
        f.write(art_row(2, "train", reward=0.2))
    mirror.sync()
    mirror.close()
    err = capsys.readouterr().err
    assert err.count("dashboard: off for this run") == 1 and "training goes on" in err
    assert mirror.off_because and (run / dashboard.FOLDER).read_text() == "a file where the folder goes"


def test_a_disk_that_fills_mid_run_turns_the_dashboard_off_once_and_keeps_the_history(tmp_path):
    """A real write failure after the mirror started (EFBIG past a file-size limit, as ENOSPC on a full disk):
    said once, never raised, no traceback; the rows written after it still reach history.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(ROOT)!r})
sys.path.insert(0, {str(ROOT / "tests")!r})
from pathlib import Path
from email_agent import dashboard
from test_dashboard import art_row
run = Path({str(run)!r})
history = run / "history.jsonl"
history.write_text(art_row(1, "train", reward=0.1))
mirror = dashboard.Mirror(run).start()
with open(history, "a") as f:
    f.write("".join(art_row(step, "train", reward=0.1) for step in range(2, 9)))
(events,) = (run / "tensorboard" / "train").iterdir()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (events.stat().st_size + 50, hard))  # room for less than a row
mirror.sync()
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # training goes on
for step in range(9, 12):
    with open(history, "a") as f:
        f.write(art_row(step, "train", reward=0.1))
    mirror.sync()
mirror.close()
print("finished")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "finished", done.stderr[-2000:]
    assert done.stderr.startswith("dashboard: off for this run: ") and "(File too large)" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr[-2000:]  # once, and no traceback
    assert [json.loads(line)["step"] for line in (run / "history.jsonl").read_text().splitlines()] == [*range(1, 12)]


def test_the_dashboard_command_serves_every_run_on_loopback_and_says_where(tmp_path):
    run = tmp_path / "email-agent" / "models" / "demo"
    run.mkdir(parents=True)
    (run / "history.jsonl").write_text(art_row(1, "val", reward=0.1) + art_row(2, "train", reward=0.2))
    dashboard.Mirror(run).start().close()
    port = free_port()
    board = subprocess.Popen([sys.executable, str(ROOT / "train_email_search_agent.py"), "dashboard", "--art-dir",
                              str(tmp_path), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        said = board.stdout.readline()
        assert said.startswith(f"TensorBoard at http://127.0.0.1:{port}/ with the curves of 1 run(s)"), said
        deadline, tags = time.monotonic() + 60, {}
        while time.monotonic() < deadline and set(tags) != {"demo/tensorboard/train", "demo/tensorboard/val"}:
            time.sleep(0.5)  # TensorBoard's first load of the folder
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=10) as reply:
                tags = json.load(reply)
        assert "reward" in tags["demo/tensorboard/train"] and "reward" in tags["demo/tensorboard/val"]
        helpers = psutil.Process(board.pid).children(recursive=True)  # TensorBoard's data server
    finally:
        board.terminate()  # as Ctrl-C
        _, err = board.communicate(timeout=30)
    assert board.returncode == 130 and "the dashboard is closed" in err
    gone, alive = psutil.wait_procs(helpers, timeout=15)
    assert helpers and not alive, alive  # nothing of it outlives the command


def test_a_port_taken_is_one_sentence(tmp_path, capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["dashboard", "--art-dir", str(tmp_path), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"Error: port {port} on 127.0.0.1 is taken") and err.count("\n") == 1, err
    assert cli.main(["dashboard", "--port", "70000"]) == 1
    assert "a port is a number from 1 to 65535" in capsys.readouterr().err


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("flags, says", [([], "TensorBoard curves in"), (["--no-tensorboard"], "dashboard    off")])
def test_the_run_says_where_its_curves_are(flags, says):
    from email_agent import config

    cfg = config.config_from_args(cli.make_parser().parse_args(["train", "--demo", *flags]))
    (line,) = [line for line in config.opening_lines(cfg, "cpu", 10, 0, 2, 3, "offline")
               if line.startswith("dashboard")]
    assert says in line and ("python train_email_search_agent.py dashboard" in line) == (not flags)
