"""Every `pyml` command that README.md and docs/ show is one the CLI accepts, and the ones that run
in moments here are run as a reader would paste them.

A command in a code block is parsed by the CLI's own parser (the command exists, every option and
argument is accepted, choices and numbers are valid); one quoted in the prose (`pyml eval --model
DIR --data FILE`, usage lines with [optional] parts) names a command that exists and options it
has. Code blocks made only of commands that need no model and no compilation (init, gen, check,
prove, cache, --help, --version) are run in a scratch folder, line by line as a shell would."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer.main

from pyml.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI = typer.main.get_command(app)
# commands that need no model, no data and no compiled kernels: run where a block holds only these
QUICK = {"init", "gen", "check", "prove", "cache", "--help", "-h", "--version"}


@dataclass(frozen=True)
class Shown:
    where: str  # file:line
    words: tuple[str, ...]  # after `pyml`

    def __str__(self) -> str:
        return f"{self.where}: pyml {shlex.join(self.words)}"


def code_blocks(path: Path):
    """(first line number, lines) of each fenced block that is shell, not Python, TOML or JSON;
    fences may be indented (in a list), and so are their lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    block, start, language, indent = None, 0, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if block is None:
                indent = len(line) - len(line.lstrip())
                block, start, language = [], number + 1, line.strip()[3:].strip()
            else:
                if language in ("", "sh", "bash", "console", "shell"):
                    yield start, block
                block = None
        elif block is not None:
            block.append(line[indent:])


def console_steps(block: list[str]) -> list[tuple[str, list[str]]]:
    """(command line, output shown after it): a block with `$ ` prompts shows output after each;
    one without shows commands only."""
    if not any(line.startswith("$ ") for line in block):
        return [(line, []) for _, line in joined_lines(block) if line.strip()]
    steps = []
    for line in block:
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and line.strip():
            steps[-1][1].append(line)
    return steps


def commands_in(line: str) -> list[list[str]]:
    """The `pyml` commands of one shell line (`a && b` is two), each without `pyml`."""
    line = line.strip().removeprefix("$ ")
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    commands, current = [], None
    for word in words:
        if word in ("&&", "||", ";", "|"):
            current = None
        elif current is None and word == "pyml":
            current = []
            commands.append(current)
        elif current is not None:
            current.append(word)
    return commands


def joined_lines(block: list[str]):
    """(offset, line) of a block's lines, a line ending in `\\` joined with the next."""
    pending, offset = "", 0
    for index, line in enumerate(block):
        if not pending:
            offset = index
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield offset, pending + line
        pending = ""


def shown_in_blocks() -> list[Shown]:
    shown = []
    for path in DOCUMENTS:
        for start, block in code_blocks(path):
            for offset, line in joined_lines(block):
                if any(row.startswith("$ ") for row in block) and not line.startswith("$ "):
                    continue  # output shown in a console block
                for words in commands_in(line):
                    shown.append(Shown(f"{path.relative_to(ROOT)}:{start + offset}", tuple(words)))
    return shown


def quoted_in_prose() -> list[Shown]:
    shown = []
    for path in DOCUMENTS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`(pyml(?: [^`]*)?)`", line):
                words = span.replace("\\|", "|").split()[1:]
                shown.append(Shown(f"{path.relative_to(ROOT)}:{number}", tuple(words)))
    return shown


def is_group(command) -> bool:
    return hasattr(command, "commands")  # a click group (typer vendors its own click)


def resolve(words: tuple[str, ...]):
    """The click command `words` name (through groups) and the words left for it."""
    command, rest = CLI, list(words)
    while is_group(command) and rest and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    return command, rest


def option_names(command) -> set[str]:
    names = {"--help", "-h"}
    for parameter in command.params:
        names.update(getattr(parameter, "opts", ()))
        names.update(getattr(parameter, "secondary_opts", ()))
    return names


BLOCK_COMMANDS = shown_in_blocks()
PROSE_COMMANDS = quoted_in_prose()


def test_the_documents_show_commands():
    assert len(BLOCK_COMMANDS) >= 20 and len(PROSE_COMMANDS) >= 50


@pytest.mark.parametrize("shown", BLOCK_COMMANDS, ids=str)
def test_a_command_in_a_code_block_is_accepted_by_the_cli(shown):
    command, rest = resolve(shown.words)
    if "--help" in rest or "-h" in rest or "--version" in rest:
        return
    assert not is_group(command), f"{shown}: names no command"
    try:
        command.make_context(f"pyml {command.name}", list(rest))
    except Exception as error:
        if not hasattr(error, "format_message"):  # not a usage error: a bug of the test's
            raise
        pytest.fail(f"{shown}: {error.format_message()}")


@pytest.mark.parametrize("shown", PROSE_COMMANDS, ids=str)
def test_a_command_quoted_in_the_prose_names_a_command_and_its_options(shown):
    command, rest = resolve(shown.words)
    if not rest or rest[0] == "COMMAND":  # `pyml COMMAND --help`: any command
        return
    if not rest[0].startswith(("-", "[", ".")) and is_group(command):
        pytest.fail(f"{shown}: no command {rest[0]!r}")
    known = option_names(command)
    for word in rest:
        for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", word):
            assert option in known, f"{shown}: {command.name} has no option {option}"


def quick_blocks():
    for path in DOCUMENTS:
        for start, block in code_blocks(path):
            steps = console_steps(block)
            commands = [words for line, _ in steps for words in commands_in(line)]
            if commands and all(words and words[0] in QUICK for words in commands):
                yield pytest.param(steps, id=f"{path.relative_to(ROOT)}:{start}")


@pytest.mark.parametrize("steps", list(quick_blocks()))
def test_a_block_of_quick_commands_runs_as_pasted(steps, tmp_path):
    """Each line through one shell, in order, in a folder holding a copy of this checkout's specs/
    (which the documents name); a `cd` carries over. A line succeeds, or fails as the document
    shows (its `error:` line), or is `pyml prove` where no Lean is installed (one line, status 1);
    the output a document shows appears as shown."""
    folder = tmp_path / "reader"
    shutil.copytree(ROOT / "specs", folder / "specs")
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                        "PYML_CACHE": str(tmp_path / "cache")}
    marker = "__pyml_doc_step__"
    # each line alone on its line, so that its comment ends there
    script = "\n".join(f"echo {marker} >&2; echo {marker}\n{line}\necho {marker}$? >&2"
                       for line, _ in steps)
    run = subprocess.run(["bash", "-c", script], cwd=folder, env=env, capture_output=True,
                         text=True, timeout=300)
    outputs = run.stdout.split(marker + "\n")[1:]
    errors = run.stderr.split(marker + "\n")[1:]
    assert len(outputs) == len(errors) == len(steps), run.stderr
    for (line, shown), output, error in zip(steps, outputs, errors):
        found = re.search(rf"{marker}(\d+)\n?$", error)
        assert found, f"{line}: no status\n{error}"
        status, error = int(found.group(1)), error[:found.start()]
        assert "Traceback" not in error, f"{line}:\n{error}"
        for expected in shown:
            assert expected.strip() in output + error, f"{line}: the document shows {expected!r}\ngot {output + error}"
        no_lean = commands_in(line)[-1][:1] == ["prove"] and shutil.which("lake", path=env["PATH"]) is None
        if any(expected.startswith("error:") for expected in shown):
            assert status == 2, f"{line}: status {status}"
        elif no_lean:
            assert status == 1 and len(error.strip().splitlines()) == 1, f"{line}: {status}\n{error}"
        else:
            assert status == 0, f"{line}: status {status}\n{error}"
