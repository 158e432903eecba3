"""Settings declared where their field is declared (email_agent/settings.py): the values each allows refuse others in
one sentence, and --help of both scripts shows each default and the values allowed."""

import argparse
import math
from dataclasses import MISSING, fields, replace

import pytest

import test_email_search_agent as evaluate_cli
import train_email_search_agent as train_cli
from email_agent import settings
from email_agent.config import TrainConfig
from email_agent.errors import UserError
from email_agent.eval_config import EvalConfig

CONFIGS = [(TrainConfig, "train"), (EvalConfig, "evaluation")]


def declared(cls):
    return [f for f in fields(cls) if any(f.metadata.get(k) is not None for k in ("ge", "gt", "le", "lt"))
            or f.metadata.get("choices")]


def outside(f):
    """Values just outside what field `f` declares (and nan, for a number)."""
    m = f.metadata
    if m["choices"]:
        return ["nonsense"]
    values = [math.nan] if "float" in f.type else []
    if m["ge"] is not None:
        values.append(m["ge"] - 1)
    if m["gt"] is not None:
        values.append(m["gt"])
    if m["le"] is not None:
        values.append(m["le"] + 1)
    if m["lt"] is not None:
        values.append(m["lt"])
    return values


@pytest.mark.parametrize("cls, script", CONFIGS)
def test_a_value_outside_a_declared_range_or_choice_is_refused_in_one_sentence(cls, script):
    fields_ = declared(cls)
    assert len(fields_) >= (25 if cls is TrainConfig else 7)
    for f in fields_:
        flag = "--" + f.name.replace("_", "-")
        for value in outside(f):
            with pytest.raises(UserError) as refused:
                settings.check(replace(cls(), **{f.name: value}))
            sentence = str(refused.value)
            shown = repr(value) if isinstance(value, str) else str(value)
            assert sentence.startswith(f"{flag} ") and sentence.endswith(f" not {shown}"), sentence
            assert "\n" not in sentence and sentence.count(". ") == 0, sentence
        m = f.metadata
        for edge in (m["ge"], m["le"], *m["choices"]):  # the bounds a field includes are allowed
            if edge is not None:
                settings.check(replace(cls(), **{f.name: edge}))
    settings.check(cls())  # every default is allowed


def test_the_asserted_refusals_keep_their_words():
    """What users were told before the constraints moved onto the fields."""
    cases = [(TrainConfig, "gpu_memory_utilization", 80.0, "--gpu-memory-utilization is a share of the GPU's memory, "
                                                            "above 0 and at most 1, not 80.0"),
             (TrainConfig, "unanswerable_share", 1.0, "--unanswerable-share must be at least 0 and below 1, not 1.0"),
             (TrainConfig, "advantage_balance", 2.0, "--advantage-balance must be between -1 and 1, not 2.0"),
             (TrainConfig, "sft_schedule", "cos", "--sft-schedule is constant, linear or cosine, not 'cos'"),
             (TrainConfig, "keep_checkpoints", "some", "--keep-checkpoints is best or all, not 'some'"),
             (TrainConfig, "learning_rate", math.inf, "--learning-rate must be above 0, not inf"),
             (EvalConfig, "timeout", math.nan, "--timeout is seconds per model request, more than 0; not nan"),
             (EvalConfig, "temperature", 2.5, "--temperature must be between 0 and 2, not 2.5"),
             (EvalConfig, "reward", "rlhf", "--reward is offline, shaped, judge or ruler, not 'rlhf'")]
    for cls, name, value, sentence in cases:
        with pytest.raises(UserError) as refused:
            settings.check(replace(cls(), **{name: value}))
        assert str(refused.value) == sentence


def helps(parser: argparse.ArgumentParser) -> dict:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("cls, script", CONFIGS)
def test_help_shows_each_default_and_the_values_allowed(cls, script):
    parser = evaluate_cli.make_parser() if cls is EvalConfig else next(
        a for a in train_cli.make_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    actions = helps(parser)
    text = parser.format_help()
    for f in fields(cls):
        action = actions["--" + f.name.replace("_", "-")]
        assert action.default is None  # only flags given override a preset or a saved config
        if f.type == "bool":
            assert f"(default: {'on' if f.default else 'off'})" in action.help
        elif f.default not in ("", None, MISSING):  # MISSING: a list, whose help says what it defaults to
            assert f"default {f.default!r}" in action.help, (f.name, action.help)
        if f.metadata.get("choices"):
            assert action.metavar == "{" + ",".join(f.metadata["choices"]) + "}"
            assert action.metavar in text
        elif settings.allowed(f):
            assert settings.allowed(f) in action.help, (f.name, action.help)
    assert f"(default {cls().concurrency}; at least 1)" in actions["--concurrency"].help


def test_a_flag_not_given_leaves_the_config_s_value():
    """The parsers give None for every flag not on the command line, so a preset or a saved config fills it."""
    from email_agent import cli

    args = evaluate_cli.make_parser().parse_args(["--limit", "3", "--no-grounded-answers", "--model", "a",
                                                  "--model", "b"])
    assert cli.given_flags(args, EvalConfig) == {"limit": 3, "grounded_answers": False, "model": ["a", "b"]}
