"""README.md stays a newcomer's page: short, pointing at real files, with the CI's own test
command, and free of the commit hashes that belong in git history."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 200


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _section(heading: str) -> str:
    """The text under the `## heading` of README, up to the next `## ` heading."""
    lines = _readme().splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().lower() == f"## {heading}".lower()]
    assert len(starts) == 1, f'README needs exactly one "## {heading}" section, found {len(starts)}'
    body = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("## "):
            break
        body.append(line)
    return "\n".join(body)


def _commands(section: str) -> list[str]:
    """The command lines of the section's ```bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", section, re.S):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(command.strip())
    return commands


def _ci_command() -> str:
    """The last command line of .ci/run: what CI runs after its setup lines."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    return commands[-1]


def _words(command: str, drop: tuple[str, ...] = ()) -> list[str]:
    return [word for word in shlex.split(command) if word not in drop]


def test_readme_is_at_most_200_lines():
    lines = _readme().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_where_things_live_names_existing_paths():
    section = _section("Where things live")
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 2, "the section holds a table"
    paths = [path for row in rows[2:] for path in re.findall(r"`([^`]+)`", row.split("|")[2])]
    assert len(paths) >= 8, paths
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"README's 'Where things live' names paths that do not exist: {missing}"
    # The table covers what a newcomer looks for first.
    table = "\n".join(rows).lower()
    for topic in ("memory_decoding", "lookahead", "tree sizing", "w8a8", "batching", "device engine",
                  "mindie", "protos"):
        assert topic in table, f"'Where things live' lacks {topic!r}"


def test_readme_test_command_is_what_ci_runs():
    commands = _commands(_section("The two commands"))
    assert len(commands) == 2, commands
    readme_test = commands[1]
    ci = _ci_command()
    assert "pytest" in readme_test and "pytest" in ci
    # CI only quiets pip (-q); otherwise the two are the same command, word for word.
    assert _words(readme_test) == _words(ci, drop=("-q",)), (readme_test, ci)
    # And the README's command with -q put back after every `pip install` is CI's line exactly.
    assert re.sub(r"\bpip install (?!-q )", "pip install -q ", readme_test) == ci, (readme_test, ci)


def test_readme_has_no_commit_hashes():
    hashes = re.findall(r"`([0-9a-f]{7,40})`", _readme())
    assert not hashes, f"README.md quotes commit hashes {hashes}: history belongs in git"
