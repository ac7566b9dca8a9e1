"""The front door: README.md, BENCHMARKS.md and the docs they link must say what works.

Checked: the README's two commands verbatim (CI runs the second, ``.ci/run``) and its length;
every relative link and anchor resolves; every ``tools/...`` path named exists; every
``relay COMMAND`` named is a command, and each ``--flag`` given to it is one its ``--help``
lists; each benchmark section of BENCHMARKS.md has the command that reproduces it and a date.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from relay import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCS = [README, BENCHMARKS, ROOT / "configs" / "README.md", ROOT / "generators" / "README.md",
        ROOT / "learner" / "README.md", ROOT / "tools" / "relay" / "README.md",
        ROOT / "transport" / "README.md"]
TWO_COMMANDS = ("tools/with-venv python tools/launch-cluster.py",
                "tools/with-venv python -m pytest")
MAX_README_LINES = 300

LINK = re.compile(r"\]\(([^)\s]+)\)")
TOOLS_PATH = re.compile(r"\btools/[\w./-]+\.py\b")
RELAY_COMMAND = re.compile(r"(?:^|`|\$ )relay ([a-z-]+)((?: [^`\n]*)?)", re.MULTILINE)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # no '#' comments
    return {github_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_readme_keeps_its_two_commands_verbatim_in_a_code_block() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    lines = {line.split("#")[0].strip() for block in blocks for line in block.splitlines()}
    for command in TWO_COMMANDS:
        assert command in lines, f"README.md lost the command {command!r}"


def test_the_readme_is_short() -> None:
    count = len(README.read_text().splitlines())
    assert count <= MAX_README_LINES, f"README.md has {count} lines; move reference to a doc"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(ROOT)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tools_path_named_exists(doc: Path) -> None:
    missing = sorted({p for p in TOOLS_PATH.findall(doc.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names missing files: {missing}"


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return out.getvalue()


def test_every_relay_command_and_flag_in_the_readme_exists() -> None:
    problems, helps = [], {}
    for name, rest in RELAY_COMMAND.findall(README.read_text()):
        if name not in cli.COMMANDS:
            problems.append(f"`relay {name}` is no command")
            continue
        flags = set(FLAG.findall(rest)) - {"--help"}
        if not flags:
            continue
        words = rest.split()
        argv = [name] + ([words[0]] if name == "prepare-data" and words else [])
        key = " ".join(argv)
        if key not in helps:
            helps[key] = help_text(argv)
        problems += [f"`relay {key}` has no {flag}" for flag in sorted(flags)
                     if not re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[key])]
    assert not problems, "; ".join(problems)


def test_each_benchmark_has_its_command_and_date() -> None:
    sections = re.split(r"^## ", BENCHMARKS.read_text(), flags=re.MULTILINE)[1:]
    assert len(sections) >= 8, "BENCHMARKS.md lost sections"
    for section in sections:
        title = section.splitlines()[0]
        assert "```bash\n" in section, f"BENCHMARKS.md, {title}: no command that reproduces it"
        assert DATE.search(section), f"BENCHMARKS.md, {title}: no date"
