"""A training run's folder, <art_dir>/<project>/models/<name>/: finding runs and their checkpoints, and
starting, locking and resuming one.

What a run's folder holds: run_config.json (how it was trained; evaluation and `ask` serve it the same way),
state.json (ART's model state: where the warm start began and ended), history.jsonl (ART's metrics log, one
line per logged step) and checkpoints/NNNN/. `train` starts, locks and resumes runs here; evaluation and
`ask` find them here. Nothing here loads a model.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from email_agent.agent.episode import LIMITS, Episode
from email_agent.agent.matcher import GRADER, STRICT_GRADER
from email_agent.errors import UserError

ART_DIR = ".art"  # where runs live: ART's layout <art_dir>/<project>/models/<name>/
PROJECT = "email-agent"  # the ART (and W&B) project


def run_path(art_dir: str, project: str, name: str) -> Path:
    return Path(art_dir) / project / "models" / name

log = logging.getLogger(__name__)


# ---- finding runs (evaluation, ask) ----------------------------------------------------------------


@dataclass
class Run:
    """A training run's folder: <art_dir>/<project>/models/<name>/ with run_config.json and checkpoints/."""

    path: Path
    config: dict

    @classmethod
    def load(cls, path: Path) -> "Run":
        config_path = path / "run_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
            problem = config_problem(config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problem = str(exc)
        if problem:
            raise UserError(f"{config_path} is damaged ({problem}): it records how the run was trained; restore it, "
                            f"or train the run again with --fresh.")
        return cls(path, config)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def project(self) -> str:
        return self.path.parent.parent.name

    @property
    def art_dir(self) -> str:
        return str(self.path.parent.parent.parent)

    @property
    def backend(self) -> str:
        return self.config.get("backend") or "cpu"  # runs from before the backend was saved were CPU runs

    @property
    def base_model(self) -> str:
        if not self.config.get("base_model"):
            raise UserError(f"{self.path / 'run_config.json'} is missing or names no base_model; "
                            "is this a training run?")
        return self.config["base_model"]

    @property
    def limits(self) -> Episode:
        return Episode.from_run_config(self.config)

    def steps(self) -> list[int]:
        folder = self.path / "checkpoints"
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []

    def checkpoint(self, step: str) -> tuple[int, Path]:
        """'' / 'latest' / 'N' -> (step, its folder), from the checkpoints on this machine."""
        steps = self.steps()
        if not steps:
            raise UserError(f"{self.path} has no checkpoints yet.")
        if step in ("", "latest"):
            chosen = steps[-1]
        elif not is_step(step) or int(step) not in steps:
            raise UserError(f"{self.path} has no checkpoint {step!r}; it has {', '.join(map(str, steps))} "
                            f"(or use @latest).")
        else:
            chosen = int(step)
        return chosen, self.path / "checkpoints" / f"{chosen:04d}"

    def last_active(self) -> float:
        candidates = [self.path / "run_config.json", self.path / "history.jsonl", self.path / "checkpoints"]
        return max((p.stat().st_mtime for p in candidates if p.exists()), default=0.0)


# What evaluation and `ask` read of run_config.json, and the type each must have (a hand edit can break it).
CONFIG_TYPES = {"base_model": str, "backend": str, "db": str, "lora_rank": int, "lora_alpha": int}


def config_problem(config) -> str | None:
    """What is wrong with a run_config.json's content, or None."""
    if not isinstance(config, dict):
        return "not an object"
    episode = config.get("episode") or {}
    if not isinstance(episode, dict):
        return f"episode is {episode!r}, not an object"
    for key, value in [*((k, config[k]) for k in CONFIG_TYPES if config.get(k) is not None),
                       *((f"episode.{name}", episode[name]) for name in LIMITS if name in episode),
                       *((name, config[name]) for name in LIMITS if config.get(name) is not None)]:
        kind = CONFIG_TYPES.get(key, int)
        if type(value) is not kind or kind is int and value < 1:
            return f"{key} is {value!r}, not a{' positive' if kind is int else ''} {kind.__name__}"
    return None


def is_step(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit alone accepts '²', which int() refuses


def find_run(name: str, art_dir: str = ART_DIR) -> Run | None:
    """A run by folder, or by name under art_dir (the default project first, then any other)."""
    path = Path(name)
    if (path / "run_config.json").exists() or (path / "checkpoints").is_dir():
        return Run.load(path)
    if not name or "/" in name or name in (".", ".."):
        return None
    candidates = [run_path(art_dir, PROJECT, name)] + sorted(Path(art_dir).glob(f"*/models/{name}"))
    return next((Run.load(p) for p in candidates if (p / "run_config.json").exists()), None)


def trained_db(specs: list[str], art_dir: str = ART_DIR) -> str | None:
    """The database the first trained run among the --model values was trained on (None if none is a run);
    a UserError if it is no longer where the run saved it."""
    for spec in specs:
        run = find_run(spec.partition("@")[0], art_dir)
        if run is not None and run.config.get("db"):
            if not Path(run.config["db"]).exists():
                raise UserError(f"run {run.name!r} was trained on the database {run.config['db']}, which is not "
                                f"there (seen from {Path.cwd()}); pass --db")
            return run.config["db"]
    return None


def list_runs(art_dir: str = ART_DIR) -> list[Run]:
    """Every run under art_dir, the most recently active first."""
    runs = []
    for path in Path(art_dir).glob("*/models/*/run_config.json"):
        try:
            runs.append(Run.load(path.parent))
        except UserError as exc:  # one damaged run does not hide the others
            log.warning("skipping a run: %s", exc)
    return sorted(runs, key=Run.last_active, reverse=True)


def latest_run(art_dir: str = ART_DIR) -> Run:
    """The most recently active run, or a UserError that says what else to pass."""
    runs = list_runs(art_dir)
    if not runs:
        raise UserError(f"no trained run under {art_dir}/*/models/ (train one with `python train_email_search_agent.py "
                        f"train --demo`), so give --model: base (the untrained model on CPU), a provider/model such "
                        f"as openai/o4-mini, or hosted_vllm/NAME with --base-url.")
    log.info("no --model given: using the most recent run, %s (others: %s)", runs[0].name,
             ", ".join(r.name for r in runs[1:]) or "none")
    return runs[0]


# ---- starting and resuming a run (train) -----------------------------------------------------------

def check_name(flag: str, value: str) -> None:
    """--name and --project become folder names."""
    if not value.strip() or value != value.strip() or "/" in value or value in (".", ".."):
        raise UserError(f"{flag} {value!r}: a run needs a {flag[2:]} that is a plain folder name")


# What a resumed run must keep: the model and its LoRA, the questions it trains and validates on (the seed
# and these settings pick them: changed, validation questions could be trained on), and the episode limits it
# learned and is evaluated with. Rates, steps, rewards and sampling may change between runs.
RESUME_KEEPS = ("base_model", "lora_rank", "lora_alpha", "db", "seed", "val_size", "train_limit", "single_source",
                "min_realistic", *LIMITS)
# Once GRPO has taken a step, what places a resumed run in its data: the step count times another batch size,
# or over another question list, would skip questions or repeat them.
GRPO_KEEPS = ("groups_per_step", "num_epochs", "unanswerable_share")


def saved_config(settings, backend: str) -> dict:
    """What run_config.json holds, from a run's settings (its TrainConfig, base model resolved). The backend and
    episode limits are read back by evaluation and `ask`: a run is served where it was trained and plays the
    episodes it learned on."""
    return {**asdict(settings), "db": str(Path(settings.db).resolve()),  # found from any folder it is evaluated in
            "backend": backend, "episode": {name: getattr(settings, name) for name in LIMITS},
            "offline_grader": GRADER}  # what grades answers without a judge (and when the judge fails)


def check_resumable(directory: Path, config: dict) -> None:
    """A UserError if the run in `directory` was trained with other RESUME_KEEPS than `config`, or other
    GRPO_KEEPS once a GRPO step is logged (keys an older run did not save are not compared)."""
    if not (directory / "run_config.json").exists():
        return
    previous = Run.load(directory).config
    history = directory / "history.jsonl"
    grpo_began = history.is_file() and '"train/reward"' in history.read_text(errors="replace")
    for key in RESUME_KEEPS + (GRPO_KEEPS if grpo_began else ()):
        before, now = previous.get(key), config[key]
        if key == "db" and before is not None:
            before, now = str(Path(before).resolve()), str(Path(now).resolve())
        if key in previous and before != now:
            raise UserError(f"run {directory.name!r} was trained with {as_flag(key, before)}, not {as_flag(key, now)}; "
                            f"pass {as_flag(key, before)} to resume it (--fresh would delete the run and start it "
                            f"over; another --name starts a new run).")




def with_grader_change(directory: Path, config: dict) -> dict:
    """`config`, noting a change of offline grader since the run's GRPO steps began: it is said, and kept in
    run_config.json's `grader_changes` (the step from which the new grader paid the rewards), never mixed
    silently into one curve."""
    previous = Run.load(directory).config
    before, now = previous.get("offline_grader", STRICT_GRADER), config.get("offline_grader")
    changes = list(previous.get("grader_changes", []))
    steps = [int(row["step"]) for row in _history_rows(directory / "history.jsonl") if "train/reward" in row]
    if steps and now and before != now:
        print(f"note: run {directory.name!r}'s GRPO steps up to {max(steps)} were rewarded by the {before}; from step "
              f"{max(steps) + 1} the {now} grades answers graded offline (run_config.json's grader_changes says so)",
              file=sys.stderr)
        changes.append({"from_step": max(steps) + 1, "before": before, "now": now})
    return {**config, "grader_changes": changes} if changes else config


def _history_rows(history: Path) -> list[dict]:
    rows = []
    for line in history.read_text(errors="replace").splitlines() if history.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [row for row in rows if isinstance(row, dict) and "step" in row]


def as_flag(key: str, value) -> str:
    """A config key's value as the `train` flag that sets it (cli.add_dataclass_flags: --max-turns 4; a boolean
    is --single-source or --no-single-source), for a person to paste back into the command."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {shlex.quote(str(value))}"


def start(directory: Path, config: dict, fresh: bool = False, preflight: bool = False) -> None:
    """Resume the run in `directory` (after `check_resumable`), or start it; `fresh` deletes it first. Saves
    `config` (the resolved training config with the backend and episode limits) unless this is a `preflight`,
    which changes nothing a later run or evaluation reads."""
    config_path = directory / "run_config.json"
    if fresh and directory.exists():
        shutil.rmtree(directory)
    if config_path.exists():
        check_resumable(directory, config)
        print(f"resuming run {directory.name!r} from {directory}", file=sys.stderr)
        config = with_grader_change(directory, config)
    if preflight:
        return
    drop_torn_history_line(directory / "history.jsonl")
    directory.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def lock(art_dir: str, project: str, name: str):
    """An exclusive lock on the run's name (a file in `art_dir`: --fresh deletes the run's folder), held until
    the returned file is closed; a UserError if another process holds it: two processes training one run
    would write the same checkpoints and prune each other's."""
    # here, not at the top: fcntl is POSIX-only, and only training locks a run (reading runs works without it)
    import fcntl

    path = Path(art_dir) / f".{project}.{name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held = open(path, "a+")
    except OSError as exc:
        raise UserError(f"--art-dir {art_dir}: runs cannot be kept there ({exc.strerror or exc})") from None
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.seek(0)
        holder = held.read().strip() or "another process"
        held.close()
        raise UserError(f"run {name!r} is being trained by {holder}; wait for it, stop it, or use another --name")
    held.seek(0)
    held.truncate()
    held.write(f"process {os.getpid()}")
    held.flush()
    return held


# What `train` keeps in state.json, and the type each must have.
STATE_FIELDS = {"sft_start_step": int, "sft_steps": int, "sft_done": bool}


def read_state(directory: Path) -> dict:
    """The run's saved progress (empty for a new run); a damaged state.json is a UserError, read before any
    model is loaded."""
    path = directory / "state.json"
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        problem = "not an object" if not isinstance(state, dict) else next(
            (f"{key} is {state[key]!r}, not a{'n' if kind is int else ''} {kind.__name__}"
             for key, kind in STATE_FIELDS.items()
             if key in state and (type(state[key]) is not kind or kind is int and state[key] < 0)), None)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problem = str(exc)
    if problem:
        raise UserError(f"{path} is damaged ({problem}); start run {directory.name!r} over with --fresh, or train "
                        f"under another --name")
    return state


async def check_state(directory: Path, state: dict, model) -> dict:
    """`state` checked against the run's checkpoints (`model`: the registered art.TrainableModel): one that
    says the warm start ended after the latest checkpoint (checkpoints deleted) lets the warm start resume."""
    step = await model.get_step()
    history = directory / "history.jsonl"
    # logged as train/sft_epoch
    warm_started = history.is_file() and 'sft_epoch"' in history.read_text(errors="replace")
    if step and warm_started and not state:
        raise UserError(f"run {directory.name!r} has checkpoints up to step {step} but no state.json, so where its "
                        f"warm start ended is unknown; restore that file, or start over with --fresh")
    if state.get("sft_done") and step < state.get("sft_steps", 0):
        print(f"note: run {directory.name!r}'s checkpoints end at step {step}, before its warm start ended (step "
              f"{state['sft_steps']}): the warm start resumes from step {step}", file=sys.stderr)
        state = model.merge_state({"sft_done": False, "sft_start_step": min(state.get("sft_start_step", 0), step)})
    return state


def drop_torn_history_line(history: Path) -> None:
    """Cut a last line that a killed run left half-written: ART appends the next step's line to it otherwise."""
    if not history.is_file() or history.stat().st_size == 0:
        return
    text = history.read_bytes()
    if not text.endswith(b"\n"):
        history.write_bytes(text[:text.rfind(b"\n") + 1])
        print(f"note: dropped a half-written last line of {history}", file=sys.stderr)


# ---- the disk under a run ---------------------------------------------------------------------------------

_STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                   errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                   errno.EROFS: "the file system is read-only"}


def checkpoint_bytes(directory: Path) -> int:
    """The size of the run's latest checkpoint folder (0 if it has none): what each further step writes."""
    folders = sorted(p for p in (directory / "checkpoints").glob("[0-9]*") if p.is_dir())
    return sum(f.stat().st_size for f in folders[-1].rglob("*") if f.is_file()) if folders else 0


def storage_problem(error: BaseException, directory: Path | None = None) -> str | None:
    """One sentence for a write that failed for lack of space or permission (a checkpoint, the history, a
    report), found anywhere in the exception's chain (safetensors raises its own type, with the OS's message);
    None for any other error."""
    seen, reason, path = error, None, None
    while seen is not None and reason is None:
        if isinstance(seen, OSError) and seen.errno in _STORAGE_ERRNOS:
            reason, path = _STORAGE_ERRNOS[seen.errno], seen.filename
        elif "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            reason = "no space left on the device"
        seen = seen.__cause__ or seen.__context__
    if reason is None:
        return None
    where = Path(path) if path else directory
    sentence = f"could not write {where or 'a file'}: {reason}"
    if directory is not None and directory.exists():
        size = checkpoint_bytes(directory)
        free = shutil.disk_usage(directory).free
        steps = sorted(int(p.name) for p in (directory / "checkpoints").glob("[0-9]*") if p.name.isdigit())
        sentence += (f" ({free / 2**20:,.0f} MB free there; a checkpoint of this run takes about "
                     f"{max(size, 1) / 2**20:,.1f} MB). Free some space (or fix the permissions) and run the same "
                     f"command again: the run resumes from its last complete checkpoint"
                     + (f", step {steps[-1]}" if steps else ""))
    return sentence + "."


def free_space_warning(directory: Path, checkpoints: int = 3) -> str | None:
    """A warning when the run's folder has room for fewer than `checkpoints` more checkpoints."""
    size = checkpoint_bytes(directory)
    if not size:
        return None
    free = shutil.disk_usage(directory).free
    if free >= checkpoints * size:
        return None
    return (f"only {free / 2**20:,.0f} MB free in {directory}, and each checkpoint takes about {size / 2**20:,.1f} "
            f"MB: room for {free // size} more; free some space before a long run")
