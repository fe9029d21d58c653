"""Every `deltalab ...`, `python -m ...` and `torchrun ... -m` command in the docs names a real subcommand or module.

The commands are read from README.md, CONTRIBUTING.md, docs/*.md, kernels/**/*.md and store/*.md: fenced
code blocks line by line and inline code spans, outside HTML comments. A `deltalab` command is walked down the
CLI's command tree (its words up to the first option, argument or placeholder) and must name at least one
subcommand, which then answers `--help` with exit code 0. A `python -m` module must be importable by name
(`importlib.util.find_spec`); a placeholder segment (`deltalab.probes.NAME`) checks the package before it.
Nothing heavy runs.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "CONTRIBUTING.md", "docs/*.md", "kernels/**/*.md", "store/*.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+?)`")  # a span may wrap onto the next line, as Markdown allows
COMMENT = re.compile(r"<!--.*?-->", re.S)  # marked rows for features not built yet


def _is_placeholder(word: str) -> bool:
    return word in ("...", "…") or (word.isupper() and len(word) > 1) or word.startswith(("[", "<", "{"))


def _command_lines(text: str) -> list[str]:
    """Candidate command lines: each line of a fenced block (comments cut), and each inline code span."""
    text = COMMENT.sub("", text)
    lines = []
    for block in FENCE.findall(text):
        lines += [re.split(r"\s#\s", line)[0].strip().lstrip("$ ") for line in block.splitlines()]
    for span in INLINE.findall(FENCE.sub("", text)):
        lines.append(" ".join(span.split()))
    starts = ("deltalab ", "python -m ", "torchrun ")
    return [line for line in lines if line.startswith(starts) or " python -m " in line]


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:  # an unbalanced quote in prose: split on blanks
        return line.split()


def doc_commands() -> list[tuple[str, str]]:
    """(document, command line) for every command the documents show, in order, without repeats."""
    seen, out = set(), []
    for pattern in DOCS:
        for path in sorted(ROOT.glob(pattern)):
            for line in _command_lines(path.read_text(encoding="utf-8")):
                if line not in seen:
                    seen.add(line)
                    out.append((str(path.relative_to(ROOT)), line))
    return out


COMMANDS = doc_commands()
CLI = [(doc, line) for doc, line in COMMANDS if line.startswith("deltalab ")]
MODULES = [(doc, w[i + 1]) for doc, line in COMMANDS if not line.startswith("deltalab ")
           for w in [_words(line)] for i in range(1, len(w) - 1)
           if w[i] == "-m" and (w[i - 1].endswith("python") or w[0] == "torchrun")]


def _cli_group():
    import typer

    from deltalab.app.cli import app

    return typer.main.get_command(app)


def subcommand_path(group, words: list[str]) -> list[str]:
    """The words of `deltalab WORDS...` that name nested subcommands, walked down click's command tree."""
    path, cmd = [], group
    for word in words:
        commands = getattr(cmd, "commands", None)
        if not commands or word not in commands:
            break
        path.append(word)
        cmd = commands[word]
    return path


def test_the_documents_show_commands():
    """Guards the walk itself: the README alone shows the quick start's commands and a benchmark module."""
    readme = [line for doc, line in CLI if doc == "README.md"]
    assert len(readme) >= 10
    assert any(line.startswith("deltalab capture ") for line in readme)
    assert any(mod.startswith("benchmarks.") for _, mod in MODULES)


def test_the_walk_stops_at_arguments_and_refuses_unknown_subcommands():
    group = _cli_group()
    assert subcommand_path(group, ["probe", "spectra", "--store", "s.zarr"]) == ["probe", "spectra"]
    assert subcommand_path(group, ["store", "info", "s4.zarr"]) == ["store", "info"]
    assert subcommand_path(group, ["capture", "models/zoo/x"]) == ["capture"]
    assert subcommand_path(group, ["probe", "bench"]) == ["probe"]  # a removed probe is not a subcommand
    assert subcommand_path(group, ["frobnicate"]) == []


@pytest.mark.parametrize(("doc", "line"), CLI, ids=[line[:60] for _, line in CLI])
def test_deltalab_command_names_a_real_subcommand(doc, line):
    from typer.testing import CliRunner

    from deltalab.app.cli import app

    words = _words(line)[1:]
    if not words or _is_placeholder(words[0]):
        pytest.skip(f"{doc}: `{line}` is a placeholder, not a command")  # e.g. `deltalab COMMAND --help`
    path = [] if words[0].startswith("-") else subcommand_path(_cli_group(), words)  # `deltalab --help`: the root
    assert path or words[0].startswith("-"), f"{doc}: `{line}`: {words[0]!r} is not a deltalab subcommand"
    nxt = words[len(path)] if len(words) > len(path) else ""
    group = _cli_group()
    for word in path:
        group = group.commands[word]
    if getattr(group, "commands", None) and nxt and not nxt.startswith("-") and not _is_placeholder(nxt):
        pytest.fail(f"{doc}: `{line}`: {nxt!r} is not a subcommand of `deltalab {' '.join(path)}`")
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, f"{doc}: `deltalab {' '.join(path)} --help` exited {result.exit_code}"


@pytest.mark.parametrize(("doc", "module"), MODULES, ids=[m for _, m in MODULES])
def test_python_m_module_exists(doc, module):
    parts = module.split(".")
    known = []
    for part in parts:
        if _is_placeholder(part):
            break
        known.append(part)
    assert known, f"{doc}: `python -m {module}` names no module"
    name = ".".join(known)
    assert importlib.util.find_spec(name) is not None, f"{doc}: `python -m {module}`: no module {name}"
