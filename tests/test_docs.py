"""The README and docs/ as a user reads them: every command their code blocks show parses with the real parsers
(the two scripts', each bench script's own argparse, the Makefile's targets and variables), so a renamed or removed
flag, target or variable fails here instead of in a user's terminal; the README stays a guide, not a notebook."""

import argparse
import re
import runpy
import shlex
import sys

import pytest

from conftest import ROOT

import test_email_search_agent as evaluate_cli
import train_email_search_agent as cli

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = {"train_email_search_agent.py": cli.make_parser, "test_email_search_agent.py": evaluate_cli.make_parser}
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
SAMPLE_VALUE = "x"  # what a shell variable the block does not define stands for


def code_blocks(text: str):
    """The text of each fenced code block in a shell language (```bash, ```sh or a bare ```), fences indented
    inside list items included; other languages (```json) and the prose between blocks are not commands."""
    language, lines = None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*(\w*)\s*$", line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence:
            if language in SHELL_LANGUAGES:
                yield "\n".join(lines) + "\n"
            language = None
        elif language is not None:
            lines.append(line)


ASSIGNMENT = re.compile(r"^[ \t]*(?:export[ \t]+)?([A-Za-z_]\w*)=(?:\"([^\"]*)\"|'([^']*)'|(\S*))[^\n]*$", re.M)


def assignments(block: str) -> dict[str, str]:
    """The shell variables a block sets (`RUN="--name qwen7b ..."`, across lines when quoted), whitespace folded."""
    return {m.group(1): " ".join((m.group(2) or m.group(3) or m.group(4) or "").split())
            for m in ASSIGNMENT.finditer(block)}


def substitute(command: str, variables: dict[str, str]) -> str:
    """Shell variables replaced as the shell would: by the value the block gave them, else by a sample value;
    command substitutions `$(...)` by the sample value."""
    command = re.sub(r"\$\([^)]*\)", SAMPLE_VALUE, command)
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: variables.get(m.group(1), SAMPLE_VALUE), command)


def shown_lines(page):
    """(line as shown, command with its variables substituted) of each line of the page's shell code blocks:
    continued lines joined, comments dropped, the block's own assignments substituted; lines with an elision
    ('...') left out: they are not commands as typed."""
    for block in code_blocks(page.read_text()):
        variables = assignments(block)
        for line in ASSIGNMENT.sub("", block).replace("\\\n", " ").splitlines():
            command = line.split(" #", 1)[0].strip()
            if not command or command.startswith("#") or "..." in command:
                continue
            yield line.strip(), substitute(command, variables)


def shown_commands(page):
    """(line, script, argv) of each script command in the page's code blocks, whatever python runs it (`python`,
    `.venv/bin/python`, `.venv-gpu/bin/python`)."""
    for line, command in shown_lines(page):
        if not any(script in command for script in SCRIPTS):
            continue
        words = shlex.split(command)
        for i, word in enumerate(words):
            if word.endswith(tuple(SCRIPTS)) and i > 0 and words[i - 1].endswith("python"):
                yield line, word.rsplit("/", 1)[-1], words[i + 1:]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page):
    commands = list(shown_commands(page))
    for line, script, argv in commands:
        try:
            SCRIPTS[script]().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.name}: `{line}` does not parse")
    if page.name == "README.md":
        assert len(commands) >= 20


def test_shell_variables_are_substituted_not_skipped():
    block = 'RUN="--name qwen7b\n     --max-steps 500"\npython train_email_search_agent.py train $RUN --preflight\n'
    assert substitute("train $RUN --inbox \"$INBOX\" --token \"$(cat t)\"", assignments(block)) == \
        'train --name qwen7b --max-steps 500 --inbox "x" --token "x"'
    page_text = "```bash\n" + block + "```\n```json\n{\"a\": 1}\n```\nprose train_email_search_agent.py\n"
    assert list(code_blocks(page_text)) == [block]


# ---- bench scripts: each command shown parses with the script's own argparse ----------------------------------

BENCH = ROOT / "bench"
PARSE_ARGS = argparse.ArgumentParser.parse_args  # the real one, before any test patches it


class Parsed(Exception):
    """Raised right after a bench script's parser has read the shown arguments: nothing of the bench runs."""


def bench_parse(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """Run bench/SCRIPT as __main__ with ArgumentParser.parse_args reading `argv`, stopped once it has: every bench
    builds its parser before it does anything (in main(), parse_args() or its __main__ block)."""
    def parse_then_stop(parser, args=None, namespace=None):
        raise Parsed(PARSE_ARGS(parser, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *argv])
    try:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    except Parsed as parsed:
        return parsed.args[0]
    raise AssertionError(f"bench/{script} ran without parsing its arguments")


def shown_bench_commands():
    """(page, line, script, argv) of every `python bench/X.py ...` in the pages' code blocks."""
    for page in PAGES:
        for line, command in shown_lines(page):
            if not re.search(r"python\S* +(?:\./)?bench/", command):
                continue  # printed output and other commands (shlex would choke on an apostrophe in prose)
            words = shlex.split(command)
            for i, word in enumerate(words):
                match = re.fullmatch(r"(?:\./)?bench/(\w+\.py)", word)
                if match and i > 0 and words[i - 1].endswith("python"):
                    yield page.name, line, match.group(1), words[i + 1:]


BENCH_COMMANDS = list(shown_bench_commands())


@pytest.mark.parametrize("page, line, script, argv", BENCH_COMMANDS, ids=[f"{p}:{s}" for p, _, s, _ in BENCH_COMMANDS])
def test_every_bench_command_shown_parses(page, line, script, argv, monkeypatch):
    assert (BENCH / script).is_file(), f"{page}: `{line}`: no bench/{script}"
    try:
        bench_parse(script, argv, monkeypatch)
    except SystemExit as stop:  # --help exits 0; a flag or value the parser refuses exits 2
        assert stop.code in (0, None), f"{page}: `{line}` does not parse"


def test_the_bench_parser_check_catches_a_wrong_flag(monkeypatch):
    assert bench_parse("bench_enron.py", ["--seeds", "0", "1"], monkeypatch).seeds == [0, 1]
    with pytest.raises(SystemExit):
        bench_parse("bench_enron.py", ["--seeds", "zero"], monkeypatch)
    with pytest.raises(SystemExit):
        bench_parse("gpu_smoke.py", ["--no-such-flag"], monkeypatch)


def test_the_pages_show_bench_commands():
    assert {script for _, _, script, _ in BENCH_COMMANDS} >= {"bench_enron.py", "bench_learning.py", "bench_vllm.py"}


# ---- make: every target shown exists, every VAR=value is a variable the Makefile uses --------------------------

def makefile_targets_and_variables() -> tuple[set[str], set[str]]:
    """The Makefile's rule names (.PHONY's included) and the variables it sets or reads, with the environment
    variables its recipes' scripts read (scripts/check_machine.py's FORCE)."""
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for line in text.splitlines():
        rule = re.match(r"^([^\s#=:][^=:]*?)\s*:(?![=:])", line)
        if rule:
            names = rule.group(1).split()
            targets |= {n for n in names if "$" not in n and n != ".PHONY"}
            if names == [".PHONY"]:
                targets |= set(line.split(":", 1)[1].split("#")[0].split())
    variables = set(re.findall(r"^([A-Za-z_]\w*)\s*(?:\?=|:=|\+=|=)", text, re.M))
    variables |= set(re.findall(r"(?<!\$)\$\(([A-Za-z_]\w*)\)", text))  # not $$(shell commands)
    variables |= set(re.findall(r"environ\.get\(\"(\w+)\"", (ROOT / "scripts" / "check_machine.py").read_text()))
    return targets, variables


def shown_make_commands():
    """(page, shown, argv after `make`) of every make command: in code blocks (each `&&`/`;` part starting with
    `make`) and in inline code (`make demo SEED=1`)."""
    for page in PAGES:
        shown = [command for _, command in shown_lines(page)]
        shown += [span for span in re.findall(r"`(make(?: [^`]*)?)`", page.read_text())]
        for command in shown:
            for part in re.split(r"&&|;|\|\|", command):
                if re.match(r"make(?: |$)", part.strip()):
                    yield page.name, part.strip(), shlex.split(part.strip())[1:]


MAKE_COMMANDS = list(shown_make_commands())


def test_every_make_command_shown_exists():
    targets, variables = makefile_targets_and_variables()
    assert {"demo", "test", "enron", "setup-gpu", "gpu-smoke"} <= targets
    assert {"SEED", "ENRON", "PYTHON", "TORCH_INDEX", "FORCE"} <= variables
    for page, shown, argv in MAKE_COMMANDS:
        for word in argv:
            if "=" in word:
                name = word.split("=", 1)[0]
                assert name in variables, f"{page}: `{shown}`: the Makefile uses no variable {name}"
            else:
                assert word in targets, f"{page}: `{shown}`: the Makefile has no target {word!r}"
    assert any(page == "README.md" and argv[:1] == ["enron"] for page, _, argv in MAKE_COMMANDS)


# ---- the README: a guide of at most 200 lines, no commit or run ids ----------------------------------------

README = ROOT / "README.md"


def test_the_readme_is_a_guide_of_at_most_200_lines():
    readme = README.read_text()
    assert len(readme.splitlines()) <= 200
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+|LICENSE)", readme):
        assert (ROOT / link).exists(), link


def commit_ids(text: str) -> list[str]:
    """Words that look like a git sha: 7-40 lowercase hex characters, digits and letters both."""
    return [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]


def run_ids(text: str) -> list[str]:
    """Named runs of the history ("run S4", "runs F-W", "run T08", "demo-seed1"): they belong in bench/RESULTS.md."""
    named = re.findall(r"\bruns? [A-Z][A-Z0-9]*(?:[-–][A-Z0-9]+)?\b", text)
    return named + re.findall(r"\bdemo-seed\d+\b", text)


def test_the_readme_names_no_commit_and_no_run():
    readme = README.read_text()
    assert not commit_ids(readme), commit_ids(readme)
    assert not run_ids(readme), run_ids(readme)


def test_the_id_checks_catch_ids():
    assert commit_ids("the code of 8fd4a36 and a8f78a9, not 0.5.18, cafebabe or 1234567") == ["8fd4a36", "a8f78a9"]
    assert run_ids("run S4, runs F-W, run T08, make demo-seed1; a run on 2 cores") == [
        "run S4", "runs F-W", "run T08", "demo-seed1"]


def test_every_docs_page_links_back_and_exists():
    for page in PAGES[1:]:
        assert "](../README.md)" in page.read_text(), page.name
        for link in re.findall(r"\]\(\.\./([^)#]+)", page.read_text()):
            assert (ROOT / link).exists(), f"{page.name}: {link}"


# The demo preset's figures as the pages and the benches' --help quote them: a preset changed without its pages
# (or a page that describes an old preset as the current one) fails here.
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def preset_figures() -> dict:
    from email_agent.config import DEMO_PRESET as p
    return dict(steps=p["max_steps"], steps_word=NUMBER_WORDS[p["max_steps"]], groups=p["groups_per_step"],
                rollouts=p["rollouts_per_group"], at_once=p["concurrency"], penalty=f"{p['hallucination_penalty']:g}",
                temperature=f"{p['temperature']:g}", turns=p["max_turns"], tokens=p["max_tokens"],
                body=p["max_body_chars"], results=p["search_results"], warm=p["sft_epochs"],
                final=p["sft_epochs"] + p["max_steps"], val=p["val_size"])


PRESET_QUOTES = {  # page -> what it says of the preset, with the preset's figures as {fields}
    "README.md": [
        "then {steps} small GRPO steps (step {final})",
        "`demo@{warm}`, the warm start",
        "`demo@{final}`, after {steps} GRPO steps",
        "the demo preset's {steps_word} GRPO steps ({groups} groups of {rollouts} rollouts each, Dr. GRPO advantages, "
        "a wrong answer costing {penalty}, sampled at {temperature})",
    ],
    "docs/agent-and-rewards.md": [
        "The demo preset (`--demo`) charges {penalty} for a wrong answer",
        "samples at {temperature} (ART: 1;",
        "in {steps_word} steps of {groups} groups x {rollouts} rollouts",
        "Only the demo preset samples at {temperature}",
        "{penalty} in the demo preset",
    ],
    "docs/training.md": [
        "CPU preset's values ({groups} groups x {rollouts} rollouts of at most {turns} turns of {tokens} tokens, all "
        "{at_once} sent at once)",
        "one step's rollouts must play (the demo preset's {at_once} at once)",
        "two GRPO steps of the demo preset's {groups} groups x {rollouts} rollouts ({at_once} at once, up to {turns} "
        "turns each)",
    ],
    "docs/development.md": [
        "then {steps_word} GRPO steps of {groups} groups x {rollouts} rollouts, a wrong answer costing {penalty}, "
        "sampled at {temperature}",
        "its warm start then its {steps_word} GRPO steps",
        "{steps_word} steps long, samples at {temperature}",
        "final `demo@{final}`",
        "after {steps} GRPO steps (`@{final}`)",
    ],
    "docs/evaluation.md": ["(the demo run: {turns} turns, {tokens} tokens per reply, {body} body characters, "
                           "{results} results)"],
    "docs/cpu-backend.md": ["the demo preset's step then ({groups} x {rollouts} at {temperature} now)"],
    "docs/data.md": ["the CPU preset's {turns} turns"],
}


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("page", sorted(PRESET_QUOTES))
def test_the_pages_quote_the_demo_preset_as_it_is(page):
    text, figures = flat((ROOT / page).read_text()), preset_figures()
    for quote in PRESET_QUOTES[page]:
        said = flat(quote.format(**figures))
        assert said in text, f"{page} no longer says {said!r}: update it to config.DEMO_PRESET"


def test_every_figure_called_the_presets_is_one():
    """"the preset's 1.5" anywhere a user or developer reads (pages, the benches' help, the scripts) must be a value
    DEMO_PRESET holds: a stale penalty, temperature or step count called the preset's is caught wherever it is."""
    from email_agent.config import DEMO_PRESET
    values = {float(v) for v in DEMO_PRESET.values() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    files = [*PAGES, *sorted((ROOT / "bench").glob("*.py")), *sorted(ROOT.glob("*.py"))]
    for path in files:
        for number in re.findall(r"preset'?s (\d+(?:\.\d+)?(?:e-?\d+)?)\b", path.read_text()):
            assert float(number) in values, f"{path.name}: \"preset's {number}\" is not a value of DEMO_PRESET"


def test_bench_learning_help_gives_the_presets_figures():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_learning.py"), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    text, figures = flat(out), preset_figures()
    for quote in ("{steps} GRPO steps of {groups} groups x {rollouts} rollouts",
                  "a wrong answer costing {penalty} (1.5 until run F125), sampled at {temperature}",
                  "validation on {val} questions", "with --demo-preset the preset's {penalty}",
                  "the preset's {groups} groups of {rollouts}"):
        assert flat(quote.format(**figures)) in text, quote


def test_gpu_smoke_and_bench_vllm_say_the_presets_step_and_limits():
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_smoke
    figures = preset_figures()
    plan = flat(gpu_smoke.PLAN.format(model="m", steps=2, questions=30, groups=figures["groups"],
                                      rollouts=figures["rollouts"], turns=figures["turns"]))
    assert flat("2 GRPO steps of {groups} groups x {rollouts} rollouts (up to {turns} turns".format(**figures)) in plan
    assert not re.search(r"\d+ min", plan + gpu_smoke.__doc__), "gpu_smoke gives a time no GPU has measured"
    # bench_vllm's GRPO step is the preset's of 2026-12-02 on purpose (its figures stay comparable); its episode
    # limits are the preset's
    source = (ROOT / "bench" / "bench_vllm.py").read_text()
    assert ("LIMITS = Episode(max_turns={turns}, max_tokens={tokens}, max_body_chars={body}, search_results={results})"
            .format(**figures)) in source
    assert ("with the demo preset's episode limits ({turns} turns, {tokens} tokens, {results} results, "
            "{body}-character").format(**figures) in source


def test_the_evaluation_help_names_the_files_it_writes():
    from email_agent.evaluation.report import OUTPUT_FILES
    named = set(re.findall(r"\b[\w-]+\.(?:jsonl|json|html|md)\b", evaluate_cli.__doc__))
    assert named and named <= set(OUTPUT_FILES), named - set(OUTPUT_FILES)


def gpu_sequence() -> list[list[str]]:
    """The README's GPU sequence as argv lists (`.venv-gpu/bin/python SCRIPT ...`), its variables substituted."""
    readme = ROOT / "README.md"
    block = next(b for b in code_blocks(readme.read_text()) if ".venv-gpu/bin/python" in b)
    variables = assignments(block)
    commands = []
    for line in ASSIGNMENT.sub("", block).replace("\\\n", " ").splitlines():
        command = substitute(line.split(" #", 1)[0].strip(), variables)
        if command.startswith(".venv-gpu/bin/python "):
            commands.append(shlex.split(command)[1:])
    return commands


@pytest.mark.slow
def test_the_gpu_sequence_on_a_machine_without_gpu_key_or_database_is_one_sentence_each(tmp_path):
    """Each command of the README's GPU sequence, typed here (no GPU, no judge key, no database, no run, no
    network to Hugging Face): it stops with one sentence, no traceback, and writes nothing."""
    import os
    import subprocess

    commands = gpu_sequence()
    assert [c[1] for c in commands if c[0] == "train_email_search_agent.py"][:3] == ["build-db", "inboxes", "train"]
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    environ.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    for argv in commands:
        done = subprocess.run([sys.executable, str(ROOT / argv[0]), *argv[1:]], cwd=tmp_path, env=environ,
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        said = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
        assert done.returncode != 0 and "Traceback" not in done.stderr and len(said) == 1, (argv, done.stderr[-2000:])
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], [".art"], ["data"], [".art", "data"])
    assert not list(tmp_path.glob("data/*.db")) and not list(tmp_path.glob(".art/*/models/*"))


# ---- --help as a user reads it ---------------------------------------------------------------------------

def switches(parser: argparse.ArgumentParser, command: str = ""):
    """(subcommand, flag, help) of every on/off flag of a parser and of its subcommands."""
    kinds = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from switches(sub, name)
        elif isinstance(action, kinds):
            yield command, action.option_strings[0], action.help


def test_every_switch_says_its_default_in_help():
    """A bare switch's default was nowhere in --help: --single-source is on for training and off for the
    evaluation. Training's are checked against TrainConfig (its flags default to None in the parser)."""
    from dataclasses import fields

    from email_agent.config import TrainConfig

    said = {}
    for script, make_parser in SCRIPTS.items():
        for command, flag, text in switches(make_parser()):
            default = re.search(r"\(default: (on|off)\)", text or "")
            assert default, f"{script} {command} {flag}: {text!r}"
            said[(command or "evaluation", flag)] = default.group(1)
    for f in fields(TrainConfig):
        if f.type == "bool":
            assert said[("train", "--" + f.name.replace("_", "-"))] == ("on" if f.default else "off")
    assert said[("train", "--single-source")] == "on" and said[("evaluation", "--single-source")] == "off"
    assert said[("serve", "--grounded-answers")] == "on" and said[("ask", "--grounded-answers")] == "off"


def test_train_help_names_the_base_model_the_code_picks_for_each_card():
    """`--base-model`'s help said 7B on a GPU, while the code picks the largest model that fits the card."""
    from email_agent.backends import readiness
    from email_agent.config import TrainConfig

    train = next(a for a in cli.make_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    text = next(a.help for a in train._actions if "--base-model" in a.option_strings)
    claims = re.findall(r"(\d+(?:\.\d+)?B): (\d+)(?:-(\d+))? GB", text)
    assert [c[0] for c in claims] == ["7B", "14B"], text
    cfg = TrainConfig()
    for size, low, high in claims:
        for card in filter(None, (low, high)):
            picked = readiness.default_local_model(readiness.CARD_GIB[int(card)], max_seq_length=cfg.max_seq_length,
                                                   gpu_memory_utilization=cfg.gpu_memory_utilization,
                                                   enforce_eager=cfg.enforce_eager)
            assert picked == f"Qwen/Qwen2.5-{size}-Instruct", (card, picked)
