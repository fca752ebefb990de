"""Finding the ``psserver`` command lines in deploy files and parsing them with the real CLI.

Shell text (scripts, README code blocks): backslash continuations are joined, comments
dropped, ``${VAR:-default}`` becomes its default, variables the script assigns become their
value, any other ``$VAR`` / ``${VAR}`` / ``$(VAR)`` (Kubernetes) a dummy ``1``; a command is
the ``psserver VERB ...`` part of a line (after ``srun ...`` or ``torchrun ... -m``) up to the
first shell operator. YAML: every ``command``/``args`` list that runs psserver.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DUMMY = "1"
SHELL_OPERATORS = {"&", "&&", "||", ";", "|", ">", ">>", "<", "2>", "2>&1", ")", "("}

_DEFAULT = re.compile(r"\$\{(\w+):?-([^{}]*)\}")
_BRACED = re.compile(r"\$\{(\w+)\}")
_PAREN = re.compile(r"\$\((\w+)\)")  # Kubernetes $(VAR), not $(command args)
_PLAIN = re.compile(r"\$(\w+)")
_OTHER = re.compile(r"\$\{[^{}]*\}")  # ${#ARRAY[@]}, ${NODES[0]}, ...
WRAPPERS = {"srun", "torchrun", "exec", "env", "nohup", "timeout", "time", "sudo"}
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=(\S+)\s*(?:#.*)?$")


@dataclass
class Command:
    source: str
    """Where it was found (file, and line or YAML path)."""
    argv: list[str]
    """Arguments after ``psserver`` (the verb first)."""

    def __str__(self) -> str:
        return f"{self.source}: psserver {shlex.join(self.argv)}"


def substitute(text: str, variables: dict[str, str] | None = None) -> str:
    variables = variables or {}
    for _ in range(5):  # defaults may themselves hold variables
        new = _DEFAULT.sub(lambda m: variables.get(m.group(1), m.group(2)), text)
        if new == text:
            break
        text = new
    text = _BRACED.sub(lambda m: variables.get(m.group(1), DUMMY), text)
    text = _PAREN.sub(lambda m: variables.get(m.group(1), DUMMY), text)
    text = _OTHER.sub(DUMMY, text)
    return _PLAIN.sub(lambda m: variables.get(m.group(1), DUMMY), text)


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined and comment lines dropped."""
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = n
            if line.lstrip().startswith("#"):
                continue
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        yield start, " ".join(part.strip() for part in buf)
        buf = []
    if buf:
        yield start, " ".join(part.strip() for part in buf)


def script_variables(text: str) -> dict[str, str]:
    """Top-level ``NAME=value`` assignments of a script, resolved to their defaults."""
    out: dict[str, str] = {}
    for _, line in logical_lines(text):
        m = _ASSIGN.match(line.strip())
        if m and not m.group(2).startswith("("):
            value = substitute(m.group(2), out)
            try:
                words = shlex.split(value)
            except ValueError:
                continue
            if len(words) == 1:
                out[m.group(1)] = words[0]
    return out


def commands_in_shell(text: str, source: str) -> list[Command]:
    variables = script_variables(text)
    found = []
    for n, line in logical_lines(text):
        if "psserver" not in line:
            continue
        lexer = shlex.shlex(substitute(line, variables), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        for i, tok in enumerate(tokens[:-1]):
            if tok != "psserver" or tokens[i + 1].startswith("-") or tokens[i + 1] in SHELL_OPERATORS:
                continue
            if not _starts_command(tokens[i - 1] if i else None):
                continue  # e.g. the value of `kubectl -n psserver`
            argv = []
            for t in tokens[i + 1:]:
                if t in SHELL_OPERATORS:
                    break
                argv.append(t)
            found.append(Command(f"{source}:{n}", argv))
    return found


def _starts_command(prev: str | None) -> bool:
    """Whether ``psserver`` after ``prev`` is a command (not an option's value)."""
    if prev is None or prev in SHELL_OPERATORS or prev in WRAPPERS or prev == "-m":
        return True
    if prev.startswith("--"):
        return "=" in prev  # srun --opt=value psserver ...
    return not prev.startswith("-")  # a wrapper's positional (e.g. timeout 60 psserver ...)


def fenced_blocks(markdown: str) -> Iterator[tuple[int, str]]:
    """(line number of the block, text) of every fenced code block."""
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(```+|~~~+)", lines[i])
        if m:
            fence = m.group(1)
            body = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j])
                j += 1
            yield i + 1, "\n".join(body)
            i = j + 1
        else:
            i += 1


def commands_in_markdown(path: Path) -> list[Command]:
    found = []
    for n, block in fenced_blocks(path.read_text()):
        for c in commands_in_shell(block, f"{path.relative_to(ROOT)}@block{n}"):
            found.append(c)
    return found


def load_yaml(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _walk(node: Any, where: str) -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        yield where, node
        for k, v in node.items():
            yield from _walk(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{where}[{i}]")


def argv_of(container: dict, entrypoint_is_psserver: bool) -> list[str] | None:
    """psserver arguments of a container / compose service / trainer spec, or None."""
    command = container.get("command")
    args = container.get("args") or []
    if isinstance(command, str):
        command = shlex.split(command)
    if command is None and "args" not in container:
        return None
    full = [*(command or []), *args]
    full = [substitute(str(a)) for a in full]
    if "psserver" in full:
        i = full.index("psserver")
        return full[i + 1:]
    if entrypoint_is_psserver and command is not None and not container.get("entrypoint"):
        return full  # compose: the image's entry point is psserver
    return None


def commands_in_yaml(path: Path) -> list[Command]:
    found = []
    compose = path.name.startswith("compose")
    for d, doc in enumerate(load_yaml(path)):
        for where, node in _walk(doc, f"doc{d}"):
            if not isinstance(node.get("command", node.get("args")), (list, str)):
                continue
            argv = argv_of(node, entrypoint_is_psserver=compose)
            if argv is not None:
                found.append(Command(f"{path.relative_to(ROOT)}:{where}", argv))
    return found


def all_commands() -> list[Command]:
    cmds: list[Command] = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        cmds += commands_in_yaml(path)
    for path in sorted(DEPLOY.rglob("*.sbatch")) + sorted(DEPLOY.rglob("*.sh")):
        cmds += commands_in_shell(path.read_text(), str(path.relative_to(ROOT)))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(DEPLOY.rglob("*.md"))]:
        if path.is_file():
            cmds += commands_in_markdown(path)
    return cmds


def parse(argv: list[str]):
    """Parse with the real CLI; returns the namespace or raises AssertionError with the error."""
    import contextlib
    import io

    from psserver.cli import build_parser

    parser, _ = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"rejected (exit {e.code}): {err.getvalue().strip()}") from None


def option(argv: list[str], flag: str) -> str | None:
    """Value of ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``)."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
