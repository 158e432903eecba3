"""What the two command-line scripts share: log lines on stderr (and no library warning noise), SIGTERM as Ctrl-C,
arguments checked as text, and flags made from a config dataclass.

Library modules only log (`logging.getLogger(__name__)`) and never touch signals; the scripts call these
first, so the library stays usable from a notebook or another program as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sqlite3
import sys
import time
import typing
import warnings
from collections.abc import Callable
from dataclasses import MISSING, fields

from email_agent.data.email_db import DEMO_DB
from email_agent import settings
from email_agent.errors import UserError
from email_agent.runs import storage_problem

PLAIN_PROGRESS_S = 30  # seconds between progress lines when stderr is a file or a CI log


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest and callers may swap it after set-up)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def log_to_stderr(level: int = logging.INFO) -> None:
    """The package's log records as `[module] message` lines on stderr (idempotent; the last level wins)."""
    # litellm's response objects trip pydantic's serializer checks on every call: harmless, not the user's problem.
    warnings.filterwarnings("ignore", message="Pydantic serializer warnings", category=UserWarning)
    package = logging.getLogger("email_agent")
    package.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in package.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[%(module)s] %(message)s"))
        package.addHandler(handler)


class _PlainProgress:
    """sys.stderr for a log file: a progress bar's redraws (a carriage return, then the bar) become a plain line at
    most every PLAIN_PROGRESS_S seconds, and the bar's last state when it closes. tqdm's own `mininterval` cannot do
    this alone: ART's gather bar redraws itself through `set_postfix` after every rollout, which ignores it."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._pending = ""  # the latest frame not yet written
        self._written_at = float("-inf")

    def write(self, text: str) -> int:
        if text.startswith("\r"):
            self._pending = text.strip()
            if self._pending and time.monotonic() - self._written_at >= PLAIN_PROGRESS_S:
                self._flush_frame()
            return len(text)
        if text.startswith("\n") and self._pending:  # the bar closes: its final state
            self._flush_frame()
            text = text[1:]
        return self._stream.write(text) if text else 0

    def _flush_frame(self) -> None:
        self._stream.write(self._pending + "\n")
        self._stream.flush()
        self._pending, self._written_at = "", time.monotonic()

    def __getattr__(self, name):
        return getattr(self._stream, name)


_bars_hidden_by_quiet = False


def console(quiet: bool = False, verbose: bool = False) -> None:
    """What every subcommand prints on stderr. --quiet: warnings and errors only, no progress bars; --verbose:
    debug records too. When stderr is not a terminal (a log file, CI) progress bars print a plain line every
    PLAIN_PROGRESS_S seconds instead of redrawing themselves."""
    global _bars_hidden_by_quiet
    log_to_stderr(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    # numpy 2 on ART 0.5.18's packer: a notice for its authors, not for users
    warnings.filterwarnings("ignore", message="__array_wrap__ must accept context", category=DeprecationWarning)
    if quiet:
        _bars_hidden_by_quiet = _bars_hidden_by_quiet or "TQDM_DISABLE" not in os.environ
        os.environ["TQDM_DISABLE"] = "1"  # tqdm reads its defaults from TQDM_* variables
        return
    if _bars_hidden_by_quiet:  # a command run earlier in this process (bench, a test) with --quiet
        os.environ.pop("TQDM_DISABLE", None)
        _bars_hidden_by_quiet = False
    if not sys.stderr.isatty() and not isinstance(sys.stderr, _PlainProgress):
        os.environ.setdefault("TQDM_MININTERVAL", str(PLAIN_PROGRESS_S))
        sys.stderr = _PlainProgress(sys.stderr)


def stop_on_sigterm() -> None:
    """`kill` stops a command the way Ctrl-C does: it unwinds, so nothing is left half-written."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


def check_text_arguments(argv: list[str]) -> None:
    """An argument that is not UTF-8 (typed in a Latin-1 terminal, say) is one error, not a traceback where it is
    first written or sent (Python keeps such bytes as lone surrogates)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise UserError(f"the argument '{shown}' is not UTF-8 text; retype it in a UTF-8 terminal") from None


def add_dataclass_flags(parser, cls) -> None:
    """One flag per field of the dataclass `cls` (`--max-turns` for max_turns), each defaulting to None so that
    only flags given on the command line override (a preset, a saved config, the field's default); its help is the
    field's declared help (`settings.setting`), its default and the values it allows."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = settings.kind(hints[f.name])
        allowed = settings.allowed(f)
        default = ("" if kind is bool or f.default in ("", None, MISSING) else  # "", None: the help says what
                   f"default {f.default!r}")
        said = "; ".join(filter(None, (default, allowed if not f.metadata.get("choices") else "")))
        help_text = f.metadata.get("help", "") + (f" ({said})" if said else "")
        help_text = help_text.replace("%", "%%")  # argparse %-formats help text: "10% warm-up" would crash --help
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{help_text} (default: {'on' if f.default else 'off'})")
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, action="append", default=None, metavar=f.metadata.get("metavar"),
                                help=help_text)
        else:
            choices = f.metadata.get("choices")
            metavar = "{" + ",".join(choices) + "}" if choices else f.metadata.get("metavar") or f.name.upper()
            parser.add_argument(flag, type=kind, default=None, metavar=metavar, help=help_text)


def given_flags(args: argparse.Namespace, cls) -> dict:
    """The fields of `cls` given on the command line (those `add_dataclass_flags` made, not None)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}


def show_switch_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: on)" or "(default: off)" to the help of every on/off flag of `parser` and its subcommands
    that does not say its default yet: a bare switch's default is otherwise nowhere in --help."""
    switches = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_switch_defaults(subparser)
        elif isinstance(action, switches) and action.help not in (None, argparse.SUPPRESS) \
                and "(default" not in action.help:
            action.help += f" (default: {'on' if action.default else 'off'})"


def add_db_flags(parser, default: str | None, help: str) -> None:
    """--db PATH, or --demo for the demo inbox's database (one or the other): what every command reading a
    database takes."""
    either = parser.add_mutually_exclusive_group()
    either.add_argument("--db", default=default, metavar="PATH", help=help)
    either.add_argument("--demo", dest="db", action="store_const", const=DEMO_DB,
                        help=f"the demo inbox (build-db --demo): --db {DEMO_DB}")


def run_cancellable(coroutine) -> None:
    """Run a training coroutine until done; Ctrl-C and SIGTERM end it like KeyboardInterrupt: the current step is
    abandoned and the backend shut down by the coroutine's own `finally`."""
    # here, not at the top: rollout imports ART (torch, seconds), and both scripts import this module for --help
    from email_agent.agent.rollout import IN_FLIGHT

    loop = asyncio.new_event_loop()
    task = loop.create_task(coroutine)

    def stop() -> None:
        # ART's gather counts a cancelled rollout as a failed one and goes on with the others, so cancelling the
        # run alone would wait for the whole step's rollouts: the rollouts in flight are cancelled too.
        task.cancel()
        for rollout_task in list(IN_FLIGHT):
            rollout_task.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    loop.add_signal_handler(signal.SIGINT, stop)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        loop.close()


def console_flags():
    """The parent parser of every subcommand's --quiet and --verbose."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_mutually_exclusive_group()
    group.add_argument("--quiet", action="store_true", help="warnings and errors only; no progress bars")
    group.add_argument("--verbose", action="store_true", help="debug messages too")
    return parent


def print_progress(line: str, *, to_stderr: bool = False) -> None:
    """A line of a long command's progress, flushed at once (a pipe or a log file would hold it back): on stdout,
    or on stderr for what is not the run's figures (`to_stderr`)."""
    print(line, file=sys.stderr if to_stderr else sys.stdout, flush=True)


def run_command(command, argv: list[str] | None, *, interrupted: str | Callable[[], str] = "interrupted",
                run_folder=lambda: None) -> int:
    """Run a subcommand as every command of both scripts ends: a one-sentence error and exit code 1 for a bad
    input, a damaged database or a full or read-only disk (`run_folder()`: the run being written, if any); 130
    after Ctrl-C or SIGTERM with `interrupted` (or what it returns) said; anything else is a bug and raises."""
    stop_on_sigterm()
    try:
        check_text_arguments(argv if argv is not None else sys.argv[1:])
        return command() or 0
    except UserError as exc:
        print(f"Error: {exc}", file=sys.stderr)
    except sqlite3.DatabaseError as exc:  # damaged after it was opened (a disk error, a half-copied file)
        print(f"Error: the database could not be read ({exc}); if it is damaged, rebuild it with build-db",
              file=sys.stderr)
    except KeyboardInterrupt:
        print(interrupted() if callable(interrupted) else interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except Exception as exc:
        if (problem := storage_problem(exc, run_folder())) is None:
            raise
        print(f"Error: {problem}", file=sys.stderr)
    return 1
