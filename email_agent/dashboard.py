"""The local dashboard: a run's curves in TensorBoard as it trains, with no account and nothing sent anywhere.

`Mirror` follows the run's history.jsonl (ART writes a row there for every training step, validation and warm-start
epoch, on every backend) and copies each row into TensorBoard event files under the run's folder: training rows to
`<run>/tensorboard/train`, validation rows to `<run>/tensorboard/val`, with the split's prefix taken off the tag, so
`reward` is one chart with a training line and a validation line per run. `serve` opens every run of a project on
127.0.0.1 (`python train_email_search_agent.py dashboard`, `make dashboard`).

TensorBoard rather than trackio (docs/training.md has the measurement): it adds 6 small packages to the install and
changes none of its pins (trackio 0.43.0 adds 9 and takes pillow back a major version), its event files are what
CleanRL and TRL write, and W&B imports them (`wandb sync --sync-tensorboard`).

It owns no figure: history.jsonl stays the record (the evaluation's learning curve and the checkpoint kept as best
read it). The event files are a copy, written again in full whenever a run starts or resumes, so a resumed run's
curve goes on from its last step with no step twice, and steps a killed process had not flushed come back. When they
cannot be written (no tensorboard package, a folder that cannot be written, a full disk) training goes on and says
so once.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from email_agent.errors import UserError

FOLDER = "tensorboard"  # in the run's folder, so --fresh deletes a run's curves with the run
SPLITS = ("val", "test", "train")  # a row is its split's (ART prefixes its metrics with it); first match wins
FOLLOW_S = 2.0  # how often the run's new history rows reach the dashboard: a step takes minutes
TENSORBOARD_PIN = "tensorboard==2.21.0"  # as requirements.txt and requirements-gpu.txt pin it
PORT = 6006  # TensorBoard's own default
HOST = "127.0.0.1"  # a run's metrics stay on this machine: another one looks through `ssh -L 6006:127.0.0.1:6006`


class Mirror:
    """history.jsonl's rows, copied to TensorBoard as they are written (a thread follows the file; `close` copies
    the last rows). A failure to write turns it off with one line on stderr; training never sees an exception."""

    def __init__(self, run_folder: Path) -> None:
        self.history = Path(run_folder) / "history.jsonl"
        self.folder = Path(run_folder) / FOLDER
        self._files: dict[str, EventFile] = {}  # split -> its event file, made at the split's first row
        self._read_up_to = 0  # bytes of history.jsonl already copied
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.off_because: str | None = None

    def start(self) -> Mirror:
        """Write the run's history so far again (a resumed run's curve goes on) and follow it from there."""
        try:
            # here, not at the top: a GPU venv made before the dashboard existed has no tensorboard package
            import tensorboard  # noqa: F401
        except ImportError:
            self._turn_off(f"the tensorboard package is not installed here (pip install {TENSORBOARD_PIN})")
            return self
        try:
            for split in SPLITS:  # the last process's copy, replaced by the full one below
                for stale in (self.folder / split).glob("events.out.tfevents.*"):
                    stale.unlink()
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._turn_off(f"{self.folder} cannot be written ({exc.strerror or exc})")
            return self
        self.sync()
        self._thread = threading.Thread(target=self._follow, name="dashboard", daemon=True)
        self._thread.start()
        return self

    def sync(self) -> None:
        """Copy the rows written since the last call (a last line still being written waits for the next)."""
        if self.off_because is not None or not self.history.is_file():
            return
        try:
            with open(self.history, "rb") as f:
                f.seek(self._read_up_to)
                new = f.read()
            complete = new[:new.rfind(b"\n") + 1]
            for line in complete.splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line a killed run cut off (runs.drop_torn_history_line)
                if isinstance(row, dict):
                    self._write(row)
            self._read_up_to += len(complete)
            for events in self._files.values():
                events.flush()  # on disk now: the curve is live
        except OSError as exc:  # a full disk, a folder removed or made read-only under the run
            self._turn_off(f"{self.folder} cannot be written ({exc.strerror or exc})")

    def close(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        self.sync()
        for events in self._files.values():
            events.close()
        self._files = {}

    def _follow(self) -> None:
        while not self._stopped.wait(FOLLOW_S):
            self.sync()

    def _write(self, row: dict) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        split = next((s for s in SPLITS if any(key.startswith(f"{s}/") for key in row)), "train")
        if split not in self._files:
            self._files[split] = EventFile(self.folder / split)
        self._files[split].scalars({key.removeprefix(f"{split}/"): float(value) for key, value in row.items()
                                    # not the x-axis itself, nor text (recorded_at)
                                    if key not in ("step", "training_step") and isinstance(value, (int, float))},
                                   step, recorded_at(row))

    def _turn_off(self, reason: str) -> None:
        if self.off_because is None:
            self.off_because = reason
            print(f"dashboard: off for this run: {reason}; training goes on, every step is still logged in "
                  f"{self.history}", file=sys.stderr, flush=True)
        for events in self._files.values():
            events.close()
        self._files = {}


class EventFile:
    """One TensorBoard event file, written by the caller's thread: torch's and tensorboard's SummaryWriter write
    from a thread of their own, whose failure (a full disk) prints a traceback before the mirror can say it once."""

    def __init__(self, folder: Path) -> None:
        # here, not at the top: Mirror.start has checked that tensorboard is installed
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self._file = open(folder / f"events.out.tfevents.{now:.0f}.{socket.gethostname()}.{os.getpid()}", "wb")
        self._records = RecordWriter(self._file)
        self._write(Event(wall_time=now, file_version="brain.Event:2"))
        # A session start at step 0: a TensorBoard already showing the run drops what it loaded of the copy this
        # file replaces (as torch's SummaryWriter(purge_step=0) marks it).
        self._write(Event(wall_time=now, step=0, session_log=SessionLog(status=SessionLog.START)))

    def scalars(self, values: dict[str, float], step: int, walltime: float | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._write(Event(wall_time=walltime or time.time(), step=step, summary=summary))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # what it could not write was said when it failed


def recorded_at(row: dict) -> float | None:
    """The row's time (ART's `recorded_at`, local time) as TensorBoard's wall time, for its relative-time axis."""
    try:
        return datetime.fromisoformat(row["recorded_at"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


# ---- the dashboard opened -------------------------------------------------------------------------------

def serve(logdir: Path, port: int = PORT) -> str:
    """TensorBoard on HOST:`port` showing every run under `logdir`, in a thread of this process; returns its URL.
    A UserError if the tensorboard package is missing or the port is taken."""
    try:
        # here, not at the top: only this command and a training run's mirror need it
        from tensorboard import program
    except ImportError:
        raise UserError(f"the dashboard is TensorBoard, which is not installed here: pip install "
                        f"{TENSORBOARD_PIN} (make setup installs it)") from None
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: a port is a number from 1 to 65535 (TensorBoard's is {PORT})")
    # Tried here first: TensorBoard starts its data server before it binds, and would leave it behind.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug binds
        try:
            probe.bind((HOST, port))
        except OSError:
            raise taken(port) from None
    board = program.TensorBoard()
    board.configure(logdir=str(logdir), host=HOST, port=port, reload_interval=FOLLOW_S)
    try:
        return board.launch()
    except program.TensorBoardPortInUseError:  # taken since the probe
        raise taken(port) from None
    except program.TensorBoardServerException as exc:
        raise UserError(f"TensorBoard cannot start on {HOST}:{port}: {exc.msg}") from None


def taken(port: int) -> UserError:
    return UserError(f"port {port} on {HOST} is taken (a dashboard already open there?): open http://{HOST}:{port}/, "
                     f"or open this one on another with --port {port + 1 if port < 65535 else PORT}")


def runs_shown(logdir: Path) -> list[str]:
    """The runs under `logdir` with curves (a run trained before the dashboard existed has none)."""
    return sorted(path.parent.name for path in Path(logdir).glob(f"*/{FOLDER}") if path.is_dir())
