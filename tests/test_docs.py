"""The README and docs/ as a user reads them: every command they show parses with the scripts' own parsers, so a
renamed or removed flag fails here instead of in a user's terminal; the README stays a guide, not a notebook."""

import re
import shlex

import pytest

from conftest import ROOT

import test_email_search_agent as evaluate_cli
import train_email_search_agent as cli

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = {"train_email_search_agent.py": cli.make_parser, "test_email_search_agent.py": evaluate_cli.make_parser}


def shown_commands(page):
    """(line, argv) of each script command in the page's code blocks (continued lines joined; lines with shell
    variables or elisions left out: they are not commands as typed)."""
    text = page.read_text()
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" #", 1)[0].strip()
            if "$" in command or "..." in command or not any(script in command for script in SCRIPTS):
                continue  # shell variables, elisions and printed output are not commands as typed
            words = shlex.split(command)
            for i, word in enumerate(words):
                if word.endswith(tuple(SCRIPTS)) and i > 0 and words[i - 1].endswith("python"):
                    yield line.strip(), word.rsplit("/", 1)[-1], words[i + 1:]


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


def test_the_readme_is_a_guide_of_at_most_300_lines():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+)", readme):
        assert (ROOT / link).exists(), link


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
        "The demo preset's {steps_word} GRPO steps ({groups} groups of {rollouts} rollouts each, Dr. GRPO advantages, "
        "a wrong answer costing {penalty}, sampled at {temperature})",
        "after {steps} GRPO steps (`@{final}`)",
        "in the CPU preset's {turns})",
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


def test_gpu_smoke_and_bench_vllm_say_the_presets_step_and_shape():
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_smoke
    figures = preset_figures()
    plan = flat(gpu_smoke.PLAN.format(model="m", steps=2, questions=30, groups=figures["groups"],
                                      rollouts=figures["rollouts"], turns=figures["turns"]))
    assert flat("2 GRPO steps of {groups} groups x {rollouts} rollouts (up to {turns} turns".format(**figures)) in plan
    assert not re.search(r"\d+ min", plan + gpu_smoke.__doc__), "gpu_smoke gives a time no GPU has measured"
    # bench_vllm's GRPO step is the preset's of 2026-12-02 on purpose (its figures stay comparable); its episode
    # shape is the preset's
    source = (ROOT / "bench" / "bench_vllm.py").read_text()
    assert ("SHAPE = Episode(max_turns={turns}, max_tokens={tokens}, max_body_chars={body}, search_results={results})"
            .format(**figures)) in source
    assert "in the demo preset's episode shape ({turns} turns, {tokens} tokens, {results} results, {body}-character" \
        .format(**figures) in source


def test_the_evaluation_help_names_the_files_it_writes():
    from email_agent.evaluation.report import OUTPUT_FILES
    named = set(re.findall(r"\b[\w-]+\.(?:jsonl|json|html|md)\b", evaluate_cli.__doc__))
    assert named and named <= set(OUTPUT_FILES), named - set(OUTPUT_FILES)
