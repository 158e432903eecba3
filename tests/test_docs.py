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
