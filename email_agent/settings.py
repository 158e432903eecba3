"""A setting: one field of a config dataclass (`TrainConfig`, `EvalConfig`) declared with its one-line help and the
values it allows (a type, choices, a range), so that `--help` (cli.add_dataclass_flags) and the check of a config
(`check`) read the same declaration. A check that relates two fields stays a hand-written one beside its config.

Why the standard library (`dataclasses.field(metadata=...)`) and not pydantic or tyro: a refusal here must be the
project's one sentence (`--timeout is seconds per model request, more than 0; not nan`), which pydantic's errors
are not, so its constraints would be read back and reworded anyway; pydantic is only an indirect dependency of the
CPU install (openai's, unpinned in requirements.txt), costs 0.2 s on every `--help`, and its dataclasses validate
at construction and put their FieldInfo in `dataclasses.fields()`. tyro (not installed) builds a parser of its own,
while the training flags are one subcommand of an argparse parser and must keep their names, --no- forms and
None-until-given defaults (a preset, or a saved eval_config.json, fills what was not given).
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import Field, field, fields

from email_agent.errors import UserError


def setting(default, help: str, *, choices: tuple = (), ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, finite: bool = False, refusal: str = "",
            metavar: str | None = None, saved: bool = True):
    """A dataclass field with its help text and the values it allows: one of `choices`, or a number within
    ge/gt/le/lt (and `finite`: not inf or nan). `refusal` replaces the words between the flag and "not VALUE" in
    the sentence refusing a value; `saved=False` keeps it out of a saved config (a key, the output folder)."""
    metadata = dict(help=help, choices=tuple(choices), ge=ge, gt=gt, le=le, lt=lt, finite=finite, refusal=refusal,
                    metavar=metavar, saved=saved)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def allowed(f: Field) -> str:
    """The values field `f` allows, in words ("at least 1", "between -1 and 1", "best or all"); "" for any."""
    m = f.metadata
    if m.get("choices"):
        *rest, last = m["choices"]
        return f"{', '.join(rest)} or {last}" if rest else last
    low = (f"at least {m['ge']:g}" if m.get("ge") is not None else
           f"above {m['gt']:g}" if m.get("gt") is not None else "")
    high = (f"at most {m['le']:g}" if m.get("le") is not None else
            f"below {m['lt']:g}" if m.get("lt") is not None else "")
    if low.startswith("at least") and high.startswith("at most"):
        return f"between {m['ge']:g} and {m['le']:g}"
    return " and ".join(filter(None, (low, high)))


def refusal(f: Field, value) -> str | None:
    """The sentence refusing `value` for field `f` (named as its flag), or None if the field allows it. None, the
    value of a field not given, is allowed."""
    m = f.metadata
    if value is None or not m:
        return None
    flag = "--" + f.name.replace("_", "-")
    if m["choices"]:
        if value in m["choices"]:
            return None
        return f"{flag} {m['refusal'] or f'is {allowed(f)},'} not {value!r}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None  # a type the parser ensured; a saved file's is checked where it is read
    within = ((m["ge"] is None or value >= m["ge"]) and (m["gt"] is None or value > m["gt"])  # NaN fails each
              and (m["le"] is None or value <= m["le"]) and (m["lt"] is None or value < m["lt"])
              and (not m["finite"] or math.isfinite(value)))
    if within:
        return None
    return f"{flag} {m['refusal'] or f'must be {allowed(f)},'} not {value}"


def kind(hint):
    """The type a field's annotation allows besides None: int for `int | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def check(cfg) -> None:
    """Refuse, in one sentence, the first field of `cfg` whose value its declaration does not allow."""
    for f in fields(cfg):
        if (sentence := refusal(f, getattr(cfg, f.name))) is not None:
            raise UserError(sentence)


def saved(cfg) -> dict:
    """The fields of `cfg` a saved config holds (not those declared saved=False)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata.get("saved", True)}
