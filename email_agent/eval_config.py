"""An evaluation's configuration: the typed `EvalConfig` (one flag of test_email_search_agent.py per field, made by
the same `cli.add_dataclass_flags` as training's, each field declared with its help and the values it allows:
`settings.setting`), the checks that relate two fields, what the flags leave to derive, and `eval_config.json`, saved
beside the report and read back.

Precedence: a flag given on the command line wins over a saved eval_config.json (`--config FILE`), which wins over
the defaults. `--rejudge DIR` plays nothing: what was played (`PLAYED`: the models, the questions and the episode
limits) is read from DIR/eval_config.json and may not be given as a flag; how answers are scored comes from the
command line, as for any evaluation.
"""

from __future__ import annotations

import json
import time
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path

from email_agent import runs, settings
from email_agent.agent.episode import LIMITS, MEANINGS, Episode
from email_agent.agent.rewards import REWARD_MODES
from email_agent.backends import CPU_BASE_MODEL
from email_agent.config import DEFAULT_DB, DEMO_DB
from email_agent.errors import UserError
from email_agent.redact import redact
from email_agent.runs import ART_DIR, PROJECT
from email_agent.settings import setting

EVAL_CONFIG = "eval_config.json"  # beside results.jsonl and the report

_LIMITS_HELP = ("(default: what each trained run was trained with; for base and prompted models the runs' limits if "
                "they share them, else {})")


@dataclass
class EvalConfig:
    # who plays, on which questions
    model: list[str] = setting(
        [], "a trained run (NAME[@STEP|@latest] under --art-dir, or its folder; served by the backend it was trained "
            "on), 'base' (the untrained --base-model on CPU), or a prompted model: openai/o4-mini, hosted_vllm/NAME "
            "with --base-url, any provider/model behind an OpenAI-compatible --base-url. Repeat to compare. Default: "
            "the most recent run.", metavar="SPEC")
    demo: bool = setting(False, f"use the demo database {DEMO_DB}")
    db: str | None = setting(None, f"database (default {DEFAULT_DB}; with --demo {DEMO_DB}; else the one the trained "
                                   f"runs among the models were trained on)", metavar="DB")
    split: str = setting("test", "question split")
    limit: int | None = setting(None, "evaluate the first N questions (after the seeded shuffle)", ge=1)
    single_source: bool = setting(False, "only questions with one gold email")
    seed: int = setting(0, "question order and sampling seed")
    concurrency: int = setting(8, "simultaneous rollouts per model, and the CPU server's decoding batch", ge=1)
    # the episode limits (None: each model's own)
    max_turns: int | None = setting(None, f"{MEANINGS['max_turns']} {_LIMITS_HELP.format(Episode.max_turns)}", ge=1)
    max_tokens: int | None = setting(None, f"{MEANINGS['max_tokens']} {_LIMITS_HELP.format(Episode.max_tokens)}",
                                     ge=1)
    max_body_chars: int | None = setting(
        None, f"{MEANINGS['max_body_chars']} {_LIMITS_HELP.format(Episode.max_body_chars)}", ge=1)
    search_results: int | None = setting(
        None, f"{MEANINGS['search_results']} {_LIMITS_HELP.format(Episode.search_results)}", ge=1)
    # how models are served and asked
    temperature: float = setting(0.0, "sampling temperature (omitted for OpenAI reasoning models)", ge=0, le=2)
    timeout: float = setting(300.0, "seconds per model request", gt=0, finite=True,
                             refusal="is seconds per model request, more than 0;")
    base_url: str | None = setting(None, "OpenAI-compatible endpoint for prompted models (vLLM, litellm proxy, ...)")
    api_key: str | None = setting(None, "key for --base-url (default: OPENAI_API_KEY for openai/, else "
                                        "POLICY_API_KEY)", saved=False)  # a secret: never written to disk
    base_model: str = setting(CPU_BASE_MODEL, "the model behind --model base (bundled for CPU)")
    # how answers are scored
    reward: str | None = setting(None, "scoring: shaped (default with a judge), offline (default without), judge "
                                       "(binary)", choices=REWARD_MODES)
    judge_model: str | None = setting(None, "litellm model name of the LLM judge (or JUDGE_MODEL)")
    judge_base_url: str | None = setting(None, "api_base for the judge, e.g. http://localhost:6688 (or "
                                               "JUDGE_API_BASE; key from JUDGE_API_KEY)")
    grounded_answers: bool = setting(
        False, "withhold answers that name something (a word with a capital or a digit) in no email or search result "
               "the agent saw: they count as \"I don't know\", and the report says how many were withheld and how "
               "many of those were right. Works with --rejudge too")
    rejudge: str | None = setting(None, "re-score DIR/results.jsonl with the judge flags; no model runs",
                                  metavar="DIR")
    # where things go
    output: str | None = setting(None, "output folder (default eval/<timestamp>)", metavar="DIR",
                                 saved=False)  # the folder the saved file is in
    art_dir: str = setting(ART_DIR, "where training runs live")
    wandb: bool = setting(False, "trace rollouts and judge calls with W&B Weave (needs WANDB_API_KEY; tracing is "
                                 "skipped if Weave cannot start)")
    project: str = setting(PROJECT, "W&B project for --wandb")


# What --rejudge reads from the evaluation it re-scores, and refuses as flags: it plays no episode again.
PLAYED = ("model", "limit", "split", "db", "demo", "single_source", *LIMITS)


def load(given: dict, config_file: str | None = None) -> EvalConfig:
    """The evaluation's configuration from the flags `given` on the command line (cli.given_flags) over a saved
    eval_config.json (`config_file`, and what --rejudge played) over the defaults; checked, then derived."""
    check_rejudge(given)
    base = read(Path(config_file)) if config_file else {}
    if given.get("rejudge"):
        played = read(Path(given["rejudge"]) / EVAL_CONFIG, missing_ok=True)  # none in an older evaluation's folder
        base = {**{k: v for k, v in base.items() if k not in PLAYED}, **{k: played[k] for k in PLAYED if k in played}}
    cfg = EvalConfig(**{**base, **given})
    settings.check(cfg)
    repeated = sorted({spec for spec in cfg.model if cfg.model.count(spec) > 1})
    if repeated:
        raise UserError(f"--model {repeated[0]} is given twice: each model is evaluated once per question")
    return derived(cfg)


def check_rejudge(given: dict) -> None:
    """Flags --rejudge would ignore: it re-scores the answers as they are."""
    if not given.get("rejudge"):
        return
    ignored = [f"--{name.replace('_', '-')}" for name in PLAYED if name in given and given[name] is not False
               and not (name == "split" and given[name] == "test")]  # --no-demo asks for what --rejudge does
    if ignored:
        raise UserError(f"--rejudge re-scores the answers in {given['rejudge']} as they are; it runs no model, so "
                        f"{', '.join(ignored)} would change nothing")


def derived(cfg: EvalConfig) -> EvalConfig:
    """What the flags leave open, decided once: the models (the most recent run), the database (the one the trained
    runs among the models were trained on, as `ask` does) and the output folder (eval/<time>)."""
    model = cfg.model or ([] if cfg.rejudge else [str(runs.latest_run(cfg.art_dir).path)])
    db = cfg.db or (DEMO_DB if cfg.demo else runs.trained_db(model, cfg.art_dir) or DEFAULT_DB)
    return replace(cfg, model=model, db=db, output=cfg.output or f"eval/{time.strftime('%Y%m%d-%H%M%S')}")


def read(path: Path, missing_ok: bool = False) -> dict:
    """The settings a saved eval_config.json holds, each of its field's type ({} if there is none and
    `missing_ok`); keys of no field (a later version's) are left out."""
    if missing_ok and not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read as an evaluation's {EVAL_CONFIG} ({exc})") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path} is not an evaluation's {EVAL_CONFIG}: it holds no settings")
    hints = typing.get_type_hints(EvalConfig)
    values = {f.name: saved[f.name] for f in fields(EvalConfig) if f.name in saved and f.metadata["saved"]}
    for name, value in values.items():
        if not _has_type(value, hints[name]):
            raise UserError(f"{path}: {name} is {value!r}, which is not a {hints[name]}")
    return values


def _has_type(value, hint) -> bool:
    expected = settings.kind(hint)
    if value is None:
        return expected is not hint  # an optional field
    if isinstance(value, bool) and expected in (int, float):
        return False
    if expected is float:
        return isinstance(value, (int, float))
    if typing.get_origin(expected) is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, expected)


def save(cfg: EvalConfig, folder: Path) -> Path:
    """eval_config.json in `folder`: every setting but the API key and the folder itself."""
    path = folder / EVAL_CONFIG
    path.write_text(json.dumps(settings.saved(cfg), indent=2) + "\n", encoding="utf-8")
    return path


def opening_line(cfg: EvalConfig) -> str:
    """The settings that are not the defaults, as the flags that give them (every setting: eval_config.json)."""
    default = EvalConfig()
    flags = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if not f.metadata["saved"] or value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [f"{flag} {v}" for v in (value if isinstance(value, list) else [value])]
    return redact(f"settings: {' '.join(flags) or 'the defaults'} (all of them: {Path(cfg.output) / EVAL_CONFIG})")
